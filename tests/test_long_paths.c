/* Paths as long as the system takes, and longer, through the spotune binary:
 * a run directory, a model and a dataset nearly 4000 bytes deep train,
 * checkpoint, resume, verify and export as any other; a run directory whose
 * own path, or a path spotune builds below it (the lock, the resolved config,
 * a checkpoint, the adapter), is longer than the system takes (PATH_MAX,
 * 4096 bytes with the terminating NUL) ends the run with an error naming the
 * whole path and "File name too long", exit 1, no crash, and nothing written
 * at the path cut to what the system takes; a path longer than an error
 * record holds (9 KB) keeps both its ends in the message, the cut marked. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint/ckpt.h"
#include "resume_util.h"
#include "test_util.h"

TestSuite(long_paths, .init = resume_setup, .fini = resume_teardown, .timeout = 900);

/* A directory below DIR whose absolute path is len bytes long (components of
 * at most 200 bytes), made; its path relative to DIR (malloc'd). */
static char *deep_dir(size_t len)
{
    size_t base = strlen(dir) + 1;
    cr_assert_gt(len, base + 1, "DIR (%s) leaves no room for %zu bytes", dir, len);
    size_t want = len - base, q = (want - 1) / 200, r = want - 200 * q;
    char *rel = malloc(want + 1), *p = rel;
    cr_assert(rel);
    for (size_t i = 0; i <= q; i++) {
        size_t n = i < q ? 199 : r;
        for (size_t j = 0; j < n; j++)
            *p++ = (char)(j < 4 ? "deep"[j] : 'a' + (char)((i + j) % 26));
        if (i < q)
            *p++ = '/';
    }
    *p = 0;
    const char *abs = tu_fmt("%s/%s", dir, rel);
    cr_assert_eq(strlen(abs), len);
    cr_assert_eq(sp_mkdir_p(abs), 0, "mkdir -p %s: %s", abs, strerror(errno));
    return rel;
}

/* The run.dir, model and data of a run all ~4000 bytes deep (its deepest
 * path, a checkpoint's metrics.jsonl while the checkpoint is written, is
 * about 4050 bytes): it trains, checkpoints, resumes from its
 * checkpoint, and the checkpoint verifies and exports (which reads the base
 * model's path from the checkpoint's config: it must be stored whole). */
Test(long_paths, a_run_4000_bytes_deep_trains_resumes_and_exports)
{
    char *deep = deep_dir(3990);
    char *abs = strdup(tu_fmt("%s/%s", dir, deep));
    char *out = NULL;
    cr_assert_eq(tu_sh(&out, "cp -r %s/model %s/data.train.h5 %s/", dir, dir, abs), 0, "%s", out);
    free(out);
    char *name = strdup(tu_fmt("%s/run", deep));
    char *extra = strdup(tu_fmt("--set model.path=%s/model --set data.train=%s/data.train.h5 "
                                "--set checkpoint.every_steps=2 --set train.steps=4",
                                abs, abs));
    cr_assert(name && extra);

    int rc = run(NULL, name, extra, &out);
    cr_assert_eq(rc, 0, "exit %d: %s", rc, out);
    free(out);
    cr_expect_eq(last_step(name), 4);
    cr_expect_eq(expect_checkpoints_verify(name), 2);
    /* the resolved config holds the paths whole */
    char *cfg = tu_read_file(tu_fmt("%s/%s/config.yaml", dir, name), NULL);
    cr_expect(tu_contains(cfg, tu_fmt("%s/model", abs)), "config.yaml lacks the model path");
    free(cfg);

    rc = run(NULL, name, tu_fmt("%s --set train.steps=6", extra), &out);
    cr_assert_eq(rc, 0, "exit %d: %s", rc, out);
    const char *ck4 = tu_fmt("%s/%s/checkpoints/step-00000004", dir, name);
    cr_expect(tu_contains(out, tu_fmt("resumed from %s: step 4", ck4)), "%s", out);
    free(out);
    cr_expect_eq(last_step(name), 6);

    const char *ck6 = tu_fmt("%s/%s/checkpoints/step-00000006", dir, name);
    rc = tu_spotune(&out, "ckpt verify %s", ck6);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, tu_fmt("%s: ok (step 6", ck6)), "%s", out);
    free(out);
    rc = tu_spotune(&out, "ckpt list %s/%s", dir, name);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "step-00000004") && tu_contains(out, "step-00000006"), "%s", out);
    free(out);
    rc = tu_spotune(&out, "export %s --peft %s/peft --merged %s/merged", ck6, abs, abs);
    cr_expect_eq(rc, 0, "%s", out);
    free(out);
    struct stat sb;
    cr_expect_eq(stat(tu_fmt("%s/peft/adapter_model.safetensors", abs), &sb), 0);
    cr_expect_eq(stat(tu_fmt("%s/merged/model.safetensors", abs), &sb), 0);
    free(name);
    free(extra);
    free(abs);
    free(deep);
}

/* The entries of directory d, one per line after a '/' ("" if none). */
static char *entries(const char *d)
{
    char *all = strdup("");
    DIR *dp = opendir(d);
    struct dirent *e;
    while (dp && all && (e = readdir(dp))) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        char *more = sp_strf("%s/%s\n", all, e->d_name);
        free(all);
        all = more;
    }
    if (dp)
        closedir(dp);
    cr_assert(all);
    return all;
}

/* Runs spotune with run.dir = DIR/parent/leaf (its absolute path len bytes):
 * the run fails with exit 1, naming the whole run.dir and "File name too
 * long"; every path in `built` (below run.dir, "" ends the list) that is
 * longer than the system takes has nothing at its cut form; the run
 * directory holds only the entries of `allowed` ("/a\n/b\n"), and any of
 * them that is a directory is empty. */
static void refused(const char *parent, size_t len, const char *const *built,
                    const char *allowed)
{
    size_t at = strlen(dir) + 1 + strlen(parent) + 1;
    cr_assert_gt(len, at);
    char *leaf = malloc(len - at + 1);
    cr_assert(leaf);
    memset(leaf, 'r', len - at);
    leaf[len - at] = 0;
    char *name = strdup(tu_fmt("%s/%s", parent, leaf)), *out = NULL;
    char *run_dir = strdup(tu_fmt("%s/%s", dir, name));
    cr_assert(name && run_dir && strlen(run_dir) == len);
    int rc = run(NULL, name, "--set train.steps=2 --set checkpoint.every_steps=1", &out);
    cr_expect_eq(rc, 1, "run.dir of %zu bytes: exit %d: %s", len, rc, out);
    cr_expect(tu_contains(out, "File name too long"), "run.dir of %zu bytes: %s", len, out);
    cr_expect(tu_contains(out, run_dir), "run.dir of %zu bytes: the message does not name it: %s",
              len, out);
    free(out);
    for (int i = -1; i < 0 || built[i][0]; i++) {
        char *path = i < 0 ? strdup(run_dir) : sp_strf("%s/%s", run_dir, built[i]);
        if (strlen(path) >= PATH_MAX) {
            path[PATH_MAX - 1] = 0; /* what a cut buffer would hold */
            struct stat sb;
            cr_expect(lstat(path, &sb) != 0 && errno == ENOENT,
                      "run.dir of %zu bytes: something was written at the cut path %s", len,
                      path);
        }
        free(path);
    }
    struct stat sb;
    if (len < PATH_MAX && stat(run_dir, &sb) == 0) {
        char *have = entries(run_dir);
        for (char *e = have; *e; e += strcspn(e, "\n") + 1) {
            size_t n = strcspn(e, "\n");
            char *one = sp_strf("/%.*s\n", (int)n - 1, e + 1);
            cr_expect(tu_contains(allowed, one), "run.dir of %zu bytes: unexpected entry %.*s",
                      len, (int)n, e);
            char *sub = sp_strf("%s%.*s", run_dir, (int)n, e);
            if (stat(sub, &sb) == 0 && S_ISDIR(sb.st_mode)) {
                char *inside = entries(sub);
                cr_expect(!inside[0], "run.dir of %zu bytes: %.*s holds %s", len, (int)n, e,
                          inside);
                free(inside);
            }
            free(sub);
            free(one);
        }
        free(have);
    } else {
        char *inside = entries(tu_fmt("%s/%s", dir, parent));
        cr_expect(!inside[0], "run.dir of %zu bytes: its parent holds %s", len, inside);
        free(inside);
    }
    free(leaf);
    free(name);
    free(run_dir);
}

/* run.dir itself, and each path spotune builds below it in turn, longer than
 * the system takes. */
Test(long_paths, a_path_longer_than_the_system_takes_is_refused_by_name)
{
    static const char *const built[] = {".lock",
                                        "config.yaml.tmp",
                                        "config.yaml",
                                        "metrics.jsonl",
                                        "checkpoints",
                                        "checkpoints/.tmp-step-00000001-",
                                        "checkpoints/step-00000001",
                                        "adapter",
                                        "adapter/adapter_model.safetensors",
                                        "adapter/adapter_config.json",
                                        ""};
    char *parent = deep_dir(3990);
    /* run.dir: 4200 bytes (nothing can be made), then its .lock (4098), its
     * config.yaml.tmp (4101), then the first checkpoint's directory and the
     * adapter's files (4079 + 25 and more) longer than the system takes */
    refused(parent, 4200, built, "");
    refused(parent, 4092, built, "");
    refused(parent, 4085, built, "/.lock\n");
    refused(parent, 4079, built, "/.lock\n/config.yaml\n/metrics.jsonl\n/checkpoints\n/adapter\n");
    free(parent);
}

/* A run.dir longer than an error record holds (9216 bytes): the message
 * loses its middle, marked, and keeps its beginning (the start of the path)
 * and its end (the path's last bytes and the cause); exit 1 as for any path
 * longer than the system takes. */
Test(long_paths, a_message_longer_than_its_record_keeps_both_ends_of_the_path)
{
    size_t want = 12000;
    char *name = strdup("x");
    while (name && strlen(dir) + 1 + strlen(name) < want) {
        char *more = sp_strf("%s/%.*s", name, 190,
                             "abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyzabcdefghijklmnopq"
                             "rstuvwxyzabcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyzabcdefg"
                             "hijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvw");
        free(name);
        name = more;
    }
    cr_assert(name);
    char *tail = sp_strf("%s/end-of-the-run-dir", name);
    free(name);
    char *run_dir = sp_strf("%s/%s", dir, tail), *out = NULL;
    cr_assert(run_dir && strlen(run_dir) > SP_ERR_MSG_MAX);
    int rc = run(NULL, tail, "--set train.steps=1", &out);
    cr_expect_eq(rc, 1, "exit %d: %.300s", rc, out);
    cr_expect(tu_contains(out, "[... message cut ...]"), "no cut marked: %.300s", out);
    cr_expect(tu_contains(out, tu_fmt("%.200s", run_dir)), "the path's start is lost: %.300s",
              out);
    const char *end = strlen(out) > 400 ? out + strlen(out) - 400 : out;
    cr_expect(tu_contains(out, run_dir + strlen(run_dir) - 300), "the path's end is lost: ...%s",
              end);
    cr_expect(tu_contains(out, "File name too long"), "the cause is lost: ...%s", end);
    struct stat sb;
    cr_expect(lstat(tu_fmt("%s/x", dir), &sb) != 0 && errno == ENOENT,
              "something was made below the run directory's first component");
    free(out);
    free(run_dir);
    free(tail);
}
