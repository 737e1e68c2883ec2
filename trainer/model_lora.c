/* The LoRA and DoRA branches of a projection, forward and backward: one
 * branch at a time, or a fused group's branches batched (the stacked A
 * matrices and the B matrices as views of the arenas, model_lora_run);
 * LoRA dropout's masks. What model_graph.c's projections call
 * (model_internal.h). */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>

#include "model.h"
#include "model_internal.h"

/* The input of a LoRA branch: x itself, or x with dropout whose mask is a
 * function of (seed, window, layer, projection) only, so a resumed run, a
 * recomputed layer, or another rank count draws the same mask. The window's
 * seed is in device memory (s->seeds, stage), its layer and projection in
 * the offset. */
static tensor_t lora_input(const step_ctx *c, int l, int p, tensor_t x, int64_t in)
{
    model_t *m = c->m;
    if (m->o.lora_dropout <= 0 || !c->training)
        return x;
    model_scratch *s = MODEL_SCRATCH(m);
    size_t win = (size_t)c->b->T * (size_t)in;
    uint64_t offset = ((uint64_t)l * PROJ_COUNT + (uint64_t)p) << 40;
    for (int w = 0; w < c->b->B; w++)
        be_dropout(m->be, tensor_view(s->drop, w * win, win), tensor_view(x, w * win, win), win,
                   (float)m->o.lora_dropout, 0, tensor_view(s->seeds, 2 * (size_t)w, 2), offset);
    return rows_of(s->drop, c->rows, in);
}

/* xr = drop(x) A^T: the LoRA branch's rank-r activation. */
tensor_t model_lora_down(const step_ctx *c, int l, int p, tensor_t x, int64_t in)
{
    model_t *m = c->m;
    be_prof_lora(m->be, 1);
    tensor_t xin = lora_input(c, l, p, x, in), xr = m->acts[l].xr[p];
    be_matmul(m->be, xr, xin, m->layers[l].lora_a[p]->w, c->rows, (int)m->o.lora_r, (int)in, 0,
              1, 1.0f, 0.0f);
    be_prof_lora(m->be, 0);
    return xr;
}

/* z = x W^T + scale * (x A^T) B^T into z (DoRA's unscaled output; the LoRA
 * branch's activation xr from the forward); w is W's compute copy
 * (model_weight: an NF4 weight dequantized). */
void model_dora_unscaled(const step_ctx *c, int l, int p, tensor_t w, tensor_t z, tensor_t x)
{
    model_t *m = c->m;
    proj_view j = proj_of(m, l, p);
    be_matmul(m->be, z, x, w, c->rows, j.out, j.in, 0, 1, 1.0f, 0.0f);
    be_matmul(m->be, z, m->acts[l].xr[p], j.L->lora_b[p]->w, c->rows, j.out, (int)m->o.lora_r, 0,
              1, m->lora_scale, 1.0f);
}

/* Whether LoRA dropout draws masks in this pass (training with
 * lora.dropout > 0). */
int model_lora_dropping(const step_ctx *c)
{
    return c->m->o.lora_dropout > 0 && c->training;
}

/* DoRA (PEFT's use_dora): y (+)= m / n * (x W^T + scale * (x A^T) B^T) + b,
 * n = ||W + scale B A||_row computed here from the current A and B and kept
 * for the backward, which treats it as a constant. With dropout (training),
 * as PEFT: the base product sees x, the DoRA term the dropped x_d:
 * y (+)= x W^T + b + m / n * z_d - x_d W^T, z_d = x_d W^T + scale * (x_d A^T) B^T. */
void model_dora_forward(const step_ctx *c, int l, int p, tensor_t y, tensor_t x, int accumulate)
{
    model_t *m = c->m;
    proj_view j = proj_of(m, l, p);
    be_prof_lora(m->be, 1); /* a DoRA projection counts whole as LoRA's */
    tensor_t n = m->acts[l].wnorm[p], w = model_weight(m, j.L->w[p]);
    model_dora_norm(m, l, p, w, n);
    model_lora_down(c, l, p, x, j.in);
    if (model_lora_dropping(c)) {
        tensor_t z = rows_of(MODEL_SCRATCH(m)->dora, c->rows, j.out);
        tensor_t xd = lora_input(c, l, p, x, j.in);
        model_dora_unscaled(c, l, p, w, z, xd);
        be_col_scale(m->be, z, j.L->lora_m[p]->w, n, c->rows, j.out);
        be_matmul(m->be, z, xd, w, c->rows, j.out, j.in, 0, 1, -1.0f, 1.0f);
        be_matmul(m->be, y, x, w, c->rows, j.out, j.in, 0, 1, 1.0f, accumulate ? 1.0f : 0.0f);
        be_add(m->be, y, z, 1.0f, z.n);
    } else {
        tensor_t z = accumulate ? rows_of(MODEL_SCRATCH(m)->dora, c->rows, j.out) : y;
        model_dora_unscaled(c, l, p, w, z, x);
        be_col_scale(m->be, z, j.L->lora_m[p]->w, n, c->rows, j.out);
        if (accumulate)
            be_add(m->be, y, z, 1.0f, z.n);
    }
    if (j.L->b[p])
        be_add_bias(m->be, y, j.L->b[p]->w, c->rows, j.out);
    be_prof_lora(m->be, 0);
}

/* The tensors w (grad 0) or grad (grad 1) of the LoRA A (b_matrix 0) or B
 * (1) matrices of projections first .. first + count - 1 of layer l as one
 * view, when they follow one another in memory (the arenas' order puts a
 * fused group's so: model_alloc.c arena_slot); else no tensor. */
tensor_t model_lora_run(const model_t *m, int l, int first, int count, int b_matrix, int grad)
{
    const layer_params *L = &m->layers[l];
    param_t *const *ps = b_matrix ? L->lora_b : L->lora_a;
    if (!ps[first])
        return no_tensor();
    tensor_t t = grad ? ps[first]->grad : ps[first]->w;
    if (!t.p)
        return no_tensor();
    size_t esz = dtype_size(t.dt), n = t.n;
    for (int i = 1; i < count; i++) {
        const param_t *q = ps[first + i];
        tensor_t u = q ? (grad ? q->grad : q->w) : no_tensor();
        if (!u.p || u.dt != t.dt || (char *)u.p != (char *)t.p + n * esz)
            return no_tensor();
        n += u.n;
    }
    t.n = n;
    return t;
}

/* Batched LoRA: the down products of a fused group's projections, which
 * read one input, are one product x [A_1; ...; A_count]^T into the
 * group's xr block [rows, count r] (projection i's xr its columns i r ..);
 * the backward makes the A gradients and dx one product each. The stacked
 * A matrices and their gradients are views of the arenas (lora_run), so
 * nothing is copied or added. Taken when every projection of the group
 * carries LoRA (not DoRA), their A matrices and gradients follow one
 * another, and no dropout draws a mask per projection (each would see
 * another input); else, and with SPOTUNE_LORA_BATCHED=0
 * (model_opts.no_lora_batch), one by one. */
int model_lora_batched(const step_ctx *c, int l, int g)
{
    const model_t *m = c->m;
    if (!m->fused || m->o.no_lora_batch || model_lora_dropping(c) || !m->acts[l].xr_cat[g].p)
        return 0;
    int first, count;
    model_fuse_group(g, &first, &count);
    for (int p = first; p < first + count; p++)
        if (!m->layers[l].lora_a[p] || m->layers[l].lora_m[p])
            return 0;
    return model_lora_run(m, l, first, count, 0, 0).p && model_lora_run(m, l, first, count, 0, 1).p;
}

/* The end j of the run of projections i .. j - 1 of a fused group
 * (projections first .. first + count - 1) that have projection first + i's
 * width. With the group's outputs (or their gradients) the column blocks of
 * one strided matrix (fused_strided) and the run's B matrices one after
 * another (model_lora_run), the B products of a run of two or more are one
 * strided batched product each way (be_matmul_batched): q, k, v of a model
 * without GQA, k, v of one with it, and gate, up. */
int model_lora_width_run(const model_t *m, int l, int first, int count, int i)
{
    int out = proj_of(m, l, first + i).out, j = i + 1;
    while (j < count && proj_of(m, l, first + j).out == out)
        j++;
    return j;
}

/* Whether ts[0 .. count - 1] are the column blocks, width out each, of one
 * matrix with row stride ld, one after another. */
static int blocks_of_one(const tensor_t *ts, int count, int out, int ld)
{
    size_t esz = dtype_size(ts[0].dt);
    for (int i = 1; i < count; i++)
        if (ts[i].dt != ts[0].dt ||
            (char *)ts[i].p != (char *)ts[0].p + (size_t)i * (size_t)out * esz)
            return 0;
    return ld > 0;
}

/* The batched backward of group g's LoRA branches given the outputs'
 * gradients dys (row stride dy_ld; 0: each its projection's width): each
 * B gradient and d(xr) (into the columns of one [rows, count r] matrix;
 * one strided batched product each for a run of one width:
 * model_lora_width_run), then one product for the stacked A gradients and
 * one for dx = d(xr) [A_1; ...] + dx_beta dx (none when dx.p is NULL). */
void model_lora_group_backward(const step_ctx *c, int l, int g, const tensor_t *dys, int dy_ld,
                                tensor_t x, tensor_t dx, float dx_beta)
{
    model_t *m = c->m;
    model_scratch *s = MODEL_SCRATCH(m);
    int first, count, r = (int)m->o.lora_r, in = (int)m->mc.hidden;
    model_fuse_group(g, &first, &count);
    int R = count * r;
    be_prof_lora(m->be, 1);
    s->lora_batched_bwd++;
    tensor_t xr = rows_of(m->acts[l].xr_cat[g], c->rows, R), dxr = rows_of(s->dxr, c->rows, R);
    for (int i = 0, j; i < count; i = j) {
        int p0 = first + i, out = proj_of(m, l, p0).out, n;
        j = model_lora_width_run(m, l, first, count, i);
        n = j - i;
        tensor_t bw = model_lora_run(m, l, p0, n, 1, 0), bg = model_lora_run(m, l, p0, n, 1, 1);
        if (n > 1 && bw.p && bg.p && blocks_of_one(dys + i, n, out, dy_ld)) {
            /* dB_k += s dy_k^T xr_k; d(xr)_k = s dy_k B_k, k in the run */
            size_t on = (size_t)out * (size_t)r;
            s->lora_uniform_bwd += n;
            be_matmul_batched(m->be, bg, dys[i], from_col(xr, i * r), out, r, c->rows, 1, 0,
                              m->lora_scale, 1.0f, dy_ld, R, r, n, (size_t)out, (size_t)r, on);
            be_matmul_batched(m->be, from_col(dxr, i * r), dys[i], bw, c->rows, r, out, 0, 0,
                              m->lora_scale, 0.0f, dy_ld, r, R, n, (size_t)out, on, (size_t)r);
            continue;
        }
        for (int k = i; k < j; k++) {
            param_t *B = m->layers[l].lora_b[first + k];
            int ld = dy_ld ? dy_ld : out;
            be_matmul_ld(m->be, B->grad, dys[k], from_col(xr, k * r), out, r, c->rows, 1, 0,
                         m->lora_scale, 1.0f, ld, R, r);
            be_matmul_ld(m->be, from_col(dxr, k * r), dys[k], B->w, c->rows, r, out, 0, 0,
                         m->lora_scale, 0.0f, ld, r, R);
        }
    }
    /* the stacked A gradients accumulate in place; dx reads the stacked A */
    be_matmul(m->be, model_lora_run(m, l, first, count, 0, 1), dxr, x, R, in, c->rows, 1, 0, 1.0f,
              1.0f);
    if (dx.p)
        be_matmul(m->be, dx, dxr, model_lora_run(m, l, first, count, 0, 0), c->rows, in, R, 0, 0,
                  1.0f, dx_beta);
    be_prof_lora(m->be, 0);
}

/* The LoRA path's gradients given dy (row stride dy_ld): those of A and B,
 * and dx = the gradient through drop(x) A^T B^T + dx_beta dx (dx_beta 0 or
 * 1; no dx when dx.p is NULL). */
void model_lora_backward(const step_ctx *c, int l, int p, tensor_t dy, int dy_ld, tensor_t x,
                          tensor_t dx, float dx_beta)
{
    model_t *m = c->m;
    be_prof_lora(m->be, 1);
    proj_view j = proj_of(m, l, p);
    model_scratch *s = MODEL_SCRATCH(m);
    param_t *A = j.L->lora_a[p], *B = j.L->lora_b[p];
    int r = (int)m->o.lora_r;
    tensor_t xr = m->acts[l].xr[p];
    be_matmul_ld(m->be, B->grad, dy, xr, j.out, r, c->rows, 1, 0, m->lora_scale, 1.0f, dy_ld, r,
                 r);
    be_matmul_ld(m->be, s->dxr, dy, B->w, c->rows, r, j.out, 0, 0, m->lora_scale, 0.0f, dy_ld, r,
                 r);
    tensor_t xin = lora_input(c, l, p, x, j.in);
    be_matmul(m->be, A->grad, s->dxr, xin, r, j.in, c->rows, 1, 0, 1.0f, 1.0f);
    if (!dx.p) {
        /* nothing upstream wants the input's gradient */
    } else if (m->o.lora_dropout > 0) {
        tensor_t d = rows_of(s->drop, c->rows, j.in);
        be_matmul(m->be, d, s->dxr, A->w, c->rows, j.in, r, 0, 0, 1.0f, 0.0f);
        lora_input(c, l, p, d, j.in); /* the same mask applied to the gradient */
        if (dx_beta != 0.0f)
            be_add(m->be, dx, d, 1.0f, d.n);
        else
            be_copy(m->be, rows_of(dx, c->rows, j.in), d);
    } else {
        be_matmul(m->be, dx, s->dxr, A->w, c->rows, j.in, r, 0, 0, 1.0f, dx_beta);
    }
    be_prof_lora(m->be, 0);
}

/* The backward of dora_forward with dropout given dy: dm += sum_rows dy *
 * z_d / n; with g = dy * m / n, dx (+)= dy W + drop((g - dy) W) and the LoRA
 * path sees g (W is frozen: DoRA is LoRA mode only). */
void model_dora_dropout_backward(const step_ctx *c, int l, int p, tensor_t dy, tensor_t x,
                                  tensor_t dx, int accumulate)
{
    model_t *m = c->m;
    proj_view j = proj_of(m, l, p);
    model_scratch *s = MODEL_SCRATCH(m);
    tensor_t g = rows_of(s->dora, c->rows, j.out), n = m->acts[l].wnorm[p];
    tensor_t w = model_weight(m, j.L->w[p]);
    be_prof_lora(m->be, 1);
    model_dora_unscaled(c, l, p, w, g, lora_input(c, l, p, x, j.in));
    be_col_dot(m->be, j.L->lora_m[p]->grad, dy, g, n, c->rows, j.out);
    be_copy(m->be, g, rows_of(dy, c->rows, j.out));
    be_col_scale(m->be, g, j.L->lora_m[p]->w, n, c->rows, j.out);
    if (dx.p) {
        be_matmul(m->be, dx, dy, w, c->rows, j.in, j.out, 0, 0, 1.0f, accumulate ? 1.0f : 0.0f);
        tensor_t d = rows_of(s->drop, c->rows, j.in); /* x_d is not needed any more */
        be_matmul(m->be, d, g, w, c->rows, j.in, j.out, 0, 0, 1.0f, 0.0f);
        be_matmul(m->be, d, dy, w, c->rows, j.in, j.out, 0, 0, -1.0f, 1.0f);
        lora_input(c, l, p, d, j.in); /* the forward's mask */
        be_add(m->be, dx, d, 1.0f, d.n);
    }
    model_lora_backward(c, l, p, g, j.out, x, dx, 1.0f);
    be_prof_lora(m->be, 0);
}
