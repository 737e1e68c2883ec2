/* Checkpoints of runs on several ranks in the local S3 server, through
 * mpirun and the spotune binary: a 2-rank LoRA run and a sharded full
 * fine-tune stopped and resumed from the bucket on a fresh machine (the
 * shards read in ranges, never pulled whole) to the bit-identical result; a
 * damaged shard in the bucket found by its block checksum, or a state.h5
 * whose contents are refused, that checkpoint retired and the previous one
 * used. */
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

/* Two ranks under mpirun: SIGUSR1 to mpirun (forwarded to every rank), the
 * run directory lost, two ranks again on a fresh machine: the run resumes
 * from the bucket and ends bit-identical to an uninterrupted 2-rank run. */
Test(remote, two_ranks_resume_from_the_bucket_on_a_fresh_machine)
{
    char *out = NULL;
    cr_assert_eq(tu_sh(&out, "%s %s", tu_mpirun(2), cmd("whole2", "--set checkpoint.remote=")), 0,
                 "%s", out);
    free(out);
    char log[4096];
    snprintf(log, sizeof log, "%s/spot2.log", dir);
    int pid = tu_spawn(log, "%s %s", tu_mpirun(2), cmd("spot2", NULL));
    int reached = wait_step("spot2", 12, pid, 300);
    kill(pid, SIGUSR1);
    int rc = tu_wait(pid, 300);
    char *text = tu_read_file(log, NULL);
    cr_assert(reached, "the run never reached step 12: %s", text);
    cr_assert_eq(rc, 75, "%s", text);
    cr_assert(tu_contains(text, "is in s3://"), "the checkpoint did not reach the bucket: %s", text);
    cr_assert(tu_contains(text, "SIGUSR1"), "%s", text);
    free(text);
    int stopped = last_step("spot2");
    cr_assert_lt(stopped, 40, "the run was not cut short");
    tu_sh(NULL, "rm -rf %s/spot2", dir); /* a new machine */
    cr_assert_eq(tu_sh(&out, "%s %s", tu_mpirun(2), cmd("spot2", NULL)), 0, "%s", out);
    cr_expect(tu_contains(out, "downloading s3://") && tu_contains(out, "resumed from"), "%s", out);
    cr_expect(!tu_contains(out, "train.grad_accum is now"), "same ranks, same batch: %s", out);
    free(out);
    char mpath[4096];
    snprintf(mpath, sizeof mpath, "%s/spot2/metrics.jsonl", dir);
    char *m = tu_read_file(mpath, NULL);
    int lines = 0;
    for (char *p = m ? strstr(m, "\"event\":\"train\"") : NULL; p;
         p = strstr(p + 1, "\"event\":\"train\""))
        lines++;
    free(m);
    cr_expect_eq(lines, 40, "metrics.jsonl holds %d train records after the resume", lines);
    cr_expect_eq(tu_sh(NULL, "cmp %s/whole2/adapter/adapter_model.safetensors "
                             "%s/spot2/adapter/adapter_model.safetensors",
                       dir, dir),
                 0, "the 2-rank adapter after a resume from the bucket differs");
}

/* Full fine-tuning on 2 ranks, the optimizer sharded: the stop checkpoint is
 * sharded, each rank putting its own shard in the bucket and rank 0 the
 * MANIFEST after both (the preemption record counts each rank's bytes); on
 * a new machine the run resumes from the bucket on 2 ranks to the
 * bit-identical final model, and `ckpt verify` on the bucket's copy says it
 * is sharded. */
Test(remote, sharded_full_run_resumes_from_the_bucket_on_a_fresh_machine)
{
    const char *full = "--set train.mode=full --set checkpoint.every_steps=0";
    char *out = NULL;
    cr_assert_eq(tu_sh(&out, "%s %s %s", tu_mpirun(2),
                       cmd("wholef", "--set checkpoint.remote="), full),
                 0, "%s", out);
    free(out);
    char log[4096];
    snprintf(log, sizeof log, "%s/spotf.log", dir);
    int pid = tu_spawn(log, "%s %s %s", tu_mpirun(2), cmd("spotf", NULL), full);
    int reached = wait_step("spotf", 12, pid, 300);
    kill(pid, SIGUSR1);
    int rc = tu_wait(pid, 300);
    char *text = tu_read_file(log, NULL);
    cr_assert(reached, "the run never reached step 12: %s", text);
    cr_assert_eq(rc, 75, "%s", text);
    cr_assert(tu_contains(text, "is in s3://") && tu_contains(text, "every rank its shard"),
              "the sharded checkpoint did not reach the bucket: %s", text);
    free(text);
    int stopped = last_step("spotf");
    char mpath[4096];
    snprintf(mpath, sizeof mpath, "%s/spotf/metrics.jsonl", dir);
    char *m = tu_read_file(mpath, NULL);
    const char *pre = m ? strstr(m, "\"event\":\"preemption\"") : NULL;
    const char *per = pre ? strstr(pre, "\"bytes_per_rank\":[") : NULL;
    long long b0 = 0, b1 = 0;
    cr_assert(per && sscanf(per, "\"bytes_per_rank\":[%lld,%lld]", &b0, &b1) == 2,
              "no per-rank bytes: %s", pre ? pre : "no preemption record");
    cr_expect(b1 > 1000000 && b0 > b1, "rank 0 wrote %lld bytes, rank 1 %lld", b0, b1);
    free(m);
    char *v = NULL;
    cr_expect_eq(tu_spotune(&v, "ckpt verify %s/step-%08d --endpoint %s --path-style", url, stopped,
                            tu_s3_endpoint()),
                 0, "%s", v);
    cr_expect(tu_contains(v, "4 file(s) verified") && tu_contains(v, "sharded"), "%s", v);
    free(v);
    tu_sh(NULL, "rm -rf %s/spotf", dir); /* a new machine */
    cr_assert_eq(tu_sh(&out, "%s %s %s", tu_mpirun(2), cmd("spotf", NULL), full), 0, "%s", out);
    cr_expect(tu_contains(out, "downloading s3://") && tu_contains(out, "resumed from") &&
                  tu_contains(out, "every rank reads the ranges it keeps from the store"),
              "%s", out);
    free(out);
    /* the shards were read from the bucket, never pulled to this machine */
    cr_expect_neq(access(tu_fmt("%s/spotf/checkpoints/step-%08d", dir, stopped), F_OK), 0,
                  "step %d was pulled whole", stopped);
    cr_expect_neq(access(tu_fmt("%s/spotf/checkpoints/.remote-step-%08d", dir, stopped), F_OK), 0,
                  "the partial copy of step %d is left behind", stopped);
    cr_expect_eq(tu_sh(NULL, "cmp %s/wholef/model/model.safetensors %s/spotf/model/model.safetensors",
                       dir, dir),
                 0, "the model after a resume of the sharded checkpoint from the bucket differs");
    /* finished, pushed, and then the machine is lost anyway (a supervisor
     * restarts the job): the restart resumes from the final step's sharded
     * checkpoint in the bucket, trains nothing, and ends 0 with the model */
    tu_sh(NULL, "rm -rf %s/spotf", dir);
    cr_assert_eq(tu_sh(&out, "%s %s %s", tu_mpirun(2), cmd("spotf", NULL), full), 0,
                 "a restart after the final step failed: %s", out);
    cr_expect(tu_contains(out, "resumed from s3://") && tu_contains(out, "step 40,"), "%s", out);
    free(out);
    cr_expect_eq(tu_sh(NULL, "cmp %s/wholef/model/model.safetensors %s/spotf/model/model.safetensors",
                       dir, dir),
                 0, "the model exported by the restart after the final step differs");
}

/* A byte changed in a shard in the bucket (its size kept): the ranks reading
 * their ranges find the block that fails its SHA-256, the run says which file
 * and block, retires that checkpoint's MANIFEST, resumes from the previous
 * one and trains to the bit-identical model; the step is pushed again. On
 * one rank, the 2-shard checkpoint read in ranges across both files gives
 * the same model; with its state.h5 damaged before its checksum, the run
 * falls back to step 10 the same way. */
Test(remote, a_damaged_shard_in_the_bucket_falls_back_to_the_previous_checkpoint)
{
    const char *full = "--set train.mode=full --set train.steps=15 --set checkpoint.keep=3";
    char *out = NULL;
    cr_assert_eq(tu_sh(&out, "%s %s %s", tu_mpirun(2), cmd("dmg", NULL), full), 0, "%s", out);
    free(out);
    cr_assert_eq(tu_sh(NULL, "cp %s/dmg/model/model.safetensors %s/whole.st", dir, dir), 0);
    cr_assert(remote_has("step-00000010/MANIFEST.json") &&
              remote_has("step-00000015/shard-00001-of-00002.h5"));
    store_t *st = open_store();
    sp_err err = {0};
    void *data = NULL;
    size_t n = 0;
    const char *key = "step-00000015/shard-00001-of-00002.h5";
    cr_assert_eq(store_get_bytes(st, key, &data, &n, &err), 0, "%s", err.msg);
    cr_assert_gt(n, 65536);
    ((unsigned char *)data)[n - 64] ^= 0x40; /* in adam_v, the last dataset */
    cr_assert_eq(store_put_bytes(st, key, data, n, 0, &err), 0, "%s", err.msg);
    free(data);
    store_close(st);

    tu_sh(NULL, "rm -rf %s/dmg", dir); /* a new machine */
    cr_assert_eq(tu_sh(&out, "%s %s %s", tu_mpirun(2), cmd("dmg", NULL), full), 0, "%s", out);
    cr_expect(tu_contains(out, "shard-00001-of-00002.h5") && tu_contains(out, "(block 0)") &&
                  tu_contains(out, "do not match their SHA-256"),
              "the damaged block is not named: %s", out);
    cr_expect(tu_contains(out, "skipping remote checkpoint step-00000015") &&
                  tu_contains(out, "its MANIFEST was removed from the store"),
              "%s", out);
    cr_expect(tu_contains(out, "resumed from") && tu_contains(out, "step 10, sample"), "%s", out);
    cr_expect(tu_contains(out, "done: 15 steps"), "%s", out);
    free(out);
    cr_expect_eq(tu_sh(NULL, "cmp %s/whole.st %s/dmg/model/model.safetensors", dir, dir), 0,
                 "the model after falling back to step 10 differs from the uninterrupted run's");
    char *v = NULL;
    cr_expect_eq(tu_spotune(&v, "ckpt verify %s/step-00000015 --endpoint %s --path-style", url,
                            tu_s3_endpoint()),
                 0, "step 15 was not pushed again: %s", v);
    free(v);

    tu_sh(NULL, "rm -rf %s/dmg", dir);
    cr_assert_eq(run("dmg", full, &out), 0, "%s", out);
    cr_expect(tu_contains(out, "step 15, sample") &&
                  tu_contains(out, "every rank reads the ranges it keeps from the store"),
              "%s", out);
    free(out);
    cr_expect_eq(tu_sh(NULL, "cmp %s/whole.st %s/dmg/model/model.safetensors", dir, dir), 0,
                 "one rank reading the 2-shard checkpoint from the bucket gives another model");

    /* step 15's state.h5 damaged before its checksum (global_batch 0, the
     * MANIFEST matching): its contents are refused before any shard is read,
     * its MANIFEST retired, and the run resumes from step 10 */
    char *ck = sp_strf("%s/ck15", dir);
    cr_assert(ck && tu_sh(NULL, "mkdir -p %s", ck) == 0);
    st = open_store();
    const char *names[2] = {"state.h5", "MANIFEST.json"};
    for (int i = 0; i < 2; i++)
        cr_assert_eq(store_get_file(st, tu_fmt("step-00000015/%s", names[i]),
                                    tu_fmt("%s/%s", ck, names[i]), &err),
                     0, "%s", err.msg);
    cr_assert_eq(tu_sh(&out, "%s/.venv/bin/python -c \"import h5py, sys; "
                             "h = h5py.File(sys.argv[1], 'r+'); "
                             "h.attrs['global_batch'] = h.attrs['global_batch'] * 0; "
                             "h.close()\" %s/state.h5",
                       SPOTUNE_SOURCE_DIR, ck),
                 0, "%s", out);
    free(out);
    cr_assert_eq(tu_remanifest(ck), 0);
    for (int i = 0; i < 2; i++)
        cr_assert_eq(store_put_file(st, tu_fmt("step-00000015/%s", names[i]),
                                    tu_fmt("%s/%s", ck, names[i]), 0, &err),
                     0, "%s", err.msg);
    store_close(st);
    free(ck);
    tu_sh(NULL, "rm -rf %s/dmg", dir);
    cr_assert_eq(run("dmg", full, &out), 0, "%s", out);
    cr_expect(tu_contains(out, "skipping checkpoint step-00000015") &&
                  tu_contains(out, "global_batch") &&
                  tu_contains(out, "its MANIFEST was removed from s3://"),
              "%s", out);
    cr_expect(tu_contains(out, "step 10, sample") && tu_contains(out, "done: 15 steps"), "%s",
              out);
    free(out);
    cr_expect_eq(tu_spotune(&v, "ckpt verify %s/step-00000015 --endpoint %s --path-style", url,
                            tu_s3_endpoint()),
                 0, "step 15 was not pushed again: %s", v);
    free(v);
}
