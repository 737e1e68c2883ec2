/* Checkpoints in a real S3-compatible store (the local Swift server that
 * tests/store.cmake starts), through the spotune binary: preemption, the run
 * directory lost, and a resume from the bucket to the bit-identical result;
 * the store down for a whole run; a remote checkpoint without MANIFEST never
 * used; the ckpt and export commands on s3:// URLs; credentials never written
 * or shown anywhere. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint/ckpt.h"
#include "checkpoint/store.h"
#include "test_util.h"

static char *dir;
static char url[512];

static const char *endpoint(void)
{
    const char *e = getenv("SPOTUNE_TEST_S3_ENDPOINT");
    cr_assert(e && *e && getenv("AWS_ACCESS_KEY_ID") && getenv("AWS_SECRET_ACCESS_KEY"),
              "the S3 test environment is missing: these tests need the local server");
    return e;
}

static void setup(void)
{
    dir = tu_tempdir("remote");
    cr_assert(dir);
    char *out = NULL;
    int rc = tu_tiny_inputs(dir, 9, 4, &out);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    /* a bucket per test run; the prefix is unique to this test */
    snprintf(url, sizeof url, "s3://spotune-remote-test/run-%d-%ld", (int)getpid(),
             (long)(sp_wall_time() * 1000) % 100000000);
    store_opts o = {0};
    o.endpoint = endpoint();
    o.addressing = STORE_ADDR_PATH;
    store_t *st;
    sp_err err = {0};
    cr_assert_eq(store_open(&st, url, &o, &err), 0, "%s", err.msg);
    cr_assert_eq(store_create_bucket(st, &err), 0, "%s", err.msg);
    store_close(st);
    char path[4096], cfg[4096];
    snprintf(path, sizeof path, "%s/run.yaml", dir);
    snprintf(cfg, sizeof cfg,
             "run:\n  seed: 8\nmodel:\n  path: %s/model\n"
             "train:\n  mode: lora\n  steps: 40\n  seq_len: 32\n  micro_batch: 4\n  lr: 3e-3\n"
             "lora:\n  r: 4\n  alpha: 8\n  targets: [q_proj, v_proj]\n"
             "data:\n  train: %s/data.train.h5\n"
             "log:\n  every: 1\nruntime:\n  backend: cpu\n  threads: 1\n"
             "checkpoint:\n  every_minutes: 0\n  every_steps: 5\n  keep: 2\n"
             "  remote: %s\n  endpoint: %s\n  region: us-east-1\n  addressing: path\n"
             "  upload_deadline_s: 60\n",
             dir, dir, url, endpoint());
    cr_assert_eq(tu_write_file(path, cfg), 0);
}

static void teardown(void)
{
    tu_rmtree(dir);
    free(dir);
}

TestSuite(remote, .init = setup, .fini = teardown, .timeout = 900);

static const char *cmd(const char *name, const char *extra)
{
    static char c[8192];
    snprintf(c, sizeof c, "%s/spotune train %s/run.yaml --set run.dir=%s/%s %s",
             SPOTUNE_BINARY_DIR, dir, dir, name, extra ? extra : "");
    return c;
}

static int run(const char *name, const char *extra, char **out)
{
    return tu_sh(out, "%s", cmd(name, extra));
}

Test(remote, preempted_run_resumes_from_the_bucket_on_a_fresh_machine)
{
    char *out = NULL;
    cr_assert_eq(run("whole", "--set checkpoint.remote=", &out), 0, "%s", out);
    free(out);
    char log[4096], metrics[4096];
    snprintf(log, sizeof log, "%s/spot.log", dir);
    snprintf(metrics, sizeof metrics, "%s/spot/metrics.jsonl", dir);
    int pid = tu_spawn(log, "%s", cmd("spot", NULL));
    for (int i = 0; i < 6000; i++) {
        char *t = tu_read_file(metrics, NULL);
        int go = tu_contains(t, "\"step\":12,");
        free(t);
        if (go || kill(pid, 0) != 0)
            break;
        tu_sleep(0.01);
    }
    kill(pid, SIGTERM);
    int rc = tu_wait(pid, 300);
    char *text = tu_read_file(log, NULL);
    cr_assert_eq(rc, 75, "%s", text);
    cr_expect(tu_contains(text, "is in s3://"), "the checkpoint reached the bucket: %s", text);
    free(text);
    /* the machine is gone: so is its disk */
    tu_sh(NULL, "rm -rf %s/spot", dir);
    cr_assert_eq(run("spot", NULL, &out), 0, "%s", out);
    cr_expect(tu_contains(out, "downloading s3://") && tu_contains(out, "resumed from"), "%s", out);
    free(out);
    /* the metrics came back with the checkpoint: the whole curve, once */
    char mpath[4096];
    snprintf(mpath, sizeof mpath, "%s/spot/metrics.jsonl", dir);
    char *m = tu_read_file(mpath, NULL);
    int lines = 0;
    for (char *p = m ? strstr(m, "\"event\":\"train\"") : NULL; p; p = strstr(p + 1, "\"event\":\"train\""))
        lines++;
    cr_expect_eq(lines, 40, "metrics.jsonl holds %d train records after the resume", lines);
    cr_expect(tu_contains(m, "\"step\":1,") && tu_contains(m, "\"step\":40,"), "%s", m);
    free(m);
    cr_expect_eq(tu_sh(NULL, "cmp %s/whole/adapter/adapter_model.safetensors "
                             "%s/spot/adapter/adapter_model.safetensors",
                       dir, dir),
                 0, "the adapter after a resume from the bucket differs");
    /* ckpt list / verify / export on the bucket */
    char *ls = NULL;
    cr_expect_eq(tu_spotune(&ls, "ckpt list %s --endpoint %s --path-style", url, endpoint()), 0);
    cr_expect(tu_contains(ls, "step-00000040") && tu_contains(ls, "complete"), "%s", ls);
    free(ls);
    char *v = NULL;
    cr_expect_eq(tu_spotune(&v, "ckpt verify %s/step-00000040 --endpoint %s --path-style", url,
                            endpoint()),
                 0, "%s", v);
    cr_expect(tu_contains(v, ": ok"), "%s", v);
    free(v);
    char *e = NULL;
    cr_expect_eq(tu_spotune(&e, "export %s/step-00000040 --endpoint %s --path-style --peft %s/exp",
                            url, endpoint(), dir),
                 0, "%s", e);
    free(e);
    cr_expect_eq(tu_sh(NULL, "cmp %s/exp/adapter_model.safetensors "
                             "%s/whole/adapter/adapter_model.safetensors",
                       dir, dir),
                 0, "the exported adapter differs from the run's own");
}

Test(remote, store_down_for_the_whole_run)
{
    char *out = NULL;
    /* nothing listens on port 9 of loopback */
    int rc = run("down", "--set checkpoint.endpoint=http://127.0.0.1:9 --set train.steps=12 "
                         "--set checkpoint.every_steps=3 --set checkpoint.final_upload_timeout_s=3",
                 &out);
    cr_assert_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "remote behind 1") || tu_contains(out, "remote behind 2"), "%s", out);
    cr_expect(tu_contains(out, "the remote store is") && tu_contains(out, "behind"), "%s", out);
    free(out);
    char root[4096];
    snprintf(root, sizeof root, "%s/down/checkpoints", dir);
    ckpt_info *l;
    int n;
    sp_err err = {0};
    cr_assert_eq(ckpt_list(root, 1, &l, &n, &err), 0);
    cr_expect_eq(n, 2, "keep: 2 local checkpoints");
    for (int i = 0; i < n; i++)
        cr_expect(l[i].ok, "%s: %s", l[i].name, l[i].problem);
    free(l);
}

Test(remote, a_remote_checkpoint_without_manifest_is_never_used)
{
    char *out = NULL;
    cr_assert_eq(run("nomf", "--set train.steps=10", &out), 0, "%s", out);
    free(out);
    /* a newer remote checkpoint whose upload never finished */
    store_opts o = {0};
    o.endpoint = endpoint();
    o.addressing = STORE_ADDR_PATH;
    store_t *st;
    sp_err err = {0};
    cr_assert_eq(store_open(&st, url, &o, &err), 0);
    cr_assert_eq(store_put_bytes(st, "step-00000099/state.h5", "partial", 7, 0, &err), 0, "%s",
                 err.msg);
    store_close(st);
    tu_sh(NULL, "rm -rf %s/nomf", dir);
    cr_assert_eq(run("nomf", "--set train.steps=12", &out), 0, "%s", out);
    cr_expect(tu_contains(out, "resumed from") && tu_contains(out, "step-00000010"), "%s", out);
    cr_expect(!tu_contains(out, "step-00000099"), "%s", out);
    free(out);
}

/* The secret never reaches a file, a log, the metrics, the saved config or a
 * command line. The command lines checked are those of the run's own process
 * group (the spotune process and anything it starts), sampled while it runs:
 * other processes on a shared machine are not the run's doing. */
Test(remote, credentials_are_never_written_or_shown)
{
    const char *secret = getenv("AWS_SECRET_ACCESS_KEY"), *key = getenv("AWS_ACCESS_KEY_ID");
    cr_assert(secret && key);
    char log[4096];
    snprintf(log, sizeof log, "%s/cred.log", dir);
    int pid = tu_spawn(log, "%s", cmd("cred", "--set train.steps=30"));
    int samples = 0, leaked = 0;
    char *seen = NULL;
    for (int i = 0; i < 40 && kill(pid, 0) == 0; i++) {
        char *ps = NULL;
        tu_sh(&ps, "ps -eo pgid=,args= | awk '$1 == %d'", pid);
        if (ps && ps[0])
            samples++;
        if (tu_contains(ps, secret) && !leaked) {
            leaked = 1;
            seen = ps;
            ps = NULL;
        }
        free(ps);
        tu_sleep(0.1);
    }
    int rc = tu_wait(pid, 300);
    cr_assert_eq(rc, 0);
    cr_expect_gt(samples, 0, "the run's command lines were never sampled");
    cr_expect(!leaked, "the secret is on a command line: %s", seen ? seen : "");
    free(seen);
    char *hits = NULL;
    tu_sh(&hits, "grep -rlF -e '%s' -e '%s' %s/cred %s/cred.log || true", secret, key, dir, dir);
    cr_expect(hits && hits[0] == 0, "credentials found in: %s", hits);
    free(hits);
}
