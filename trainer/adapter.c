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

static json_t *adapter_config(const model_opts *o, const char *base)
{
    json_t *targets = json_array();
    /* PEFT writes target_modules sorted */
    const char *sorted[] = {"down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                            "v_proj"};
    for (int i = 0; i < PROJ_COUNT; i++)
        for (int p = 0; p < PROJ_COUNT; p++)
            if ((o->lora_targets & (1 << p)) && strcmp(config_target_names[p], sorted[i]) == 0)
                json_array_append_new(targets, json_string(sorted[i]));
    double alpha = o->lora_alpha;
    json_t *jalpha = alpha == floor(alpha) && fabs(alpha) < 1e15 ? json_integer((json_int_t)alpha)
                                                                 : json_real(alpha);
    json_t *j = json_object();
    json_object_set_new(j, "peft_type", json_string("LORA"));
    json_object_set_new(j, "task_type", json_string("CAUSAL_LM"));
    json_object_set_new(j, "base_model_name_or_path", base ? json_string(base) : json_null());
    json_object_set_new(j, "revision", json_null());
    json_object_set_new(j, "r", json_integer(o->lora_r));
    json_object_set_new(j, "lora_alpha", jalpha);
    json_object_set_new(j, "lora_dropout", json_real(o->lora_dropout));
    json_object_set_new(j, "target_modules", targets);
    json_object_set_new(j, "bias", json_string("none"));
    json_object_set_new(j, "use_rslora", json_boolean(o->rslora));
    json_object_set_new(j, "use_dora", json_false());
    json_object_set_new(j, "fan_in_fan_out", json_false());
    json_object_set_new(j, "inference_mode", json_true());
    json_object_set_new(j, "init_lora_weights", json_true());
    json_object_set_new(j, "modules_to_save", json_null());
    json_object_set_new(j, "layers_to_transform", json_null());
    json_object_set_new(j, "layers_pattern", json_null());
    json_object_set_new(j, "rank_pattern", json_object());
    json_object_set_new(j, "alpha_pattern", json_object());
    json_object_set_new(j, "megatron_config", json_null());
    json_object_set_new(j, "megatron_core", json_string("megatron.core"));
    json_object_set_new(j, "loftq_config", json_object());
    json_object_set_new(j, "layer_replication", json_null());
    return j;
}

static int cmp_entry(const void *a, const void *b)
{
    return strcmp(((const st_entry *)a)->name, ((const st_entry *)b)->name);
}

int adapter_write(const char *dir, const model_opts *o, const char *base_model_path,
                  const adapter_tensor *t, size_t n, sp_err *err)
{
    if (sp_mkdir_p(dir) != 0)
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot create: %s", dir, strerror(errno));
    st_entry *e = calloc(n ? n : 1, sizeof *e);
    if (!e)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    for (size_t i = 0; i < n; i++)
        e[i] = (st_entry){t[i].name, DT_F32, 2, {t[i].shape[0], t[i].shape[1]}, t[i].data};
    /* sorted by name: the same adapter gives the same bytes, whoever writes it */
    qsort(e, n, sizeof *e, cmp_entry);
    char *weights = sp_strf("%s/adapter_model.safetensors", dir);
    char *path = sp_strf("%s/adapter_config.json", dir);
    char *tmp = path ? sp_strf("%s.tmp", path) : NULL;
    const char *meta[] = {"format", "pt"};
    int rc = weights && tmp ? st_write(weights, e, n, meta, 1, err)
                            : sp_fail(err, SP_EXIT_OTHER, "out of memory");
    free(e);
    if (!rc) {
        json_t *cfg = adapter_config(o, base_model_path);
        rc = json_dump_file(cfg, tmp, JSON_INDENT(2) | JSON_SORT_KEYS);
        json_decref(cfg);
        if (rc || rename(tmp, path) != 0)
            rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot write", path);
    }
    free(weights);
    free(path);
    free(tmp);
    return rc;
}

int adapter_save(model_t *m, const char *dir, const char *base_model_path, sp_err *err)
{
    if (m->o.mode != MODE_LORA)
        return sp_fail(err, SP_EXIT_OTHER, "adapter_save: the model has no LoRA adapters");
    adapter_tensor *t = calloc((size_t)m->nparams, sizeof *t);
    if (!t)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    size_t n = 0;
    int rc = 0;
    for (int i = 0; i < m->nparams && !rc; i++) {
        param_t *p = &m->params[i];
        if (p->kind != PK_LORA_A && p->kind != PK_LORA_B)
            continue;
        float *buf = malloc(sizeof(float) * p->n);
        if (!buf) {
            rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
            break;
        }
        model_param_download(m, p, buf);
        t[n++] = (adapter_tensor){p->name, {p->shape[0], p->shape[1]}, buf};
    }
    if (!rc)
        rc = be_check(m->be, err);
    if (!rc)
        rc = adapter_write(dir, &m->o, base_model_path, t, n, err);
    for (size_t i = 0; i < n; i++)
        free((void *)t[i].data);
    free(t);
    return rc;
}

/* adapter_config.json (path) describes the adapters of m. */
static int check_config(const model_t *m, const char *path, sp_err *err)
{
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

/* adapter_load of the adapters' file path */
static int load_weights(model_t *m, const char *path, sp_err *err)
{
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

int adapter_load(model_t *m, const char *dir, sp_err *err)
{
    char *config = sp_strf("%s/adapter_config.json", dir);
    char *path = sp_strf("%s/adapter_model.safetensors", dir);
    int rc = !config || !path ? sp_fail(err, SP_EXIT_OTHER, "out of memory")
                              : check_config(m, config, err);
    free(config);
    if (!rc)
        rc = load_weights(m, path, err);
    free(path);
    return rc;
}
