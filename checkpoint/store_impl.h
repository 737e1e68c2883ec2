/* checkpoint/store_impl.h — private to the store modules: the backend
 * interface (one table of functions per URL scheme), the store record, and
 * the routines backends share (key checks, error formatting, retry backoff,
 * growable buffers, local temporary files). Not for use outside checkpoint/. */
#ifndef SPOTUNE_STORE_IMPL_H
#define SPOTUNE_STORE_IMPL_H

#include "checkpoint/store.h"

#include <stdarg.h>

typedef const atomic_int *store_cancel;

/* One backend. Keys reaching these are already checked. `cancel` may be NULL. */
typedef struct store_ops {
    int (*put_file)(store_t *s, const char *key, const char *path, int inm, store_cancel c,
                    sp_err *err);
    int (*put_bytes)(store_t *s, const char *key, const void *data, size_t n, int inm,
                     store_cancel c, sp_err *err);
    int (*get_file)(store_t *s, const char *key, const char *path, store_cancel c, sp_err *err);
    int (*get_bytes)(store_t *s, const char *key, void **data, size_t *n, char *tag,
                     store_cancel c, sp_err *err); /* tag: NULL or STORE_TAG_MAX bytes */
    int (*put_bytes_if)(store_t *s, const char *key, const void *data, size_t n,
                        const char *tag, store_cancel c, sp_err *err); /* n <= part_bytes */
    int (*get_range)(store_t *s, const char *key, uint64_t off, size_t n, void *dst,
                     store_cancel c, sp_err *err); /* n > 0 */
    int (*list)(store_t *s, const char *prefix, store_listing *out, store_cancel c, sp_err *err);
    int (*del)(store_t *s, const char *key, store_cancel c, sp_err *err);
    int (*exists)(store_t *s, const char *key, int *exists, uint64_t *size, store_cancel c,
                  sp_err *err);
    int (*create_bucket)(store_t *s, sp_err *err);
    void (*close)(store_t *s);
} store_ops;

struct store {
    const store_ops *ops;
    char *url;       /* shown in messages; no credentials */
    store_opts opts; /* defaults applied; endpoint and region are NULL or owned copies */
    void *impl;      /* the backend's own state */
};

/* Backend constructors: fill s->ops, s->impl (s->url and s->opts are set). */
int store_file_open(store_t *s, const char *root, sp_err *err);
int store_s3_open(store_t *s, const char *bucket, const char *prefix, sp_err *err);

/* Records "URL/KEY: message" (key may be NULL) with the exit code rc maps to;
 * returns rc. */
int store_fail(const store_t *s, sp_err *err, int rc, const char *key, const char *fmt, ...)
    SP_PRINTF(5, 6);
int store_exit_code(int rc);
/* Checks a key (is_prefix: may be empty and end with '/'). */
int store_check_key(const store_t *s, const char *key, int is_prefix, sp_err *err);

/* Retry policy: full jitter, uniform in [0, min(retry_max_s, retry_base_s * 2^attempt)). */
double store_backoff_s(const store_opts *o, int attempt, uint64_t *rng);
uint64_t store_rng_seed(void);
/* Sleeps, waking early when either flag (each may be NULL) is raised:
 * 0 or STORE_ECANCELED. */
int store_sleep(double seconds, store_cancel c1, store_cancel c2);
static inline int store_canceled(store_cancel c)
{
    return c && atomic_load(c);
}

/* A growable byte buffer, always NUL-terminated past n. */
typedef struct membuf {
    unsigned char *p;
    size_t n, cap;
} membuf;
int membuf_append(membuf *b, const void *data, size_t n); /* 0 or -1 (out of memory) */
/* Appends a copy of key to l (cap: its allocated length): 0 or -1. */
int store_list_add(store_listing *l, size_t *cap, const char *key, uint64_t size);
void membuf_free(membuf *b);

/* Local files (store_file.c): a temporary file beside `path` (mkstemp, name
 * starting STORE_TMP_MARK), and publishing it: fsync, then rename (or link when
 * noreplace: EEXIST if the target exists), then fsync the directory.
 * Return 0 or an errno value. */
#define STORE_TMP_MARK ".spotune-tmp."
int store_local_tmp(const char *path, char **tmp_path, int *fd);
int store_local_publish(int fd, const char *tmp_path, const char *path, int noreplace);
int store_local_mkdirs(const char *dir);            /* mkdir -p */
int store_local_mkparents(const char *path);        /* mkdir -p dirname(path) */
int store_local_read(const char *path, void **data, size_t *n); /* whole file, NUL-terminated */
void store_local_rmtree(const char *dir);           /* best effort */
/* Every regular file below dir (names starting with STORE_TMP_MARK skipped),
 * as a path relative to the top prefixed with rel ("a/b.h5"): file() for
 * each, into directories only where enter() (NULL: always) says so. Stops at
 * the first non-zero return or a raised cancel (ECANCELED); returns 0 or an
 * errno. tolerant: entries removed meanwhile are not errors, and links are
 * not followed (a listing of a live store); else every error counts. */
typedef struct store_walk {
    int (*file)(void *ctx, const char *rel, uint64_t size);
    int (*enter)(void *ctx, const char *rel);
    void *ctx;
    store_cancel cancel;
    int tolerant;
} store_walk;
int store_local_walk(const char *dir, const char *rel, const store_walk *w);

#endif
