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

#include "model_io.h"
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
    json_object_set_new(j, "use_dora", json_boolean(o->dora));
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
                  const char *base_identity, const adapter_tensor *t, size_t n, sp_err *err)
{
    if (sp_mkdir_p(dir) != 0)
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot create: %s", dir, strerror(errno));
    st_entry *e = calloc(n ? n : 1, sizeof *e);
    if (!e)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    for (size_t i = 0; i < n; i++)
        e[i] = (st_entry){t[i].name, DT_F32, t[i].shape[1] ? 2 : 1, {t[i].shape[0], t[i].shape[1]},
                          t[i].data};
    /* sorted by name: the same adapter gives the same bytes, whoever writes it */
    qsort(e, n, sizeof *e, cmp_entry);
    char *weights = sp_strf("%s/adapter_model.safetensors", dir);
    char *path = sp_strf("%s/adapter_config.json", dir);
    char *tmp = path ? sp_strf("%s.tmp", path) : NULL;
    /* the base model's identity, when its directory is at hand: lora.init_from
     * checks it (PEFT, vLLM and SGLang ignore metadata) */
    char id[17];
    sp_err ignored = {0};
    int has_id = base_identity && base_identity[0]
                     ? snprintf(id, sizeof id, "%s", base_identity) > 0
                     : base_model_path && model_io_identity(base_model_path, id, &ignored) == 0;
    const char *meta[] = {"format", "pt", ADAPTER_META_BASE, id};
    int rc = weights && tmp ? st_write(weights, e, n, meta, has_id ? 2 : 1, err)
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
        if (p->kind != PK_LORA_A && p->kind != PK_LORA_B && p->kind != PK_LORA_M)
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
        rc = adapter_write(dir, &m->o, base_model_path, NULL, t, n, err);
    for (size_t i = 0; i < n; i++)
        free((void *)t[i].data);
    free(t);
    return rc;
}
