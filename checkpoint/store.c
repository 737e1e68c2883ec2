/* checkpoint/store.c — the store front end: URL parsing, option defaults,
 * key checks, dispatch to the file:// and s3:// backends, error formatting and
 * the retry policy (exponential backoff with full jitter) the backends share. */
#define _GNU_SOURCE
#include "checkpoint/store_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MIB ((size_t)1 << 20)
/* the sizes S3 allows a multipart upload's part */
#define PART_MIN_BYTES (5 * MIB)
#define PART_MAX_BYTES ((size_t)5 << 30)

/* ---- errors ----------------------------------------------------------------- */

int store_exit_code(int rc)
{
    switch (rc) {
    case STORE_ENOENT: return SP_EXIT_INPUT;
    case STORE_EUSAGE:
    case STORE_ENOBUCKET: return SP_EXIT_USAGE;
    default: return SP_EXIT_OTHER;
    }
}

int store_fail(const store_t *s, sp_err *err, int rc, const char *key, const char *fmt, ...)
{
    char msg[sizeof err->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    const char *url = s && s->url ? s->url : "store";
    if (key && *key)
        sp_fail(err, store_exit_code(rc), "%s/%s: %s", url, key, msg);
    else
        sp_fail(err, store_exit_code(rc), "%s: %s", url, msg);
    return rc;
}

/* ---- keys ------------------------------------------------------------------- */

static int bad_segment(const char *seg, size_t len, int last_of_prefix)
{
    if (last_of_prefix)
        return 0; /* "step-0000" is a plain string prefix */
    if (len == 0)
        return 1;
    return (len == 1 && seg[0] == '.') || (len == 2 && seg[0] == '.' && seg[1] == '.');
}

int store_check_key(const store_t *s, const char *key, int is_prefix, sp_err *err)
{
    size_t len = key ? strlen(key) : 0;
    if (!key || (!is_prefix && len == 0))
        return store_fail(s, err, STORE_EUSAGE, NULL, "empty object key");
    if (len > 1024)
        return store_fail(s, err, STORE_EUSAGE, NULL, "object key longer than 1024 bytes");
    if (key[0] == '/')
        return store_fail(s, err, STORE_EUSAGE, key, "object key starts with '/'");
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)key[i];
        if (c < 0x20 || c == 0x7f)
            return store_fail(s, err, STORE_EUSAGE, NULL, "object key holds a control character");
    }
    const char *seg = key;
    for (;;) {
        const char *slash = strchr(seg, '/');
        size_t n = slash ? (size_t)(slash - seg) : strlen(seg);
        if (len > 0 && bad_segment(seg, n, is_prefix && !slash))
            return store_fail(s, err, STORE_EUSAGE, key,
                              "object key has an empty, '.' or '..' segment");
        if (!slash)
            break;
        seg = slash + 1;
    }
    return 0;
}

/* ---- retry policy ---------------------------------------------------------- */

uint64_t store_rng_seed(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int local;
    return sp_mix64((uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^
                    (uint64_t)(uintptr_t)&local);
}

double store_backoff_s(const store_opts *o, int attempt, uint64_t *rng)
{
    double ceil_s = o->retry_base_s;
    for (int i = 0; i < attempt && ceil_s < o->retry_max_s; i++)
        ceil_s *= 2;
    if (ceil_s > o->retry_max_s)
        ceil_s = o->retry_max_s;
    *rng = sp_mix64(*rng + 0x9e3779b97f4a7c15ULL);
    double u = (double)(*rng >> 11) * (1.0 / 9007199254740992.0);
    return u * ceil_s;
}

int store_sleep(double seconds, store_cancel c1, store_cancel c2)
{
    double end = sp_now() + seconds;
    for (;;) {
        if (store_canceled(c1) || store_canceled(c2))
            return STORE_ECANCELED;
        double left = end - sp_now();
        if (left <= 0)
            return 0;
        struct timespec ts = {0, (long)((left < 0.02 ? left : 0.02) * 1e9)};
        nanosleep(&ts, NULL);
    }
}

/* ---- buffers ---------------------------------------------------------------- */

int membuf_append(membuf *b, const void *data, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n + 1)
            cap *= 2;
        unsigned char *p = realloc(b->p, cap);
        if (!p)
            return -1;
        b->p = p;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->n, data, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

int store_list_add(store_listing *l, size_t *cap, const char *key, uint64_t size)
{
    if (l->n == *cap) {
        size_t c = *cap ? *cap * 2 : 64;
        store_entry *p = realloc(l->items, c * sizeof *p);
        if (!p)
            return -1;
        l->items = p;
        *cap = c;
    }
    char *k = strdup(key);
    if (!k)
        return -1;
    l->items[l->n++] = (store_entry){k, size};
    return 0;
}

void membuf_free(membuf *b)
{
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
}

/* ---- open / close ----------------------------------------------------------- */

static int apply_defaults(store_t *s, const store_opts *in, sp_err *err)
{
    store_opts *o = &s->opts;
    *o = in ? *in : (store_opts){0};
    o->endpoint = o->endpoint && *o->endpoint ? strdup(o->endpoint) : NULL;
    o->region = o->region && *o->region ? strdup(o->region) : NULL;
    if (!o->part_bytes)
        o->part_bytes = 16 * MIB;
    if (!o->parallel)
        o->parallel = 4;
    if (!o->max_retries)
        o->max_retries = 8;
    if (o->max_retries < 0)
        o->max_retries = 0;
    if (o->timeout_s <= 0)
        o->timeout_s = 30;
    if (o->request_deadline_s <= 0)
        o->request_deadline_s = 300;
    if (o->retry_base_s <= 0)
        o->retry_base_s = 0.25;
    if (o->retry_max_s <= 0)
        o->retry_max_s = 20;
    if (o->addressing < STORE_ADDR_AUTO || o->addressing > STORE_ADDR_VHOST)
        return store_fail(s, err, STORE_EUSAGE, NULL, "bad addressing style %d", o->addressing);
    if (o->part_bytes < PART_MIN_BYTES || o->part_bytes > PART_MAX_BYTES)
        return store_fail(s, err, STORE_EUSAGE, NULL,
                          "part size %zu bytes is outside 5 MiB .. 5 GiB", o->part_bytes);
    if (o->parallel < 1 || o->parallel > 64)
        return store_fail(s, err, STORE_EUSAGE, NULL, "parallel %d is outside 1..64",
                          o->parallel);
    return 0;
}

static int percent_decode(char *s)
{
    char *w = s;
    for (const char *r = s; *r; r++) {
        if (*r == '%') {
            unsigned v;
            if (sscanf(r + 1, "%2x", &v) != 1 || !r[1] || !r[2] || v == 0)
                return -1;
            *w++ = (char)v;
            r += 2;
        } else {
            *w++ = *r;
        }
    }
    *w = 0;
    return 0;
}

static int open_file_url(store_t *s, const char *rest, sp_err *err)
{
    const char *local = sp_after(rest, "localhost");
    if (local && *local == '/')
        rest = local;
    if (rest[0] != '/')
        return store_fail(s, err, STORE_EUSAGE, NULL,
                          "file:// URLs need an absolute path (file:///abs/path)");
    char *root = strdup(rest);
    if (!root)
        return store_fail(s, err, STORE_EFAIL, NULL, "out of memory");
    size_t n = strlen(root);
    while (n > 1 && root[n - 1] == '/')
        root[--n] = 0;
    int rc = percent_decode(root) ? store_fail(s, err, STORE_EUSAGE, NULL, "bad %%-escape in URL")
                                  : 0;
    char *url = rc ? NULL : sp_strf("file://%s", strcmp(root, "/") ? root : "");
    if (!rc && !url)
        rc = store_fail(s, err, STORE_EFAIL, NULL, "out of memory");
    if (url) {
        free(s->url);
        s->url = url;
    }
    if (!rc)
        rc = store_file_open(s, root, err);
    free(root);
    return rc;
}

static int valid_bucket(const char *b, size_t n)
{
    if (n < 1 || n > 255)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_", b[i]))
            return 0;
    return 1;
}

static int open_s3_url(store_t *s, const char *rest, sp_err *err)
{
    const char *slash = strchr(rest, '/');
    size_t bn = slash ? (size_t)(slash - rest) : strlen(rest);
    if (!valid_bucket(rest, bn))
        return store_fail(s, err, STORE_EUSAGE, NULL,
                          "bad bucket name in s3:// URL (letters, digits, '.', '-', '_')");
    char *bucket = strndup(rest, bn);
    char *prefix = strdup(slash ? slash + 1 : "");
    int rc = 0;
    if (!bucket || !prefix)
        rc = store_fail(s, err, STORE_EFAIL, NULL, "out of memory");
    size_t pn = prefix ? strlen(prefix) : 0;
    while (pn > 0 && prefix[pn - 1] == '/')
        prefix[--pn] = 0;
    char *url = NULL;
    if (!rc)
        url = pn ? sp_strf("s3://%s/%s", bucket, prefix)
                 : sp_strf("s3://%s", bucket);
    if (!rc && !url)
        rc = store_fail(s, err, STORE_EFAIL, NULL, "out of memory");
    if (url) {
        free(s->url);
        s->url = url;
    }
    if (!rc && pn)
        rc = store_check_key(s, prefix, 0, err);
    if (!rc)
        rc = store_s3_open(s, bucket, prefix, err);
    free(bucket);
    free(prefix);
    return rc;
}

static int open_url(store_t *s, const char *url, const store_opts *opts, sp_err *err)
{
    int rc = apply_defaults(s, opts, err);
    if (rc)
        return rc;
    const char *rest;
    if (url && (rest = sp_after(url, "file://")))
        return open_file_url(s, rest, err);
    if (url && (rest = sp_after(url, "s3://")))
        return open_s3_url(s, rest, err);
    return store_fail(s, err, STORE_EUSAGE, NULL,
                      "unsupported store URL (use file:///abs/path or s3://bucket/prefix)");
}

int store_open(store_t **out, const char *url, const store_opts *opts, sp_err *err)
{
    *out = NULL;
    store_t *s = calloc(1, sizeof *s);
    if (!s || !(s->url = strdup(url ? url : "(null)"))) {
        free(s);
        sp_fail(err, SP_EXIT_OTHER, "store: out of memory");
        return STORE_EFAIL;
    }
    int rc = open_url(s, url, opts, err);
    if (rc) {
        store_close(s);
        return rc;
    }
    *out = s;
    return 0;
}

void store_close(store_t *s)
{
    if (!s)
        return;
    if (s->ops && s->ops->close)
        s->ops->close(s);
    free((char *)s->opts.endpoint);
    free((char *)s->opts.region);
    free(s->url);
    free(s);
}

const char *store_url(const store_t *s)
{
    return s->url;
}

/* ---- dispatch --------------------------------------------------------------- */

int store_put_file(store_t *s, const char *key, const char *local_path, int if_none_match,
                   sp_err *err)
{
    int rc = store_check_key(s, key, 0, err);
    return rc ? rc : s->ops->put_file(s, key, local_path, if_none_match, NULL, err);
}

int store_put_bytes(store_t *s, const char *key, const void *data, size_t n, int if_none_match,
                    sp_err *err)
{
    int rc = store_check_key(s, key, 0, err);
    return rc ? rc : s->ops->put_bytes(s, key, data, n, if_none_match, NULL, err);
}

int store_get_file(store_t *s, const char *key, const char *local_path, sp_err *err)
{
    int rc = store_check_key(s, key, 0, err);
    return rc ? rc : s->ops->get_file(s, key, local_path, NULL, err);
}

int store_get_bytes(store_t *s, const char *key, void **data, size_t *n, sp_err *err)
{
    *data = NULL;
    *n = 0;
    int rc = store_check_key(s, key, 0, err);
    return rc ? rc : s->ops->get_bytes(s, key, data, n, NULL, NULL, err);
}

int store_get_bytes_tag(store_t *s, const char *key, void **data, size_t *n, char *tag,
                        sp_err *err)
{
    *data = NULL;
    *n = 0;
    tag[0] = 0;
    int rc = store_check_key(s, key, 0, err);
    return rc ? rc : s->ops->get_bytes(s, key, data, n, tag, NULL, err);
}

int store_put_bytes_if(store_t *s, const char *key, const void *data, size_t n, const char *tag,
                       sp_err *err)
{
    int rc = store_check_key(s, key, 0, err);
    if (rc)
        return rc;
    if (n > s->opts.part_bytes)
        return store_fail(s, err, STORE_EUSAGE, key,
                          "a conditional put takes at most %zu bytes, not %zu",
                          s->opts.part_bytes, n);
    if (strlen(tag) >= STORE_TAG_MAX)
        return store_fail(s, err, STORE_EUSAGE, key, "a version tag of %zu bytes", strlen(tag));
    return s->ops->put_bytes_if(s, key, data, n, tag, NULL, err);
}

int store_get_range(store_t *s, const char *key, uint64_t off, size_t n, void *dst, sp_err *err)
{
    int rc = store_check_key(s, key, 0, err);
    if (rc || n == 0)
        return rc;
    if (off > UINT64_MAX - n)
        return store_fail(s, err, STORE_EUSAGE, key, "GET failed: the range at %llu overflows",
                          (unsigned long long)off);
    return s->ops->get_range(s, key, off, n, dst, NULL, err);
}

static int cmp_entry(const void *a, const void *b)
{
    return strcmp(((const store_entry *)a)->key, ((const store_entry *)b)->key);
}

int store_list(store_t *s, const char *key_prefix, store_listing *out, sp_err *err)
{
    out->items = NULL;
    out->n = 0;
    const char *p = key_prefix ? key_prefix : "";
    int rc = store_check_key(s, p, 1, err);
    if (!rc)
        rc = s->ops->list(s, p, out, NULL, err);
    if (rc) {
        store_list_free(out);
        return rc;
    }
    if (out->n > 1)
        qsort(out->items, out->n, sizeof *out->items, cmp_entry);
    return 0;
}

void store_list_free(store_listing *l)
{
    if (!l)
        return;
    for (size_t i = 0; i < l->n; i++)
        free(l->items[i].key);
    free(l->items);
    l->items = NULL;
    l->n = 0;
}

int store_delete(store_t *s, const char *key, sp_err *err)
{
    int rc = store_check_key(s, key, 0, err);
    return rc ? rc : s->ops->del(s, key, NULL, err);
}

int store_exists(store_t *s, const char *key, int *exists, uint64_t *size, sp_err *err)
{
    uint64_t sz = 0;
    *exists = 0;
    int rc = store_check_key(s, key, 0, err);
    if (!rc)
        rc = s->ops->exists(s, key, exists, &sz, NULL, err);
    if (size)
        *size = sz;
    return rc;
}

int store_create_bucket(store_t *s, sp_err *err)
{
    return s->ops->create_bucket(s, err);
}
