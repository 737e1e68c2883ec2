/* safetensors: 8-byte little-endian header length, a JSON header
 * {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then data. */
#define _GNU_SOURCE
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_HEADER (100u << 20)

static int parse_dtype(const char *s, dtype_t *dt)
{
    static const struct { const char *name; dtype_t dt; } known[] = {
        {"F32", DT_F32}, {"BF16", DT_BF16}, {"F16", DT_F16}, {"I32", DT_I32}, {"U8", DT_U8}};
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (strcmp(s, known[i].name) == 0) {
            *dt = known[i].dt;
            return 0;
        }
    static const char *const other[] = {"F64", "I64", "U64", "I16", "U16", "I8", "BOOL",
                                        "U32", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", NULL};
    for (int i = 0; other[i]; i++)
        if (strcmp(s, other[i]) == 0)
            return 1; /* known to the format, not supported here */
    return -1;
}

static int parse_entry(st_file *f, st_tensor *t, const char *name, json_t *v, size_t data_len,
                       sp_err *err)
{
    const char *p = f->path;
    if (!json_is_object(v))
        return sp_fail(err, SP_EXIT_INPUT, "%s: tensor '%s': header entry is not an object", p,
                       name);
    json_t *jd = json_object_get(v, "dtype"), *js = json_object_get(v, "shape"),
           *jo = json_object_get(v, "data_offsets");
    if (!json_is_string(jd) || !json_is_array(js) || !json_is_array(jo) ||
        json_array_size(jo) != 2)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: tensor '%s': header entry lacks dtype, shape or data_offsets", p, name);
    int rc = parse_dtype(json_string_value(jd), &t->dt);
    if (rc < 0)
        return sp_fail(err, SP_EXIT_INPUT, "%s: tensor '%s': unknown dtype '%s'", p, name,
                       json_string_value(jd));
    if (rc > 0)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: tensor '%s': dtype %s is not supported (expected F32, BF16 or F16)",
                       p, name, json_string_value(jd));
    size_t nd = json_array_size(js);
    if (nd > ST_MAX_DIMS)
        return sp_fail(err, SP_EXIT_INPUT, "%s: tensor '%s': %zu dimensions", p, name, nd);
    t->ndim = (int)nd;
    t->numel = 1;
    for (size_t i = 0; i < nd; i++) {
        json_t *d = json_array_get(js, i);
        if (!json_is_integer(d) || json_integer_value(d) < 0)
            return sp_fail(err, SP_EXIT_INPUT, "%s: tensor '%s': bad shape", p, name);
        t->shape[i] = json_integer_value(d);
        if (t->shape[i] && t->numel > SIZE_MAX / (size_t)t->shape[i])
            return sp_fail(err, SP_EXIT_INPUT, "%s: tensor '%s': shape overflows", p, name);
        t->numel *= (size_t)t->shape[i];
    }
    json_t *b = json_array_get(jo, 0), *e = json_array_get(jo, 1);
    if (!json_is_integer(b) || !json_is_integer(e) || json_integer_value(b) < 0 ||
        json_integer_value(e) < json_integer_value(b))
        return sp_fail(err, SP_EXIT_INPUT, "%s: tensor '%s': bad data_offsets", p, name);
    size_t begin = (size_t)json_integer_value(b), end = (size_t)json_integer_value(e);
    if (end > data_len)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: tensor '%s': data [%zu, %zu) lies past the end of the file (the file "
                       "is truncated?)",
                       p, name, begin, end);
    if (end - begin != t->numel * dtype_size(t->dt))
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: tensor '%s': %zu bytes of data for %zu elements of %s", p, name,
                       end - begin, t->numel, dtype_name(t->dt));
    t->name = strdup(name);
    if (!t->name)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    t->data = (const char *)f->map + 8 + (f->size - 8 - data_len) + begin;
    return 0;
}

/* qsort order of tensors by where their data starts (then ends) */
static int by_offset(const void *a, const void *b)
{
    const st_tensor *x = *(const st_tensor *const *)a, *y = *(const st_tensor *const *)b;
    const char *xe = (const char *)x->data + x->numel * dtype_size(x->dt);
    const char *ye = (const char *)y->data + y->numel * dtype_size(y->dt);
    if (x->data != y->data)
        return (const char *)x->data < (const char *)y->data ? -1 : 1;
    return xe < ye ? -1 : xe > ye;
}

/* The data section as the format defines it (and the reference library
 * checks): the tensors' byte ranges, in offset order, follow one another
 * from 0 to the end of the file, with no overlap, gap or trailing bytes.
 * Two tensors sharing bytes would load one as the other's values. */
static int check_layout(const st_file *f, size_t data_len, sp_err *err)
{
    if (!f->n)
        return data_len ? sp_fail(err, SP_EXIT_INPUT,
                                  "%s: %zu bytes of data but no tensors in the header", f->path,
                                  data_len)
                        : 0;
    const st_tensor **order = malloc(sizeof *order * f->n);
    if (!order)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    for (size_t i = 0; i < f->n; i++)
        order[i] = &f->tensors[i];
    qsort(order, f->n, sizeof *order, by_offset);
    const char *base = (const char *)f->map + (f->size - data_len);
    size_t at = 0;
    const st_tensor *prev = NULL;
    int rc = 0;
    for (size_t i = 0; i < f->n && !rc; i++) {
        const st_tensor *t = order[i];
        size_t begin = (size_t)((const char *)t->data - base);
        size_t end = begin + t->numel * dtype_size(t->dt);
        if (begin < at)
            rc = sp_fail(err, SP_EXIT_INPUT,
                         "%s: tensor '%s': data [%zu, %zu) overlaps tensor '%s' (which ends at "
                         "%zu): bad data_offsets",
                         f->path, t->name, begin, end, prev->name, at);
        else if (begin > at)
            rc = sp_fail(err, SP_EXIT_INPUT,
                         "%s: tensor '%s': data [%zu, %zu) leaves bytes [%zu, %zu) that no "
                         "tensor holds: bad data_offsets",
                         f->path, t->name, begin, end, at, begin);
        at = end, prev = t;
    }
    if (!rc && at != data_len)
        rc = sp_fail(err, SP_EXIT_INPUT,
                     "%s: the tensors' data ends at byte %zu of the %zu after the header: the "
                     "file has trailing bytes no tensor holds",
                     f->path, at, data_len);
    free(order);
    return rc;
}

static int parse_header(st_file *f, const char *hdr, size_t hlen, size_t data_len, sp_err *err)
{
    json_error_t je;
    json_t *root = json_loadb(hdr, hlen, 0, &je);
    if (!root)
        return sp_fail(err, SP_EXIT_INPUT, "%s: header is not valid JSON: %s (at byte %d)",
                       f->path, je.text, je.position);
    int rc = 0;
    if (!json_is_object(root)) {
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: header is not a JSON object", f->path);
        goto out;
    }
    f->tensors = calloc(json_object_size(root) + 1, sizeof *f->tensors);
    if (!f->tensors) {
        rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
        goto out;
    }
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val)
    {
        if (strcmp(key, "__metadata__") == 0) {
            f->metadata_json = json_dumps(val, JSON_COMPACT);
            continue;
        }
        rc = parse_entry(f, &f->tensors[f->n], key, val, data_len, err);
        if (rc)
            goto out;
        f->n++;
    }
    rc = check_layout(f, data_len, err);
out:
    json_decref(root);
    return rc;
}

int st_open(st_file *f, const char *path, sp_err *err)
{
    memset(f, 0, sizeof *f);
    f->path = strdup(path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return sp_fail(err, SP_EXIT_INPUT, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return sp_fail(err, SP_EXIT_INPUT, "%s: not a regular file", path);
    }
    f->size = (size_t)sb.st_size;
    if (f->size < 8) {
        close(fd);
        return sp_fail(err, SP_EXIT_INPUT, "%s: %zu bytes is too short for a safetensors file",
                       path, f->size);
    }
    f->map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        return sp_fail(err, SP_EXIT_INPUT, "%s: cannot map: %s", path, strerror(errno));
    }
    const unsigned char *b = f->map;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | b[i];
    if (hlen > f->size - 8)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: header length %llu runs past the end of the file (%zu bytes)", path,
                       (unsigned long long)hlen, f->size);
    if (hlen > MAX_HEADER)
        return sp_fail(err, SP_EXIT_INPUT, "%s: header length %llu is implausibly large", path,
                       (unsigned long long)hlen);
    madvise(f->map, f->size, MADV_SEQUENTIAL);
    return parse_header(f, (const char *)b + 8, (size_t)hlen, f->size - 8 - (size_t)hlen, err);
}

void st_close(st_file *f)
{
    for (size_t i = 0; i < f->n; i++)
        free(f->tensors[i].name);
    free(f->tensors);
    free(f->metadata_json);
    if (f->map)
        munmap(f->map, f->size);
    free(f->path);
    memset(f, 0, sizeof *f);
}

/* Elements [lo, hi) of a float tensor's bits: how many are NaN or infinite
 * (exponent all ones), with no branch in the loop (it vectorizes). */
static size_t count_non_finite(const void *data, dtype_t dt, size_t lo, size_t hi)
{
    size_t bad = 0;
    if (dt == DT_F32) {
        const uint32_t *x = data;
        for (size_t i = lo; i < hi; i++)
            bad += (x[i] & 0x7f800000u) == 0x7f800000u;
    } else {
        const uint16_t *x = data;
        uint16_t e = dt == DT_BF16 ? 0x7f80 : 0x7c00;
        for (size_t i = lo; i < hi; i++)
            bad += (uint16_t)(x[i] & e) == e;
    }
    return bad;
}

#define FINITE_BLOCK ((size_t)1 << 16)

int st_check_finite(const st_file *f, const st_tensor *t, sp_err *err)
{
    if (t->dt != DT_F32 && t->dt != DT_BF16 && t->dt != DT_F16)
        return 0;
    size_t n = t->numel, nb = (n + FINITE_BLOCK - 1) / FINITE_BLOCK, bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad)
    for (size_t b = 0; b < nb; b++) {
        size_t lo = b * FINITE_BLOCK;
        bad += count_non_finite(t->data, t->dt, lo, lo + FINITE_BLOCK < n ? lo + FINITE_BLOCK : n);
    }
    if (!bad)
        return 0;
    size_t first = 0;
    while (!count_non_finite(t->data, t->dt, first, first + 1))
        first++;
    float v = 0.0f;
    dtype_convert(&v, DT_F32, (const char *)t->data + first * dtype_size(t->dt), t->dt, 1);
    return sp_fail(err, SP_EXIT_INPUT,
                   "%s: tensor '%s' holds %zu value(s) that are not finite, the first %g at "
                   "element %zu of %zu: the file is damaged, or was saved from a run that "
                   "diverged",
                   f->path, t->name, bad, (double)v, first, n);
}

const st_tensor *st_find(const st_file *f, const char *name)
{
    for (size_t i = 0; i < f->n; i++)
        if (strcmp(f->tensors[i].name, name) == 0)
            return &f->tensors[i];
    return NULL;
}

/* ---- writing ------------------------------------------------------------- */

static char *build_header(const st_entry *e, size_t n, const char *const *meta, size_t n_meta,
                          size_t *hlen)
{
    json_t *root = json_object();
    size_t off = 0;
    if (n_meta) {
        json_t *m = json_object();
        for (size_t i = 0; i < n_meta; i++)
            json_object_set_new(m, meta[2 * i], json_string(meta[2 * i + 1]));
        json_object_set_new(root, "__metadata__", m);
    }
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_object(), *shape = json_array();
        size_t numel = 1;
        for (int d = 0; d < e[i].ndim; d++) {
            json_array_append_new(shape, json_integer(e[i].shape[d]));
            numel *= (size_t)e[i].shape[d];
        }
        size_t bytes = numel * dtype_size(e[i].dt);
        json_object_set_new(t, "dtype", json_string(dtype_name(e[i].dt)));
        json_object_set_new(t, "shape", shape);
        json_object_set_new(t, "data_offsets",
                            json_pack("[II]", (json_int_t)off, (json_int_t)(off + bytes)));
        json_object_set_new(root, e[i].name, t);
        off += bytes;
    }
    char *s = json_dumps(root, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(root);
    if (!s)
        return NULL;
    size_t len = strlen(s), padded = (len + 7) & ~(size_t)7;
    char *h = realloc(s, padded + 1);
    if (!h) {
        free(s);
        return NULL;
    }
    memset(h + len, ' ', padded - len); /* the format pads with spaces */
    h[padded] = 0;
    *hlen = padded;
    return h;
}

static int write_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

size_t st_entry_bytes(const st_entry *e)
{
    size_t numel = 1;
    for (int d = 0; d < e->ndim; d++)
        numel *= (size_t)e->shape[d];
    return numel * dtype_size(e->dt);
}

int st_write(const char *path, const st_entry *e, size_t n, const char *const *meta,
             size_t n_meta, sp_err *err)
{
    return st_write_fetch(path, e, n, meta, n_meta, NULL, NULL, err);
}

static int write_entry(int fd, const st_entry *e, size_t i, st_fetch_fn fetch, void *ctx,
                       sp_err *err)
{
    size_t bytes = st_entry_bytes(e);
    if (e->data)
        return write_all(fd, e->data, bytes) ? sp_fail(err, SP_EXIT_OTHER, "write failed") : 0;
    void *buf = malloc(bytes ? bytes : 1);
    if (!buf)
        return sp_fail(err, SP_EXIT_OTHER, "out of host memory writing '%s'", e->name);
    int rc = fetch ? fetch(ctx, i, buf, err)
                   : sp_fail(err, SP_EXIT_OTHER, "no data for tensor '%s'", e->name);
    if (!rc && write_all(fd, buf, bytes))
        rc = sp_fail(err, SP_EXIT_OTHER, "write failed");
    free(buf);
    return rc;
}

/* st_write_fetch's file, written as tmp and renamed to path. */
static int write_file(const char *tmp, const char *path, const char *hdr, size_t hlen,
                      const st_entry *e, size_t n, st_fetch_fn fetch, void *ctx, sp_err *err)
{
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot create: %s", tmp, strerror(errno));
    unsigned char len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    int bad = write_all(fd, len8, 8) || write_all(fd, hdr, hlen);
    int rc = 0;
    for (size_t i = 0; i < n && !bad && !rc; i++)
        rc = write_entry(fd, &e[i], i, fetch, ctx, err);
    if (!bad && !rc)
        bad = fsync(fd);
    if (close(fd) != 0)
        bad = 1;
    if (rc) {
        unlink(tmp);
        sp_err_prefix(err, "%s: ", path);
        return rc;
    }
    if (bad || rename(tmp, path) != 0) {
        int saved = errno;
        unlink(tmp);
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot write: %s", path, strerror(saved));
    }
    return 0;
}

int st_write_fetch(const char *path, const st_entry *e, size_t n, const char *const *meta,
                   size_t n_meta, st_fetch_fn fetch, void *ctx, sp_err *err)
{
    size_t hlen;
    char *hdr = build_header(e, n, meta, n_meta, &hlen);
    if (!hdr)
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot build the safetensors header", path);
    char *tmp = sp_strf("%s.tmp-%d", path, (int)getpid());
    if (!tmp) {
        free(hdr);
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    }
    int rc = write_file(tmp, path, hdr, hlen, e, n, fetch, ctx, err);
    free(tmp);
    free(hdr);
    return rc;
}
