/* The computation of the model: a micro-batch's forward, loss and backward,
 * written once against the backend ops. Shapes: rows = B*T token positions,
 * H hidden, qd = heads*head_dim, kvd = kv_heads*head_dim, I intermediate.
 * q, k, v and gate, up are one product each where the model is fused
 * (model_t.fused: their weights concatenated in layer_params.fused_w, or
 * NF4 weights dequantized together), one per projection elsewhere. */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>

#include "model.h"
#include "model_internal.h"

/* y += b + scale * (drop(x) A^T) B^T: what a projection adds to its base
 * product (its bias when bias is set, its LoRA branch); y has row stride
 * y_ld (a column block of a strided fused product's, whose biases were
 * added to the whole product: fused_forward). xr.p: the
 * branch's xr is already made, stored with row stride ld (a block of a
 * batched group's). */
static void linear_extras(const step_ctx *c, int l, int p, tensor_t y, int y_ld, tensor_t x,
                          tensor_t xr, int ld, int bias)
{
    model_t *m = c->m;
    proj_view j = proj_of(m, l, p);
    int r = (int)m->o.lora_r;
    if (bias && j.L->b[p])
        be_add_bias(m->be, y, j.L->b[p]->w, c->rows, j.out);
    if (j.L->lora_a[p]) {
        be_prof_lora(m->be, 1);
        if (!xr.p)
            xr = model_lora_down(c, l, p, x, j.in), ld = r;
        be_matmul_ld(m->be, y, xr, j.L->lora_b[p]->w, c->rows, j.out, r, 0, 1, m->lora_scale,
                     1.0f, ld, r, y_ld);
        be_prof_lora(m->be, 0);
    }
}

/* y = res + x W^T + b + scale * (drop(x) A^T) B^T (res.p NULL: no res);
 * the base product reads res and writes y (be_matmul_into: on CUDA no copy
 * of the residual stream) */
static void linear_forward(const step_ctx *c, int l, int p, tensor_t y, tensor_t x, tensor_t res)
{
    model_t *m = c->m;
    proj_view j = proj_of(m, l, p);
    if (j.L->lora_m[p]) {
        if (res.p)
            be_copy(m->be, rows_of(y, c->rows, j.out), rows_of(res, c->rows, j.out));
        model_dora_forward(c, l, p, y, x, res.p != NULL);
        return;
    }
    be_matmul_into(m->be, y, x, model_weight(m, j.L->w[p]), res.p ? res : y, c->rows, j.out, j.in,
                   0, 1, 1.0f, res.p ? 1.0f : 0.0f);
    linear_extras(c, l, p, y, j.out, x, no_tensor(), 0, 1);
}

/* Given dy: dx (+)= dy W (+ the LoRA path; no dx when dx.p is NULL), and
 * the gradients of whatever is trainable (W, b, A, B, DoRA's magnitude).
 * The LoRA path writes (or
 * adds to) dx first and the base product adds to it: the small product
 * writes dx once instead of reading and writing it, the large one reads it
 * while it computes (as in fused_forward). */
static void linear_backward(const step_ctx *c, int l, int p, tensor_t dy, tensor_t x, tensor_t dx,
                            int accumulate)
{
    model_t *m = c->m;
    proj_view j = proj_of(m, l, p);
    param_t *W = j.L->w[p], *bias = j.L->b[p];
    if (bias && bias->trainable)
        be_bias_backward(m->be, bias->grad, dy, c->rows, j.out);
    if (j.L->lora_m[p] && model_lora_dropping(c)) {
        model_dora_dropout_backward(c, l, p, dy, x, dx, accumulate);
        return;
    }
    tensor_t w = model_weight(m, W); /* dequantized once (NF4) */
    if (j.L->lora_m[p]) {
        /* DoRA: dm += sum_rows dy * z / n; the rest sees dy * m / n */
        tensor_t g = rows_of(MODEL_SCRATCH(m)->dora, c->rows, j.out), n = m->acts[l].wnorm[p];
        be_prof_lora(m->be, 1);
        model_dora_unscaled(c, l, p, w, g, x);
        be_col_dot(m->be, j.L->lora_m[p]->grad, dy, g, n, c->rows, j.out);
        be_copy(m->be, g, rows_of(dy, c->rows, j.out));
        be_col_scale(m->be, g, j.L->lora_m[p]->w, n, c->rows, j.out);
        be_prof_lora(m->be, 0);
        dy = g;
    }
    float beta = accumulate ? 1.0f : 0.0f;
    if (j.L->lora_a[p]) {
        model_lora_backward(c, l, p, dy, j.out, x, dx, beta);
        beta = 1.0f;
    }
    if (dx.p)
        be_matmul(m->be, dx, dy, w, c->rows, j.in, j.out, 0, 0, 1.0f, beta);
    if (W->trainable)
        be_matmul(m->be, W->grad, dy, x, j.out, j.in, c->rows, 1, 0, 1.0f, 1.0f);
}

/* Output columns of fused group g (the sum of its projections' outs). */
static int fused_width(const model_t *m, int g)
{
    int first, count, n = 0;
    model_fuse_group(g, &first, &count);
    for (int p = first; p < first + count; p++)
        n += proj_of(m, 0, p).out;
    return n;
}

/* Whether fused group g of layer l is strided: its outputs are used as the
 * column blocks of its product x W_cat^T [rows, sum of outs] (row stride
 * that width), with no split copy, and its backward reads the outputs'
 * gradients as the column blocks of one such matrix, with no join copy.
 * Each projection's LoRA branch adds into its block (be_matmul_ld).
 * - gate/up: the product is written into the layer's gu (gate and up its
 *   column halves); SwiGLU reads the halves, and its backward writes
 *   d(gate) and d(up) over them. Decided with the scratch's size
 *   (model_alloc.c gate_up_in_place: no bias on gate or up).
 * - q/k/v: the product is written into the layer's qkv, RoPE rotates its
 *   q and k blocks in place, and attention reads q, k, v as its column
 *   blocks (row strides, qkv_of); the attention backward writes dq, dk, dv
 *   as the column blocks of one matrix in s->bwd, whose q and k blocks RoPE
 *   rotates back in place. No copy either way. Biases on q, k, v (Qwen2)
 *   are one add over the whole product (layer_params.fused_b).
 * Fused groups have no DoRA (model_alloc.c fuse_on), and their biases are
 * frozen (LoRA), so the backward has no bias gradient to take from the
 * strided blocks. */
static int fused_strided(const model_t *m, int l, int g)
{
    const layer_params *L = &m->layers[l];
    if (!m->fused)
        return 0;
    if (g == FUSE_GATE_UP)
        return MODEL_SCRATCH(m)->gate_up_in_place;
    return (!L->b[PROJ_Q] && !L->b[PROJ_K] && !L->b[PROJ_V]) || L->fused_b[g].p;
}

/* Layer l's gate and up activations and their row stride (see
 * fused_strided) */
static int gate_up(const step_ctx *c, int l, tensor_t *g, tensor_t *u)
{
    layer_acts *a = &c->m->acts[l];
    int I = (int)c->m->mc.intermediate;
    if (!fused_strided(c->m, l, FUSE_GATE_UP)) {
        *g = a->g, *u = a->u;
        return I;
    }
    *g = rows_of(a->gu, c->rows, 2 * (int64_t)I);
    *u = from_col(*g, I);
    return 2 * I;
}

/* The weight [sum of outs, in] of fused group g of layer l: the
 * concatenated dense weights, or the NF4 weights dequantized into their
 * slots of the workspace, which follow one another (model_nf4_slots), each
 * unless its slot holds it already (valid until another weight's slot
 * overlaps them). */
static tensor_t fused_weight(const step_ctx *c, int l, int g)
{
    model_t *m = c->m;
    layer_params *L = &m->layers[l];
    if (L->fused_w[g].p)
        return L->fused_w[g];
    int first, count;
    size_t n = 0;
    model_fuse_group(g, &first, &count);
    for (int p = first; p < first + count; p++) {
        model_weight(m, L->w[p]);
        n += L->w[p]->n;
    }
    return tensor_view(m->nf4_work, m->nf4_off[first], n);
}

/* Fused group g of layer l from the input x the group shares: one product
 * x W_cat^T [rows, sum of outs] into the layer's gu (gate/up strided) or
 * s->bwd (unused in the forward), then each projection's bias and LoRA
 * branch. Strided (fused_strided), the outputs are the product's column
 * blocks; else it is split into ys (projection first + i's in ys[i]).
 * Strided with batched LoRA, the branches come first: each B product
 * writes its block (beta 0) and the base product adds to the whole
 * (beta 1), which it reads while it computes; in the other order each B
 * product would read and write its block, a pass over the group's output
 * in memory-bound small products (7B: 3 x 16 MB for q/k/v, 2 x 45 MB for
 * gate/up, each way, a layer). */
static void fused_forward(const step_ctx *c, int l, int g, const tensor_t *ys, tensor_t x)
{
    model_t *m = c->m;
    int first, count, N = fused_width(m, g), in = (int)m->mc.hidden;
    model_fuse_group(g, &first, &count);
    int strided = fused_strided(m, l, g);
    tensor_t cat = rows_of(!strided ? MODEL_SCRATCH(m)->bwd
                           : g == FUSE_GATE_UP ? m->acts[l].gu
                                               : m->acts[l].qkv,
                           c->rows, N);
    tensor_t xr = no_tensor();
    int r = (int)m->o.lora_r, batched = model_lora_batched(c, l, g);
    if (batched) {
        be_prof_lora(m->be, 1);
        MODEL_SCRATCH(m)->lora_batched_fwd++;
        xr = rows_of(m->acts[l].xr_cat[g], c->rows, count * r);
        be_matmul(m->be, xr, x, model_lora_run(m, l, first, count, 0, 0), c->rows, count * r, in, 0,
                  1, 1.0f, 0.0f);
        /* strided: the B products first, each writing its block of cat's
         * columns; a run of one width (model_lora_width_run) one batched
         * product */
        for (int i = 0, j, col = 0; strided && i < count; i = j) {
            int p0 = first + i, out = proj_of(m, l, p0).out, n;
            j = model_lora_width_run(m, l, first, count, i);
            n = j - i;
            tensor_t bw = model_lora_run(m, l, p0, n, 1, 0);
            if (n > 1 && bw.p) {
                MODEL_SCRATCH(m)->lora_uniform_fwd += n;
                be_matmul_batched(m->be, from_col(cat, col), from_col(xr, i * r), bw, c->rows, out,
                                  r, 0, 1, m->lora_scale, 0.0f, count * r, r, N, n, (size_t)r,
                                  (size_t)out * (size_t)r, (size_t)out);
                col += n * out;
                continue;
            }
            for (int k = i; k < j; k++, col += out)
                be_matmul_ld(m->be, from_col(cat, col), from_col(xr, k * r),
                             m->layers[l].lora_b[first + k]->w, c->rows, out, r, 0, 1,
                             m->lora_scale, 0.0f, count * r, r, N);
        }
        be_prof_lora(m->be, 0);
    }
    int lora_first = batched && strided;
    be_matmul(m->be, cat, x, fused_weight(c, l, g), c->rows, N, in, 0, 1, 1.0f,
              lora_first ? 1.0f : 0.0f);
    if (strided && m->layers[l].fused_b[g].p) /* the group's biases, one add */
        be_add_bias(m->be, cat, m->layers[l].fused_b[g], c->rows, N);
    if (lora_first)
        return;
    for (int i = 0, col = 0; i < count; i++) {
        int out = proj_of(m, l, first + i).out;
        tensor_t y = strided ? from_col(cat, col) : ys[i];
        if (!strided)
            be_copy2d(m->be, ys[i], from_col(cat, col), c->rows, out, out, N);
        linear_extras(c, l, first + i, y, strided ? N : out, x,
                      batched ? from_col(xr, i * r) : no_tensor(), count * r, !strided);
        col += out;
    }
}

/* The backward of fused_forward given the outputs' gradients dys: they are
 * joined into `join` (the group's activations, dead by now) as one
 * [rows, sum of outs] matrix (strided: they are join's column blocks
 * already), dx = join W_cat (one product; the frozen W_cat has no
 * gradient), then each projection's bias and LoRA gradients and dx += its
 * LoRA path. */
static void fused_backward(const step_ctx *c, int l, int g, const tensor_t *dys, tensor_t x,
                           tensor_t dx, tensor_t join)
{
    model_t *m = c->m;
    int first, count, N = fused_width(m, g), in = (int)m->mc.hidden;
    model_fuse_group(g, &first, &count);
    int strided = fused_strided(m, l, g);
    for (int i = 0, col = 0; i < count && !strided; i++) {
        int out = proj_of(m, l, first + i).out;
        be_copy2d(m->be, from_col(join, col), dys[i], c->rows, out, N, out);
        col += out;
    }
    int batched = model_lora_batched(c, l, g);
    float beta = 0.0f; /* the LoRA paths write dx first (linear_backward) */
    for (int i = 0; i < count; i++) {
        layer_params *L = &m->layers[l];
        int p = first + i, out = proj_of(m, l, p).out;
        if (L->b[p] && L->b[p]->trainable)
            be_bias_backward(m->be, L->b[p]->grad, dys[i], c->rows, out);
        if (L->lora_a[p] && !batched) {
            model_lora_backward(c, l, p, dys[i], strided ? N : out, x, dx, beta);
            beta = 1.0f;
        }
    }
    if (batched) {
        model_lora_group_backward(c, l, g, dys, strided ? N : 0, x, dx, 0.0f);
        beta = 1.0f;
    }
    if (dx.p)
        be_matmul(m->be, dx, join, fused_weight(c, l, g), c->rows, in, N, 0, 0, 1.0f, beta);
}

/* The batch's packed-document positions and segment starts on the device
 * (uploaded by forward; the starts followed by the documents' table when
 * one was staged: backend.h, attention), or absent tensors for one stream
 * per row. */
static tensor_t batch_pos(const step_ctx *c)
{
    return c->b->pos ? rows_of(MODEL_SCRATCH(c->m)->pos, c->rows, 1) : no_tensor();
}

static tensor_t batch_seg(const step_ctx *c)
{
    model_scratch *s = MODEL_SCRATCH(c->m);
    if (!c->b->seg)
        return no_tensor();
    return tensor_view(s->seg, 0, (size_t)c->rows + (s->doc_cap ? (size_t)s->doc_cap + 1 : 0));
}

/* Layer l's q, k and v for attention, and their row strides. */
typedef struct qkv_views {
    tensor_t q, k, v;
    int q_ld, kv_ld;
} qkv_views;

/* Strided (fused_strided): the column blocks of the fused product's
 * output [rows, qd + 2 kvd] in acts.qkv; else acts.q, k, v, contiguous. */
static qkv_views qkv_of(const step_ctx *c, int l)
{
    model_t *m = c->m;
    layer_acts *a = &m->acts[l];
    int qd = (int)(m->mc.heads * m->mc.head_dim), kvd = (int)(m->mc.kv_heads * m->mc.head_dim);
    qkv_views r = {a->q, a->k, a->v, qd, kvd};
    if (fused_strided(m, l, FUSE_QKV)) {
        int N = qd + 2 * kvd;
        tensor_t cat = rows_of(a->qkv, c->rows, N);
        r.q = cat, r.k = from_col(cat, qd), r.v = from_col(cat, qd + kvd);
        r.q_ld = r.kv_ld = N;
    }
    return r;
}

static void attention(const step_ctx *c, int l)
{
    const model_config_t *mc = &c->m->mc;
    layer_acts *a = &c->m->acts[l];
    qkv_views x = qkv_of(c, l);
    be_attention_forward_ld(c->m->be, a->att, a->lse, x.q, x.k, x.v, batch_seg(c), c->b->B,
                            c->b->T, (int)mc->heads, (int)mc->kv_heads, (int)mc->head_dim, x.q_ld,
                            x.kv_ld);
}

/* RoPE of the query and key heads qs, ks into q, k (inverse: of their
 * gradients), each with its row stride; qs, ks may be q, k (in place). */
static void rope_qk_ld(const step_ctx *c, tensor_t q, int q_ld, tensor_t qs, int qs_ld, tensor_t k,
                       int k_ld, tensor_t ks, int ks_ld, int inverse)
{
    model_t *m = c->m;
    const model_config_t *mc = &m->mc;
    model_scratch *s = MODEL_SCRATCH(m);
    tensor_t pos = batch_pos(c);
    int B = c->b->B, T = c->b->T, hd = (int)mc->head_dim;
    be_rope_ld(m->be, q, qs, s->rope_cos, s->rope_sin, pos, B, T, (int)mc->heads, hd, inverse,
               q_ld, qs_ld);
    be_rope_ld(m->be, k, ks, s->rope_cos, s->rope_sin, pos, B, T, (int)mc->kv_heads, hd, inverse,
               k_ld, ks_ld);
}

/* RoPE on the query and key heads in place (inverse: their gradients). */
static void rope_qk(const step_ctx *c, tensor_t q, tensor_t k, int inverse)
{
    int qd = (int)(c->m->mc.heads * c->m->mc.head_dim);
    int kvd = (int)(c->m->mc.kv_heads * c->m->mc.head_dim);
    rope_qk_ld(c, q, qd, q, qd, k, kvd, k, kvd, inverse);
}

/* RoPE on the q and k blocks of a strided [rows, qd + 2 kvd] matrix, in
 * place: the product's output (forward) or the gradients of the rotated
 * q and k (inverse). The k heads follow the q heads in every row, and
 * each head turns by its token's position alone, so one call over the
 * heads + kv_heads heads of a row does both. */
static void rope_qk_strided(const step_ctx *c, tensor_t cat, int inverse)
{
    model_t *m = c->m;
    const model_config_t *mc = &m->mc;
    model_scratch *s = MODEL_SCRATCH(m);
    int hd = (int)mc->head_dim, heads = (int)(mc->heads + mc->kv_heads);
    int N = (int)(mc->heads + 2 * mc->kv_heads) * hd;
    be_rope_ld(m->be, cat, cat, s->rope_cos, s->rope_sin, batch_pos(c), c->b->B, c->b->T, heads,
               hd, inverse, N, N);
}

/* One decoder layer; out receives the next residual stream (out.p == NULL
 * when recomputing: everything the backward needs, without the last
 * projection's output). */
static void layer_forward(const step_ctx *c, int l, tensor_t out)
{
    model_t *m = c->m;
    const model_config_t *mc = &m->mc;
    layer_params *L = &m->layers[l];
    layer_acts *a = &m->acts[l];
    int H = (int)mc->hidden;
    be_rmsnorm_forward(m->be, a->h1, a->rstd1, a->x, L->attn_norm->w, c->rows, H,
                       (float)mc->rms_eps);
    if (m->fused) {
        tensor_t ys[3] = {a->q, a->k, a->v};
        fused_forward(c, l, FUSE_QKV, ys, a->h1);
    } else {
        linear_forward(c, l, PROJ_Q, a->q, a->h1, no_tensor());
        linear_forward(c, l, PROJ_K, a->k, a->h1, no_tensor());
        linear_forward(c, l, PROJ_V, a->v, a->h1, no_tensor());
    }
    if (fused_strided(m, l, FUSE_QKV))
        rope_qk_strided(c, qkv_of(c, l).q, 0);
    else
        rope_qk(c, a->q, a->k, 0);
    attention(c, l);
    linear_forward(c, l, PROJ_O, a->x_mid, a->att, a->x); /* x_mid = x + o(att) */
    be_rmsnorm_forward(m->be, a->h2, a->rstd2, a->x_mid, L->mlp_norm->w, c->rows, H,
                       (float)mc->rms_eps);
    tensor_t g, u;
    int ld = gate_up(c, l, &g, &u);
    if (m->fused) {
        tensor_t ys[2] = {g, u};
        fused_forward(c, l, FUSE_GATE_UP, ys, a->h2);
    } else {
        linear_forward(c, l, PROJ_GATE, g, a->h2, no_tensor());
        linear_forward(c, l, PROJ_UP, u, a->h2, no_tensor());
    }
    be_swiglu_forward(m->be, a->a, g, u, c->rows, (int)mc->intermediate, ld);
    if (!out.p) {
        if (L->lora_a[PROJ_DOWN])
            model_lora_down(c, l, PROJ_DOWN, a->a, mc->intermediate);
        if (L->lora_m[PROJ_DOWN])
            model_dora_norm(m, l, PROJ_DOWN, model_weight(m, L->w[PROJ_DOWN]),
                            a->wnorm[PROJ_DOWN]);
        return;
    }
    linear_forward(c, l, PROJ_DOWN, out, a->a, a->x_mid); /* out = x_mid + down(a) */
}

/* s->dres holds d(layer output) on entry and d(layer input) on return,
 * except for layer 0 when neither the embedding nor its first norm trains
 * (LoRA): nothing wants d(input) there, so the q/k/v products' dx and the
 * norm's backward are not made (7B: one [rows, 4096] x [4096, 12288]
 * product and a pass), and s->dres is left holding d(x_mid). */
void model_graph_layer_backward(const step_ctx *c, int l)
{
    model_t *m = c->m;
    const model_config_t *mc = &m->mc;
    layer_params *L = &m->layers[l];
    layer_acts *a = &m->acts[l];
    model_scratch *s = MODEL_SCRATCH(m);
    int B = c->b->B, T = c->b->T, H = (int)mc->hidden;
    size_t rows = (size_t)c->rows, I = (size_t)mc->intermediate;
    size_t qd = (size_t)(mc->heads * mc->head_dim), kvd = (size_t)(mc->kv_heads * mc->head_dim);

    if (m->o.recompute == RECOMPUTE_LAYER)
        layer_forward(c, l, no_tensor());
    /* MLP: out = x_mid + down(silu(gate(h2)) * up(h2)), h2 = norm(x_mid) */
    tensor_t g, u, dg, du, da;
    int ld = gate_up(c, l, &g, &u);
    if (fused_strided(m, l, FUSE_GATE_UP)) { /* s->bwd holds da alone */
        dg = g, du = u; /* over the activations, as the fused backward reads them */
        da = tensor_view(s->bwd, 0, rows * I);
    } else {
        dg = tensor_view(s->bwd, 0, rows * I), du = tensor_view(s->bwd, rows * I, rows * I);
        da = tensor_view(s->bwd, 2 * rows * I, rows * I);
    }
    linear_backward(c, l, PROJ_DOWN, s->dres, a->a, da, 0);
    be_swiglu_backward(m->be, dg, du, da, g, u, c->rows, (int)I, ld);
    if (m->fused) {
        tensor_t dys[2] = {dg, du};
        fused_backward(c, l, FUSE_GATE_UP, dys, a->h2, s->dh, a->gu);
    } else {
        linear_backward(c, l, PROJ_GATE, dg, a->h2, s->dh, 0);
        linear_backward(c, l, PROJ_UP, du, a->h2, s->dh, 1);
    }
    be_rmsnorm_backward(m->be, s->dres, L->mlp_norm->trainable ? L->mlp_norm->grad : no_tensor(),
                        s->dh, a->x_mid, L->mlp_norm->w, a->rstd2, c->rows, H);
    /* attention: x_mid = x + o(attn(rope(q(h1)), rope(k(h1)), v(h1))), h1 = norm(x) */
    if (m->o.recompute == RECOMPUTE_ATTENTION)
        attention(c, l);
    int dx_wanted = l > 0 || m->embed->trainable || L->attn_norm->trainable;
    tensor_t dh = dx_wanted ? s->dh : no_tensor();
    /* s->bwd: d(att), then dq, dk, dv; strided, as the column blocks of
     * one [rows, qd + 2 kvd] matrix (the fused backward's join) */
    int strided = fused_strided(m, l, FUSE_QKV), N = (int)(qd + 2 * kvd);
    tensor_t datt = tensor_view(s->bwd, 0, rows * qd);
    tensor_t join = tensor_view(s->bwd, rows * qd, rows * (size_t)N);
    tensor_t dq = strided ? join : tensor_view(join, 0, rows * qd);
    tensor_t dk = strided ? from_col(join, (int)qd) : tensor_view(join, rows * qd, rows * kvd);
    tensor_t dv = strided ? from_col(join, (int)(qd + kvd))
                          : tensor_view(join, rows * (qd + kvd), rows * kvd);
    linear_backward(c, l, PROJ_O, s->dres, a->att, datt, 0);
    qkv_views x = qkv_of(c, l);
    be_attention_backward_ld(m->be, dq, dk, dv, datt, a->att, a->lse, x.q, x.k, x.v,
                             batch_seg(c), B, T, (int)mc->heads, (int)mc->kv_heads,
                             (int)mc->head_dim, x.q_ld, x.kv_ld, strided ? N : (int)qd,
                             strided ? N : (int)kvd);
    if (strided) {
        rope_qk_strided(c, join, 1);
        tensor_t dys[3] = {dq, dk, dv};
        fused_backward(c, l, FUSE_QKV, dys, a->h1, dh, join);
    } else if (m->fused) {
        rope_qk(c, dq, dk, 1);
        tensor_t dys[3] = {dq, dk, dv};
        fused_backward(c, l, FUSE_QKV, dys, a->h1, dh, a->qkv);
    } else {
        rope_qk(c, dq, dk, 1);
        linear_backward(c, l, PROJ_Q, dq, a->h1, dh, 0);
        linear_backward(c, l, PROJ_K, dk, a->h1, dh, 1);
        linear_backward(c, l, PROJ_V, dv, a->h1, dh, 1);
    }
    if (dx_wanted)
        be_rmsnorm_backward(m->be, s->dres,
                            L->attn_norm->trainable ? L->attn_norm->grad : no_tensor(), s->dh,
                            a->x, L->attn_norm->w, a->rstd1, c->rows, H);
}

/* Final norm, LM head and loss, a chunk of rows at a time so the logits of
 * the whole batch never exist at once; with backward, the head's gradients
 * (the loss gradient scaled by s->gscale) and s->dres = d(final residual).
 * The token losses are left in s->loss (model_step.c reads them). */
void model_graph_head(const step_ctx *c, int backward)
{
    model_t *m = c->m;
    model_scratch *s = MODEL_SCRATCH(m);
    int H = (int)m->mc.hidden, V = (int)m->mc.vocab, rows = c->rows;
    param_t *W = m->lm_head;
    be_rmsnorm_forward(m->be, s->hf, s->rstd_f, s->x_final, m->final_norm->w, rows, H,
                       (float)m->mc.rms_eps);
    for (int r0 = 0; r0 < rows; r0 += (int)s->chunk_rows) {
        int cr = rows - r0 < (int)s->chunk_rows ? rows - r0 : (int)s->chunk_rows;
        tensor_t logits = tensor_view(s->logits, 0, (size_t)cr * (size_t)V);
        tensor_t hf = tensor_view(s->hf, (size_t)r0 * H, (size_t)cr * H);
        be_matmul(m->be, logits, hf, W->w, cr, V, H, 0, 1, 1.0f, 0.0f);
        be_cross_entropy(m->be, logits, tensor_view(s->loss, (size_t)r0, (size_t)cr),
                         tensor_view(s->targets, (size_t)r0, (size_t)cr), cr, V,
                         backward ? 1.0f : 0.0f, backward ? s->gscale : no_tensor());
        if (!backward)
            continue;
        be_matmul(m->be, tensor_view(s->dh, (size_t)r0 * H, (size_t)cr * H), logits, W->w, cr, H,
                  V, 0, 0, 1.0f, 0.0f);
        if (W->trainable)
            be_matmul(m->be, W->grad, logits, hf, V, H, cr, 1, 0, 1.0f, 1.0f);
    }
    if (backward) {
        be_zero(m->be, rows_of(s->dres, rows, H));
        be_rmsnorm_backward(m->be, s->dres,
                            m->final_norm->trainable ? m->final_norm->grad : no_tensor(), s->dh,
                            s->x_final, m->final_norm->w, s->rstd_f, rows, H);
    }
}

/* The embedding and every layer: the final residual in s->x_final. */
void model_graph_forward(const step_ctx *c)
{
    model_t *m = c->m;
    model_scratch *s = MODEL_SCRATCH(m);
    model_nf4_forget(m); /* the pass dequantizes what it uses: it may be captured */
    be_embedding_forward(m->be, m->acts[0].x, m->embed->w, s->tokens, c->rows, (int)m->mc.hidden);
    int L = (int)m->mc.layers;
    for (int l = 0; l < L; l++)
        layer_forward(c, l, l + 1 < L ? m->acts[l + 1].x : s->x_final);
}
