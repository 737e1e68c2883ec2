/* trainer/model.h — the Llama-family model written once against
 * kernels/backend.h: the parameter table (Hugging Face and PEFT names, which
 * are trainable), the trainable arenas (fp32 masters, gradients, AdamW
 * moments), activations sized for (micro_batch, seq_len), and the forward,
 * backward and evaluation of a micro-batch. Owns every device buffer of the
 * model. Never dereferences device memory. */
#ifndef SPOTUNE_MODEL_H
#define SPOTUNE_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "../kernels/backend.h"
#include "config.h"
#include "model_config.h"

/* PK_LORA_M: DoRA's magnitude vector [out] of a target projection */
enum { PK_EMBED, PK_NORM, PK_WEIGHT, PK_BIAS, PK_LM_HEAD, PK_LORA_A, PK_LORA_B, PK_LORA_M };

typedef struct param {
    char name[160]; /* as Hugging Face (base) or PEFT (adapter) names it */
    int kind, layer, proj;
    int ndim;
    int64_t shape[2];
    size_t n;
    int trainable, decay;
    size_t offset;   /* in the trainable arenas */
    tensor_t w;      /* compute copy (act_dt): what the ops read */
    tensor_t master; /* F32 master (trainable only; on the CPU the same memory as w;
                        empty when the optimizer is sharded: the masters of the
                        rank's shard are in model.master) */
    tensor_t grad;   /* F32 gradient (trainable only) */
    /* model.quantize nf4, a projection weight (PK_WEIGHT): w is empty and the
     * value is held as NF4 with double quantization (kernels/nf4.h): codes U8
     * [(n+1)/2], absmax U8 [blocks of 64], nested F32 [blocks of 256 blocks],
     * offset; model_weight() dequantizes it when a product needs it */
    tensor_t q_codes, q_absmax, q_nested;
    float q_offset;
} param_t;

/* Fused products: the projections that read one input, q, k, v (of the
 * normalised residual) and gate, up (of the second norm's output), are one
 * product each when their weights are frozen and dense (LoRA without NF4 or
 * DoRA): their weights are stored concatenated by output rows, each
 * projection's w a view into it, so names, shapes, loading and saving are
 * those of the separate projections. */
enum { FUSE_QKV, FUSE_GATE_UP, FUSE_COUNT };
/* The projections of group g: first, first + 1, ..., first + count - 1. */
void model_fuse_group(int g, int *first, int *count);

typedef struct layer_params {
    param_t *attn_norm, *mlp_norm;
    param_t *w[PROJ_COUNT], *b[PROJ_COUNT];
    param_t *lora_a[PROJ_COUNT], *lora_b[PROJ_COUNT]; /* NULL: not a target */
    param_t *lora_m[PROJ_COUNT];                      /* NULL: not a target or no DoRA */
    /* the concatenated weight [sum of the outs, in] of each fused group
     * (act_dt; model_t.fused); p == NULL: that group's products are made
     * one by one, or its weights are NF4 and dequantized together into
     * model_t.nf4_work for the group's product.
     * fused_b: the group's biases concatenated the same way [sum of the
     * outs] (each projection's b->w a view; zeros for a projection without
     * one), so one add_bias serves the group's product; p == NULL when no
     * projection of the group has a bias. Fused groups train LoRA only, so
     * these weights and biases are frozen. */
    tensor_t fused_w[FUSE_COUNT], fused_b[FUSE_COUNT];
} layer_params;

typedef struct model_opts {
    int mode; /* MODE_LORA or MODE_FULL */
    int64_t lora_r;
    double lora_alpha, lora_dropout;
    int64_t lora_targets;
    int rslora;
    int dora; /* DoRA: lora_m on every target (needs lora_dropout 0) */
    /* QLoRA: the projection weights (PK_WEIGHT) stored as NF4 with double
     * quantization (kernels/nf4.h) instead of a dense compute copy; needs
     * MODE_LORA and no DoRA */
    int nf4;
    int64_t max_batch, seq_len;
    int recompute;
    uint64_t seed;
    /* Optimizer sharding (ZeRO stage 1): with shard_count > 1 this rank keeps
     * the fp32 masters and AdamW moments of one contiguous 1/shard_count of
     * the trainable arena only; the gradients are reduce-scattered into that
     * shard and the updated compute copy all-gathered (grad_sync.h). 0 or 1:
     * every rank holds the whole state. */
    int shard_rank, shard_count;
    /* Gradient sharding (ZeRO stage 2, full mode with shard_count > 1): no
     * whole gradient arena; the backward writes into bucket buffers that
     * grad_sync reduces, as the backward finishes each, into the owners'
     * grad_shard (model.shard_grads). */
    int shard_grads;
    /* 1: never fuse products (the per-projection path everywhere; for
     * comparisons); the environment's SPOTUNE_FUSED=0 sets it too */
    int no_fuse;
    /* 1: the LoRA branches of a fused group one by one, never batched
     * (trainer/model_graph.c, lora_batched; for comparisons); the
     * environment's SPOTUNE_LORA_BATCHED=0 sets it too */
    int no_lora_batch;
    /* 1: each micro-batch's forward and backward is a captured span
     * (be_graph, kernels/backend.h): captured on the second micro-batch
     * that launches exactly what an earlier one did, replayed for every
     * later one that does (their launch traces match), eager otherwise
     * (a micro-batch whose gradients are reduced during the backward, a
     * profiled step). On CUDA one CUDA graph; on the CPU the recorded op
     * list (the same rules, for tests). The step's update (model_update)
     * is a captured span too, by the same rules. A span that cannot be
     * captured turns it off for the run, with why in model.graph_off. */
    int graphs;
} model_opts;

/* A micro-batch: host arrays of B*T token ids. targets < 0 are not trained. */
typedef struct model_batch {
    const int32_t *inputs, *targets;
    const uint64_t *sample_ids; /* [B] global sample index of each window (dropout streams) */
    int B, T;
    float grad_scale; /* d(step loss)/d(sum of token losses): 1 / trained tokens of the step */
    int last;         /* the step's last micro-batch: gradients become final (grads_ready) */
    /* Packed documents (data.packing documents|pad), or both NULL (one
     * stream: position t, every earlier token attended): [B*T] each, pos
     * the RoPE position of each token (0 at its document's start), seg the
     * index in its row of its document's first token (0 <= seg[t] <= t). */
    const int32_t *pos, *seg;
} model_batch;

/* Called during the backward of the step's last micro-batch each time the
 * prefix [0, upto) of the gradient arena holds its final values (the arena
 * is laid out in the order the backward finishes gradients), so their
 * reduction across ranks can start while the backward goes on. With sharded
 * gradients it is called during every micro-batch's backward (the prefix
 * holds that micro-batch's gradient) and is required: the bucket buffers
 * are reused, so each segment must be reduced before the backward goes on
 * two segments further. */
typedef void (*model_grads_ready_fn)(void *ctx, size_t upto);

typedef struct layer_acts layer_acts;

typedef struct adamw_run {
    size_t offset, n;
    int decay;
} adamw_run;

/* What captured spans of one kind did: how many replayed a graph (the one
 * just captured included), were captured, ran eagerly; ops: the ops (kernel
 * launches, copies) of the last capture. */
typedef struct model_graph_count {
    size_t replays, captures, eager, ops;
} model_graph_count;

typedef struct model {
    model_config_t mc;
    model_opts o;
    backend_t *be;
    param_t *params;
    int nparams;
    param_t *embed, *final_norm, *lm_head;
    layer_params *layers;
    /* q, k, v and gate, up are one product each (LoRA without DoRA:
     * model_alloc.c fuse_on; layer_params.fused_w) */
    int fused;
    float lora_scale;
    /* trainable arenas, laid out in the order the backward produces them */
    size_t n_trainable;
    tensor_t master, grad, adam_m, adam_v, copy;
    /* sharded optimizer: this rank's shard is [shard_lo, shard_lo + shard_len)
     * of the arena; grad (empty with sharded gradients, below) and copy hold
     * shard_count * shard_len elements (the tail past n_trainable is zero
     * padding); master, adam_m, adam_v and
     * grad_shard hold shard_len. Unsharded: shard_lo 0, shard_len
     * n_trainable, shard_count 1. */
    int shard_count, shard_rank;
    size_t shard_lo, shard_len;
    tensor_t grad_shard;
    /* sharded gradients (ZeRO stage 2): grad is empty. The arena is cut
     * into nsegs segments, one per unit the backward finishes at once (the
     * head, each layer from the last, the embedding); segment k is
     * [seg_end[k - 1], seg_end[k]) and its gradient is written into bucket
     * buffer grad_bufs[seg_buf[k]] (from its start; param_t.grad are views of
     * it). Two buffers serve the segments in turn (a tied embedding, written
     * by the head and the embedding, has a third): grad_sync reduces each
     * segment into the owners' grad_shard and zeroes its buffer before the
     * backward reaches the segment after next. grad_buckets_len: their
     * elements in all. */
    int shard_grads;
    int nsegs;
    size_t *seg_end;
    int *seg_buf;
    tensor_t grad_bufs[3];
    size_t grad_buckets_len;
    adamw_run *runs;
    int nruns;
    /* arena prefix final after the head (index 0) and after layer l's
     * backward (index 1 + l) */
    size_t *ready_upto;
    model_grads_ready_fn grads_ready;
    void *grads_ready_ctx;
    /* activations and scratch */
    layer_acts *acts;
    void *scratch;
    size_t bytes_weights, bytes_trainable, bytes_acts;
    /* model.quantize nf4: the NF4 values then the 8-bit dynamic map (F32
     * [16 + 256]), and the workspace the dequantized weights are written to
     * (act_dt): projection p's at nf4_off[p] (model_nf4_slots: a slot each
     * under recompute layer, else the largest projection or fused group),
     * holding layer nf4_held[p]'s weight (-1: none), which model_weight
     * then reads without dequantizing it again; nf4_dequants counts the
     * dequantizations */
    tensor_t nf4_maps, nf4_work;
    size_t nf4_off[PROJ_COUNT];
    int nf4_held[PROJ_COUNT];
    int nf4_reuse; /* 0 (SPOTUNE_NF4_REUSE=0, tests): dequantized at every use */
    long nf4_dequants;
    /* the step's update (model_update): F32 [10], adamw_args.hyper at 0
     * (3 values), the gradient's sum of squares (a double) at 4; the
     * training micro-batches' loss sum (a double, model_loss_take) at 6,
     * an evaluation's at 8 */
    tensor_t upd;
    /* captured spans (model_opts.graphs, model_step.c): the graphs kept for
     * the micro-batches and for the update, and what each did; graph_off:
     * why graphs were turned off ("" while on) */
    struct model_graphs *graphs, *graphs_upd;
    model_graph_count graph_mb, graph_upd;
    char graph_off[320];
} model_t;

/* Builds the parameter table and allocates everything (weights zero: load or
 * initialise next). */
int model_create(model_t **out, backend_t *be, const model_config_t *mc, const model_opts *o,
                 sp_err *err);
void model_destroy(model_t *m);
/* Base weights ~ N(0, 0.02), norms 1, biases 0 (as Hugging Face initialises). */
void model_init_base_random(model_t *m, uint64_t seed);
/* LoRA A Kaiming-uniform (a = sqrt 5, i.e. U(-1/sqrt(in), 1/sqrt(in))), B = 0;
 * with DoRA the magnitude m = ||W + s B A||_row = ||W||_row (as PEFT
 * initialises it): call after the base weights are loaded. */
void model_init_lora(model_t *m, uint64_t seed);
/* The compute copy of p for a product: p->w, or for an NF4 weight its
 * dequantized value in its slot of m->nf4_work, dequantized unless the
 * slot holds it already (valid until a weight whose slot overlaps it is
 * asked for). */
tensor_t model_weight(model_t *m, const param_t *p);
/* The NF4 workspace's slots (offset[p] for projection p) and its elements
 * (0 without NF4); model_alloc.c. */
size_t model_nf4_slots(const model_config_t *mc, const model_opts *o, size_t offset[PROJ_COUNT]);
/* Copies host values (dtype src_dt) into a parameter (master and compute
 * copy; an NF4 weight is quantized on the host first). */
void model_param_upload(model_t *m, param_t *p, const void *src, dtype_t src_dt);
/* Sets NF4 weight p from a stored state (bitsandbytes' layout, host memory):
 * codes [(n+1)/2], 8-bit absmax [blocks], nested absmax [nested blocks], offset. */
void model_param_set_nf4(model_t *m, param_t *p, const uint8_t *codes, const uint8_t *absmax,
                         const float *nested, float offset);
/* Reads a parameter's value (the F32 master when trainable; the compute copy
 * when the optimizer is sharded) into host F32. */
void model_param_download(model_t *m, const param_t *p, float *dst);
param_t *model_find_param(model_t *m, const char *name);

/* Zeroes the gradient (sharded gradients: grad_shard and the buckets). */
void model_zero_grads(model_t *m);
/* Forward and backward of one micro-batch: its gradients (scaled by
 * grad_scale) added into the gradient arena, its summed token loss into the
 * model's loss sum in device memory. With loss_sum, that sum is then taken
 * (model_loss_take) into *loss_sum, which waits for the micro-batch; with
 * NULL nothing waits for the device, and the host may stage the next
 * micro-batch while this one runs (the trainer takes the loss once a step). */
int model_forward_backward(model_t *m, const model_batch *b, double *loss_sum, sp_err *err);
/* Adds the loss summed since the last take (the micro-batches' losses, in
 * their order, in double) to *loss_sum and starts the sum again; waits for
 * the device, so a fault of the step's kernels surfaces here. */
int model_loss_take(model_t *m, double *loss_sum, sp_err *err);
/* Forward only, no dropout: adds the summed token loss to *loss_sum. */
int model_evaluate(model_t *m, const model_batch *b, double *loss_sum, sp_err *err);
/* Forward only: writes the logits [B*T, vocab] (F32) to host memory. */
int model_forward_logits(model_t *m, const model_batch *b, float *logits, sp_err *err);
/* Sum of squares of every trainable gradient (sharded: of this rank's shard
 * of the reduced gradient; the caller sums over the ranks). */
double model_grad_sumsq(model_t *m);
/* One AdamW step over every trainable parameter (no decay on norms, biases);
 * sharded: over this rank's shard, writing its part of the compute copy,
 * which the caller then all-gathers. */
void model_adamw(model_t *m, const adamw_args *a);
/* The step's update with an unsharded optimizer: the gradient's sum of
 * squares written to device memory, and model_adamw reading it there (the
 * clip scale, adamw_clip_scale of its root against max_norm; a->grad_scale
 * is not used), with a's learning rate and bias corrections staged in
 * device memory too (m->upd). Nothing waits between the norm and the
 * update; the norm is read after: *gnorm. When it is not finite nothing
 * was updated (the caller fails the step). With model_opts.graphs the two
 * are one captured span, the same every step, so it replays. A sharded
 * optimizer, whose norm is summed over the ranks, is refused: see
 * grad_sync_update. */
int model_update(model_t *m, const adamw_args *a, double max_norm, double *gnorm, sp_err *err);

/* Bytes the model needs, by category, before anything is allocated (with
 * model_opts.nf4 the projection weights count nf4_bytes() each and the
 * dequantization workspace is in scratch). */
typedef struct model_plan {
    size_t weights, trainable, activations, scratch;
} model_plan;
void model_plan_bytes(const model_config_t *mc, const model_opts *o, dtype_t act_dt,
                      model_plan *plan);
/* Elements of this rank's optimizer shard when n trainable elements are split
 * over count ranks (the last shards are padded). */
size_t model_shard_len(size_t n, int count);
/* Whether o shards the gradients: shard_grads, shard_count > 1, full mode. */
int model_shards_grads(const model_opts *o);
/* Elements of the gradient bucket buffers a model of o allocates (0 unless
 * it shards the gradients): two of the largest of the head's, a layer's
 * and an untied embedding's gradients, plus a tied embedding's. */
size_t model_grad_buckets_len(const model_config_t *mc, const model_opts *o);
/* Sharded gradients: segment k's bucket (its length: the segment's) and, in
 * *lo, where the segment starts in the arena. */
tensor_t model_grad_segment(model_t *m, int k, size_t *lo);

/* Hugging Face / PEFT names. */
void model_base_name(char *buf, size_t n, int layer, int proj, int bias);
void model_lora_name(char *buf, size_t n, int layer, int proj, int b_matrix);
/* PEFT's name of DoRA's magnitude vector: ...q_proj.lora_magnitude_vector */
void model_dora_name(char *buf, size_t n, int layer, int proj);
/* DoRA: n[o] = ||W[o,:] + s (B A)[o,:]||_2 of target p of layer l into the
 * F32 tensor n [out], from w (W's compute copy: model_weight(), for an NF4
 * weight its dequantized value) and the compute copies of A and B. */
void model_dora_norm(model_t *m, int l, int p, tensor_t w, tensor_t n);

#endif
