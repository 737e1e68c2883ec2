/* Preemption and resume end to end, through the spotune binary (and mpirun
 * for several ranks): a run stopped by a signal or killed with SIGKILL just
 * after a checkpoint continues to the bit-identical result of an
 * uninterrupted run (CPU); 2 ranks resume on 1 with the same global batch;
 * SIGKILL at random moments never leaves a checkpoint that is chosen and
 * fails; changed math is refused and a changed step count is allowed. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/ckpt.h"
#include "test_util.h"

static char *dir;

static void setup(void)
{
    dir = tu_tempdir("resume");
    cr_assert(dir);
    char *out = NULL;
    int rc = tu_tiny_inputs(dir, 3, 5, &out);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    rc = tu_spotune(&out, "init-model --preset tiny --seed 6 %s/other", dir);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    char path[4096], cfg[4096];
    snprintf(path, sizeof path, "%s/run.yaml", dir);
    snprintf(cfg, sizeof cfg,
             "run:\n  seed: 21\nmodel:\n  path: %s/model\n"
             "train:\n  mode: lora\n  steps: 40\n  seq_len: 32\n  micro_batch: 2\n"
             "  grad_accum: 2\n  lr: 3e-3\n  warmup_steps: 4\n"
             "lora:\n  r: 4\n  alpha: 8\n  dropout: 0.1\n  targets: [q_proj, v_proj, down_proj]\n"
             "data:\n  train: %s/data.train.h5\n"
             "log:\n  every: 1\nruntime:\n  backend: cpu\n  threads: 1\n"
             "checkpoint:\n  every_minutes: 0\n  keep: 2\n",
             dir, dir);
    cr_assert_eq(tu_write_file(path, cfg), 0);
}

static void teardown(void)
{
    tu_rmtree(dir);
    free(dir);
}

TestSuite(resume, .init = setup, .fini = teardown, .timeout = 900);

/* "spotune train run.yaml --set run.dir=DIR/name EXTRA", with a launcher prefix */
static const char *train_cmd(const char *prefix, const char *name, const char *extra)
{
    static char cmd[8192];
    snprintf(cmd, sizeof cmd, "%s %s/spotune train %s/run.yaml --set run.dir=%s/%s %s",
             prefix ? prefix : "", SPOTUNE_BINARY_DIR, dir, dir, name, extra ? extra : "");
    return cmd;
}

static int run(const char *prefix, const char *name, const char *extra, char **out)
{
    return tu_sh(out, "%s", train_cmd(prefix, name, extra));
}

static int read_losses(const char *name, double *v, int max)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s/metrics.jsonl", dir, name);
    char *text = tu_read_file(path, NULL);
    cr_assert(text, "no %s", path);
    int n = 0;
    for (char *p = strstr(text, "\"event\":\"train\""); p && n < max;
         p = strstr(p + 1, "\"event\":\"train\"")) {
        char *l = strstr(p, "\"loss\":");
        cr_assert(l);
        v[n++] = strtod(l + 7, NULL);
    }
    free(text);
    return n;
}

static int last_step(const char *name)
{
    double v[256];
    return read_losses(name, v, 256);
}

/* Waits until the run has logged `step` (or the process ended). */
static void wait_step(const char *name, int step, int pid)
{
    for (int i = 0; i < 6000; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s/metrics.jsonl", dir, name);
        char *text = tu_read_file(path, NULL);
        char pat[64];
        snprintf(pat, sizeof pat, "\"step\":%d,", step);
        int seen = tu_contains(text, pat);
        free(text);
        if (seen || kill(pid, 0) != 0)
            return;
        tu_sleep(0.01);
    }
}

static void expect_same_run(const char *a, const char *b, int bitwise)
{
    double la[128], lb[128];
    int na = read_losses(a, la, 128), nb = read_losses(b, lb, 128);
    cr_assert_eq(na, 40, "%s logged %d steps", a, na);
    cr_assert_eq(nb, 40, "%s logged %d steps", b, nb);
    for (int i = 0; i < na; i++) {
        if (bitwise)
            cr_expect_eq(la[i], lb[i], "step %d: %.17g vs %.17g", i + 1, la[i], lb[i]);
        else
            cr_expect_lt(fabs(la[i] - lb[i]), 1e-5 * fabs(la[i]), "step %d: %.9g vs %.9g",
                         i + 1, la[i], lb[i]);
    }
    if (bitwise)
        cr_expect_eq(tu_sh(NULL, "cmp %s/%s/adapter/adapter_model.safetensors "
                                 "%s/%s/adapter/adapter_model.safetensors",
                           dir, a, dir, b),
                     0, "final adapters of %s and %s differ", a, b);
}

static void stop_with_signals(const char *prefix, const char *name, const char *extra, int sig,
                              int at_step, int times)
{
    char log[4096];
    snprintf(log, sizeof log, "%s/%s.log", dir, name);
    int pid = tu_spawn(log, "%s", train_cmd(prefix, name, extra));
    wait_step(name, at_step, pid);
    for (int i = 0; i < times; i++) {
        kill(pid, sig);
        tu_sleep(0.002);
    }
    int rc = tu_wait(pid, 300);
    char *text = tu_read_file(log, NULL);
    cr_assert_eq(rc, 75, "exit %d after signal %d: %s", rc, sig, text);
    cr_expect(tu_contains(text, "after committing checkpoint step"), "%s", text);
    free(text);
}

static void stop_with(const char *prefix, const char *name, const char *extra, int sig,
                      int at_step)
{
    stop_with_signals(prefix, name, extra, sig, at_step, 1);
}

Test(resume, sigterm_then_resume_is_bit_identical)
{
    char *out = NULL;
    cr_assert_eq(run(NULL, "whole", NULL, &out), 0, "%s", out);
    free(out);
    stop_with(NULL, "cut", NULL, SIGTERM, 12);
    int done = last_step("cut");
    cr_assert(done >= 12 && done < 40, "stopped after %d steps", done);
    cr_assert_eq(run(NULL, "cut", NULL, &out), 0, "%s", out);
    cr_expect(tu_contains(out, "resumed from"), "%s", out);
    free(out);
    expect_same_run("whole", "cut", 1);
}

/* A second (and third) signal while the stop checkpoint is being written
 * changes nothing: the same exit, a checkpoint that verifies, the same end. */
Test(resume, repeated_signals_during_the_save_corrupt_nothing)
{
    char *out = NULL;
    cr_assert_eq(run(NULL, "whole", NULL, &out), 0, "%s", out);
    free(out);
    stop_with_signals(NULL, "twice", NULL, SIGTERM, 10, 3);
    char root[4096];
    snprintf(root, sizeof root, "%s/twice/checkpoints", dir);
    ckpt_info *l;
    int n;
    sp_err err = {0};
    cr_assert_eq(ckpt_list(root, 1, &l, &n, &err), 0);
    cr_assert_geq(n, 1);
    for (int i = 0; i < n; i++)
        cr_expect(l[i].ok, "%s: %s", l[i].name, l[i].problem);
    free(l);
    cr_assert_eq(run(NULL, "twice", NULL, &out), 0, "%s", out);
    free(out);
    expect_same_run("whole", "twice", 1);
}

Test(resume, sigkill_just_after_a_checkpoint_then_resume_is_bit_identical)
{
    char *out = NULL;
    cr_assert_eq(run(NULL, "whole", NULL, &out), 0, "%s", out);
    free(out);
    char log[4096], ck[4096];
    snprintf(log, sizeof log, "%s/killed.log", dir);
    snprintf(ck, sizeof ck, "%s/killed/checkpoints/step-00000010/MANIFEST.json", dir);
    int pid = tu_spawn(log, "%s", train_cmd(NULL, "killed", "--set checkpoint.every_steps=10"));
    for (int i = 0; i < 30000 && access(ck, R_OK) != 0; i++)
        tu_sleep(0.001);
    kill(pid, SIGKILL);
    tu_wait(pid, 60);
    cr_assert_eq(access(ck, R_OK), 0, "checkpoint 10 was never committed");
    cr_assert_eq(run(NULL, "killed", "--set checkpoint.every_steps=10", &out), 0, "%s", out);
    cr_expect(tu_contains(out, "resumed from"), "%s", out);
    free(out);
    expect_same_run("whole", "killed", 1);
}

Test(resume, two_ranks_stopped_by_sigusr1_resume_bit_identical)
{
    char *out = NULL;
    char prefix[2048];
    snprintf(prefix, sizeof prefix, "%s", tu_mpirun(2));
    cr_assert_eq(run(prefix, "whole2", "--set train.grad_accum=1", &out), 0, "%s", out);
    free(out);
    /* mpirun forwards SIGUSR1 to every rank; they agree, checkpoint, exit 75 */
    stop_with(prefix, "cut2", "--set train.grad_accum=1", SIGUSR1, 12);
    cr_assert_eq(run(prefix, "cut2", "--set train.grad_accum=1", &out), 0, "%s", out);
    free(out);
    expect_same_run("whole2", "cut2", 1);
}

Test(resume, two_ranks_resume_on_one_with_the_same_global_batch)
{
    char *out = NULL;
    char prefix[2048];
    snprintf(prefix, sizeof prefix, "%s", tu_mpirun(2));
    cr_assert_eq(run(prefix, "two", "--set train.grad_accum=1", &out), 0, "%s", out);
    free(out);
    stop_with(prefix, "shrink", "--set train.grad_accum=1", SIGUSR1, 12);
    /* the new machine has one GPU: grad_accum 1 -> 2 keeps 2 x 2 x 1 = 4 windows */
    cr_assert_eq(run(NULL, "shrink", "--set train.grad_accum=1", &out), 0, "%s", out);
    cr_expect(tu_contains(out, "train.grad_accum is now 2"), "%s", out);
    free(out);
    /* the same windows in the same steps: equal up to the order of the sums */
    expect_same_run("two", "shrink", 0);
    /* a global batch the new rank count cannot split is refused, clearly */
    stop_with(prefix, "odd", "--set train.grad_accum=1", SIGUSR1, 5);
    int rc = run(NULL, "odd", "--set train.grad_accum=1 --set train.micro_batch=3", &out);
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "cannot split evenly"), "%s", out);
    free(out);
}

/* SIGKILL at random moments, checkpoints every 2 steps: whatever the moment,
 * the checkpoint a restart picks verifies, and the run ends where an
 * uninterrupted one does. A kill lands a random 1-8 steps after the restart
 * has logged its first step, plus a random 0-30 ms: within a step, often
 * while a checkpoint is being written, whatever the speed of the machine. */
Test(resume, sigkill_at_random_moments)
{
    const char *extra = "--set checkpoint.every_steps=2 --set train.steps=400";
    char *out = NULL;
    cr_assert_eq(run(NULL, "whole", extra, &out), 0, "%s", out);
    free(out);
    char log[4096], root[4096];
    snprintf(log, sizeof log, "%s/chaos.log", dir);
    snprintf(root, sizeof root, "%s/chaos/checkpoints", dir);
    int trials = 0, finished = 0;
    for (int t = 0; t < 20 && !finished; t++) {
        int before = 0;
        char mpath[4096];
        snprintf(mpath, sizeof mpath, "%s/chaos/metrics.jsonl", dir);
        if (access(mpath, R_OK) == 0)
            before = last_step("chaos");
        int pid = tu_spawn(log, "%s", train_cmd(NULL, "chaos", extra));
        int target = before + 1 + (int)(8 * sp_rng_uniform(99, (uint64_t)t));
        wait_step("chaos", target, pid);
        tu_sleep(0.03 * sp_rng_uniform(98, (uint64_t)t));
        if (kill(pid, SIGKILL) == 0)
            trials++;
        int rc = tu_wait(pid, 120);
        finished = rc == 0;
        /* every committed checkpoint verifies; none is chosen that does not */
        ckpt_info *l;
        int n;
        sp_err err = {0};
        cr_assert_eq(ckpt_list(root, 1, &l, &n, &err), 0);
        for (int i = 0; i < n; i++)
            if (strncmp(l[i].name, ".tmp-", 5) != 0)
                cr_expect(l[i].ok, "trial %d: %s fails: %s", t, l[i].name, l[i].problem);
        free(l);
    }
    cr_expect_geq(trials, 20, "only %d kills landed", trials);
    if (!finished) {
        cr_assert_eq(run(NULL, "chaos", extra, &out), 0, "%s", out);
        free(out);
    }
    cr_expect_eq(tu_sh(NULL, "cmp %s/whole/adapter/adapter_model.safetensors "
                             "%s/chaos/adapter/adapter_model.safetensors",
                       dir, dir),
                 0, "the run killed %d times ended with other weights", trials);
}

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
    /* --resume none starts afresh */
    rc = run(NULL, "chg", "--set train.steps=3 --resume none", &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(!tu_contains(out, "resumed from"), "%s", out);
    free(out);
}
