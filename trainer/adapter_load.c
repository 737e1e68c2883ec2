/* Reading a PEFT adapter directory into a model (adapter.h): its
 * adapter_config.json checked against the model's LoRA options, the base
 * model's identity when the adapter records one, and every tensor by name,
 * shape and dtype. Nothing is uploaded until everything has been checked. */
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

/* "q_proj, v_proj" of TARGET_* bits, into buf */
static const char *targets_text(int64_t bits, char *buf, size_t n)
{
    buf[0] = 0;
    for (int p = 0; p < PROJ_COUNT; p++)
        if (bits & (1 << p))
            sp_cutf(buf + strlen(buf), n - strlen(buf), "%s%s", buf[0] ? ", " : "",
                    config_target_names[p]);
    return buf;
}

/* target_modules (path) as TARGET_* bits: a list of projection names, or
 * PEFT's "all-linear" (every projection of a Llama-family layer). */
static int read_targets(const json_t *tm, const char *path, int64_t *bits, sp_err *err)
{
    *bits = 0;
    if (json_is_string(tm) && strcmp(json_string_value(tm), "all-linear") == 0) {
        *bits = (1 << PROJ_COUNT) - 1;
        return 0;
    }
    if (json_is_string(tm))
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: target_modules is the pattern '%s'; spotune needs the list of "
                       "projections (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj)",
                       path, json_string_value(tm));
    if (!json_is_array(tm) || json_array_size(tm) == 0)
        return sp_fail(err, SP_EXIT_INPUT, "%s: target_modules must be a non-empty list", path);
    size_t i;
    json_t *v;
    json_array_foreach(tm, i, v)
    {
        int bit = 0;
        for (int p = 0; p < PROJ_COUNT && json_is_string(v); p++)
            if (strcmp(json_string_value(v), config_target_names[p]) == 0)
                bit = 1 << p;
        if (!bit)
            return sp_fail(err, SP_EXIT_INPUT,
                           "%s: target_modules names %s, which is not one of q_proj k_proj "
                           "v_proj o_proj gate_proj up_proj down_proj",
                           path, json_is_string(v) ? json_string_value(v) : "a non-string");
        *bits |= bit;
    }
    return 0;
}

/* A field of adapter_config.json that changes the math and that spotune does
 * not implement: refused when present with another value than PEFT's default. */
static int unsupported(const json_t *c, const char *path, sp_err *err)
{
    static const char *const off[] = {"layers_to_transform", "layers_pattern", "modules_to_save",
                                      "layer_replication", "target_parameters",
                                      "trainable_token_indices"};
    json_t *v = json_object_get(c, "bias");
    if (v && !(json_is_string(v) && strcmp(json_string_value(v), "none") == 0))
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: bias is not \"none\": spotune trains no biases in LoRA mode", path);
    static const char *const falses[] = {"fan_in_fan_out", "lora_bias", "use_qalora"};
    for (size_t i = 0; i < sizeof falses / sizeof falses[0]; i++)
        if ((v = json_object_get(c, falses[i])) && json_is_true(v))
            return sp_fail(err, SP_EXIT_INPUT, "%s: %s is true, which spotune does not support",
                           path, falses[i]);
    static const char *const empties[] = {"rank_pattern", "alpha_pattern"};
    for (size_t i = 0; i < sizeof empties / sizeof empties[0]; i++)
        if ((v = json_object_get(c, empties[i])) && !json_is_null(v) &&
            !(json_is_object(v) && json_object_size(v) == 0))
            return sp_fail(err, SP_EXIT_INPUT,
                           "%s: %s is not empty: per-module ranks or alphas are not supported",
                           path, empties[i]);
    for (size_t i = 0; i < sizeof off / sizeof off[0]; i++)
        if ((v = json_object_get(c, off[i])) && !json_is_null(v) &&
            !(json_is_array(v) && json_array_size(v) == 0))
            return sp_fail(err, SP_EXIT_INPUT, "%s: %s is set, which spotune does not support",
                           path, off[i]);
    return 0;
}

/* adapter_config.json (path) of the adapter in dir describes the model's
 * adapters; *name_or_path receives base_model_name_or_path (or NULL). */
static int check_config(const model_t *m, const char *dir, const char *path,
                        char **name_or_path, sp_err *err)
{
    struct stat sb;
    if (stat(path, &sb) != 0)
        return sp_fail(err, SP_EXIT_INPUT, "%s: cannot open: %s (not a PEFT adapter directory)",
                       path, strerror(errno));
    json_error_t je;
    json_t *c = json_load_file(path, 0, &je);
    if (!c)
        return sp_fail(err, SP_EXIT_INPUT, "%s:%d: not valid JSON: %s", path, je.line, je.text);
    int rc = 0;
    const model_opts *o = &m->o;
    json_t *pt = json_object_get(c, "peft_type"), *r = json_object_get(c, "r");
    json_t *a = json_object_get(c, "lora_alpha"), *rs = json_object_get(c, "use_rslora");
    json_t *bm = json_object_get(c, "base_model_name_or_path");
    json_t *dora = json_object_get(c, "use_dora");
    int64_t bits = 0;
    char want[160], have[160];
    if (!json_is_object(c))
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: expected a JSON object", path);
    else if (!json_is_string(pt) || strcmp(json_string_value(pt), "LORA") != 0)
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: peft_type is %s, not \"LORA\"", path,
                     json_is_string(pt) ? json_string_value(pt) : "missing");
    else if (!json_is_integer(r) || json_integer_value(r) < 1)
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: r must be a positive integer", path);
    else if (!json_is_number(a))
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: lora_alpha must be a number", path);
    else if (rs && !json_is_boolean(rs) && !json_is_null(rs))
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: use_rslora must be true or false", path);
    else if (dora && !json_is_boolean(dora) && !json_is_null(dora))
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: use_dora must be true or false", path);
    else if (!(rc = read_targets(json_object_get(c, "target_modules"), path, &bits, err)))
        rc = unsupported(c, path, err);
    if (rc) {
        json_decref(c);
        return rc;
    }
    if (json_integer_value(r) != o->lora_r)
        rc = sp_fail(err, SP_EXIT_USAGE, "%s: the adapter has r %lld, the run lora.r %lld", dir,
                     (long long)json_integer_value(r), (long long)o->lora_r);
    else if (fabs(json_number_value(a) - o->lora_alpha) > 1e-12 * fabs(o->lora_alpha))
        rc = sp_fail(err, SP_EXIT_USAGE,
                     "%s: the adapter has lora_alpha %.17g, the run lora.alpha %.17g", dir,
                     json_number_value(a), o->lora_alpha);
    else if (json_is_true(rs) != !!o->rslora)
        rc = sp_fail(err, SP_EXIT_USAGE, "%s: the adapter has use_rslora %s, the run lora.rslora %s",
                     dir, json_is_true(rs) ? "true" : "false", o->rslora ? "true" : "false");
    else if (json_is_true(dora) != !!o->dora)
        rc = sp_fail(err, SP_EXIT_USAGE,
                     "%s: the adapter has use_dora %s, the run lora.dora %s: a DoRA adapter "
                     "(its lora_magnitude_vector) and a plain LoRA one do not compute the same",
                     dir, json_is_true(dora) ? "true" : "false", o->dora ? "true" : "false");
    else if (bits != o->lora_targets)
        rc = sp_fail(err, SP_EXIT_USAGE,
                     "%s: the adapter has target_modules [%s], the run lora.targets [%s]", dir,
                     targets_text(bits, have, sizeof have),
                     targets_text(o->lora_targets, want, sizeof want));
    if (!rc && json_is_string(bm) && !(*name_or_path = strdup(json_string_value(bm))))
        rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
    json_decref(c);
    return rc;
}

/* The base model identity the adapter's file records (ADAPTER_META_BASE in
 * its safetensors metadata), into id; "" when it records none. */
static int recorded_identity(const st_file *f, char id[17], sp_err *err)
{
    id[0] = 0;
    if (!f->metadata_json)
        return 0;
    json_t *meta = json_loads(f->metadata_json, 0, NULL);
    json_t *v = json_object_get(meta, ADAPTER_META_BASE);
    int rc = 0;
    if (v && (!json_is_string(v) || strlen(json_string_value(v)) != 16 ||
              strspn(json_string_value(v), "0123456789abcdef") != 16))
        rc = sp_fail(err, SP_EXIT_INPUT,
                     "%s: the metadata %s is not a base model identity (16 hex digits)", f->path,
                     ADAPTER_META_BASE);
    else if (v)
        memcpy(id, json_string_value(v), 17);
    json_decref(meta);
    return rc;
}

static int adapter_kind(int kind)
{
    return kind == PK_LORA_A || kind == PK_LORA_B || kind == PK_LORA_M;
}

/* Every tensor of f is one of the model's LoRA weights (A, B, and DoRA's
 * magnitude), and every one of them is in f with its shape and a float
 * dtype. */
static int check_tensors(model_t *m, const st_file *f, sp_err *err)
{
    for (size_t i = 0; i < f->n; i++) {
        const st_tensor *t = &f->tensors[i];
        param_t *p = model_find_param(m, t->name);
        if (!p || !adapter_kind(p->kind))
            return sp_fail(err, SP_EXIT_INPUT,
                           "%s: tensor '%s' is not a LoRA weight of this run (lora.targets, "
                           "the model's layers)",
                           f->path, t->name);
    }
    for (int i = 0; i < m->nparams; i++) {
        param_t *p = &m->params[i];
        if (!adapter_kind(p->kind))
            continue;
        const st_tensor *t = st_find(f, p->name);
        if (!t)
            return sp_fail(err, SP_EXIT_INPUT, "%s: tensor '%s' is missing", f->path, p->name);
        if (t->ndim != p->ndim || t->shape[0] != p->shape[0] ||
            (p->ndim == 2 && t->shape[1] != p->shape[1])) {
            char got[96] = "";
            for (int d = 0; d < t->ndim; d++)
                sp_cutf(got + strlen(got), sizeof got - strlen(got), "%s%lld", d ? ", " : "",
                        (long long)t->shape[d]);
            char want[64];
            if (p->ndim == 2)
                snprintf(want, sizeof want, "%lld, %lld", (long long)p->shape[0],
                         (long long)p->shape[1]);
            else
                snprintf(want, sizeof want, "%lld", (long long)p->shape[0]);
            return sp_fail(err, SP_EXIT_INPUT,
                           "%s: tensor '%s' has shape [%s], this run's LoRA needs [%s]", f->path,
                           p->name, got, want);
        }
        if (t->dt != DT_F32 && t->dt != DT_BF16 && t->dt != DT_F16)
            return sp_fail(err, SP_EXIT_INPUT,
                           "%s: tensor '%s' has dtype %s (expected F32, BF16 or F16)", f->path,
                           p->name, dtype_name(t->dt));
        if (st_check_finite(f, t, err))
            return err->code;
    }
    return 0;
}

int adapter_init_from(model_t *m, const char *dir, const char *base_identity, char *note,
                      size_t note_n, sp_err *err)
{
    if (note && note_n)
        note[0] = 0;
    if (m->o.mode != MODE_LORA)
        return sp_fail(err, SP_EXIT_USAGE, "%s: the run has no LoRA adapters to load it into",
                       dir);
    char *config = sp_strf("%s/adapter_config.json", dir);
    char *path = sp_strf("%s/adapter_model.safetensors", dir);
    char *name_or_path = NULL, id[17] = "";
    st_file f;
    int opened = 0;
    int rc = !config || !path ? sp_fail(err, SP_EXIT_OTHER, "out of memory")
                              : check_config(m, dir, config, &name_or_path, err);
    if (!rc) {
        opened = 1; /* st_close after st_open, whatever it returned */
        if (!(rc = st_open(&f, path, err)))
            rc = recorded_identity(&f, id, err);
    }
    if (!rc && id[0] && base_identity && strcmp(id, base_identity) != 0)
        rc = sp_fail(err, SP_EXIT_USAGE,
                     "%s: the adapter was trained on the base model of identity %s, model.path "
                     "has identity %s: a LoRA adapter only fits the model it was trained on",
                     dir, id, base_identity);
    if (!rc)
        rc = check_tensors(m, &f, err);
    for (int i = 0; !rc && i < m->nparams; i++) {
        param_t *p = &m->params[i];
        if (adapter_kind(p->kind))
            model_param_upload(m, p, st_find(&f, p->name)->data, st_find(&f, p->name)->dt);
    }
    if (!rc && note && note_n && id[0])
        sp_cutf(note, note_n, "%zu tensors; base model identity %s, the same as model.path's",
                f.n, id);
    else if (!rc && note && note_n)
        sp_cutf(note, note_n,
                "%zu tensors; the adapter records no base model identity "
                "(base_model_name_or_path: %s), its tensors fit model.path",
                f.n, name_or_path ? name_or_path : "null");
    if (opened)
        st_close(&f);
    free(config);
    free(path);
    free(name_or_path);
    return rc ? rc : be_check(m->be, err);
}

int adapter_load(model_t *m, const char *dir, sp_err *err)
{
    return adapter_init_from(m, dir, NULL, NULL, 0, err);
}
