/* tests/test_store_s3.c — the store API against a real S3 server (Swift +
 * s3api, started by ctest through scripts/swift-s3.sh): round trips through
 * single PUT and multipart, ListObjectsV2 pagination, errors and credentials,
 * conditional puts, both addressing styles, checkpoint ordering (MANIFEST last
 * on push, first on prune), interoperability with awscli, parallel ranged
 * GETs (seen in the server's access log), store_get_range, and a failed
 * multipart upload aborted (nothing left in ListMultipartUploads). */
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

TestSuite(store_s3, .timeout = 120);

static char *path_in(const char *dir, const char *name)
{
    char *p = NULL;
    cr_assert(asprintf(&p, "%s/%s", dir, name) > 0);
    return p;
}

static void roundtrip(store_t *s, const char *dir, const char *key, size_t n, uint64_t seed)
{
    char *src = path_in(dir, "src.bin"), *back = path_in(dir, "back.bin");
    tu_random_file(src, n, seed);
    sp_err err = {0};
    cr_assert_eq(store_put_file(s, key, src, 0, &err), 0, "put %zu: %s", n, err.msg);
    int exists = 0;
    uint64_t size = 0;
    cr_assert_eq(store_exists(s, key, &exists, &size, &err), 0, "%s", err.msg);
    cr_assert(exists);
    cr_assert_eq(size, n);
    cr_assert_eq(store_get_file(s, key, back, &err), 0, "get %zu: %s", n, err.msg);
    cr_assert(tu_files_equal(src, back), "%zu bytes: not byte-identical", n);
    free(src);
    free(back);
}

Test(store_s3, roundtrip_1k_5m_37m)
{
    store_opts o = {.part_bytes = 8 * MIB};
    store_t *s = tu_s3_open("rt", &o, NULL);
    char *dir = tu_tempdir("s3rt");
    cr_assert(dir, "cannot make a directory under the build tree");
    roundtrip(s, dir, "rt/one-kib", 1024, 11);
    roundtrip(s, dir, "rt/five-mib", 5 * MIB, 12);        /* one PUT */
    roundtrip(s, dir, "rt/thirty-seven-mib", 37 * MIB, 13); /* 5 parts of 8 MiB, ranged GET */
    roundtrip(s, dir, "rt/empty", 0, 14);

    void *data = NULL;
    size_t n = 0;
    sp_err err = {0};
    void *small = tu_random_bytes(1024, 15);
    cr_assert_eq(store_put_bytes(s, "rt/bytes", small, 1024, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(store_get_bytes(s, "rt/bytes", &data, &n, &err), 0, "%s", err.msg);
    cr_assert_eq(n, 1024);
    cr_assert_eq(memcmp(data, small, n), 0);
    free(data);
    free(small);
    store_close(s);
    tu_rmtree(dir);
    free(dir);
}

/* An EC2 instance role's credentials, from a fake metadata service
 * (tests/tools/fake_metadata.py) that hands out the test server's key, with
 * a session token: a single PUT, a multipart one (parts in parallel, each
 * signed with its own copy) and a ranged parallel GET reach the real store,
 * and the service was asked once. */
Test(store_s3, instance_role_credentials_reach_the_store)
{
    char *dir = tu_tempdir("s3role"), url[64];
    char *creds = sp_strf("%s/creds.json", dir), *fetches = sp_strf("%s.fetches", creds);
    char *json = sp_strf("{\"role\": \"spotune-ci\", \"AccessKeyId\": \"%s\", "
                         "\"SecretAccessKey\": \"%s\", \"Token\": \"session-token-1\"}",
                         getenv("AWS_ACCESS_KEY_ID"), getenv("AWS_SECRET_ACCESS_KEY"));
    cr_assert_eq(tu_write_file(creds, json), 0);
    char *log = sp_strf("%s/meta.log", dir), *args = sp_strf("--creds %s", creds);
    int pid = tu_fake_metadata(log, args, url, sizeof url);
    store_opts o = {.part_bytes = 5 * MIB, .endpoint = tu_s3_endpoint()};
    unsetenv("AWS_ACCESS_KEY_ID");
    unsetenv("AWS_SECRET_ACCESS_KEY");
    unsetenv("AWS_SESSION_TOKEN");
    unsetenv("AWS_EC2_METADATA_DISABLED"); /* scripts/test.sh sets it */
    setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", url, 1);
    char *prefix = tu_unique("role"), *where = sp_strf("s3://" TU_BUCKET "/%s", prefix);
    store_t *s = NULL;
    sp_err err = {0};
    cr_assert_eq(store_open(&s, where, &o, &err), 0, "%s", err.msg);
    cr_assert_eq(store_create_bucket(s, &err), 0, "%s", err.msg);
    roundtrip(s, dir, "role/small", 4096, 21);
    roundtrip(s, dir, "role/multipart", 17 * MIB, 22); /* 4 parts, ranged GET */
    store_close(s);
    char *got = tu_read_file(fetches, NULL);
    cr_expect(got && !strcmp(got, "test:tester\n"), "asked: %s", got ? got : "(never)");
    free(got);
    kill(pid, SIGTERM);
    tu_wait(pid, 10);
    tu_rmtree(dir);
    free(dir), free(creds), free(fetches), free(json), free(log), free(args);
    free(prefix), free(where);
}

Test(store_s3, exactly_part_size_and_odd_keys)
{
    store_opts o = {.part_bytes = 5 * MIB, .parallel = 3};
    store_t *s = tu_s3_open("edge", &o, NULL);
    char *dir = tu_tempdir("s3edge");
    cr_assert(dir, "cannot make a directory under the build tree");
    roundtrip(s, dir, "edge/exactly-part", 5 * MIB, 21);         /* single PUT */
    roundtrip(s, dir, "edge/part-plus-one", 5 * MIB + 1, 22);    /* 2 parts */
    roundtrip(s, dir, "edge/sp ace+plus=&(x)~é,;", 100, 23);     /* SigV4 encoding */
    store_listing l;
    sp_err err = {0};
    cr_assert_eq(store_list(s, "edge/sp ace", &l, &err), 0, "%s", err.msg);
    cr_assert_eq(l.n, 1);
    cr_assert_str_eq(l.items[0].key, "edge/sp ace+plus=&(x)~é,;");
    store_list_free(&l);
    store_close(s);
    tu_rmtree(dir);
    free(dir);
}

typedef struct filler {
    store_t *s;
    int from, to;
    int failures;
} filler;

static void *fill(void *arg)
{
    filler *f = arg;
    for (int i = f->from; i < f->to; i++) {
        char key[64];
        sp_err err = {0};
        snprintf(key, sizeof key, "many/k-%05d", i);
        if (store_put_bytes(f->s, key, key, strlen(key), 0, &err))
            f->failures++;
    }
    return NULL;
}

Test(store_s3, list_paginates_past_1000_keys)
{
    store_t *s = tu_s3_open("page", NULL, NULL);
    enum { N = 1005, T = 4 };
    pthread_t th[T];
    filler f[T];
    for (int t = 0; t < T; t++) {
        f[t] = (filler){s, t * N / T, (t + 1) * N / T, 0};
        cr_assert_eq(pthread_create(&th[t], NULL, fill, &f[t]), 0);
    }
    for (int t = 0; t < T; t++) {
        pthread_join(th[t], NULL);
        cr_assert_eq(f[t].failures, 0);
    }
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(s, "manz", "x", 1, 0, &err), 0);
    store_listing l;
    cr_assert_eq(store_list(s, "many/", &l, &err), 0, "%s", err.msg);
    cr_assert_eq(l.n, N, "all %d keys across pages (got %zu)", N, l.n);
    for (size_t i = 0; i < l.n; i++) {
        char key[64];
        snprintf(key, sizeof key, "many/k-%05zu", i);
        cr_assert_str_eq(l.items[i].key, key);
        cr_assert_eq(l.items[i].size, strlen(key));
    }
    store_list_free(&l);
    cr_assert_eq(store_list(s, "", &l, &err), 0, "%s", err.msg);
    cr_assert_eq(l.n, N + 1);
    cr_assert_str_eq(l.items[N].key, "manz");
    store_list_free(&l);
    /* paged by the last key instead of the token (what a libcurl that
     * mis-signs a '+' of a query, 8.14 to 8.18, gets when a token holds
     * one): the same keys, in order */
    setenv("SPOTUNE_S3_LIST", "start-after", 1);
    cr_assert_eq(store_list(s, "many/", &l, &err), 0, "%s", err.msg);
    cr_assert_eq(l.n, N, "all %d keys across pages by start-after (got %zu)", N, l.n);
    for (size_t i = 0; i < l.n; i++) {
        char key[64];
        snprintf(key, sizeof key, "many/k-%05zu", i);
        cr_assert_str_eq(l.items[i].key, key);
    }
    store_list_free(&l);
    setenv("SPOTUNE_S3_LIST", "tokens", 1);
    int rc = store_list(s, "many/", &l, &err);
    cr_expect_eq(rc, STORE_EUSAGE, "rc %d: %s", rc, err.msg);
    cr_expect(tu_contains(err.msg, "SPOTUNE_S3_LIST=tokens: expected auto, token or start-after"),
              "%s", err.msg);
    unsetenv("SPOTUNE_S3_LIST");
    store_close(s);
}

static void assert_auth_failure(const char *secret, const char *key_id)
{
    tu_s3_endpoint();
    setenv("AWS_SECRET_ACCESS_KEY", secret, 1);
    if (key_id)
        setenv("AWS_ACCESS_KEY_ID", key_id, 1);
    store_opts o = {.endpoint = tu_s3_endpoint()};
    store_t *s = NULL;
    sp_err err = {0};
    cr_assert_eq(store_open(&s, "s3://" TU_BUCKET "/auth", &o, &err), 0, "%s", err.msg);
    double t0 = sp_now();
    int rc = store_put_bytes(s, "step-1/state.h5", "x", 1, 0, &err);
    double took = sp_now() - t0;
    cr_assert_eq(rc, STORE_EAUTH, "rc %d: %s", rc, err.msg);
    cr_assert_lt(took, 10.0, "an auth error is not retried (took %.1f s)", took);
    cr_assert(strstr(err.msg, "s3://" TU_BUCKET "/auth/step-1/state.h5: PUT failed: 403 "),
              "%s", err.msg);
    cr_assert(strstr(err.msg, "SignatureDoesNotMatch"), "%s", err.msg);
    cr_assert_null(strstr(err.msg, secret), "the secret leaked into: %s", err.msg);
    cr_assert_null(strstr(err.msg, "spotune-local-test-secret-7f3a"), "the real secret leaked into: %s", err.msg);

    sp_err e2 = {0};
    store_listing l;
    cr_assert_eq(store_list(s, "", &l, &e2), STORE_EAUTH);
    cr_assert(strstr(e2.msg, "ListObjectsV2 failed: 403 SignatureDoesNotMatch"), "%s", e2.msg);
    cr_assert_null(strstr(e2.msg, secret));
    sp_err e3 = {0};
    int exists;
    cr_assert_eq(store_exists(s, "x", &exists, NULL, &e3), STORE_EAUTH, "HEAD: %s", e3.msg);
    cr_assert(strstr(e3.msg, "HEAD failed: 403 Forbidden"), "%s", e3.msg);
    store_close(s);
}

Test(store_s3, bad_secret_fails_fast_without_leaking)
{
    assert_auth_failure("Wr0ngSecret-ZZZ-do-not-print", NULL);
}

Test(store_s3, unknown_access_key_fails_fast)
{
    assert_auth_failure("Wr0ngSecret-YYY", "nobody:nobody");
}

Test(store_s3, missing_credentials_is_a_usage_error)
{
    store_opts o = {.endpoint = tu_s3_endpoint()};
    unsetenv("AWS_SECRET_ACCESS_KEY");
    setenv("AWS_EC2_METADATA_DISABLED", "true", 1); /* never a role's, on any machine */
    store_t *s = NULL;
    sp_err err = {0};
    cr_assert_eq(store_open(&s, "s3://" TU_BUCKET "/x", &o, &err), STORE_EUSAGE);
    cr_assert_eq(err.code, SP_EXIT_USAGE);
    cr_assert(strstr(err.msg, "AWS_SECRET_ACCESS_KEY"), "%s", err.msg);
}

Test(store_s3, if_none_match_falls_back_and_keeps_the_first)
{
    store_t *s = tu_s3_open("inm", NULL, NULL);
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(s, "c/MANIFEST.json", "first", 5, 1, &err), 0, "%s", err.msg);
    cr_assert_eq(store_put_bytes(s, "c/MANIFEST.json", "second", 6, 1, &err), STORE_EEXIST);
    cr_assert(strstr(err.msg, "already exists"), "%s", err.msg);
    void *data;
    size_t n;
    sp_err e2 = {0};
    cr_assert_eq(store_get_bytes(s, "c/MANIFEST.json", &data, &n, &e2), 0, "%s", e2.msg);
    cr_assert_eq(n, 5);
    cr_assert_eq(memcmp(data, "first", 5), 0);
    free(data);
    /* multipart path too */
    store_close(s);
    store_opts o = {.part_bytes = 5 * MIB};
    s = tu_s3_open("inm-mp", &o, NULL);
    void *big = tu_random_bytes(6 * MIB, 3);
    sp_err e3 = {0};
    cr_assert_eq(store_put_bytes(s, "big", big, 6 * MIB, 1, &e3), 0, "%s", e3.msg);
    cr_assert_eq(store_put_bytes(s, "big", big, 6 * MIB, 1, &e3), STORE_EEXIST);
    free(big);
    store_close(s);
}

/* The lease's compare-and-swap put on the S3 server (whose s3api answers
 * If-Match and If-None-Match on PUT with 501: the HEAD check). */
Test(store_s3, a_conditional_put_replaces_only_what_was_read)
{
    store_t *s = tu_s3_open("cas", NULL, NULL);
    tu_check_put_if(s);
    store_close(s);
}

Test(store_s3, missing_objects_and_delete)
{
    store_t *s = tu_s3_open("miss", NULL, NULL);
    sp_err err = {0};
    void *data;
    size_t n;
    cr_assert_eq(store_get_bytes(s, "none", &data, &n, &err), STORE_ENOENT);
    cr_assert_eq(err.code, SP_EXIT_INPUT);
    cr_assert(strstr(err.msg, "404 NoSuchKey"), "%s", err.msg);
    sp_err_clear(&err);
    char *dir = tu_tempdir("miss");
    cr_assert(dir, "cannot make a directory under the build tree");
    char *dst = path_in(dir, "x");
    cr_assert_eq(store_get_file(s, "none", dst, &err), STORE_ENOENT);
    cr_assert_neq(access(dst, F_OK), 0);
    cr_assert_eq(store_put_bytes(s, "gone", "x", 1, 0, &err), 0);
    cr_assert_eq(store_delete(s, "gone", &err), 0, "%s", err.msg);
    cr_assert_eq(store_delete(s, "gone", &err), 0, "a missing object deletes fine");
    int exists = 1;
    cr_assert_eq(store_exists(s, "gone", &exists, NULL, &err), 0);
    cr_assert_eq(exists, 0);
    tu_rmtree(dir);
    free(dst);
    free(dir);
    store_close(s);
}

Test(store_s3, virtual_host_addressing)
{
    /* http://BUCKET.localhost:PORT: curl resolves *.localhost to loopback, and
     * the test server's s3api has storage_domain = localhost */
    const char *ep = tu_s3_endpoint(); /* http://127.0.0.1:PORT */
    char *vh = NULL;
    cr_assert(asprintf(&vh, "http://localhost%s", strrchr(ep, ':')) > 0);
    store_t *path_s = tu_s3_open("vh", NULL, NULL); /* creates the bucket */
    store_close(path_s);
    store_opts o = {.endpoint = vh, .addressing = STORE_ADDR_VHOST, .part_bytes = 5 * MIB};
    store_t *s = NULL;
    sp_err err = {0};
    char *url = tu_unique("s3://" TU_BUCKET "/vh");
    cr_assert_eq(store_open(&s, url, &o, &err), 0, "%s", err.msg);
    char *dir = tu_tempdir("vh");
    cr_assert(dir, "cannot make a directory under the build tree");
    roundtrip(s, dir, "a/b", 6 * MIB, 5);
    store_listing l;
    cr_assert_eq(store_list(s, "", &l, &err), 0, "%s", err.msg);
    cr_assert_eq(l.n, 1);
    store_list_free(&l);
    store_close(s);
    tu_rmtree(dir);
    free(dir);
    free(url);
    free(vh);
}

/* ---- checkpoint protocol --------------------------------------------------- */

static char *make_ckpt(const char *parent, const char *name, uint64_t seed, size_t big)
{
    char *d = path_in(parent, name);
    cr_assert_eq(mkdir(d, 0777), 0);
    const char *files[] = {"a-state.h5", "shard-00000-of-00002.h5", "shard-00001-of-00002.h5"};
    for (int i = 0; i < 3; i++) {
        char *p = path_in(d, files[i]);
        tu_random_file(p, i == 0 ? big : 100000, seed * 10 + (uint64_t)i);
        free(p);
    }
    char *p = path_in(d, "MANIFEST.json"), man[64];
    int n = snprintf(man, sizeof man, "{\"step\": \"%s\"}", name);
    tu_write_bytes(p, man, (size_t)n);
    free(p);
    return d;
}

typedef struct order_probe {
    store_t *s;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int paused, released;
    int files, manifest_seen_early;
    char last[128];
} order_probe;

static void probe_event(void *arg, const uploader_event *ev)
{
    order_probe *p = arg;
    if (ev->kind != UPLOADER_FILE_DONE)
        return;
    pthread_mutex_lock(&p->mu);
    p->files++;
    snprintf(p->last, sizeof p->last, "%s", ev->key);
    int first = p->files == 1;
    pthread_mutex_unlock(&p->mu);
    if (!strstr(ev->key, "MANIFEST")) { /* called on the uploader thread */
        char man[128];
        snprintf(man, sizeof man, "%s/MANIFEST.json", ev->prefix);
        int exists = 1;
        sp_err err = {0};
        cr_assert_eq(store_exists(p->s, man, &exists, NULL, &err), 0, "%s", err.msg);
        if (exists)
            p->manifest_seen_early = 1;
    }
    if (first) { /* hold the upload while the main thread lists */
        pthread_mutex_lock(&p->mu);
        p->paused = 1;
        pthread_cond_broadcast(&p->cv);
        while (!p->released)
            pthread_cond_wait(&p->cv, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}

Test(store_s3, uploader_sends_manifest_last)
{
    store_opts so = {.part_bytes = 5 * MIB};
    order_probe p = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    p.s = tu_s3_open("order", &so, NULL);
    char *dir = tu_tempdir("order");
    cr_assert(dir, "cannot make a directory under the build tree");
    char *ck = make_ckpt(dir, "step-00000100", 1, 12 * MIB);
    uploader_opts uo = {.on_event = probe_event, .arg = &p};
    uploader_t *u;
    sp_err err = {0};
    cr_assert_eq(uploader_start(&u, p.s, &uo, &err), 0);
    cr_assert_eq(uploader_submit(u, ck, "step-00000100", &err), 0);

    pthread_mutex_lock(&p.mu);
    while (!p.paused)
        pthread_cond_wait(&p.cv, &p.mu);
    pthread_mutex_unlock(&p.mu);
    store_listing l; /* main thread, same store, while the uploader holds it */
    cr_assert_eq(store_list(p.s, "step-00000100/", &l, &err), 0, "%s", err.msg);
    cr_assert_eq(l.n, 1, "one file up so far");
    cr_assert_str_eq(l.items[0].key, "step-00000100/a-state.h5");
    store_list_free(&l);
    cr_assert_eq(uploader_pending(u), 1);
    pthread_mutex_lock(&p.mu);
    p.released = 1;
    pthread_cond_broadcast(&p.cv);
    pthread_mutex_unlock(&p.mu);

    cr_assert_eq(uploader_wait(u, 60), 1);
    uploader_stop(u);
    cr_assert_eq(p.files, 4);
    cr_assert_str_eq(p.last, "step-00000100/MANIFEST.json", "MANIFEST uploaded last");
    cr_assert_not(p.manifest_seen_early, "MANIFEST existed before the data files were up");

    char *back = path_in(dir, "back");
    cr_assert_eq(store_pull_dir(p.s, "step-00000100", back, NULL, &err), 0, "%s", err.msg);
    const char *files[] = {"MANIFEST.json", "a-state.h5", "shard-00000-of-00002.h5",
                           "shard-00001-of-00002.h5"};
    for (int i = 0; i < 4; i++) {
        char *a = path_in(ck, files[i]), *b = path_in(back, files[i]);
        cr_assert(tu_files_equal(a, b), "%s differs after pull", files[i]);
        free(a);
        free(b);
    }
    free(back);
    store_close(p.s);
    tu_rmtree(dir);
    free(ck);
    free(dir);
}

typedef struct del_log {
    char *keys[64];
    int n;
} del_log;

static void log_del(void *arg, const char *key)
{
    del_log *l = arg;
    if (l->n < 64)
        l->keys[l->n++] = strdup(key);
}

Test(store_s3, prune_deletes_manifest_first)
{
    store_t *s = tu_s3_open("prune", NULL, NULL);
    char *dir = tu_tempdir("prune");
    cr_assert(dir, "cannot make a directory under the build tree");
    sp_err err = {0};
    for (int st = 1; st <= 4; st++) {
        char name[32];
        snprintf(name, sizeof name, "step-%08d", st * 100);
        char *ck = make_ckpt(dir, name, (uint64_t)st, 1000);
        cr_assert_eq(store_push_dir(s, ck, name, NULL, &err), 0, "%s", err.msg);
        free(ck);
    }
    del_log log = {{0}, 0};
    store_xfer_opts x = {.on_key = log_del, .arg = &log};
    int pruned = 0;
    cr_assert_eq(store_prune_steps(s, 2, 0, &x, &pruned, &err), 0, "%s", err.msg);
    cr_assert_eq(pruned, 2);
    cr_assert_eq(log.n, 8);
    cr_assert_str_eq(log.keys[0], "step-00000100/MANIFEST.json");
    for (int i = 1; i < 4; i++)
        cr_assert(!strncmp(log.keys[i], "step-00000100/", 14) && !strstr(log.keys[i], "MANIFEST"));
    cr_assert_str_eq(log.keys[4], "step-00000200/MANIFEST.json");
    store_listing l;
    cr_assert_eq(store_list(s, "", &l, &err), 0);
    cr_assert_eq(l.n, 8);
    cr_assert_str_eq(l.items[0].key, "step-00000300/MANIFEST.json");
    store_list_free(&l);
    for (int i = 0; i < log.n; i++)
        free(log.keys[i]);
    store_close(s);
    tu_rmtree(dir);
    free(dir);
}

/* ---- awscli interop -------------------------------------------------------- */

static int aws(const char *out_path, const char *a1, const char *a2, const char *a3,
               const char *a4, const char *a5, const char *a6, const char *a7, const char *a8)
{
    /* the arguments end at the first NULL */
    return tu_aws(out_path, a1, a2, a3, a4, a5, a6, a7, a8, NULL);
}

Test(store_s3, awscli_interop_both_ways)
{
    cr_assert_eq(access("/usr/bin/aws", X_OK), 0, "awscli missing: scripts/install-s3-test-deps.sh");
    store_opts o = {.part_bytes = 8 * MIB};
    char *url = NULL;
    store_t *s = tu_s3_open("aws", &o, &url);
    char *dir = tu_tempdir("aws");
    cr_assert(dir, "cannot make a directory under the build tree");
    char *src = path_in(dir, "ours.bin"), *theirs = path_in(dir, "theirs.bin");
    char *got = path_in(dir, "got.bin"), *etag = path_in(dir, "etag.txt");
    tu_random_file(src, 20 * MIB, 31);
    sp_err err = {0};
    cr_assert_eq(store_put_file(s, "x/ours.bin", src, 0, &err), 0, "%s", err.msg);
    char *s3url = NULL;
    cr_assert(asprintf(&s3url, "%s/x/ours.bin", url) > 0);
    cr_assert_eq(aws(NULL, "s3", "cp", "--only-show-errors", s3url, got, NULL, NULL, NULL), 0);
    cr_assert(tu_files_equal(src, got), "awscli download of our multipart upload differs");
    char *key = strchr(url + 5, '/') + 1, *objkey = NULL;
    cr_assert(asprintf(&objkey, "%s/x/ours.bin", key) > 0);
    cr_assert_eq(aws(etag, "s3api", "head-object", "--bucket", TU_BUCKET, "--key", objkey,
                     "--query", "ETag"), 0);
    FILE *f = fopen(etag, "r");
    cr_assert_not_null(f);
    char line[256] = "";
    cr_assert_not_null(fgets(line, sizeof line, f));
    fclose(f);
    cr_assert(strstr(line, "-3"), "20 MiB in 8 MiB parts is a 3-part upload: %s", line);

    tu_random_file(theirs, 20 * MIB, 32);
    char *s3theirs = NULL;
    cr_assert(asprintf(&s3theirs, "%s/x/theirs.bin", url) > 0);
    cr_assert_eq(aws(NULL, "s3", "cp", "--only-show-errors", theirs, s3theirs, NULL, NULL, NULL), 0);
    unlink(got);
    cr_assert_eq(store_get_file(s, "x/theirs.bin", got, &err), 0, "%s", err.msg);
    cr_assert(tu_files_equal(theirs, got), "our download of an awscli multipart upload differs");
    store_listing l;
    cr_assert_eq(store_list(s, "x/", &l, &err), 0);
    cr_assert_eq(l.n, 2);
    cr_assert_eq(l.items[1].size, 20 * MIB);
    store_list_free(&l);
    store_close(s);
    tu_rmtree(dir);
    free(s3url);
    free(s3theirs);
    free(objkey);
    free(src);
    free(theirs);
    free(got);
    free(etag);
    free(dir);
    free(url);
}

/* ---- large objects: ranged GETs, aborted uploads ----------------------------- */

typedef struct access_line {
    long status;
    unsigned long long bytes;
    double start, end;
} access_line;

/* The proxy's access-log lines (after byte `from`) for "METHOD /bucket/key
 * HTTP/1.0 ..." exactly, fields as in tu_proxy_log. Returns how many. */
static int access_lines(size_t from, const char *method, const char *full_key, access_line *out,
                        int max)
{
    size_t n = 0;
    char *text = tu_proxy_log(&n), needle[1200];
    snprintf(needle, sizeof needle, " %s /" TU_BUCKET "/%s HTTP/1.0 ", method, full_key);
    int count = 0;
    for (char *p = n > from ? strstr(text + from, needle) : NULL; p && count < max;
         p = strstr(p + 1, needle)) {
        char *eol = strchr(p, '\n');
        if (eol)
            *eol = 0;
        /* status referer agent token recvd sent etag txn headers time source info start end */
        char *f[16] = {0};
        int nf = 0;
        for (char *t = strtok(p + strlen(needle), " "); t && nf < 16; t = strtok(NULL, " "))
            f[nf++] = t;
        cr_assert_geq(nf, 14, "an access-log line with %d fields", nf);
        out[count++] = (access_line){strtol(f[0], NULL, 10), strtoull(f[5], NULL, 10),
                                     strtod(f[12], NULL), strtod(f[13], NULL)};
        if (!eol)
            break;
        p = eol;
    }
    free(text);
    return count;
}

/* The most requests of `l` the server was serving at one moment. */
static int max_concurrent(const access_line *l, int n)
{
    int best = 0;
    for (int i = 0; i < n; i++) {
        int at = 0; /* requests running when request i started */
        for (int j = 0; j < n; j++)
            at += l[j].start <= l[i].start && l[i].start < l[j].end;
        best = at > best ? at : best;
    }
    return best;
}

/* A 37 MiB object comes down as 5 ranged GETs of up to 8 MiB (206 Partial
 * Content, 37 MiB in all, never a whole-object GET), several of them at the
 * same time, and byte-identical. Seen in the server's access log: the client
 * exposes no counter. */
Test(store_s3, large_download_is_parallel_ranged_gets)
{
    /* each connection held to 32 MiB/s: a range takes about a quarter second */
    store_opts o = {.part_bytes = 8 * MIB, .parallel = 4, .max_recv_bps = 32 * MIB};
    char *url = NULL;
    store_t *s = tu_s3_open("ranged", &o, &url);
    char *dir = tu_tempdir("ranged");
    cr_assert(dir, "cannot make a directory under the build tree");
    char *src = path_in(dir, "src.bin"), *back = path_in(dir, "back.bin");
    tu_random_file(src, 37 * MIB, 51);
    sp_err err = {0};
    cr_assert_eq(store_put_file(s, "big.bin", src, 0, &err), 0, "%s", err.msg);
    char *full = tu_s3_full_key(url, "big.bin");
    size_t from = 0;
    free(tu_proxy_log(&from));
    cr_assert_eq(store_get_file(s, "big.bin", back, &err), 0, "%s", err.msg);
    cr_assert(tu_files_equal(src, back), "not byte-identical");

    access_line l[32];
    int n = 0;
    /* the proxy logs a request once it has sent the answer: wait for all five */
    for (double t0 = sp_now(); (n = access_lines(from, "GET", full, l, 32)) < 5 &&
                               sp_now() - t0 < 30;)
        usleep(50 * 1000);
    cr_assert_eq(n, 5, "5 GETs of 8 MiB ranges for 37 MiB, got %d", n);
    unsigned long long total = 0;
    for (int i = 0; i < n; i++) {
        cr_expect_eq(l[i].status, 206, "GET %d answered %ld, not 206 Partial Content", i, l[i].status);
        cr_expect_leq(l[i].bytes, 8 * MIB, "GET %d sent %llu bytes", i, l[i].bytes);
        total += l[i].bytes;
    }
    cr_expect_eq(total, 37 * MIB, "the ranges add up to %llu bytes", total);
    int conc = max_concurrent(l, n);
    cr_expect_geq(conc, 2, "the ranges were fetched one after another (at most %d at once)", conc);
    store_close(s);
    tu_rmtree(dir);
    free(full);
    free(src);
    free(back);
    free(dir);
    free(url);
}

Test(store_s3, get_range)
{
    char *url = NULL;
    store_t *s = tu_s3_open("range", NULL, &url);
    tu_check_get_range(s, "ckpt/shard-0.h5");
    /* one GET for a range, answered 206 with just its bytes */
    char *full = tu_s3_full_key(url, "ckpt/shard-0.h5");
    size_t from = 0;
    free(tu_proxy_log(&from));
    char b[100];
    sp_err err = {0};
    cr_assert_eq(store_get_range(s, "ckpt/shard-0.h5", 1000, sizeof b, b, &err), 0, "%s",
                 err.msg);
    access_line l[4];
    int n = 0;
    for (double t0 = sp_now(); (n = access_lines(from, "GET", full, l, 4)) < 1 &&
                               sp_now() - t0 < 30;)
        usleep(50 * 1000);
    cr_assert_eq(n, 1, "%d GETs", n);
    cr_expect_eq(l[0].status, 206);
    cr_expect_eq(l[0].bytes, sizeof b);
    free(full);
    free(url);
    store_close(s);
}

typedef struct bg_put {
    store_t *s;
    const char *key, *path;
    int rc;
    sp_err err;
} bg_put;

static void *bg_put_file(void *arg)
{
    bg_put *b = arg;
    b->rc = store_put_file(b->s, b->key, b->path, 0, &b->err);
    return NULL;
}

/* A multipart upload that fails half-way (here its file shrinks, so a part
 * cannot be read) is aborted: no incomplete upload of the key is left in the
 * store, and no object either. The listing that says so (awscli
 * ListMultipartUploads) is shown to see the upload while it is in progress. */
Test(store_s3, failed_multipart_upload_is_aborted)
{
    /* 3 parts of 5 MiB over one connection at 1 MiB/s: a part takes 5 s */
    store_opts o = {.part_bytes = 5 * MIB, .parallel = 1, .max_send_bps = 1 * MIB};
    char *url = NULL;
    store_t *s = tu_s3_open("abort", &o, &url);
    char *dir = tu_tempdir("abort");
    cr_assert(dir, "cannot make a directory under the build tree");
    char *src = path_in(dir, "src.bin");
    tu_random_file(src, 11 * MIB, 61);
    char *full = tu_s3_full_key(url, "ckpt/state.h5");
    size_t from = 0;
    free(tu_proxy_log(&from));
    bg_put up = {s, "ckpt/state.h5", src, -99, {0}};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, bg_put_file, &up), 0);
    int began = tu_proxy_log_wait(from, tu_mpu_created(full), 60);
    int listed = began ? tu_s3_uploads_in_progress(full) : -1;
    /* the file shrinks: the next part (at 5 MiB) cannot be read */
    cr_assert_eq(truncate(src, 1 * MIB), 0);
    pthread_join(th, NULL);
    cr_assert(began, "CreateMultipartUpload never reached the store");
    cr_assert_eq(listed, 1, "the upload in progress is not listed (%d)", listed);
    cr_assert_eq(up.rc, STORE_ELOCAL, "the upload did not fail locally: %d %s", up.rc, up.err.msg);
    cr_assert(strstr(up.err.msg, "UploadPart"), "%s", up.err.msg);

    tu_expect_mpu_aborted(s, "ckpt/state.h5", full, from, 10);
    store_close(s);
    tu_rmtree(dir);
    free(full);
    free(src);
    free(dir);
    free(url);
}
