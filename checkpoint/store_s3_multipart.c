/* checkpoint/store_s3_multipart.c — large objects on s3://: multipart upload
 * (CreateMultipartUpload, UploadPart over `parallel` threads with one curl
 * handle each, CompleteMultipartUpload, AbortMultipartUpload on failure) and
 * parallel ranged GET into a file, every range pinned to the object's ETag
 * with If-Match so that a concurrent overwrite is detected. Each part and range
 * is retried on its own (s3_call); the first failure stops the siblings. */
#define _GNU_SOURCE
#include "checkpoint/store_s3.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_PARTS 10000 /* AWS's limit; Swift's default is 1000 (see docs) */

typedef struct par_job par_job;
typedef int (*par_fn)(par_job *j, size_t idx, void **scratch, sp_err *err);

struct par_job {
    store_t *s;
    const char *key;
    uint64_t size, chunk;
    size_t nchunks;
    par_fn fn;
    store_cancel cancel;  /* the caller's */
    atomic_int stop;      /* a sibling failed */
    pthread_mutex_t mu;
    size_t next;
    int rc;               /* first failure */
    sp_err err;
    /* upload */
    const s3_src *src;
    const char *upload_query; /* "uploadId=..." */
    char (*etags)[160];
    /* download */
    int fd;
    const char *etag;
};

static int take(par_job *j, size_t *idx)
{
    int ok = 0;
    pthread_mutex_lock(&j->mu);
    if (j->next < j->nchunks && !atomic_load(&j->stop) && !store_canceled(j->cancel)) {
        *idx = j->next++;
        ok = 1;
    }
    pthread_mutex_unlock(&j->mu);
    return ok;
}

static void record(par_job *j, int rc, const sp_err *e)
{
    pthread_mutex_lock(&j->mu);
    if (!j->rc) {
        j->rc = rc;
        j->err = *e;
    }
    pthread_mutex_unlock(&j->mu);
    atomic_store(&j->stop, 1);
}

static void *worker(void *arg)
{
    par_job *j = arg;
    void *scratch = NULL;
    size_t idx;
    while (take(j, &idx)) {
        sp_err e = {0};
        int rc = j->fn(j, idx, &scratch, &e);
        if (rc) {
            record(j, rc, &e);
            break;
        }
    }
    free(scratch);
    return NULL;
}

/* The threads run_parallel adds (the caller runs worker itself) */
static void *part_thread(void *arg)
{
    sp_name_thread(STORE_PART_THREAD);
    return worker(arg);
}

/* Runs fn over every chunk on up to `parallel` threads (this one included). */
static int run_parallel(par_job *j, sp_err *err)
{
    pthread_t tids[64];
    size_t want = (size_t)j->s->opts.parallel < j->nchunks ? (size_t)j->s->opts.parallel
                                                           : j->nchunks;
    size_t made = 0;
    pthread_mutex_init(&j->mu, NULL);
    atomic_init(&j->stop, 0);
    for (size_t i = 1; i < want && i < 64; i++)
        if (pthread_create(&tids[made], NULL, part_thread, j) == 0)
            made++; /* fewer threads is slower, not wrong */
    worker(j);
    for (size_t i = 0; i < made; i++)
        pthread_join(tids[i], NULL);
    pthread_mutex_destroy(&j->mu);
    if (!j->rc && store_canceled(j->cancel))
        return store_fail(j->s, err, STORE_ECANCELED, j->key, "transfer canceled");
    if (j->rc && err && !err->code)
        *err = j->err;
    return j->rc;
}

/* ---- multipart upload ------------------------------------------------------- */

static int pread_fully(int fd, void *buf, size_t n, uint64_t off)
{
    for (size_t got = 0; got < n;) {
        ssize_t k = pread(fd, (char *)buf + got, n - got, (off_t)(off + got));
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return k < 0 ? errno : EIO; /* EIO: the file shrank while being uploaded */
        got += (size_t)k;
    }
    return 0;
}

static int upload_part(par_job *j, size_t idx, void **scratch, sp_err *err)
{
    uint64_t off = (uint64_t)idx * j->chunk;
    size_t len = (size_t)(j->size - off < j->chunk ? j->size - off : j->chunk);
    const unsigned char *data = j->src->mem ? j->src->mem + off : NULL;
    if (!data) {
        if (!*scratch && !(*scratch = malloc(j->chunk)))
            return store_fail(j->s, err, STORE_EFAIL, j->key, "UploadPart: out of memory");
        int e = pread_fully(j->src->fd, *scratch, len, off);
        if (e)
            return store_fail(j->s, err, STORE_ELOCAL, j->key, "UploadPart %zu: read: %s",
                              idx + 1, strerror(e));
        data = *scratch;
    }
    char sha[65], what[40];
    s3_sha256_hex(data, len, sha);
    snprintf(what, sizeof what, "UploadPart %zu", idx + 1);
    char *query = sp_strf("partNumber=%zu&%s", idx + 1, j->upload_query);
    if (!query)
        return store_fail(j->s, err, STORE_EFAIL, j->key, "UploadPart: out of memory");
    s3_req r = {.method = "PUT", .what = what, .key = j->key, .query = query, .body = data,
                .body_len = len, .body_sha = sha, .fd = -1, .cancel2 = &j->stop};
    int rc = s3_call(j->s, &r, j->cancel, err);
    free(query);
    if (!rc && !r.etag[0])
        rc = store_fail(j->s, err, STORE_EFAIL, j->key, "%s: no ETag in the answer", what);
    if (!rc)
        memcpy(j->etags[idx], r.etag, sizeof r.etag);
    s3_req_free(&r);
    return rc;
}

static int create_upload(store_t *s, const char *key, char **upload_query, store_cancel c,
                         sp_err *err)
{
    membuf body = {0};
    s3_req r = {.method = "POST", .what = "CreateMultipartUpload", .key = key,
                .query = "uploads=", .out = &body, .fd = -1,
                .hdr = {"Content-Type: application/octet-stream"}};
    int rc = s3_call(s, &r, c, err);
    char *id = rc ? NULL : s3_xml_find(&body, "UploadId");
    char *enc = id ? s3_uri_encode(id, 0) : NULL;
    if (!rc && !enc)
        rc = store_fail(s, err, STORE_EFAIL, key, "CreateMultipartUpload: no UploadId in the answer");
    if (!rc && !(*upload_query = sp_strf("uploadId=%s", enc)))
        rc = store_fail(s, err, STORE_EFAIL, key, "out of memory");
    free(id);
    free(enc);
    s3_req_free(&r);
    membuf_free(&body);
    return rc;
}

/* When the upload was cancelled (a stop is waiting on it, the store may be
 * hung) the abort gets one short try, so cancelling stays prompt. */
static void abort_upload(store_t *s, const char *key, const char *upload_query, store_cancel c)
{
    int cancelled = c && atomic_load(c);
    s3_req r = {.method = "DELETE", .what = "AbortMultipartUpload", .key = key,
                .query = upload_query, .fd = -1, .tries = cancelled ? 1 : 2,
                .stall_s = cancelled ? 2 : 10};
    s3_call(s, &r, NULL, NULL); /* best effort: a lifecycle rule can clean up the rest */
    s3_req_free(&r);
}

static char *complete_body(char (*etags)[160], size_t n)
{
#define APPEND_LIT(b, lit) membuf_append(b, lit, SP_LEN(lit))
    membuf b = {0};
    int bad = APPEND_LIT(&b, "<CompleteMultipartUpload>");
    for (size_t i = 0; i < n && !bad; i++) {
        char part[256];
        int len = snprintf(part, sizeof part, "<Part><PartNumber>%zu</PartNumber><ETag>", i + 1);
        bad |= membuf_append(&b, part, (size_t)len);
        for (const char *e = etags[i]; *e && !bad; e++) /* ETags are quoted hex; escape anyway */
            bad |= *e == '&'   ? APPEND_LIT(&b, "&amp;")
                   : *e == '<' ? APPEND_LIT(&b, "&lt;")
                               : membuf_append(&b, e, 1);
        bad |= APPEND_LIT(&b, "</ETag></Part>");
    }
    bad |= APPEND_LIT(&b, "</CompleteMultipartUpload>");
#undef APPEND_LIT
    if (bad)
        membuf_free(&b);
    return (char *)b.p;
}

/* A Complete whose answer was lost is retried and gets 404 NoSuchUpload: the
 * object is there if its ETag says it has n parts. */
static int completed_meanwhile(store_t *s, const char *key, size_t n, store_cancel c)
{
    int exists = 0;
    uint64_t size;
    char etag[160], suffix[32];
    if (s3_head(s, key, &exists, &size, etag, c, NULL) || !exists)
        return 0;
    snprintf(suffix, sizeof suffix, "-%zu\"", n);
    size_t el = strlen(etag), sl = strlen(suffix);
    return (el >= sl && !strcmp(etag + el - sl, suffix)) ||
           (el >= sl - 1 && !strncmp(etag + el - (sl - 1), suffix, sl - 1));
}

static int complete_upload(store_t *s, const char *key, const char *upload_query,
                           char (*etags)[160], size_t n, store_cancel c, sp_err *err)
{
    char *xml = complete_body(etags, n), sha[65];
    if (!xml)
        return store_fail(s, err, STORE_EFAIL, key, "out of memory");
    s3_sha256_hex(xml, strlen(xml), sha);
    membuf resp = {0};
    double stall = s->opts.timeout_s > 120 ? s->opts.timeout_s : 120; /* stores assemble first */
    s3_req r = {.method = "POST", .what = "CompleteMultipartUpload", .key = key,
                .query = upload_query, .body = xml, .body_len = strlen(xml), .body_sha = sha,
                .out = &resp, .fd = -1, .body_may_be_error = 1, .stall_s = stall,
                .hdr = {"Content-Type: application/xml"}};
    sp_err e1 = {0};
    int rc = s3_call(s, &r, c, &e1);
    if (rc == STORE_ENOENT && r.attempts > 1 && completed_meanwhile(s, key, n, c))
        rc = 0;
    if (rc && err && !err->code)
        *err = e1;
    s3_req_free(&r);
    membuf_free(&resp);
    free(xml);
    return rc;
}

static uint64_t part_size(const store_t *s, uint64_t size)
{
    uint64_t p = s->opts.part_bytes;
    while ((size + p - 1) / p > MAX_PARTS)
        p *= 2;
    return p;
}

int s3_put_multipart(store_t *s, const char *key, const s3_src *src, int inm, store_cancel c,
                     sp_err *err)
{
    if (inm) { /* conditional Complete is not widely supported: check first */
        int exists = 0;
        uint64_t size;
        int rc = s3_head(s, key, &exists, &size, NULL, c, err);
        if (rc || exists)
            return rc ? rc
                      : store_fail(s, err, STORE_EEXIST, key, "PUT failed: the object already exists");
    }
    par_job j = {.s = s, .key = key, .size = src->size, .chunk = part_size(s, src->size),
                 .fn = upload_part, .cancel = c, .src = src, .fd = -1};
    j.nchunks = (size_t)((j.size + j.chunk - 1) / j.chunk);
    char *upload_query = NULL;
    int rc = create_upload(s, key, &upload_query, c, err);
    if (rc)
        return rc;
    j.upload_query = upload_query;
    j.etags = calloc(j.nchunks, sizeof *j.etags);
    rc = j.etags ? run_parallel(&j, err) : store_fail(s, err, STORE_EFAIL, key, "out of memory");
    if (!rc)
        rc = complete_upload(s, key, upload_query, j.etags, j.nchunks, c, err);
    if (rc)
        abort_upload(s, key, upload_query, c);
    free(j.etags);
    free(upload_query);
    return rc;
}

/* ---- ranged GET ------------------------------------------------------------- */

static int get_range(par_job *j, size_t idx, void **scratch, sp_err *err)
{
    (void)scratch; /* the range goes straight to the file at its offset */
    uint64_t off = (uint64_t)idx * j->chunk;
    uint64_t end = (off + j->chunk < j->size ? off + j->chunk : j->size) - 1;
    char if_match[200] = "";
    if (j->etag[0])
        snprintf(if_match, sizeof if_match, "If-Match: %s", j->etag);
    s3_req r = {.method = "GET", .key = j->key, .fd = j->fd, .off = off, .end = end,
                .hdr = {j->etag[0] ? if_match : NULL}, .cancel2 = &j->stop};
    sp_err e1 = {0};
    int rc = s3_call(j->s, &r, j->cancel, &e1);
    if (rc == STORE_EEXIST) /* 412: If-Match failed */
        rc = store_fail(j->s, err, STORE_EFAIL, j->key,
                        "GET failed: the object changed during the download");
    else if (rc && err && !err->code)
        *err = e1;
    else if (!rc && r.got != end - off + 1)
        rc = store_fail(j->s, err, STORE_EFAIL, j->key, "GET failed: short read at %llu",
                        (unsigned long long)(off + r.got));
    s3_req_free(&r);
    return rc;
}

int s3_get_ranges(store_t *s, const char *key, int fd, uint64_t size, const char *etag,
                  store_cancel c, sp_err *err)
{
    par_job j = {.s = s, .key = key, .size = size, .chunk = s->opts.part_bytes, .fn = get_range,
                 .cancel = c, .fd = fd, .etag = etag ? etag : ""};
    j.nchunks = (size_t)((size + j.chunk - 1) / j.chunk);
    return run_parallel(&j, err);
}
