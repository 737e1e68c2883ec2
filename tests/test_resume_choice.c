/* Which checkpoint a restart takes, and what it refuses, through the
 * spotune binary: a damaged newest checkpoint is skipped with a message; one
 * whose contents are refused (damaged before its checksum) is set aside
 * under --resume auto; a store that could not be listed at the start and
 * holds a newer checkpoint stops the job so that the restart takes it; the
 * data identity decides whether data.train at another path is the same
 * data; changed math is refused and a changed step count is allowed.
 * Preemption itself: test_resume.c (the same fixture, resume_util). */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/ckpt.h"
#include "resume_util.h"
#include "test_util.h"
#include "trainer/data.h"

TestSuite(resume, .init = resume_setup, .fini = resume_teardown, .timeout = 900);

Test(resume, damaged_newest_checkpoint_is_skipped_with_a_message)
{
    char *out = NULL;
    cr_assert_eq(run(NULL, "dmg", "--set checkpoint.every_steps=5 --set train.steps=10", &out), 0,
                 "%s", out);
    free(out);
    tu_sh(NULL, "printf 'Z' | dd of=%s/dmg/checkpoints/step-00000010/state.h5 bs=1 seek=4000 "
                "conv=notrunc 2>/dev/null",
          dir);
    cr_assert_eq(run(NULL, "dmg", "--set checkpoint.every_steps=5 --set train.steps=12", &out), 0,
                 "%s", out);
    cr_expect(tu_contains(out, "skipping checkpoint step-00000010") &&
                  tu_contains(out, "fails its SHA-256 checksum"),
              "%s", out);
    cr_expect(tu_contains(out, "resumed from") && tu_contains(out, "step-00000005"), "%s", out);
    free(out);
    /* every checkpoint damaged: each named, and the start from step 0 said
     * once (it used to follow the per-checkpoint warnings without a word) */
    tu_sh(NULL, "for s in %s/dmg/checkpoints/step-*; do printf 'Z' | dd of=$s/state.h5 bs=1 "
                "seek=4000 conv=notrunc 2>/dev/null; done",
          dir);
    cr_assert_eq(run(NULL, "dmg", "--set checkpoint.every_steps=5 --set train.steps=2", &out), 0,
                 "%s", out);
    cr_expect(!tu_contains(out, "resumed from") &&
                  tu_contains(out, "can be resumed (each named above): the run starts again "
                                   "from step 0") &&
                  tu_contains(out, "unusable checkpoints moved to"),
              "%s", out);
    free(out);
    /* ... and they moved aside (kept, outside checkpoints/), so retention
     * keeps the new run's checkpoint, which the next start resumes; left in
     * place (checkpoint.keep 2) they outranked it and it was deleted at once */
    char *ls = NULL;
    cr_expect_eq(tu_sh(&ls, "ls %s/dmg/previous-*/checkpoints/ | grep -c step-", dir), 0);
    cr_expect(ls && atoi(ls) >= 2, "moved aside: %s", ls ? ls : "");
    free(ls);
    cr_assert_eq(run(NULL, "dmg", "--set checkpoint.every_steps=5 --set train.steps=3", &out), 0,
                 "%s", out);
    cr_expect(tu_contains(out, "resumed from") && tu_contains(out, "step-00000002"), "%s", out);
    free(out);
}

/* Sets the first second moment of checkpoint ck's state.h5 negative (h5py)
 * and rewrites its MANIFEST to match: damage from before the checksum, which
 * only the checks of what a checkpoint holds see. */
static void negative_moment(const char *ck)
{
    const char *script = tu_fmt("%s/negative_moment.py", dir);
    cr_assert_eq(tu_write_file(script, "import h5py, sys\n"
                                       "h = h5py.File(sys.argv[1] + '/state.h5', 'r+')\n"
                                       "d = h['adam_v'][sorted(h['adam_v'])[0]]\n"
                                       "d[(0,) * d.ndim] = -1.0\n"
                                       "h.close()\n"),
                 0);
    char *out = NULL;
    cr_assert_eq(tu_sh(&out, "%s/.venv/bin/python %s %s", SPOTUNE_SOURCE_DIR, script, ck), 0,
                 "%s: %s", ck, out);
    free(out);
    cr_assert_eq(tu_remanifest(ck), 0);
}

/* A checkpoint damaged before its checksum was taken (it matches its
 * MANIFEST; its contents are refused) is, under --resume auto, passed over
 * like one that fails its checksums: the local one moved aside, the store's
 * MANIFEST removed, and the newest older checkpoint resumed, to the
 * bit-identical end of the uninterrupted run, which pushes that step again.
 * It used to stop every restart with exit 3 until someone removed it by
 * hand. When every checkpoint is refused the run starts from step 0, saying
 * so. (Named by --resume PATH such a checkpoint is refused with exit 3:
 * test_ckpt_contents.) */
Test(resume, a_checkpoint_refused_for_its_contents_is_set_aside_under_auto)
{
    char extra[4200];
    snprintf(extra, sizeof extra,
             "--set checkpoint.every_steps=10 --set checkpoint.remote=file://%s/cd-bucket", dir);
    char *out = NULL;
    cr_assert_eq(run(NULL, "cd", extra, &out), 0, "%s", out);
    free(out);
    cr_assert_eq(tu_sh(NULL, "cp -r %s/cd %s/cd-ref", dir, dir), 0);
    /* step 40 damaged before its checksum, here and (the same bytes) in the store */
    const char *local40 = tu_fmt("%s/cd/checkpoints/step-00000040", dir);
    negative_moment(local40);
    cr_assert_eq(tu_sh(NULL, "cp %s/cd/checkpoints/step-00000040/state.h5 "
                             "%s/cd/checkpoints/step-00000040/MANIFEST.json "
                             "%s/cd-bucket/step-00000040/",
                       dir, dir, dir),
                 0);
    cr_assert_eq(run(NULL, "cd", extra, &out), 0, "%s", out);
    cr_expect(tu_contains(out, "skipping checkpoint step-00000040") &&
                  tu_contains(out, "holds a negative second moment") &&
                  tu_contains(out, "(kept for inspection)") &&
                  tu_contains(out, "its MANIFEST was removed from file://"),
              "%s", out);
    cr_expect(tu_contains(out, "resumed from") && tu_contains(out, "step-00000030"), "%s", out);
    free(out);
    expect_same_run("cd", "cd-ref", 1);
    cr_expect_eq(tu_sh(NULL, "ls -d %s/cd/previous-*/checkpoints/step-00000040", dir), 0,
                 "the local one was not moved aside");
    cr_expect_eq(tu_spotune(&out, "ckpt verify %s/cd-bucket/step-00000040", dir), 0,
                 "the store did not get step 40 again: %s", out);
    free(out);
    cr_expect_eq(tu_spotune(&out, "ckpt verify %s", local40), 0, "%s", out);
    free(out);

    /* every checkpoint refused (a new machine: only the store's) */
    for (int step = 30; step <= 40; step += 10)
        negative_moment(tu_fmt("%s/cd-bucket/step-%08d", dir, step));
    cr_assert_eq(run(NULL, "cd-new", tu_fmt("%s --set train.steps=2", extra), &out), 0, "%s",
                 out);
    cr_expect(tu_contains(out, "skipping checkpoint step-00000040") &&
                  tu_contains(out, "skipping checkpoint step-00000030") &&
                  tu_contains(out, "none of the 2 checkpoints in") &&
                  tu_contains(out, "the run starts again from step 0") &&
                  !tu_contains(out, "resumed from"),
              "%s", out);
    free(out);
    cr_expect_eq(last_step("cd-new"), 2);
}

/* A job on a new machine whose start could not list checkpoint.remote
 * (here a directory under step-* nested past PATH_MAX: listing fails, the
 * lease and the puts work) starts from step 0, as a start with the store
 * down does. It lists the store again at its step boundaries (10 s after a
 * failed try) and, once it can, finds there a checkpoint newer than its own
 * step: it commits a checkpoint and stops with exit 75, so that the restart
 * resumes the newer one rather than this job train on from step 0. */
Test(resume, a_newer_checkpoint_in_a_store_that_could_not_be_listed_stops_the_job)
{
    char bucket[4200], extra[4400];
    snprintf(bucket, sizeof bucket, "%s/nw-bucket", dir);
    snprintf(extra, sizeof extra,
             "--set checkpoint.every_steps=5 --set checkpoint.remote=file://%s", bucket);
    char *out = NULL;
    cr_assert_eq(run(NULL, "nw-old", extra, &out), 0, "%s", out);
    free(out);
    cr_assert_eq(tu_sh(NULL, "test -f %s/step-00000040/MANIFEST.json", bucket), 0);
    cr_assert_eq(tu_sh(NULL, "mkdir %s/step-blocker && cd %s/step-blocker && "
                             "n=$(printf 'd%%0200d' 0) && for i in $(seq 30); do "
                             "mkdir $n && cd -P $n || exit 1; done",
                       bucket, bucket),
                 0);
    const char *log = tu_fmt("%s/nw-new.log", dir);
    int pid = tu_spawn(log, "%s",
                       train_cmd(NULL, "nw-new", tu_fmt("%s --set train.steps=100000", extra)));
    wait_step("nw-new", 3, pid);
    cr_assert_eq(kill(pid, SIGSTOP), 0);
    char *text = read_log("nw-new");
    cr_expect(tu_contains(text, "cannot list file://") &&
                  tu_contains(text, "File name too long") &&
                  tu_contains(text, "resuming from local checkpoints only"),
              "%s", text);
    free(text);
    cr_assert_eq(tu_sh(NULL, "rm -rf %s/step-blocker", bucket), 0);
    tu_sleep(10.5); /* past the next listing's time */
    cr_assert_eq(kill(pid, SIGCONT), 0);
    int rc = tu_wait(pid, 300);
    text = read_log("nw-new");
    cr_expect_eq(rc, 75, "%s", text);
    cr_expect(tu_contains(text, "holds checkpoint step 40, newer than this job's step") &&
                  tu_contains(text, "holds a newer checkpoint of this run (step 40)"),
              "%s", text);
    free(text);
    int stopped = last_step("nw-new");
    cr_expect_lt(stopped, 40, "the job trained to step %d", stopped);
    /* the restart resumes the store's step 40 */
    cr_assert_eq(run(NULL, "nw-new", tu_fmt("%s --set train.steps=42", extra), &out), 0, "%s",
                 out);
    cr_expect(tu_contains(out, "resumed from") && tu_contains(out, "step-00000040: step 40"),
              "%s", out);
    free(out);
}

/* path: a dataset of other contents than the tiny task's (6000 tokens, one
 * document, the tiny model's vocabulary) */
static void write_other_data(const char *path)
{
    enum { N = 6000 };
    uint32_t *tok = malloc(sizeof(uint32_t) * N);
    uint8_t *msk = malloc(N);
    for (int i = 0; i < N; i++)
        tok[i] = (uint32_t)(i * 7 % 250), msk[i] = 1;
    uint64_t off[2] = {0, N};
    sp_err err = {0};
    cr_assert_eq(dataset_write(path, tok, msk, N, off, 1, 258, 257, "other", &err), 0, "%s",
                 err.msg);
    free(tok), free(msk);
}

/* A checkpoint records its data.train's identity (dataset_identity: its
 * length, counts and sampled tokens, masks and offsets): the same path
 * holding other contents (a dataset prepared again into the same file) is
 * refused on resume (exit 2, naming the path and both identities), where it
 * used to train on other windows in another order without a word; the
 * original file back, the run resumes. */
Test(resume, the_same_data_path_with_other_contents_is_refused)
{
    char *out = NULL;
    cr_assert_eq(run(NULL, "dsw", "--set train.steps=4", &out), 0, "%s", out);
    free(out);
    const char *data = tu_fmt("%s/data.train.h5", dir);
    cr_assert_eq(tu_sh(NULL, "cp %s %s/data.keep.h5", data, dir), 0);
    write_other_data(data);
    int rc = run(NULL, "dsw", "--set train.steps=6", &out);
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "was trained on other data: data.train") &&
                  tu_contains(out, "data.train.h5 now holds other contents"),
              "%s", out);
    free(out);
    cr_assert_eq(tu_sh(NULL, "cp %s/data.keep.h5 %s", dir, data), 0);
    rc = run(NULL, "dsw", "--set train.steps=6", &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "resumed from") && tu_contains(out, "step 4"), "%s", out);
    free(out);
}

/* A new machine may mount the dataset at another path: data.train moved
 * (the old path gone) with the same contents resumes, saying so, and trains
 * the same steps bit for bit as a run that never stopped; other contents at
 * a new path are refused (exit 2) naming both paths and identities; and a
 * checkpoint without the data identity (written before it was recorded)
 * resumes only at its own path, the refusal saying why. It used to be
 * refused by the path in the config hash, whatever the file held. */
Test(resume, the_same_data_at_another_path_resumes)
{
    char *out = NULL;
    cr_assert_eq(run(NULL, "mvref", "--set train.steps=6", &out), 0, "%s", out);
    free(out);
    cr_assert_eq(run(NULL, "mv", "--set train.steps=4", &out), 0, "%s", out);
    free(out);
    const char *ck4 = tu_fmt("%s/mv/checkpoints/step-00000004", dir);
    cr_assert_eq(tu_sh(NULL, "cp -r %s %s/noid", ck4, dir), 0);
    cr_assert_eq(tu_sh(&out,
                       "%s/.venv/bin/python -c \"import h5py; h = h5py.File('%s/noid/state.h5', "
                       "'r+'); del h.attrs['data_identity']; h.close()\"",
                       SPOTUNE_SOURCE_DIR, dir),
                 0, "%s", out);
    free(out);
    cr_assert_eq(tu_remanifest(tu_fmt("%s/noid", dir)), 0);
    cr_assert_eq(tu_sh(NULL, "mkdir -p %s/mnt %s/other-mnt && mv %s/data.train.h5 %s/mnt/", dir,
                       dir, dir, dir),
                 0);
    write_other_data(tu_fmt("%s/other-mnt/data.train.h5", dir));

    /* other contents at a new path */
    int rc = run(NULL, "mv",
                 tu_fmt("--set train.steps=6 --set data.train=%s/other-mnt/data.train.h5", dir),
                 &out);
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "was trained on other data: data.train ") &&
                  tu_contains(out, "other-mnt/data.train.h5 holds other contents") &&
                  tu_contains(out, tu_fmt("at %s/data.train.h5)", dir)),
              "%s", out);
    free(out);
    /* a checkpoint without the identity, at a new path */
    rc = run(NULL, "noid-run",
             tu_fmt("--set train.steps=6 --set data.train=%s/mnt/data.train.h5 --resume %s/noid",
                    dir, dir),
             &out);
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "was trained with different settings: data.train (") &&
                  tu_contains(out, "records no identity of its data"),
              "%s", out);
    free(out);
    /* the same contents at the new path */
    rc = run(NULL, "mv", tu_fmt("--set train.steps=6 --set data.train=%s/mnt/data.train.h5", dir),
             &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "resumed from") && tu_contains(out, "step-00000004") &&
                  tu_contains(out, tu_fmt("data.train is now %s/mnt/data.train.h5 (the "
                                          "checkpoint's run read %s/data.train.h5): the same "
                                          "contents",
                                          dir, dir)),
              "%s", out);
    free(out);
    double a[16], b[16];
    int na = read_losses("mvref", a, 16), nb = read_losses("mv", b, 16);
    cr_assert_eq(na, 6, "mvref logged %d steps", na);
    cr_assert_eq(nb, 6, "mv logged %d steps", nb);
    for (int i = 0; i < 6; i++)
        cr_expect_eq(a[i], b[i], "step %d: %.17g vs %.17g", i + 1, a[i], b[i]);
}

Test(resume, changed_math_refused_changed_steps_allowed)
{
    char *out = NULL;
    cr_assert_eq(run(NULL, "chg", "--set train.steps=6", &out), 0, "%s", out);
    free(out);
    int rc = run(NULL, "chg", "--set train.steps=8 --set lora.r=8", &out);
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "lora.r (4, now 8)"), "%s", out);
    free(out);
    rc = run(NULL, "chg", "--set train.steps=8 --set lora.dropout=0 --set lora.dora=true", &out);
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "lora.dora (false, now true)"), "%s", out);
    free(out);
    rc = run(NULL, "chg", "--set train.steps=8 --set model.quantize=nf4", &out);
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "model.quantize (none, now nf4)"), "%s", out);
    free(out);
    /* another packing makes other windows: the data cursor would mean others */
    rc = run(NULL, "chg", "--set train.steps=8 --set data.packing=documents", &out);
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "data.packing (stream, now documents)"), "%s", out);
    free(out);
    char sets[4096];
    snprintf(sets, sizeof sets, "--set train.steps=8 --set model.path=%s/other", dir);
    rc = run(NULL, "chg", sets, &out);
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "another base model"), "%s", out);
    free(out);
    rc = run(NULL, "chg", "--set train.steps=8 --set log.every=2", &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "resumed from") && tu_contains(out, "step 6"), "%s", out);
    free(out);
    cr_expect_eq(last_step("chg"), 8);
    /* train.steps below the checkpoint's step: nothing to train, said so */
    rc = run(NULL, "chg", "--set train.steps=7", &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "train.steps is 7 but the checkpoint resumed is at step 8"), "%s",
              out);
    free(out);
    /* --resume none starts afresh; the earlier run's checkpoints (up to step
     * 8) and metrics move aside into run.dir/previous-*: left in
     * checkpoints/, retention pruned the new run's lower steps in their favour
     * and the next start resumed the old step 8 */
    rc = run(NULL, "chg", "--set train.steps=3 --set checkpoint.keep=1 --resume none", &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(!tu_contains(out, "resumed from"), "%s", out);
    cr_expect(tu_contains(out, "--resume none: run.dir held an earlier run's") &&
                  tu_contains(out, "(newest step-00000008)") && tu_contains(out, "/previous-"),
              "%s", out);
    free(out);
    char *moved = NULL;
    cr_expect_eq(tu_sh(&moved, "ls -d %s/chg/previous-*/checkpoints/step-00000008 "
                               "%s/chg/previous-*/metrics.jsonl",
                       dir, dir),
                 0, "%s", moved);
    free(moved);
    cr_expect_eq(last_step("chg"), 3, "the fresh run's metrics hold its own 3 steps");
    cr_expect(access(tu_fmt("%s/chg/checkpoints/step-00000003", dir), F_OK) == 0,
              "its checkpoint kept");
    rc = run(NULL, "chg", "--set train.steps=4", &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "resumed from") && tu_contains(out, "step 3"), "%s", out);
    free(out);
    cr_expect_eq(last_step("chg"), 4);
    /* with checkpoint.remote holding checkpoints, --resume none is refused
     * (exit 2, naming the store and its newest step) and nothing moves: the
     * store's copies would be mixed with the new run's the same way */
    const char *remote = tu_fmt("--set checkpoint.remote=file://%s/chg-bucket", dir);
    snprintf(sets, sizeof sets, "%s --set train.steps=5", remote);
    rc = run(NULL, "chgr", sets, &out);
    cr_expect_eq(rc, 0, "%s", out);
    free(out);
    snprintf(sets, sizeof sets, "%s --set train.steps=2 --resume none", remote);
    rc = run(NULL, "chgr", sets, &out);
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "--resume none: checkpoint.remote file://") &&
                  tu_contains(out, "holds checkpoints of an earlier run (newest step 5)"),
              "%s", out);
    free(out);
    cr_expect(access(tu_fmt("%s/chgr/checkpoints/step-00000005", dir), F_OK) == 0,
              "nothing moved when refused");
}
