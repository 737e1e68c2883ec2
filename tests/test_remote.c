/* Checkpoints in a real S3-compatible store (the local Swift server that
 * tests/store.cmake starts), through the spotune binary: preemption, the run
 * directory lost, and a resume from the bucket to the bit-identical result
 * (one rank; several: test_remote_ranks.c); the store down for a whole run;
 * the store hung (its proxy SIGSTOPped) while training goes on, and when a preemption's upload deadline
 * runs out; a remote checkpoint without MANIFEST, or whose data fails its
 * size or checksum, never used; the ckpt and export commands on s3:// URLs;
 * the endpoint from AWS_ENDPOINT_URL; credentials never written or shown
 * anywhere. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint/ckpt.h"
#include "checkpoint/store.h"
#include "remote_util.h"
#include "test_util.h"

TestSuite(remote, .init = remote_setup, .fini = remote_teardown, .timeout = 900);

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
    cr_expect_eq(
        tu_spotune(&ls, "ckpt list %s --endpoint %s --path-style", url, tu_s3_endpoint()), 0);
    cr_expect(tu_contains(ls, "step-00000040") && tu_contains(ls, "complete"), "%s", ls);
    free(ls);
    char *v = NULL;
    cr_expect_eq(tu_spotune(&v, "ckpt verify %s/step-00000040 --endpoint %s --path-style", url,
                            tu_s3_endpoint()),
                 0, "%s", v);
    cr_expect(tu_contains(v, ": ok"), "%s", v);
    free(v);
    char *e = NULL;
    cr_expect_eq(tu_spotune(&e, "export %s/step-00000040 --endpoint %s --path-style --peft %s/exp",
                            url, tu_s3_endpoint(), dir),
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
    /* the local checkpoints are complete, but the job did not reach its store */
    cr_assert_eq(rc, 1, "%s", out);
    cr_expect(tu_contains(out, "remote behind 1") || tu_contains(out, "remote behind 2"), "%s", out);
    cr_expect(tu_contains(out, "the remote store is") && tu_contains(out, "behind"), "%s", out);
    cr_expect(tu_contains(out, "training finished, but its final checkpoint (step 12) is not in "
                               "s3://") &&
                  tu_contains(out, "the store received no checkpoint of this run") &&
                  tu_contains(out, "running the same command again pushes it"),
              "%s", out);
    cr_expect(tu_contains(out, "does not answer now; training starts"), "%s", out);
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
    /* the store is back: the same command pushes the final checkpoint and ends 0 */
    cr_assert(!remote_has("step-00000012/MANIFEST.json"));
    rc = run("down", "--set train.steps=12 --set checkpoint.every_steps=3", &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "lacks checkpoint step 12: pushing it"), "%s", out);
    free(out);
    cr_expect(remote_has("step-00000012/MANIFEST.json"), "the final checkpoint was not pushed");
    cr_expect(!remote_has("LEASE.json"), "the lease outlived the job");
}

/* A store that refuses the credentials (403) or has no such bucket (404
 * NoSuchBucket): the job says so in one line and exits 2 before training,
 * since its checkpoints could never leave the machine. */
Test(remote, refused_credentials_or_no_bucket_stop_the_job_before_training)
{
    char *out = NULL;
    double t0 = sp_now();
    int rc = tu_sh(&out, "AWS_SECRET_ACCESS_KEY=not-the-secret %s", cmd("denied", NULL));
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "the store refuses to hold this job's checkpoints") &&
                  tu_contains(out, " 403 "),
              "%s", out);
    cr_expect(!tu_contains(out, "step      1/"), "it trained: %s", out);
    cr_expect(!tu_contains(out, "not-the-secret"), "the secret was shown: %s", out);
    free(out);
    cr_expect_lt(sp_now() - t0, 30.0, "the refusal took %.1f s", sp_now() - t0);

    rc = run("nobucket", "--set checkpoint.remote=s3://spotune-no-such-bucket-7d1e/p", &out);
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "s3://spotune-no-such-bucket-7d1e/p: the store refuses") &&
                  tu_contains(out, "NoSuchBucket"),
              "%s", out);
    cr_expect(!tu_contains(out, "step      1/"), "it trained: %s", out);
    free(out);
}

/* One job per remote prefix. A second job (its own run.dir) on the prefix of
 * a running one waits checkpoint.lease_s + 5 s for the lease to expire, then
 * exits 2 naming the holder; the first ends 0 and its lease goes with it. A
 * lease of a process of this host that has ended is taken over at once. */
Test(remote, a_second_job_on_a_live_prefix_waits_then_refuses)
{
    char log[4096];
    snprintf(log, sizeof log, "%s/first.log", dir);
    /* a checkpoint every 200 steps: the job holds the lease; pushing one
     * every 5 steps at the speed of a fast CPU (tens of steps a second)
     * kept the local test store too busy to answer the second job */
    int pid = tu_spawn(log, "%s",
                       cmd("first", "--set train.steps=2000 --set checkpoint.lease_s=2 "
                                    "--set checkpoint.every_steps=200"));
    cr_assert(wait_log(log, "step      1/", pid, 120), "the first job did not start");
    cr_assert(remote_has("LEASE.json"), "no lease while the first job runs");
    char *out = NULL;
    double t0 = sp_now();
    int rc = run("second", "--set checkpoint.lease_s=2", &out);
    double waited = sp_now() - t0;
    char want[128];
    snprintf(want, sizeof want, "is in use by another job: pid %d on host ", pid);
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, want) && tu_contains(out, "--takeover"), "'%s' lacks '%s'", out,
              want);
    cr_expect(!tu_contains(out, "step      1/"), "the second job trained: %s", out);
    cr_expect_geq(waited, 7.0, "refused after %.1f s, before the lease could expire", waited);
    free(out);
    cr_expect(running(pid), "the first job ended early");
    kill(pid, SIGTERM);
    rc = tu_wait(pid, 300);
    cr_expect_eq(rc, 75, "the first job: exit %d", rc);
    cr_expect(!remote_has("LEASE.json"), "the first job's lease outlived it");

    /* a lease of this host's process that has ended */
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    char lease[1024];
    snprintf(lease, sizeof lease,
             "{\"host\": \"%s\", \"pid\": 999999, \"job\": \"0123456789abcdef\", "
             "\"run_dir\": \"/gone\", \"started\": %.0f, \"renewed\": %.0f, \"ttl_s\": 90}",
             host, sp_wall_time(), sp_wall_time());
    store_t *st = open_store();
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(st, "LEASE.json", lease, strlen(lease), 0, &err), 0, "%s",
                 err.msg);
    store_close(st);
    rc = run("third", "--set train.steps=3", &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "taking over the lease of pid 999999 on host ") &&
                  tu_contains(out, "which has ended"),
              "%s", out);
    free(out);

    /* a lease of this host's process that has exited and is not yet reaped
     * (a zombie) is taken over at once too, not after its 90 s */
    int zombie = tu_zombie_pid();
    snprintf(lease, sizeof lease,
             "{\"host\": \"%s\", \"pid\": %d, \"job\": \"0123456789abcdef\", "
             "\"run_dir\": \"/gone\", \"started\": %.0f, \"renewed\": %.0f, \"ttl_s\": 90}",
             host, zombie, sp_wall_time(), sp_wall_time());
    st = open_store();
    cr_assert_eq(store_put_bytes(st, "LEASE.json", lease, strlen(lease), 0, &err), 0, "%s",
                 err.msg);
    store_close(st);
    t0 = sp_now();
    rc = run("fourth", "--set train.steps=3", &out);
    waited = sp_now() - t0;
    tu_reap(zombie);
    char took[128];
    snprintf(took, sizeof took, "taking over the lease of pid %d on host ", zombie);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, took) && tu_contains(out, "which has ended"), "'%s' lacks '%s'",
              out, took);
    cr_expect_lt(waited, 85.0, "the run waited %.0f s for a dead job's lease", waited);
    free(out);
}

/* --takeover: a second job takes the prefix at once; the first notices at its
 * next renewal, pushes nothing more and exits 2 naming the new holder. */
Test(remote, takeover_stops_the_other_job)
{
    char log[4096];
    snprintf(log, sizeof log, "%s/old.log", dir);
    int pid = tu_spawn(log, "%s",
                       cmd("old", "--set train.steps=4000 --set checkpoint.lease_s=2 "
                                  "--set checkpoint.every_steps=200")); /* as above */
    cr_assert(wait_log(log, "step      1/", pid, 120), "the first job did not start");
    char log2[4096];
    snprintf(log2, sizeof log2, "%s/new.log", dir);
    int pid2 = tu_spawn(log2, "%s --takeover",
                        cmd("new", "--set train.steps=4000 --set checkpoint.lease_s=2 "
                                   "--set checkpoint.every_steps=200"));
    cr_assert(wait_log(log2, "step      1/", pid2, 120), "the new job did not start");
    int rc = tu_wait(pid, 120);
    char *text = tu_read_file(log, NULL);
    char want[128];
    snprintf(want, sizeof want, "another job holds this prefix now: pid %d on host ", pid2);
    cr_expect_eq(rc, 2, "the old job: exit %d: %s", rc, text);
    cr_expect(tu_contains(text, want) && tu_contains(text, "this job stops"), "%s", text);
    free(text);
    text = tu_read_file(log2, NULL);
    snprintf(want, sizeof want, "taking over (as told) the live lease of pid %d", pid);
    cr_expect(tu_contains(text, want), "%s", text);
    free(text);
    cr_expect(running(pid2), "the new job ended");
    kill(pid2, SIGTERM);
    cr_expect_eq(tu_wait(pid2, 300), 75);
}

/* A store that accepts connections and never answers (its proxy stopped):
 * ckpt list and verify give up within their deadline (--timeout, default 30 s
 * a request), naming the request and the time, instead of retrying for
 * minutes. */
Test(remote, ckpt_commands_give_up_on_a_store_that_never_answers)
{
    char *out = NULL;
    tu_proxy_freeze(120);
    double t0 = sp_now();
    int rc = tu_spotune(&out, "ckpt list %s --endpoint %s --path-style --timeout 4", url,
                        tu_s3_endpoint());
    double took = sp_now() - t0;
    cr_expect_neq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "ListObjectsV2 failed") && tu_contains(out, "gave up after"),
              "%s", out);
    cr_expect(took >= 3.5 && took < 12, "ckpt list --timeout 4 took %.1f s", took);
    free(out);
    t0 = sp_now();
    rc = tu_spotune(&out, "ckpt verify %s/step-00000005 --endpoint %s --path-style --timeout 4",
                    url, tu_s3_endpoint());
    took = sp_now() - t0;
    cr_expect_neq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "gave up after"), "%s", out);
    cr_expect(took >= 3.5 && took < 12, "ckpt verify --timeout 4 took %.1f s", took);
    free(out);
    t0 = sp_now();
    rc = tu_spotune(&out, "ckpt list %s --endpoint %s --path-style", url, tu_s3_endpoint());
    took = sp_now() - t0;
    cr_expect_neq(rc, 0, "%s", out);
    cr_expect(took >= 25 && took < 45, "ckpt list (default deadline 30 s) took %.1f s", took);
    free(out);
    tu_proxy_thaw();
    rc = tu_spotune(&out, "ckpt list %s --endpoint %s --path-style --timeout 0", url,
                    tu_s3_endpoint());
    cr_expect_eq(rc, 2, "--timeout 0 is a usage error: %s", out);
    free(out);
}

Test(remote, a_remote_checkpoint_without_manifest_is_never_used)
{
    char *out = NULL;
    cr_assert_eq(run("nomf", "--set train.steps=10", &out), 0, "%s", out);
    free(out);
    /* a newer remote checkpoint whose upload never finished */
    store_opts o = {0};
    o.endpoint = tu_s3_endpoint();
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

/* Neither the secret nor the access key id ever reaches a file, a log, the
 * metrics, the saved config or a command line. The command lines checked are those of the run's own process
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
        if ((tu_contains(ps, secret) || tu_contains(ps, key)) && !leaked) {
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
    cr_expect(!leaked, "a credential (secret or key id) is on a command line: %s",
              seen ? seen : "");
    free(seen);
    char *hits = NULL;
    tu_sh(&hits, "grep -rlF -e '%s' -e '%s' %s/cred %s/cred.log || true", secret, key, dir, dir);
    cr_expect(hits && hits[0] == 0, "credentials found in: %s", hits);
    free(hits);
}

/* `spotune ckpt pull` downloads a remote checkpoint that verifies and holds
 * exactly the files the run pushed; a step that is not in the bucket is a
 * clear error (exit 3) that leaves nothing behind; an existing target
 * directory is refused and left as it was. */
Test(remote, ckpt_pull_downloads_what_was_pushed_and_refuses_a_missing_step)
{
    char *out = NULL;
    cr_assert_eq(run("pull", "--set train.steps=10", &out), 0, "%s", out);
    cr_assert(tu_contains(out, "checkpoint_uploaded: ") && tu_contains(out, "/step-00000010"),
              "%s", out);
    free(out);
    cr_assert_eq(tu_spotune(&out, "ckpt pull %s/step-00000010 %s/pulled --endpoint %s --path-style",
                            url, dir, tu_s3_endpoint()),
                 0, "%s", out);
    cr_expect(tu_contains(out, "verified"), "%s", out);
    free(out);
    cr_assert_eq(tu_spotune(&out, "ckpt verify %s/pulled", dir), 0, "%s", out);
    cr_expect(tu_contains(out, ": ok (step 10"), "%s", out);
    free(out);
    /* byte for byte what the run pushed: its own local copy, file by file */
    cr_expect_eq(tu_sh(&out, "diff -r %s/pull/checkpoints/step-00000010 %s/pulled", dir, dir), 0,
                 "the pulled checkpoint differs from the pushed one: %s", out);
    free(out);
    cr_expect_eq(tu_sh(NULL, "test -s %s/pulled/MANIFEST.json && test -s %s/pulled/state.h5", dir,
                       dir),
                 0, "the pulled checkpoint lacks its MANIFEST or state");

    int rc = tu_spotune(&out, "ckpt pull %s/step-00000099 %s/missing --endpoint %s --path-style",
                        url, dir, tu_s3_endpoint());
    cr_expect_eq(rc, 3, "a missing checkpoint is an input error (exit 3): %d %s", rc, out);
    cr_expect(tu_contains(out, "error") && tu_contains(out, "step-00000099"), "%s", out);
    free(out);
    cr_expect_eq(tu_sh(NULL, "test -e %s/missing", dir), 1, "a failed pull left %s/missing", dir);
    cr_expect_eq(tu_sh(NULL, "ls -a %s | grep -q spotune-tmp", dir), 1,
                 "a failed pull left a temporary directory in %s", dir);

    /* the target exists: refused, and the pulled checkpoint is untouched */
    rc = tu_spotune(&out, "ckpt pull %s/step-00000005 %s/pulled --endpoint %s --path-style", url,
                    dir, tu_s3_endpoint());
    cr_expect_neq(rc, 0, "pulled over an existing directory: %s", out);
    cr_expect(tu_contains(out, "already exists"), "%s", out);
    free(out);
    cr_expect_eq(tu_sh(NULL, "diff -r %s/pull/checkpoints/step-00000010 %s/pulled", dir, dir), 0);
}

/* A remote checkpoint that has its MANIFEST but whose data does not match it
 * (different bytes of the same size: the checksum; a shorter file: the size)
 * is reported and skipped; a fresh machine resumes from the newest one that
 * verifies and ends where an uninterrupted run ends, bit for bit. */
Test(remote, a_remote_checkpoint_failing_its_checksum_or_size_is_never_resumed)
{
    char *out = NULL;
    cr_assert_eq(run("corr", "--set train.steps=15 --set checkpoint.keep=3", &out), 0, "%s", out);
    free(out);
    cr_assert_eq(tu_sh(&out, "cp %s/corr/adapter/adapter_model.safetensors %s/uninterrupted.st",
                       dir, dir),
                 0, "%s", out);
    free(out);
    const char *steps[] = {"step-00000005", "step-00000010", "step-00000015"};
    for (int i = 0; i < 3; i++) {
        char key[128];
        snprintf(key, sizeof key, "%s/MANIFEST.json", steps[i]);
        cr_assert(remote_has(key), "%s is not complete in the bucket", steps[i]);
    }
    /* after the run: overwrite the data of the two newest through the store */
    store_t *st = open_store();
    sp_err err = {0};
    void *data = NULL;
    size_t n = 0;
    cr_assert_eq(store_get_bytes(st, "step-00000015/state.h5", &data, &n, &err), 0, "%s", err.msg);
    cr_assert_gt(n, 4096);
    ((unsigned char *)data)[n / 2] ^= 0x5a; /* same size, other bytes */
    ((unsigned char *)data)[n - 1] ^= 0xa5;
    cr_assert_eq(store_put_bytes(st, "step-00000015/state.h5", data, n, 0, &err), 0, "%s", err.msg);
    free(data);
    cr_assert_eq(store_get_bytes(st, "step-00000010/state.h5", &data, &n, &err), 0, "%s", err.msg);
    cr_assert_eq(store_put_bytes(st, "step-00000010/state.h5", data, n - 1000, 0, &err), 0, "%s",
                 err.msg); /* shorter */
    free(data);
    store_close(st);
    /* ckpt pull verifies too */
    int rc = tu_spotune(&out, "ckpt pull %s/step-00000015 %s/pulled15 --endpoint %s --path-style",
                        url, dir, tu_s3_endpoint());
    cr_expect_eq(rc, 3, "pulled a checkpoint that fails its checksum: %d %s", rc, out);
    cr_expect(tu_contains(out, "fails its SHA-256 checksum"), "%s", out);
    free(out);
    char pulled[4096];
    snprintf(pulled, sizeof pulled, "%s/pulled15", dir);
    cr_expect_neq(access(pulled, F_OK), 0, "a pull that fails verification leaves %s", pulled);

    tu_sh(NULL, "rm -rf %s/corr", dir); /* a new machine */
    cr_assert_eq(run("corr", "--set train.steps=15 --set checkpoint.keep=3", &out), 0, "%s", out);
    cr_expect(tu_contains(out, "skipping remote checkpoint step-00000015") &&
                  tu_contains(out, "fails its SHA-256 checksum"),
              "the corrupted step 15 is reported: %s", out);
    cr_expect(tu_contains(out, "skipping remote checkpoint step-00000010") &&
                  tu_contains(out, "MANIFEST.json says"),
              "the truncated step 10 is reported: %s", out);
    cr_expect(tu_contains(out, "resumed from") && tu_contains(out, "/step-00000005: step 5"),
              "resumed from the newest checkpoint that verifies: %s", out);
    cr_expect(tu_contains(out, "done: 15 steps"), "%s", out);
    cr_expect(tu_contains(out, "removed the MANIFEST of") && tu_contains(out, "step-00000015"),
              "the corrupt remote checkpoints are retired: %s", out);
    free(out);
    cr_expect_eq(tu_sh(NULL, "cmp %s/uninterrupted.st %s/corr/adapter/adapter_model.safetensors",
                       dir, dir),
                 0, "the adapter after resuming from step 5 differs from the uninterrupted run's");
    /* the resumed run pushed steps 10 and 15 again: the bucket has good copies */
    for (int i = 1; i < 3; i++) {
        char *v = NULL;
        int vrc = tu_spotune(&v, "ckpt verify %s/%s --endpoint %s --path-style", url, steps[i],
                             tu_s3_endpoint());
        cr_expect_eq(vrc, 0, "%s in the bucket after the re-push: %s", steps[i], v);
        cr_expect(tu_contains(v, ": ok"), "%s", v);
        free(v);
    }
}

/* The store hangs (its proxy SIGSTOPped: connections accepted, nothing
 * answered) in the middle of a run: training does not wait for it, the step
 * lines say the remote is behind, and once the store answers again the
 * backlog is pushed and the final checkpoint is in the bucket. */
Test(remote, training_goes_on_while_the_store_hangs)
{
    char log[4096], *text = NULL;
    snprintf(log, sizeof log, "%s/hang.log", dir);
    int pid = tu_spawn(log, "%s",
                       cmd("hang", "--set train.steps=300 --set checkpoint.every_steps=10"));
    /* the store works: a first checkpoint reaches it */
    int up = wait_log(log, "checkpoint_uploaded: ", pid, 300);
    text = tu_read_file(log, NULL);
    cr_assert(up, "no checkpoint reached the store before it was stopped: %s", text);
    free(text);
    cr_assert(running(pid), "the run ended before the store was stopped");

    tu_proxy_freeze(300);
    double t_stop = sp_wall_time();
    int s0 = last_step("hang");
    cr_assert_leq(s0, 270, "the run is too fast for this test: step %d of 300 already", s0);
    /* 30 steps (three checkpoints taken while the store hangs), and 3 s: a
     * store that answered would have taken some of them by then */
    int reached = wait_step("hang", s0 + 30, pid, 300);
    while (reached && running(pid) && sp_wall_time() - t_stop < 3.0)
        tu_sleep(0.02);
    double t_cont = sp_wall_time();
    tu_proxy_thaw();
    int s1 = last_step("hang");
    int rc = tu_wait(pid, 600);
    text = tu_read_file(log, NULL);
    cr_assert(reached, "training stalled with the store hung: step %d -> %d: %s", s0, s1, text);
    cr_assert_eq(rc, 0, "%s", text);

    /* the records written while the store hung */
    char mpath[4096];
    snprintf(mpath, sizeof mpath, "%s/hang/metrics.jsonl", dir);
    char *m = tu_read_file(mpath, NULL);
    cr_assert(m);
    int during = 0, last = 0, last_behind = -1, uploads = 0;
    for (char *p = strstr(m, "{\"event\":"); p; p = strstr(p + 1, "{\"event\":")) {
        char *t = strstr(p, "\"time\":"), *eol = strchr(p, '\n');
        cr_assert(t && (!eol || t < eol), "a record without its time: %.200s", p);
        double when = strtod(t + SP_LEN("\"time\":"), NULL);
        if (sp_after(p, "{\"event\":\"checkpoint_uploaded\"") && when > t_stop + 1.0 &&
            when < t_cont)
            uploads++; /* (an answer already on its way when the proxy stopped: 1 s) */
        if (!sp_after(p, "{\"event\":\"train\",\"step\":") || when < t_stop || when > t_cont)
            continue;
        char *b = strstr(p, "\"remote_behind\":");
        cr_assert(b && b < t, "a train record without remote_behind: %.200s", p);
        during++;
        last = atoi(p + SP_LEN("{\"event\":\"train\",\"step\":"));
        last_behind = atoi(b + SP_LEN("\"remote_behind\":"));
    }
    free(m);
    cr_expect_eq(uploads, 0, "%d checkpoint(s) reached a store that was stopped", uploads);
    cr_expect_geq(during, 25, "only %d steps were logged while the store hung (%d -> %d)", during,
                  s0, s1);
    /* three checkpoints went to a store that answers nothing: 2 or more are pending */
    cr_expect_geq(last_behind, 2, "step %d, the last while the store hung, says the remote is "
                  "behind by %d", last, last_behind);
    char line[64];
    snprintf(line, sizeof line, "step %6d/300 |", last);
    const char *l = strstr(text, line), *r = l ? strstr(l, "| remote behind ") : NULL;
    const char *nl = l ? strchr(l, '\n') : NULL;
    cr_expect(r && (!nl || r < nl) && atoi(r + SP_LEN("| remote behind ")) == last_behind,
              "the log line of step %d does not say the remote is %d behind: %s", last,
              last_behind, text);

    /* after the store came back: the backlog went up, the final checkpoint last */
    char done[1024];
    snprintf(done, sizeof done, "checkpoint_uploaded: %s/step-00000300", url);
    cr_expect(tu_contains(text, done), "the final checkpoint was not pushed: %s", text);
    cr_expect(remote_has("step-00000300/MANIFEST.json"), "step 300 is not complete in the bucket");
    cr_expect(!tu_contains(text, "checkpoint(s) behind; the local checkpoints"),
              "the run gave up on the backlog: %s", text);
    free(text);
}

/* A preemption while the store hangs: the stop checkpoint is committed
 * locally, the upload waits checkpoint.upload_deadline_s (3 s) and no more,
 * the run exits 75 saying the checkpoint is complete locally but not in the
 * bucket, and the local checkpoint verifies. */
Test(remote, upload_deadline_runs_out_on_preemption_while_the_store_hangs)
{
    char log[4096], *text = NULL;
    const double deadline = 3.0;
    snprintf(log, sizeof log, "%s/dl.log", dir);
    int pid = tu_spawn(log, "%s",
                       cmd("dl", "--set train.steps=400 --set checkpoint.upload_deadline_s=3"));
    int up = wait_log(log, "checkpoint_uploaded: ", pid, 300);
    text = tu_read_file(log, NULL);
    cr_assert(up, "no checkpoint reached the store before it was stopped: %s", text);
    free(text);
    tu_proxy_freeze(300);
    int s0 = last_step("dl");
    int reached = wait_step("dl", s0 + 3, pid, 300);
    double t0 = sp_now();
    kill(pid, SIGTERM);
    int rc = tu_wait(pid, deadline + 120);
    double took = sp_now() - t0;
    tu_proxy_thaw();
    text = tu_read_file(log, NULL);
    cr_assert(reached, "training stalled with the store hung: %s", text);
    cr_assert_eq(rc, 75, "exit %d after SIGTERM (%.1f s): %s", rc, took, text);
    /* the deadline is the point: it waits that long (not less), then goes */
    cr_expect_geq(took, deadline - 0.05, "exited %.2f s after SIGTERM, before the %.0f s deadline",
                  took, deadline);
    cr_expect_lt(took, deadline + 60, "exited %.1f s after SIGTERM", took);
    const char *p = strstr(text, "warning: checkpoint step ");
    cr_assert(p && tu_contains(p, "is not yet in s3://") &&
                  tu_contains(p, "after 3 s; it is complete locally"),
              "%s", text);
    long long step = atoll(p + strlen("warning: checkpoint step "));
    cr_assert_gt(step, s0, "%s", text);
    char name[64];
    snprintf(name, sizeof name, "step-%08lld", step);
    char *v = NULL;
    cr_expect_eq(tu_spotune(&v, "ckpt verify %s/dl/checkpoints/%s", dir, name), 0, "%s", v);
    cr_expect(tu_contains(v, ": ok"), "%s", v);
    free(v);
    char key[128];
    snprintf(key, sizeof key, "%s/MANIFEST.json", name);
    cr_expect(!remote_has(key), "%s is complete in the bucket, yet the run said it was not", name);
    free(text);
}

/* With checkpoint.endpoint empty the endpoint comes from the environment:
 * AWS_ENDPOINT_URL, or AWS_ENDPOINT_URL_S3 ahead of it. */
Test(remote, endpoint_from_aws_endpoint_url)
{
    char *out = NULL;
    cr_assert_eq(tu_sh(&out, "env -u AWS_ENDPOINT_URL_S3 AWS_ENDPOINT_URL=%s %s", tu_s3_endpoint(),
                       cmd("envep", "--set checkpoint.endpoint= --set train.steps=10")),
                 0, "%s", out);
    char done[1024];
    snprintf(done, sizeof done, "checkpoint_uploaded: %s/step-00000010", url);
    cr_expect(tu_contains(out, done), "%s", out);
    free(out);
    /* the run really had no endpoint of its own */
    char cpath[4096];
    snprintf(cpath, sizeof cpath, "%s/envep/config.yaml", dir);
    char *conf = tu_read_file(cpath, NULL);
    cr_assert(conf, "no %s", cpath);
    cr_expect(!tu_contains(conf, tu_s3_endpoint()), "the resolved config names the endpoint: %s",
              conf);
    free(conf);
    cr_expect(remote_has("step-00000010/MANIFEST.json"), "step 10 is not in the bucket");

    cr_expect_eq(tu_sh(&out, "env -u AWS_ENDPOINT_URL_S3 AWS_ENDPOINT_URL=%s %s/spotune ckpt list %s",
                       tu_s3_endpoint(), SPOTUNE_BINARY_DIR, url),
                 0, "%s", out);
    cr_expect(tu_contains(out, "step-00000010") && tu_contains(out, "complete"), "%s", out);
    free(out);
    /* AWS_ENDPOINT_URL_S3 wins over AWS_ENDPOINT_URL (nothing listens on port 9) */
    cr_expect_eq(tu_sh(&out, "env AWS_ENDPOINT_URL_S3=%s AWS_ENDPOINT_URL=http://127.0.0.1:9 "
                             "%s/spotune ckpt list %s",
                       tu_s3_endpoint(), SPOTUNE_BINARY_DIR, url),
                 0, "%s", out);
    cr_expect(tu_contains(out, "step-00000010") && tu_contains(out, "complete"), "%s", out);
    free(out);
}
