/* checkpoint/store_s3.c — the s3:// backend's operations: endpoint,
 * addressing and region resolution (credentials: store_s3_creds.c),
 * single-request PUT/GET/HEAD/DELETE, conditional PUT (If-None-Match,
 * If-Match) with its fallback for stores that reject the header
 * (remembered per handle), ListObjectsV2
 * with continuation tokens, and CreateBucket. Requests and retries are in
 * store_s3_request.c; multipart uploads and ranged GETs in
 * store_s3_multipart.c. Thread safety: the backend record is read-only after
 * open, except the mutex-guarded handle pool, the atomic flag and the
 * credentials (their own mutex). */
#define _GNU_SOURCE
#include "checkpoint/store_s3.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* libcurl and libxml2 need one process-wide initialisation. */
static pthread_once_t libs_once = PTHREAD_ONCE_INIT;
static CURLcode libs_rc = CURLE_FAILED_INIT; /* written once, inside pthread_once */

static void libs_init(void)
{
    libs_rc = curl_global_init(CURL_GLOBAL_DEFAULT);
    xmlInitParser();
}

/* ---- single-request operations ------------------------------------------- */

int s3_head(store_t *s, const char *key, int *exists, uint64_t *size, char etag[160],
            store_cancel c, sp_err *err)
{
    s3_req r = {.method = "HEAD", .key = key, .fd = -1};
    sp_err e1 = {0};
    int rc = s3_call(s, &r, c, &e1);
    *exists = rc == 0;
    *size = rc == 0 ? r.content_length : 0;
    if (etag)
        snprintf(etag, 160, "%s", rc == 0 ? r.etag : "");
    if (rc == STORE_ENOENT)
        rc = 0;
    else if (rc)
        s3_err_take(err, &e1);
    s3_req_free(&r);
    return rc;
}

static int put_plain(store_t *s, const char *key, const void *data, size_t n, const char *sha,
                     const char *cond, store_cancel c, sp_err *err, s3_req *out)
{
    s3_req r = {.method = "PUT", .key = key, .body = data, .body_len = n, .body_sha = sha,
                .fd = -1, .hdr = {"Content-Type: application/octet-stream", cond}};
    int rc = s3_call(s, &r, c, err);
    if (out)
        *out = r;
    else
        s3_req_free(&r);
    return rc;
}

/* The object is not as the put required: it exists (a create), or it is
 * missing or has another ETag (a replace). */
static int conflict_fail(store_t *s, const char *key, int create, sp_err *err)
{
    return store_fail(s, err, STORE_EEXIST, key, "PUT failed: %s",
                      create ? "the object already exists" : "the object is no longer as read");
}

/* A PUT that must find the object absent (tag "": If-None-Match: *) or as
 * read (its ETag tag: If-Match). Where the store answers that header with
 * 501 (remembered per handle and header), a HEAD compares first and a plain
 * PUT follows, which is not atomic against a concurrent writer. AWS answers
 * If-Match on a missing object with 404: not as read either. */
static int put_checked(store_t *s, const char *key, const void *data, size_t n, const char *tag,
                       store_cancel c, sp_err *err)
{
    s3_backend *b = s->impl;
    int create = !tag[0];
    atomic_int *unsupported = create ? &b->inm_unsupported : &b->im_unsupported;
    char sha[65], cond[STORE_TAG_MAX + 16];
    s3_sha256_hex(data, n, sha);
    if (create)
        snprintf(cond, sizeof cond, "If-None-Match: *");
    else
        snprintf(cond, sizeof cond, "If-Match: %s", tag);
    if (!atomic_load(unsupported)) {
        sp_err e1 = {0};
        s3_req r;
        int rc = put_plain(s, key, data, n, sha, cond, c, &e1, &r);
        int notimpl = r.status == 501 || (r.status == 400 && !strcmp(r.code, "NotImplemented"));
        s3_req_free(&r);
        if (rc == STORE_EEXIST || (!create && rc == STORE_ENOENT))
            return conflict_fail(s, key, create, err);
        if (rc == 0 || !notimpl) {
            s3_err_take(err, &e1);
            return rc;
        }
        atomic_store(unsupported, 1);
    }
    int exists = 0;
    uint64_t size;
    char now[160];
    int rc = s3_head(s, key, &exists, &size, now, c, err);
    if (!rc && (create ? exists : (!exists || strcmp(now, tag) != 0)))
        return conflict_fail(s, key, create, err);
    return rc ? rc : put_plain(s, key, data, n, sha, NULL, c, err, NULL);
}

static int put_small(store_t *s, const char *key, const void *data, size_t n, int inm,
                     store_cancel c, sp_err *err)
{
    if (inm)
        return put_checked(s, key, data, n, "", c, err);
    char sha[65];
    s3_sha256_hex(data, n, sha);
    return put_plain(s, key, data, n, sha, NULL, c, err, NULL);
}

static int s3_put_bytes_if(store_t *s, const char *key, const void *data, size_t n,
                           const char *tag, store_cancel c, sp_err *err)
{
    return put_checked(s, key, data, n, tag, c, err);
}

static int s3_put_bytes(store_t *s, const char *key, const void *data, size_t n, int inm,
                        store_cancel c, sp_err *err)
{
    if (n <= s->opts.part_bytes)
        return put_small(s, key, data, n, inm, c, err);
    s3_src src = {-1, data, n};
    return s3_put_multipart(s, key, &src, inm, c, err);
}

static int read_fully(int fd, void *buf, size_t n)
{
    for (size_t got = 0; got < n;) {
        ssize_t k = pread(fd, (char *)buf + got, n - got, (off_t)got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return k < 0 ? errno : EIO;
        got += (size_t)k;
    }
    return 0;
}

static int s3_put_file(store_t *s, const char *key, const char *path, int inm, store_cancel c,
                       sp_err *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        return store_fail(s, err, STORE_ELOCAL, key, "PUT failed: %s: %s", path, strerror(e));
    }
    int rc;
    if ((uint64_t)st.st_size > s->opts.part_bytes) {
        s3_src src = {fd, NULL, (uint64_t)st.st_size};
        rc = s3_put_multipart(s, key, &src, inm, c, err);
    } else {
        void *buf = malloc(st.st_size ? (size_t)st.st_size : 1);
        int e = buf ? read_fully(fd, buf, (size_t)st.st_size) : ENOMEM;
        rc = e ? store_fail(s, err, STORE_ELOCAL, key, "PUT failed: %s: %s", path, strerror(e))
               : put_small(s, key, buf, (size_t)st.st_size, inm, c, err);
        free(buf);
    }
    close(fd);
    return rc;
}

static int s3_get_bytes(store_t *s, const char *key, void **data, size_t *n, char *tag,
                        store_cancel c, sp_err *err)
{
    membuf body = {0};
    s3_req r = {.method = "GET", .key = key, .out = &body, .fd = -1};
    int rc = s3_call(s, &r, c, err);
    if (tag)
        snprintf(tag, STORE_TAG_MAX, "%s", rc == 0 ? r.etag : "");
    s3_req_free(&r);
    if (!rc && tag && !tag[0])
        rc = store_fail(s, err, STORE_EFAIL, key, "GET failed: the answer has no ETag");
    if (!rc && !body.p && membuf_append(&body, "", 0))
        rc = store_fail(s, err, STORE_EFAIL, key, "GET failed: out of memory");
    if (rc) {
        membuf_free(&body);
        return rc;
    }
    *data = body.p;
    *n = body.n;
    return 0;
}

/* One ranged GET into dst, resumed on retry from the bytes already received. */
static int s3_get_range(store_t *s, const char *key, uint64_t off, size_t n, void *dst,
                        store_cancel c, sp_err *err)
{
    s3_req r = {.method = "GET", .key = key, .fd = -1, .mem = dst, .off = off,
                .end = off + n - 1};
    sp_err e1 = {0};
    int rc = s3_call(s, &r, c, &e1);
    if (rc == STORE_EFAIL && r.status == 416)
        rc = store_fail(s, err, STORE_EFAIL, key,
                        "GET failed: the range [%llu, %llu) is past the object's end (416)",
                        (unsigned long long)off, (unsigned long long)(off + n));
    else if (rc && err && !err->code)
        *err = e1;
    else if (!rc && r.got != n)
        rc = store_fail(s, err, STORE_EFAIL, key,
                        "GET failed: short read: %llu of the %zu bytes at %llu (the object "
                        "ends before %llu)",
                        (unsigned long long)r.got, n, (unsigned long long)off,
                        (unsigned long long)(off + n));
    s3_req_free(&r);
    return rc;
}

static int s3_get_file(store_t *s, const char *key, const char *path, store_cancel c,
                       sp_err *err)
{
    int exists = 0, fd = -1;
    uint64_t size = 0;
    char etag[160], *tmp = NULL;
    int rc = s3_head(s, key, &exists, &size, etag, c, err);
    if (!rc && !exists)
        rc = store_fail(s, err, STORE_ENOENT, key, "GET failed: no such object");
    if (rc)
        return rc;
    int e = store_local_mkparents(path);
    if (!e)
        e = store_local_tmp(path, &tmp, &fd);
    if (!e && size && ftruncate(fd, (off_t)size) != 0)
        e = errno;
    if (e)
        rc = store_fail(s, err, STORE_ELOCAL, key, "GET failed: %s: %s", path, strerror(e));
    if (!rc && size)
        rc = s3_get_ranges(s, key, fd, size, etag, c, err);
    if (!rc && (e = store_local_publish(fd, tmp, path, 0)) != 0)
        rc = store_fail(s, err, STORE_ELOCAL, key, "GET failed: %s: %s", path, strerror(e));
    else if (rc && fd >= 0) {
        close(fd);
        unlink(tmp);
    }
    free(tmp);
    return rc;
}

static int s3_exists(store_t *s, const char *key, int *exists, uint64_t *size, store_cancel c,
                     sp_err *err)
{
    return s3_head(s, key, exists, size, NULL, c, err);
}

static int s3_del(store_t *s, const char *key, store_cancel c, sp_err *err)
{
    s3_req r = {.method = "DELETE", .key = key, .fd = -1};
    int rc = s3_call(s, &r, c, err);
    s3_req_free(&r);
    return rc == STORE_ENOENT ? 0 : rc;
}

/* ---- listing ---------------------------------------------------------------- */

typedef struct list_page {
    store_listing *out;
    size_t cap;
    size_t strip;     /* length of "prefix/" to remove from keys */
    int truncated;
    char *token;
    char *last; /* the page's last key, whole (start-after) */
} list_page;

static int page_entry(list_page *p, const xmlNode *contents)
{
    char *key = s3_xml_text(s3_xml_node(contents->children, "Key"));
    char *size = s3_xml_text(s3_xml_node(contents->children, "Size"));
    int rc = 0;
    if (key) {
        free(p->last);
        p->last = strdup(key);
    }
    if (!key || !p->last)
        rc = -1;
    else if (strlen(key) > p->strip) /* skip the prefix itself, if it is an object */
        rc = store_list_add(p->out, &p->cap, key + p->strip, size ? strtoull(size, NULL, 10) : 0);
    free(key);
    free(size);
    return rc;
}

static int parse_page(list_page *p, const membuf *body)
{
    xmlDoc *doc = s3_xml_parse(body);
    const xmlNode *root = doc ? xmlDocGetRootElement(doc) : NULL;
    int rc = root ? 0 : -1;
    free(p->token);
    p->token = NULL;
    p->truncated = 0;
    for (const xmlNode *n = root ? root->children : NULL; n && !rc; n = n->next) {
        if (n->type != XML_ELEMENT_NODE)
            continue;
        const char *name = (const char *)n->name;
        if (!strcmp(name, "Contents")) {
            rc = page_entry(p, n);
        } else if (!strcmp(name, "IsTruncated")) {
            char *t = s3_xml_text(n);
            p->truncated = t && !strcmp(t, "true");
            free(t);
        } else if (!strcmp(name, "NextContinuationToken")) {
            p->token = s3_xml_text(n);
        }
    }
    xmlFreeDoc(doc);
    return rc;
}

/* libcurl 8.14 to 8.18 sign a '+' of a query as a space (%20) while the
 * request carries %2B (curl issue 20543, fixed in 8.19): the store answers
 * SignatureDoesNotMatch. Their continuation tokens (base64) mostly hold one. */
static int sigv4_plus_broken(void)
{
    const curl_version_info_data *v = curl_version_info(CURLVERSION_NOW);
    return v && v->version_num >= 0x080e00 && v->version_num < 0x081300;
}

/* The next page's query: after the continuation token, or after the last
 * key listed (start-after, which ListObjectsV2 takes too) where the token
 * would be mis-signed or SPOTUNE_S3_LIST=start-after asks. */
static char *list_query(const list_page *p, int start_after, const char *enc_prefix)
{
    if (!p->token && !(start_after && p->last))
        return sp_strf("list-type=2&prefix=%s", enc_prefix);
    char *t = s3_uri_encode(start_after ? p->last : p->token, 0);
    char *q = !t ? NULL
              : start_after ? sp_strf("list-type=2&prefix=%s&start-after=%s", enc_prefix, t)
                            : sp_strf("continuation-token=%s&list-type=2&prefix=%s", t,
                                      enc_prefix);
    free(t);
    return q;
}

/* SPOTUNE_S3_LIST: "auto" (unset), "token" or "start-after"; -1 for
 * anything else. */
static int list_mode(void)
{
    const char *m = s3_env("SPOTUNE_S3_LIST");
    return !m || !strcmp(m, "auto") ? 0 : !strcmp(m, "token") ? 1 : !strcmp(m, "start-after") ? 2
                                                                                               : -1;
}

static int s3_list(store_t *s, const char *prefix, store_listing *out, store_cancel c, sp_err *err)
{
    s3_backend *b = s->impl;
    char *fp = b->prefix[0] ? sp_strf("%s/%s", b->prefix, prefix) : strdup(prefix);
    char *enc = fp ? s3_uri_encode(fp, 0) : NULL;
    list_page p = {out, 0, b->prefix[0] ? strlen(b->prefix) + 1 : 0, 0, NULL, NULL};
    int mode = list_mode(), broken = mode == 0 && sigv4_plus_broken(), start_after = mode == 2;
    int rc = enc ? 0 : store_fail(s, err, STORE_EFAIL, prefix, "LIST failed: out of memory");
    if (!rc && mode < 0)
        rc = store_fail(s, err, STORE_EUSAGE, prefix,
                        "SPOTUNE_S3_LIST=%s: expected auto, token or start-after",
                        s3_env("SPOTUNE_S3_LIST"));
    if (!rc && broken && strchr(fp, '+'))
        rc = store_fail(s, err, STORE_EUSAGE, prefix,
                        "libcurl %s signs a '+' in a query wrongly (fixed in 8.19), so the "
                        "store would refuse this listing: choose a checkpoint.remote prefix "
                        "without '+', or run with another libcurl",
                        curl_version_info(CURLVERSION_NOW)->version);
    do {
        membuf body = {0};
        char *q = rc ? NULL : list_query(&p, start_after, enc);
        s3_req r = {.method = "GET", .what = "ListObjectsV2", .query = q, .out = &body, .fd = -1};
        if (!rc && !q)
            rc = store_fail(s, err, STORE_EFAIL, prefix, "LIST failed: out of memory");
        if (!rc)
            rc = s3_call(s, &r, c, err);
        if (!rc && parse_page(&p, &body))
            rc = store_fail(s, err, STORE_EFAIL, prefix, "ListObjectsV2: unreadable answer");
        if (!rc && p.truncated && !p.token && !p.last)
            rc = store_fail(s, err, STORE_EFAIL, prefix,
                            "ListObjectsV2: truncated page without a continuation token");
        if (!rc && p.truncated && (!p.token || (broken && strchr(p.token, '+'))))
            start_after = 1;
        if (!rc && p.truncated && start_after && !p.last)
            rc = store_fail(s, err, STORE_EFAIL, prefix, "ListObjectsV2: truncated empty page");
        if (!rc && p.truncated && start_after && broken && strchr(p.last, '+'))
            rc = store_fail(s, err, STORE_EUSAGE, prefix,
                            "libcurl %s signs a '+' in a query wrongly (fixed in 8.19): the "
                            "listing cannot go on after %s",
                            curl_version_info(CURLVERSION_NOW)->version, p.last);
        s3_req_free(&r);
        membuf_free(&body);
        free(q);
    } while (!rc && p.truncated);
    free(p.token);
    free(p.last);
    free(fp);
    free(enc);
    return rc;
}

/* ---- bucket ----------------------------------------------------------------- */

static int s3_create_bucket(store_t *s, sp_err *err)
{
    s3_backend *b = s->impl;
    char *body = NULL, sha[65] = S3_EMPTY_SHA256;
    if (b->aws_default && strcmp(b->region, "us-east-1")) /* AWS wants the region spelled out */
        body = sp_strf(
            "<CreateBucketConfiguration xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
            "<LocationConstraint>%s</LocationConstraint></CreateBucketConfiguration>",
            b->region);
    if (body)
        s3_sha256_hex(body, strlen(body), sha);
    s3_req r = {.method = "PUT", .what = "CreateBucket", .body = body,
                .body_len = body ? strlen(body) : 0, .body_sha = sha, .fd = -1};
    sp_err e1 = {0};
    int rc = s3_call(s, &r, NULL, &e1);
    if (rc && r.status == 409 && !strcmp(r.code, "BucketAlreadyOwnedByYou"))
        rc = 0;
    if (rc)
        s3_err_take(err, &e1);
    s3_req_free(&r);
    free(body);
    return rc;
}

/* ---- open / close ----------------------------------------------------------- */

static void s3_close(store_t *s)
{
    s3_backend *b = s->impl;
    if (!b)
        return;
    for (size_t i = 0; i < b->pool_n; i++)
        curl_easy_cleanup(b->pool[i]);
    free(b->pool);
    pthread_mutex_destroy(&b->mu);
    s3_creds_close(&b->creds);
    free(b->bucket);
    free(b->prefix);
    free(b->region);
    free(b->base);
    free(b->bucket_url);
    free(b->sigv4);
    free(b->ca_bundle);
    free(b);
    s->impl = NULL;
}

static const store_ops s3_ops = {
    .put_file = s3_put_file,
    .put_bytes = s3_put_bytes,
    .get_file = s3_get_file,
    .get_bytes = s3_get_bytes,
    .put_bytes_if = s3_put_bytes_if,
    .get_range = s3_get_range,
    .list = s3_list,
    .del = s3_del,
    .exists = s3_exists,
    .create_bucket = s3_create_bucket,
    .close = s3_close,
};

const char *s3_env(const char *name)
{
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

/* Splits "scheme://host[:port][/path]" into "scheme://" and the rest. */
static int split_endpoint(const char *ep, char **scheme, char **rest)
{
    const char *sep = strstr(ep, "://");
    if (!sep || (!sp_after(ep, "http://") && !sp_after(ep, "https://")) || !sep[3])
        return -1;
    *scheme = strndup(ep, (size_t)(sep - ep) + 3);
    *rest = strdup(sep + 3);
    if (!*scheme || !*rest)
        return -1;
    size_t n = strlen(*rest);
    while (n > 0 && (*rest)[n - 1] == '/')
        (*rest)[--n] = 0;
    return n ? 0 : -1;
}

/* Stores that want (or only take) virtual-host addressing. */
static int endpoint_wants_vhost(const char *hostport)
{
    static const char *const domains[] = {".amazonaws.com", ".amazonaws.com.cn", ".aliyuncs.com",
                                          ".myqcloud.com"};
    size_t n = strcspn(hostport, ":/"); /* the host name's length */
    for (size_t i = 0; i < sizeof domains / sizeof *domains; i++) {
        size_t d = strlen(domains[i]);
        if (n > d && !strncmp(hostport + n - d, domains[i], d))
            return 1;
    }
    return 0;
}

static int bucket_is_dns_safe(const char *bucket)
{
    for (const char *p = bucket; *p; p++)
        if (*p == '.' || *p == '_' || (*p >= 'A' && *p <= 'Z'))
            return 0;
    return 1;
}

static int resolve_endpoint(store_t *s, s3_backend *b, sp_err *err)
{
    const char *ep = s->opts.endpoint ? s->opts.endpoint : s3_env("AWS_ENDPOINT_URL_S3");
    if (!ep)
        ep = s3_env("AWS_ENDPOINT_URL");
    char *aws = NULL, *scheme = NULL, *rest = NULL;
    b->aws_default = !ep;
    if (!ep)
        ep = aws = sp_strf("https://s3.%s.amazonaws.com%s", b->region,
                                       sp_after(b->region, "cn-") ? ".cn" : "");
    int rc = 0;
    if (!ep || split_endpoint(ep, &scheme, &rest))
        rc = store_fail(s, err, STORE_EUSAGE, NULL,
                        "bad endpoint '%s' (want http[s]://host[:port])", ep ? ep : "");
    int style = s->opts.addressing;
    if (style == STORE_ADDR_AUTO)
        style = !rc && endpoint_wants_vhost(rest) && bucket_is_dns_safe(b->bucket)
                    ? STORE_ADDR_VHOST
                    : STORE_ADDR_PATH;
    if (!rc && style == STORE_ADDR_PATH) {
        b->base = sp_strf("%s%s/%s", scheme, rest, b->bucket);
        b->bucket_url = b->base ? strdup(b->base) : NULL;
    } else if (!rc) {
        b->base = sp_strf("%s%s.%s", scheme, b->bucket, rest);
        b->bucket_url = b->base ? sp_strf("%s/", b->base) : NULL;
    }
    if (!rc && (!b->base || !b->bucket_url))
        rc = store_fail(s, err, STORE_EFAIL, NULL, "out of memory");
    free(aws);
    free(scheme);
    free(rest);
    return rc;
}

static const char *pick_region(const store_t *s)
{
    if (s->opts.region)
        return s->opts.region;
    const char *r = s3_env("AWS_REGION");
    if (!r)
        r = s3_env("AWS_DEFAULT_REGION");
    return r ? r : "us-east-1";
}

int store_s3_open(store_t *s, const char *bucket, const char *prefix, sp_err *err)
{
    pthread_once(&libs_once, libs_init);
    if (libs_rc != CURLE_OK)
        return store_fail(s, err, STORE_EFAIL, NULL, "curl_global_init failed: %s",
                          curl_easy_strerror(libs_rc));
    s3_backend *b = calloc(1, sizeof *b);
    if (!b)
        return store_fail(s, err, STORE_EFAIL, NULL, "out of memory");
    s->impl = b;
    s->ops = &s3_ops;
    pthread_mutex_init(&b->mu, NULL);
    atomic_init(&b->inm_unsupported, 0);
    atomic_init(&b->im_unsupported, 0);
    b->pool_cap = (size_t)s->opts.parallel + 4;
    b->pool = calloc(b->pool_cap, sizeof *b->pool);
    b->bucket = strdup(bucket);
    b->prefix = strdup(prefix);
    b->region = strdup(pick_region(s));
    b->sigv4 = b->region ? sp_strf("aws:amz:%s:s3", b->region) : NULL;
    if (s3_env("AWS_CA_BUNDLE"))
        b->ca_bundle = strdup(s3_env("AWS_CA_BUNDLE"));
    if (!b->pool || !b->bucket || !b->prefix || !b->region || !b->sigv4)
        return store_fail(s, err, STORE_EFAIL, NULL, "out of memory");
    int rc = resolve_endpoint(s, b, err);
    return rc ? rc : s3_creds_open(s, &b->creds, err);
}
