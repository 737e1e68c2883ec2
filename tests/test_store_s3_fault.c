/* tests/test_store_s3_fault.c — the S3 store when the server fails: the proxy
 * killed in the middle of a multipart upload and restarted (the upload
 * completes through retries), the uploader while the store is down (backlog
 * counted, then pushed), and a hung server (SIGSTOP) detected in seconds.
 * Uses scripts/swift-s3.sh stop-one/start-one on the server ctest started. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/store.h"
#include "checkpoint/uploader.h"
#include "test_store_util.h"

#define MIB ((size_t)1 << 20)

static pid_t proxy_pid(void)
{
    const char *base = getenv("SWIFT_S3_BASE");
    cr_assert(base && *base, "SWIFT_S3_BASE missing (ctest sets it)");
    char path[1024];
    snprintf(path, sizeof path, "%s/run/proxy.pid", base);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    int pid = 0;
    cr_assert_eq(fscanf(f, "%d", &pid), 1);
    fclose(f);
    return (pid_t)pid;
}

/* Whatever a test did, leave the proxy running and healthy. */
static void proxy_back(void)
{
    const char *base = getenv("SWIFT_S3_BASE");
    if (base && *base) {
        char path[1024];
        snprintf(path, sizeof path, "%s/run/proxy.pid", base);
        FILE *f = fopen(path, "r");
        int pid = 0;
        if (f && fscanf(f, "%d", &pid) == 1 && pid > 0)
            kill(pid, SIGCONT);
        if (f)
            fclose(f);
        tu_swift("start-one", "proxy");
        tu_swift("wait", "30");
    }
}

TestSuite(store_s3_fault, .timeout = 120, .fini = proxy_back);

static char *path_in(const char *dir, const char *name)
{
    char *p = NULL;
    cr_assert(asprintf(&p, "%s/%s", dir, name) > 0);
    return p;
}

static void sleep_s(double s)
{
    usleep((useconds_t)(s * 1e6));
}

typedef struct upload {
    store_t *s;
    const char *key, *path;
    int rc;
    double took;
    sp_err err;
} upload;

static void *run_upload(void *arg)
{
    upload *up = arg;
    double t0 = sp_now();
    up->rc = store_put_file(up->s, up->key, up->path, 0, &up->err);
    up->took = sp_now() - t0;
    return NULL;
}

Test(store_s3_fault, proxy_killed_mid_multipart_upload_completes)
{
    /* 37 MiB in 8 MiB parts, 2 connections at 4 MiB/s each: about 5 s of upload */
    store_opts o = {.part_bytes = 8 * MIB, .parallel = 2, .max_send_bps = 4 * MIB,
                    .max_retries = 12, .retry_base_s = 0.25, .retry_max_s = 2, .timeout_s = 10};
    store_t *s = tu_s3_open("kill", &o, NULL);
    char *dir = tu_tmpdir("kill");
    char *src = path_in(dir, "big.bin"), *back = path_in(dir, "back.bin");
    tu_random_file(src, 37 * MIB, 41);
    upload up = {s, "ckpt/state.h5", src, -99, 0, {0}};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, run_upload, &up), 0);

    sleep_s(1.5);
    double t_kill = sp_now();
    cr_assert_eq(tu_swift("stop-one", "proxy"), 0);
    int exists = 0;
    sp_err probe = {0};
    store_opts quick = {.endpoint = tu_s3_endpoint(), .max_retries = -1};
    store_t *q = NULL;
    cr_assert_eq(store_open(&q, "s3://" TU_BUCKET "/x", &quick, &probe), 0);
    cr_assert_eq(store_exists(q, "y", &exists, NULL, &probe), STORE_EFAIL, "the proxy is down");
    cr_assert(strstr(probe.msg, "HEAD failed: "), "%s", probe.msg);
    store_close(q);
    sleep_s(2.0);
    cr_assert_eq(tu_swift("start-one", "proxy"), 0);
    double outage = sp_now() - t_kill;

    pthread_join(th, NULL);
    cr_assert_eq(up.rc, 0, "the upload did not survive a %.1f s outage: %s", outage, up.err.msg);
    cr_assert_gt(up.took, 1.5 + outage, "the transfer was in flight across the outage");
    sp_err err = {0};
    cr_assert_eq(store_get_file(s, "ckpt/state.h5", back, &err), 0, "%s", err.msg);
    cr_assert(tu_files_equal(src, back), "not byte-identical after retries");
    store_close(s);
    tu_rmtree(dir);
    free(src);
    free(back);
    free(dir);
}

static char *make_ckpt(const char *parent, const char *name, uint64_t seed)
{
    char *d = path_in(parent, name);
    cr_assert_eq(mkdir(d, 0777), 0);
    char *p = path_in(d, "state.h5");
    tu_random_file(p, 1 * MIB + 17, seed);
    free(p);
    p = path_in(d, "MANIFEST.json");
    tu_write_file(p, name, strlen(name));
    free(p);
    return d;
}

Test(store_s3_fault, uploader_backlog_pushed_when_store_returns)
{
    store_opts so = {.max_retries = 1, .retry_base_s = 0.05, .timeout_s = 5};
    store_t *s = tu_s3_open("backlog", &so, NULL);
    char *dir = tu_tmpdir("backlog");
    char *c1 = make_ckpt(dir, "step-00000100", 1), *c2 = make_ckpt(dir, "step-00000200", 2);
    cr_assert_eq(tu_swift("stop-one", "proxy"), 0);

    uploader_opts uo = {.retry_base_s = 0.2, .retry_max_s = 0.5};
    uploader_t *u;
    sp_err err = {0};
    cr_assert_eq(uploader_start(&u, s, &uo, &err), 0);
    cr_assert_eq(uploader_submit(u, c1, "step-00000100", &err), 0);
    cr_assert_eq(uploader_submit(u, c2, "step-00000200", &err), 0);
    sleep_s(1.5);
    cr_assert_eq(uploader_pending(u), 2, "remote behind by 2 while the store is down");
    cr_assert_eq(uploader_wait(u, 0.3), 0);
    sp_err last = {0};
    cr_assert_eq(uploader_last_error(u, &last), 1);
    cr_assert(strstr(last.msg, "s3://" TU_BUCKET "/"), "%s", last.msg);
    cr_assert(strstr(last.msg, "connect"), "a connection failure: %s", last.msg);
    cr_assert_null(strstr(last.msg, "spotune-local-test-secret-7f3a"), "secret in: %s", last.msg);

    cr_assert_eq(tu_swift("start-one", "proxy"), 0);
    cr_assert_eq(uploader_wait(u, 30), 1, "backlog pushed once the store is back");
    cr_assert_eq(uploader_pending(u), 0);
    uploader_stop(u);

    const char *names[] = {"step-00000100", "step-00000200"};
    char *locals[] = {c1, c2};
    for (int i = 0; i < 2; i++) {
        char *back = path_in(dir, "back"), *a = path_in(locals[i], "state.h5");
        char *b = path_in(back, "state.h5");
        cr_assert_eq(store_pull_dir(s, names[i], back, NULL, &err), 0, "%s", err.msg);
        cr_assert(tu_files_equal(a, b));
        tu_rmtree(back);
        free(a);
        free(b);
        free(back);
    }
    store_close(s);
    tu_rmtree(dir);
    free(c1);
    free(c2);
    free(dir);
}

Test(store_s3_fault, hung_server_detected_in_seconds)
{
    store_opts o = {.timeout_s = 2, .max_retries = 1, .retry_base_s = 0.1};
    store_t *s = tu_s3_open("hung", &o, NULL);
    pid_t pid = proxy_pid();
    cr_assert_eq(kill(pid, SIGSTOP), 0);
    double t0 = sp_now();
    int exists = 0;
    sp_err err = {0};
    int rc = store_exists(s, "anything", &exists, NULL, &err);
    double took = sp_now() - t0;
    kill(pid, SIGCONT);
    cr_assert_eq(rc, STORE_EFAIL, "%s", err.msg);
    cr_assert_lt(took, 8.0, "took %.1f s", took);
    cr_assert_gt(took, 3.5, "two attempts with a 2 s stall limit (took %.1f s)", took);
    cr_assert(strstr(err.msg, "(after 2 attempts)"), "%s", err.msg);
    sp_err e2 = {0};
    cr_assert_eq(store_exists(s, "anything", &exists, NULL, &e2), 0, "back: %s", e2.msg);
    store_close(s);
}
