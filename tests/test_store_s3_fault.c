/* tests/test_store_s3_fault.c — the S3 store when the server fails: the proxy
 * killed in the middle of a multipart upload and restarted (the upload
 * completes through retries), the proxy killed (SIGKILL) in the middle of a
 * ranged read (it resumes where it was and returns the exact bytes), the
 * uploader while the store is down (backlog counted, then pushed), a hung
 * server (SIGSTOP) detected in seconds, and a multipart upload that fails
 * against a hung server aborted once the server answers (nothing left in
 * progress). Uses scripts/swift-s3.sh stop-one/start-one, SIGKILL and
 * SIGSTOP/SIGCONT on the server ctest started; every
 * test leaves the proxy running (the suite's fini, and a guard process for
 * SIGSTOP). */
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

/* Whatever a test did, leave the proxy running and healthy. */
static void proxy_back(void)
{
    tu_proxy_thaw();
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
        tu_swift("wait", "60");
    }
}

TestSuite(store_s3_fault, .timeout = 120, .fini = proxy_back);

static char *path_in(const char *dir, const char *name)
{
    char *p = NULL;
    cr_assert(asprintf(&p, "%s/%s", dir, name) > 0);
    return p;
}

typedef struct upload {
    store_t *s;
    const char *key, *path;
    int rc;
    double ended; /* sp_now() when store_put_file returned */
    atomic_int done;
    sp_err err;
} upload;

static void *run_upload(void *arg)
{
    upload *up = arg;
    up->rc = store_put_file(up->s, up->key, up->path, 0, &up->err);
    up->ended = sp_now();
    atomic_store(&up->done, 1);
    return NULL;
}

/* How many lines of text (from byte `from`) hold needle. */
static int count_lines(const char *text, size_t from, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(text + from, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

Test(store_s3_fault, proxy_killed_mid_multipart_upload_completes)
{
    /* 37 MiB in 8 MiB parts, 2 connections at 4 MiB/s each: about 5 s of
     * upload. The retry budget, 30 retries with a backoff ceiling of 2 s
     * (about 27 s expected, full jitter; hardly ever under 15 s), is far
     * longer than a restart of the proxy, even a slow one. */
    store_opts o = {.part_bytes = 8 * MIB, .parallel = 2, .max_send_bps = 4 * MIB,
                    .max_retries = 30, .retry_base_s = 0.25, .retry_max_s = 2, .timeout_s = 10};
    char *url = NULL;
    store_t *s = tu_s3_open("kill", &o, &url);
    char *dir = tu_tempdir("kill");
    cr_assert(dir, "cannot make a directory under the build tree");
    char *src = path_in(dir, "big.bin"), *back = path_in(dir, "back.bin");
    tu_random_file(src, 37 * MIB, 41);
    char *full = tu_s3_full_key(url, "ckpt/state.h5"), part[1300], complete[1300];
    snprintf(part, sizeof part, " PUT /" TU_BUCKET "/%s%%3FpartNumber%%3D", full);
    snprintf(complete, sizeof complete, " POST /" TU_BUCKET "/%s%%3FuploadId%%3D", full);
    size_t from = 0;
    free(tu_proxy_log(&from));
    upload up = {.s = s, .key = "ckpt/state.h5", .path = src, .rc = -99};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, run_upload, &up), 0);

    /* the upload is under way: a first part is stored */
    int part1 = tu_proxy_log_wait(from, part, 60);
    cr_assert(part1, "no part of the upload reached the store");
    cr_assert_eq(tu_swift("stop-one", "proxy"), 0);
    double t_kill = sp_now();
    char *before = tu_proxy_log(NULL); /* all the dead proxy logged */
    int parts_before = count_lines(before, from, part);
    int completed_before = count_lines(before, from, complete);
    free(before);
    int exists = 0;
    sp_err probe = {0};
    store_opts quick = {.endpoint = tu_s3_endpoint(), .max_retries = -1};
    store_t *q = NULL;
    cr_assert_eq(store_open(&q, "s3://" TU_BUCKET "/x", &quick, &probe), 0);
    cr_assert_eq(store_exists(q, "y", &exists, NULL, &probe), STORE_EFAIL, "the proxy is down");
    cr_assert(strstr(probe.msg, "HEAD failed: "), "%s", probe.msg);
    store_close(q);
    cr_assert_eq(tu_swift("start-one", "proxy"), 0);
    cr_assert_eq(tu_swift("wait", "60"), 0, "the proxy did not come back");
    double t_back = sp_now();

    pthread_join(th, NULL);
    cr_assert_lt(parts_before, 5, "all 5 parts were stored before the kill: not mid-upload");
    cr_assert_eq(completed_before, 0, "the upload was complete before the kill");
    cr_assert_eq(up.rc, 0, "the upload did not survive a %.1f s outage: %s", t_back - t_kill,
                 up.err.msg);
    /* in flight when the proxy died, so it finished through the restarted
     * one (which may listen before the health wait below reports it) */
    cr_assert_gt(up.ended, t_kill, "the transfer ended before the proxy was killed");
    sp_err err = {0};
    cr_assert_eq(store_get_file(s, "ckpt/state.h5", back, &err), 0, "%s", err.msg);
    cr_assert(tu_files_equal(src, back), "not byte-identical after retries");
    store_close(s);
    tu_rmtree(dir);
    free(full);
    free(url);
    free(src);
    free(back);
    free(dir);
}

typedef struct range_read {
    store_t *s;
    const char *key;
    uint64_t off;
    size_t n;
    uint8_t *dst;
    int rc;
    double ended;
    sp_err err;
} range_read;

static void *run_range(void *arg)
{
    range_read *rr = arg;
    rr->rc = store_get_range(rr->s, rr->key, rr->off, rr->n, rr->dst, &rr->err);
    rr->ended = sp_now();
    return NULL;
}

/* The bytes sent of the first "GET /bucket/full_key" in the proxy log after
 * byte `from` (the sixth access-log field after the request line, as in
 * test_store_s3.c); 0 if none. */
static unsigned long long get_bytes_sent(size_t from, const char *full_key)
{
    size_t n = 0;
    char *text = tu_proxy_log(&n), needle[1300];
    snprintf(needle, sizeof needle, " GET /" TU_BUCKET "/%s HTTP/1.0 ", full_key);
    char *p = n > from ? strstr(text + from, needle) : NULL;
    unsigned long long sent = 0;
    if (p) {
        p += strlen(needle);
        for (int i = 0; i < 5 && p; i++) {
            p = strchr(p, ' ');
            p = p ? p + 1 : NULL;
        }
        sent = p ? strtoull(p, NULL, 10) : 0;
    }
    free(text);
    return sent;
}

Test(store_s3_fault, proxy_killed_mid_range_read_resumes)
{
    /* 40 MiB at 4 MiB/s: about 10 s of transfer. The proxy is killed once
     * the first MiB has arrived (SIGKILL: SIGTERM would let it finish) and
     * restarted, with a retry budget far longer than a restart. The range is
     * larger than what the socket buffers hold (a few MiB each way), so the
     * connection ends early. Killing after a fixed delay instead was a race:
     * on a loaded machine the proxy had sometimes not sent a byte yet, and
     * the retry then asked for the whole range. */
    store_opts o = {.max_recv_bps = 4 * MIB, .max_retries = 30, .retry_base_s = 0.25,
                    .retry_max_s = 2, .timeout_s = 10};
    char *url = NULL;
    store_t *s = tu_s3_open("kill-range", &o, &url);
    char *full = tu_s3_full_key(url, "ckpt/shard-0.h5");
    const size_t size = 48 * MIB + 333;
    uint8_t *src = tu_random_bytes(size, 43);
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(s, "ckpt/shard-0.h5", src, size, 0, &err), 0, "%s", err.msg);
    range_read rr = {.s = s, .key = "ckpt/shard-0.h5", .off = 5 * MIB + 5, .n = 40 * MIB + 7,
                     .rc = -99};
    rr.dst = malloc(rr.n);
    cr_assert_not_null(rr.dst);
    /* each byte differs from the one the read will put there, so the last
     * byte of the first MiB says when that MiB has arrived (the read fills
     * dst in order as the response comes) */
    for (size_t i = 0; i < rr.n; i++)
        rr.dst[i] = (uint8_t)(src[rr.off + i] ^ 0xFF);
    const size_t mark = 1 * MIB - 1;
    pthread_t th;
    size_t from = 0;
    free(tu_proxy_log(&from));
    cr_assert_eq(pthread_create(&th, NULL, run_range, &rr), 0);
    int arrived = 0;
    for (double t0 = sp_now(); !arrived && sp_now() - t0 < 60; usleep(20 * 1000))
        arrived = __atomic_load_n(&rr.dst[mark], __ATOMIC_ACQUIRE) == src[rr.off + mark];
    cr_assert(arrived, "the first MiB of the read did not arrive in 60 s");
    cr_assert_eq(kill(tu_proxy_pid(), SIGKILL), 0);
    double t_kill = sp_now();
    cr_assert_eq(tu_swift("stop-one", "proxy"), 0); /* waits for it to be gone */
    cr_assert_eq(tu_swift("start-one", "proxy"), 0);
    cr_assert_eq(tu_swift("wait", "60"), 0, "the proxy did not come back");
    double t_back = sp_now();
    pthread_join(th, NULL);
    cr_assert_eq(rr.rc, 0, "the read did not survive a %.1f s outage: %s", t_back - t_kill,
                 rr.err.msg);
    /* in flight when the proxy died (it may end before the restarted proxy
     * is reported healthy: the retry goes through as soon as it listens,
     * and the health wait can be slow on a loaded machine); the resumed GET
     * below is the restarted proxy's */
    cr_assert_gt(rr.ended, t_kill, "the read ended before the proxy was killed");
    cr_assert_eq(memcmp(rr.dst, src + rr.off, rr.n), 0, "not byte-identical after retries");
    /* the retry asked for the rest only (the killed proxy logged nothing) */
    unsigned long long sent = 0;
    for (double t0 = sp_now(); !(sent = get_bytes_sent(from, full)) && sp_now() - t0 < 30;)
        usleep(50 * 1000);
    cr_expect(sent > 0 && sent < rr.n, "the resumed GET sent %llu of %zu bytes", sent, rr.n);
    store_close(s);
    free(full);
    free(url);
    free(rr.dst);
    free(src);
}

static char *make_ckpt(const char *parent, const char *name, uint64_t seed)
{
    char *d = path_in(parent, name);
    cr_assert_eq(mkdir(d, 0777), 0);
    char *p = path_in(d, "state.h5");
    tu_random_file(p, 1 * MIB + 17, seed);
    free(p);
    p = path_in(d, "MANIFEST.json");
    tu_write_bytes(p, name, strlen(name));
    free(p);
    return d;
}

Test(store_s3_fault, uploader_backlog_pushed_when_store_returns)
{
    store_opts so = {.max_retries = 1, .retry_base_s = 0.05, .timeout_s = 5};
    store_t *s = tu_s3_open("backlog", &so, NULL);
    char *dir = tu_tempdir("backlog");
    cr_assert(dir, "cannot make a directory under the build tree");
    char *c1 = make_ckpt(dir, "step-00000100", 1), *c2 = make_ckpt(dir, "step-00000200", 2);
    cr_assert_eq(tu_swift("stop-one", "proxy"), 0);

    uploader_opts uo = {.retry_base_s = 0.2, .retry_max_s = 0.5};
    uploader_t *u;
    sp_err err = {0};
    cr_assert_eq(uploader_start(&u, s, &uo, &err), 0);
    cr_assert_eq(uploader_submit(u, c1, "step-00000100", &err), 0);
    cr_assert_eq(uploader_submit(u, c2, "step-00000200", &err), 0);
    /* the first push fails (connection refused, after one retry) */
    sp_err last = {0};
    int failed = 0;
    for (double t0 = sp_now(); !(failed = uploader_last_error(u, &last)) && sp_now() - t0 < 60;)
        usleep(20 * 1000);
    cr_assert_eq(failed, 1, "no push failed with the store down");
    cr_assert_eq(uploader_pending(u), 2, "remote behind by 2 while the store is down");
    cr_assert_eq(uploader_wait(u, 0.3), 0);
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
    tu_proxy_freeze(120);
    double t0 = sp_now();
    int exists = 0;
    sp_err err = {0};
    int rc = store_exists(s, "anything", &exists, NULL, &err);
    double took = sp_now() - t0;
    tu_proxy_thaw();
    cr_assert_eq(rc, STORE_EFAIL, "%s", err.msg);
    /* the lower bound is the point (two attempts, each given up after 2 s
     * without a byte); the upper one only says "seconds, not minutes" */
    cr_assert_gt(took, 3.5, "two attempts with a 2 s stall limit (took %.1f s)", took);
    cr_assert_lt(took, 20.0, "took %.1f s", took);
    cr_assert(strstr(err.msg, "(after 2 attempts)"), "%s", err.msg);
    sp_err e2 = {0};
    cr_assert_eq(store_exists(s, "anything", &exists, NULL, &e2), 0, "back: %s", e2.msg);
    store_close(s);
}

/* A host name that does not resolve (.invalid never does) fails every
 * attempt the same way and says so; each retry gets a fresh handle (curl 7.88
 * answered the second attempt on the reused one with "A libcurl function was
 * given a bad argument"). */
Test(store_s3_fault, unresolvable_endpoint_is_named_on_every_attempt)
{
    setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE", 1);
    setenv("AWS_SECRET_ACCESS_KEY", "secret", 1);
    store_opts o = {.endpoint = "http://no-such-host.invalid:9", .max_retries = 2,
                    .retry_base_s = 0.05, .timeout_s = 5};
    store_t *s = NULL;
    sp_err err = {0};
    cr_assert_eq(store_open(&s, "s3://bucket/prefix", &o, &err), 0, "%s", err.msg);
    int exists = 0;
    int rc = store_exists(s, "anything", &exists, NULL, &err);
    store_close(s);
    cr_expect_eq(rc, STORE_EFAIL, "%s", err.msg);
    cr_expect(strstr(err.msg, "Could not resolve host: no-such-host.invalid") &&
                  strstr(err.msg, "(after 3 attempts)"),
              "%s", err.msg);
    cr_expect(!strstr(err.msg, "bad argument"), "%s", err.msg);
}

/* A multipart upload whose parts fail because the store hangs (proxy
 * SIGSTOPped; no retries, 2 s stall limit) is aborted: the abort, sent
 * once the part threads have given up, is answered when the proxy runs again,
 * and no incomplete upload of the key is left. (The listing is shown to see
 * an upload in progress by store_s3::failed_multipart_upload_is_aborted.) */
Test(store_s3_fault, multipart_upload_failing_on_a_hung_store_is_aborted)
{
    /* 4 parts of 5 MiB over 2 connections at 2 MiB/s each */
    store_opts o = {.part_bytes = 5 * MIB, .parallel = 2, .max_send_bps = 2 * MIB,
                    .max_retries = -1, .timeout_s = 2};
    char *url = NULL;
    store_t *s = tu_s3_open("hung-mpu", &o, &url);
    char *dir = tu_tempdir("hung-mpu");
    cr_assert(dir, "cannot make a directory under the build tree");
    char *src = path_in(dir, "big.bin");
    tu_random_file(src, 15 * MIB + 1, 71);
    char *full = tu_s3_full_key(url, "ckpt/state.h5");
    size_t from = 0;
    free(tu_proxy_log(&from));
    cr_assert_eq(tu_threads_named(STORE_PART_THREAD), 0, "part threads before the upload");
    upload up = {.s = s, .key = "ckpt/state.h5", .path = src, .rc = -99};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, run_upload, &up), 0);

    /* the upload exists and its parts are being sent: the store hangs.
     * Frozen once a part thread runs, i.e. once CreateMultipartUpload is
     * answered (the threads start after it): frozen as soon as the proxy
     * logged the request, its answer could be held too, and the upload
     * then failed at its creation instead (once, in the sanitizer build
     * of a full run) */
    int began = tu_proxy_log_wait(from, tu_mpu_created(full), 60), parts = 0;
    for (double t1 = sp_now(); began && !parts && !atomic_load(&up.done) && sp_now() - t1 < 60;)
        if (!(parts = tu_threads_named(STORE_PART_THREAD) > 0))
            usleep(2 * 1000);
    if (began && parts)
        tu_proxy_freeze(120);
    /* The parts stall and fail (curl's stall check: 2 s without a byte,
     * after its speed window of some seconds), the part thread ends, and the
     * upload's own thread sends the abort, which waits up to 10 s (twice) for
     * an answer: let the proxy run again then. */
    /* (the part threads by name: counting every thread of the process
     * against a count taken before the upload, as this test did, let another
     * thread that ended in between hide the part thread, once in a full run
     * of the suite) */
    int workers_seen = 0, workers_gone = 0, threads_max = 0;
    double t0 = sp_now(), waited = 0;
    for (; began && parts && !workers_gone && !atomic_load(&up.done); waited = sp_now() - t0) {
        int n = tu_threads_named(STORE_PART_THREAD);
        threads_max = n > threads_max ? n : threads_max;
        workers_gone = workers_seen && n == 0;
        workers_seen |= n > 0;
        if (sp_now() - t0 > 60)
            break;
        usleep(10 * 1000);
    }
    tu_proxy_thaw();
    pthread_join(th, NULL);
    cr_assert(began, "CreateMultipartUpload never reached the store");
    cr_assert(parts, "no part thread started (the upload: %s, %d %s)",
              atomic_load(&up.done) ? "done" : "running", up.rc, up.err.msg);
    /* (what the upload said, to tell a race of this test from the store's) */
    cr_assert(workers_seen && workers_gone,
              "the part threads were %s (%d at most; watched %.2f s; the upload: %s, %d %s)",
              workers_seen ? "never done" : "never seen", threads_max, waited,
              atomic_load(&up.done) ? "done" : "running", up.rc, up.err.msg);
    cr_assert_eq(up.rc, STORE_EFAIL, "the upload did not fail on the hung store: %d %s", up.rc,
                 up.err.msg);
    cr_assert(strstr(up.err.msg, "UploadPart"), "%s", up.err.msg);
    tu_expect_mpu_aborted(s, "ckpt/state.h5", full, from, 30);
    store_close(s);
    tu_rmtree(dir);
    free(full);
    free(url);
    free(src);
    free(dir);
}
