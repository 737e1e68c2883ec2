/* tests/test_store_util.h — shared by the store suites: scratch directories,
 * random files, byte comparison, running programs (awscli, swift-s3.sh), and
 * opening a store on the local S3 test server (tests/store.cmake starts it). */
#ifndef SPOTUNE_TEST_STORE_UTIL_H
#define SPOTUNE_TEST_STORE_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "checkpoint/store.h"

/* A fresh directory under the build tree; removed by tu_rmtree. */
char *tu_tmpdir(const char *tag);
void tu_rmtree(const char *dir);
/* Writes n pseudo-random bytes (stream `seed`) to path. */
void tu_random_file(const char *path, size_t n, uint64_t seed);
void *tu_random_bytes(size_t n, uint64_t seed);
void tu_write_file(const char *path, const void *data, size_t n);
/* 1 when both files exist with identical bytes. */
int tu_files_equal(const char *a, const char *b);
/* Runs argv (no shell); stdout into out_path when not NULL. Returns the exit status. */
int tu_run(char *const argv[], const char *out_path);
/* Runs scripts/swift-s3.sh with one or two arguments. */
int tu_swift(const char *cmd, const char *arg);
/* A name unique to this process: "<tag>-<pid>-<usec>". */
char *tu_unique(const char *tag);

/* The S3 test server's endpoint; fails the test when the environment is
 * missing (an S3 test must never pass without a server). */
const char *tu_s3_endpoint(void);
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

/* ---- the test server's proxy (fault injection) ---------------------------- */

/* The pid of the running Swift proxy ($SWIFT_S3_BASE/run/proxy.pid). */
int tu_proxy_pid(void);
/* SIGSTOPs the proxy (the store hangs: connections are accepted, nothing is
 * answered). A guard process sends SIGCONT if this process ends first (a
 * failed assertion, a crash, a timeout) or after max_s seconds, so a stopped
 * proxy never outlives the test. tu_proxy_thaw sends SIGCONT at once. */
void tu_proxy_freeze(double max_s);
void tu_proxy_thaw(void);
/* The proxy's log: one line per request, which ends "... bytes_recvd
 * bytes_sent etag txn headers request_time source info start_time end_time
 * policy". The whole text (malloc'ed), and its current size. */
char *tu_proxy_log(size_t *len);
/* Polls the proxy log (after byte offset `from`) until it holds `needle`,
 * up to timeout_s; returns 1 if it does. */
int tu_proxy_log_wait(size_t from, const char *needle, double timeout_s);

#define TU_BUCKET "spotune-test"

#endif
