/* Training on two GPUs: `mpirun -np 2 spotune train` with runtime.backend
 * cuda against the same run on the CPU backend over MPI (the reference, run
 * on every CI run by test_distributed), step by step:
 *  - LoRA, the gradient all-reduced in small buckets (comm.bucket_mb, several
 *    of them) on the second stream while the backward goes on;
 *  - LoRA with runtime.cuda_graphs: the all-reduce after the backward, the
 *    micro-batches replayed; the same sums as the overlapped run's;
 *  - QLoRA (model.quantize nf4) and DoRA with dropout, their adapters'
 *    gradients all-reduced;
 *  - full fine-tuning with the optimizer sharded 2 ways (ZeRO-1: the
 *    gradient reduce-scattered, AdamW on this rank's shard, the compute copy
 *    all-gathered);
 *  - full fine-tuning with the gradients sharded too (ZeRO-2: each finished
 *    layer's parts reduced to their owners in one NCCL group), with gradient
 *    accumulation; then the same run stopped at step 4 (a sharded checkpoint
 *    of two shards) and resumed on one GPU, which must carry on as the
 *    uninterrupted two-GPU run does;
 *  - the same on three ranks (shards padded to three, segments split three
 *    ways), where there is a third GPU;
 *  - a stop within a step (sharded gradients in flight): given up, resumed
 *    to the uninterrupted run's steps;
 *  - without a loadable NCCL (SPOTUNE_NCCL_LIBRARY naming a missing file):
 *    every rank names it and the run ends before a step.
 * Each rank trains half of every global batch, so a sum that is not one
 * (a collective that adds nothing, or adds twice, or a shard delivered to
 * the wrong rank) shows in the gradient norm of the first step already.
 *
 * Needs two CUDA devices (rank r takes device r): with fewer, main prints
 * why and exits 77 (skipped). On the emulated device (tests/cuda.cmake:
 * SPOTUNE_CUDA_EMU_DEVICES=2 and the emulated NCCL preloaded) it runs on
 * every CI run. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_test_main.h"
#include "test_util.h"

#define STEPS 8

static char *dir;

static void setup(void)
{
    char *out = NULL;
    dir = tu_tempdir("cuda-ranks");
    cr_assert(dir, "cannot create a directory under %s/tmp", tu_binary_dir());
    cr_assert_eq(tu_animals_task(dir, &out), 0, "%s", out);
    free(out);
    char *path = sp_strf("%s/base.yaml", dir);
    /* a constant schedule after warmup: the learning rate of a step does not
     * depend on train.steps, which the resumed run changes */
    char *cfg = sp_strf("run:\n  seed: 11\nmodel:\n  path: %s/model\n"
                        "train:\n  steps: %d\n  seq_len: 64\n  micro_batch: 4\n"
                        "  schedule: constant\n  warmup_steps: 2\n"
                        "lora:\n  r: 8\n  alpha: 16\n  dropout: 0.05\n"
                        "  targets: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                        "down_proj]\n"
                        "data:\n  train: %s/data.train.h5\n"
                        "log:\n  every: 1\nruntime:\n  threads: 1\n",
                        dir, STEPS, dir);
    cr_assert_eq(tu_write_file(path, cfg), 0);
    free(cfg);
    free(path);
}

static void teardown(void)
{
    if (dir)
        tu_rmtree(dir);
    free(dir);
    dir = NULL;
}

TestSuite(cuda_ranks, .init = setup, .fini = teardown, .timeout = 900);

/* ---- runs and their curves --------------------------------------------------------- */

typedef struct curve {
    int n;
    int step[STEPS];
    double loss[STEPS], gnorm[STEPS];
} curve;

/* The "train" records of RUN/metrics.jsonl. */
static void read_curve(const char *run, curve *c)
{
    char *path = sp_strf("%s/%s/metrics.jsonl", dir, run);
    char *text = tu_read_file(path, NULL);
    cr_assert(text, "no %s", path);
    memset(c, 0, sizeof *c);
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        json_error_t je;
        json_t *o = json_loads(line, 0, &je);
        cr_assert(o, "%s: %s", path, je.text);
        const char *ev = json_string_value(json_object_get(o, "event"));
        if (ev && !strcmp(ev, "train")) {
            cr_assert_lt(c->n, STEPS, "%s: more than %d steps", path, STEPS);
            c->step[c->n] = (int)json_integer_value(json_object_get(o, "step"));
            c->loss[c->n] = json_number_value(json_object_get(o, "loss"));
            c->gnorm[c->n] = json_number_value(json_object_get(o, "grad_norm"));
            c->n++;
        }
        json_decref(o);
    }
    free(text);
    free(path);
}

/* `spotune train base.yaml` on RANKS ranks with BACKEND into run.dir
 * DIR/NAME, MORE appended; its curve into c. */
static void train(int ranks, const char *backend, const char *name, const char *more, curve *c)
{
    char *out = NULL;
    int rc = tu_sh(&out,
                   "%s %s/spotune train %s/base.yaml --set run.dir=%s/%s "
                   "--set runtime.backend=%s %s",
                   tu_mpirun(ranks), tu_binary_dir(), dir, dir, name, backend, more);
    cr_assert_eq(rc, 0, "%s on %d ranks (%s): %s", name, ranks, backend, out);
    if (ranks > 1 && strcmp(backend, "cpu") != 0 && !cuda_test_standin()) {
        char *want = sp_strf("%d ranks, backend cuda", ranks);
        cr_assert(tu_contains(out, want), "%s: %s", name, out);
        free(want);
    }
    free(out);
    read_curve(name, c);
}

/* Per step: the losses within loss_tol and the gradient norms within
 * gnorm_tol of the reference's (relative); steps from..STEPS. */
static void expect_tracks(const char *what, const curve *got, const curve *want, int from,
                          double loss_tol, double gnorm_tol)
{
    int n = STEPS - from + 1;
    cr_assert_eq(got->n, n, "%s: %d steps logged, want %d", what, got->n, n);
    double worst_l = 0, worst_g = 0;
    for (int i = 0; i < n; i++) {
        int k = from - 1 + i; /* the reference's record of the same step */
        cr_assert_eq(got->step[i], want->step[k], "%s: record %d is step %d, want %d", what, i,
                     got->step[i], want->step[k]);
        double dl = fabs(got->loss[i] - want->loss[k]) / fabs(want->loss[k]);
        double dg = fabs(got->gnorm[i] - want->gnorm[k]) / fabs(want->gnorm[k]);
        worst_l = fmax(worst_l, dl);
        worst_g = fmax(worst_g, dg);
        cr_expect_lt(dl, loss_tol, "%s: step %d loss %.6f, want %.6f", what, got->step[i],
                     got->loss[i], want->loss[k]);
        cr_expect_lt(dg, gnorm_tol, "%s: step %d gradient norm %.6f, want %.6f", what,
                     got->step[i], got->gnorm[i], want->gnorm[k]);
    }
    fprintf(stderr,
            "%s: steps %d-%d, loss %.4f -> %.4f (want %.4f -> %.4f), largest differences: "
            "loss %.2e, gradient norm %.2e\n",
            what, from, STEPS, got->loss[0], got->loss[n - 1], want->loss[from - 1],
            want->loss[STEPS - 1], worst_l, worst_g);
}

/* Against the CPU: bf16 activations and another summation order. Measured
 * on the emulated device (docs/cuda.md): at most 0.1% in the loss and 0.5%
 * in the gradient norm over these 8 steps; a sum over ranks that is wrong
 * moves the gradient norm by tens of percent. */
#define LOSS_TOL 0.01
#define GNORM_TOL 0.03

static void cpu_and_cuda_on(int ranks, const char *tag, const char *more, curve *cuda)
{
    curve cpu;
    char name[64];
    snprintf(name, sizeof name, "%s-cpu", tag);
    train(ranks, "cpu", name, more, &cpu);
    snprintf(name, sizeof name, "%s-cuda", tag);
    train(ranks, cuda_test_backend(), name, more, cuda);
    char what[96];
    snprintf(what, sizeof what, "%s, %d ranks, cuda against cpu", tag, ranks);
    expect_tracks(what, cuda, &cpu, 1, LOSS_TOL, GNORM_TOL);
    cr_expect_lt(cuda->loss[STEPS - 1], cuda->loss[0] - 0.1, "%s: the loss did not fall", tag);
}

static void cpu_and_cuda(const char *tag, const char *more, curve *cuda)
{
    cpu_and_cuda_on(2, tag, more, cuda);
}

Test(cuda_ranks, lora_overlapped_buckets_and_graphs)
{
    static const char *lora = "--set train.mode=lora --set train.lr=3e-3 "
                              "--set comm.bucket_mb=0.0625";
    curve eager, graphs;
    cpu_and_cuda("lora", lora, &eager);
    /* the same sums after the backward instead of during it */
    char *more = sp_strf("%s --set runtime.cuda_graphs=true", lora);
    train(2, cuda_test_backend(), "lora-graphs", more, &graphs);
    free(more);
    expect_tracks("lora, 2 ranks, cuda graphs against eager", &graphs, &eager, 1, 1e-5, 1e-5);
}

Test(cuda_ranks, qlora_and_dora)
{
    curve q, d;
    cpu_and_cuda("qlora", "--set train.mode=lora --set train.lr=3e-3 --set model.quantize=nf4", &q);
    cpu_and_cuda("dora",
                 "--set train.mode=lora --set train.lr=3e-3 --set lora.dora=true "
                 "--set lora.dropout=0.05",
                 &d);
}

Test(cuda_ranks, full_sharded_optimizer)
{
    curve cuda;
    cpu_and_cuda("zero1",
                 "--set train.mode=full --set train.lr=1e-3 --set train.shard_optimizer=true "
                 "--set train.shard_gradients=false",
                 &cuda);
}

Test(cuda_ranks, full_sharded_gradients_then_resumed_on_one_gpu)
{
    static const char *zero2 = "--set train.mode=full --set train.lr=1e-3 "
                               "--set train.shard_optimizer=true "
                               "--set train.shard_gradients=true --set train.micro_batch=2 "
                               "--set train.grad_accum=2";
    curve whole, first, rest;
    cpu_and_cuda("zero2", zero2, &whole);

    /* stopped at step 4 (a checkpoint of two shards), resumed on one rank:
     * the same global batch of 8 windows, now 4 micro-batches of 2 on one
     * GPU (grad_accum re-derived from the checkpoint) */
    char *more = sp_strf("%s --set train.steps=4", zero2);
    train(2, cuda_test_backend(), "zero2-stop", more, &first);
    free(more);
    char *shard = sp_strf("%s/zero2-stop/checkpoints/step-00000004/shard-00001-of-00002.h5", dir);
    cr_assert_eq(access(shard, R_OK), 0, "no %s: not a sharded checkpoint", shard);
    free(shard);
    train(1, cuda_test_backend(), "zero2-stop", zero2, &rest); /* the resume */
    /* the run's metrics.jsonl holds both legs: the resumed one's records
     * follow the first's */
    cr_assert_eq(rest.n, STEPS, "steps 1-4 and 5-%d logged: %d records", STEPS, rest.n);
    curve resumed = {.n = STEPS - 4};
    for (int i = 0; i < resumed.n; i++) {
        resumed.step[i] = rest.step[4 + i];
        resumed.loss[i] = rest.loss[4 + i];
        resumed.gnorm[i] = rest.gnorm[4 + i];
    }
    expect_tracks("zero2, stopped at 4 on 2 ranks and resumed on 1, against the 2-rank run",
                  &resumed, &whole, 5, LOSS_TOL, GNORM_TOL);
}

/* A stop within a step on two GPUs with sharded gradients: SIGUSR1 to
 * mpirun once step 2 is logged, each step 6 micro-batches whose segments
 * are reduced on the second stream as the backward goes. The ranks agree
 * between micro-batches and give step 3 up (the reductions in flight
 * waited for, nothing applied); the stop's checkpoint is step 2, and the
 * resumed run's step 3 is the uninterrupted run's (bit-identical on
 * the emulated device; within 1e-6 allowed for a GPU's). */
Test(cuda_ranks, a_stop_within_a_step_gives_it_up_and_resumes)
{
    static const char *zero2 = "--set train.mode=full --set train.lr=1e-3 "
                               "--set train.shard_optimizer=true --set train.shard_gradients=true "
                               "--set train.micro_batch=1 --set train.grad_accum=6 "
                               "--set train.steps=3";
    curve whole, cut;
    train(2, cuda_test_backend(), "within-whole", zero2, &whole);
    char *log = sp_strf("%s/within-cut.log", dir);
    char *metrics = sp_strf("%s/within-cut/metrics.jsonl", dir);
    int pid = tu_spawn(log, "%s %s/spotune train %s/base.yaml --set run.dir=%s/within-cut "
                            "--set runtime.backend=%s %s",
                       tu_mpirun(2), tu_binary_dir(), dir, dir, cuda_test_backend(), zero2);
    for (int i = 0; i < 24000; i++) {
        char *text = tu_read_file(metrics, NULL);
        int seen = tu_contains(text, "\"step\":2,");
        free(text);
        if (seen)
            break;
        tu_sleep(0.01);
    }
    kill(pid, SIGUSR1);
    int rc = tu_wait(pid, 300);
    char *text = tu_read_file(log, NULL);
    cr_assert_eq(rc, 75, "exit %d after SIGUSR1: %s", rc, text);
    cr_expect(tu_contains(text, "step 3 is given up after"), "step 3 was not given up: %s",
              text);
    cr_expect(tu_contains(text, "stopped by a signal after committing checkpoint step 2"), "%s",
              text);
    free(text);
    free(log);
    free(metrics);
    train(2, cuda_test_backend(), "within-cut", zero2, &cut); /* the resume */
    cr_assert_eq(cut.n, 3, "steps 1-2 and 3 logged: %d records", cut.n);
    for (int i = 0; i < 3; i++) {
        double dl = fabs(cut.loss[i] - whole.loss[i]) / fabs(whole.loss[i]);
        double dg = fabs(cut.gnorm[i] - whole.gnorm[i]) / fabs(whole.gnorm[i]);
        cr_expect(dl <= 1e-6 && dg <= 1e-6,
                  "step %d: loss %.9g vs %.9g, gradient norm %.9g vs %.9g", i + 1, cut.loss[i],
                  whole.loss[i], cut.gnorm[i], whole.gnorm[i]);
    }
}

/* Three ranks, ZeRO-2: the arena padded to three equal shards, segments
 * whose parts go to three owners in one NCCL group. Needs a third GPU. */
Test(cuda_ranks, full_sharded_gradients_on_three_ranks)
{
    char why[512];
    if (!cuda_test_standin() && backend_cuda_probe(why, sizeof why) < 3)
        cr_skip_test("3 ranks need 3 CUDA devices, this machine has %d",
                     backend_cuda_probe(why, sizeof why));
    curve cuda;
    cpu_and_cuda_on(3, "zero2-3",
                    "--set train.mode=full --set train.lr=1e-3 --set train.shard_optimizer=true "
                    "--set train.shard_gradients=true --set train.micro_batch=2 "
                    "--set train.grad_accum=1",
                    &cuda);
}

/* Two ranks on CUDA without a loadable NCCL: every rank names the library
 * and what to do, and the run ends non-zero before a step (here NCCL is
 * pointed at a file that does not exist; the emulated one is not preloaded
 * for this run). */
Test(cuda_ranks, a_missing_nccl_is_named_by_every_rank)
{
    if (cuda_test_standin())
        cr_skip_test("the stand-in backend uses no NCCL");
    char *out = NULL;
    int rc = tu_sh(&out,
                   "env -u LD_PRELOAD SPOTUNE_NCCL_LIBRARY=/nonexistent/libnccl.so.2 %s "
                   "%s/spotune train %s/base.yaml --set run.dir=%s/no-nccl "
                   "--set runtime.backend=%s --set train.mode=lora",
                   tu_mpirun(2), tu_binary_dir(), dir, dir, cuda_test_backend());
    cr_expect_neq(rc, 0, "%s", out);
    for (int r = 0; r < 2; r++) {
        char *want = sp_strf("rank %d on", r);
        cr_expect(tu_contains(out, want), "rank %d said nothing: %s", r, out);
        free(want);
    }
    cr_expect(tu_contains(out, "2 ranks on CUDA sharing gradients need NCCL, which could not "
                               "be loaded: /nonexistent/libnccl.so.2") &&
                  tu_contains(out, "SPOTUNE_NCCL_LIBRARY"),
              "%s", out);
    cr_expect(!tu_contains(out, "step      1"), "a step ran: %s", out);
    free(out);
}

/* A rank stuck inside a collective (its GPU hung: alive, so the launcher
 * sees nothing) while the other's GPU waits for it: NCCL reports nothing,
 * and the host waiting for that GPU would wait for ever. The watchdog
 * watches those waits (the backend's syncs and copies, the NCCL calls,
 * comm_device_wait): after comm.timeout_s the job ends non-zero, naming
 * the wait. The emulated NCCL stops rank 1 in its 4th collective
 * (SPOTUNE_NCCL_EMU_STALL) and, as NCCL, waits for ever for a missing
 * peer (SPOTUNE_NCCL_EMU_TIMEOUT_S=never); a run that hangs is cut at
 * 240 s and fails. */
Test(cuda_ranks, a_peer_stuck_in_a_collective_ends_the_job)
{
    const char *module = getenv("SPOTUNE_CUDA_MODULE");
    if (cuda_test_standin() || !module || !*module)
        cr_skip_test("needs the emulated NCCL, which can stop a rank in a collective");
    char *out = NULL;
    double t0 = sp_now();
    int rc = tu_sh(&out,
                   "SPOTUNE_NCCL_EMU_STALL=1:4 SPOTUNE_NCCL_EMU_TIMEOUT_S=never "
                   "timeout -k 10 240 %s %s/spotune train %s/base.yaml --set run.dir=%s/stuck "
                   "--set runtime.backend=cuda --set comm.timeout_s=5",
                   tu_mpirun(2), tu_binary_dir(), dir, dir);
    double secs = sp_now() - t0;
    cr_expect(rc != 0 && rc != 124 && rc != 137, "exit %d after %.0f s: %s", rc, secs, out);
    cr_expect(tu_contains(out, "rank 1 stalls in its collective 4"), "no stall: %s", out);
    cr_expect(tu_contains(out, "the wait for the GPU's work (") &&
                  tu_contains(out, "timed out after 5 s (a peer may have died)"),
              "the watchdog did not name the wait: %s", out);
    /* start-up of two ranks on the emulated device, a step or two, the 5 s
     * and the roll call and teardown, on a loaded machine */
    cr_expect_lt(secs, 150.0, "took %.0f s: %s", secs, out);
    free(out);
}

/* The first step pays one-time costs that the host waits for (NCCL
 * connecting its channels on the first collective, cuDNN and cuBLASLt
 * planning), unevenly over the ranks: the watchdog gives it at least 300 s
 * whatever comm.timeout_s says. Rank 1's first collective is held 12 s with
 * comm.timeout_s=5: the run must finish, where a later step held as long
 * ends the job (the test above). (5 s, not less: on the emulated device a
 * whole step's work runs while the host waits for its loss.) */
Test(cuda_ranks, a_slow_first_step_is_not_taken_for_a_stuck_peer)
{
    const char *module = getenv("SPOTUNE_CUDA_MODULE");
    if (cuda_test_standin() || !module || !*module)
        cr_skip_test("needs the emulated NCCL, which can hold a rank in a collective");
    char *out = NULL;
    int rc = tu_sh(&out,
                   "SPOTUNE_NCCL_EMU_STALL=1:1:12 "
                   "timeout -k 10 240 %s %s/spotune train %s/base.yaml --set run.dir=%s/slow1 "
                   "--set runtime.backend=cuda --set comm.timeout_s=5 --set train.steps=2",
                   tu_mpirun(2), tu_binary_dir(), dir, dir);
    cr_expect(tu_contains(out, "rank 1 holds its collective 1 for 12 s"), "not held: %s", out);
    cr_expect_eq(rc, 0, "exit %d: %s", rc, out);
    cr_expect(!tu_contains(out, "timed out"), "%s", out);
    free(out);
}

/* ---- main: two devices or skipped (77) ---------------------------------------------- */

int main(int argc, char *argv[])
{
    char why[512];
    int n = backend_cuda_probe(why, sizeof why);
    if (!cuda_test_standin() && n == 1) {
        const char *module = getenv("SPOTUNE_CUDA_MODULE");
        if (module && *module) { /* the emulated device was set up for two */
            printf("FAILED: SPOTUNE_CUDA_MODULE=%s gives 1 device, this suite needs 2 "
                   "(SPOTUNE_CUDA_EMU_DEVICES=2)\n",
                   module);
            return 1;
        }
        printf("skipped: this suite needs 2 CUDA devices, this machine has 1\n");
        return CUDA_TEST_SKIPPED;
    }
    return cuda_test_main(argc, argv); /* none: skips naming the CUDA error */
}
