/* tests/test_store_util.h — shared by the store suites (with test_util.h:
 * scratch directories, the S3 test server's endpoint and proxy): random
 * files, byte comparison, running programs (awscli, swift-s3.sh), and opening
 * a store on the local S3 test server (tests/store.cmake starts it). */
#ifndef SPOTUNE_TEST_STORE_UTIL_H
#define SPOTUNE_TEST_STORE_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "checkpoint/store.h"
#include "test_util.h"

/* Writes n pseudo-random bytes (stream `seed`) to path. */
void tu_random_file(const char *path, size_t n, uint64_t seed);
void *tu_random_bytes(size_t n, uint64_t seed);
void tu_write_bytes(const char *path, const void *data, size_t n);
/* 1 when both files exist with identical bytes. */
int tu_files_equal(const char *a, const char *b);
/* Runs argv (no shell); stdout into out_path when not NULL. Returns the exit status. */
int tu_run(char *const argv[], const char *out_path);
/* Runs scripts/swift-s3.sh with one or two arguments. */
int tu_swift(const char *cmd, const char *arg);
/* Threads of this process named name (/proc/self/task/N/comm): spotune's
 * own threads name themselves (sp_name_thread). */
int tu_threads_named(const char *name);
/* A name unique to this process: "<tag>-<pid>-<usec>". */
char *tu_unique(const char *tag);

/* Opens s3://BUCKET/<unique prefix> on the test server (creating the bucket);
 * o may be NULL, its endpoint is filled in. *url receives the URL. */
store_t *tu_s3_open(const char *tag, store_opts *o, char **url);
/* The key a store key has in the bucket: "<prefix of url>/key" (malloc'ed). */
char *tu_s3_full_key(const char *url, const char *key);

/* Runs awscli against the test server (endpoint, region and no metadata
 * lookups set): argv after "aws --endpoint-url EP", NULL-terminated. stdout
 * into out_path when not NULL. Returns the exit status. */
int tu_aws(const char *out_path, ...);
/* How many multipart uploads of full_key (a key in TU_BUCKET) are in
 * progress, from ListMultipartUploads through awscli. */
int tu_s3_uploads_in_progress(const char *full_key);

/* The proxy log's line of a started multipart upload of full_key (a key in
 * TU_BUCKET): the needle for tu_proxy_log_wait (one of tu_fmt's strings). */
const char *tu_mpu_created(const char *full_key);
/* After a multipart upload of key (full_key in the bucket) failed: the store
 * was told to abort it (in the proxy log after offset `from`, within wait_s),
 * no incomplete upload of it is left, and no object. */
void tu_expect_mpu_aborted(store_t *s, const char *key, const char *full_key, size_t from,
                           double wait_s);

/* store_get_range on s, against an object of a few MiB and some odd bytes
 * put under key: a middle range, the whole object, a range ending at its end
 * (the bytes compared with what was put), ranges past its end (STORE_EFAIL
 * naming the key), a missing key (STORE_ENOENT) and n == 0 (0). */
void tu_check_get_range(store_t *s, const char *key);

/* store_put_bytes_if on key cas/LEASE.json: a create ("") once only, a
 * replace with the tag read, a stale tag refused (the object unchanged), a
 * deleted object's tag refused (nothing created), a missing object read
 * as STORE_ENOENT with tag "". */
void tu_check_put_if(store_t *s);

#define TU_BUCKET "spotune-test"

/* A file:// store in a fresh scratch directory (tests/test_store_file*.c). */
typedef struct tu_file_fx {
    char *dir;   /* scratch */
    char *root;  /* store root (dir/store) */
    char *url;
    store_t *s;
} tu_file_fx;
tu_file_fx tu_file_store(const char *tag);
void tu_file_store_close(tu_file_fx *f);
/* "dir/name", malloc'ed */
char *tu_path_in(const char *dir, const char *name);
/* A checkpoint directory parent/name: state.h5 (big bytes), two shards, a
 * sub/ file, MANIFEST.json; its path, malloc'ed. */
char *tu_make_ckpt(const char *parent, const char *name, uint64_t seed, size_t big);
/* The files tu_make_ckpt makes are the same bytes under a and b (asserted). */
void tu_assert_same_tree(const char *a, const char *b);

#endif
