/* Sharded checkpoint state (ckpt.h, "Sharded state"), the reading side:
 * ranged reads of any tensor's elements through MANIFEST's layout, from a
 * directory (HDF5), a store, or both (ckpt_shard_write.c writes the files). */
#define _GNU_SOURCE
#include "ckpt.h"
#include "ckpt_internal.h"

#include <errno.h>
#include <hdf5.h>
#include <jansson.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "store.h"

/* A ranged reader copies the stored bytes of float32 LE datasets as they are. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "a little-endian host");

/* ---- reading ---------------------------------------------------------------------- */

typedef struct shard_file {
    char name[128];
    uint64_t lo, hi;
    hid_t f, ds[CKPT_SHARD_GROUPS]; /* opened on first use (-1: not yet) */
    /* for ranged reads (ranged: all of these were in the MANIFEST) */
    int ranged;
    uint64_t size, off[CKPT_SHARD_GROUPS], block_bytes;
    uint32_t nblocks;
    unsigned char (*sums)[32];
    /* a store-backed reader: where this file's bytes come from (the local
     * copy's directory as a file:// store, or the remote store) and its key */
    store_t *src;
    char *key;
    int used;   /* read from */
    atomic_int warned; /* a block of the local copy was read again from the store */
} shard_file;

typedef struct shard_tensor {
    char *name;
    uint64_t offset, n;
    int ndim;
    int64_t shape[2];
} shard_tensor;

struct ckpt_sharded {
    char *dir; /* the directory, or the store's URL/PREFIX (messages) */
    uint64_t elements;
    shard_tensor *tensors;
    int ntensors;
    shard_file *files;
    int nfiles;
    /* reading from a store: per group, the last verified block read partly
     * (file cache_file[g]'s block cache_block[g]): a group's reads are
     * sequential, and the next one usually starts in that block */
    store_t *st;    /* the remote store (the caller's; may be NULL with a local copy) */
    store_t *local; /* file:// over the local copy's directory (owned; may be NULL) */
    char *local_dir;
    char *prefix;
    unsigned char *cache[CKPT_SHARD_GROUPS];
    int cache_file[CKPT_SHARD_GROUPS];
    uint64_t cache_block[CKPT_SHARD_GROUPS];
    int damaged; /* a block did not match its checksum */
    int ranged;  /* reads go through the files' stores (else HDF5 on dir) */
};

void ckpt_sharded_close(ckpt_sharded *r)
{
    if (!r)
        return;
    for (int i = 0; i < r->nfiles; i++) {
        for (int g = 0; g < CKPT_SHARD_GROUPS; g++)
            if (r->files[i].ds[g] >= 0)
                H5Dclose(r->files[i].ds[g]);
        if (r->files[i].f >= 0)
            H5Fclose(r->files[i].f);
        free(r->files[i].sums);
        free(r->files[i].key);
    }
    store_close(r->local);
    for (int i = 0; i < r->ntensors; i++)
        free(r->tensors[i].name);
    free(r->tensors);
    free(r->files);
    free(r->dir);
    free(r->prefix);
    free(r->local_dir);
    for (int g = 0; g < CKPT_SHARD_GROUPS; g++)
        free(r->cache[g]);
    free(r);
}

static int json_u64(json_t *o, const char *key, uint64_t *v)
{
    json_t *x = json_object_get(o, key);
    if (!json_is_integer(x) || json_integer_value(x) < 0)
        return -1;
    *v = (uint64_t)json_integer_value(x);
    return 0;
}

static int parse_tensors(ckpt_sharded *r, json_t *ts)
{
    r->tensors = calloc(json_array_size(ts) + 1, sizeof *r->tensors);
    if (!r->tensors)
        return -1;
    size_t i;
    json_t *t;
    json_array_foreach(ts, i, t)
    {
        shard_tensor *x = &r->tensors[r->ntensors];
        const char *name = json_string_value(json_object_get(t, "name"));
        json_t *shape = json_object_get(t, "shape");
        size_t nd = json_array_size(shape);
        if (!name || json_u64(t, "offset", &x->offset) || !json_is_array(shape) || nd < 1 ||
            nd > 2 || !(x->name = strdup(name)))
            return -1;
        r->ntensors++;
        x->ndim = (int)nd;
        x->n = 1;
        for (size_t d = 0; d < nd; d++) {
            json_t *v = json_array_get(shape, d);
            if (!json_is_integer(v) || json_integer_value(v) < 0)
                return -1;
            x->shape[d] = json_integer_value(v);
            x->n *= (uint64_t)x->shape[d];
        }
        if (x->offset + x->n > r->elements)
            return -1;
    }
    return 0;
}

static int unhex32(const char *hex, unsigned char out[32])
{
    if (!hex || strlen(hex) != 64)
        return -1;
    for (int i = 0; i < 32; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1)
            return -1;
        out[i] = (unsigned char)v;
    }
    return 0;
}

/* The ranged-read fields of shard x from its layout entry f and its entry
 * in MANIFEST's files (size): all present and consistent, or x stays not
 * ranged (0 returned either way; -1 only when what is there is damaged). */
static int parse_ranged(shard_file *x, json_t *f, json_t *file)
{
    json_t *offs = json_object_get(f, "data_offsets"), *sums = json_object_get(f, "block_sha256");
    if (!offs && !sums)
        return 0; /* written before block checksums: read through a directory only */
    uint64_t n = x->hi - x->lo;
    if (json_array_size(offs) != CKPT_SHARD_GROUPS || !json_is_array(sums) ||
        json_u64(f, "block_bytes", &x->block_bytes) || !x->block_bytes ||
        json_u64(file, "size", &x->size) ||
        json_array_size(sums) != (x->size + x->block_bytes - 1) / x->block_bytes)
        return -1;
    for (int g = 0; g < CKPT_SHARD_GROUPS; g++) {
        json_t *v = json_array_get(offs, (size_t)g);
        if (!json_is_integer(v) || json_integer_value(v) < 0)
            return -1;
        x->off[g] = (uint64_t)json_integer_value(v);
        if (n && (x->off[g] > x->size || 4 * n > x->size - x->off[g]))
            return -1;
    }
    x->nblocks = (uint32_t)json_array_size(sums);
    if (!(x->sums = calloc(x->nblocks + 1, 32)))
        return -1;
    for (uint32_t k = 0; k < x->nblocks; k++)
        if (unhex32(json_string_value(json_array_get(sums, k)), x->sums[k]))
            return -1;
    x->ranged = 1;
    return 0;
}

static int parse_files(ckpt_sharded *r, json_t *fs, json_t *files)
{
    r->files = calloc(json_array_size(fs) + 1, sizeof *r->files);
    if (!r->files)
        return -1;
    uint64_t next = 0;
    size_t i;
    json_t *f;
    json_array_foreach(fs, i, f)
    {
        shard_file *x = &r->files[r->nfiles++];
        const char *name = json_string_value(json_object_get(f, "file"));
        x->f = -1;
        for (int g = 0; g < CKPT_SHARD_GROUPS; g++)
            x->ds[g] = -1;
        if (!name || strchr(name, '/') || strlen(name) >= sizeof x->name ||
            json_u64(f, "lo", &x->lo) || json_u64(f, "hi", &x->hi) || x->lo != next ||
            x->hi < x->lo)
            return -1;
        snprintf(x->name, sizeof x->name, "%s", name);
        next = x->hi;
        if (parse_ranged(x, f, json_object_get(files, name)))
            return -1;
    }
    return next == r->elements ? 0 : -1; /* the shards cover the arena, in order */
}

/* r's layout from MANIFEST j (where: its path or URL, for messages). */
static int parse_manifest(ckpt_sharded *r, json_t *j, const char *where, sp_err *err)
{
    json_t *lay = json_object_get(j, "layout");
    if (!json_is_object(lay))
        return sp_fail(err, SP_EXIT_INPUT, "%s: not a sharded checkpoint (no layout)", where);
    if (json_u64(lay, "elements", &r->elements) ||
        !json_is_array(json_object_get(lay, "tensors")) ||
        !json_is_array(json_object_get(lay, "shards")) ||
        parse_tensors(r, json_object_get(lay, "tensors")) ||
        parse_files(r, json_object_get(lay, "shards"), json_object_get(j, "files")))
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: the layout is damaged (tensors or shards missing, out of range, or "
                       "not covering its %llu elements in order)",
                       where, (unsigned long long)r->elements);
    return 0;
}

int ckpt_sharded_open(ckpt_sharded **out, const char *dir, sp_err *err)
{
    *out = NULL;
    char *path = sp_strf("%s/%s", dir, CKPT_MANIFEST);
    json_error_t je;
    json_t *j = path ? json_load_file(path, 0, &je) : NULL;
    ckpt_sharded *r = calloc(1, sizeof *r);
    int rc = 0;
    if (!path || !r || !(r->dir = strdup(dir)))
        rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
    else if (!j)
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: cannot read: %s", path, je.text);
    else
        rc = parse_manifest(r, j, path, err);
    json_decref(j);
    free(path);
    if (rc) {
        ckpt_sharded_close(r);
        return rc;
    }
    *out = r;
    return 0;
}

/* Where file x's bytes come from: the local copy when it holds the file
 * with the size MANIFEST gives, else the remote store. */
static int choose_source(ckpt_sharded *r, shard_file *x, sp_err *err)
{
    int there = 0;
    uint64_t size = 0;
    sp_err e = {0};
    if (r->local && store_exists(r->local, x->name, &there, &size, &e) == 0 && there &&
        size == x->size) {
        x->src = r->local;
        x->key = strdup(x->name);
    } else if (r->st) {
        x->src = r->st;
        x->key = sp_strf("%s/%s", r->prefix, x->name);
    } else {
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: %s is not in this machine's copy of the checkpoint (it was written "
                       "on another machine) and no remote store was given to read it from",
                       r->dir, x->name);
    }
    return x->key ? 0 : sp_fail(err, SP_EXIT_OTHER, "out of memory");
}

int ckpt_sharded_open_mixed(ckpt_sharded **out, const char *manifest, const char *local_dir,
                            store_t *st, const char *prefix, sp_err *err)
{
    *out = NULL;
    json_error_t je;
    json_t *j = json_loads(manifest, 0, &je);
    ckpt_sharded *r = calloc(1, sizeof *r);
    int rc = 0;
    if (!r || !(r->dir = st ? sp_strf("%s/%s", store_url(st), prefix) : strdup(local_dir)) ||
        !(r->prefix = strdup(prefix)))
        rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
    else if (!j)
        rc = sp_fail(err, SP_EXIT_INPUT, "%s/%s: not JSON: %s", r->dir, CKPT_MANIFEST, je.text);
    else
        rc = parse_manifest(r, j, r->dir, err);
    r->st = st;
    struct stat sb;
    if (!rc && local_dir && stat(local_dir, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        char *url = sp_strf("file://%s", local_dir);
        sp_err e = {0};
        if (!url || !(r->local_dir = strdup(local_dir)))
            rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
        else if (store_open(&r->local, url, NULL, &e))
            r->local = NULL; /* not readable here: the remote store only */
        free(url);
    }
    uint64_t most = 0;
    for (int i = 0; !rc && i < r->nfiles; i++) {
        if (!r->files[i].ranged)
            rc = sp_fail(err, SP_EXIT_INPUT,
                         "%s: %s has no block checksums in MANIFEST.json (written by an older "
                         "version): pull the checkpoint whole",
                         r->dir, r->files[i].name);
        else
            rc = choose_source(r, &r->files[i], err);
        if (r->files[i].block_bytes > most)
            most = r->files[i].block_bytes;
    }
    for (int g = 0; g < CKPT_SHARD_GROUPS && !rc; g++)
        if (!(r->cache[g] = malloc(most ? most : 1)))
            rc = sp_fail(err, SP_EXIT_OTHER, "out of memory for a %llu-byte read buffer",
                         (unsigned long long)most);
    json_decref(j);
    if (rc) {
        ckpt_sharded_close(r);
        return rc;
    }
    r->ranged = 1;
    for (int g = 0; g < CKPT_SHARD_GROUPS; g++)
        r->cache_file[g] = -1;
    *out = r;
    return 0;
}

int ckpt_sharded_open_store(ckpt_sharded **out, const char *manifest, store_t *st,
                            const char *prefix, sp_err *err)
{
    return ckpt_sharded_open_mixed(out, manifest, NULL, st, prefix, err);
}

void ckpt_sharded_files_read(const ckpt_sharded *r, int *local, int *remote)
{
    *local = *remote = 0;
    for (int i = 0; r && i < r->nfiles; i++) {
        if (!r->files[i].used)
            continue;
        if (r->local && r->files[i].src == r->local)
            ++*local;
        else
            ++*remote;
    }
}

int ckpt_sharded_ranged(const char *manifest)
{
    json_t *j = json_loads(manifest, 0, NULL);
    ckpt_sharded *r = calloc(1, sizeof *r);
    sp_err e = {0};
    int ok = j && r && parse_manifest(r, j, "MANIFEST.json", &e) == 0 && r->nfiles > 0;
    for (int i = 0; ok && i < r->nfiles; i++)
        ok = r->files[i].ranged;
    json_decref(j);
    ckpt_sharded_close(r);
    return ok;
}

int ckpt_sharded_damaged(const ckpt_sharded *r)
{
    return r && r->damaged;
}

static const shard_tensor *find_tensor(const ckpt_sharded *r, const char *name)
{
    for (int i = 0; i < r->ntensors; i++)
        if (strcmp(r->tensors[i].name, name) == 0)
            return &r->tensors[i];
    return NULL;
}

uint64_t ckpt_sharded_tensor(const ckpt_sharded *r, const char *name, int *ndim,
                             int64_t shape[2])
{
    const shard_tensor *t = find_tensor(r, name);
    if (!t)
        return 0;
    if (ndim)
        *ndim = t->ndim;
    if (shape)
        memcpy(shape, t->shape, sizeof t->shape);
    return t->n;
}

const char *ckpt_sharded_tensor_at(const ckpt_sharded *r, int i, uint64_t *n)
{
    if (i < 0 || i >= r->ntensors)
        return NULL;
    if (n)
        *n = r->tensors[i].n;
    return r->tensors[i].name;
}

const char *ckpt_sharded_file_of(const ckpt_sharded *r, const char *name, uint64_t element)
{
    const shard_tensor *t = find_tensor(r, name);
    if (!t || element >= t->n)
        return NULL;
    uint64_t at = t->offset + element;
    for (int i = 0; i < r->nfiles; i++)
        if (at >= r->files[i].lo && at < r->files[i].hi)
            return r->files[i].name;
    return NULL;
}

const char *ckpt_sharded_where(const ckpt_sharded *r)
{
    return r->dir;
}

static int64_t read_i64_attr(hid_t f, const char *name)
{
    int64_t v = -1;
    hid_t a = H5Aexists(f, name) > 0 ? H5Aopen(f, name, H5P_DEFAULT) : -1;
    if (a < 0 || H5Aread(a, H5T_NATIVE_INT64, &v) < 0)
        v = -1;
    if (a >= 0)
        H5Aclose(a);
    return v;
}

/* Opens file x and its dataset for group g, checking the file is the shard
 * the layout says: its range, and one float32 dimension of that length. */
static int open_group(ckpt_sharded *r, shard_file *x, int g, sp_err *err)
{
    char *path = sp_strf("%s/%s", r->dir, x->name);
    if (!path)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    if (x->f < 0)
        x->f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    int rc = 0;
    if (x->f < 0) {
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: cannot open as HDF5", path);
    } else if (read_i64_attr(x->f, "lo") != (int64_t)x->lo ||
               read_i64_attr(x->f, "hi") != (int64_t)x->hi) {
        rc = sp_fail(err, SP_EXIT_INPUT,
                     "%s: its range is not [%llu, %llu) as MANIFEST.json says", path,
                     (unsigned long long)x->lo, (unsigned long long)x->hi);
    } else {
        hid_t ds = H5Lexists(x->f, ckpt_shard_groups[g], H5P_DEFAULT) > 0
                       ? H5Dopen2(x->f, ckpt_shard_groups[g], H5P_DEFAULT)
                       : -1;
        hid_t sp = ds >= 0 ? H5Dget_space(ds) : -1, ty = ds >= 0 ? H5Dget_type(ds) : -1;
        hsize_t dims = 0;
        int ok = sp >= 0 && H5Sget_simple_extent_ndims(sp) == 1 &&
                 H5Sget_simple_extent_dims(sp, &dims, NULL) == 1 &&
                 dims == (hsize_t)(x->hi - x->lo) && ty >= 0 &&
                 H5Tget_class(ty) == H5T_FLOAT && H5Tget_size(ty) == 4;
        if (sp >= 0)
            H5Sclose(sp);
        if (ty >= 0)
            H5Tclose(ty);
        if (!ok) {
            if (ds >= 0)
                H5Dclose(ds);
            rc = sp_fail(err, SP_EXIT_INPUT,
                         "%s: dataset '%s' is missing or is not %llu float32 values", path,
                         ckpt_shard_groups[g], (unsigned long long)(x->hi - x->lo));
        } else {
            x->ds[g] = ds;
        }
    }
    free(path);
    return rc;
}

/* Block k of file x from store src (key) into buf; *match: whether it
 * matches its SHA-256. */
static int get_checked(const shard_file *x, store_t *src, const char *key, uint64_t k,
                       unsigned char *buf, size_t len, int *match, sp_err *err)
{
    if (store_get_range(src, key, k * x->block_bytes, len, buf, err))
        return err->code ? err->code : SP_EXIT_OTHER;
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned mdlen = 0;
    if (EVP_Digest(buf, len, md, &mdlen, EVP_sha256(), NULL) != 1 || mdlen != 32)
        return sp_fail(err, SP_EXIT_OTHER, "SHA-256 failed");
    *match = memcmp(md, x->sums[k], 32) == 0;
    return 0;
}

/* Block k of file x into buf, checked against its SHA-256. A block of the
 * local copy that does not match is read again from the remote store. */
static int get_block(ckpt_sharded *r, shard_file *x, uint64_t k, unsigned char *buf,
                     int *damaged, sp_err *err)
{
    uint64_t at = k * x->block_bytes;
    size_t len = (size_t)(x->size - at < x->block_bytes ? x->size - at : x->block_bytes);
    int match = 0, local = x->src == r->local;
    if (get_checked(x, x->src, x->key, k, buf, len, &match, err))
        return err->code;
    if (!match && local && r->st) {
        if (!atomic_exchange(&x->warned, 1)) /* once a file (fetch threads share x) */
            fprintf(stderr,
                    "warning: %s/%s: block %llu of this machine's copy does not match its "
                    "SHA-256; reading such blocks from %s/%s\n",
                    r->local_dir, x->name, (unsigned long long)k, r->dir, x->name);
        char *key = sp_strf("%s/%s", r->prefix, x->name);
        int rc = key ? get_checked(x, r->st, key, k, buf, len, &match, err)
                     : sp_fail(err, SP_EXIT_OTHER, "out of memory");
        free(key);
        if (rc)
            return rc;
        local = 0;
    }
    if (!match) {
        *damaged = !local; /* the stored checkpoint is damaged; a local copy is only ours */
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s/%s: bytes [%llu, %llu) (block %llu) do not match their SHA-256 in "
                       "MANIFEST.json: the %s shard is damaged",
                       local ? r->local_dir : r->dir, x->name,
                       (unsigned long long)at, (unsigned long long)(at + len),
                       (unsigned long long)k, local ? "local copy of the" : "stored");
    }
    return 0;
}

/* Whole blocks [k0, k1) of one file fetched straight into their place in
 * dst (block k0 at dst), by up to FETCH_THREADS connections at once. */
#define FETCH_THREADS 4
typedef struct fetch_job {
    ckpt_sharded *r;
    shard_file *x;
    uint64_t k0, k1;
    unsigned char *dst;
    pthread_mutex_t mu;
    uint64_t next;
    int failed, damaged;
    sp_err err;
} fetch_job;

static void *fetch_worker(void *arg)
{
    fetch_job *j = arg;
    for (;;) {
        pthread_mutex_lock(&j->mu);
        uint64_t k = j->failed ? j->k1 : j->next++;
        pthread_mutex_unlock(&j->mu);
        if (k >= j->k1)
            return NULL;
        sp_err e = {0};
        int damaged = 0;
        if (get_block(j->r, j->x, k, j->dst + (k - j->k0) * j->x->block_bytes, &damaged, &e)) {
            pthread_mutex_lock(&j->mu);
            if (!j->failed || (damaged && !j->damaged)) /* a damaged block says most */
                j->err = e;
            j->failed = 1;
            j->damaged |= damaged;
            pthread_mutex_unlock(&j->mu);
        }
    }
}

static void *fetch_thread(void *arg) /* the ones added; the caller fetches too */
{
    sp_name_thread("ckpt-fetch");
    return fetch_worker(arg);
}

static int fetch_blocks(ckpt_sharded *r, shard_file *x, uint64_t k0, uint64_t k1,
                        unsigned char *dst, sp_err *err)
{
    fetch_job j = {.r = r, .x = x, .k0 = k0, .k1 = k1, .dst = dst, .next = k0};
    pthread_mutex_init(&j.mu, NULL);
    pthread_t th[FETCH_THREADS];
    int n = 0;
    for (uint64_t want = k1 - k0 < FETCH_THREADS ? k1 - k0 : FETCH_THREADS; n < (int)want - 1;
         n++)
        if (pthread_create(&th[n], NULL, fetch_thread, &j) != 0)
            break;
    fetch_worker(&j); /* this thread fetches too */
    for (int t = 0; t < n; t++)
        pthread_join(th[t], NULL);
    pthread_mutex_destroy(&j.mu);
    if (!j.failed)
        return 0;
    r->damaged |= j.damaged;
    *err = j.err;
    return err->code ? err->code : SP_EXIT_OTHER;
}

/* Block k of file i into group g's cache slot (kept for the next read). */
static int fetch_cached(ckpt_sharded *r, int i, int g, uint64_t k, sp_err *err)
{
    if (r->cache_file[g] == i && r->cache_block[g] == k)
        return 0;
    r->cache_file[g] = -1;
    if (get_block(r, &r->files[i], k, r->cache[g], &r->damaged, err))
        return err->code;
    r->cache_file[g] = i;
    r->cache_block[g] = k;
    return 0;
}

/* Arena elements [a, b) of group g from file i of a store-backed reader:
 * the blocks the range covers whole straight into dst, in parallel; the
 * first and last, when the range covers them in part, through the cache. */
static int read_ranged(ckpt_sharded *r, int i, int g, uint64_t a, uint64_t b, float *dst,
                       sp_err *err)
{
    shard_file *x = &r->files[i];
    uint64_t B = x->block_bytes;
    uint64_t from = x->off[g] + 4 * (a - x->lo), to = x->off[g] + 4 * (b - x->lo);
    /* whole blocks: [w0, w1) (their ends inside [from, to], or the file's end) */
    uint64_t w0 = (from + B - 1) / B, w1 = to / B;
    if (to == x->size)
        w1 = (to + B - 1) / B;
    char *out = (char *)dst;
    int rc = 0;
    for (uint64_t at = from; at < to && !rc;) {
        uint64_t k = at / B;
        if (k >= w0 && k < w1 && at == k * B) {
            rc = fetch_blocks(r, x, w0, w1, (unsigned char *)out, err);
            uint64_t end = w1 * B < to ? w1 * B : to;
            out += end - at;
            at = end;
            continue;
        }
        uint64_t end = (k + 1) * B < to ? (k + 1) * B : to;
        rc = fetch_cached(r, i, g, k, err);
        if (!rc)
            memcpy(out, r->cache[g] + (at - k * B), (size_t)(end - at));
        out += end - at;
        at = end;
    }
    return rc;
}

/* Arena elements [a, b) of group g from file i into dst. */
static int read_part(ckpt_sharded *r, int i, int g, uint64_t a, uint64_t b, float *dst,
                     sp_err *err)
{
    shard_file *x = &r->files[i];
    x->used = 1;
    if (r->ranged)
        return read_ranged(r, i, g, a, b, dst, err);
    if (x->ds[g] < 0 && open_group(r, x, g, err))
        return err->code;
    hsize_t off = (hsize_t)(a - x->lo), cnt = (hsize_t)(b - a);
    hid_t fsp = H5Dget_space(x->ds[g]);
    hid_t msp = H5Screate_simple(1, &cnt, NULL);
    int bad = fsp < 0 || msp < 0 ||
              H5Sselect_hyperslab(fsp, H5S_SELECT_SET, &off, NULL, &cnt, NULL) < 0 ||
              H5Dread(x->ds[g], H5T_NATIVE_FLOAT, msp, fsp, H5P_DEFAULT, dst) < 0;
    if (fsp >= 0)
        H5Sclose(fsp);
    if (msp >= 0)
        H5Sclose(msp);
    if (bad)
        return sp_fail(err, SP_EXIT_INPUT, "%s/%s: cannot read %s [%llu, %llu)", r->dir, x->name,
                       ckpt_shard_groups[g], (unsigned long long)a, (unsigned long long)b);
    return 0;
}

int ckpt_sharded_read(ckpt_sharded *r, int g, const char *name, uint64_t start, uint64_t count,
                      float *dst, sp_err *err)
{
    const shard_tensor *t = find_tensor(r, name);
    if (!t)
        return sp_fail(err, SP_EXIT_INPUT, "%s: the checkpoint lacks the tensor %s", r->dir,
                       name);
    if (g < 0 || g >= CKPT_SHARD_GROUPS || start + count > t->n)
        return sp_fail(err, SP_EXIT_OTHER, "%s: elements [%llu, %llu) of %s are out of range",
                       r->dir, (unsigned long long)start, (unsigned long long)(start + count),
                       name);
    uint64_t a = t->offset + start, b = a + count;
    for (int i = 0; i < r->nfiles && a < b; i++) {
        shard_file *x = &r->files[i];
        uint64_t lo = a > x->lo ? a : x->lo, hi = b < x->hi ? b : x->hi;
        if (lo >= hi)
            continue;
        if (read_part(r, i, g, lo, hi, dst + (lo - t->offset - start), err))
            return err->code;
    }
    return 0;
}

int ckpt_sharded_load(const char *dir, ckpt_snapshot *s, int g, const char *prefix,
                      sp_err *err)
{
    ckpt_sharded *r;
    if (ckpt_sharded_open(&r, dir, err))
        return err->code;
    int rc = 0;
    for (int i = 0; i < r->ntensors && !rc; i++) {
        const shard_tensor *t = &r->tensors[i];
        char *name = sp_strf("%s%s", prefix, t->name);
        float *buf = name ? ckpt_add_array(s, name, t->ndim, t->shape) : NULL;
        rc = buf ? ckpt_sharded_read(r, g, t->name, 0, t->n, buf, err)
                 : sp_fail(err, SP_EXIT_OTHER, "out of memory");
        free(name);
    }
    ckpt_sharded_close(r);
    return rc;
}
