/* checkpoint/store_s3_request.c — one S3 request and its retries: a pool of
 * curl handles (connections are reused), the request options (libcurl's
 * built-in SigV4 with the key and secret set apart, since a key may hold ':';
 * x-amz-content-sha256 set by us, since curl 7.88 does not send it), the
 * response sinks (memory, or a range written into a file or a buffer at a
 * resumable offset), the classification of an outcome (done, retry, fail) and
 * the backoff loop. Also the small codecs the backend needs: SigV4 URI
 * encoding, SHA-256 (OpenSSL), XML (libxml2). */
#define _GNU_SOURCE
#include "checkpoint/store_s3.h"

#include <errno.h>
#include <openssl/evp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#define EXPECT_MIN_BYTES ((size_t)1 << 20)

/* ---- encoding, hashing, XML -------------------------------------------------- */

char *s3_uri_encode(const char *in, int keep_slash)
{
    static const char hex[] = "0123456789ABCDEF";
    size_t n = strlen(in);
    char *out = malloc(3 * n + 1), *w = out;
    if (!out)
        return NULL;
    for (const unsigned char *p = (const unsigned char *)in; *p; p++) {
        unsigned char c = *p;
        if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
            c == '-' || c == '_' || c == '.' || c == '~' || (keep_slash && c == '/')) {
            *w++ = (char)c;
        } else {
            *w++ = '%';
            *w++ = hex[c >> 4];
            *w++ = hex[c & 15];
        }
    }
    *w = 0;
    return out;
}

void s3_sha256_hex(const void *data, size_t n, char out[65])
{
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    if (EVP_Digest(data, n, md, &len, EVP_sha256(), NULL) != 1 || len != 32) {
        strcpy(out, "0"); /* never matches: the store rejects the request */
        return;
    }
    for (unsigned i = 0; i < 32; i++)
        sprintf(out + 2 * i, "%02x", md[i]);
}

const xmlNode *s3_xml_node(const xmlNode *n, const char *name)
{
    for (; n; n = n->next) {
        if (n->type != XML_ELEMENT_NODE)
            continue;
        if (!strcmp((const char *)n->name, name))
            return n;
        const xmlNode *c = s3_xml_node(n->children, name);
        if (c)
            return c;
    }
    return NULL;
}

/* Leading white space is skipped: S3 sends spaces while a
 * CompleteMultipartUpload runs (its 200 comes first), and an XML
 * declaration after them is not well-formed XML. */
xmlDoc *s3_xml_parse(const membuf *b)
{
    if (!b || !b->n || b->n > INT32_MAX)
        return NULL;
    size_t skip = 0;
    for (char c; skip < b->n && ((c = ((const char *)b->p)[skip]) == ' ' || c == '\t' ||
                                 c == '\r' || c == '\n');)
        skip++;
    if (skip == b->n)
        return NULL;
    return xmlReadMemory((const char *)b->p + skip, (int)(b->n - skip), "s3.xml", NULL,
                         XML_PARSE_NONET | XML_PARSE_NOERROR | XML_PARSE_NOWARNING);
}

char *s3_xml_text(const xmlNode *n)
{
    if (!n)
        return NULL;
    xmlChar *t = xmlNodeGetContent(n);
    char *out = t ? strdup((const char *)t) : NULL;
    xmlFree(t);
    return out;
}

char *s3_xml_find(const membuf *b, const char *name)
{
    xmlDoc *doc = s3_xml_parse(b);
    if (!doc)
        return NULL;
    char *out = s3_xml_text(s3_xml_node(xmlDocGetRootElement(doc), name));
    xmlFreeDoc(doc);
    return out;
}

void s3_err_take(sp_err *dst, const sp_err *src)
{
    if (dst && !dst->code && src->code)
        *dst = *src;
}

static char *full_key(const s3_backend *b, const char *key)
{
    return b->prefix[0] ? sp_strf("%s/%s", b->prefix, key) : strdup(key);
}

static char *req_url(const s3_backend *b, const s3_req *r)
{
    const char *q = r->query ? r->query : "";
    const char *qm = r->query ? "?" : "";
    if (!r->key)
        return sp_strf("%s%s%s", b->bucket_url, qm, q);
    char *fk = full_key(b, r->key);
    char *enc = fk ? s3_uri_encode(fk, 1) : NULL;
    char *url = enc ? sp_strf("%s/%s%s%s", b->base, enc, qm, q) : NULL;
    free(fk);
    free(enc);
    return url;
}

/* ---- curl handle pool ------------------------------------------------------- */

static CURL *pool_get(s3_backend *b)
{
    CURL *h = NULL;
    pthread_mutex_lock(&b->mu);
    if (b->pool_n)
        h = b->pool[--b->pool_n];
    pthread_mutex_unlock(&b->mu);
    if (h) {
        curl_easy_reset(h); /* keeps the connection cache */
        return h;
    }
    return curl_easy_init();
}

/* A handle goes back to the pool for its connection cache only after a
 * transfer that worked: after a failed one (curl 7.88 after a failed name
 * lookup, for one) its next setopt can fail with "bad argument", and the
 * connection it held is dead anyway. */
static void pool_put(s3_backend *b, CURL *h, int worked)
{
    pthread_mutex_lock(&b->mu);
    if (worked && b->pool_n < b->pool_cap) {
        b->pool[b->pool_n++] = h;
        h = NULL;
    }
    pthread_mutex_unlock(&b->mu);
    if (h)
        curl_easy_cleanup(h);
}

/* ---- one attempt ------------------------------------------------------------ */

typedef struct attempt_ctx {
    s3_req *r;
    CURL *h;
    store_cancel cancel;
    const s3_cred_use *cred;
} attempt_ctx;

/* A ranged GET: the body goes to r->fd or r->mem. */
static int ranged(const s3_req *r)
{
    return r->fd >= 0 || r->mem;
}

static size_t sink_range(s3_req *r, long st, const char *data, size_t n)
{
    if ((st == 200 && r->req_start != 0) || r->off + r->got + n > r->end + 1) {
        r->sink_bad_range = 1; /* Range ignored, or more bytes than asked for */
        return 0;
    }
    if (r->fd < 0) {
        memcpy(r->mem + r->got, data, n);
        r->got += n;
        return n;
    }
    for (size_t w = 0; w < n;) {
        ssize_t k = pwrite(r->fd, data + w, n - w, (off_t)(r->off + r->got));
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            r->sink_errno = k < 0 ? errno : EIO;
            return 0;
        }
        w += (size_t)k;
        r->got += (uint64_t)k;
    }
    return n;
}

static size_t on_write(char *data, size_t size, size_t nmemb, void *arg)
{
    attempt_ctx *a = arg;
    s3_req *r = a->r;
    size_t n = size * nmemb;
    long st = 0;
    if (curl_easy_getinfo(a->h, CURLINFO_RESPONSE_CODE, &st) != CURLE_OK || st < 200 ||
        st >= 300) {
        if (r->ebody.n < 65536)
            membuf_append(&r->ebody, data, n); /* out of memory: message shorter */
        return n;
    }
    if (r->out)
        return membuf_append(r->out, data, n) ? 0 : n;
    if (ranged(r))
        return sink_range(r, st, data, n);
    return n;
}

static void header_value(const char *data, size_t n, size_t skip, char *out, size_t cap)
{
    const char *v = data + skip, *end = data + n;
    while (v < end && (*v == ' ' || *v == '\t'))
        v++;
    while (end > v && (end[-1] == '\r' || end[-1] == '\n' || end[-1] == ' '))
        end--;
    size_t len = (size_t)(end - v) < cap - 1 ? (size_t)(end - v) : cap - 1;
    memcpy(out, v, len);
    out[len] = 0;
}

/* The header line data (n bytes) starts with name, case aside: name's
 * length, else 0. */
static size_t header_is(const char *data, size_t n, const char *name)
{
    size_t len = strlen(name);
    return n >= len && !strncasecmp(data, name, len) ? len : 0;
}

static size_t on_header(char *data, size_t size, size_t nmemb, void *arg)
{
    s3_req *r = ((attempt_ctx *)arg)->r;
    size_t n = size * nmemb;
    char num[32];
    size_t k;
    if (header_is(data, n, "HTTP/")) {
        r->etag[0] = 0;
        r->region[0] = 0;
        r->content_length = 0;
    } else if ((k = header_is(data, n, "x-amz-bucket-region:")) && n > k) {
        header_value(data, n, k, r->region, sizeof r->region);
    } else if ((k = header_is(data, n, "etag:")) && n > k) {
        header_value(data, n, k, r->etag, sizeof r->etag);
    } else if ((k = header_is(data, n, "content-length:")) && n > k) {
        header_value(data, n, k, num, sizeof num);
        r->content_length = strtoull(num, NULL, 10);
    }
    return n;
}

static size_t on_read(char *buf, size_t size, size_t nmemb, void *arg)
{
    s3_req *r = ((attempt_ctx *)arg)->r;
    size_t room = size * nmemb, left = r->body_len - r->sent;
    size_t n = left < room ? left : room;
    memcpy(buf, (const char *)r->body + r->sent, n);
    r->sent += n;
    return n;
}

static int on_seek(void *arg, curl_off_t off, int origin)
{
    s3_req *r = ((attempt_ctx *)arg)->r;
    if (origin != SEEK_SET || off < 0 || (size_t)off > r->body_len)
        return CURL_SEEKFUNC_CANTSEEK;
    r->sent = (size_t)off;
    return CURL_SEEKFUNC_OK;
}

static int on_progress(void *arg, curl_off_t dt, curl_off_t dn, curl_off_t ut, curl_off_t un)
{
    (void)dt, (void)dn, (void)ut, (void)un; /* only asked whether to go on */
    attempt_ctx *a = arg;
    return store_canceled(a->cancel) || store_canceled(a->r->cancel2);
}

#define SET(opt, val) (e = e != CURLE_OK ? e : curl_easy_setopt(h, opt, val))

static CURLcode set_common(store_t *s, attempt_ctx *a, const char *url, char *errbuf)
{
    s3_backend *b = s->impl;
    CURL *h = a->h;
    s3_req *r = a->r;
    double stall = r->stall_s > 0 ? r->stall_s : s->opts.timeout_s;
    CURLcode e = CURLE_OK;
    SET(CURLOPT_URL, url);
    SET(CURLOPT_PATH_AS_IS, 1L); /* signed path == sent path */
    SET(CURLOPT_NOSIGNAL, 1L);
    SET(CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1);
    SET(CURLOPT_ERRORBUFFER, errbuf);
    SET(CURLOPT_AWS_SIGV4, b->sigv4);
    SET(CURLOPT_USERNAME, a->cred->access_key); /* may hold ':' (Swift): never user:pass */
    SET(CURLOPT_PASSWORD, a->cred->secret_key);
    /* a refused connection fails at once; an unanswered one within 10 s */
    SET(CURLOPT_CONNECTTIMEOUT_MS, (long)((s->opts.timeout_s < 10 ? s->opts.timeout_s : 10) * 1000));
    double left = r->until - sp_now(); /* this attempt ends with the request's deadline */
    SET(CURLOPT_TIMEOUT_MS, (long)((left > 0.001 ? left : 0.001) * 1000.0));
    SET(CURLOPT_LOW_SPEED_LIMIT, 1L);
    SET(CURLOPT_LOW_SPEED_TIME, (long)(stall + 0.999));
    SET(CURLOPT_TCP_KEEPALIVE, 1L);
    SET(CURLOPT_BUFFERSIZE, 512L * 1024);
    SET(CURLOPT_UPLOAD_BUFFERSIZE, 1024L * 1024);
    SET(CURLOPT_WRITEFUNCTION, on_write);
    SET(CURLOPT_WRITEDATA, a);
    SET(CURLOPT_HEADERFUNCTION, on_header);
    SET(CURLOPT_HEADERDATA, a);
    SET(CURLOPT_XFERINFOFUNCTION, on_progress);
    SET(CURLOPT_XFERINFODATA, a);
    SET(CURLOPT_NOPROGRESS, 0L);
    if (b->ca_bundle)
        SET(CURLOPT_CAINFO, b->ca_bundle);
    if (s->opts.max_send_bps)
        SET(CURLOPT_MAX_SEND_SPEED_LARGE, (curl_off_t)s->opts.max_send_bps);
    if (s->opts.max_recv_bps)
        SET(CURLOPT_MAX_RECV_SPEED_LARGE, (curl_off_t)s->opts.max_recv_bps);
    return e;
}

static CURLcode set_method(attempt_ctx *a)
{
    CURL *h = a->h;
    s3_req *r = a->r;
    CURLcode e = CURLE_OK;
    if (!strcmp(r->method, "HEAD")) {
        SET(CURLOPT_NOBODY, 1L);
    } else if (!strcmp(r->method, "PUT")) {
        SET(CURLOPT_UPLOAD, 1L);
        SET(CURLOPT_READFUNCTION, on_read);
        SET(CURLOPT_READDATA, a);
        SET(CURLOPT_SEEKFUNCTION, on_seek);
        SET(CURLOPT_SEEKDATA, a);
        SET(CURLOPT_INFILESIZE_LARGE, (curl_off_t)r->body_len);
        /* curl sends "Expect: 100-continue" before every PUT body and waits for
         * the answer: a round trip per object, worth it only to learn of a 403
         * before sending megabytes. Removing the header with "Expect:" is not an
         * option: curl 7.88 signs the removed header (403 SignatureDoesNotMatch). */
        if (r->body_len < EXPECT_MIN_BYTES)
            SET(CURLOPT_EXPECT_100_TIMEOUT_MS, 0L);
    } else if (!strcmp(r->method, "POST")) {
        SET(CURLOPT_POST, 1L);
        SET(CURLOPT_POSTFIELDS, r->body ? r->body : "");
        SET(CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)r->body_len);
    } else if (!strcmp(r->method, "DELETE")) {
        SET(CURLOPT_CUSTOMREQUEST, "DELETE");
    }
    return e;
}

#undef SET

static struct curl_slist *add_header(struct curl_slist *l, int *bad, const char *fmt, ...)
    SP_PRINTF(3, 4);

static struct curl_slist *add_header(struct curl_slist *l, int *bad, const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    struct curl_slist *n = curl_slist_append(l, line);
    if (!n)
        *bad = 1;
    return n ? n : l;
}

static struct curl_slist *build_headers(const s3_cred_use *u, const s3_req *r, int *bad)
{
    struct curl_slist *l = NULL;
    l = add_header(l, bad, "x-amz-content-sha256: %s", r->body_sha ? r->body_sha : S3_EMPTY_SHA256);
    if (u->token_hdr && !(l = curl_slist_append(l, u->token_hdr)))
        *bad = 1;
    if (ranged(r))
        l = add_header(l, bad, "Range: bytes=%llu-%llu", (unsigned long long)(r->off + r->got),
                       (unsigned long long)r->end);
    for (int i = 0; i < 4 && r->hdr[i]; i++)
        l = add_header(l, bad, "%s", r->hdr[i]);
    return l;
}

static const char *status_text(long st)
{
    switch (st) {
    case 301: return "Moved Permanently (wrong region or endpoint?)";
    case 307: return "Temporary Redirect (wrong region or endpoint?)";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 409: return "Conflict";
    case 411: return "Length Required";
    case 412: return "Precondition Failed";
    case 416: return "Range Not Satisfiable";
    case 429: return "Too Many Requests";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    default: return "HTTP error";
    }
}

static int curl_transient(CURLcode cc)
{
    switch (cc) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_WEIRD_SERVER_REPLY:
    case CURLE_SEND_FAIL_REWIND:
        return 1;
    default:
        return 0;
    }
}

static void parse_error_body(s3_req *r, const membuf *body)
{
    char *code = s3_xml_find(body, "Code"), *msg = code ? s3_xml_find(body, "Message") : NULL;
    snprintf(r->code, sizeof r->code, "%s", code ? code : "");
    snprintf(r->msg, sizeof r->msg, "%s", msg ? msg : "");
    free(code);
    free(msg);
}

static int http_transient(const s3_req *r)
{
    long st = r->status;
    if (st == 408 || st == 429 || (st >= 500 && st != 501))
        return 1;
    if (st == 400 && !strcmp(r->code, "RequestTimeout"))
        return 1;
    if (st == 409 && !strcmp(r->code, "ConditionalRequestConflict"))
        return 1;
    if (st == 403 && !strcmp(r->code, "RequestTimeTooSkewed")) /* until the clock is set */
        return 1;
    if (st == 200) /* an <Error> inside a 200 (CompleteMultipartUpload) */
        return !strcmp(r->code, "InternalError") || !strcmp(r->code, "SlowDown") ||
               !strcmp(r->code, "ServiceUnavailable");
    return 0;
}

/* The store refused the request's temporary credentials as expired (AWS
 * answers 400 ExpiredToken; some stores 403 or TokenRefreshRequired). */
static int expired_token(const s3_req *r)
{
    return (r->status == 400 || r->status == 401 || r->status == 403) &&
           (!strcmp(r->code, "ExpiredToken") || !strcmp(r->code, "TokenRefreshRequired"));
}

/* The bucket is in another region than the one requests are signed for
 * (AWS: 301 PermanentRedirect, a HEAD's 301 without a body, 400
 * AuthorizationHeaderMalformed or IllegalLocationConstraintException). */
static int wrong_region(const s3_req *r)
{
    return r->status == 301 || !strcmp(r->code, "PermanentRedirect") ||
           !strcmp(r->code, "AuthorizationHeaderMalformed") ||
           !strcmp(r->code, "IllegalLocationConstraintException");
}

static int http_rc(const s3_req *r)
{
    if (expired_token(r))
        return STORE_EAUTH;
    switch (r->status) {
    case 404: return strcmp(r->code, "NoSuchBucket") == 0 ? STORE_ENOBUCKET : STORE_ENOENT;
    case 412: return STORE_EEXIST;
    case 401:
    case 403: return STORE_EAUTH;
    default: return STORE_EFAIL;
    }
}

/* 0: done; 1: retry; < 0: final failure. detail receives the reason. */
static int classify(s3_req *r, CURLcode cc, const char *errbuf, store_cancel c, char *detail,
                    size_t dn)
{
    if (store_canceled(c) || store_canceled(r->cancel2)) {
        snprintf(detail, dn, "canceled");
        return STORE_ECANCELED;
    }
    if (cc == CURLE_WRITE_ERROR && r->sink_errno) {
        snprintf(detail, dn, "local write: %s", strerror(r->sink_errno));
        return STORE_ELOCAL;
    }
    if (cc == CURLE_WRITE_ERROR && r->sink_bad_range) {
        snprintf(detail, dn, "the store ignored the Range header");
        return STORE_EFAIL;
    }
    if (cc != CURLE_OK) {
        snprintf(detail, dn, "%s%s%s", curl_easy_strerror(cc), *errbuf ? ": " : "", errbuf);
        return curl_transient(cc) ? 1 : STORE_EFAIL;
    }
    int err_in_200 = 0;
    if (r->status >= 300)
        parse_error_body(r, &r->ebody);
    else if (r->body_may_be_error && r->out && r->out->p &&
             (err_in_200 = strstr((char *)r->out->p, "<Error") != NULL)) {
        parse_error_body(r, r->out);
        if (!r->code[0]) { /* an error all the same: not a success */
            snprintf(r->code, sizeof r->code, "InternalError");
            snprintf(r->msg, sizeof r->msg, "an <Error> in a 200 answer that could not be read");
        }
    }
    if (r->status >= 200 && r->status < 300 && !r->code[0])
        return 0;
    if (r->code[0])
        snprintf(detail, dn, "%ld %s: %s", r->status, r->code, r->msg);
    else
        snprintf(detail, dn, "%ld %s", r->status, status_text(r->status));
    if (http_transient(r))
        return 1;
    if (wrong_region(r)) {
        size_t k = strlen(detail);
        snprintf(detail + k, dn - k, " (the bucket is in %s%s, not in this store's region: set "
                 "checkpoint.region, or AWS_REGION)", r->region[0] ? "region " : "another region",
                 r->region);
        return STORE_EUSAGE;
    }
    return err_in_200 ? STORE_EFAIL : http_rc(r);
}

static void reset_response(s3_req *r)
{
    r->status = 0;
    r->etag[0] = r->code[0] = r->msg[0] = 0;
    r->content_length = 0;
    r->ebody.n = 0;
    r->sent = 0;
    r->sink_errno = r->sink_bad_range = 0;
    r->req_start = r->off + r->got;
    if (r->out)
        r->out->n = 0;
}

static int attempt(store_t *s, s3_req *r, const char *url, store_cancel c, char *detail,
                   size_t dn)
{
    s3_backend *b = s->impl;
    if (ranged(r) && r->off + r->got > r->end)
        return 0; /* a previous attempt received everything */
    reset_response(r);
    s3_cred_use cred;
    int rc = s3_creds_use(&b->creds, &cred, detail, dn);
    if (rc)
        return rc;
    attempt_ctx a = {r, pool_get(b), c, &cred};
    char errbuf[CURL_ERROR_SIZE] = "";
    if (!a.h) {
        s3_cred_use_free(&cred);
        snprintf(detail, dn, "curl_easy_init failed");
        return STORE_EFAIL;
    }
    int bad = 0;
    struct curl_slist *hdrs = build_headers(&cred, r, &bad);
    CURLcode cc = bad ? CURLE_OUT_OF_MEMORY : set_common(s, &a, url, errbuf);
    if (cc == CURLE_OK)
        cc = set_method(&a);
    if (cc == CURLE_OK)
        cc = curl_easy_setopt(a.h, CURLOPT_HTTPHEADER, hdrs);
    if (cc == CURLE_OK)
        cc = curl_easy_perform(a.h);
    if (cc == CURLE_OK && curl_easy_getinfo(a.h, CURLINFO_RESPONSE_CODE, &r->status) != CURLE_OK)
        cc = CURLE_BAD_FUNCTION_ARGUMENT;
    rc = classify(r, cc, errbuf, c, detail, dn);
    if (rc < 0 && expired_token(r)) {
        /* an instance role's are renewed and the request tried again; the
         * environment's cannot be: said how to go on */
        if (s3_creds_expired(&b->creds, &cred))
            rc = 1;
        else
            snprintf(detail + strlen(detail), dn - strlen(detail),
                     " (the temporary credentials from %s have expired: restart with fresh "
                     "ones, or, on EC2, unset AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and "
                     "AWS_SESSION_TOKEN so that the instance role's are used and renewed)",
                     b->creds.source);
    }
    s3_cred_use_free(&cred);
    curl_slist_free_all(hdrs);
    pool_put(b, a.h, cc == CURLE_OK);
    return rc;
}

int s3_call(store_t *s, s3_req *r, store_cancel c, sp_err *err)
{
    char detail[768] = "";
    int tries = r->tries > 0 ? r->tries : 1 + s->opts.max_retries, rc = STORE_EFAIL;
    uint64_t rng = store_rng_seed();
    char *url = req_url(s->impl, r);
    if (!url)
        snprintf(detail, sizeof detail, "out of memory");
    double t0 = sp_now();
    r->until = t0 + s->opts.request_deadline_s;
    int out_of_time = 0;
    for (r->attempts = 0; url && r->attempts < tries;) {
        r->attempts++;
        rc = attempt(s, r, url, c, detail, sizeof detail);
        if (rc <= 0)
            break;
        rc = STORE_EFAIL;
        double wait = store_backoff_s(&s->opts, r->attempts - 1, &rng);
        if (sp_now() + wait >= r->until) { /* no time for another attempt */
            out_of_time = r->attempts < tries;
            break;
        }
        if (r->attempts < tries && store_sleep(wait, c, r->cancel2)) {
            rc = STORE_ECANCELED;
            snprintf(detail, sizeof detail, "canceled");
            break;
        }
    }
    free(url);
    if (rc < 0 && err) {
        char more[96] = "";
        if (out_of_time || sp_now() >= r->until)
            snprintf(more, sizeof more, " (gave up after %d attempt(s) in %.0f s)", r->attempts,
                     sp_now() - t0);
        else if (r->attempts > 1)
            snprintf(more, sizeof more, " (after %d attempts)", r->attempts);
        store_fail(s, err, rc, r->key, "%s failed: %s%s", r->what ? r->what : r->method, detail,
                   more);
    }
    return rc;
}

void s3_req_free(s3_req *r)
{
    membuf_free(&r->ebody);
}
