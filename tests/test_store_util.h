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

#define TU_BUCKET "spotune-test"

#endif
