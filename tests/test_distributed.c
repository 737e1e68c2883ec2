/* Data-parallel training through mpirun (TCP between ranks, as across
 * nodes): 1, 2 and 4 ranks with the same global batch follow the same loss
 * trajectory (1e-5 relative: only the order of the sums differs); every
 * window of an epoch is trained exactly once across ranks; a rank killed
 * with SIGKILL ends the job within comm.timeout_s; a rank hitting bad input
 * ends the job cleanly with the rank named. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test_util.h"
#include "trainer/data.h"
#include "trainer/safetensors.h"

static char *dir;

static void setup(void)
{
    dir = tu_tiny_dir("dist", 4, 8);
    tu_run_yaml(dir, "run:\n  seed: 5\n"
                     "train:\n  mode: lora\n  steps: 6\n  seq_len: 32\n  micro_batch: 1\n"
                     "  grad_accum: 1\n  lr: 3e-3\n"
                     "lora:\n  r: 4\n  alpha: 8\n  dropout: 0.1\n"
                     "  targets: [q_proj, k_proj, down_proj]\n"
                     "log:\n  every: 1\nruntime:\n  backend: cpu\n  threads: 1\n"
                     "comm:\n  timeout_s: 10\ncheckpoint:\n  every_minutes: 0\n");
}

static void teardown(void)
{
    tu_rmtree(dir);
    free(dir);
}

TestSuite(distributed, .init = setup, .fini = teardown, .timeout = 900);

static int train(int ranks, const char *name, const char *extra, char **out)
{
    return tu_sh(out, "%s %s/spotune train %s/run.yaml --set run.dir=%s/%s %s",
                 ranks > 0 ? tu_mpirun(ranks) : "", SPOTUNE_BINARY_DIR, dir, dir, name,
                 extra ? extra : "");
}

static int losses(const char *name, double *v, int max)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s/metrics.jsonl", dir, name);
    char *text = tu_read_file(path, NULL);
    cr_assert(text, "no %s", path);
    int n = 0;
    for (char *p = strstr(text, "\"event\":\"train\""); p && n < max;
         p = strstr(p + 1, "\"event\":\"train\""))
        v[n++] = strtod(strstr(p, "\"loss\":") + SP_LEN("\"loss\":"), NULL);
    free(text);
    return n;
}

static void same_trajectory_with(const char *mode, const char *tag, const char *more)
{
    /* global batch 4 windows: 1 x 4, 2 x 2, 4 x 1 (and 1 rank by accumulation) */
    const struct { int ranks; int mb, ga; } runs[] = {{0, 4, 1}, {1, 1, 4}, {2, 2, 1}, {4, 1, 1}};
    double ref[16];
    for (int r = 0; r < 4; r++) {
        char name[64], extra[256], *out = NULL;
        snprintf(name, sizeof name, "%s-%d-%d-%d", tag, runs[r].ranks, runs[r].mb, runs[r].ga);
        snprintf(extra, sizeof extra,
                 "--set train.mode=%s --set train.micro_batch=%d --set train.grad_accum=%d %s",
                 mode, runs[r].mb, runs[r].ga, more);
        cr_assert_eq(train(runs[r].ranks, name, extra, &out), 0, "%s", out);
        free(out);
        double v[16];
        int n = losses(name, v, 16);
        cr_assert_eq(n, 6, "%s: %d steps", name, n);
        for (int i = 0; i < n; i++) {
            if (r == 0)
                ref[i] = v[i];
            else
                cr_expect_lt(fabs(v[i] - ref[i]), 1e-5 * fabs(ref[i]),
                             "%s step %d: %.9f vs %.9f (1 rank)", name, i + 1, v[i], ref[i]);
        }
    }
}

static void same_trajectory(const char *mode)
{
    same_trajectory_with(mode, mode, "");
}

/* DoRA's magnitudes are reduced with the other gradients; with the run's
 * LoRA dropout (0.1): a window's masks do not depend on the rank that
 * trains it */
Test(distributed, one_two_four_ranks_same_trajectory_dora)
{
    same_trajectory_with("lora", "dora", "--set lora.dora=true");
}

Test(distributed, one_two_four_ranks_same_trajectory_lora)
{
    same_trajectory("lora");
}

Test(distributed, one_two_four_ranks_same_trajectory_full)
{
    same_trajectory("full");
}

/* The gradient buckets (comm.bucket_mb) only cut the all-reduce into pieces:
 * 64 KiB buckets (about 60 of them for the tiny model's 3.8 MB of full
 * gradients) give the bit-identical run of 25 MiB buckets (one). Only rank 0
 * prints progress and writes metrics; tokens/s counts every rank's tokens. */
Test(distributed, buckets_change_nothing_and_rank_0_alone_reports)
{
    const char *base = "--set train.mode=full --set train.shard_optimizer=false --set "
                       "train.micro_batch=2";
    char extra[1024], *one = NULL, *many = NULL;
    snprintf(extra, sizeof extra, "%s --set comm.bucket_mb=25", base);
    cr_assert_eq(train(2, "bucket-one", extra, &one), 0, "%s", one);
    snprintf(extra, sizeof extra, "%s --set comm.bucket_mb=0.0625", base);
    cr_assert_eq(train(2, "bucket-many", extra, &many), 0, "%s", many);
    cr_expect_eq(tu_sh(NULL, "cmp %s/bucket-one/model/model.safetensors "
                             "%s/bucket-many/model/model.safetensors",
                       dir, dir),
                 0, "64 KiB buckets changed the result");
    double a[16], b[16];
    cr_assert_eq(losses("bucket-one", a, 16), 6);
    cr_assert_eq(losses("bucket-many", b, 16), 6);
    for (int i = 0; i < 6; i++)
        cr_expect_eq(a[i], b[i], "step %d: %.17g vs %.17g", i + 1, a[i], b[i]);
    /* one progress line per step, one memory plan: rank 0 alone prints */
    int lines = 0;
    for (const char *p = strstr(many, "step      3/6 |"); p; p = strstr(p + 1, "step      3/6 |"))
        lines++;
    cr_expect_eq(lines, 1, "%d progress lines for step 3:\n%s", lines, many);
    lines = 0;
    for (const char *p = strstr(many, "memory plan"); p; p = strstr(p + 1, "memory plan"))
        lines++;
    cr_expect_eq(lines, 1, "%d memory plans:\n%s", lines, many);
    char path[4096];
    snprintf(path, sizeof path, "%s/bucket-many/metrics.jsonl", dir);
    char *m = tu_read_file(path, NULL);
    cr_assert(m);
    int records = 0;
    for (char *p = strstr(m, "\"event\":\"train\""); p; p = strstr(p + 1, "\"event\":\"train\"")) {
        double tps = strtod(strstr(p, "\"tokens_per_s\":") + SP_LEN("\"tokens_per_s\":"), NULL);
        double dt = strtod(strstr(p, "\"step_s\":") + SP_LEN("\"step_s\":"), NULL);
        /* global batch: 2 ranks x 2 windows x 32 tokens */
        cr_expect_lt(fabs(tps * dt - 128.0), 1e-3 * 128.0, "tokens/s %g x step %g s", tps, dt);
        records++;
    }
    cr_expect_eq(records, 6, "one train record per step from rank 0 alone (%d)", records);
    free(m);
    free(one);
    free(many);
}

/* runtime.cuda_graphs on 2 ranks (the CPU's recorded op list): the same
 * losses and weights bit for bit as eager, DoRA with dropout (LoRA) and a
 * sharded optimizer (full, gradients whole), 2 micro-batches a step; each
 * rank's 12 micro-batches: the first eager, the second captured, every
 * later one a replay (rank 0 reports); the 6 updates likewise, but with a
 * sharded optimizer, whose gradient norm is summed over the ranks on the
 * host (updates: what rank 0 says of them). */
static void graphs_change_nothing(const char *tag, const char *base, const char *file,
                                  const char *updates)
{
    char name[2][64], extra[1024], *out[2] = {NULL, NULL};
    for (int g = 0; g < 2; g++) {
        snprintf(name[g], sizeof name[g], "%s-%s", tag, g ? "graphs" : "eager");
        snprintf(extra, sizeof extra,
                 "%s --set train.micro_batch=1 --set train.grad_accum=2 "
                 "--set runtime.cuda_graphs=%s",
                 base, g ? "true" : "false");
        cr_assert_eq(train(2, name[g], extra, &out[g]), 0, "%s", out[g]);
    }
    cr_expect(tu_contains(out[1], "runtime.cuda_graphs: 11 micro-batches replayed a graph, 1 "
                                  "were captured, 1 ran eagerly; "),
              "%s: %s", tag, out[1]);
    cr_expect(tu_contains(out[1], updates), "%s: wanted '%s' in %s", tag, updates, out[1]);
    double a[16], b[16];
    cr_assert_eq(losses(name[0], a, 16), 6);
    cr_assert_eq(losses(name[1], b, 16), 6);
    for (int i = 0; i < 6; i++)
        cr_expect_eq(a[i], b[i], "%s step %d: %.17g eager, %.17g with graphs", tag, i + 1, a[i],
                     b[i]);
    cr_expect_eq(tu_sh(NULL, "cmp %s/%s/%s %s/%s/%s", dir, name[0], file, dir, name[1], file), 0,
                 "%s: %s differs with graphs", tag, file);
    free(out[0]);
    free(out[1]);
}

Test(distributed, graphs_change_nothing_on_two_ranks_dora)
{
    graphs_change_nothing("graphs-dora", "--set lora.dora=true",
                          "adapter/adapter_model.safetensors",
                          "5 updates replayed one, 1 were captured, 1 ran eagerly");
}

Test(distributed, graphs_change_nothing_on_two_ranks_full_sharded_optimizer)
{
    graphs_change_nothing("graphs-full",
                          "--set train.mode=full --set train.shard_gradients=false",
                          "model/model.safetensors",
                          "the updates ran without (the optimizer is sharded)");
}

/* The union of the windows all ranks trained in an epoch is the epoch's
 * permutation, with no window twice. On a dataset of the text's first 2000
 * lines (about 1800 windows, not a multiple of the 4 a step trains, so an
 * epoch ends inside a step): two epochs are some 900 steps. */
static void exactly_once(int ranks)
{
    dataset_t d;
    sp_err err = {0};
    char path[4096];
    cr_assert_eq(tu_sh(NULL,
                       "head -n 2000 %s/text.txt > %s/part.txt && %s/spotune prepare-text "
                       "%s/part.txt %s/part --val-fraction 0",
                       dir, dir, SPOTUNE_BINARY_DIR, dir, dir),
                 0);
    snprintf(path, sizeof path, "%s/part.train.h5", dir);
    cr_assert_eq(dataset_open(&d, path, 32, 260, 5, &err), 0, "%s", err.msg);
    uint64_t W = d.n_windows;
    dataset_close(&d);
    cr_assert(W > 1000 && W % 4 != 0, "%llu windows", (unsigned long long)W);
    /* two epochs in steps of 4 windows */
    long steps = (long)((2 * W + 3) / 4);
    char name[64], extra[4600], *out = NULL;
    snprintf(name, sizeof name, "once-%d", ranks);
    snprintf(extra, sizeof extra,
             "--set data.train=%s --set log.samples=true --set train.steps=%ld "
             "--set train.micro_batch=%d --set train.mode=lora --set lora.targets=[q_proj] "
             "--set log.every=1000",
             path, steps, 4 / ranks);
    cr_assert_eq(train(ranks, name, extra, &out), 0, "%s", out);
    free(out);
    int *seen = calloc(2 * W, sizeof *seen);
    uint64_t rows = 0;
    for (int r = 0; r < ranks; r++) {
        snprintf(path, sizeof path, "%s/%s/samples/rank-%d.tsv", dir, name, r);
        FILE *f = fopen(path, "r");
        cr_assert(f, "no %s", path);
        long long step;
        unsigned long long sample, epoch, window;
        while (fscanf(f, "%lld %llu %llu %llu", &step, &sample, &epoch, &window) == 4) {
            rows++;
            cr_assert_lt(window, W);
            if (epoch < 2)
                seen[epoch * W + window]++;
        }
        fclose(f);
    }
    cr_expect_eq(rows, (uint64_t)steps * 4, "every slot of every step logged once");
    for (uint64_t e = 0; e < 2; e++)
        for (uint64_t w = 0; w < W; w++)
            cr_expect_eq(seen[e * W + w], 1, "%d ranks: epoch %llu window %llu trained %d times",
                         ranks, (unsigned long long)e, (unsigned long long)w, seen[e * W + w]);
    free(seen);
}

Test(distributed, every_window_once_per_epoch_2_ranks)
{
    exactly_once(2);
}

Test(distributed, every_window_once_per_epoch_4_ranks)
{
    exactly_once(4);
}

Test(distributed, a_rank_killed_ends_the_job_within_the_timeout)
{
    char log[4096];
    snprintf(log, sizeof log, "%s/kill.log", dir);
    int pid = tu_spawn(log, "%s %s/spotune train %s/run.yaml --set run.dir=%s/kill --set "
                            "train.steps=100000 --set train.micro_batch=2",
                       tu_mpirun(2), SPOTUNE_BINARY_DIR, dir, dir);
    /* wait until training runs, then SIGKILL one rank (a child of mpirun) */
    char metrics[4096];
    snprintf(metrics, sizeof metrics, "%s/kill/metrics.jsonl", dir);
    for (int i = 0; i < 3000; i++) {
        char *t = tu_read_file(metrics, NULL);
        int going = tu_contains(t, "\"step\":3,");
        free(t);
        if (going)
            break;
        tu_sleep(0.02);
    }
    char *victim = NULL;
    tu_sh(&victim, "pgrep -P %d -x spotune | tail -1", pid);
    int vpid = victim ? atoi(victim) : 0;
    free(victim);
    cr_assert_gt(vpid, 0, "no rank found under mpirun %d", pid);
    double t0 = sp_now();
    kill(vpid, SIGKILL);
    int rc = tu_wait(pid, 60);
    double dt = sp_now() - t0;
    cr_expect(rc != 0 && rc != -1, "mpirun exit %d", rc);
    cr_expect_lt(dt, 10.0 + 5.0, "the job took %.1f s to end (timeout 10 s)", dt);
    /* nothing is left running */
    cr_expect_neq(tu_sh(NULL, "pgrep -P %d", pid), 0);
}

Test(distributed, bad_input_on_one_rank_aborts_the_job_naming_it)
{
    /* 8 windows of 32; window 5's loss_mask holds a 7: only the rank that
     * reads window 5 can see it */
    uint64_t n = 8 * 32 + 1;
    uint32_t *tok = calloc(n, sizeof *tok);
    uint8_t *msk = calloc(n, 1);
    for (uint64_t i = 0; i < n; i++) {
        tok[i] = (uint32_t)(i % 200);
        msk[i] = 1;
    }
    msk[5 * 32 + 3] = 7;
    uint64_t off[2] = {0, n};
    sp_err err = {0};
    char path[4096];
    snprintf(path, sizeof path, "%s/bad.h5", dir);
    cr_assert_eq(dataset_write(path, tok, msk, n, off, 1, 258, 257, "test", &err), 0);
    free(tok);
    free(msk);
    char *out = NULL, extra[4200];
    snprintf(extra, sizeof extra,
             "--set data.train=%s --set train.micro_batch=4 --set train.steps=2", path);
    int rc = train(2, "bad", extra, &out);
    cr_expect_eq(rc, 3, "exit %d: %s", rc, out);
    cr_expect(tu_contains(out, "spotune: rank ") && tu_contains(out, " on "), "%s", out);
    cr_expect(tu_contains(out, "bad.h5: loss_mask value 7 at position 163"), "%s", out);
    free(out);
}

/* Each rank checks only its slice of the tokens when the job opens the
 * dataset (rank r: positions [r n/N, (r+1) n/N)), so a token outside the
 * model's vocabulary is found by the rank whose slice holds it, and the whole
 * job ends naming that rank and the position. */
static void bad_token_found_by(uint64_t position, int rank)
{
    uint64_t n = 8 * 32 + 1;
    uint32_t *tok = calloc(n, sizeof *tok);
    uint8_t *msk = calloc(n, 1);
    for (uint64_t i = 0; i < n; i++) {
        tok[i] = (uint32_t)(i % 200);
        msk[i] = 1;
    }
    tok[position] = 300; /* the tiny model's vocabulary is 260 */
    uint64_t off[2] = {0, n};
    sp_err err = {0};
    char path[4096], name[64], want[128];
    snprintf(name, sizeof name, "tok%llu", (unsigned long long)position);
    snprintf(path, sizeof path, "%s/%s.h5", dir, name);
    cr_assert_eq(dataset_write(path, tok, msk, n, off, 1, 258, 257, "test", &err), 0);
    free(tok);
    free(msk);
    char *out = NULL, extra[4200];
    snprintf(extra, sizeof extra, "--set data.train=%s --set train.micro_batch=2 --set train.steps=2",
             path);
    int rc = train(2, name, extra, &out);
    cr_expect_eq(rc, 3, "exit %d: %s", rc, out);
    snprintf(want, sizeof want, "spotune: rank %d on ", rank);
    cr_expect(tu_contains(out, want), "expected %s: %s", want, out);
    snprintf(want, sizeof want, "token 300 at position %llu is not a token id of the model",
             (unsigned long long)position);
    cr_expect(tu_contains(out, want), "%s", out);
    free(out);
}

Test(distributed, each_rank_checks_its_own_slice_of_the_tokens)
{
    bad_token_found_by(20, 0);
    bad_token_found_by(200, 1);
}

/* The largest relative difference between two F32 safetensors files of the
 * same tensors, how many values were compared, and (l2 not NULL) the norm of
 * the difference over the norm of b's values. */
static void rel_diffs(const char *a, const char *b, double *worst, size_t *count, double *l2)
{
    double dd = 0.0, bb = 0.0;
    st_file fa, fb;
    sp_err err = {0};
    cr_assert_eq(st_open(&fa, a, &err), 0, "%s", err.msg);
    cr_assert_eq(st_open(&fb, b, &err), 0, "%s", err.msg);
    cr_assert_eq(fa.n, fb.n);
    *worst = 0.0;
    *count = 0;
    for (size_t i = 0; i < fa.n; i++) {
        const st_tensor *x = &fa.tensors[i], *y = st_find(&fb, x->name);
        cr_assert(y && y->numel == x->numel && x->dt == DT_F32 && y->dt == DT_F32, "%s", x->name);
        for (size_t k = 0; k < x->numel; k++) {
            float u, v; /* the data need not be aligned */
            memcpy(&u, (const char *)x->data + 4 * k, 4);
            memcpy(&v, (const char *)y->data + 4 * k, 4);
            double d = fabs((double)u - (double)v) / (fabs((double)u) + 1e-3);
            if (d > *worst)
                *worst = d;
            dd += ((double)u - (double)v) * ((double)u - (double)v);
            bb += (double)v * (double)v;
        }
        *count += x->numel;
    }
    st_close(&fa);
    st_close(&fb);
    if (l2)
        *l2 = bb > 0 ? sqrt(dd / bb) : sqrt(dd);
}

static void max_rel_diff(const char *a, const char *b, double *worst, size_t *count)
{
    rel_diffs(a, b, worst, count, NULL);
}

/* Full fine-tuning with the optimizer sharded over the ranks (ZeRO stage 1,
 * here with the gradients sharded too, train.shard_gradients' default: with
 * one micro-batch a step the owners sum the ranks' gradients in the same
 * rank order as the all-reduce): the same run as with every rank holding all
 * the state (losses and final weights within 1e-6 relative: only the
 * grouping of the gradient norm's sum differs), and its checkpoints are ordinary ones: resumed on 2 ranks the run
 * ends bit-identical to the uninterrupted one, and on 1 rank (unsharded) or 4
 * ranks (sharded 4 ways) it follows the same losses within 1e-5. */
Test(distributed, full_fine_tuning_with_a_sharded_optimizer)
{
    const char *full = "--set train.mode=full --set train.micro_batch=2 --set "
                       "checkpoint.every_steps=3";
    char extra[1024], *out = NULL;
    cr_assert_eq(train(2, "zero", full, &out), 0, "%s", out);
    cr_expect(tu_contains(out, "optimizer state and gradients sharded over the ranks"), "%s",
              out);
    free(out);
    snprintf(extra, sizeof extra, "%s --set train.shard_optimizer=false", full);
    cr_assert_eq(train(2, "nozero", extra, &out), 0, "%s", out);
    cr_expect(!tu_contains(out, "sharded"), "%s", out);
    free(out);
    double a[16], b[16];
    int n = losses("zero", a, 16);
    cr_assert_eq(n, 6);
    cr_assert_eq(losses("nozero", b, 16), 6);
    for (int i = 0; i < n; i++)
        cr_expect_lt(fabs(a[i] - b[i]), 1e-6 * fabs(b[i]), "step %d: %.9f sharded, %.9f not",
                     i + 1, a[i], b[i]);
    char pa[4096], pb[4096];
    snprintf(pa, sizeof pa, "%s/zero/model/model.safetensors", dir);
    snprintf(pb, sizeof pb, "%s/nozero/model/model.safetensors", dir);
    double worst;
    size_t count;
    max_rel_diff(pa, pb, &worst, &count);
    cr_expect_gt(count, 900000, "the tiny model has about 0.95M weights (%zu)", count);
    cr_expect_lt(worst, 1e-6, "final weights differ by %.3g relative", worst);

    /* resume from the sharded run's step 3 on 2, 1 and 4 ranks */
    const struct { int ranks; const char *name, *set; } r[] = {
        {2, "zero-r2", ""}, {0, "zero-r1", ""}, {4, "zero-r4", "--set train.micro_batch=1"}};
    for (int k = 0; k < 3; k++) {
        snprintf(extra, sizeof extra, "%s %s --resume %s/zero/checkpoints/step-00000003", full,
                 r[k].set, dir);
        cr_assert_eq(train(r[k].ranks, r[k].name, extra, &out), 0, "%s", out);
        cr_expect(tu_contains(out, "resumed from") && tu_contains(out, "step 3"), "%s", out);
        free(out);
        double v[16];
        cr_assert_eq(losses(r[k].name, v, 16), 6, "%s", r[k].name);
        for (int i = 3; i < 6; i++)
            cr_expect_lt(fabs(v[i] - a[i]), 1e-5 * fabs(a[i]), "%s step %d: %.9f vs %.9f",
                         r[k].name, i + 1, v[i], a[i]);
    }
    cr_expect_eq(tu_sh(NULL, "cmp %s %s/zero-r2/model/model.safetensors", pa, dir), 0,
                 "a sharded run resumed on the same ranks is not bit-identical");
}

/* Gradient sharding (ZeRO stage 2) with micro-batch accumulation: each
 * micro-batch's gradient is reduced into the owners' shards as the backward
 * finishes each layer. Global batch 8 windows on 1 rank (2 x 4 micro-batches,
 * nothing sharded), 2 ranks (2 x 2) and 4 ranks (1 x 2), gradients sharded
 * and not: every run's losses within 1e-5 relative of the 1-rank run's, and
 * the final weights of the sharded runs within 1e-5 of the others' (the norm
 * of the difference over the weights' norm: only the order of the sums
 * differs, and that already moves single weights that AdamW pushes from a
 * near-zero gradient by up to ~1e-3 between the unsharded runs on 1, 2 and
 * 4 ranks, so the largest single difference is bounded by 1e-2 relative to
 * |w| + 1e-3 and checked to be no worse than the unsharded runs' own). */
Test(distributed, full_fine_tuning_with_sharded_gradients_and_accumulation)
{
    const struct {
        int ranks, mb, ga, shard;
        const char *name;
    } runs[] = {{0, 2, 4, 0, "z2-1"},     {2, 2, 2, 1, "z2-2"}, {2, 2, 2, 0, "z2-2-off"},
                {4, 1, 2, 1, "z2-4"},     {4, 1, 2, 0, "z2-4-off"}};
    double ref[16];
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        char extra[1024], *out = NULL;
        snprintf(extra, sizeof extra,
                 "--set train.mode=full --set train.micro_batch=%d --set train.grad_accum=%d "
                 "--set train.shard_gradients=%s",
                 runs[r].mb, runs[r].ga, runs[r].shard ? "true" : "false");
        cr_assert_eq(train(runs[r].ranks, runs[r].name, extra, &out), 0, "%s", out);
        if (runs[r].ranks > 1)
            cr_expect(tu_contains(out, runs[r].shard ? "optimizer state and gradients sharded"
                                                     : "(optimizer state sharded"),
                      "%s: %s", runs[r].name, out);
        free(out);
        double v[16];
        cr_assert_eq(losses(runs[r].name, v, 16), 6, "%s", runs[r].name);
        for (int i = 0; i < 6; i++) {
            if (r == 0)
                ref[i] = v[i];
            else
                cr_expect_lt(fabs(v[i] - ref[i]), 1e-5 * fabs(ref[i]),
                             "%s step %d: %.9f vs %.9f (1 rank)", runs[r].name, i + 1, v[i],
                             ref[i]);
        }
    }
    /* sharded vs unsharded on the same ranks, and vs 1 rank; then the
     * unsharded runs against each other, whose largest difference bounds
     * what summation order alone does */
    const char *pairs[][2] = {{"z2-2", "z2-2-off"}, {"z2-4", "z2-4-off"}, {"z2-2", "z2-1"},
                              {"z2-4", "z2-1"},     {"z2-2-off", "z2-1"}, {"z2-4-off", "z2-1"}};
    double worst[6];
    for (int k = 0; k < 6; k++) {
        char pa[4096], pb[4096];
        snprintf(pa, sizeof pa, "%s/%s/model/model.safetensors", dir, pairs[k][0]);
        snprintf(pb, sizeof pb, "%s/%s/model/model.safetensors", dir, pairs[k][1]);
        double l2;
        size_t count;
        rel_diffs(pa, pb, &worst[k], &count, &l2);
        cr_log_info("%s vs %s: final weights within %.3g (norm), %.3g (largest)", pairs[k][0],
                    pairs[k][1], l2, worst[k]);
        cr_expect_gt(count, 900000, "the tiny model has about 0.95M weights (%zu)", count);
        cr_expect_lt(l2, 1e-5, "%s vs %s: final weights differ by %.3g (norm of the difference "
                               "over the weights' norm)",
                     pairs[k][0], pairs[k][1], l2);
        cr_expect_lt(worst[k], 1e-2, "%s vs %s: a final weight differs by %.3g relative",
                     pairs[k][0], pairs[k][1], worst[k]);
    }
    double base = fmax(worst[4], worst[5]);
    for (int k = 0; k < 4; k++)
        cr_expect_leq(worst[k], 2 * base,
                      "%s vs %s: largest difference %.3g, more than twice the unsharded runs' "
                      "own (%.3g)",
                      pairs[k][0], pairs[k][1], worst[k], base);
}

/* A tied embedding (tie_word_embeddings: the tiny model's config.json
 * changed, its lm_head no longer read) is written by the head first and by
 * the embedding's backward last, so with sharded gradients its segment has a
 * bucket of its own: 2 ranks x 2 micro-batches with the gradients sharded
 * follow the unsharded 2-rank run and the 1-rank run (4 micro-batches)
 * within 1e-5 relative per step, and their final weights within 1e-5 (norm
 * of the difference over the weights' norm). */
Test(distributed, sharded_gradients_with_tied_embeddings)
{
    char *cfg = tu_read_file(tu_fmt("%s/model/config.json", dir), NULL);
    cr_assert(cfg);
    char *at = strstr(cfg, "\"tie_word_embeddings\": false");
    cr_assert(at, "%s", cfg);
    cr_assert_eq(tu_sh(NULL, "cp -r %s/model %s/tied", dir, dir), 0);
    *at = 0;
    cr_assert_eq(tu_write_file(tu_fmt("%s/tied/config.json", dir),
                               tu_fmt("%s\"tie_word_embeddings\": true%s", cfg,
                                      at + SP_LEN("\"tie_word_embeddings\": false"))),
                 0);
    free(cfg);
    const struct {
        int ranks, mb, ga, shard;
        const char *name;
    } runs[] = {{0, 1, 4, 0, "tied-1"}, {2, 1, 2, 1, "tied-2"}, {2, 1, 2, 0, "tied-2-off"}};
    double ref[16];
    for (int r = 0; r < 3; r++) {
        char extra[1024], *out = NULL;
        snprintf(extra, sizeof extra,
                 "--set model.path=%s/tied --set train.mode=full --set train.micro_batch=%d "
                 "--set train.grad_accum=%d --set train.shard_gradients=%s",
                 dir, runs[r].mb, runs[r].ga, runs[r].shard ? "true" : "false");
        cr_assert_eq(train(runs[r].ranks, runs[r].name, extra, &out), 0, "%s", out);
        if (runs[r].shard)
            cr_expect(tu_contains(out, "optimizer state and gradients sharded"), "%s", out);
        free(out);
        double v[16];
        cr_assert_eq(losses(runs[r].name, v, 16), 6, "%s", runs[r].name);
        for (int i = 0; i < 6; i++) {
            if (r == 0)
                ref[i] = v[i];
            else
                cr_expect_lt(fabs(v[i] - ref[i]), 1e-5 * fabs(ref[i]),
                             "%s step %d: %.9f vs %.9f (1 rank)", runs[r].name, i + 1, v[i],
                             ref[i]);
        }
    }
    const char *pairs[][2] = {{"tied-2", "tied-2-off"}, {"tied-2", "tied-1"}};
    for (int k = 0; k < 2; k++) {
        double worst, l2;
        size_t count;
        rel_diffs(tu_fmt("%s/%s/model/model.safetensors", dir, pairs[k][0]),
                  tu_fmt("%s/%s/model/model.safetensors", dir, pairs[k][1]), &worst, &count,
                  &l2);
        cr_log_info("%s vs %s: final weights within %.3g (norm), %.3g (largest)", pairs[k][0],
                    pairs[k][1], l2, worst);
        cr_expect_lt(l2, 1e-5, "%s vs %s: final weights differ by %.3g", pairs[k][0],
                     pairs[k][1], l2);
    }
}
