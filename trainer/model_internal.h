/* trainer/model_internal.h — private to model.c, model_alloc.c,
 * model_graph.c, model_lora.c and model_step.c: the activation and scratch
 * buffers of the model, the steps of model_create that model_alloc.c
 * implements, what model_step.c asks of model_graph.c, and what
 * model_graph.c asks of model_lora.c. */
#ifndef SPOTUNE_MODEL_INTERNAL_H
#define SPOTUNE_MODEL_INTERNAL_H

#include "model.h"

/* What a layer's backward needs from its forward. With recompute=layer only
 * x is kept per layer and the rest point at one shared set; with
 * recompute=attention att and lse are shared and recomputed. */
struct layer_acts {
    tensor_t x; /* layer input (the residual stream) [BT,H] */
    tensor_t rstd1, h1, q, k, v, att, lse, x_mid, rstd2, h2, g, u, a;
    /* the memory of q, k, v (one block, in that order) and of g, u: after
     * the attention's (the SwiGLU's) backward they are dead, and the
     * backward of a fused product joins its output gradients there */
    tensor_t qkv, gu;
    tensor_t xr[PROJ_COUNT]; /* LoRA x.A^T [BT,r] */
    /* the memory of a fused group's xr (one block; xr[p] its consecutive
     * [BT,r] parts), or [BT, count r] when the group's LoRA is batched */
    tensor_t xr_cat[FUSE_COUNT];
    tensor_t wnorm[PROJ_COUNT]; /* DoRA: ||W + s B A||_row [out] (F32), detached */
};

typedef struct model_scratch {
    tensor_t x_final, rstd_f, hf; /* final norm input/output */
    tensor_t dres, dh;            /* residual gradient, norm-output gradient */
    tensor_t bwd;                 /* union: MLP (dg, du, da) or attention (dq, dk, dv, datt);
                                     in the forward, a fused product's output */
    tensor_t dxr, drop;           /* LoRA: d(x.A^T) [BT, 3r], dropped input */
    tensor_t dora;                /* DoRA: a projection's unscaled output, then its
                                     gradient times m / n [BT, widest projection] */
    tensor_t logits, loss, tokens, targets;
    tensor_t pos, seg; /* packed documents: positions and first positions [BT] (model_batch);
                          seg has room after them for their document table [BT + 1] */
    int doc_cap; /* the staged micro-batch's document table: its capacity C (C + 1
                    entries after seg's rows), 0 when none was staged */
    /* per-micro-batch values the launches read from device memory, so a
     * captured micro-batch replays for the next: the LoRA dropout seed of
     * each window (I32 [2 B], a 64-bit value each) and the loss gradient's
     * scale (F32 [1]) */
    tensor_t seeds, gscale;
    /* full fine-tuning: the tokens grouped by id for the embedding's
     * backward (embedding_order: I32 [BT] and [BT + 2]) */
    tensor_t emb_order, emb_runs;
    /* the host side of every staged value of a micro-batch (be_host_alloc,
     * I32 words: tokens, targets, positions, document starts [BT] each,
     * seeds [2 B], the scale, order [BT] and runs [BT + 2]) */
    int32_t *host;
    size_t host_words;
    tensor_t rope_cos, rope_sin;
    int64_t chunk_rows; /* rows of logits materialised at once */
    int gate_up_in_place; /* the fused gate/up product in place (s->bwd sized for it) */
    /* fused groups whose LoRA ran batched, forward and backward counted
     * apart, and the projections whose B products ran in a strided
     * batched product with others (model_lora_width_run) (as the host
     * issued them: a graph's replays do not count) */
    long lora_batched_fwd, lora_batched_bwd, lora_uniform_fwd, lora_uniform_bwd;
} model_scratch;

#define MODEL_SCRATCH(m) ((model_scratch *)(m)->scratch)

/* model.c: whether projection proj carries LoRA in this model. */
int model_lora_on(const model_t *m, int proj);
/* model.c: every slot of the NF4 workspace forgets the weight it holds
 * (model_weight dequantizes each again on its next use). */
void model_nf4_forget(model_t *m);

/* model_alloc.c, in the order model_create calls them: each trainable
 * parameter's offset in the flat arenas (n_trainable); the gradient segments
 * of sharded gradients; the parameters' memory (arenas, shards, buckets,
 * fused weights, NF4 tables); the activations and scratch. */
int model_layout_arenas(model_t *m, sp_err *err);
int model_layout_segments(model_t *m, sp_err *err);
void model_alloc_params(model_t *m);
void model_alloc_activations(model_t *m);
/* model_step.c: releases the captured micro-batches. */
void model_graphs_free(model_t *m);

/* A micro-batch being run (model_step.c) and what model_graph.c computes of
 * it: the forward (the final residual in s->x_final), the head (final norm,
 * LM head, loss; with backward, their gradients and s->dres), a layer's
 * backward. rows = B * T; training: LoRA dropout on. */
typedef struct step_ctx {
    model_t *m;
    const model_batch *b;
    int rows;
    int training;
} step_ctx;
void model_graph_forward(const step_ctx *c);
void model_graph_head(const step_ctx *c, int backward);
void model_graph_layer_backward(const step_ctx *c, int l);

/* model_graph.c and model_lora.c: a matrix's first rows, columns from col
 * on of a row-major matrix (a view to its end), no tensor, and projection p
 * of layer l (its parameters, the w, b, lora_a and lora_b of L, and its
 * input and output widths). */
static inline tensor_t rows_of(tensor_t t, int rows, int64_t cols)
{
    return tensor_view(t, 0, (size_t)rows * (size_t)cols);
}

static inline tensor_t from_col(tensor_t t, int col)
{
    return tensor_view(t, (size_t)col, t.n - (size_t)col);
}

static inline tensor_t no_tensor(void)
{
    tensor_t t = {0};
    return t;
}

typedef struct proj_view {
    layer_params *L;
    int in, out;
} proj_view;

static inline proj_view proj_of(const model_t *m, int l, int p)
{
    int64_t in, out;
    model_config_proj_dims(&m->mc, p, &in, &out);
    proj_view j = {&m->layers[l], (int)in, (int)out};
    return j;
}

/* model_lora.c: the LoRA and DoRA branches (their comments there) */
int model_lora_dropping(const step_ctx *c);
tensor_t model_lora_down(const step_ctx *c, int l, int p, tensor_t x, int64_t in);
void model_lora_backward(const step_ctx *c, int l, int p, tensor_t dy, int dy_ld, tensor_t x,
                         tensor_t dx, float dx_beta);
tensor_t model_lora_run(const model_t *m, int l, int first, int count, int b_matrix, int grad);
int model_lora_batched(const step_ctx *c, int l, int g);
int model_lora_width_run(const model_t *m, int l, int first, int count, int i);
void model_lora_group_backward(const step_ctx *c, int l, int g, const tensor_t *dys, int dy_ld,
                               tensor_t x, tensor_t dx, float dx_beta);
void model_dora_unscaled(const step_ctx *c, int l, int p, tensor_t w, tensor_t z, tensor_t x);
void model_dora_forward(const step_ctx *c, int l, int p, tensor_t y, tensor_t x, int accumulate);
void model_dora_dropout_backward(const step_ctx *c, int l, int p, tensor_t dy, tensor_t x,
                                 tensor_t dx, int accumulate);
/* Whether p's compute copy is a view into a fused weight (not freed alone). */
int model_fused_view(const model_t *m, const param_t *p);

#endif
