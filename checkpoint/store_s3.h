/* checkpoint/store_s3.h — private to the s3:// backend: the backend record,
 * one HTTP request (s3_req) and the call that runs it with retries (s3_call,
 * store_s3_request.c), shared by store_s3.c (single requests, listing, the
 * backend table) and store_s3_multipart.c (multipart upload, ranged GET). */
#ifndef SPOTUNE_STORE_S3_H
#define SPOTUNE_STORE_S3_H

#include "checkpoint/store_impl.h"

#include <curl/curl.h>
#include <libxml/parser.h>
#include <libxml/tree.h>
#include <pthread.h>

/* Credentials (store_s3_creds.c): the environment's, read once, or a
 * role's (a web identity's through STS, a container's, an EC2 instance's),
 * renewed S3_CREDS_REFRESH_S before they expire (tried at most every
 * S3_CREDS_RETRY_S until then) and when the store says they expired.
 * Everything under mu; one request at a time renews (renewing), without
 * holding mu, and the requests that cannot go on without the renewed ones
 * wait for renewed. */
#define S3_CREDS_REFRESH_S 300.0
#define S3_CREDS_RETRY_S 5.0
enum { S3_CREDS_ENV = 0, S3_CREDS_INSTANCE, S3_CREDS_CONTAINER, S3_CREDS_WEB_IDENTITY };
typedef struct s3_creds {
    pthread_mutex_t mu;
    pthread_cond_t renewed;  /* a renewal ended (broadcast) */
    int renewing;            /* a request is asking the source now */
    char *access_key, *secret_key, *token_hdr; /* token_hdr: "x-amz-security-token: ..." */
    int kind;                /* S3_CREDS_ENV (never renewed), _INSTANCE, _CONTAINER, ... */
    char *service;           /* the metadata service, the container's endpoint, STS */
    char *auth_file;         /* the container endpoint's or the web identity's token file */
    char *role;              /* the instance role's name, or the web identity's role ARN */
    char *session;           /* the web identity's role session name */
    double expires;          /* seconds since the epoch (role credentials) */
    double last_try;         /* sp_now() of the last fetch */
    int stale;               /* the store answered ExpiredToken to these */
    unsigned long generation; /* counts the credentials fetched */
    char source[400];        /* where they come from, for messages (no secrets) */
    int ready;               /* mu initialised */
} s3_creds;

/* One request's copy of the credentials. */
typedef struct s3_cred_use {
    char *access_key, *secret_key, *token_hdr;
    unsigned long generation;
} s3_cred_use;

/* At open: the environment's, else the instance role's (fetched now). */
int s3_creds_open(store_t *s, s3_creds *c, sp_err *err);
/* A copy for one request, renewed first when due: 0; 1 (retry later: expired
 * and the metadata service did not answer) or a STORE_ code, with detail. */
int s3_creds_use(s3_creds *c, s3_cred_use *u, char *detail, size_t dn);
/* The store refused u's credentials as expired: they are renewed before the
 * next request. 1 when they can be (an instance role's), 0 when not. */
int s3_creds_expired(s3_creds *c, const s3_cred_use *u);
void s3_cred_use_free(s3_cred_use *u);
void s3_creds_close(s3_creds *c);

/* Read-only after store_s3_open, except the pool (under mu), the flag and
 * the credentials (under their own mutex). */
typedef struct s3_backend {
    char *bucket, *prefix; /* prefix: "" or without a trailing '/' */
    char *region;
    char *base;            /* objects live at base + "/" + encoded key */
    char *bucket_url;      /* bucket-level requests (list, create) */
    char *sigv4;           /* "aws:amz:REGION:s3" */
    s3_creds creds;
    char *ca_bundle;
    int aws_default;       /* no endpoint given: AWS itself */
    pthread_mutex_t mu;
    CURL **pool;           /* idle handles; each keeps its connections */
    size_t pool_n, pool_cap;
    atomic_int inm_unsupported; /* the store answered If-None-Match with 501 */
    atomic_int im_unsupported;  /* the store answered If-Match with 501 */
} s3_backend;

/* getenv(name), or NULL when it is unset or empty. */
const char *s3_env(const char *name);

#define S3_EMPTY_SHA256 "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

typedef struct s3_req {
    /* request */
    const char *method;        /* GET PUT HEAD POST DELETE */
    const char *what;          /* name in messages ("UploadPart 3"); NULL: method */
    const char *key;           /* relative to the store prefix; NULL: the bucket */
    const char *query;         /* canonical query string (sorted, encoded) or NULL */
    const void *body;          /* PUT/POST body from memory */
    size_t body_len;
    const char *body_sha;      /* hex SHA-256 of body; NULL: the empty hash */
    const char *hdr[4];        /* extra headers, NULL-terminated */
    membuf *out;               /* GET body into memory (reset on each attempt) */
    int fd;                    /* GET body into fd at [off, end] (ranged, resumed on retry) */
    char *mem;                 /* or (fd < 0) into mem[0 .. end - off], ranged the same way */
    uint64_t off, end;
    int body_may_be_error;     /* 200 whose body is <Error> is an error (CompleteMultipartUpload) */
    int tries;                 /* attempts; 0: 1 + opts.max_retries */
    double stall_s;            /* 0: opts.timeout_s */
    double until;              /* set by s3_call: sp_now() by which the request ends */
    store_cancel cancel2;      /* a second cancel flag (sibling transfer failed) */
    /* response, valid after s3_call */
    long status;
    int attempts;
    uint64_t got;              /* body bytes delivered to fd or mem (kept across retries) */
    uint64_t content_length;
    char etag[160];
    char code[96];             /* the store's <Code>, or "" */
    char region[64];           /* x-amz-bucket-region of the answer, or "" */
    char msg[512];             /* the store's <Message>, or "" */
    /* private to the request core */
    membuf ebody;
    size_t sent;
    uint64_t req_start;
    int sink_errno;
    int sink_bad_range;
} s3_req;

/* Runs r with retries. 0 on 2xx; else STORE_ENOENT (404), STORE_EEXIST (412),
 * STORE_EAUTH (401/403), STORE_ECANCELED, STORE_ELOCAL (fd write failed) or
 * STORE_EFAIL, with the message recorded in *err unless err is NULL. */
int s3_call(store_t *s, s3_req *r, store_cancel c, sp_err *err);
void s3_req_free(s3_req *r);

/* Percent-encodes for SigV4 (unreserved kept; '/' kept when keep_slash). */
char *s3_uri_encode(const char *in, int keep_slash);
void s3_sha256_hex(const void *data, size_t n, char out[65]);
/* The first descendant element named `name` of the XML in b; its text malloc'ed. */
char *s3_xml_find(const membuf *b, const char *name);
xmlDoc *s3_xml_parse(const membuf *b);                             /* NULL if not XML */
const xmlNode *s3_xml_node(const xmlNode *n, const char *name);    /* n, siblings, descendants */
char *s3_xml_text(const xmlNode *n);                               /* malloc'ed, or NULL */
/* Copies src into dst when dst holds no error yet (first failure wins). */
void s3_err_take(sp_err *dst, const sp_err *src);

/* store_s3_multipart.c */
typedef struct s3_src {
    int fd;                    /* read with pread when mem is NULL */
    const unsigned char *mem;
    uint64_t size;
} s3_src;
int s3_put_multipart(store_t *s, const char *key, const s3_src *src, int inm, store_cancel c,
                     sp_err *err);
int s3_get_ranges(store_t *s, const char *key, int fd, uint64_t size, const char *etag,
                  store_cancel c, sp_err *err);
int s3_head(store_t *s, const char *key, int *exists, uint64_t *size, char etag[160],
            store_cancel c, sp_err *err);

#endif
