/* checkpoint/store.h — object stores for checkpoints: one API over a
 * directory (file:///abs/path, local disk, NFS or a FUSE mount) and S3-compatible
 * object storage (s3://bucket/prefix: AWS S3, MinIO, Ceph RGW, Swift s3api,
 * R2, OSS, COS), plus the directory-level operations the checkpoint protocol
 * needs (push a checkpoint with MANIFEST.json last, pull one, prune old ones
 * MANIFEST first). Owns: URL parsing, S3 request signing (SigV4 via libcurl),
 * multipart and ranged transfers, retries with backoff, atomic publication on
 * file://. Does not own: what a checkpoint contains or whether it is valid
 * (checkpoint code verifies MANIFEST checksums after a pull).
 *
 * Keys are relative to the URL's prefix ("step-00001200/state.h5"): no leading
 * '/', no empty, "." or ".." segments, at most 1024 bytes, no control chars.
 *
 * Errors: every int-returning function returns 0 or a negative STORE_E* value
 * and records a message in *err ("s3://b/p/step-1/state.h5: PUT failed: 403
 * SignatureDoesNotMatch: ..."). err->code holds the process exit code the
 * failure maps to (SP_EXIT_INPUT for a missing object, SP_EXIT_USAGE for a bad
 * URL, key or option, SP_EXIT_OTHER otherwise). Messages never contain
 * credentials.
 *
 * Credentials (s3://) come only from the environment, read once by store_open:
 * AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and, for temporary credentials,
 * AWS_SESSION_TOKEN.
 *
 * Threads: every function may be called concurrently on one store_t (for
 * example the uploader thread pushing while the main thread lists), except
 * store_close, which must not overlap any other call on that store. */
#ifndef SPOTUNE_STORE_H
#define SPOTUNE_STORE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "base/base.h"

typedef struct store store_t;

/* Return values (negative; 0 is success). */
enum {
    STORE_EFAIL = -1,     /* remote or transport failure (after retries) */
    STORE_ENOENT = -2,    /* no such object (or nothing under a prefix) */
    STORE_EEXIST = -3,    /* if_none_match and the object exists; or a conflict */
    STORE_EAUTH = -4,     /* 401/403: credentials, signature, permissions */
    STORE_ELOCAL = -5,    /* local file or directory error */
    STORE_EUSAGE = -6,    /* bad URL, key or option */
    STORE_ECANCELED = -7, /* a cancel flag was raised */
    STORE_ENOBUCKET = -8, /* s3://: the bucket does not exist (404 NoSuchBucket) */
    STORE_EPEER = -9      /* push: a rank did not put its shard in time (shards_put_by_ranks) */
};

enum { STORE_ADDR_AUTO = 0, STORE_ADDR_PATH = 1, STORE_ADDR_VHOST = 2 };

/* Zero or NULL fields take the default shown. */
/* The name of the threads a multipart upload or ranged GET adds (top -H, gdb). */
#define STORE_PART_THREAD "store-part"

typedef struct store_opts {
    const char *endpoint;  /* "https://host[:port]"; else AWS_ENDPOINT_URL_S3, else
                              AWS_ENDPOINT_URL, else AWS's regional endpoint */
    const char *region;    /* else AWS_REGION, else AWS_DEFAULT_REGION, else us-east-1 */
    int addressing;        /* STORE_ADDR_AUTO (default): virtual-host on AWS, Alibaba
                              OSS and Tencent COS endpoints (unless the bucket name has
                              '.', '_' or capitals), path-style elsewhere;
                              STORE_ADDR_PATH: endpoint/bucket/key;
                              STORE_ADDR_VHOST: bucket.endpoint/key */
    size_t part_bytes;     /* multipart part and ranged-GET chunk size: >= 5 MiB, default 16 MiB */
    int parallel;          /* connections per multipart upload / ranged GET, default 4
                              (the calling thread and parallel - 1 threads named
                              STORE_PART_THREAD) */
    int max_retries;       /* retries after the first attempt, default 8; < 0: none */
    double timeout_s;      /* longest transfer stall (no byte either way), default 30;
                              connecting: at most 10 */
    double request_deadline_s; /* longest one request may take, its retries and their waits
                              included, default 300 (a multipart upload or ranged GET is
                              one request per part) */
    double retry_base_s;   /* first backoff ceiling, default 0.25 s, doubling ... */
    double retry_max_s;    /* ... up to this ceiling, default 20 s (full jitter below it) */
    uint64_t max_send_bps; /* per-connection upload limit in bytes/s, 0: none */
    uint64_t max_recv_bps; /* per-connection download limit in bytes/s, 0: none */
} store_opts;

typedef struct store_entry {
    char *key;
    uint64_t size;
} store_entry;

typedef struct store_list {
    store_entry *items;
    size_t n;
} store_listing;

/* url: "file:///abs/path" or "s3://bucket[/prefix]". opts may be NULL. */
int store_open(store_t **out, const char *url, const store_opts *opts, sp_err *err);
void store_close(store_t *s);
/* "s3://bucket/prefix" or "file:///path", without a trailing '/'. */
const char *store_url(const store_t *s);
/* Where an s3:// store's credentials come from, as store_open finds them
 * (the environment, else the EC2 instance role's from the metadata
 * service, store_s3_creds.c): 0 with a line in source naming it (never a
 * secret), or STORE_EUSAGE with why. */
int store_s3_credentials(char *source, size_t n, sp_err *err);

/* Uploads a file or a buffer. Objects larger than part_bytes go up as a
 * multipart upload. if_none_match: never replace an existing object; then
 * STORE_EEXIST if it exists. S3 sends "If-None-Match: *"; a store that answers
 * 501 NotImplemented (Swift s3api, older MinIO/Ceph) is remembered and then
 * checked with a HEAD before a plain PUT, which is not atomic against a
 * concurrent writer. file:// links a temporary file into place (atomic). */
int store_put_file(store_t *s, const char *key, const char *local_path, int if_none_match,
                   sp_err *err);
int store_put_bytes(store_t *s, const char *key, const void *data, size_t n, int if_none_match,
                    sp_err *err);

/* Compare-and-swap on a small object (at most part_bytes), for an object
 * that several jobs may race to write (the lease): store_get_bytes_tag reads
 * it as store_get_bytes does, plus its version tag (tag: STORE_TAG_MAX bytes;
 * the ETag on s3://, the file's inode, time and size on file://);
 * store_put_bytes_if writes it only while it is as read: tag "" when it must
 * not exist, else the tag read. STORE_EEXIST when it is not (another writer
 * came first, or it was deleted); read it again to see who. s3:// sends
 * If-None-Match: * or If-Match: TAG (AWS S3, R2 and MinIO make that atomic);
 * a store that answers 501 NotImplemented to If-Match is remembered and then
 * checked with a HEAD before a plain PUT, which is not atomic against a
 * concurrent writer. file:// checks and renames under an exclusive lock on
 * the object's directory (flock), and falls back the same way where the
 * directory cannot be locked (some network file systems). */
#define STORE_TAG_MAX 160
int store_get_bytes_tag(store_t *s, const char *key, void **data, size_t *n, char *tag,
                        sp_err *err);
int store_put_bytes_if(store_t *s, const char *key, const void *data, size_t n, const char *tag,
                       sp_err *err);

/* Downloads into local_path through a temporary file in the same directory,
 * fsync'ed and renamed into place (an existing file is replaced). Large objects
 * are fetched as parallel ranged GETs pinned to one ETag. */
int store_get_file(store_t *s, const char *key, const char *local_path, sp_err *err);
/* *data is malloc'ed (one extra NUL byte after n, not counted); free() it. */
int store_get_bytes(store_t *s, const char *key, void **data, size_t *n, sp_err *err);
/* Reads exactly n bytes of object key starting at byte off into dst (one
 * ranged GET on s3://, pread on file://). STORE_ENOENT when the object is
 * missing; STORE_EFAIL (message naming the key and the range) when the object
 * ends before off + n. n == 0 succeeds without a request. */
int store_get_range(store_t *s, const char *key, uint64_t off, size_t n, void *dst, sp_err *err);

/* Every object whose key starts with key_prefix ("" for all), keys relative
 * to the store prefix, sorted by byte value. */
int store_list(store_t *s, const char *key_prefix, store_listing *out, sp_err *err);
void store_list_free(store_listing *l);

/* Deleting a missing object succeeds (as S3 does). */
int store_delete(store_t *s, const char *key, sp_err *err);
/* *exists = 0 and 0 returned when the object is missing; size may be NULL. */
int store_exists(store_t *s, const char *key, int *exists, uint64_t *size, sp_err *err);

/* Creates the URL's bucket (s3://; "already owned by you" is success) or
 * directory (file://). Checkpoint runs expect the bucket to exist; this is for
 * tools and tests. */
int store_create_bucket(store_t *s, sp_err *err);

/* ---- checkpoint directories ---------------------------------------------- */

/* Options of the directory-level operations; NULL for none. */
typedef struct store_xfer_opts {
    const atomic_int *cancel; /* nonzero: stop at once (transfers in flight, backoff sleeps) */
    void (*on_key)(void *arg, const char *key); /* after each object put, got or deleted */
    void *arg;
    /* push of a sharded checkpoint whose ranks put their shard files
     * (shard-*.h5, ckpt.h) themselves: those are not sent, and MANIFEST.json
     * goes up only once each is in the store with its local size, polled for
     * up to shards_wait_s (then STORE_EPEER naming the missing shard) */
    int shards_put_by_ranks;
    double shards_wait_s;
} store_xfer_opts;

/* Pushes checkpoint directory local_dir to prefix/ ("step-00001200"): every
 * regular file (recursively) except the top-level MANIFEST.json, then
 * MANIFEST.json last with if_none_match. local_dir must hold MANIFEST.json.
 * A remote MANIFEST.json identical to the local one means the checkpoint is
 * already pushed (success, nothing sent); a different one is STORE_EEXIST and
 * nothing is overwritten. (x->shards_put_by_ranks: see store_xfer_opts.) */
int store_push_dir(store_t *s, const char *local_dir, const char *prefix,
                   const store_xfer_opts *x, sp_err *err);

/* Downloads every object under prefix/ into a temporary sibling of local_dir,
 * then renames it to local_dir, which must not exist. STORE_ENOENT when the
 * prefix holds nothing. Does not verify the checkpoint. */
int store_pull_dir(store_t *s, const char *prefix, const char *local_dir,
                   const store_xfer_opts *x, sp_err *err);

/* Retention over the checkpoints "step-<digits>/" at the top of the store:
 * keeps the newest `keep` (>= 1) complete ones (holding MANIFEST.json) and,
 * when keep_every > 0, every complete one whose step is a multiple of it.
 * Deletes the other complete ones, and incomplete ones older than the newest
 * complete one (newer ones may be uploads in flight). Each is deleted MANIFEST
 * first, so a half-deleted checkpoint is never taken for a complete one.
 * *n_pruned (may be NULL) receives how many checkpoints were deleted. */
int store_prune_steps(store_t *s, int keep, int keep_every, const store_xfer_opts *x,
                      int *n_pruned, sp_err *err);

#endif
