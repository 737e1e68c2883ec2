/* tests/test_store_file.c — the store API on file:// (in-process, no server):
 * round trips, ranged reads, no-replace puts, listing, deletes, key and URL
 * checks, checkpoint push/pull/prune ordering, and the uploader (retry while
 * the store is unreachable, bounded queue, prompt stop, its thread's name). */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/lease.h"
#include "checkpoint/store.h"
#include "checkpoint/uploader.h"
#include "test_store_util.h"

#define MIB ((size_t)1 << 20)

TestSuite(store_file, .timeout = 120);

typedef struct store_fx {
    char *dir;   /* scratch */
    char *root;  /* store root (dir/store) */
    char *url;
    store_t *s;
} store_fx;

static store_fx open_fixture(const char *tag)
{
    store_fx f = {0};
    f.dir = tu_tempdir(tag);
    cr_assert(f.dir, "cannot make a directory under the build tree");
    cr_assert(asprintf(&f.root, "%s/store", f.dir) > 0);
    cr_assert(asprintf(&f.url, "file://%s", f.root) > 0);
    sp_err err = {0};
    cr_assert_eq(store_open(&f.s, f.url, NULL, &err), 0, "%s", err.msg);
    return f;
}

static void close_fixture(store_fx *f)
{
    store_close(f->s);
    tu_rmtree(f->dir);
    free(f->dir);
    free(f->root);
    free(f->url);
}

static char *path_in(const char *dir, const char *name)
{
    char *p = NULL;
    cr_assert(asprintf(&p, "%s/%s", dir, name) > 0);
    return p;
}

static void roundtrip_file(store_fx *f, size_t n, uint64_t seed)
{
    char *src = path_in(f->dir, "src.bin"), *back = path_in(f->dir, "back/got.bin");
    tu_random_file(src, n, seed);
    sp_err err = {0};
    cr_assert_eq(store_put_file(f->s, "rt/obj.bin", src, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(store_get_file(f->s, "rt/obj.bin", back, &err), 0, "%s", err.msg);
    cr_assert(tu_files_equal(src, back), "%zu bytes differ after a round trip", n);
    int exists = 0;
    uint64_t size = 0;
    cr_assert_eq(store_exists(f->s, "rt/obj.bin", &exists, &size, &err), 0);
    cr_assert(exists);
    cr_assert_eq(size, n);
    free(src);
    free(back);
}

Test(store_file, roundtrip_sizes)
{
    store_fx f = open_fixture("rt");
    roundtrip_file(&f, 1024, 1);
    roundtrip_file(&f, 5 * MIB, 2);
    roundtrip_file(&f, 37 * MIB, 3);
    roundtrip_file(&f, 0, 4);
    cr_assert_str_eq(store_url(f.s), f.url);
    close_fixture(&f);
}

Test(store_file, get_range)
{
    store_fx f = open_fixture("range");
    tu_check_get_range(f.s, "ckpt/shard-0.h5");
    sp_err err = {0};
    char b[4];
    cr_expect_eq(store_get_range(f.s, "ckpt/shard-0.h5/x", 0, 1, b, &err), STORE_ENOENT,
                 "below an object: %s", err.msg);
    sp_err e2 = {0};
    cr_expect_eq(store_get_range(f.s, "ckpt", 0, 1, b, &e2), STORE_EFAIL, "a directory: %s",
                 e2.msg);
    close_fixture(&f);
}

Test(store_file, bytes_roundtrip_and_missing)
{
    store_fx f = open_fixture("bytes");
    sp_err err = {0};
    const char msg[] = "hello, checkpoint";
    cr_assert_eq(store_put_bytes(f.s, "a/b/c.txt", msg, sizeof msg - 1, 0, &err), 0, "%s", err.msg);
    void *data = NULL;
    size_t n = 0;
    cr_assert_eq(store_get_bytes(f.s, "a/b/c.txt", &data, &n, &err), 0, "%s", err.msg);
    cr_assert_eq(n, sizeof msg - 1);
    cr_assert_eq(memcmp(data, msg, n), 0);
    cr_assert_eq(((char *)data)[n], 0, "NUL-terminated");
    free(data);

    int rc = store_get_bytes(f.s, "a/b/none.txt", &data, &n, &err);
    cr_assert_eq(rc, STORE_ENOENT);
    cr_assert_eq(err.code, SP_EXIT_INPUT);
    cr_assert(strstr(err.msg, "a/b/none.txt"), "message names the key: %s", err.msg);
    sp_err_clear(&err);
    char *dst = path_in(f.dir, "x.bin");
    cr_assert_eq(store_get_file(f.s, "nope", dst, &err), STORE_ENOENT);
    cr_assert_neq(access(dst, F_OK), 0, "no local file after a failed get");
    free(dst);
    close_fixture(&f);
}

Test(store_file, if_none_match_never_replaces)
{
    store_fx f = open_fixture("inm");
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(f.s, "m/MANIFEST.json", "one", 3, 1, &err), 0, "%s", err.msg);
    cr_assert_eq(store_put_bytes(f.s, "m/MANIFEST.json", "two", 3, 1, &err), STORE_EEXIST);
    cr_assert(strstr(err.msg, "already exists"), "%s", err.msg);
    sp_err_clear(&err);
    char *src = path_in(f.dir, "three");
    tu_write_bytes(src, "three", 5);
    cr_assert_eq(store_put_file(f.s, "m/MANIFEST.json", src, 1, &err), STORE_EEXIST);
    sp_err_clear(&err);
    void *data;
    size_t n;
    cr_assert_eq(store_get_bytes(f.s, "m/MANIFEST.json", &data, &n, &err), 0);
    cr_assert_eq(n, 3);
    cr_assert_eq(memcmp(data, "one", 3), 0, "the first object is kept");
    free(data);
    /* a plain put does replace */
    cr_assert_eq(store_put_file(f.s, "m/MANIFEST.json", src, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(store_get_bytes(f.s, "m/MANIFEST.json", &data, &n, &err), 0);
    cr_assert_eq(n, 5);
    free(data);
    free(src);
    close_fixture(&f);
}

Test(store_file, list_sorted_filtered_and_skips_temporaries)
{
    store_fx f = open_fixture("list");
    sp_err err = {0};
    store_listing l;
    cr_assert_eq(store_list(f.s, "", &l, &err), 0, "missing root lists as empty: %s", err.msg);
    cr_assert_eq(l.n, 0);
    store_list_free(&l);
    const char *keys[] = {"step-2/b", "step-10/a", "step-1/z/deep.h5", "step-1/a", "other"};
    for (int i = 0; i < 5; i++)
        cr_assert_eq(store_put_bytes(f.s, keys[i], keys[i], strlen(keys[i]), 0, &err), 0);
    char *junk = path_in(f.root, "step-1/.spotune-tmp.abc123");
    tu_write_bytes(junk, "x", 1);
    free(junk);

    cr_assert_eq(store_list(f.s, "", &l, &err), 0);
    cr_assert_eq(l.n, 5);
    const char *sorted[] = {"other", "step-1/a", "step-1/z/deep.h5", "step-10/a", "step-2/b"};
    for (int i = 0; i < 5; i++) {
        cr_assert_str_eq(l.items[i].key, sorted[i]);
        cr_assert_eq(l.items[i].size, strlen(sorted[i]));
    }
    store_list_free(&l);
    cr_assert_eq(store_list(f.s, "step-1", &l, &err), 0);
    cr_assert_eq(l.n, 3, "string prefix: step-1/ and step-10/");
    store_list_free(&l);
    cr_assert_eq(store_list(f.s, "step-1/", &l, &err), 0);
    cr_assert_eq(l.n, 2);
    cr_assert_str_eq(l.items[1].key, "step-1/z/deep.h5");
    store_list_free(&l);
    close_fixture(&f);
}

Test(store_file, delete_is_idempotent_and_tidies_directories)
{
    store_fx f = open_fixture("del");
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(f.s, "d/e/f.bin", "x", 1, 0, &err), 0);
    cr_assert_eq(store_delete(f.s, "d/e/f.bin", &err), 0, "%s", err.msg);
    cr_assert_eq(store_delete(f.s, "d/e/f.bin", &err), 0, "deleting a missing object succeeds");
    int exists = 1;
    cr_assert_eq(store_exists(f.s, "d/e/f.bin", &exists, NULL, &err), 0);
    cr_assert_eq(exists, 0);
    char *d = path_in(f.root, "d");
    struct stat st;
    cr_assert_neq(stat(d, &st), 0, "empty parent directories are removed");
    cr_assert_eq(stat(f.root, &st), 0, "the root stays");
    free(d);
    close_fixture(&f);
}

Test(store_file, bad_keys_and_urls)
{
    store_fx f = open_fixture("bad");
    const char *bad[] = {"", "/abs", "a//b", "a/../b", "..", "./a", "a/", "a\nb"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        sp_err err = {0};
        cr_assert_eq(store_put_bytes(f.s, bad[i], "x", 1, 0, &err), STORE_EUSAGE, "key '%s'",
                     bad[i]);
        cr_assert_eq(err.code, SP_EXIT_USAGE);
    }
    const char *urls[] = {"file://relative/path", "ftp://host/x", "s3://", "s3://bad bucket/x",
                          "/just/a/path", "s3://b/a/../x"};
    for (size_t i = 0; i < sizeof urls / sizeof *urls; i++) {
        sp_err err = {0};
        store_t *s = (store_t *)1;
        cr_assert_eq(store_open(&s, urls[i], NULL, &err), STORE_EUSAGE, "url '%s'", urls[i]);
        cr_assert_null(s);
        cr_assert_eq(err.code, SP_EXIT_USAGE);
    }
    sp_err err = {0};
    store_t *s = NULL;
    store_opts o = {.part_bytes = 1 * MIB};
    cr_assert_eq(store_open(&s, f.url, &o, &err), STORE_EUSAGE, "part size below 5 MiB");
    close_fixture(&f);
}

/* ---- checkpoint directories ---------------------------------------------- */

typedef struct key_log {
    pthread_mutex_t mu;
    char *keys[256];
    int n;
} key_log;

static void log_key(void *arg, const char *key)
{
    key_log *l = arg;
    pthread_mutex_lock(&l->mu);
    if (l->n < 256)
        l->keys[l->n++] = strdup(key);
    pthread_mutex_unlock(&l->mu);
}

static void key_log_free(key_log *l)
{
    for (int i = 0; i < l->n; i++)
        free(l->keys[i]);
    l->n = 0;
}

/* A checkpoint directory: state.h5, two shards, a sub/ file, MANIFEST.json. */
static char *make_ckpt(const char *parent, const char *name, uint64_t seed, size_t big)
{
    char *d = path_in(parent, name);
    cr_assert_eq(mkdir(d, 0777), 0);
    char *p;
    const char *files[] = {"state.h5", "shard-00000-of-00002.h5", "shard-00001-of-00002.h5",
                           "sub/extra.bin"};
    for (int i = 0; i < 4; i++) {
        p = path_in(d, files[i]);
        if (i == 3) {
            char *sub = path_in(d, "sub");
            mkdir(sub, 0777);
            free(sub);
        }
        tu_random_file(p, i == 0 ? big : 1000 + (size_t)i, seed * 10 + (uint64_t)i);
        free(p);
    }
    p = path_in(d, "MANIFEST.json");
    char man[128];
    int n = snprintf(man, sizeof man, "{\"step\": \"%s\", \"seed\": %llu}", name,
                     (unsigned long long)seed);
    tu_write_bytes(p, man, (size_t)n);
    free(p);
    return d;
}

static void assert_same_tree(const char *a, const char *b)
{
    const char *files[] = {"MANIFEST.json", "state.h5", "shard-00000-of-00002.h5",
                           "shard-00001-of-00002.h5", "sub/extra.bin"};
    for (int i = 0; i < 5; i++) {
        char *pa = path_in(a, files[i]), *pb = path_in(b, files[i]);
        cr_assert(tu_files_equal(pa, pb), "%s differs", files[i]);
        free(pa);
        free(pb);
    }
}

Test(store_file, push_manifest_last_pull_identical)
{
    store_fx f = open_fixture("push");
    char *local = path_in(f.dir, "local");
    mkdir(local, 0777);
    char *ck = make_ckpt(local, "step-00000100", 7, 3 * MIB);
    key_log log = {PTHREAD_MUTEX_INITIALIZER, {0}, 0};
    store_xfer_opts x = {.on_key = log_key, .arg = &log};
    sp_err err = {0};
    cr_assert_eq(store_push_dir(f.s, ck, "step-00000100/", &x, &err), 0, "%s", err.msg);
    cr_assert_eq(log.n, 5);
    cr_assert_str_eq(log.keys[4], "step-00000100/MANIFEST.json", "MANIFEST last");
    for (int i = 0; i < 4; i++)
        cr_assert_null(strstr(log.keys[i], "MANIFEST"));
    key_log_free(&log);

    /* pushing the same checkpoint again sends nothing */
    cr_assert_eq(store_push_dir(f.s, ck, "step-00000100", &x, &err), 0, "%s", err.msg);
    cr_assert_eq(log.n, 0);

    char *back = path_in(f.dir, "pulled/step-00000100");
    cr_assert_eq(store_pull_dir(f.s, "step-00000100", back, &x, &err), 0, "%s", err.msg);
    assert_same_tree(ck, back);
    key_log_free(&log);
    cr_assert_eq(store_pull_dir(f.s, "step-00000100", back, NULL, &err), STORE_ELOCAL,
                 "pull refuses an existing directory");
    sp_err_clear(&err);
    char *missing = path_in(f.dir, "pulled/none");
    cr_assert_eq(store_pull_dir(f.s, "step-00000999", missing, NULL, &err), STORE_ENOENT);
    cr_assert_eq(err.code, SP_EXIT_INPUT);
    cr_assert_neq(access(missing, F_OK), 0);
    free(missing);
    free(back);
    free(ck);
    free(local);
    close_fixture(&f);
}

/* A sharded checkpoint whose ranks put their shard files themselves
 * (shards_put_by_ranks): MANIFEST.json waits for them (0.3 s here). A shard
 * still missing then that the local directory holds with its MANIFEST size
 * (run.dir shared: its rank's put failed) is put by the push itself, and the
 * push completes; one the local directory lacks (another machine's) fails
 * the push with STORE_EPEER, naming it, and MANIFEST.json is not pushed. */
Test(store_file, push_puts_a_missing_rank_shard_it_holds_and_names_one_it_lacks)
{
    store_fx f = open_fixture("shards");
    char *ck = path_in(f.dir, "step-00000010");
    cr_assert_eq(mkdir(ck, 0777), 0);
    const char *names[2] = {"shard-00000-of-00002.h5", "shard-00001-of-00002.h5"};
    char *paths[2];
    for (int i = 0; i < 2; i++) {
        paths[i] = path_in(ck, names[i]);
        tu_random_file(paths[i], 1000 + (size_t)i, 40 + (uint64_t)i);
    }
    char *mpath = path_in(ck, "MANIFEST.json");
    FILE *m = fopen(mpath, "w");
    cr_assert(m);
    fprintf(m, "{\"format\": 1, \"files\": {\"%s\": {\"size\": 1000}, \"%s\": {\"size\": 1001}}}\n",
            names[0], names[1]);
    fclose(m);
    sp_err err = {0};
    cr_assert_eq(store_put_file(f.s, "step-00000010/shard-00000-of-00002.h5", paths[0], 0, &err), 0,
                 "%s", err.msg); /* rank 0 put its own; rank 1's put failed */
    store_xfer_opts x = {.shards_put_by_ranks = 1, .shards_wait_s = 0.3};
    cr_assert_eq(store_push_dir(f.s, ck, "step-00000010", &x, &err), 0, "%s", err.msg);
    char *got = path_in(f.dir, "got.h5");
    cr_assert_eq(store_get_file(f.s, "step-00000010/shard-00000-of-00002.h5", got, &err), 0);
    int there = 0;
    cr_assert_eq(store_exists(f.s, "step-00000010/MANIFEST.json", &there, NULL, &err), 0);
    cr_expect(there, "MANIFEST.json pushed");
    cr_assert_eq(store_get_file(f.s, "step-00000010/shard-00001-of-00002.h5", got, &err), 0,
                 "%s", err.msg);
    cr_expect(tu_files_equal(got, paths[1]), "rank 1's shard, put by the push, differs");
    /* step 20: rank 1's shard is on another machine (not here) and not in the store */
    char *ck2 = path_in(f.dir, "step-00000020");
    cr_assert_eq(mkdir(ck2, 0777), 0);
    char *m2 = path_in(ck2, "MANIFEST.json"), *p2 = path_in(ck2, names[0]);
    tu_random_file(p2, 1000, 50);
    cr_assert_eq(rename(mpath, m2), 0);
    cr_assert_eq(store_put_file(f.s, "step-00000020/shard-00000-of-00002.h5", p2, 0, &err), 0);
    sp_err_clear(&err);
    cr_expect_eq(store_push_dir(f.s, ck2, "step-00000020", &x, &err), STORE_EPEER);
    cr_expect(strstr(err.msg, "shard-00001-of-00002.h5") != NULL, "%s", err.msg);
    there = 1;
    sp_err_clear(&err);
    cr_assert_eq(store_exists(f.s, "step-00000020/MANIFEST.json", &there, NULL, &err), 0);
    cr_expect(!there, "MANIFEST.json of an incomplete checkpoint pushed");
    for (int i = 0; i < 2; i++)
        free(paths[i]);
    free(mpath), free(m2), free(p2), free(ck), free(ck2), free(got);
    close_fixture(&f);
}

Test(store_file, push_refuses_incomplete_and_conflicting)
{
    store_fx f = open_fixture("conflict");
    char *local = path_in(f.dir, "local");
    mkdir(local, 0777);
    char *ck = make_ckpt(local, "step-00000100", 1, 1000);
    sp_err err = {0};
    cr_assert_eq(store_push_dir(f.s, ck, "step-00000100", NULL, &err), 0, "%s", err.msg);

    char *other = make_ckpt(local, "other", 2, 1000);
    cr_assert_eq(store_push_dir(f.s, other, "step-00000100", NULL, &err), STORE_EEXIST);
    cr_assert(strstr(err.msg, "MANIFEST.json differs"), "%s", err.msg);
    char *back = path_in(f.dir, "back");
    sp_err_clear(&err);
    cr_assert_eq(store_pull_dir(f.s, "step-00000100", back, NULL, &err), 0, "%s", err.msg);
    assert_same_tree(ck, back); /* nothing of `other` was written */

    char *nomanifest = path_in(local, "other/MANIFEST.json");
    unlink(nomanifest);
    sp_err_clear(&err);
    cr_assert_eq(store_push_dir(f.s, other, "step-00000200", NULL, &err), STORE_ELOCAL);
    cr_assert(strstr(err.msg, "no MANIFEST.json"), "%s", err.msg);
    store_listing l;
    cr_assert_eq(store_list(f.s, "step-00000200", &l, &err), 0);
    cr_assert_eq(l.n, 0, "nothing uploaded for an incomplete checkpoint");
    store_list_free(&l);
    free(nomanifest);
    free(back);
    free(other);
    free(ck);
    free(local);
    close_fixture(&f);
}

static void put_step(store_t *s, unsigned step, int complete)
{
    char key[64];
    sp_err err = {0};
    const char *files[] = {"state.h5", "shard-00000-of-00001.h5"};
    for (int i = 0; i < 2; i++) {
        snprintf(key, sizeof key, "step-%08u/%s", step, files[i]);
        cr_assert_eq(store_put_bytes(s, key, "data", 4, 0, &err), 0, "%s", err.msg);
    }
    if (complete) {
        snprintf(key, sizeof key, "step-%08u/MANIFEST.json", step);
        cr_assert_eq(store_put_bytes(s, key, "{}", 2, 1, &err), 0, "%s", err.msg);
    }
}

/* every deleted checkpoint lost its MANIFEST before any other file */
static void assert_manifest_first(const key_log *log)
{
    for (int i = 0; i < log->n; i++) {
        char dir[64];
        const char *slash = strchr(log->keys[i], '/');
        cr_assert_not_null(slash);
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - log->keys[i] + 1), log->keys[i]);
        int first = -1;
        for (int j = 0; j < log->n && first < 0; j++)
            if (!strncmp(log->keys[j], dir, strlen(dir)))
                first = j;
        char man[96];
        snprintf(man, sizeof man, "%sMANIFEST.json", dir);
        int has_manifest = 0;
        for (int j = 0; j < log->n; j++)
            has_manifest |= !strcmp(log->keys[j], man);
        if (has_manifest)
            cr_assert_str_eq(log->keys[first], man, "%s: MANIFEST deleted first", dir);
    }
}

Test(store_file, prune_keeps_newest_and_multiples_manifest_first)
{
    store_fx f = open_fixture("prune");
    put_step(f.s, 50, 0); /* incomplete, older: garbage */
    for (unsigned st = 100; st <= 600; st += 100)
        put_step(f.s, st, 1);
    put_step(f.s, 700, 0); /* incomplete, newer: an upload in flight */
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(f.s, "unrelated/file", "x", 1, 0, &err), 0);
    key_log log = {PTHREAD_MUTEX_INITIALIZER, {0}, 0};
    store_xfer_opts x = {.on_key = log_key, .arg = &log};
    int pruned = -1;
    cr_assert_eq(store_prune_steps(f.s, 2, 300, &x, &pruned, &err), 0, "%s", err.msg);
    cr_assert_eq(pruned, 4, "50, 100, 200, 400 go");
    assert_manifest_first(&log);
    cr_assert_eq(log.n, 2 + 3 * 3);

    store_listing l;
    cr_assert_eq(store_list(f.s, "", &l, &err), 0);
    const char *left[] = {"step-00000300/", "step-00000500/", "step-00000600/", "step-00000700/",
                          "unrelated/"};
    int seen[5] = {0};
    for (size_t i = 0; i < l.n; i++) {
        int ok = 0;
        for (int k = 0; k < 5; k++)
            if (!strncmp(l.items[i].key, left[k], strlen(left[k])))
                ok = 1, seen[k] = 1;
        cr_assert(ok, "unexpected survivor %s", l.items[i].key);
    }
    for (int k = 0; k < 5; k++)
        cr_assert(seen[k], "%s was deleted", left[k]);
    store_list_free(&l);
    cr_assert_eq(store_prune_steps(f.s, 0, 0, NULL, NULL, &err), STORE_EUSAGE);
    key_log_free(&log);
    close_fixture(&f);
}

/* ---- uploader ----------------------------------------------------------------- */

typedef struct ev_log {
    pthread_mutex_t mu;
    int done, retry, failed, dropped, files;
    char last_prefix[64];
    char last_err[256];
    int gate, asked; /* may_push's answer, and how often it was asked */
} ev_log;

static int gate_fn(void *arg, sp_err *why)
{
    ev_log *l = arg;
    pthread_mutex_lock(&l->mu);
    int answer = l->gate;
    l->asked++;
    pthread_mutex_unlock(&l->mu);
    if (answer < 0)
        sp_fail(why, SP_EXIT_USAGE, "another job holds this prefix now");
    return answer;
}

static void on_event(void *arg, const uploader_event *ev)
{
    ev_log *l = arg;
    pthread_mutex_lock(&l->mu);
    switch (ev->kind) {
    case UPLOADER_JOB_DONE:
        l->done++;
        snprintf(l->last_prefix, sizeof l->last_prefix, "%s", ev->prefix);
        break;
    case UPLOADER_JOB_RETRY: l->retry++; break;
    case UPLOADER_JOB_FAILED:
        l->failed++;
        snprintf(l->last_err, sizeof l->last_err, "%.200s", ev->err ? ev->err->msg : "");
        break;
    case UPLOADER_JOB_DROPPED: l->dropped++; break;
    case UPLOADER_FILE_DONE: l->files++; break;
    default: break;
    }
    pthread_mutex_unlock(&l->mu);
}

static int ev_get(ev_log *l, const int *field)
{
    pthread_mutex_lock(&l->mu);
    int v = *field;
    pthread_mutex_unlock(&l->mu);
    return v;
}

/* "Takes the store down": the store root's parent becomes a regular file. */
static void block_store(const store_fx *f, const char *moved)
{
    cr_assert_eq(rename(f->root, moved), 0);
    tu_write_bytes(f->root, "blocker", 7);
}

static void unblock_store(const store_fx *f, const char *moved)
{
    cr_assert_eq(unlink(f->root), 0);
    cr_assert_eq(rename(moved, f->root), 0);
}

Test(store_file, uploader_pushes_backlog_after_outage)
{
    store_fx f = open_fixture("upl");
    sp_err err = {0};
    cr_assert_eq(store_create_bucket(f.s, &err), 0);
    char *local = path_in(f.dir, "local"), *moved = path_in(f.dir, "moved");
    mkdir(local, 0777);
    char *c1 = make_ckpt(local, "step-00000100", 1, 2 * MIB);
    char *c2 = make_ckpt(local, "step-00000200", 2, 2 * MIB);
    block_store(&f, moved);

    ev_log ev = {.mu = PTHREAD_MUTEX_INITIALIZER};
    uploader_opts o = {.max_queue = 4, .retry_base_s = 0.05, .retry_max_s = 0.2,
                       .on_event = on_event, .arg = &ev};
    uploader_t *u;
    cr_assert_eq(uploader_start(&u, f.s, &o, &err), 0, "%s", err.msg);
    cr_assert_eq(uploader_submit(u, c1, "step-00000100", &err), 0);
    cr_assert_eq(uploader_submit(u, c2, "step-00000200", &err), 0);
    cr_assert_eq(uploader_wait(u, 0.6), 0, "store down: not everything pushed");
    cr_assert_eq(uploader_pending(u), 2, "remote is behind by 2");
    cr_assert_gt(ev_get(&ev, &ev.retry), 1, "the job was retried");
    sp_err last = {0};
    cr_assert_eq(uploader_last_error(u, &last), 1);
    cr_assert(strstr(last.msg, "file://"), "%s", last.msg);

    unblock_store(&f, moved);
    cr_assert_eq(uploader_wait(u, 20), 1, "backlog pushed after the store came back");
    cr_assert_eq(uploader_pending(u), 0);
    cr_assert_eq(ev_get(&ev, &ev.done), 2);
    cr_assert_str_eq(ev.last_prefix, "step-00000200", "oldest first");
    cr_assert_eq(uploader_last_error(u, NULL), 0);
    uploader_stop(u);

    char *b1 = path_in(f.dir, "b1"), *b2 = path_in(f.dir, "b2");
    cr_assert_eq(store_pull_dir(f.s, "step-00000100", b1, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(store_pull_dir(f.s, "step-00000200", b2, NULL, &err), 0, "%s", err.msg);
    assert_same_tree(c1, b1);
    assert_same_tree(c2, b2);
    free(b1);
    free(b2);
    free(c1);
    free(c2);
    free(local);
    free(moved);
    close_fixture(&f);
}

/* may_push "not yet" (the lease not yet written): the jobs stay queued,
 * nothing reaches the store and no event is sent, while it is asked again;
 * "yes": they go, oldest first; "never" (the lease lost): the next job fails
 * for good with the gate's reason, and nothing of it reaches the store. */
Test(store_file, uploader_holds_jobs_until_it_may_push)
{
    store_fx f = open_fixture("gate");
    sp_err err = {0};
    cr_assert_eq(store_create_bucket(f.s, &err), 0);
    char *local = path_in(f.dir, "local");
    mkdir(local, 0777);
    char *c1 = make_ckpt(local, "step-00000100", 1, 4096);
    char *c2 = make_ckpt(local, "step-00000200", 2, 4096);
    char *c3 = make_ckpt(local, "step-00000300", 3, 4096);
    ev_log ev = {.mu = PTHREAD_MUTEX_INITIALIZER, .gate = 0};
    uploader_opts o = {.max_queue = 4, .on_event = on_event, .may_push = gate_fn, .arg = &ev};
    uploader_t *u;
    cr_assert_eq(uploader_start(&u, f.s, &o, &err), 0, "%s", err.msg);
    cr_assert_eq(uploader_submit(u, c1, "step-00000100", &err), 0);
    cr_assert_eq(uploader_submit(u, c2, "step-00000200", &err), 0);
    cr_assert_eq(uploader_wait(u, 1.6), 0, "held: not pushed");
    cr_expect_eq(uploader_pending(u), 2);
    cr_expect_geq(ev_get(&ev, &ev.asked), 3, "asked again every %.1f s", UPLOADER_HOLD_S);
    cr_expect_eq(ev_get(&ev, &ev.files) + ev_get(&ev, &ev.retry) + ev_get(&ev, &ev.failed) +
                     ev_get(&ev, &ev.dropped),
                 0, "no event while held");
    store_listing l = {0};
    cr_assert_eq(store_list(f.s, "", &l, &err), 0, "%s", err.msg);
    cr_expect_eq(l.n, 0, "%zu objects in the store while held", l.n);
    store_list_free(&l);
    pthread_mutex_lock(&ev.mu);
    ev.gate = 1;
    pthread_mutex_unlock(&ev.mu);
    cr_assert_eq(uploader_wait(u, 20), 1);
    cr_expect_eq(ev_get(&ev, &ev.done), 2);
    cr_expect_str_eq(ev.last_prefix, "step-00000200", "oldest first");
    pthread_mutex_lock(&ev.mu);
    ev.gate = -1;
    pthread_mutex_unlock(&ev.mu);
    cr_assert_eq(uploader_submit(u, c3, "step-00000300", &err), 0);
    cr_assert_eq(uploader_wait(u, 20), 1, "a job refused for good is not pending");
    cr_expect_eq(ev_get(&ev, &ev.failed), 1);
    cr_expect(strstr(ev.last_err, "another job holds this prefix now"), "%s", ev.last_err);
    int exists = 1;
    cr_assert_eq(store_exists(f.s, "step-00000300/MANIFEST.json", &exists, NULL, &err), 0);
    cr_expect_not(exists, "refused, yet pushed");
    uploader_stop(u);
    free(c1), free(c2), free(c3), free(local);
    close_fixture(&f);
}

/* lease_check, the other ranks' question before each shard put: 1 only
 * while the store's lease is this job's (lease_job, as rank 0 gives it
 * out); before it is written, after it is released, another job's, or a
 * lease that cannot be read: 0, saying which. */
Test(store_file, lease_check_knows_the_jobs_own_lease_only)
{
    store_fx f = open_fixture("lease");
    sp_err err = {0};
    cr_assert_eq(store_create_bucket(f.s, &err), 0);
    const char *other = "0123456789abcdef";
    cr_expect_eq(lease_check(f.s, other, &err), 0, "no lease yet");
    cr_expect(strstr(err.msg, "LEASE.json: this job's lease is not written yet"), "%s", err.msg);
    store_t *ls;
    cr_assert_eq(store_open(&ls, f.url, NULL, &err), 0, "%s", err.msg);
    lease_opts lo = {.ttl_s = 30, .wait_s = 1, .run_dir = f.dir};
    lease_t *l;
    int connected = 0;
    char note[256];
    cr_assert_eq(lease_acquire(&l, ls, &lo, &connected, note, sizeof note, &err), 0, "%s",
                 err.msg);
    cr_expect(connected && lease_held(l));
    char job[17];
    snprintf(job, sizeof job, "%s", lease_job(l));
    cr_expect_eq(strlen(job), 16, "job id %s", job);
    memset(&err, 0, sizeof err);
    cr_expect_eq(lease_check(f.s, job, &err), 1, "%s", err.msg);
    cr_expect_eq(lease_check(f.s, other, &err), 0, "another job's id passed");
    cr_expect(strstr(err.msg, "is not this job's but that of pid") && strstr(err.msg, job),
              "%s", err.msg);
    lease_release(l);
    memset(&err, 0, sizeof err);
    cr_expect_eq(lease_check(f.s, job, &err), 0, "the released lease still counts");
    cr_expect(strstr(err.msg, "not written yet"), "%s", err.msg);
    /* a lease the store cannot give back: a directory where the object goes */
    char *bad = path_in(f.root, "LEASE.json");
    cr_assert_eq(mkdir(bad, 0755), 0);
    memset(&err, 0, sizeof err);
    cr_expect_eq(lease_check(f.s, job, &err), 0, "an unreadable lease passed");
    cr_expect(strstr(err.msg, "LEASE.json cannot be read: "), "%s", err.msg);
    free(bad);
    close_fixture(&f);
}

Test(store_file, uploader_bounded_queue_drops_oldest_waiting)
{
    store_fx f = open_fixture("drop");
    sp_err err = {0};
    cr_assert_eq(store_create_bucket(f.s, &err), 0);
    char *local = path_in(f.dir, "local"), *moved = path_in(f.dir, "moved");
    mkdir(local, 0777);
    char *c[4];
    for (int i = 0; i < 4; i++) {
        char name[32];
        snprintf(name, sizeof name, "step-%08d", (i + 1) * 100);
        c[i] = make_ckpt(local, name, (uint64_t)i, 1000);
    }
    block_store(&f, moved);
    ev_log ev = {.mu = PTHREAD_MUTEX_INITIALIZER};
    uploader_opts o = {.max_queue = 2, .retry_base_s = 0.05, .retry_max_s = 0.1, .keep = 2,
                       .on_event = on_event, .arg = &ev};
    uploader_t *u;
    cr_assert_eq(uploader_start(&u, f.s, &o, &err), 0);
    int dropped = 0;
    for (int i = 0; i < 4; i++) {
        dropped += uploader_submit(u, c[i], strrchr(c[i], '/') + 1, &err);
        usleep(100 * 1000); /* let the thread try (and fail) */
    }
    cr_assert_eq(dropped + ev_get(&ev, &ev.dropped), 2, "two of four superseded");
    cr_assert_eq(uploader_pending(u), 2);
    unblock_store(&f, moved);
    cr_assert_eq(uploader_wait(u, 20), 1);
    uploader_stop(u);
    int exists = 0;
    cr_assert_eq(store_exists(f.s, "step-00000400/MANIFEST.json", &exists, NULL, &err), 0);
    cr_assert(exists, "the newest checkpoint was pushed");
    cr_assert_eq(store_exists(f.s, "step-00000300/MANIFEST.json", &exists, NULL, &err), 0);
    cr_assert(exists);
    cr_assert_eq(store_exists(f.s, "step-00000100/MANIFEST.json", &exists, NULL, &err), 0);
    cr_assert_not(exists, "dropped");
    for (int i = 0; i < 4; i++)
        free(c[i]);
    free(local);
    free(moved);
    close_fixture(&f);
}

/* on_event that holds the uploader's thread at the first file of a job
 * until the test lets it go (a push in flight for as long as it takes) */
typedef struct held_push {
    ev_log ev;
    int holding, release;
} held_push;

static void hold_first_file(void *arg, const uploader_event *e)
{
    held_push *h = arg;
    on_event(&h->ev, e);
    pthread_mutex_lock(&h->ev.mu);
    int hold = e->kind == UPLOADER_FILE_DONE && !h->release;
    h->holding = hold;
    pthread_mutex_unlock(&h->ev.mu);
    while (hold) {
        usleep(10 * 1000);
        pthread_mutex_lock(&h->ev.mu);
        hold = !h->release;
        pthread_mutex_unlock(&h->ev.mu);
    }
}

/* The job stops (a spot notice): uploader_hurry. The push in flight of an
 * older checkpoint is canceled and dropped, not retried; of the waiting
 * ones only the newest stays; the newest is pushed, and nothing older after
 * it. */
Test(store_file, uploader_hurry_pushes_the_newest_first)
{
    store_fx f = open_fixture("hurry");
    sp_err err = {0};
    cr_assert_eq(store_create_bucket(f.s, &err), 0);
    char *local = path_in(f.dir, "local");
    mkdir(local, 0777);
    char *c[3];
    for (int i = 0; i < 3; i++) {
        char name[32];
        snprintf(name, sizeof name, "step-%08d", (i + 1) * 100);
        c[i] = make_ckpt(local, name, (uint64_t)i, 4096);
    }
    held_push h = {.ev = {.mu = PTHREAD_MUTEX_INITIALIZER}};
    uploader_opts o = {.max_queue = 4, .retry_base_s = 0.05, .retry_max_s = 0.1,
                       .on_event = hold_first_file, .arg = &h};
    uploader_t *u;
    cr_assert_eq(uploader_start(&u, f.s, &o, &err), 0, "%s", err.msg);
    cr_assert_eq(uploader_submit(u, c[0], "step-00000100", &err), 0);
    for (int i = 0; i < 500 && !ev_get(&h.ev, &h.holding); i++)
        usleep(10 * 1000);
    cr_assert(ev_get(&h.ev, &h.holding), "the first push never reached its first file");
    cr_assert_eq(uploader_submit(u, c[1], "step-00000200", &err), 0);
    cr_assert_eq(uploader_submit(u, c[2], "step-00000300", &err), 0);
    cr_expect_eq(uploader_hurry(u), 2, "step 200 waiting and step 100 in flight passed over");
    pthread_mutex_lock(&h.ev.mu);
    h.release = 1;
    pthread_mutex_unlock(&h.ev.mu);
    cr_assert_eq(uploader_wait(u, 20), 1);
    cr_expect_eq(ev_get(&h.ev, &h.ev.done), 1, "one push completed");
    cr_expect_str_eq(h.ev.last_prefix, "step-00000300", "the newest");
    cr_expect_eq(ev_get(&h.ev, &h.ev.dropped), 1, "the push in flight dropped");
    cr_expect_eq(ev_get(&h.ev, &h.ev.retry), 0, "a hurried push is not retried");
    int exists = 1;
    static const char *const gone[] = {"step-00000100/MANIFEST.json",
                                       "step-00000200/MANIFEST.json"};
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(store_exists(f.s, gone[i], &exists, NULL, &err), 0, "%s", err.msg);
        cr_expect_not(exists, "%s pushed after the hurry", gone[i]);
    }
    cr_assert_eq(store_exists(f.s, "step-00000300/MANIFEST.json", &exists, NULL, &err), 0);
    cr_expect(exists, "the newest checkpoint was not pushed");
    uploader_stop(u);
    for (int i = 0; i < 3; i++)
        free(c[i]);
    free(local);
    close_fixture(&f);
}

/* The uploader's thread is named ckpt-upload while it runs (top -H, gdb)
 * and is gone once uploader_stop returns. */
Test(store_file, uploader_thread_is_named_and_gone_after_stop)
{
    store_fx f = open_fixture("named");
    sp_err err = {0};
    cr_assert_eq(store_create_bucket(f.s, &err), 0);
    cr_assert_eq(tu_threads_named("ckpt-upload"), 0);
    uploader_opts o = {.retry_base_s = 0.05, .retry_max_s = 0.1};
    uploader_t *u;
    cr_assert_eq(uploader_start(&u, f.s, &o, &err), 0, "%s", err.msg);
    int seen = 0;
    for (int i = 0; i < 200 && !seen; i++) {
        seen = tu_threads_named("ckpt-upload");
        if (!seen)
            usleep(10 * 1000); /* the thread names itself first thing */
    }
    cr_expect_eq(seen, 1, "no thread named ckpt-upload within 2 s of uploader_start");
    uploader_stop(u);
    cr_expect_eq(tu_threads_named("ckpt-upload"), 0, "the uploader's thread outlived its stop");
    close_fixture(&f);
}

Test(store_file, uploader_drops_job_whose_directory_vanished_and_stops_promptly)
{
    store_fx f = open_fixture("gone");
    sp_err err = {0};
    ev_log ev = {.mu = PTHREAD_MUTEX_INITIALIZER};
    uploader_opts o = {.retry_base_s = 5, .retry_max_s = 5, .on_event = on_event, .arg = &ev};
    uploader_t *u;
    cr_assert_eq(uploader_start(&u, f.s, &o, &err), 0);
    char *gone = path_in(f.dir, "no-such-dir");
    cr_assert_eq(uploader_submit(u, gone, "step-00000001", &err), 0);
    cr_assert_eq(uploader_wait(u, 10), 1);
    cr_assert_eq(ev_get(&ev, &ev.failed), 1, "failed for good, not retried");
    cr_assert_eq(ev_get(&ev, &ev.retry), 0);

    /* a job waiting for its 5 s retry does not delay stop */
    char *moved = path_in(f.dir, "moved");
    cr_assert_eq(store_create_bucket(f.s, &err), 0);
    char *local = path_in(f.dir, "local");
    mkdir(local, 0777);
    char *ck = make_ckpt(local, "step-00000002", 3, 1000);
    block_store(&f, moved);
    cr_assert_eq(uploader_submit(u, ck, "step-00000002", &err), 0);
    usleep(200 * 1000);
    double t0 = sp_now();
    uploader_stop(u);
    /* far below the 5 s the retry would wait, with room for a loaded machine */
    cr_assert_lt(sp_now() - t0, 3.0, "stop took %.2f s", sp_now() - t0);
    unblock_store(&f, moved);
    free(ck);
    free(local);
    free(moved);
    free(gone);
    close_fixture(&f);
}
