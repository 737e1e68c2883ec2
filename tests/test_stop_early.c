/* A stop does not wait for the end of the step or of the validation (a
 * 30-second notice on GCP or Azure may not cover them): the ranks agree
 * between micro-batches and between validation batches. A step given up
 * leaves the state of the step before (nothing was applied), so the
 * resumed run trains it again and ends bit-identical to an uninterrupted
 * one, its windows audited once; a validation given up is run first by
 * the resumed run, so the curve keeps every point. One rank and two (the
 * signal to one of them, with sharded gradients and optimizer). */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "resume_util.h"
#include "test_util.h"

TestSuite(stop_early, .init = resume_setup, .fini = resume_teardown, .timeout = 900);

enum { STEPS = 3 };

/* The step named given up in a log, and after how many of its
 * micro-batches; 0 when the stop came at a boundary instead. */
static int given_up_step(const char *text, int *done, int *of)
{
    const char *p = strstr(text, "is given up after ");
    if (!p)
        return 0;
    while (p > text && strncmp(p, "step ", 5) != 0)
        p--;
    int step = 0;
    cr_assert_eq(sscanf(p, "step %d is given up after %d of its %d", &step, done, of), 3, "%s",
                 p);
    return step;
}

/* Starts run name (extra: not a tu_fmt string, which this outlives), sends sig to the launcher (rank < 0) or to one rank of
 * it once step 2 is logged, and returns the stopped run's log; tries again
 * (a new run directory) when the signal met a step boundary rather than a
 * step, up to 3 times. */
static char *stop_in_step(const char *prefix, const char *name, const char *extra, int sig,
                          int rank, int *step, int *done, int *of)
{
    for (int attempt = 0; attempt < 3; attempt++) {
        tu_rmtree(tu_fmt("%s/%s", dir, name));
        int pid = tu_spawn(tu_fmt("%s/%s.log", dir, name), "%s", train_cmd(prefix, name, extra));
        wait_step(name, 2, pid);
        int victim = rank < 0 ? pid : rank_pid(pid, rank);
        cr_assert_gt(victim, 0, "rank %d not found under %d", rank, pid);
        kill(victim, sig);
        int rc = tu_wait(pid, 300);
        char *text = read_log(name);
        cr_assert_eq(rc, 75, "exit %d after signal %d: %s", rc, sig, text);
        if ((*step = given_up_step(text, done, of)) > 0)
            return text;
        cr_log_info("attempt %d: the signal met a step boundary: %s", attempt + 1, text);
        free(text);
    }
    cr_assert_fail("in 3 runs no signal landed within a step");
    return NULL;
}

/* The stopped run's checkpoint is the step before the one given up, and no
 * later step was logged. */
static void expect_stopped_before(const char *name, const char *text, int step)
{
    int at = stopped_at(name, text);
    cr_expect_eq(at, step - 1, "step %d given up, but the stop checkpoint is step %d", step, at);
    cr_expect_eq(last_step(name), step - 1, "the run logged %d steps", last_step(name));
}

static void expect_same_losses(const char *a, const char *b)
{
    double la[16], lb[16];
    int na = read_losses(a, la, 16), nb = read_losses(b, lb, 16);
    cr_assert_eq(na, STEPS, "%s logged %d steps", a, na);
    cr_assert_eq(nb, STEPS, "%s logged %d steps", b, nb);
    for (int i = 0; i < na; i++)
        cr_expect_eq(la[i], lb[i], "step %d: %.17g vs %.17g", i + 1, la[i], lb[i]);
}

/* One rank, LoRA with dropout: 40 micro-batches a step, SIGUSR1 within
 * step 3 (or so). The step is given up after fewer than its 40; the
 * resumed run ends with the uninterrupted one's losses and adapter, bit
 * for bit, and the sample audit holds each step's windows once. */
Test(stop_early, a_stop_between_micro_batches_gives_up_the_step)
{
    char extra[512];
    snprintf(extra, sizeof extra,
             "--set train.steps=%d --set train.micro_batch=1 --set train.grad_accum=40 "
             "--set log.samples=true",
             STEPS);
    char *out = NULL;
    cr_assert_eq(run(NULL, "whole", extra, &out), 0, "%s", out);
    free(out);
    int step = 0, done = 0, of = 0;
    char *text = stop_in_step(NULL, "cut", extra, SIGUSR1, -1, &step, &done, &of);
    cr_expect(tu_contains(text, "stop requested (SIGUSR1): step"), "%s", text);
    cr_expect(of == 40 && done >= 1 && done < 40, "given up after %d of %d", done, of);
    cr_assert(step >= 2 && step <= STEPS, "step %d given up", step);
    expect_stopped_before("cut", text, step);
    free(text);
    enum { MAX_ROWS = 2048 };
    sample_row *rows = calloc(MAX_ROWS, sizeof *rows);
    cr_assert(rows);
    int n = read_samples("cut", 0, rows, MAX_ROWS);
    cr_expect_eq(n, (step - 1) * 40, "the stopped run audited %d windows for %d steps", n,
                 step - 1);
    for (int i = 0; i < n; i++)
        cr_expect_lt(rows[i].step, step, "the audit holds step %lld, which was given up",
                     rows[i].step);

    cr_assert_eq(run(NULL, "cut", extra, &out), 0, "%s", out);
    cr_expect(tu_contains(out, "resumed from"), "%s", out);
    free(out);
    expect_same_losses("whole", "cut");
    size_t na = 0, nb = 0;
    char *a = tu_read_file(tu_fmt("%s/whole/adapter/adapter_model.safetensors", dir), &na);
    char *b = tu_read_file(tu_fmt("%s/cut/adapter/adapter_model.safetensors", dir), &nb);
    cr_assert(a && b);
    cr_expect(na == nb && memcmp(a, b, na) == 0, "the adapters differ");
    free(a);
    free(b);
    n = read_samples("cut", 0, rows, MAX_ROWS);
    expect_every_sample_once(rows, n, STEPS, 40);
    free(rows);
}

/* Two ranks, full fine-tuning (the gradients reduced to their shards
 * during every micro-batch, the optimizer sharded): SIGTERM to rank 1
 * alone. Rank 0 learns it at the next micro-batch, both give the step up
 * after the same one (the reductions begun have both ranks), and the
 * resumed run ends bit-identical. */
Test(stop_early, two_ranks_give_up_the_step_one_of_them_was_signalled_in)
{
    char extra[512];
    snprintf(extra, sizeof extra,
             "--set train.mode=full --set train.lr=5e-4 --set train.steps=%d "
             "--set train.micro_batch=1 --set train.grad_accum=20",
             STEPS);
    char prefix[2048], *out = NULL;
    snprintf(prefix, sizeof prefix, "%s", tu_mpirun(2));
    cr_assert_eq(run(prefix, "whole2", extra, &out), 0, "%s", out);
    cr_expect(tu_contains(out, "gradients sharded over the ranks"), "%s", out);
    free(out);
    int step = 0, done = 0, of = 0;
    char *text = stop_in_step(prefix, "cut2", extra, SIGTERM, 1, &step, &done, &of);
    cr_expect(tu_contains(text, "stop requested (another rank): step"), "%s", text);
    cr_expect(of == 20 && done >= 1 && done < 20, "given up after %d of %d", done, of);
    expect_stopped_before("cut2", text, step);
    free(text);
    cr_assert_eq(run(prefix, "cut2", extra, &out), 0, "%s", out);
    cr_expect(tu_contains(out, "resumed from"), "%s", out);
    free(out);
    expect_same_losses("whole2", "cut2");
}

/* Reads the validation records of a run: steps[i], losses[i]. */
static int read_vals(const char *name, long long *steps, double *losses, int max)
{
    char *text = tu_read_file(tu_fmt("%s/%s/metrics.jsonl", dir, name), NULL);
    cr_assert(text);
    int n = 0;
    for (char *p = strstr(text, "\"event\":\"val\""); p && n < max;
         p = strstr(p + 1, "\"event\":\"val\"")) {
        char *s = strstr(p, "\"step\":"), *l = strstr(p, "\"val_loss\":");
        cr_assert(s && l);
        steps[n] = strtoll(s + 7, NULL, 10);
        losses[n++] = strtod(l + 11, NULL);
    }
    free(text);
    return n;
}

/* SIGUSR1 as step 2's validation starts (1000 windows): it is given up,
 * the stop checkpoint is step 2, and metrics.jsonl has no validation of
 * step 2 yet; the resumed run runs it before step 3, so the
 * finished curve has the uninterrupted run's validations (steps 0, 2, 3),
 * each once and bit for bit. */
Test(stop_early, a_validation_given_up_is_run_first_on_resume)
{
    char extra[4096];
    snprintf(extra, sizeof extra,
             "--set train.steps=%d --set train.grad_accum=1 --set data.val=%s/data.train.h5 "
             "--set data.val_every=2 --set data.val_windows=1000",
             STEPS, dir);
    char *out = NULL;
    cr_assert_eq(run(NULL, "vwhole", extra, &out), 0, "%s", out);
    free(out);
    int pid = tu_spawn(tu_fmt("%s/vcut.log", dir), "%s", train_cmd(NULL, "vcut", extra));
    wait_step("vcut", 2, pid);
    kill(pid, SIGUSR1);
    int rc = tu_wait(pid, 300);
    char *text = read_log("vcut");
    cr_assert_eq(rc, 75, "exit %d: %s", rc, text);
    cr_expect(tu_contains(text, "the validation of step 2 is given up after"), "%s", text);
    cr_expect_eq(stopped_at("vcut", text), 2, "%s", text);
    free(text);
    long long vs[8], ws[8];
    double vl[8], wl[8];
    int nv = read_vals("vcut", vs, vl, 8);
    cr_expect(nv == 1 && vs[0] == 0, "the stopped run logged %d validations", nv);

    cr_assert_eq(run(NULL, "vcut", extra, &out), 0, "%s", out);
    cr_expect(tu_contains(out, "resumed from"), "%s", out);
    free(out);
    int nw = read_vals("vwhole", ws, wl, 8);
    nv = read_vals("vcut", vs, vl, 8);
    cr_assert_eq(nw, 3, "the uninterrupted run logged %d validations", nw);
    cr_assert_eq(nv, nw, "the resumed run's curve has %d validations", nv);
    for (int i = 0; i < nw; i++) {
        cr_expect_eq(vs[i], ws[i], "validation %d: step %lld vs %lld", i, vs[i], ws[i]);
        cr_expect_eq(vl[i], wl[i], "validation of step %lld: %.17g vs %.17g", ws[i], vl[i], wl[i]);
    }
    expect_same_losses("vwhole", "vcut");
}
