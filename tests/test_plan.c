/* spotune plan: figures checked by hand (7B LoRA, QLoRA, FLOPs, checkpoint),
 * the fixes that make a run fit, the GPU table, the command's table and JSON,
 * and every bad input refused with its name and exit code. The plan against
 * what the model allocates: test_plan_model.c. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"
#include "trainer/config.h"
#include "trainer/model.h"
#include "trainer/plan.h"

#define GIB (1024.0 * 1024.0 * 1024.0)

static void input_for(plan_input *in, const char *model, int mode, const char *gpu)
{
    sp_err err = {0};
    plan_input_defaults(in);
    cr_assert_eq(plan_load_model(in, model, &err), 0, "%s", err.msg);
    in->mode = mode;
    const plan_gpu *g = plan_gpu_find(gpu);
    cr_assert(g, "%s", gpu);
    plan_input_set_gpu(in, g);
}

/* Llama-2-7B (the llama-7b preset: vocabulary 32000, hidden 4096,
 * intermediate 11008, 32 layers, 32 heads, untied), LoRA r 16 on all seven
 * projections, seq_len 2048, micro_batch 1, no recompute, one H100:
 *   N = 2 x 32000 x 4096 (embedding, lm_head) + 4096 (final norm)
 *       + 32 x (2 x 4096 (norms) + 4 x 4096^2 (q, k, v, o) + 3 x 4096 x 11008 (MLP))
 *     = 6,738,415,616 (Hugging Face's count of Llama-2-7b-hf)
 *   weights, bf16: 2N = 13,476,831,232 bytes (12.55 GiB)
 *   LoRA: per layer r (in + out): 4 x 16 x 8192 + 3 x 16 x 15104 = 1,249,280;
 *     x 32 = 39,976,960 trainable
 *   trainable state: fp32 master 4 + bf16 compute copy 2 = 6 B each = 239,861,760
 *   gradients: fp32, 4 B = 159,907,840; optimizer: AdamW m and v, 8 B = 319,815,680
 *   activations (B T = 2048): every layer's input and the final one,
 *     33 x 2048 x 4096 in bf16 = 553,648,128 bytes, plus per layer in bf16
 *     3BT H (h1, h2, x_mid) + BT qd + 2 BT kvd (q, k, v) + BT qd (att) +
 *     3 BT I (g, u, a) + 7 BT r (LoRA's x A) = 126,582,784 elements x 2, and
 *     in fp32 2BT (rstd) + B heads T (lse) = 69,632 x 4: 253,444,096 bytes;
 *     553,648,128 + 32 x 253,444,096 = 8,663,859,200 bytes (8.07 GiB)
 *   checkpoint: params, adam_m, adam_v in fp32: 12 x 39,976,960 = 479,723,520 bytes
 *   FLOPs per token: matmul weights nmm = 32000 x 4096 (lm_head)
 *     + 32 x (4 x 4096^2 + 3 x 4096 x 11008) = 6,607,077,376; frozen 4 nmm
 *     + trainable 6 x 39,976,960 + attention 12 x 32 x 4096 x 2048
 *     = 26,428,309,504 + 239,861,760 + 3,221,225,472 = 29,889,396,736
 *   tokens/s at the H100's measured 49.5% of 989 TFLOP/s (docs/perf.md, run 5):
 *   0.495 x 989e12 / 29,889,396,736 = 16,379.1 */
Test(plan, llama_7b_lora_by_hand)
{
    plan_input in;
    plan_result r;
    sp_err err = {0};
    input_for(&in, "llama-7b", PLAN_LORA, "H100");
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);
    cr_expect_eq(r.params, 6738415616LL);
    cr_expect_eq(r.trainable_params, 39976960LL);
    cr_expect_eq(r.mem.weights, 13476831232.0);
    cr_expect_eq(r.mem.trainable, 239861760.0);
    cr_expect_eq(r.mem.gradients, 159907840.0);
    cr_expect_eq(r.mem.optimizer, 319815680.0);
    cr_expect_eq(r.mem.activations, 8663859200.0);
    cr_expect_gt(r.mem.workspace, PLAN_CUDA_WORKSPACE);
    cr_expect_eq(r.mem.total, r.mem.weights + r.mem.trainable + r.mem.gradients +
                                  r.mem.optimizer + r.mem.activations + r.mem.workspace);
    cr_expect_eq(r.ckpt_bytes, 479723520.0);
    cr_expect_eq(r.flops_per_token, 29889396736.0);
    cr_expect_eq(r.flops_6n, 6.0 * 6738415616.0);
    cr_expect_float_eq(r.tokens_per_s_gpu, 0.495 * 989e12 / 29889396736.0, 1e-6);
    cr_expect_eq(r.mfu_measured, 1);
    cr_expect(strstr(r.mfu_source, "measured"), "%s", r.mfu_source);
    /* 80 GiB less 1 GiB and 5%: 75 GiB usable */
    cr_expect_float_eq(r.usable_bytes, 75.0 * GIB, 1.0);
    cr_expect(r.fits);
    cr_expect_eq(r.nfixes, 0);
    /* the model's own plan agrees: the trainer allocates these bytes */
    model_opts o = {.mode = MODE_LORA, .lora_r = 16, .lora_targets = 127, .max_batch = 1,
                    .seq_len = 2048};
    model_plan p;
    model_plan_bytes(&in.mc, &o, DT_BF16, &p);
    cr_expect_eq((double)(p.weights + p.trainable + p.activations + p.scratch) +
                     PLAN_CUDA_WORKSPACE,
                 r.mem.total);
}

/* The MFU measured on a card (docs/perf.md's GPU rows, plan.c measured[])
 * replaces the assumed one for that card and mode only, and says so. */
Test(plan, a_measured_mfu_is_used_for_its_card_and_mode)
{
    plan_input in;
    plan_result r;
    sp_err err = {0};
    input_for(&in, "llama-7b", PLAN_LORA, "H200");
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);
    cr_expect_eq(r.mfu_measured, 1);
    cr_expect_float_eq(r.mfu, 0.482, 1e-12);
    cr_expect(strstr(r.mfu_source, "measured: docs/perf.md"), "%s", r.mfu_source);
    cr_expect_float_eq(r.tokens_per_s_gpu, 0.482 * 989e12 / r.flops_per_token, 1e-6);
    input_for(&in, "llama-7b", PLAN_LORA, "H100"); /* its own row */
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);
    cr_expect_eq(r.mfu_measured, 1);
    cr_expect_float_eq(r.mfu, 0.495, 1e-12);
    cr_expect(strstr(r.mfu_source, "H100 80GB HBM3"), "%s", r.mfu_source);
    input_for(&in, "llama-7b", PLAN_LORA, "A100-80GB"); /* no row: assumed */
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);
    cr_expect_eq(r.mfu_measured, 0);
    input_for(&in, "llama-7b", PLAN_FULL, "H200"); /* another mode: assumed */
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);
    cr_expect_eq(r.mfu_measured, 0);
    cr_expect(strstr(r.mfu_source, "assumed"), "%s", r.mfu_source);
}

/* The same run on a 24 GB card: 21.807 GiB do not fit the 21.8 usable (the
 * text says by how many MiB, not "0.00 GiB");
 * recomputing attention (its output in bf16 and softmax statistics in fp32
 * no longer kept per layer, one set shared: 31 x (2048 x 4096 x 2 + 65536 x
 * 4) bytes less) is the cheapest change,
 * re-planned to fit. */
Test(plan, llama_7b_lora_on_24_gb_fits_with_recompute)
{
    plan_input in;
    plan_result r;
    sp_err err = {0};
    input_for(&in, "llama-7b", PLAN_LORA, "RTX3090");
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);
    cr_expect_not(r.fits, "%.3f GiB of %.3f", r.mem.total / GIB, r.usable_bytes / GIB);
    cr_assert_geq(r.nfixes, 2);
    cr_expect_eq(r.fixes[0].recompute, RECOMPUTE_ATTENTION);
    cr_expect_eq(r.fixes[0].micro_batch, 1);
    cr_expect_float_eq(r.mem.total - r.fixes[0].mem.total,
                       31.0 * (2048.0 * 4096 * 2 + 65536.0 * 4), 1.0);
    for (int i = 0; i < r.nfixes; i++)
        cr_expect_leq(r.fixes[i].mem.total, r.usable_bytes, "%s", r.fixes[i].what);
    /* QLoRA is offered last for LoRA, naming the key that turns it on */
    const plan_fix *q = &r.fixes[r.nfixes - 1];
    cr_expect_eq(q->mode, PLAN_QLORA);
    cr_expect(strstr(q->what, "mode qlora (model.quantize nf4: LoRA r 16 on NF4 weights)"), "%s",
              q->what);
    char *out = NULL;
    cr_assert_eq(tu_spotune(&out, "plan llama-7b --gpu RTX3090"), 0, "%s", out);
    cr_expect(strstr(out, "fits: NO, 7.3 MiB more than usable"), "%s", out);
    free(out);
}

/* Micro-batch 8 on a 48 GB card (64 GiB of activations): a smaller micro-batch with a larger
 * grad_accum keeps the global batch (mb x accum = 8). */
Test(plan, smaller_micro_batch_keeps_the_global_batch)
{
    plan_input in;
    plan_result r;
    sp_err err = {0};
    input_for(&in, "llama-7b", PLAN_LORA, "L40S");
    in.micro_batch = 8;
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);
    cr_assert_not(r.fits);
    int found = 0;
    for (int i = 0; i < r.nfixes; i++)
        if (r.fixes[i].micro_batch < 8 && r.fixes[i].mode == PLAN_LORA) {
            found = 1;
            cr_expect_eq(r.fixes[i].micro_batch * r.fixes[i].grad_accum, 8);
            cr_expect(strstr(r.fixes[i].what, "train.micro_batch"), "%s", r.fixes[i].what);
        }
    cr_expect(found);
}

/* QLoRA: the seven projections' 6,476,005,376 weights as model.quantize nf4
 * stores them (kernels/nf4.h: 4 bits, an 8-bit absmax per 64, an fp32
 * nested absmax per 256 absmax: 4.127 bits, and an fp32 offset per matrix):
 * q, k, v, o (4096 x 4096) 8,388,608 + 262,144 + 4 x (1,024 + 1) =
 * 8,654,852 bytes each, gate, up, down (4096 x 11008) 22,544,384 + 704,512 +
 * 4 x (2,752 + 1) = 23,259,908 each, 32 layers: 3,340,772,224; the other
 * 262,410,240 (embeddings, lm_head, norms) bf16: + 524,820,480 =
 * 3,865,592,704 bytes. */
Test(plan, qlora_weights_by_hand)
{
    plan_input in;
    plan_result r;
    sp_err err = {0};
    input_for(&in, "llama-7b", PLAN_QLORA, "L4");
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);
    cr_expect_eq(r.mem.weights, 3865592704.0);
    cr_expect_eq(r.trainable_params, 39976960LL);
    cr_expect_float_eq(r.mfu, 0.30, 1e-12);
}

/* Full fine-tuning of 7B on eight 80 GB cards: with the optimizer sharded
 * (train.shard_gradients off), 6 bytes per weight stay whole (fp32 gradient,
 * bf16 copy) and 16 are divided (master, m, v, the reduced gradient shard):
 * 8 bytes per weight; alone on one card it does not fit, and the fix is more
 * GPUs. */
Test(plan, full_7b_sharded_over_8_gpus)
{
    plan_input in;
    plan_result r;
    sp_err err = {0};
    input_for(&in, "llama-7b", PLAN_FULL, "H100");
    in.recompute = RECOMPUTE_LAYER;
    in.gpus_per_node = 8;
    in.shard_gradients = 0;
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);
    cr_expect(r.sharded);
    cr_expect_not(r.grads_sharded);
    double N = 6738415616.0, per = (r.mem.trainable + r.mem.gradients + r.mem.optimizer) / N;
    cr_expect_float_eq(per, 8.0, 1e-6, "%.6f B/weight", per);
    cr_expect_eq(r.mem.weights, 0.0);
    cr_expect(r.fits, "%.2f GiB", r.mem.total / GIB);
    cr_expect_eq(r.ckpt_bytes, 12.0 * N);
    /* one machine: a sharded checkpoint, each rank copying its 1/8 to host
     * memory (the goal: at most 1 s of stall for 7B full on 8 GPUs) */
    cr_expect(r.ckpt_sharded);
    cr_expect_eq(r.ckpt_rank_bytes, 12.0 * (double)r.shard_params);
    cr_expect_geq(r.ckpt_rank_bytes * 8, 12.0 * N);
    cr_expect_float_eq(r.ckpt_stall_s, r.ckpt_rank_bytes / PLAN_D2H_BYTES_S, 1e-12);
    cr_expect_leq(r.ckpt_stall_s, 1.0, "%.2f s", r.ckpt_stall_s);
    /* two machines of 4: gathered to rank 0, which holds the whole state */
    in.gpus_per_node = 4;
    in.nodes = 2;
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);
    cr_expect(r.sharded && !r.ckpt_sharded);
    cr_expect_eq(r.ckpt_rank_bytes, 12.0 * N);
    in.nodes = 1;

    in.gpus_per_node = 1;
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);
    cr_expect_not(r.sharded);
    cr_expect_not(r.fits);
    cr_assert_gt(r.nfixes, 0);
    cr_expect_gt(r.fixes[0].gpus_per_node * r.fixes[0].nodes, 1, "%s", r.fixes[0].what);
    cr_expect(strstr(r.fixes[0].what, "sharded"), "%s", r.fixes[0].what);
    cr_expect_eq(r.fixes[0].mode, PLAN_FULL);
}

/* The same with the gradients sharded too (train.shard_gradients, the
 * default): the fp32 gradient is the reduced shard (4 bytes per weight / 8)
 * and two bucket buffers of the largest unit the backward finishes at once.
 * Llama-2-7B's layer, 2 x 4096 (norms) + 4 x 4096^2 + 3 x 4096 x 11008 =
 * 202,383,360 weights, is larger than its head (lm_head 32000 x 4096 + the
 * final norm 4096 = 131,076,096) and its embedding (131,072,000), and N / 8
 * = 842,301,952 exactly, so per GPU:
 *   bf16 copy 2N + master, m, v, reduced gradient 16 N / 8 + buckets 2 x 4 x 202,383,360
 *   = 4N + 1,619,066,880 bytes (26.61 GiB): the whole gradient (N x 4 bytes,
 *   25.1 GiB) less two layers. */
Test(plan, full_7b_with_sharded_gradients)
{
    plan_input in;
    plan_result r;
    sp_err err = {0};
    input_for(&in, "llama-7b", PLAN_FULL, "H100");
    in.recompute = RECOMPUTE_LAYER;
    in.gpus_per_node = 8;
    cr_assert(in.shard_gradients, "on by default");
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);
    cr_expect(r.sharded);
    cr_expect(r.grads_sharded);
    double N = 6738415616.0, layer = 2 * 4096.0 + 4 * 4096.0 * 4096 + 3 * 4096.0 * 11008;
    cr_expect_eq(layer, 202383360.0);
    double state = r.mem.trainable + r.mem.gradients + r.mem.optimizer;
    cr_expect_float_eq(state, 4 * N + 8 * layer, 1e-9 * N, "%.0f bytes", state);
    cr_expect_float_eq(r.mem.gradients, 4 * N / 8 + 8 * layer, 1, "%.0f", r.mem.gradients);
    cr_expect(r.fits, "%.2f GiB", r.mem.total / GIB);
    /* ZeRO-1 kept the whole arena and the shard: 4 N + 4 N / 8 */
    in.shard_gradients = 0;
    plan_result r1;
    cr_assert_eq(plan_compute(&in, &r1, &err), 0, "%s", err.msg);
    cr_expect_float_eq(r1.mem.gradients - r.mem.gradients, 4 * N - 8 * layer, 1, "%.0f",
                       r1.mem.gradients - r.mem.gradients);
    /* 4 GPUs: N / 4 = 1,684,603,904, the buckets the same */
    in.shard_gradients = 1;
    in.gpus_per_node = 4;
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);
    cr_expect_float_eq(r.mem.gradients, 4 * N / 4 + 8 * layer, 1, "%.0f", r.mem.gradients);
    cr_expect(r.fits, "7B full on 4 x 80 GB: %.2f GiB", r.mem.total / GIB);
}

/* 13B full on 80 GB cards: with the optimizer alone sharded it does not fit
 * however many GPUs (the whole fp32 gradient is 48.5 GiB and the bf16 copy
 * 24): LoRA is what fits. With the gradients sharded too it fits on 8. */
Test(plan, full_13b_on_80_gb)
{
    plan_input in;
    plan_result r;
    sp_err err = {0};
    input_for(&in, "llama-13b", PLAN_FULL, "A100-80GB");
    in.gpus_per_node = 8;
    in.shard_gradients = 0;
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);
    cr_expect_not(r.fits);
    for (int i = 0; i < r.nfixes; i++)
        cr_expect_neq(r.fixes[i].mode, PLAN_FULL, "%s", r.fixes[i].what);
    cr_assert_gt(r.nfixes, 0);
    cr_expect_eq(r.fixes[0].mode, PLAN_LORA);

    in.shard_gradients = 1;
    in.recompute = RECOMPUTE_LAYER;
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);
    cr_expect(r.grads_sharded);
    cr_expect(r.fits, "13B full on 8 x 80 GB: %.2f GiB", r.mem.total / GIB);
    /* 13B: N = 13,015,864,320; a layer 2 x 5120 + 4 x 5120^2 + 3 x 5120 x 13824 */
    double N = 13015864320.0, layer = 2 * 5120.0 + 4 * 5120.0 * 5120 + 3 * 5120.0 * 13824;
    cr_expect_eq(r.params, (int64_t)N);
    cr_expect_float_eq(r.mem.gradients, 4 * N / 8 + 8 * layer, 1, "%.0f", r.mem.gradients);
}

/* Wall time, cost and upload: 1e9 tokens at the job's tokens/s; a 480 MB
 * adapter checkpoint at 100 Mbit/s takes 38.4 s: inside AWS's 120 s and
 * Alibaba Cloud's 300 s, not GCP's or Azure's 30 s. */
Test(plan, job_time_cost_and_upload)
{
    plan_input in;
    plan_result r;
    sp_err err = {0};
    input_for(&in, "llama-7b", PLAN_LORA, "H100");
    in.gpus_per_node = 8;
    in.tokens = 1e9;
    in.epochs = 2;
    in.price_per_hour = 3.0;
    in.upload_mbps = 100;
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);
    cr_expect_float_eq(r.tokens_per_s, 8 * r.tokens_per_s_gpu, 1e-6);
    cr_expect_float_eq(r.wall_s, 2e9 / r.tokens_per_s, 1e-6);
    cr_expect_float_eq(r.cost, r.wall_s / 3600 * 3.0 * 8, 1e-9);
    cr_expect_float_eq(r.upload_s, 479723520.0 * 8 / 100e6, 1e-9);
    int n = plan_cloud_count();
    cr_assert_eq(n, 4);
    double want[] = {120, 30, 30, 300};
    for (int i = 0; i < n; i++)
        cr_expect_eq(plan_cloud_at(i)->notice_s, want[i], "%s", plan_cloud_at(i)->name);
}

/* A training config's settings, as a config check before a run takes them. */
Test(plan, from_a_training_config)
{
    config_t c;
    sp_err err = {0};
    config_defaults(&c);
    cr_assert_eq(config_load(&c, tu_fmt("%s/configs/llama-7b-full.yaml", tu_source_dir()), &err),
                 0, "%s", err.msg);
    plan_input in;
    plan_input_defaults(&in);
    plan_input_from_config(&in, &c);
    cr_expect_eq(in.mode, PLAN_FULL);
    cr_expect_eq(in.seq_len, c.seq_len);
    cr_expect_eq(in.micro_batch, c.micro_batch);
    cr_expect_eq(in.grad_accum, c.grad_accum);
    cr_expect_eq(in.recompute, c.recompute);
    cr_expect_eq(in.shard_optimizer, c.shard_optimizer);
    cr_assert_eq(plan_load_model(&in, "llama-7b", &err), 0);
    plan_input_set_gpu(&in, plan_gpu_find("H100"));
    in.gpus_per_node = 8;
    plan_result r;
    cr_assert_eq(plan_compute(&in, &r, &err), 0, "%s", err.msg);
    cr_expect(r.fits, "configs/llama-7b-full.yaml on 8 H100: %.2f GiB of %.2f", r.mem.total / GIB,
              r.usable_bytes / GIB);
    config_free(&c);
}

Test(plan, gpu_table)
{
    cr_expect_eq(plan_gpu_count(), 9);
    cr_expect_eq(plan_gpu_find("h100")->mem_gib, 80);
    cr_expect_eq(plan_gpu_find("RTX 4090")->bf16_tflops, 165.2);
    cr_expect_eq(plan_gpu_find("a100-40gb")->mem_gib, 40);
    cr_expect_eq(plan_gpu_find("H200")->mem_gib, 141);
    cr_expect_null(plan_gpu_find("A100"), "ambiguous");
    cr_expect_str_eq(plan_gpu_find("H100 SXM")->name, "H100");
    cr_expect_str_eq(plan_gpu_find("h200 141gb")->name, "H200");
    cr_expect_str_eq(plan_gpu_find("A100 80GB")->name, "A100-80GB");
    cr_expect_null(plan_gpu_find("TPUv5"));
    cr_expect_str_eq(plan_gpu_for_device("NVIDIA A100-SXM4-80GB")->name, "A100-80GB");
    cr_expect_str_eq(plan_gpu_for_device("NVIDIA A100-PCIE-40GB")->name, "A100-40GB");
    cr_expect_str_eq(plan_gpu_for_device("NVIDIA H100 80GB HBM3")->name, "H100");
    cr_expect_str_eq(plan_gpu_for_device("NVIDIA L40S")->name, "L40S");
    cr_expect_str_eq(plan_gpu_for_device("NVIDIA L4")->name, "L4");
    cr_expect_str_eq(plan_gpu_for_device("NVIDIA A10")->name, "A10");
    cr_expect_str_eq(plan_gpu_for_device("NVIDIA GeForce RTX 3090")->name, "RTX3090");
    cr_expect_str_eq(plan_gpu_for_device("NVIDIA A100 80GB PCIe")->name, "A100-80GB");
    cr_expect_str_eq(plan_gpu_for_device("NVIDIA GeForce RTX 4090")->name, "RTX4090");
    cr_expect_str_eq(plan_gpu_for_device("NVIDIA H200")->name, "H200");
    cr_expect_null(plan_gpu_for_device("NVIDIA L40"));
    cr_expect_null(plan_gpu_for_device("NVIDIA A10G"));
    cr_expect_null(plan_gpu_for_device("NVIDIA H100 PCIe"));
}

/* PLAN_CUDA_WORKSPACE is the CUDA backend's workspace_bytes (which only a
 * CUDA build can read): the source still says 32 + 256 + 64 MiB. */
Test(plan, cuda_workspace_matches_the_backend)
{
    char *src = tu_read_file(tu_fmt("%s/kernels/cuda/cuda_backend.cu", tu_source_dir()), NULL);
    cr_assert(src);
    cr_expect(strstr(src, "be->workspace_bytes = ((size_t)32 << 20) + ((size_t)256 << 20) + "
                          "((size_t)64 << 20);"),
              "kernels/cuda/cuda_backend.cu changed the workspace: update PLAN_CUDA_WORKSPACE");
    cr_expect_eq(PLAN_CUDA_WORKSPACE, (double)((32 + 256 + 64) << 20));
    free(src);
}

/* ---- the command ------------------------------------------------------------- */

static json_t *plan_json(const char *args)
{
    char *out = NULL;
    int rc = tu_spotune(&out, "plan %s --json 2>/dev/null", args);
    cr_assert_eq(rc, 0, "plan %s: exit %d\n%s", args, rc, out);
    json_error_t je;
    json_t *j = json_loads(out, 0, &je);
    cr_assert(j, "%s: %s\n%s", args, je.text, out);
    free(out);
    return j;
}

Test(plan, command_table_and_json)
{
    char *out = NULL;
    cr_assert_eq(tu_spotune(&out, "plan llama-7b --gpu H100 --tokens 1e8 --price-per-hour 2.5 "
                                  "--upload-mbps 100"),
                 0, "%s", out);
    const char *want[] = {"weights", "trainable state", "gradients", "optimizer", "activations",
                          "workspace", "fits: yes", "MFU", "assumed", "tokens/s", "wall time",
                          "cost", "479.7 MB", "AWS 120 s ok", "GCP 30 s TOO SLOW",
                          "Alibaba Cloud 300 s ok"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        cr_expect(tu_contains(out, want[i]), "no '%s' in:\n%s", want[i], out);
    free(out);

    json_t *j = plan_json("llama-7b --gpu RTX3090");
    cr_expect(json_is_false(json_object_get(j, "fits")));
    json_t *fx = json_object_get(j, "fixes");
    cr_assert(json_array_size(fx) >= 2);
    cr_expect_str_eq(json_string_value(json_object_get(json_array_get(fx, 0), "recompute")),
                     "attention");
    json_t *mem = json_object_get(j, "memory_gib");
    cr_expect_float_eq(json_real_value(json_object_get(mem, "weights")), 13476831232.0 / GIB,
                       1e-9);
    cr_expect(json_is_null(json_object_get(json_object_get(j, "job"), "wall_s")));
    json_decref(j);

    j = plan_json("llama-13b --gpu L4 --mode qlora");
    cr_expect_str_eq(json_string_value(json_object_get(j, "mode")), "qlora");
    cr_expect(json_is_true(json_object_get(j, "fits")));
    cr_expect(json_is_false(json_object_get(j, "dora")));
    json_decref(j);
    cr_assert_eq(tu_spotune(&out, "plan llama-13b --gpu L4 --mode qlora"), 0, "%s", out);
    cr_expect(tu_contains(out, "note: QLoRA is LoRA on the projections stored as NF4 "
                               "(model.quantize nf4)") &&
                  !tu_contains(out, "not available"),
              "%s", out);
    free(out);

    /* --gpu-mem and --gpu-tflops instead of a card of the table */
    j = plan_json("small --gpu-mem 8 --gpu-tflops 100 --mode full");
    cr_expect_float_eq(json_real_value(json_object_get(json_object_get(j, "gpu"), "mem_gib")),
                       8.0, 1e-12);
    json_decref(j);
}

/* A model directory, its config.json, a run YAML (its settings, the job from
 * train.steps) and a dataset's token count. */
/* A DoRA run (lora.dora in the YAML) is planned with its magnitudes: one
 * trainable value per output feature of each target, on top of LoRA's; as
 * QLoRA (--mode qlora, or a fix that changes it to QLoRA) it stays DoRA on
 * the NF4 base (QDoRA): the same trainable values, the base in 4 bits. */
Test(plan, a_dora_run_counts_its_magnitudes)
{
    char *d = tu_tempdir("plandora");
    const char *run = "train:\n  seq_len: 2048\n  micro_batch: 1\nlora:\n  r: 16\n"
                      "  targets: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]\n";
    tu_write_file(tu_fmt("%s/lora.yaml", d), run);
    tu_write_file(tu_fmt("%s/dora.yaml", d), tu_fmt("%s  dora: true\n", run));
    json_t *l = plan_json(tu_fmt("%s/lora.yaml --model llama-7b --gpu H100", d));
    json_t *j = plan_json(tu_fmt("%s/dora.yaml --model llama-7b --gpu H100", d));
    cr_expect(json_is_true(json_object_get(j, "dora")));
    cr_expect(json_is_false(json_object_get(l, "dora")));
    /* 32 layers x (q, k, v, o: 4096 each; gate, up: 11008 each; down: 4096) */
    json_int_t mags = 32 * (4 * 4096 + 2 * 11008 + 4096);
    cr_expect_eq(json_integer_value(json_object_get(j, "trainable_params")),
                 json_integer_value(json_object_get(l, "trainable_params")) + mags);
    cr_expect_eq(json_integer_value(json_object_get(l, "trainable_params")), 39976960);
    double dm = json_real_value(json_object_get(json_object_get(j, "memory_gib"), "total")),
           lm = json_real_value(json_object_get(json_object_get(l, "memory_gib"), "total"));
    cr_expect_gt(dm, lm, "DoRA %.4f GiB, LoRA %.4f GiB", dm, lm);
    json_t *q = plan_json(tu_fmt("%s/dora.yaml --model llama-7b --gpu H100 --mode qlora", d));
    cr_expect(json_is_true(json_object_get(q, "dora")));
    cr_expect_str_eq(json_string_value(json_object_get(q, "mode")), "qlora");
    cr_expect_eq(json_integer_value(json_object_get(q, "trainable_params")),
                 json_integer_value(json_object_get(j, "trainable_params")));
    double qm = json_real_value(json_object_get(json_object_get(q, "memory_gib"), "total"));
    /* 6.5G projection weights: 13 GB in bf16, about 3.4 in NF4 */
    cr_expect(qm < dm - 8.0, "QDoRA %.4f GiB, DoRA %.4f GiB", qm, dm);
    json_decref(q);
    json_decref(j);
    json_decref(l);
    char *out = NULL;
    cr_assert_eq(tu_spotune(&out, "plan %s/dora.yaml --model llama-7b --gpu RTX3090", d), 0,
                 "%s", out);
    cr_expect(tu_contains(out, "mode lora with DoRA: r 16 on") &&
                  tu_contains(out, "(41.3M trainable parameters, a magnitude per output feature "
                                   "included)") &&
                  tu_contains(out, "fits: NO") &&
                  tu_contains(out, "mode qlora (model.quantize nf4: DoRA r 16 on NF4 weights)"),
              "%s", out);
    free(out);
    tu_rmtree(d);
    free(d);
}

Test(plan, command_inputs)
{
    char *d = tu_tiny_dir("plan", 1, 1), *out = NULL;
    json_t *a = plan_json(tu_fmt("%s/model --gpu L4", d));
    json_t *b = plan_json(tu_fmt("%s/model/config.json --gpu L4", d));
    json_t *c = plan_json("tiny --gpu L4");
    json_int_t pa = json_integer_value(json_object_get(a, "params"));
    cr_expect_eq(pa, json_integer_value(json_object_get(b, "params")));
    cr_expect_eq(pa, json_integer_value(json_object_get(c, "params")));
    json_decref(a);
    json_decref(b);
    json_decref(c);

    tu_run_yaml(d, "run:\n  dir: %s/run\ntrain:\n  mode: full\n  steps: 50\n  seq_len: 64\n"
                   "  micro_batch: 4\n  grad_accum: 2\nruntime:\n  recompute: layer\n", d);
    json_t *y = plan_json(tu_fmt("%s/run.yaml --gpu H100 --gpus 2", d));
    cr_expect_str_eq(json_string_value(json_object_get(y, "mode")), "full");
    cr_expect_eq(json_integer_value(json_object_get(y, "seq_len")), 64);
    cr_expect_eq(json_integer_value(json_object_get(y, "micro_batch")), 4);
    cr_expect_str_eq(json_string_value(json_object_get(y, "recompute")), "layer");
    cr_expect(json_is_true(json_object_get(y, "optimizer_sharded")));
    cr_expect(json_is_true(json_object_get(y, "gradients_sharded")));
    double sharded = json_real_value(json_object_get(json_object_get(y, "memory_gib"), "gradients"));
    /* 50 steps x (2 GPUs x 4 x 2) windows x 64 tokens */
    cr_expect_float_eq(json_real_value(json_object_get(json_object_get(y, "job"), "tokens")),
                       50.0 * 16 * 64, 1e-9);
    json_decref(y);
    /* train.shard_gradients false: the whole gradient again, more memory */
    tu_run_yaml(d, "run:\n  dir: %s/run\ntrain:\n  mode: full\n  steps: 50\n  seq_len: 64\n"
                   "  micro_batch: 4\n  grad_accum: 2\n  shard_gradients: false\nruntime:\n"
                   "  recompute: layer\n", d);
    y = plan_json(tu_fmt("%s/run.yaml --gpu H100 --gpus 2", d));
    cr_expect(json_is_true(json_object_get(y, "optimizer_sharded")));
    cr_expect(json_is_false(json_object_get(y, "gradients_sharded")));
    double whole = json_real_value(json_object_get(json_object_get(y, "memory_gib"), "gradients"));
    cr_expect_gt(whole, sharded, "gradients %.3f GiB whole, %.3f sharded", whole, sharded);
    json_decref(y);
    /* model.quantize nf4: the plan of QLoRA */
    tu_write_file(tu_fmt("%s/qlora.yaml", d),
                  tu_fmt("run:\n  dir: %s/run\nmodel:\n  path: %s/model\n  quantize: nf4\n"
                         "data:\n  train: %s/data.train.h5\n",
                         d, d, d));
    y = plan_json(tu_fmt("%s/qlora.yaml --model llama-7b --gpu H100", d));
    cr_expect_str_eq(json_string_value(json_object_get(y, "mode")), "qlora");
    json_decref(y);
    /* options win over the YAML; --model replaces its model.path */
    y = plan_json(tu_fmt("%s/run.yaml --model llama-7b --mode lora --seq-len 128 --gpu H100", d));
    cr_expect_str_eq(json_string_value(json_object_get(y, "mode")), "lora");
    cr_expect_str_eq(json_string_value(json_object_get(y, "model")), "llama-7b");
    cr_expect_eq(json_integer_value(json_object_get(y, "seq_len")), 128);
    cr_expect_eq(json_integer_value(json_object_get(y, "params")), 6738415616LL);
    json_decref(y);

    /* the dataset: its windows of seq_len tokens, times the epochs */
    json_t *ds = plan_json(tu_fmt("tiny --gpu L4 --seq-len 64 --dataset %s/data.train.h5 "
                                  "--epochs 3",
                                  d));
    double tok = json_real_value(json_object_get(json_object_get(ds, "job"), "tokens"));
    cr_expect_gt(tok, 0);
    cr_expect_eq(fmod(tok, 3.0 * 64), 0.0, "%g", tok);
    json_decref(ds);
    cr_expect_eq(tu_spotune(&out, "plan --help"), 0);
    cr_expect(tu_contains(out, "--upload-mbps"), "%s", out);
    free(out);
    cr_expect_eq(tu_spotune(&out, "plan --list-gpus"), 0);
    cr_expect(tu_contains(out, "H200 141GB"), "%s", out);
    free(out);
    cr_expect_eq(tu_spotune(&out, "--help"), 0);
    cr_expect(tu_contains(out, "plan MODEL"), "%s", out);
    free(out);
    tu_rmtree(d);
    free(d);
}

static void refused(int code, const char *args, const char *needle)
{
    char *out = NULL;
    int rc = tu_spotune(&out, "plan %s", args);
    cr_expect_eq(rc, code, "plan %s: exit %d, not %d\n%s", args, rc, code, out);
    cr_expect(tu_contains(out, needle), "plan %s: no '%s' in:\n%s", args, needle, out);
    free(out);
}

Test(plan, bad_inputs)
{
    char *d = tu_tempdir("planbad");
    /* a config.json of an architecture spotune does not train */
    cr_assert_eq(tu_sh(NULL, "mkdir -p %s/gpt2 %s/empty", d, d), 0);
    tu_write_file(tu_fmt("%s/gpt2/config.json", d),
                  "{\"architectures\": [\"GPT2LMHeadModel\"], \"model_type\": \"gpt2\", "
                  "\"vocab_size\": 50257, \"n_embd\": 768, \"n_layer\": 12}");
    refused(3, tu_fmt("%s/gpt2 --gpu H100", d), "architecture 'GPT2LMHeadModel' is not supported");
    refused(3, tu_fmt("%s/gpt2/config.json --gpu H100", d), "gpt2/config.json");
    refused(3, tu_fmt("%s/empty --gpu H100", d), "empty/config.json: missing");
    tu_write_file(tu_fmt("%s/empty/config.json", d), "{\"architectures\": [\"LlamaForCausalLM\"], "
                                                     "\"hidden_size\": 64}");
    refused(3, tu_fmt("%s/empty --gpu H100", d), "vocab_size is missing");
    /* a GPU not in the table, none at all, a memory too small for anything */
    refused(2, "llama-7b --gpu TPUv5", "--gpu 'TPUv5' is not in the table (RTX3090");
    refused(2, "llama-7b", "which GPU?");
    refused(2, "llama-7b --gpu-mem 80", "which GPU?");
    refused(2, "llama-7b --gpu-mem 2 --gpu-tflops 100", "nothing fits");
    refused(2, "llama-7b --gpu-mem 2 --gpu-tflops 100", "QLoRA with layer recompute and "
                                                        "micro-batch 1, needs 5.92 GiB");
    refused(2, "tiny --gpu-mem 0.5 --gpu-tflops 100", "no larger than the headroom");
    refused(2, "llama-13b --gpu-mem 6 --gpu-tflops 100 --mode full", "nothing fits");
    /* bad numbers and words, each named */
    refused(2, "llama-7b --gpu H100 --seq-len abc", "--seq-len 'abc'");
    refused(2, "llama-7b --gpu H100 --seq-len 1", "--seq-len '1'");
    refused(2, "llama-7b --gpu H100 --micro-batch 0", "--micro-batch '0'");
    refused(2, "llama-7b --gpu H100 --gpus 0", "--gpus '0'");
    refused(2, "llama-7b --gpu H100 --nodes -1", "--nodes '-1'");
    refused(2, "llama-7b --gpu-mem -3 --gpu-tflops 100", "--gpu-mem '-3'");
    refused(2, "llama-7b --gpu-mem 80 --gpu-tflops 0", "--gpu-tflops '0'");
    refused(2, "llama-7b --gpu H100 --mfu 1.5", "--mfu 1.5");
    refused(2, "llama-7b --gpu H100 --price-per-hour x", "--price-per-hour 'x'");
    refused(2, "llama-7b --gpu H100 --tokens 0", "--tokens '0'");
    refused(2, "llama-7b --gpu H100 --epochs 2", "--epochs needs --tokens or --dataset");
    refused(2, "llama-7b --gpu H100 --upload-mbps 0", "--upload-mbps '0'");
    refused(2, "llama-7b --gpu H100 --headroom 90", "--headroom 90.00 GiB leaves nothing");
    refused(2, "llama-7b --gpu H100 --mode qlor", "--mode 'qlor'");
    refused(2, "llama-7b --gpu H100 --recompute all", "--recompute 'all'");
    refused(2, "llama-7b --gpu H100 --lora-r 0", "--lora-r '0'");
    refused(2, "llama-7b --gpu H100 --bogus", "unknown or incomplete option '--bogus'");
    refused(2, "--gpu H100", "give a model");
    refused(2, "llama-7b tiny --gpu H100", "one MODEL or RUN.yaml");
    refused(2, "llama-7b --gpu H100 --tokens 5 --dataset x.h5", "--tokens or --dataset");
    /* a dataset that is not one, a YAML with a bad key or a missing model */
    refused(3, tu_fmt("tiny --gpu L4 --dataset %s/none.h5", d), "none.h5");
    tu_write_file(tu_fmt("%s/text.h5", d), "not a dataset\n");
    refused(3, tu_fmt("tiny --gpu L4 --dataset %s/text.h5", d), "text.h5: not an HDF5 file");
    tu_write_file(tu_fmt("%s/bad.yaml", d), "train:\n  seq_len: -4\n");
    refused(2, tu_fmt("%s/bad.yaml --gpu L4", d), "train.seq_len");
    cr_assert_eq(tu_sh(NULL, "printf 'model:\\n  path: %s/nowhere\\n' > %s/nomodel.yaml", d, d), 0);
    refused(3, tu_fmt("%s/nomodel.yaml --gpu L4", d), "model.path: ");
    refused(3, tu_fmt("%s/nomodel.yaml --gpu L4", d), "--model config.json|DIR|PRESET");
    refused(2, tu_fmt("llama-7b --model tiny --gpu L4"), "--model replaces a run YAML's model.path");
    tu_rmtree(d);
    free(d);
}

/* docs/plan.md carries scripts/plan_table.sh's output and --list-gpus's
 * table unchanged. */
Test(plan, docs_tables_are_the_commands_output, .timeout = 120)
{
    char *doc = tu_read_file(tu_fmt("%s/docs/plan.md", tu_source_dir()), NULL), *out = NULL;
    cr_assert(doc);
    cr_assert_eq(tu_sh(&out, "bash %s/scripts/plan_table.sh --spotune %s/spotune",
                       tu_source_dir(), tu_binary_dir()),
                 0, "%s", out);
    const char *begin = "<!-- scripts/plan_table.sh: begin -->\n";
    const char *b = strstr(doc, begin), *e = strstr(doc, "<!-- scripts/plan_table.sh: end -->");
    cr_assert(b && e && e > b);
    b += strlen(begin);
    cr_expect(strlen(out) == (size_t)(e - b) && !strncmp(b, out, (size_t)(e - b)),
              "docs/plan.md's table is not scripts/plan_table.sh's output; regenerate it:\n%s",
              out);
    free(out);
    cr_assert_eq(tu_spotune(&out, "plan --list-gpus"), 0, "%s", out);
    cr_expect(strstr(doc, out), "docs/plan.md lacks the table of --list-gpus:\n%s", out);
    free(out);
    free(doc);
}
