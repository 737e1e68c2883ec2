/* spotune plan against what the trainer allocates: the CPU allocator's
 * measured peak of real training steps, the model's own bytes with sharded
 * gradients, and the activation and scratch bytes to the byte at fp32 and
 * bf16 activations. (The same suite, plan, as test_plan.c.) */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"
#include "trainer/model.h"
#include "trainer/plan.h"

/* ---- the plan against the CPU allocator's peak ------------------------------- */

/* Creates the model on the CPU backend, runs two training steps (forward,
 * backward, AdamW), and compares the backend's peak of allocated bytes with
 * the plan of the same run on the CPU (f32, no headroom). */
static void check_peak(const char *preset, int mode, int recompute, int64_t mb, int64_t T,
                       double dropout, int shards)
{
    plan_input in;
    plan_result r;
    sp_err err = {0};
    plan_input_defaults(&in);
    cr_assert_eq(plan_load_model(&in, preset, &err), 0);
    in.mode = mode;
    in.recompute = recompute;
    in.micro_batch = mb;
    in.seq_len = T;
    in.lora_dropout = dropout;
    in.gpus_per_node = shards;
    /* the steps below run without collectives, which sharded gradients need:
     * ZeRO-1 here; sharded_gradients_shrink_the_model checks ZeRO-2's bytes */
    in.shard_gradients = 0;
    in.cpu = 1;
    in.gpu_mem_bytes = 1e12;
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);

    backend_t *be;
    cr_assert_eq(backend_create(&be, "cpu", 0, 2, &err), 0, "%s", err.msg);
    model_opts o = {.mode = mode, .lora_r = 16, .lora_alpha = 32, .lora_dropout = dropout,
                    .lora_targets = 127, .max_batch = mb, .seq_len = T, .recompute = recompute,
                    .seed = 1};
    if (shards > 1 && mode == MODE_FULL)
        o.shard_count = shards;
    model_t *m;
    cr_assert_eq(model_create(&m, be, &in.mc, &o, &err), 0, "%s", err.msg);
    model_init_base_random(m, 1);
    if (mode == MODE_LORA)
        model_init_lora(m, 1);
    size_t n = (size_t)(mb * T);
    int32_t *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
    uint64_t ids[64];
    for (size_t i = 0; i < n; i++) {
        x[i] = (int32_t)(sp_rng_u64(3, i) % (uint64_t)in.mc.vocab);
        y[i] = (int32_t)(sp_rng_u64(4, i) % (uint64_t)in.mc.vocab);
    }
    for (int b = 0; b < mb; b++)
        ids[b] = (uint64_t)b;
    model_batch batch = {.inputs = x,
                         .targets = y,
                         .sample_ids = ids,
                         .B = (int)mb,
                         .T = (int)T,
                         .grad_scale = (float)(1.0 / (double)n),
                         .last = 1};
    adamw_args a = {.lr = 1e-4f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                    .grad_scale = 1.0f};
    int steps = strcmp(preset, "tiny") == 0 ? 2 : 1; /* the peak is the same at every step */
    for (int s = 1; s <= steps; s++) {
        double loss = 0;
        model_zero_grads(m);
        cr_assert_eq(model_forward_backward(m, &batch, &loss, &err), 0, "%s", err.msg);
        a.step = s;
        model_adamw(m, &a);
        cr_assert_eq(be_check(be, &err), 0, "%s", err.msg);
    }
    double peak = (double)be->bytes_peak, rel = fabs(r.mem.total - peak) / peak;
    cr_log_info("%s %s recompute %d mb %lld T %lld: plan %.0f, peak %.0f bytes (%+.3f%%)", preset,
                mode == MODE_FULL ? "full" : "lora", recompute, (long long)mb, (long long)T,
                r.mem.total, peak, 100 * (r.mem.total - peak) / peak);
    cr_expect_leq(rel, 0.05,
                  "%s %s recompute %d mb %lld T %lld dropout %g shards %d: plan %.0f bytes, "
                  "allocator peak %.0f (%.2f%%)",
                  preset, mode == MODE_FULL ? "full" : "lora", recompute, (long long)mb,
                  (long long)T, dropout, shards, r.mem.total, peak, 100 * rel);
    model_destroy(m);
    backend_destroy(be);
    free(x);
    free(y);
}

Test(plan, within_5_percent_of_the_allocator_peak_tiny)
{
    for (int rec = RECOMPUTE_NONE; rec <= RECOMPUTE_LAYER; rec++) {
        check_peak("tiny", MODE_LORA, rec, 2, 64, 0.0, 1);
        check_peak("tiny", MODE_FULL, rec, 2, 64, 0.0, 1);
    }
    check_peak("tiny", MODE_LORA, RECOMPUTE_NONE, 4, 128, 0.1, 1);
    check_peak("tiny", MODE_FULL, RECOMPUTE_ATTENTION, 1, 128, 0.0, 2);
}

Test(plan, within_5_percent_of_the_allocator_peak_small, .timeout = 300)
{
    check_peak("small", MODE_LORA, RECOMPUTE_NONE, 1, 128, 0.05, 1);
    check_peak("small", MODE_FULL, RECOMPUTE_LAYER, 2, 64, 0.0, 1);
}

/* The model itself with the gradients sharded over 2 ranks (rank 1's view,
 * no collective needed to build it): no whole gradient arena; its trainable
 * bytes are ZeRO-1's less the whole fp32 gradient plus two bucket buffers of
 * the largest unit (layer, head) taken from its own parameter table; every
 * trainable gradient is a view of a bucket, at its offset in its segment;
 * and the plan's figure is the model's. */
Test(plan, sharded_gradients_shrink_the_model)
{
    plan_input in;
    sp_err err = {0};
    plan_input_defaults(&in);
    cr_assert_eq(plan_load_model(&in, "tiny", &err), 0, "%s", err.msg);
    backend_t *be;
    cr_assert_eq(backend_create(&be, "cpu", 0, 1, &err), 0, "%s", err.msg);
    model_opts o = {.mode = MODE_FULL, .max_batch = 1, .seq_len = 16, .seed = 1,
                    .shard_count = 2, .shard_rank = 1};
    model_t *z1, *z2;
    cr_assert_eq(model_create(&z1, be, &in.mc, &o, &err), 0, "%s", err.msg);
    o.shard_grads = 1;
    cr_assert_eq(model_create(&z2, be, &in.mc, &o, &err), 0, "%s", err.msg);
    cr_expect_not(z1->shard_grads);
    cr_assert(z2->shard_grads);
    cr_expect_null(z2->grad.p, "no whole gradient arena");
    size_t layer = 0, head = z2->final_norm->n + (in.mc.tie_embeddings ? 0 : z2->lm_head->n);
    for (int i = 0; i < z2->nparams; i++)
        if (z2->params[i].layer == 0)
            layer += z2->params[i].n;
    size_t unit = layer > head ? layer : head;
    if (!in.mc.tie_embeddings && z2->embed->n > unit)
        unit = z2->embed->n;
    size_t buckets = 2 * unit + (in.mc.tie_embeddings ? z2->embed->n : 0);
    size_t padded = z2->shard_len * 2;
    cr_expect_eq(z2->grad_buckets_len, buckets);
    cr_expect_eq(z1->bytes_trainable - z2->bytes_trainable, 4 * (padded - buckets),
                 "ZeRO-1 %zu bytes, ZeRO-2 %zu", z1->bytes_trainable, z2->bytes_trainable);
    cr_expect_lt(z2->bytes_trainable, z1->bytes_trainable);
    for (int i = 0; i < z2->nparams; i++) {
        const param_t *p = &z2->params[i];
        int k = 0;
        while (z2->seg_end[k] <= p->offset)
            k++;
        size_t lo;
        tensor_t seg = model_grad_segment(z2, k, &lo);
        cr_expect(p->offset + p->n <= z2->seg_end[k], "%s crosses a segment", p->name);
        cr_expect_eq((char *)p->grad.p, (char *)seg.p + 4 * (p->offset - lo), "%s", p->name);
    }
    model_plan mp;
    model_plan_bytes(&in.mc, &o, DT_F32, &mp);
    cr_expect_eq(mp.trainable, z2->bytes_trainable);
    /* the backward refuses to run with nothing to reduce its buckets */
    int32_t tok[16] = {0};
    uint64_t ids[1] = {0};
    model_batch b = {.inputs = tok, .targets = tok, .sample_ids = ids, .B = 1, .T = 16,
                     .grad_scale = 1.0f, .last = 1};
    double loss = 0;
    cr_expect_neq(model_forward_backward(z2, &b, &loss, &err), 0);
    cr_expect(strstr(err.msg, "grad_sync_begin"), "%s", err.msg);
    model_destroy(z1);
    model_destroy(z2);
    backend_destroy(be);
}

/* ---- activations and scratch, to the byte ------------------------------------ */

/* model_plan_bytes counts what the model allocates for its activations and
 * scratch, each buffer at its own dtype (the RMSNorm statistics, the
 * softmax log-sum-exps, the losses are F32 whatever the activations are):
 * exactly, for the CPU's F32 activations and for the BF16 ones of the CUDA
 * backend (a CPU backend told to keep BF16 activations: the model is only
 * built, nothing runs). */
Test(plan, activations_and_scratch_are_the_models_bytes)
{
    plan_input in;
    sp_err err = {0};
    plan_input_defaults(&in);
    cr_assert_eq(plan_load_model(&in, "tiny", &err), 0, "%s", err.msg);
    static const struct {
        int mode, recompute, dora, nf4;
        double dropout;
        int64_t mb, T;
    } cases[] = {
        {MODE_LORA, RECOMPUTE_NONE, 0, 0, 0.0, 2, 64},
        {MODE_LORA, RECOMPUTE_ATTENTION, 0, 0, 0.1, 1, 96},
        {MODE_LORA, RECOMPUTE_LAYER, 0, 0, 0.0, 3, 32},
        {MODE_LORA, RECOMPUTE_NONE, 1, 0, 0.0, 1, 64},
        {MODE_LORA, RECOMPUTE_NONE, 0, 1, 0.0, 2, 64},  /* QLoRA: the NF4 workspace */
        {MODE_LORA, RECOMPUTE_LAYER, 0, 1, 0.1, 1, 32}, /* QLoRA with dropout */
        {MODE_LORA, RECOMPUTE_NONE, 1, 1, 0.0, 2, 64},  /* QDoRA */
        {MODE_LORA, RECOMPUTE_ATTENTION, 1, 1, 0.1, 1, 32}, /* QDoRA with dropout */
        {MODE_FULL, RECOMPUTE_NONE, 0, 0, 0.0, 2, 64},
        {MODE_FULL, RECOMPUTE_ATTENTION, 0, 0, 0.0, 1, 128},
    };
    static const dtype_t dts[] = {DT_F32, DT_BF16};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (size_t d = 0; d < 2; d++) {
            backend_t *be;
            cr_assert_eq(backend_create(&be, "cpu", 0, 1, &err), 0, "%s", err.msg);
            be->act_dt = dts[d];
            model_opts o = {.mode = cases[i].mode, .lora_r = 8, .lora_alpha = 16,
                            .lora_dropout = cases[i].dropout, .lora_targets = 127,
                            .dora = cases[i].dora, .nf4 = cases[i].nf4, .max_batch = cases[i].mb,
                            .seq_len = cases[i].T, .recompute = cases[i].recompute, .seed = 1};
            model_t *m;
            cr_assert_eq(model_create(&m, be, &in.mc, &o, &err), 0, "case %zu %s: %s", i,
                         dtype_name(dts[d]), err.msg);
            model_plan p;
            model_plan_bytes(&in.mc, &o, dts[d], &p);
            cr_expect_eq(p.activations + p.scratch, m->bytes_acts,
                         "case %zu %s: plan %zu + %zu, model %zu", i, dtype_name(dts[d]),
                         p.activations, p.scratch, m->bytes_acts);
            model_destroy(m);
            backend_destroy(be);
        }
}
