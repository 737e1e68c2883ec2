/* Model directories: safetensors shards in, safetensors out. */
#define _GNU_SOURCE
#include "model_io.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

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

int model_io_load_base(model_t *m, const char *dir, sp_err *err)
{
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
        if (p->kind == PK_LORA_A || p->kind == PK_LORA_B)
            continue;
        const st_tensor *t = NULL;
        int where = -1;
        for (int j = 0; j < nf && !t; j++)
            if ((t = st_find(&st[j], p->name)))
                where = j;
        if (!t) {
            rc = sp_fail(err, SP_EXIT_INPUT, "%s: tensor '%s' is missing from %s", dir, p->name,
                         nf == 1 ? files[0] : "every shard");
            break;
        }
        if ((rc = check_tensor(&st[where], t, p, err)))
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

/* ---- writing ------------------------------------------------------------- */

typedef struct save_ctx {
    model_t *m;
    param_t **params;
    dtype_t dtype;
    int merge_lora;
} save_ctx;

/* W + scale * B A for a projection weight with an adapter. */
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

int model_io_save(model_t *m, const char *dir, dtype_t dtype, int merge_lora, size_t shard_bytes,
                  sp_err *err)
{
    if (sp_mkdir_p(dir) != 0)
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot create: %s", dir, strerror(errno));
    char *path = sp_strf("%s/config.json", dir);
    const char *torch_dtype = dtype == DT_BF16 ? "bfloat16" : dtype == DT_F16 ? "float16" : "float32";
    int rc = path ? model_config_write(&m->mc, path, torch_dtype, err)
                  : sp_fail(err, SP_EXIT_OTHER, "out of memory");
    free(path);
    if (rc)
        return rc;
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
        if (p->kind == PK_LORA_A || p->kind == PK_LORA_B)
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
    free(e);
    free(ps);
    free(shard_of);
    return rc;
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
