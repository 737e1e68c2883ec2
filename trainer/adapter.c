/* PEFT adapter directories in and out. */
#define _POSIX_C_SOURCE 200809L
#include "adapter.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "safetensors.h"

typedef struct fetch_ctx {
    model_t *m;
    param_t **params;
} fetch_ctx;

static int fetch_lora(void *vctx, size_t i, void *buf, sp_err *err)
{
    fetch_ctx *c = vctx;
    model_param_download(c->m, c->params[i], buf);
    return be_check(c->m->be, err);
}

static json_t *adapter_config(const model_t *m, const char *base)
{
    json_t *targets = json_array();
    /* PEFT writes target_modules sorted */
    const char *sorted[] = {"down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                            "v_proj"};
    for (int i = 0; i < PROJ_COUNT; i++)
        for (int p = 0; p < PROJ_COUNT; p++)
            if ((m->o.lora_targets & (1 << p)) && strcmp(config_target_names[p], sorted[i]) == 0)
                json_array_append_new(targets, json_string(sorted[i]));
    double alpha = m->o.lora_alpha;
    json_t *jalpha = alpha == floor(alpha) && fabs(alpha) < 1e15 ? json_integer((json_int_t)alpha)
                                                                 : json_real(alpha);
    json_t *o = json_object();
    json_object_set_new(o, "peft_type", json_string("LORA"));
    json_object_set_new(o, "task_type", json_string("CAUSAL_LM"));
    json_object_set_new(o, "base_model_name_or_path", base ? json_string(base) : json_null());
    json_object_set_new(o, "revision", json_null());
    json_object_set_new(o, "r", json_integer(m->o.lora_r));
    json_object_set_new(o, "lora_alpha", jalpha);
    json_object_set_new(o, "lora_dropout", json_real(m->o.lora_dropout));
    json_object_set_new(o, "target_modules", targets);
    json_object_set_new(o, "bias", json_string("none"));
    json_object_set_new(o, "use_rslora", json_boolean(m->o.rslora));
    json_object_set_new(o, "use_dora", json_false());
    json_object_set_new(o, "fan_in_fan_out", json_false());
    json_object_set_new(o, "inference_mode", json_true());
    json_object_set_new(o, "init_lora_weights", json_true());
    json_object_set_new(o, "modules_to_save", json_null());
    json_object_set_new(o, "layers_to_transform", json_null());
    json_object_set_new(o, "layers_pattern", json_null());
    json_object_set_new(o, "rank_pattern", json_object());
    json_object_set_new(o, "alpha_pattern", json_object());
    json_object_set_new(o, "megatron_config", json_null());
    json_object_set_new(o, "megatron_core", json_string("megatron.core"));
    json_object_set_new(o, "loftq_config", json_object());
    json_object_set_new(o, "layer_replication", json_null());
    return o;
}

int adapter_save(model_t *m, const char *dir, const char *base_model_path, sp_err *err)
{
    if (m->o.mode != MODE_LORA)
        return sp_fail(err, SP_EXIT_OTHER, "adapter_save: the model has no LoRA adapters");
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot create: %s", dir, strerror(errno));
    st_entry *e = calloc((size_t)m->nparams, sizeof *e);
    param_t **ps = calloc((size_t)m->nparams, sizeof *ps);
    if (!e || !ps) {
        free(e);
        free(ps);
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    }
    size_t n = 0;
    for (int i = 0; i < m->nparams; i++) {
        param_t *p = &m->params[i];
        if (p->kind != PK_LORA_A && p->kind != PK_LORA_B)
            continue;
        e[n] = (st_entry){p->name, DT_F32, 2, {p->shape[0], p->shape[1]}, NULL};
        ps[n++] = p;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
    const char *meta[] = {"format", "pt"};
    fetch_ctx ctx = {m, ps};
    int rc = st_write_fetch(path, e, n, meta, 1, fetch_lora, &ctx, err);
    free(e);
    free(ps);
    if (rc)
        return rc;
    json_t *cfg = adapter_config(m, base_model_path);
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    rc = json_dump_file(cfg, tmp, JSON_INDENT(2) | JSON_SORT_KEYS);
    json_decref(cfg);
    if (rc || rename(tmp, path) != 0)
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot write", path);
    return 0;
}

static int check_config(const model_t *m, const char *dir, sp_err *err)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    json_error_t je;
    json_t *c = json_load_file(path, 0, &je);
    if (!c)
        return sp_fail(err, SP_EXIT_INPUT, "%s: %s", path, je.text);
    int rc = 0;
    json_t *r = json_object_get(c, "r"), *a = json_object_get(c, "lora_alpha");
    json_t *rs = json_object_get(c, "use_rslora"), *tm = json_object_get(c, "target_modules");
    if (!json_is_integer(r) || json_integer_value(r) != m->o.lora_r)
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: r differs from lora.r = %lld", path,
                     (long long)m->o.lora_r);
    else if (!json_is_number(a) || fabs(json_number_value(a) - m->o.lora_alpha) > 1e-9)
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: lora_alpha differs from lora.alpha = %g", path,
                     m->o.lora_alpha);
    else if (!!json_is_true(rs) != !!m->o.rslora)
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: use_rslora differs from lora.rslora", path);
    else if (!json_is_array(tm))
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: target_modules must be a list", path);
    if (!rc) {
        int64_t bits = 0;
        size_t i;
        json_t *v;
        json_array_foreach(tm, i, v) for (int p = 0; p < PROJ_COUNT; p++) if (
            json_is_string(v) && strcmp(json_string_value(v), config_target_names[p]) == 0) bits |=
            1 << p;
        if (bits != m->o.lora_targets)
            rc = sp_fail(err, SP_EXIT_INPUT, "%s: target_modules differ from lora.targets", path);
    }
    json_decref(c);
    return rc;
}

int adapter_load(model_t *m, const char *dir, sp_err *err)
{
    if (check_config(m, dir, err))
        return err->code;
    char path[4096];
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
    st_file f;
    int rc = st_open(&f, path, err);
    for (int i = 0; i < m->nparams && !rc; i++) {
        param_t *p = &m->params[i];
        if (p->kind != PK_LORA_A && p->kind != PK_LORA_B)
            continue;
        const st_tensor *t = st_find(&f, p->name);
        if (!t)
            rc = sp_fail(err, SP_EXIT_INPUT, "%s: tensor '%s' is missing", path, p->name);
        else if (t->ndim != 2 || t->shape[0] != p->shape[0] || t->shape[1] != p->shape[1])
            rc = sp_fail(err, SP_EXIT_INPUT, "%s: tensor '%s' has the wrong shape", path,
                         p->name);
        else if (t->dt != DT_F32 && t->dt != DT_BF16 && t->dt != DT_F16)
            rc = sp_fail(err, SP_EXIT_INPUT, "%s: tensor '%s' has dtype %s", path, p->name,
                         dtype_name(t->dt));
        else
            model_param_upload(m, p, t->data, t->dt);
    }
    st_close(&f);
    return rc ? rc : be_check(m->be, err);
}
