/* tests/test_store_file.c — the store API on file:// (in-process, no server):
 * round trips, ranged reads, no-replace puts, listing, deletes, key and URL
 * checks, checkpoint push/pull/prune ordering (the uploader on it:
 * test_store_file_uploader.c). */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/store.h"
#include "test_store_util.h"

#define MIB ((size_t)1 << 20)

TestSuite(store_file, .timeout = 120);

static void roundtrip_file(tu_file_fx *f, size_t n, uint64_t seed)
{
    char *src = tu_path_in(f->dir, "src.bin"), *back = tu_path_in(f->dir, "back/got.bin");
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
    tu_file_fx f = tu_file_store("rt");
    roundtrip_file(&f, 1024, 1);
    roundtrip_file(&f, 5 * MIB, 2);
    roundtrip_file(&f, 37 * MIB, 3);
    roundtrip_file(&f, 0, 4);
    cr_assert_str_eq(store_url(f.s), f.url);
    tu_file_store_close(&f);
}

Test(store_file, get_range)
{
    tu_file_fx f = tu_file_store("range");
    tu_check_get_range(f.s, "ckpt/shard-0.h5");
    sp_err err = {0};
    char b[4];
    cr_expect_eq(store_get_range(f.s, "ckpt/shard-0.h5/x", 0, 1, b, &err), STORE_ENOENT,
                 "below an object: %s", err.msg);
    sp_err e2 = {0};
    cr_expect_eq(store_get_range(f.s, "ckpt", 0, 1, b, &e2), STORE_EFAIL, "a directory: %s",
                 e2.msg);
    tu_file_store_close(&f);
}

Test(store_file, bytes_roundtrip_and_missing)
{
    tu_file_fx f = tu_file_store("bytes");
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
    char *dst = tu_path_in(f.dir, "x.bin");
    cr_assert_eq(store_get_file(f.s, "nope", dst, &err), STORE_ENOENT);
    cr_assert_neq(access(dst, F_OK), 0, "no local file after a failed get");
    free(dst);
    tu_file_store_close(&f);
}

Test(store_file, if_none_match_never_replaces)
{
    tu_file_fx f = tu_file_store("inm");
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(f.s, "m/MANIFEST.json", "one", 3, 1, &err), 0, "%s", err.msg);
    cr_assert_eq(store_put_bytes(f.s, "m/MANIFEST.json", "two", 3, 1, &err), STORE_EEXIST);
    cr_assert(strstr(err.msg, "already exists"), "%s", err.msg);
    sp_err_clear(&err);
    char *src = tu_path_in(f.dir, "three");
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
    tu_file_store_close(&f);
}

Test(store_file, list_sorted_filtered_and_skips_temporaries)
{
    tu_file_fx f = tu_file_store("list");
    sp_err err = {0};
    store_listing l;
    cr_assert_eq(store_list(f.s, "", &l, &err), 0, "missing root lists as empty: %s", err.msg);
    cr_assert_eq(l.n, 0);
    store_list_free(&l);
    const char *keys[] = {"step-2/b", "step-10/a", "step-1/z/deep.h5", "step-1/a", "other"};
    for (int i = 0; i < 5; i++)
        cr_assert_eq(store_put_bytes(f.s, keys[i], keys[i], strlen(keys[i]), 0, &err), 0);
    char *junk = tu_path_in(f.root, "step-1/.spotune-tmp.abc123");
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
    tu_file_store_close(&f);
}

Test(store_file, delete_is_idempotent_and_tidies_directories)
{
    tu_file_fx f = tu_file_store("del");
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(f.s, "d/e/f.bin", "x", 1, 0, &err), 0);
    cr_assert_eq(store_delete(f.s, "d/e/f.bin", &err), 0, "%s", err.msg);
    cr_assert_eq(store_delete(f.s, "d/e/f.bin", &err), 0, "deleting a missing object succeeds");
    int exists = 1;
    cr_assert_eq(store_exists(f.s, "d/e/f.bin", &exists, NULL, &err), 0);
    cr_assert_eq(exists, 0);
    char *d = tu_path_in(f.root, "d");
    struct stat st;
    cr_assert_neq(stat(d, &st), 0, "empty parent directories are removed");
    cr_assert_eq(stat(f.root, &st), 0, "the root stays");
    free(d);
    tu_file_store_close(&f);
}

Test(store_file, bad_keys_and_urls)
{
    tu_file_fx f = tu_file_store("bad");
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
    tu_file_store_close(&f);
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

Test(store_file, push_manifest_last_pull_identical)
{
    tu_file_fx f = tu_file_store("push");
    char *local = tu_path_in(f.dir, "local");
    mkdir(local, 0777);
    char *ck = tu_make_ckpt(local, "step-00000100", 7, 3 * MIB);
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

    char *back = tu_path_in(f.dir, "pulled/step-00000100");
    cr_assert_eq(store_pull_dir(f.s, "step-00000100", back, &x, &err), 0, "%s", err.msg);
    tu_assert_same_tree(ck, back);
    key_log_free(&log);
    cr_assert_eq(store_pull_dir(f.s, "step-00000100", back, NULL, &err), STORE_ELOCAL,
                 "pull refuses an existing directory");
    sp_err_clear(&err);
    char *missing = tu_path_in(f.dir, "pulled/none");
    cr_assert_eq(store_pull_dir(f.s, "step-00000999", missing, NULL, &err), STORE_ENOENT);
    cr_assert_eq(err.code, SP_EXIT_INPUT);
    cr_assert_neq(access(missing, F_OK), 0);
    free(missing);
    free(back);
    free(ck);
    free(local);
    tu_file_store_close(&f);
}

/* A sharded checkpoint whose ranks put their shard files themselves
 * (shards_put_by_ranks): MANIFEST.json waits for them (0.3 s here). A shard
 * still missing then that the local directory holds with its MANIFEST size
 * (run.dir shared: its rank's put failed) is put by the push itself, and the
 * push completes; one the local directory lacks (another machine's) fails
 * the push with STORE_EPEER, naming it, and MANIFEST.json is not pushed. */
Test(store_file, push_puts_a_missing_rank_shard_it_holds_and_names_one_it_lacks)
{
    tu_file_fx f = tu_file_store("shards");
    char *ck = tu_path_in(f.dir, "step-00000010");
    cr_assert_eq(mkdir(ck, 0777), 0);
    const char *names[2] = {"shard-00000-of-00002.h5", "shard-00001-of-00002.h5"};
    char *paths[2];
    for (int i = 0; i < 2; i++) {
        paths[i] = tu_path_in(ck, names[i]);
        tu_random_file(paths[i], 1000 + (size_t)i, 40 + (uint64_t)i);
    }
    char *mpath = tu_path_in(ck, "MANIFEST.json");
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
    char *got = tu_path_in(f.dir, "got.h5");
    cr_assert_eq(store_get_file(f.s, "step-00000010/shard-00000-of-00002.h5", got, &err), 0);
    int there = 0;
    cr_assert_eq(store_exists(f.s, "step-00000010/MANIFEST.json", &there, NULL, &err), 0);
    cr_expect(there, "MANIFEST.json pushed");
    cr_assert_eq(store_get_file(f.s, "step-00000010/shard-00001-of-00002.h5", got, &err), 0,
                 "%s", err.msg);
    cr_expect(tu_files_equal(got, paths[1]), "rank 1's shard, put by the push, differs");
    /* step 20: rank 1's shard is on another machine (not here) and not in the store */
    char *ck2 = tu_path_in(f.dir, "step-00000020");
    cr_assert_eq(mkdir(ck2, 0777), 0);
    char *m2 = tu_path_in(ck2, "MANIFEST.json"), *p2 = tu_path_in(ck2, names[0]);
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
    tu_file_store_close(&f);
}

Test(store_file, push_refuses_incomplete_and_conflicting)
{
    tu_file_fx f = tu_file_store("conflict");
    char *local = tu_path_in(f.dir, "local");
    mkdir(local, 0777);
    char *ck = tu_make_ckpt(local, "step-00000100", 1, 1000);
    sp_err err = {0};
    cr_assert_eq(store_push_dir(f.s, ck, "step-00000100", NULL, &err), 0, "%s", err.msg);

    char *other = tu_make_ckpt(local, "other", 2, 1000);
    cr_assert_eq(store_push_dir(f.s, other, "step-00000100", NULL, &err), STORE_EEXIST);
    cr_assert(strstr(err.msg, "MANIFEST.json differs"), "%s", err.msg);
    char *back = tu_path_in(f.dir, "back");
    sp_err_clear(&err);
    cr_assert_eq(store_pull_dir(f.s, "step-00000100", back, NULL, &err), 0, "%s", err.msg);
    tu_assert_same_tree(ck, back); /* nothing of `other` was written */

    char *nomanifest = tu_path_in(local, "other/MANIFEST.json");
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
    tu_file_store_close(&f);
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
    tu_file_fx f = tu_file_store("prune");
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
    tu_file_store_close(&f);
}
