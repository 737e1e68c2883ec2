/* Model directories: safetensors shards in, safetensors out, and the base
 * identity; a derived directory's config and side files are in
 * model_io_derived.c. */
#define _GNU_SOURCE
#include "model_io_internal.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../kernels/nf4.h"
#include "safetensors.h"

static int file_exists(const char *p)
{
    struct stat sb;
    return stat(p, &sb) == 0;
}

static int add_unique(char ***files, int *n, const char *name)
{
    for (int i = 0; i < *n; i++)
        if (strcmp((*files)[i], name) == 0)
            return 0;
    char **grown = realloc(*files, sizeof(char *) * (size_t)(*n + 1));
    if (!grown)
        return -1;
    *files = grown;
    (*files)[*n] = strdup(name);
    if (!(*files)[*n])
        return -1;
    (*n)++;
    return 0;
}

/* The files named by the weight_map of the index file path. */
static int read_index(const char *path, char ***files, int *n, sp_err *err)
{
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root)
        return sp_fail(err, SP_EXIT_INPUT, "%s: %s", path, je.text);
    json_t *map = json_object_get(root, "weight_map");
    int rc = 0;
    if (!json_is_object(map)) {
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: no weight_map object", path);
    } else {
        const char *k;
        json_t *v;
        json_object_foreach(map, k, v)
        {
            if (!json_is_string(v) || strchr(json_string_value(v), '/')) {
                rc = sp_fail(err, SP_EXIT_INPUT, "%s: weight_map['%s'] is not a file name", path,
                             k);
                break;
            }
            if (add_unique(files, n, json_string_value(v))) {
                rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
                break;
            }
        }
    }
    json_decref(root);
    return rc;
}

int model_io_weight_files(const char *dir, char ***files, int *n, sp_err *err)
{
    *files = NULL;
    *n = 0;
    char *index = sp_strf("%s/model.safetensors.index.json", dir);
    char *single = sp_strf("%s/model.safetensors", dir);
    int rc = 0;
    if (!index || !single)
        rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
    else if (file_exists(index))
        rc = read_index(index, files, n, err);
    else if (!file_exists(single))
        rc = sp_fail(err, SP_EXIT_INPUT,
                     "%s: no model.safetensors or model.safetensors.index.json", dir);
    else if (add_unique(files, n, "model.safetensors"))
        rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
    free(index);
    free(single);
    return rc;
}

static void free_files(char **files, int n)
{
    for (int i = 0; i < n; i++)
        free(files[i]);
    free(files);
}

static int check_tensor(const st_file *f, const st_tensor *t, const param_t *p, sp_err *err)
{
    if (t->dt != DT_F32 && t->dt != DT_BF16 && t->dt != DT_F16)
        return sp_fail(err, SP_EXIT_INPUT, "%s: tensor '%s' has dtype %s (expected F32, BF16 or "
                                           "F16)",
                       f->path, t->name, dtype_name(t->dt));
    int ok = t->ndim == p->ndim && t->shape[0] == p->shape[0] &&
             (p->ndim == 1 || t->shape[1] == p->shape[1]);
    if (!ok) {
        char got[128] = "", want[64];
        for (int d = 0; d < t->ndim; d++) {
            char one[24];
            snprintf(one, sizeof one, "%s%lld", d ? ", " : "", (long long)t->shape[d]);
            strncat(got, one, sizeof got - strlen(got) - 1);
        }
        if (p->ndim == 1)
            snprintf(want, sizeof want, "%lld", (long long)p->shape[0]);
        else
            snprintf(want, sizeof want, "%lld, %lld", (long long)p->shape[0],
                     (long long)p->shape[1]);
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: tensor '%s' has shape [%s], but config.json implies [%s]", f->path,
                       t->name, got, want);
    }
    return 0;
}

/* The error for tensor `name`, found in none of the nf weight files of dir:
 * the shard the index places it in, or that the index does not list it. */
static int missing_tensor(const char *dir, const char *name, char **files, int nf, sp_err *err)
{
    char *index = sp_strf("%s/model.safetensors.index.json", dir);
    json_t *root = index && file_exists(index) ? json_load_file(index, 0, NULL) : NULL;
    json_t *shard = json_object_get(json_object_get(root, "weight_map"), name);
    int rc;
    if (!root)
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: tensor '%s' is missing from %s", dir, name,
                     nf == 1 ? files[0] : "every shard");
    else if (json_is_string(shard))
        rc = sp_fail(err, SP_EXIT_INPUT,
                     "%s: tensor '%s' is missing from %s, the shard "
                     "model.safetensors.index.json places it in",
                     dir, name, json_string_value(shard));
    else
        rc = sp_fail(err, SP_EXIT_INPUT,
                     "%s: tensor '%s' is missing: model.safetensors.index.json does not list it "
                     "and none of its %d shard(s) holds it",
                     dir, name, nf);
    json_decref(root);
    free(index);
    return rc;
}

/* The tensor named name in any of the nf files, or NULL. */
static const st_tensor *find_in(st_file *st, int nf, const char *name)
{
    const st_tensor *t = NULL;
    for (int j = 0; j < nf && !t; j++)
        t = st_find(&st[j], name);
    return t;
}

/* One part NAME.SUFFIX of a bitsandbytes NF4 weight: present, of dtype dt
 * and n elements. */
static const st_tensor *bnb_part(const char *dir, st_file *st, int nf, const param_t *p,
                                 const char *suffix, dtype_t dt, size_t n, sp_err *err)
{
    char name[256];
    snprintf(name, sizeof name, "%s%s%s", p->name, *suffix ? "." : "", suffix);
    const st_tensor *t = find_in(st, nf, name);
    if (!t)
        sp_fail(err, SP_EXIT_INPUT, "%s: tensor '%s' is missing (a bitsandbytes NF4 weight)",
                dir, name);
    else if (t->dt != dt || t->numel != n)
        sp_fail(err, SP_EXIT_INPUT, "%s: tensor '%s' is %s with %zu elements, expected %s with %zu",
                dir, name, dtype_name(t->dt), t->numel, dtype_name(dt), n);
    else
        return t;
    return NULL;
}

/* A projection weight of a bitsandbytes 4-bit directory (model_config_t
 * bnb_nf4): the packed codes and the double-quantized statistics as
 * transformers saves them, checked against kernels/nf4.h's layout, stored
 * as they are (no requantization). */
static int load_bnb_nf4(model_t *m, param_t *p, const char *dir, st_file *st, int nf,
                        sp_err *err)
{
    const st_tensor *w, *am, *na, *qm, *nqm, *qs;
    if (!(w = bnb_part(dir, st, nf, p, "", DT_U8, nf4_code_bytes(p->n), err)) ||
        !(am = bnb_part(dir, st, nf, p, "absmax", DT_U8, nf4_blocks(p->n), err)) ||
        !(na = bnb_part(dir, st, nf, p, "nested_absmax", DT_F32, nf4_nested_blocks(p->n), err)) ||
        !(qm = bnb_part(dir, st, nf, p, "quant_map", DT_F32, 16, err)) ||
        !(nqm = bnb_part(dir, st, nf, p, "nested_quant_map", DT_F32, 256, err)))
        return err->code;
    char qs_name[256];
    snprintf(qs_name, sizeof qs_name, "%s.quant_state.bitsandbytes__nf4", p->name);
    if (!(qs = find_in(st, nf, qs_name)) || qs->dt != DT_U8)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: tensor '%s' is %s (bitsandbytes' quant state, U8 JSON; only NF4 "
                       "weights are supported)",
                       dir, qs_name, qs ? "not U8" : "missing");
    if (memcmp(qm->data, nf4_quant_map, sizeof nf4_quant_map) != 0)
        return sp_fail(err, SP_EXIT_INPUT, "%s: %s.quant_map is not the NF4 map", dir, p->name);
    if (memcmp(nqm->data, nf4_dynamic_map, sizeof nf4_dynamic_map) != 0)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: %s.nested_quant_map is not bitsandbytes' 8-bit dynamic map", dir,
                       p->name);
    json_error_t je;
    json_t *j = json_loadb(qs->data, qs->numel, 0, &je);
    json_t *shape = json_object_get(j, "shape"), *off = json_object_get(j, "nested_offset");
    const char *qt = json_string_value(json_object_get(j, "quant_type"));
    int rc = 0;
    if (!j)
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: %s is not JSON: %s", dir, qs_name, je.text);
    else if (!qt || strcmp(qt, "nf4") != 0)
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: %s: quant_type %s is not supported (nf4)", dir,
                     qs_name, qt ? qt : "(missing)");
    else if (json_integer_value(json_object_get(j, "blocksize")) != NF4_BLOCK)
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: %s: blocksize %lld is not supported (64)", dir,
                     qs_name, (long long)json_integer_value(json_object_get(j, "blocksize")));
    else if (json_integer_value(json_object_get(j, "nested_blocksize")) != NF4_NESTED_BLOCK)
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: %s: nested_blocksize %lld is not supported (256)",
                     dir, qs_name,
                     (long long)json_integer_value(json_object_get(j, "nested_blocksize")));
    else if (json_array_size(shape) != 2 ||
             json_integer_value(json_array_get(shape, 0)) != p->shape[0] ||
             json_integer_value(json_array_get(shape, 1)) != p->shape[1])
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: %s: shape is not [%lld, %lld]", dir, qs_name,
                     (long long)p->shape[0], (long long)p->shape[1]);
    else if (!json_is_number(off))
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: %s: no nested_offset (double quantization)", dir,
                     qs_name);
    else
        model_param_set_nf4(m, p, w->data, am->data, na->data, (float)json_number_value(off));
    json_decref(j);
    return rc ? rc : be_check(m->be, err);
}

int model_io_load_base(model_t *m, const char *dir, sp_err *err)
{
    if (m->mc.bnb_nf4 && !m->o.nf4)
        return sp_fail(err, SP_EXIT_USAGE,
                       "%s: the projection weights are bitsandbytes 4-bit NF4 "
                       "(config.json quantization_config): set model.quantize nf4",
                       dir);
    char **files;
    int nf;
    if (model_io_weight_files(dir, &files, &nf, err))
        return err->code;
    st_file *st = calloc((size_t)nf, sizeof *st);
    int rc = st ? 0 : sp_fail(err, SP_EXIT_OTHER, "out of memory");
    for (int i = 0; i < nf && !rc; i++) {
        char *path = sp_strf("%s/%s", dir, files[i]);
        rc = path ? st_open(&st[i], path, err) : sp_fail(err, SP_EXIT_OTHER, "out of memory");
        free(path);
    }
    for (int i = 0; i < m->nparams && !rc; i++) {
        param_t *p = &m->params[i];
        if (p->kind == PK_LORA_A || p->kind == PK_LORA_B || p->kind == PK_LORA_M)
            continue;
        if (m->mc.bnb_nf4 && p->kind == PK_WEIGHT) {
            if ((rc = load_bnb_nf4(m, p, dir, st, nf, err)))
                break;
            continue;
        }
        const st_tensor *t = NULL;
        int where = -1;
        for (int j = 0; j < nf && !t; j++)
            if ((t = st_find(&st[j], p->name)))
                where = j;
        if (!t) {
            rc = missing_tensor(dir, p->name, files, nf, err);
            break;
        }
        if ((rc = check_tensor(&st[where], t, p, err)) ||
            (rc = st_check_finite(&st[where], t, err)))
            break;
        model_param_upload(m, p, t->data, t->dt);
        rc = be_check(m->be, err);
    }
    for (int i = 0; st && i < nf; i++)
        st_close(&st[i]);
    free(st);
    free_files(files, nf);
    return rc;
}

/* 1 when tensor `name` of the model's files is one model m reads */
static int used_by(const model_t *m, const char *name)
{
    size_t len = strlen(name);
    static const char inv_freq[] = ".rotary_emb.inv_freq";
    if (len >= sizeof inv_freq - 1 && strcmp(name + len - (sizeof inv_freq - 1), inv_freq) == 0)
        return 1;
    if (m->mc.tie_embeddings && strcmp(name, "lm_head.weight") == 0)
        return 1;
    for (int i = 0; i < m->nparams; i++) {
        const param_t *p = &m->params[i];
        if (p->kind == PK_LORA_A || p->kind == PK_LORA_B || p->kind == PK_LORA_M)
            continue;
        size_t pl = strlen(p->name);
        if (strncmp(name, p->name, pl) == 0 &&
            (name[pl] == 0 || (m->mc.bnb_nf4 && p->kind == PK_WEIGHT && name[pl] == '.')))
            return 1;
    }
    return 0;
}

int model_io_unused(const model_t *m, const char *dir, char *buf, size_t n, size_t *count,
                    sp_err *err)
{
    char **files;
    int nf;
    *count = 0;
    if (n)
        buf[0] = 0;
    if (model_io_weight_files(dir, &files, &nf, err))
        return err->code;
    size_t k = 0;
    int rc = 0;
    for (int i = 0; i < nf && !rc; i++) {
        char *path = sp_strf("%s/%s", dir, files[i]);
        st_file f = {0};
        rc = path ? st_open(&f, path, err) : sp_fail(err, SP_EXIT_OTHER, "out of memory");
        free(path);
        for (size_t j = 0; !rc && j < f.n; j++) {
            if (used_by(m, f.tensors[j].name))
                continue;
            if (*count < 8 && k < n)
                k += (size_t)snprintf(buf + k, n - k, "%s%s", *count ? ", " : "",
                                      f.tensors[j].name);
            ++*count;
        }
        st_close(&f);
    }
    free_files(files, nf);
    return rc;
}

/* ---- writing ------------------------------------------------------------- */

typedef struct save_ctx {
    model_t *m;
    param_t **params;
    dtype_t dtype;
    int merge_lora;
} save_ctx;

/* W + scale * B A for a projection weight with an adapter; with DoRA each
 * row o then times m[o] / ||row o|| (PEFT's merge). */
static int merged_weight(model_t *m, const param_t *p, float *w, sp_err *err)
{
    layer_params *L = &m->layers[p->layer];
    param_t *A = L->lora_a[p->proj], *B = L->lora_b[p->proj];
    int64_t out = p->shape[0], in = p->shape[1], r = A->shape[0];
    float *a = malloc(sizeof(float) * A->n), *b = malloc(sizeof(float) * B->n);
    if (!a || !b) {
        free(a);
        free(b);
        return sp_fail(err, SP_EXIT_OTHER, "out of host memory merging '%s'", p->name);
    }
    model_param_download(m, A, a);
    model_param_download(m, B, b);
    for (int64_t o = 0; o < out; o++)
        for (int64_t k = 0; k < r; k++) {
            float s = m->lora_scale * b[o * r + k];
            const float *ak = a + k * in;
            float *wo = w + o * in;
            for (int64_t i = 0; i < in; i++)
                wo[i] += s * ak[i];
        }
    free(a);
    free(b);
    param_t *M = L->lora_m[p->proj];
    if (!M)
        return 0;
    float *mag = malloc(sizeof(float) * M->n);
    if (!mag)
        return sp_fail(err, SP_EXIT_OTHER, "out of host memory merging '%s'", p->name);
    model_param_download(m, M, mag);
    for (int64_t o = 0; o < out; o++) {
        float *wo = w + o * in;
        double ss = 0.0;
        for (int64_t i = 0; i < in; i++)
            ss += (double)wo[i] * wo[i];
        double f = (double)mag[o] / sqrt(ss);
        for (int64_t i = 0; i < in; i++)
            wo[i] = (float)(wo[i] * f);
    }
    free(mag);
    return 0;
}

static int fetch_param(void *vctx, size_t i, void *buf, sp_err *err)
{
    save_ctx *c = vctx;
    const param_t *p = c->params[i];
    float *f = c->dtype == DT_F32 ? buf : malloc(sizeof(float) * p->n);
    if (!f)
        return sp_fail(err, SP_EXIT_OTHER, "out of host memory");
    model_param_download(c->m, p, f);
    int rc = 0;
    if (c->merge_lora && p->kind == PK_WEIGHT && c->m->layers[p->layer].lora_a[p->proj])
        rc = merged_weight(c->m, p, f, err);
    if (c->dtype != DT_F32) {
        dtype_convert(buf, c->dtype, f, DT_F32, p->n);
        free(f);
    }
    return rc ? rc : be_check(c->m->be, err);
}

static int write_index(const char *dir, st_entry *e, int *shard_of, size_t n, int nshards,
                       size_t total, sp_err *err)
{
    json_t *root = json_object(), *map = json_object();
    json_object_set_new(root, "metadata", json_pack("{s:I}", "total_size", (json_int_t)total));
    for (size_t i = 0; i < n; i++) {
        char name[64];
        snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", shard_of[i] + 1, nshards);
        json_object_set_new(map, e[i].name, json_string(name));
    }
    json_object_set_new(root, "weight_map", map);
    char *path = sp_strf("%s/model.safetensors.index.json", dir);
    int rc = !path ? sp_fail(err, SP_EXIT_OTHER, "out of memory")
             : json_dump_file(root, path, JSON_INDENT(2) | JSON_SORT_KEYS)
                 ? sp_fail(err, SP_EXIT_OTHER, "%s: cannot write", path)
                 : 0;
    json_decref(root);
    free(path);
    return rc;
}

const char *model_io_torch_dtype(dtype_t dtype)
{
    return dtype == DT_BF16 ? "bfloat16" : dtype == DT_F16 ? "float16" : "float32";
}

/* The weights of m as safetensors files in dir (made already). */
int model_io_save_weights(model_t *m, const char *dir, dtype_t dtype, int merge_lora,
                          size_t shard_bytes, sp_err *err)
{
    int rc = 0;
    char *path;
    size_t n = 0, total = 0;
    st_entry *e = calloc((size_t)m->nparams, sizeof *e);
    param_t **ps = calloc((size_t)m->nparams, sizeof *ps);
    int *shard_of = calloc((size_t)m->nparams, sizeof *shard_of);
    if (!e || !ps || !shard_of) {
        free(e);
        free(ps);
        free(shard_of);
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    }
    int nshards = 1;
    size_t in_shard = 0;
    for (int i = 0; i < m->nparams; i++) {
        param_t *p = &m->params[i];
        if (p->kind == PK_LORA_A || p->kind == PK_LORA_B || p->kind == PK_LORA_M)
            continue;
        e[n] = (st_entry){p->name, dtype, p->ndim, {p->shape[0], p->shape[1]}, NULL};
        ps[n] = p;
        size_t bytes = st_entry_bytes(&e[n]);
        if (in_shard && in_shard + bytes > shard_bytes) {
            nshards++;
            in_shard = 0;
        }
        shard_of[n] = nshards - 1;
        in_shard += bytes;
        total += bytes;
        n++;
    }
    save_ctx ctx = {m, ps, dtype, merge_lora};
    const char *meta[] = {"format", "pt"};
    for (int s = 0; s < nshards && !rc; s++) {
        size_t first = 0, count = 0;
        while (shard_of[first] != s)
            first++;
        while (first + count < n && shard_of[first + count] == s)
            count++;
        ctx.params = ps + first;
        path = nshards == 1
                   ? sp_strf("%s/model.safetensors", dir)
                   : sp_strf("%s/model-%05d-of-%05d.safetensors", dir, s + 1, nshards);
        rc = path ? st_write_fetch(path, e + first, count, meta, 1, fetch_param, &ctx, err)
                  : sp_fail(err, SP_EXIT_OTHER, "out of memory");
        free(path);
    }
    if (!rc && nshards > 1)
        rc = write_index(dir, e, shard_of, n, nshards, total, err);
    /* the other layout's entry point, left by an earlier save into dir, would
     * be read instead of (or beside) these files */
    char *stale = rc ? NULL
                     : sp_strf("%s/%s", dir, nshards > 1 ? "model.safetensors"
                                                         : "model.safetensors.index.json");
    if (stale && unlink(stale) != 0 && errno != ENOENT)
        rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot remove: %s", stale, strerror(errno));
    free(stale);
    free(e);
    free(ps);
    free(shard_of);
    return rc;
}

int model_io_save(model_t *m, const char *dir, dtype_t dtype, int merge_lora, size_t shard_bytes,
                  sp_err *err)
{
    if (sp_mkdir_p(dir) != 0)
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot create: %s", dir, strerror(errno));
    char *path = sp_strf("%s/config.json", dir);
    int rc = path ? model_config_write(&m->mc, path, model_io_torch_dtype(dtype), err)
                  : sp_fail(err, SP_EXIT_OTHER, "out of memory");
    free(path);
    return rc ? rc : model_io_save_weights(m, dir, dtype, merge_lora, shard_bytes, err);
}

/* ---- identity -------------------------------------------------------------- */

static uint64_t hash_whole_file(uint64_t h, const char *path, sp_err *err, int *rc)
{
    FILE *f = fopen(path, "rb");
    unsigned char buf[4096];
    size_t got;
    if (!f) {
        *rc = sp_fail(err, SP_EXIT_INPUT, "%s: cannot open: %s", path, strerror(errno));
        return h;
    }
    while ((got = fread(buf, 1, sizeof buf, f)) > 0)
        h = sp_fnv1a(h, buf, got);
    fclose(f);
    return h;
}

static uint64_t hash_file_sampled(uint64_t h, const char *path, sp_err *err, int *rc)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        *rc = sp_fail(err, SP_EXIT_INPUT, "%s: cannot open: %s", path, strerror(errno));
        return h;
    }
    fseeko(f, 0, SEEK_END);
    off_t size = ftello(f);
    h = sp_fnv1a(h, &size, sizeof size);
    /* the header whole (names, shapes, dtypes), then 16 samples of 4 KiB */
    unsigned char buf[4096], len8[8];
    uint64_t hlen = 0;
    fseeko(f, 0, SEEK_SET);
    if (size >= 8 && fread(len8, 1, 8, f) == 8)
        for (int i = 7; i >= 0; i--)
            hlen = (hlen << 8) | len8[i];
    for (uint64_t done = 0; done < hlen && done < (uint64_t)size;) {
        size_t want = hlen - done < sizeof buf ? (size_t)(hlen - done) : sizeof buf;
        size_t got = fread(buf, 1, want, f);
        if (!got)
            break;
        h = sp_fnv1a(h, buf, got);
        done += got;
    }
    for (int s = 0; s < 16 && size > 0; s++) {
        fseeko(f, (off_t)((double)size * s / 16.0), SEEK_SET);
        size_t got = fread(buf, 1, sizeof buf, f);
        h = sp_fnv1a(h, buf, got);
    }
    fclose(f);
    return h;
}

int model_io_identity(const char *dir, char out[17], sp_err *err)
{
    char **files;
    int nf, rc = 0;
    char *path = sp_strf("%s/config.json", dir);
    if (!path)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    uint64_t h = hash_whole_file(SP_FNV_INIT, path, err, &rc);
    free(path);
    if (rc || model_io_weight_files(dir, &files, &nf, err))
        return err->code;
    for (int i = 0; i < nf && !rc; i++) {
        path = sp_strf("%s/%s", dir, files[i]);
        h = path ? hash_file_sampled(h, path, err, &rc) : h;
        if (!path)
            rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
        free(path);
    }
    free_files(files, nf);
    snprintf(out, 17, "%016llx", (unsigned long long)h);
    return rc;
}

int model_io_weights_dtype(const char *dir, dtype_t *dt, sp_err *err)
{
    char **files;
    int nf;
    *dt = DT_F32;
    if (model_io_weight_files(dir, &files, &nf, err))
        return err->code;
    char *path = sp_strf("%s/%s", dir, files[0]);
    free_files(files, nf);
    if (!path)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    st_file f;
    int rc = st_open(&f, path, err);
    free(path);
    if (!rc && f.n > 0)
        *dt = f.tensors[0].dt == DT_F32 || f.tensors[0].dt == DT_F16 ? f.tensors[0].dt : DT_BF16;
    st_close(&f);
    return rc;
}
