/* The NCCL paths of training on one GPU, through the trainer's own code
 * (trainer/grad_sync.c) and a real one-rank NCCL communicator
 * (comm_opts.nccl_world_of_one), against the same step with communication
 * off (a world of one: no collective at all):
 *  - the bucketed all-reduce with overlap on: the model's grads_ready hook
 *    hands buckets to NCCL on the backend's second stream while the backward
 *    goes on (a spy on the hook sees buckets launched before the backward's
 *    end), then the compute stream waits for them; LoRA and full fine-tuning
 *    of the small preset, with 1 MiB and 25 MiB buckets;
 *  - the sharded optimizer's two collectives (grad_sync_reduce_scatter and
 *    grad_sync_allgather, which its path calls): the F32 gradient arena
 *    reduce-scattered into a separate shard buffer, AdamW from it, and the
 *    bf16 compute copy all-gathered in place.
 * With one rank a sum is the value itself, so the gradients, the updated
 * masters and the compute copy must equal the comm-off run's, bit for bit
 * (every kernel is deterministic, docs/cuda.md).
 * What one GPU cannot show: a sum over two ranks, the reduce-scatter of
 * blocks to different ranks, a gather from a peer (docs/cuda.md says what a
 * two-GPU check would be).
 * Without a usable CUDA device main prints "skipped: no usable CUDA device: "
 * and the CUDA error, and exits 77 (cuda_test_main.h). */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "cuda_test_main.h"
#include "test_util.h"
#include "trainer/grad_sync.h"
#include "trainer/model.h"
#include "trainer/optim.h"


TestSuite(cuda_comm, .timeout = 300);

/* ---- fixtures --------------------------------------------------------------------- */

typedef struct run {
    backend_t *be;
    model_t *m;
    comm_t *comm;
} run;

/* The small preset at seq 256; with SPOTUNE_TEST_SHAPES=reduced (the
 * emulated device) the tiny preset at seq 64, its buckets 64 times smaller
 * so that several still overlap the backward. */
static const int B = 2;
static int T = 256;

static double bucket(double mib)
{
    return cuda_test_reduced_shapes() ? mib / 64 : mib;
}

static void open_run(run *r, int mode, int nccl)
{
    sp_err err = {0};
    model_config_t mc;
    memset(r, 0, sizeof *r);
    comm_opts co = {.timeout_s = 120, .nccl_world_of_one = nccl};
    cr_assert_eq(comm_init(&r->comm, NULL, NULL, &co, &err), 0, "%s", err.msg);
    cr_assert_eq(comm_size(r->comm), 1, "run this test without mpirun");
    cr_assert_eq(backend_create(&r->be, "cuda", 0, 1, &err), 0, "%s", err.msg);
    if (nccl) {
        cr_assert_eq(comm_device_init(r->comm, r->be->device, &err), 0, "%s", err.msg);
        cr_assert(comm_device_collectives(r->comm), "a one-rank NCCL communicator was asked for");
        /* again on the same device (spotune bench's second mode): kept;
         * on another: refused by name */
        cr_assert_eq(comm_device_init(r->comm, r->be->device, &err), 0, "%s", err.msg);
        cr_expect_neq(comm_device_init(r->comm, r->be->device + 1, &err), 0);
        cr_expect(strstr(err.msg, "asked for device"), "%s", err.msg);
        err = (sp_err){0};
    } else {
        cr_assert(!comm_device_collectives(r->comm), "a world of one has no collectives");
    }
    T = cuda_test_reduced_shapes() ? 64 : 256;
    cr_assert_eq(model_config_preset(&mc, cuda_test_reduced_shapes() ? "tiny" : "small"), 0);
    model_opts o = {.mode = mode, .lora_r = 16, .lora_alpha = 32.0,
                    .lora_targets = (1 << PROJ_COUNT) - 1, .max_batch = B, .seq_len = T,
                    .seed = 1};
    cr_assert_eq(model_create(&r->m, r->be, &mc, &o, &err), 0, "%s", err.msg);
    model_init_base_random(r->m, 3);
    if (mode == MODE_LORA) { /* B random too, so that every LoRA gradient is non-zero */
        model_init_lora(r->m, 3);
        for (int i = 0; i < r->m->nparams; i++) {
            param_t *p = &r->m->params[i];
            if (p->kind == PK_LORA_B)
                be_fill_normal(r->be, p->master, p->n, 0.0f, 0.02f, 50 + (uint64_t)i,
                               0);
        }
        be_copy(r->be, r->m->copy, r->m->master);
    }
}

static void close_run(run *r)
{
    sp_err err = {0};
    cr_expect_eq(be_check(r->be, &err), 0, "%s", err.msg);
    model_destroy(r->m);
    backend_destroy(r->be);
    comm_finalize(r->comm);
}

static void expect_same(const char *what, const float *got, const float *want, size_t n)
{
    size_t differ = 0;
    for (size_t i = 0; i < n; i++)
        differ += memcmp(&got[i], &want[i], sizeof(float)) != 0;
    double e = tu_rel_err(got, want, n);
    cr_expect(differ == 0, "%s: NCCL run differs from comm off by %.3g (%zu of %zu values)",
              what, e, differ, n);
    fprintf(stderr, "%s: %zu of %zu values differ, largest %.2e\n", what, differ, n, e);
}

/* A spy on the model's grads_ready hook: calls grad_sync's own, and records
 * how much of the arena had been handed to NCCL at each call. */
typedef struct spy {
    model_grads_ready_fn inner;
    void *inner_ctx;
    grad_sync_t *gs;
    int calls;
    size_t launched_before_last; /* handed to NCCL by the hook call before the last */
} spy;

static void spy_hook(void *ctx, size_t upto)
{
    spy *s = ctx;
    s->launched_before_last = s->gs->launched;
    s->inner(s->inner_ctx, upto);
    s->calls++;
}

/* One training step as bench.c and train.c take it: the backward with the
 * gradient sync, its norm, AdamW, the sharded gather (nothing unsharded). */
static void step(run *r, double bucket_mb, spy *sp)
{
    sp_err err = {0};
    int32_t *in = malloc(sizeof(int32_t) * B * T), *tg = malloc(sizeof(int32_t) * B * T);
    for (int i = 0; i < B * T; i++) {
        in[i] = (int32_t)(sp_rng_u64(31, (uint64_t)i) % (uint64_t)r->m->mc.vocab);
        tg[i] = (int32_t)(sp_rng_u64(32, (uint64_t)i) % (uint64_t)r->m->mc.vocab);
    }
    uint64_t ids[2] = {0, 1};
    model_batch b = {.inputs = in,
                     .targets = tg,
                     .sample_ids = ids,
                     .B = B,
                     .T = T,
                     .grad_scale = 1.0f / (float)(B * T),
                     .last = 1};
    grad_sync_t gs;
    double loss = 0, sumsq = 0;
    model_zero_grads(r->m);
    grad_sync_begin(&gs, r->m, r->comm, bucket(bucket_mb));
    int nccl = comm_device_collectives(r->comm);
    cr_expect_eq(gs.overlap, nccl && !r->m->o.graphs, "overlap %s with %s%s",
                 gs.overlap ? "on" : "off", nccl ? "a one-rank NCCL communicator" : "comm off",
                 r->m->o.graphs ? " and graphs" : "");
    if (sp && gs.overlap) {
        memset(sp, 0, sizeof *sp);
        sp->inner = r->m->grads_ready;
        sp->inner_ctx = r->m->grads_ready_ctx;
        sp->gs = &gs;
        r->m->grads_ready = spy_hook;
        r->m->grads_ready_ctx = sp;
    }
    cr_assert_eq(model_forward_backward(r->m, &b, &loss, &err), 0, "%s", err.msg);
    cr_assert_eq(grad_sync_finish(&gs, &err), 0, "%s", err.msg);
    if (gs.overlap)
        cr_expect_eq(gs.launched, r->m->n_trainable, "every bucket handed to NCCL: %zu of %zu",
                     gs.launched, r->m->n_trainable);
    cr_assert_eq(grad_sync_sumsq(r->m, r->comm, &sumsq, &err), 0, "%s", err.msg);
    adamw_args a = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                    .weight_decay = 0.01f, .step = 1};
    a.grad_scale = (float)optim_clip_scale(sqrt(sumsq), 1.0);
    model_adamw(r->m, &a);
    cr_assert_eq(grad_sync_gather_weights(r->m, r->comm, &err), 0, "%s", err.msg);
    cr_assert_eq(be_check(r->be, &err), 0, "%s", err.msg);
    free(in);
    free(tg);
}

/* ---- the overlapped all-reduce ------------------------------------------------------- */

static void check_overlap(int mode, double bucket_mb)
{
    const char *what = mode == MODE_LORA ? "LoRA" : "full";
    run off, on;
    spy sp;
    open_run(&off, mode, 0);
    step(&off, bucket_mb, NULL);
    float *g0 = tu_download(off.be, off.m->grad), *m0 = tu_download(off.be, off.m->master);
    float *c0 = tu_download(off.be, off.m->copy);
    size_t n = off.m->n_trainable;
    close_run(&off);

    open_run(&on, mode, 1);
    step(&on, bucket_mb, &sp);
    cr_expect_gt(sp.calls, 1, "the hook ran %d times", sp.calls);
    cr_expect_gt(sp.launched_before_last, 0,
                 "%s: no bucket reached NCCL before the backward's end (overlap)", what);
    fprintf(stderr, "%s, %g MiB buckets: %zu trainable, hook called %d times, %zu elements "
                    "handed to NCCL before the last call\n",
            what, bucket(bucket_mb), n, sp.calls, sp.launched_before_last);
    float *g1 = tu_download(on.be, on.m->grad), *m1 = tu_download(on.be, on.m->master);
    float *c1 = tu_download(on.be, on.m->copy);
    char buf[160];
    snprintf(buf, sizeof buf, "%s %g MiB: gradients after the all-reduce", what, bucket_mb);
    expect_same(buf, g1, g0, n);
    snprintf(buf, sizeof buf, "%s %g MiB: masters after AdamW", what, bucket_mb);
    expect_same(buf, m1, m0, n);
    snprintf(buf, sizeof buf, "%s %g MiB: bf16 compute copy after AdamW", what, bucket_mb);
    expect_same(buf, c1, c0, n);
    close_run(&on);
    free(g0), free(m0), free(c0), free(g1), free(m1), free(c1);
}

Test(cuda_comm, overlapped_allreduce_lora_small_buckets)
{
    check_overlap(MODE_LORA, 1.0);
}

/* runtime.cuda_graphs with NCCL: the all-reduce after the backward instead
 * of overlapped, so the step's one micro-batch replays a graph from the
 * second step; three steps give what three overlapped eager steps give. */
Test(cuda_comm, graphs_reduce_after_the_backward_and_replay)
{
    run eager, graphs;
    open_run(&eager, MODE_LORA, 1);
    for (int s = 0; s < 3; s++)
        step(&eager, 1.0, NULL);
    float *m0 = tu_download(eager.be, eager.m->master);
    size_t n = eager.m->n_trainable;
    close_run(&eager);
    open_run(&graphs, MODE_LORA, 1);
    graphs.m->o.graphs = 1;
    for (int s = 0; s < 3; s++)
        step(&graphs, 1.0, NULL);
    cr_expect_str_empty(graphs.m->graph_off, "graphs turned off: %s", graphs.m->graph_off);
    cr_expect_eq(graphs.m->graph_mb.captures, 1, "%zu captures", graphs.m->graph_mb.captures);
    cr_expect_eq(graphs.m->graph_mb.replays, 2, "%zu replays", graphs.m->graph_mb.replays);
    float *m1 = tu_download(graphs.be, graphs.m->master);
    expect_same("LoRA, graphs and NCCL after the backward: masters after 3 steps", m1, m0, n);
    close_run(&graphs);
    free(m0), free(m1);
}

Test(cuda_comm, overlapped_allreduce_full_default_buckets)
{
    check_overlap(MODE_FULL, 25.0);
}

/* ---- the sharded optimizer's collectives ------------------------------------------------ */

Test(cuda_comm, sharded_reduce_scatter_and_allgather_one_rank)
{
    sp_err err = {0};
    run off, on;
    open_run(&off, MODE_FULL, 0);
    step(&off, 25.0, NULL);
    float *g0 = tu_download(off.be, off.m->grad), *m0 = tu_download(off.be, off.m->master);
    float *c0 = tu_download(off.be, off.m->copy);
    size_t n = off.m->n_trainable;
    close_run(&off);

    /* the same step, its gradient reduce-scattered through NCCL into a
     * separate buffer (as grad_shard is), AdamW from that, then the compute
     * copy all-gathered in place */
    open_run(&on, MODE_FULL, 1);
    run *r = &on;
    int32_t *in = malloc(sizeof(int32_t) * B * T), *tg = malloc(sizeof(int32_t) * B * T);
    for (int i = 0; i < B * T; i++) {
        in[i] = (int32_t)(sp_rng_u64(31, (uint64_t)i) % (uint64_t)r->m->mc.vocab);
        tg[i] = (int32_t)(sp_rng_u64(32, (uint64_t)i) % (uint64_t)r->m->mc.vocab);
    }
    uint64_t ids[2] = {0, 1};
    model_batch b = {.inputs = in, .targets = tg, .sample_ids = ids, .B = B, .T = T, .grad_scale = 1.0f / (float)(B * T), .last = 1};
    double loss = 0;
    model_zero_grads(r->m);
    cr_assert_eq(model_forward_backward(r->m, &b, &loss, &err), 0, "%s", err.msg);
    tensor_t shard = be_alloc(r->be, DT_F32, n);
    cr_assert(shard.p);
    cr_assert_eq(grad_sync_reduce_scatter(r->be, r->comm, r->m->grad, shard, n, &err), 0, "%s",
                 err.msg);
    float *s1 = tu_download(r->be, shard);
    float *g1 = tu_download(r->be, r->m->grad);
    expect_same("reduce-scatter: the shard holds the gradient", s1, g0, n);
    expect_same("reduce-scatter: the gradient arena is left as it was", g1, g0, n);
    double sumsq = be_sumsq(r->be, shard, n);
    adamw_args a = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                    .weight_decay = 0.01f, .step = 1};
    a.grad_scale = (float)optim_clip_scale(sqrt(sumsq), 1.0);
    be_copy(r->be, r->m->grad, shard); /* AdamW reads the arena */
    model_adamw(r->m, &a);
    cr_assert_eq(grad_sync_allgather(r->be, r->comm, r->m->copy, 0, n, &err), 0, "%s", err.msg);
    float *m1 = tu_download(r->be, r->m->master), *c1 = tu_download(r->be, r->m->copy);
    expect_same("AdamW from the shard: masters", m1, m0, n);
    expect_same("all-gather in place (bf16): the compute copy", c1, c0, n);
    be_free(r->be, &shard);
    close_run(&on);
    free(in), free(tg);
    free(g0), free(m0), free(c0), free(s1), free(g1), free(m1), free(c1);
}

/* ZeRO-2's per-segment reductions go to NCCL as one group
 * (comm_device_group_begin/end): on one rank each reduction is its input, so
 * three grouped reductions to root 0 of different lengths leave their
 * buffers as they were; a second begin inside a group and an end outside
 * one change nothing. */
Test(cuda_comm, grouped_reductions_one_rank)
{
    sp_err err = {0};
    comm_t *comm;
    backend_t *be;
    comm_opts co = {.timeout_s = 120, .nccl_world_of_one = 1};
    cr_assert_eq(comm_init(&comm, NULL, NULL, &co, &err), 0, "%s", err.msg);
    cr_assert_eq(backend_create(&be, "cuda", 0, 1, &err), 0, "%s", err.msg);
    cr_assert_eq(comm_device_init(comm, be->device, &err), 0, "%s", err.msg);
    static const size_t lens[3] = {1, 4099, 1 << 20};
    tensor_t buf[3];
    float *want[3];
    for (int i = 0; i < 3; i++) {
        want[i] = malloc(sizeof(float) * lens[i]);
        for (size_t k = 0; k < lens[i]; k++)
            want[i][k] = (float)sp_rng_uniform(70 + (uint64_t)i, k) - 0.5f;
        buf[i] = be_alloc(be, DT_F32, lens[i]);
        be_upload(be, buf[i], want[i], DT_F32);
    }
    cr_assert_eq(comm_device_group_begin(comm, &err), 0, "%s", err.msg);
    cr_assert_eq(comm_device_group_begin(comm, &err), 0, "%s", err.msg);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(comm_device_reduce(comm, buf[i].p, lens[i], COMM_F32, COMM_SUM, 0,
                                        be->stream, &err),
                     0, "%s", err.msg);
    cr_assert_eq(comm_device_group_end(comm, &err), 0, "%s", err.msg);
    cr_assert_eq(comm_device_group_end(comm, &err), 0, "%s", err.msg);
    cr_assert_eq(comm_device_wait(comm, be->stream, &err), 0, "%s", err.msg);
    for (int i = 0; i < 3; i++) {
        float *got = tu_download(be, buf[i]);
        expect_same("a grouped reduction over one rank", got, want[i], lens[i]);
        free(got);
        free(want[i]);
        be_free(be, &buf[i]);
    }
    cr_expect_eq(be_check(be, &err), 0, "%s", err.msg);
    backend_destroy(be);
    comm_finalize(comm);
}

/* ---- main: skip (77, with the CUDA error) without a usable device ------------------ */

int main(int argc, char *argv[])
{
    char why[512];
    if (backend_cuda_probe(why, sizeof why) > 0 && !comm_device_available()) {
        printf("skipped: this build's comm module has no NCCL\n");
        return CUDA_TEST_SKIPPED;
    }
    return cuda_test_main(argc, argv); /* no usable device: skips naming the CUDA error */
}
