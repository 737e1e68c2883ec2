/* Launch traces and captured spans (kernels/backend.h, be_trace and
 * be_graph) on the CPU backend, whose captured span is the recorded op list
 * with the same rules as a CUDA graph:
 *  - a trace's digest is the same for the same launches and changes with
 *    any argument (a scalar, a tensor's address, size or dtype, an op);
 *    a dry trace runs nothing, at its barriers neither (copies, sync,
 *    sumsq, fences; alloc and free do run); barriers are counted and named;
 *  - a captured span runs nothing until launched, then runs its ops with the
 *    arguments they were captured with, reading device memory as it is at
 *    launch; a barrier inside a capture fails it with the barrier's name
 *    and leaves the sticky error clean;
 *  - training with model_opts.graphs (runtime.cuda_graphs) gives the same
 *    bits as without, every step: LoRA with dropout, DoRA, QLoRA (NF4
 *    weights dequantized in the step), full fine-tuning, packed documents,
 *    recomputation, gradient accumulation, a token count
 *    (the loss gradient's scale) that changes every step, and a micro-batch
 *    of another shape; and it does replay: every micro-batch of the usual
 *    shape after the second replays one graph, and every update after the
 *    second (model_update: its values in device memory);
 *  - an update whose gradient is NaN changes nothing; a refused capture
 *    turns graphs off and the run goes on eagerly, the same bits; full
 *    fine-tuning twice gives the same bits; model_update refuses a sharded
 *    optimizer;
 *  - the loss taken once a step (model_loss_take) is the micro-batches'
 *    losses taken one by one, bit for bit, and an evaluation keeps its own.
 * Tolerance: exact (bit for bit) throughout; the CPU backend is
 * deterministic for a fixed thread count. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/base.h"
#include "graphs_util.h"
#include "kernels/backend.h"
#include "trainer/config.h"
#include "trainer/model.h"
#include "trainer/model_config.h"

static backend_t *cpu(void)
{
    backend_t *be;
    sp_err err = {0};
    cr_assert_eq(backend_create(&be, "cpu", 0, 2, &err), 0, "%s", err.msg);
    return be;
}

static void fill(backend_t *be, tensor_t t, float base)
{
    float *h = malloc(sizeof(float) * t.n);
    for (size_t i = 0; i < t.n; i++)
        h[i] = base + 0.25f * (float)(i % 7);
    be_upload(be, t, h, DT_F32);
    free(h);
}

/* y = 2 x + y; z = y x^T (a 4 x 4 product) */
static void ops(backend_t *be, tensor_t x, tensor_t y, tensor_t z, float alpha)
{
    be_add(be, y, x, alpha, x.n);
    be_matmul(be, z, y, x, 4, 4, 4, 0, 1, 1.0f, 0.0f);
}

static uint64_t digest_of(backend_t *be, tensor_t x, tensor_t y, tensor_t z, float alpha)
{
    be_trace t;
    be_trace_start(be, &t, 1);
    ops(be, x, y, z, alpha);
    be_trace_stop(be);
    cr_assert_eq(t.ops, 2, "two ops traced, got %zu", t.ops);
    cr_assert_eq(t.barriers, 0);
    return t.digest;
}

Test(trace, the_digest_is_the_launch_and_a_dry_trace_runs_nothing)
{
    backend_t *be = cpu();
    tensor_t x = be_alloc(be, DT_F32, 16), y = be_alloc(be, DT_F32, 16),
             z = be_alloc(be, DT_F32, 16), w = be_alloc(be, DT_F32, 32);
    fill(be, x, 1.0f);
    fill(be, y, -1.0f);
    float before[16], after[16];
    be_download(be, before, DT_F32, y);
    uint64_t d = digest_of(be, x, y, z, 2.0f);
    be_download(be, after, DT_F32, y);
    cr_assert_eq(memcmp(before, after, sizeof before), 0, "a dry trace ran an op");
    cr_assert_eq(digest_of(be, x, y, z, 2.0f), d, "the same launches, another digest");
    cr_assert_neq(digest_of(be, x, y, z, 2.5f), d, "a scalar changed, the digest did not");
    cr_assert_neq(digest_of(be, tensor_view(w, 0, 16), y, z, 2.0f), d,
                  "an address changed, the digest did not");
    cr_assert_neq(digest_of(be, x, y, z, 2.0f), digest_of(be, y, x, z, 2.0f),
                  "swapped operands, one digest");
    /* an op more */
    be_trace t;
    be_trace_start(be, &t, 1);
    ops(be, x, y, z, 2.0f);
    be_zero(be, z);
    be_trace_stop(be);
    cr_assert_neq(t.digest, d);
    cr_assert_eq(t.ops, 3);
    be_free(be, &x);
    be_free(be, &y);
    be_free(be, &z);
    be_free(be, &w);
    backend_destroy(be);
}

Test(trace, barriers_are_counted_and_the_first_is_named)
{
    backend_t *be = cpu();
    tensor_t x = be_alloc(be, DT_F32, 16), y = be_alloc(be, DT_F32, 16),
             z = be_alloc(be, DT_F32, 16);
    float h[16] = {0};
    be_trace t;
    be_trace_start(be, &t, 0);
    ops(be, x, y, z, 1.0f);
    be_h2d(be, x.p, h, sizeof h);
    be_sync(be);
    (void)be_sumsq(be, x, 16);
    be_trace_stop(be);
    cr_assert_eq(t.barriers, 3, "h2d, sync, sumsq: got %zu", t.barriers);
    cr_assert(strstr(t.first_barrier, "h2d at ") && strstr(t.first_barrier, "test_graphs.c:"),
              "first barrier: '%s'", t.first_barrier);
    be_free(be, &x);
    be_free(be, &y);
    be_free(be, &z);
    backend_destroy(be);
}

/* A dry trace counts every barrier but moves no data: copies, downloads,
 * uploads, sync, sumsq (0) and fences do nothing (the span's real run does
 * them); alloc and free run, since the host code keeps what they give. */
Test(trace, a_dry_trace_moves_no_data_at_its_barriers)
{
    backend_t *be = cpu();
    tensor_t x = be_alloc(be, DT_F32, 16), y = be_alloc(be, DT_F32, 16);
    fill(be, x, 1.0f);
    fill(be, y, 5.0f);
    float before_x[16], before_y[16], h[16], after[16];
    be_download(be, before_x, DT_F32, x);
    be_download(be, before_y, DT_F32, y);
    for (int i = 0; i < 16; i++)
        h[i] = -7.0f;
    float down[16], down2[16];
    memset(down, 0x5a, sizeof down);
    memset(down2, 0x5a, sizeof down2);
    be_trace t;
    be_trace_start(be, &t, 1);
    be_h2d(be, x.p, h, sizeof h);               /* 1 */
    be_upload(be, y, h, DT_F32);                /* 2 */
    be_d2h(be, down, x.p, sizeof down);         /* 3 */
    be_download(be, down2, DT_F32, y);          /* 4 */
    be_sync(be);                                /* 5 */
    double ss = be_sumsq(be, x, 16);            /* 6 */
    be_stream_fence(be, NULL, NULL);            /* 7 */
    tensor_t z = be_alloc(be, DT_F32, 8);       /* 8 */
    be_free(be, &z);                            /* 9 */
    be_trace_stop(be);
    cr_assert_eq(be->err.code, 0, "%s", be->err.msg);
    cr_assert_eq(t.barriers, 9, "got %zu", t.barriers);
    cr_assert(strstr(t.first_barrier, "h2d at "), "first barrier: '%s'", t.first_barrier);
    cr_expect_eq(ss, 0.0, "a dry sumsq read the device: %g", ss);
    be_download(be, after, DT_F32, x);
    cr_expect_eq(memcmp(after, before_x, sizeof after), 0, "a dry h2d wrote x");
    be_download(be, after, DT_F32, y);
    cr_expect_eq(memcmp(after, before_y, sizeof after), 0, "a dry upload wrote y");
    unsigned char pattern[sizeof down];
    memset(pattern, 0x5a, sizeof pattern);
    cr_expect_eq(memcmp(down, pattern, sizeof down), 0, "a dry d2h wrote the host buffer");
    cr_expect_eq(memcmp(down2, pattern, sizeof down2), 0, "a dry download wrote the host buffer");
    cr_expect(z.p == NULL, "the dry trace's free did not run");
    /* the same calls outside a trace do move the data */
    be_h2d(be, x.p, h, sizeof h);
    be_download(be, after, DT_F32, x);
    cr_expect_eq(after[3], -7.0f);
    cr_expect_eq(be_sumsq(be, x, 16), 16 * 49.0);
    be_free(be, &x);
    be_free(be, &y);
    backend_destroy(be);
}

Test(graph, a_captured_span_runs_when_launched_on_the_memory_of_that_moment)
{
    backend_t *be = cpu();
    tensor_t x = be_alloc(be, DT_F32, 16), y = be_alloc(be, DT_F32, 16),
             z = be_alloc(be, DT_F32, 16);
    tensor_t y2 = be_alloc(be, DT_F32, 16), z2 = be_alloc(be, DT_F32, 16);
    fill(be, x, 1.0f);
    fill(be, y, -1.0f);
    fill(be, y2, -1.0f);
    cr_assert_eq(be_graph_begin(be), 0);
    ops(be, x, y, z, 2.0f);
    char why[256] = "";
    be_graph *g = be_graph_end(be, why, sizeof why);
    cr_assert_not_null(g, "%s", why);
    cr_assert_eq(g->ops, 2);
    cr_assert_eq(g->digest, digest_of(be, x, y, z, 2.0f), "the capture's digest is the trace's");
    float a[16], b[16];
    be_download(be, a, DT_F32, z);
    for (int i = 0; i < 16; i++)
        cr_assert_eq(a[i], 0.0f, "the capture ran: z[%d] = %g", i, (double)a[i]);
    /* launched twice, as eagerly twice: y accumulates */
    for (int rep = 0; rep < 2; rep++) {
        cr_assert_eq(be_graph_launch(be, g), 0);
        ops(be, x, y2, z2, 2.0f);
        be_download(be, a, DT_F32, z);
        be_download(be, b, DT_F32, z2);
        cr_assert_eq(memcmp(a, b, sizeof a), 0, "launch %d differs from the eager ops", rep);
    }
    /* new inputs in the same memory: the graph reads them */
    fill(be, x, 3.0f);
    cr_assert_eq(be_graph_launch(be, g), 0);
    ops(be, x, y2, z2, 2.0f);
    be_download(be, a, DT_F32, z);
    be_download(be, b, DT_F32, z2);
    cr_assert_eq(memcmp(a, b, sizeof a), 0, "the graph did not read x as it is now");
    be_graph_free(be, g);
    tensor_t *ts[] = {&x, &y, &z, &y2, &z2};
    for (int i = 0; i < 5; i++)
        be_free(be, ts[i]);
    sp_err err = {0};
    cr_assert_eq(be_check(be, &err), 0, "%s", err.msg);
    backend_destroy(be);
}

Test(graph, a_barrier_in_a_capture_fails_it_by_name_and_leaves_no_error)
{
    backend_t *be = cpu();
    tensor_t x = be_alloc(be, DT_F32, 16), y = be_alloc(be, DT_F32, 16),
             z = be_alloc(be, DT_F32, 16);
    float h[16];
    cr_assert_eq(be_graph_begin(be), 0);
    ops(be, x, y, z, 1.0f);
    be_d2h(be, h, z.p, sizeof h);
    char why[256] = "";
    be_graph *g = be_graph_end(be, why, sizeof why);
    cr_assert_null(g);
    cr_assert(strstr(why, "d2h at ") && strstr(why, "test_graphs.c:"), "why: '%s'", why);
    sp_err err = {0};
    cr_assert_eq(be_check(be, &err), 0, "%s", err.msg);
    /* nesting is refused with a message */
    be_trace t;
    be_trace_start(be, &t, 1);
    cr_assert_eq(be_graph_begin(be), -1);
    be_trace_stop(be);
    cr_assert_neq(be_check(be, &err), 0);
    cr_assert(strstr(err.msg, "already"), "%s", err.msg);
    be_free(be, &x);
    be_free(be, &y);
    be_free(be, &z);
    backend_destroy(be);
}

Test(graphs, lora_with_dropout_and_packed_documents_replays_bit_for_bit)
{
    graphs_case rc = {.mode = MODE_LORA, .dropout = 0.1, .packed = 1};
    graphs_same_as_eager("cpu", &rc, "lora dropout packed");
}

Test(graphs, full_fine_tuning_with_recompute_and_a_shorter_micro_batch_replays_bit_for_bit)
{
    graphs_case rc = {.mode = MODE_FULL, .recompute = RECOMPUTE_LAYER, .odd_last = 1};
    graphs_same_as_eager("cpu", &rc, "full recompute odd");
}

Test(graphs, dora_with_dropout_replays_bit_for_bit)
{
    graphs_case rc = {.mode = MODE_LORA, .dropout = 0.1, .dora = 1, .packed = 1};
    graphs_same_as_eager("cpu", &rc, "dora dropout packed");
}

Test(graphs, qlora_replays_bit_for_bit)
{
    graphs_case rc = {.mode = MODE_LORA, .dropout = 0.05, .nf4 = 1, .odd_last = 1};
    graphs_same_as_eager("cpu", &rc, "qlora dropout odd");
}

/* QLoRA under recompute layer, where the NF4 workspace holds a layer's
 * weights from its recomputed forward to its backward, with an evaluation
 * and a weight's download between the steps: a captured pass dequantizes
 * what it uses from its start (model_graph_forward forgets the slots), so
 * a replay after other work reads no other layer's weights */
Test(graphs, qlora_with_layer_recompute_and_evaluations_between_replays_bit_for_bit)
{
    graphs_case rc = {.mode = MODE_LORA, .nf4 = 1, .recompute = RECOMPUTE_LAYER,
                      .eval_between = 1};
    graphs_same_as_eager("cpu", &rc, "qlora recompute layer, evaluations between");
}

Test(graphs, lora_with_attention_recompute_replays_bit_for_bit)
{
    graphs_case rc = {.mode = MODE_LORA, .recompute = RECOMPUTE_ATTENTION};
    graphs_same_as_eager("cpu", &rc, "lora recompute attention");
}

/* A gradient that is not finite: the update (captured and replayed on that
 * step) changes nothing, and the norm says so; the steps after go on. */
Test(graphs, an_update_whose_gradient_is_not_finite_changes_nothing)
{
    graphs_case rc = {.mode = MODE_LORA, .nan_step = 4};
    graphs_same_as_eager("cpu", &rc, "lora nan step 4");
}

/* A device that refuses the capture: graphs off for the run, saying why,
 * and the run the same bits as without graphs. */
Test(graphs, a_refused_capture_turns_graphs_off_and_runs_eagerly)
{
    graphs_case rc = {.mode = MODE_LORA, .dropout = 0.1, .packed = 1};
    graphs_refused_run_eagerly("cpu", &rc, "lora refused");
    graphs_case full = {.mode = MODE_FULL, .recompute = RECOMPUTE_LAYER};
    graphs_refused_run_eagerly("cpu", &full, "full refused");
}

/* Full fine-tuning (the embedding gradient of repeated tokens) twice: the
 * same bits. */
Test(graphs, full_fine_tuning_twice_gives_the_same_bits)
{
    graphs_case rc = {.mode = MODE_FULL, .packed = 1};
    graphs_run_twice_the_same("cpu", &rc, "full twice");
}

/* model_update is the unsharded update: a sharded optimizer (whose norm is
 * summed over the ranks, grad_sync_update) is refused, naming the way, and
 * nothing is updated. */
Test(graphs, model_update_refuses_a_sharded_optimizer)
{
    backend_t *be = cpu();
    sp_err err = {0};
    model_config_t mc;
    cr_assert_eq(model_config_preset(&mc, "tiny"), 0);
    mc.layers = 1;
    model_opts o = {.mode = MODE_FULL, .max_batch = 1, .seq_len = 8, .seed = 1,
                    .shard_count = 2, .shard_rank = 0};
    model_t *m;
    cr_assert_eq(model_create(&m, be, &mc, &o, &err), 0, "%s", err.msg);
    model_init_base_random(m, 3);
    size_t n = m->shard_len;
    float *before = malloc(sizeof(float) * n), *after = malloc(sizeof(float) * n);
    be_download(be, before, DT_F32, tensor_view(m->master, 0, n));
    adamw_args a = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .step = 1};
    double gnorm = -1;
    cr_expect_neq(model_update(m, &a, 1.0, &gnorm, &err), 0);
    cr_expect(strstr(err.msg, "sharded") && strstr(err.msg, "grad_sync_update"), "%s", err.msg);
    be_download(be, after, DT_F32, tensor_view(m->master, 0, n));
    cr_expect_eq(memcmp(before, after, sizeof(float) * n), 0, "a refused update changed weights");
    free(before), free(after);
    model_destroy(m);
    backend_destroy(be);
}

/* The trainer's way to read the loss (model_forward_backward without a
 * loss pointer, model_loss_take once a step, so the host never waits for a
 * micro-batch): the same bits as each micro-batch's loss taken as it ends,
 * with an evaluation in between that takes only its own loss (the
 * evaluation's sum is kept apart), and a take that starts the sum again. */
Test(graphs, the_loss_taken_once_a_step_is_the_micro_batches_losses)
{
    backend_t *be = cpu();
    sp_err err = {0};
    model_config_t mc;
    cr_assert_eq(model_config_preset(&mc, "tiny"), 0);
    mc.layers = 1;
    enum { B = 2, T = 16, GA = 3 };
    model_opts o = {.mode = MODE_LORA, .lora_r = 4, .lora_alpha = 8,
                    .lora_targets = (1 << PROJ_COUNT) - 1, .max_batch = B, .seq_len = T,
                    .seed = 1};
    model_t *m;
    cr_assert_eq(model_create(&m, be, &mc, &o, &err), 0, "%s", err.msg);
    model_init_base_random(m, 3);
    model_init_lora(m, 4);
    int32_t in[GA][B * T], tg[GA][B * T];
    uint64_t ids[B] = {0, 1};
    model_batch b[GA];
    for (int k = 0; k < GA; k++) {
        for (int i = 0; i < B * T; i++) {
            in[k][i] = (int32_t)(sp_rng_u64(7 + (uint64_t)k, (uint64_t)i) % (uint64_t)mc.vocab);
            tg[k][i] = i == 3 ? -1 : (int32_t)(sp_rng_u64(9 + (uint64_t)k, (uint64_t)i) %
                                                (uint64_t)mc.vocab);
        }
        b[k] = (model_batch){.inputs = in[k], .targets = tg[k], .sample_ids = ids, .B = B,
                             .T = T, .grad_scale = 1.0f / (GA * B * T), .last = k == GA - 1};
    }
    double each = 0.0, once = 0.0, eval = 0.0, eval_alone = 0.0, empty = 5.0;
    for (int k = 0; k < GA; k++)
        cr_assert_eq(model_forward_backward(m, &b[k], &each, &err), 0, "%s", err.msg);
    cr_assert_eq(model_evaluate(m, &b[0], &eval_alone, &err), 0, "%s", err.msg);
    for (int k = 0; k < GA; k++) {
        cr_assert_eq(model_forward_backward(m, &b[k], NULL, &err), 0, "%s", err.msg);
        if (k == 1)
            cr_assert_eq(model_evaluate(m, &b[0], &eval, &err), 0, "%s", err.msg);
    }
    cr_assert_eq(model_loss_take(m, &once, &err), 0, "%s", err.msg);
    cr_assert_eq(model_loss_take(m, &empty, &err), 0, "%s", err.msg);
    cr_expect(each > 0 && isfinite(each), "loss sum %g", each);
    cr_expect_eq(memcmp(&each, &once, sizeof once), 0, "taken once a step %.17g, one by one %.17g",
                 once, each);
    cr_expect_eq(memcmp(&eval, &eval_alone, sizeof eval), 0,
                 "an evaluation between micro-batches %.17g, alone %.17g", eval, eval_alone);
    cr_expect_eq(empty, 5.0, "a second take added %.17g", empty - 5.0);
    model_destroy(m);
    backend_destroy(be);
}
