/* The memory of the model: where each trainable parameter lives in the
 * flat arenas (in the order the backward finishes gradients), the optimizer
 * and gradient shards, the bucket buffers, the fused weights, the
 * activations, and the plan of all of it (model_plan_bytes). */
#define _POSIX_C_SOURCE 200809L
#include "model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/nf4.h"
#include "model_internal.h"

/* Rank of a parameter in the order the backward finishes its gradient:
 * lm_head, final norm, layers from last to first, the embedding last. */
static long backward_rank(const model_t *m, const param_t *p)
{
    long L = (long)m->mc.layers;
    if (p == m->embed)
        return 4 * (L + 2);
    if (p->kind == PK_LM_HEAD)
        return 0;
    if (p == m->final_norm)
        return 1;
    return 4 + 4 * (L - 1 - p->layer) + (p->decay ? 0 : 1);
}

typedef struct ranked {
    long rank;
    int slot, sub, index;
} ranked;

static int cmp_ranked(const void *a, const void *b)
{
    const ranked *x = a, *y = b;
    if (x->rank != y->rank)
        return x->rank < y->rank ? -1 : 1;
    if (x->slot != y->slot)
        return x->slot - y->slot;
    return x->sub - y->sub;
}

/* Where p goes among the parameters of its rank: at its place in the
 * table, except that the LoRA A matrices of a fused group's projections
 * (q, k, v; gate, up) follow one another, and so do their B matrices, in
 * projection order: the group's stacked [A_1; ...; A_count] and its
 * gradient are then views of the arenas (model_lora_run), which batched
 * LoRA reads and writes without copies. */
static void arena_slot(const model_t *m, const param_t *p, int *slot, int *sub)
{
    *slot = (int)(p - m->params);
    *sub = 0;
    if ((p->kind != PK_LORA_A && p->kind != PK_LORA_B) || p->layer < 0)
        return;
    for (int g = 0; g < FUSE_COUNT; g++) {
        int first, count;
        model_fuse_group(g, &first, &count);
        if (p->proj < first || p->proj >= first + count)
            continue;
        const layer_params *L = &m->layers[p->layer];
        const param_t *head = p->kind == PK_LORA_A ? L->lora_a[first] : L->lora_b[first];
        if (head) {
            *slot = (int)(head - m->params);
            *sub = p->proj - first;
        }
    }
}

/* Assigns arena offsets and the AdamW runs (adjacent params sharing a decay
 * flag are updated by one call). */
int model_layout_arenas(model_t *m, sp_err *err)
{
    ranked *order = calloc((size_t)m->nparams, sizeof *order);
    m->runs = calloc((size_t)m->nparams + 1, sizeof *m->runs);
    if (!order || !m->runs) {
        free(order);
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    }
    int n = 0;
    for (int i = 0; i < m->nparams; i++)
        if (m->params[i].trainable) {
            ranked *o = &order[n++];
            o->rank = backward_rank(m, &m->params[i]);
            o->index = i;
            arena_slot(m, &m->params[i], &o->slot, &o->sub);
        }
    qsort(order, (size_t)n, sizeof *order, cmp_ranked);
    size_t off = 0;
    long L = (long)m->mc.layers;
    m->ready_upto = calloc((size_t)L + 1, sizeof *m->ready_upto);
    if (!m->ready_upto) {
        free(order);
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    }
    m->nruns = 0;
    for (int i = 0; i < n; i++) {
        param_t *p = &m->params[order[i].index];
        /* ready after the head (ranks 0, 1) or after layer l (rank 4 + 4(L-1-l) + 0..1) */
        for (long l = 0; l <= L; l++) {
            long limit = l == 0 ? 1 : 4 + 4 * (L - l) + 1;
            if (order[i].rank <= limit)
                m->ready_upto[l] = off + p->n;
        }
        p->offset = off;
        adamw_run *last = m->nruns ? &m->runs[m->nruns - 1] : NULL;
        if (last && last->decay == p->decay)
            last->n += p->n;
        else
            m->runs[m->nruns++] = (adamw_run){off, p->n, p->decay};
        off += p->n;
    }
    m->n_trainable = off;
    free(order);
    return 0;
}

/* Bytes of one layer's activations as alloc_layer_set allocates them
 * (which: 0 = everything but x, 1 = att + lse only): the activation-dtype
 * buffers at a bytes each, the F32 ones (RMSNorm statistics, the softmax
 * log-sum-exps, DoRA's norms) at 4. */
static size_t act_bytes_per_layer(const model_config_t *mc, const model_opts *o, size_t a,
                                  int which)
{
    size_t BT = (size_t)(o->max_batch * o->seq_len), H = (size_t)mc->hidden;
    size_t qd = (size_t)(mc->heads * mc->head_dim), kvd = (size_t)(mc->kv_heads * mc->head_dim);
    size_t I = (size_t)mc->intermediate;
    size_t lse = (size_t)o->max_batch * (size_t)mc->heads * (size_t)o->seq_len;
    size_t att = BT * qd * a + lse * 4;
    if (which == 1)
        return att;
    size_t lora = 0, dora = 0;
    if (o->mode == MODE_LORA)
        for (int p = 0; p < PROJ_COUNT; p++)
            if (o->lora_targets & (1 << p)) {
                int64_t in, out;
                model_config_proj_dims(mc, p, &in, &out);
                lora += BT * (size_t)o->lora_r;
                dora += o->dora ? (size_t)out : 0;
            }
    return 2 * BT * 4 + (3 * BT * H + BT * qd + 2 * BT * kvd + 3 * BT * I + lora) * a + att +
           dora * 4;
}

/* The widest input or output of a projection. */
static size_t max_in_features(const model_config_t *mc)
{
    size_t q = (size_t)(mc->heads * mc->head_dim), mx = (size_t)mc->hidden;
    if (q > mx)
        mx = q;
    if ((size_t)mc->intermediate > mx)
        mx = (size_t)mc->intermediate;
    return mx;
}

static int64_t logits_chunk_rows(const model_config_t *mc, const model_opts *o, dtype_t act_dt)
{
    int64_t BT = o->max_batch * o->seq_len;
    int64_t rows = (int64_t)((64u << 20) / ((size_t)mc->vocab * dtype_size(act_dt)));
    if (rows < 1)
        rows = 1;
    return rows < BT ? rows : BT;
}

/* Products are fused when the projection weights are frozen: LoRA,
 * without DoRA (a norm per projection). NF4 weights are dequantized a group
 * at a time into the workspace (nf4_work_elems). */
static int fuse_on_opts(const model_opts *o)
{
    const char *env = getenv("SPOTUNE_FUSED");
    if (o->no_fuse || (env && strcmp(env, "0") == 0))
        return 0;
    return o->mode == MODE_LORA && !o->dora;
}

/* Where projection p's dequantized weight lies in the NF4 workspace
 * (offset[p], in elements; model.c model_weight) and the workspace's
 * elements (the return value; 0 without NF4):
 *  - recompute layer: a slot per projection, one after another (q, k, v,
 *    o, gate, up, down), so a whole layer's weights stay dequantized
 *    between the layer's recomputed forward and its backward, which reads
 *    them again (7B: 404 MB; 13B: 634 MB, against 283 MB);
 *  - else the largest projection weight, or fused group (q, k, v; gate,
 *    up: a group's slots one after another from 0), every other slot at 0.
 * A fused group's slots follow one another in both: its product reads
 * them as one matrix (model_graph.c fused_weight). */
size_t model_nf4_slots(const model_config_t *mc, const model_opts *o, size_t offset[PROJ_COUNT])
{
    size_t work = 0, group[FUSE_COUNT] = {0, 0}, n[PROJ_COUNT], at = 0;
    int fused = fuse_on_opts(o), layer = o->recompute == RECOMPUTE_LAYER;
    for (int p = 0; p < PROJ_COUNT; p++) {
        int64_t in, out;
        model_config_proj_dims(mc, p, &in, &out);
        n[p] = (size_t)in * (size_t)out;
    }
    for (int p = 0; p < PROJ_COUNT; p++) {
        int g = p < PROJ_O ? FUSE_QKV : p == PROJ_GATE || p == PROJ_UP ? FUSE_GATE_UP : -1;
        if (layer) {
            offset[p] = at;
            at += n[p];
        } else {
            offset[p] = fused && g >= 0 ? group[g] : 0;
            if (g >= 0)
                group[g] += n[p];
        }
        work = n[p] > work ? n[p] : work;
    }
    for (int g = 0; g < FUSE_COUNT && fused; g++)
        work = group[g] > work ? group[g] : work;
    if (layer)
        work = at;
    return o->mode == MODE_LORA && o->nf4 ? work : 0;
}

static size_t nf4_work_elems(const model_config_t *mc, const model_opts *o)
{
    size_t offset[PROJ_COUNT];
    return model_nf4_slots(mc, o, offset);
}

/* Whether the fused gate/up product runs in place (model_graph.c
 * fused_in_place): fused, and neither gate nor up has a bias. */
static int gate_up_in_place(const model_config_t *mc, const model_opts *o)
{
    return fuse_on_opts(o) && !mc->bias[PROJ_GATE] && !mc->bias[PROJ_UP];
}

/* Elements of the scratch s->bwd for BT rows: the MLP's backward (dg, du
 * and da; da alone where gate/up runs in place, its gradients written over
 * the activations) or the attention's (dq, datt, dk, dv), the larger; in
 * the forward it holds a fused product's output (q/k/v; gate/up when not in
 * place), which fits either. */
static size_t bwd_elems(const model_config_t *mc, const model_opts *o, size_t BT)
{
    size_t I = (size_t)mc->intermediate;
    size_t qd = (size_t)(mc->heads * mc->head_dim), kvd = (size_t)(mc->kv_heads * mc->head_dim);
    size_t mlp = (gate_up_in_place(mc, o) ? 1 : 3) * BT * I, att = 2 * BT * (qd + kvd);
    return mlp > att ? mlp : att;
}

void model_plan_bytes(const model_config_t *mc, const model_opts *o, dtype_t act_dt,
                      model_plan *plan)
{
    size_t a = dtype_size(act_dt), BT = (size_t)(o->max_batch * o->seq_len);
    size_t H = (size_t)mc->hidden;
    size_t total = (size_t)model_config_params(mc), lora = 0;
    if (o->mode == MODE_LORA)
        for (int p = 0; p < PROJ_COUNT; p++)
            if (o->lora_targets & (1 << p)) {
                int64_t in, out;
                model_config_proj_dims(mc, p, &in, &out);
                lora += (size_t)mc->layers * (size_t)o->lora_r * (size_t)(in + out);
                if (o->dora) /* the magnitude (its norm: act_bytes_per_layer) */
                    lora += (size_t)mc->layers * (size_t)out;
            }
    size_t trainable = o->mode == MODE_FULL ? total : lora;
    plan->weights = (o->mode == MODE_FULL ? 0 : total) * a;
    size_t nf4_work = nf4_work_elems(mc, o);
    if (o->mode == MODE_LORA && o->nf4)
        for (int p = 0; p < PROJ_COUNT; p++) {
            int64_t in, out;
            model_config_proj_dims(mc, p, &in, &out);
            size_t n = (size_t)in * (size_t)out;
            plan->weights -= (size_t)mc->layers * n * a;
            plan->weights += (size_t)mc->layers * nf4_bytes(n);
        }
    if (o->shard_count > 1) {
        /* compute copy whole (padded); masters, moments, reduced grad per
         * shard; the gradient whole, or with sharded gradients the buckets */
        size_t shard = model_shard_len(trainable, o->shard_count);
        size_t padded = shard * (size_t)o->shard_count;
        size_t grads = model_shards_grads(o) ? model_grad_buckets_len(mc, o) : padded;
        plan->trainable = padded * a + shard * 16 + grads * 4;
    } else {
        plan->trainable = trainable * (16 + (act_dt == DT_F32 ? 0 : a));
    }
    size_t per = act_bytes_per_layer(mc, o, a, 0), L = (size_t)mc->layers;
    size_t att = act_bytes_per_layer(mc, o, a, 1);
    size_t acts = (L + 1) * BT * H * a; /* every layer's input, and the final one */
    if (o->recompute == RECOMPUTE_LAYER)
        acts += per;
    else if (o->recompute == RECOMPUTE_ATTENTION)
        acts += L * (per - att) + att;
    else
        acts += L * per;
    plan->activations = acts;
    size_t bwd = bwd_elems(mc, o, BT);
    size_t drop = o->mode == MODE_LORA && o->lora_dropout > 0 ? BT * max_in_features(mc) : 0;
    if (o->mode == MODE_LORA && o->dora)
        drop += BT * max_in_features(mc);
    size_t chunk = (size_t)logits_chunk_rows(mc, o, act_dt);
    size_t dxr = o->mode == MODE_LORA ? 3 * BT * (size_t)o->lora_r : 0;
    plan->scratch = (3 * BT * H + bwd + dxr + drop +
                     chunk * (size_t)mc->vocab + nf4_work) * a +
                    /* rstd_f, loss, tokens, targets, pos, seg; seeds; gscale */
                    BT * 4 * 6 + 2 * (size_t)o->max_batch * 4 + 4 +
                    (size_t)o->seq_len * (size_t)mc->head_dim * 4 +
                    (o->mode == MODE_FULL ? (2 * BT + 2) * 4 : 0) +
                    (nf4_work ? (16 + 256) * 4 : 0);
}

static tensor_t act_alloc(model_t *m, size_t n, dtype_t dt)
{
    tensor_t t = be_alloc(m->be, dt, n ? n : 1);
    m->bytes_acts += n * dtype_size(dt);
    return t;
}

/* Allocates one set of per-layer activations (everything but x); part 1:
 * only att and lse, part 2: everything but them, 0: all. */
static void alloc_layer_set(model_t *m, layer_acts *a, int part)
{
    const model_config_t *mc = &m->mc;
    dtype_t d = m->be->act_dt;
    size_t BT = (size_t)(m->o.max_batch * m->o.seq_len), H = (size_t)mc->hidden;
    size_t qd = (size_t)(mc->heads * mc->head_dim), kvd = (size_t)(mc->kv_heads * mc->head_dim);
    size_t I = (size_t)mc->intermediate;
    if (part != 2) {
        a->att = act_alloc(m, BT * qd, d);
        a->lse = act_alloc(m, (size_t)m->o.max_batch * (size_t)mc->heads * (size_t)m->o.seq_len,
                           DT_F32);
    }
    if (part == 1)
        return;
    a->rstd1 = act_alloc(m, BT, DT_F32);
    a->rstd2 = act_alloc(m, BT, DT_F32);
    a->h1 = act_alloc(m, BT * H, d);
    a->h2 = act_alloc(m, BT * H, d);
    a->x_mid = act_alloc(m, BT * H, d);
    a->qkv = act_alloc(m, BT * (qd + 2 * kvd), d);
    a->q = tensor_view(a->qkv, 0, BT * qd);
    a->k = tensor_view(a->qkv, BT * qd, BT * kvd);
    a->v = tensor_view(a->qkv, BT * (qd + kvd), BT * kvd);
    a->gu = act_alloc(m, 2 * BT * I, d);
    a->g = tensor_view(a->gu, 0, BT * I);
    a->u = tensor_view(a->gu, BT * I, BT * I);
    a->a = act_alloc(m, BT * I, d);
    size_t xr_n = BT * (size_t)m->o.lora_r;
    for (int g = 0; g < FUSE_COUNT; g++) { /* a group's xr in one block */
        int first, count, all = 1;
        model_fuse_group(g, &first, &count);
        for (int p = first; p < first + count; p++)
            all &= model_lora_on(m, p);
        if (!all)
            continue;
        a->xr_cat[g] = act_alloc(m, (size_t)count * xr_n, d);
        for (int i = 0; i < count; i++)
            a->xr[first + i] = tensor_view(a->xr_cat[g], (size_t)i * xr_n, xr_n);
    }
    for (int p = 0; p < PROJ_COUNT; p++)
        if (model_lora_on(m, p)) {
            if (!a->xr[p].p)
                a->xr[p] = act_alloc(m, xr_n, d);
            if (m->o.dora) {
                int64_t in, out;
                model_config_proj_dims(mc, p, &in, &out);
                a->wnorm[p] = act_alloc(m, (size_t)out, DT_F32);
            }
        }
}

void model_alloc_activations(model_t *m)
{
    const model_config_t *mc = &m->mc;
    dtype_t d = m->be->act_dt;
    size_t BT = (size_t)(m->o.max_batch * m->o.seq_len), H = (size_t)mc->hidden;
    int L = (int)mc->layers;
    layer_acts shared;
    memset(&shared, 0, sizeof shared);
    if (m->o.recompute == RECOMPUTE_LAYER)
        alloc_layer_set(m, &shared, 0);
    else if (m->o.recompute == RECOMPUTE_ATTENTION)
        alloc_layer_set(m, &shared, 1);
    for (int l = 0; l < L; l++) {
        layer_acts *a = &m->acts[l];
        if (m->o.recompute == RECOMPUTE_LAYER) {
            *a = shared;
        } else {
            int shared_attention = m->o.recompute == RECOMPUTE_ATTENTION;
            alloc_layer_set(m, a, shared_attention ? 2 : 0);
            if (shared_attention) {
                a->att = shared.att;
                a->lse = shared.lse;
            }
        }
        a->x = act_alloc(m, BT * H, d);
    }
    model_scratch *s = MODEL_SCRATCH(m);
    s->gate_up_in_place = gate_up_in_place(mc, &m->o);
    s->x_final = act_alloc(m, BT * H, d);
    s->rstd_f = act_alloc(m, BT, DT_F32);
    s->hf = act_alloc(m, BT * H, d);
    s->dres = act_alloc(m, BT * H, d);
    s->dh = act_alloc(m, BT * H, d);
    s->bwd = act_alloc(m, bwd_elems(mc, &m->o, BT), d);
    if (m->o.mode == MODE_LORA) {
        s->dxr = act_alloc(m, 3 * BT * (size_t)m->o.lora_r, d);
        const char *env = getenv("SPOTUNE_LORA_BATCHED");
        if (env && strcmp(env, "0") == 0)
            m->o.no_lora_batch = 1;
        if (m->o.lora_dropout > 0)
            s->drop = act_alloc(m, BT * max_in_features(mc), d);
        if (m->o.dora)
            s->dora = act_alloc(m, BT * max_in_features(mc), d);
    }
    s->chunk_rows = logits_chunk_rows(mc, &m->o, d);
    s->logits = act_alloc(m, (size_t)s->chunk_rows * (size_t)mc->vocab, d);
    s->loss = act_alloc(m, BT, DT_F32);
    s->tokens = act_alloc(m, BT, DT_I32);
    s->targets = act_alloc(m, BT, DT_I32);
    s->seeds = act_alloc(m, 2 * (size_t)m->o.max_batch, DT_I32);
    s->gscale = act_alloc(m, 1, DT_F32);
    if (m->o.mode == MODE_FULL) {
        s->emb_order = act_alloc(m, BT, DT_I32);
        s->emb_runs = act_alloc(m, BT + 2, DT_I32);
    }
    s->pos = act_alloc(m, BT, DT_I32);
    /* the starts, then (be->doc_table) the documents' table (packed_doc_table) */
    s->seg = act_alloc(m, m->be->doc_table ? 2 * BT + 1 : BT, DT_I32);
    /* the host side of the staged values (stage(), model_step.c): pinned
     * memory on CUDA, so the copies do not wait */
    s->host_words = 7 * BT + 2 * (size_t)m->o.max_batch + 4;
    s->host = be_host_alloc(m->be, s->host_words * sizeof(int32_t));
    if (!s->host)
        be_fail(m->be, __FILE__, __LINE__, "out of host memory for the staged inputs (%zu bytes)",
                s->host_words * sizeof(int32_t));
    size_t half = (size_t)mc->head_dim / 2, T = (size_t)m->o.seq_len;
    s->rope_cos = act_alloc(m, T * half, DT_F32);
    s->rope_sin = act_alloc(m, T * half, DT_F32);
    float *c = malloc(sizeof(float) * T * half), *sn = malloc(sizeof(float) * T * half);
    if (c && sn) {
        model_config_rope_tables(mc, (int64_t)T, c, sn);
        be_upload(m->be, s->rope_cos, c, DT_F32);
        be_upload(m->be, s->rope_sin, sn, DT_F32);
    } else {
        be_fail(m->be, __FILE__, __LINE__, "out of host memory for RoPE tables");
    }
    free(c);
    free(sn);
}

size_t model_shard_len(size_t n, int count)
{
    if (count <= 1)
        return n;
    size_t len = (n + (size_t)count - 1) / (size_t)count;
    return len ? len : 1;
}

/* Sharded gradients: the arena's segments, one per unit the backward
 * finishes at once (the head, each layer from the last, the embedding):
 * segment k is [seg_end[k - 1], seg_end[k]) (seg_end[-1] = 0). */
int model_layout_segments(model_t *m, sp_err *err)
{
    int L = (int)m->mc.layers;
    m->nsegs = L + 2;
    m->seg_end = calloc((size_t)m->nsegs, sizeof *m->seg_end);
    m->seg_buf = calloc((size_t)m->nsegs, sizeof *m->seg_buf);
    if (!m->seg_end || !m->seg_buf)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    m->seg_end[0] = m->ready_upto[0];
    for (int j = 0; j < L; j++) /* layer L - 1 - j */
        m->seg_end[1 + j] = m->ready_upto[L - j];
    m->seg_end[L + 1] = m->n_trainable;
    /* two buffers in turn; a tied embedding's gradient is written by the
     * head first and the embedding last, so its segment has a third */
    for (int k = 0; k < m->nsegs; k++)
        m->seg_buf[k] = k == L + 1 && m->mc.tie_embeddings ? 2 : k % 2;
    return 0;
}

static size_t seg_len(const model_t *m, int k)
{
    return m->seg_end[k] - (k ? m->seg_end[k - 1] : 0);
}

tensor_t model_grad_segment(model_t *m, int k, size_t *lo)
{
    *lo = k ? m->seg_end[k - 1] : 0;
    return tensor_view(m->grad_bufs[m->seg_buf[k]], 0, seg_len(m, k));
}

size_t model_grad_buckets_len(const model_config_t *mc, const model_opts *o)
{
    if (!model_shards_grads(o))
        return 0;
    size_t H = (size_t)mc->hidden, emb = (size_t)(mc->vocab * mc->hidden);
    size_t layer = (size_t)(model_config_params(mc) - mc->hidden) -
                   emb * (mc->tie_embeddings ? 1 : 2);
    layer /= (size_t)mc->layers;
    size_t head = (mc->tie_embeddings ? 0 : emb) + H, len = layer > head ? layer : head;
    if (mc->tie_embeddings)
        return 2 * len + emb;
    return 2 * (len > emb ? len : emb);
}

int model_shards_grads(const model_opts *o)
{
    return o->shard_grads && o->shard_count > 1 && o->mode == MODE_FULL;
}

void model_fuse_group(int g, int *first, int *count)
{
    *first = g == FUSE_QKV ? PROJ_Q : PROJ_GATE;
    *count = g == FUSE_QKV ? 3 : 2;
}

static int fuse_on(const model_t *m)
{
    return fuse_on_opts(&m->o);
}

/* The fused groups' concatenated weights (none for NF4 weights: they are
 * dequantized into the workspace) and biases, each projection's w and b
 * views. */
static void alloc_fused(model_t *m)
{
    m->fused = fuse_on(m);
    if (!m->fused)
        return;
    for (int l = 0; l < m->mc.layers && !m->be->err.code; l++)
        for (int g = 0; g < FUSE_COUNT; g++) {
            layer_params *L = &m->layers[l];
            int first, count;
            size_t n = 0;
            model_fuse_group(g, &first, &count);
            for (int p = first; p < first + count; p++)
                n += L->w[p]->n;
            if (!m->o.nf4) {
                L->fused_w[g] = be_alloc(m->be, m->be->act_dt, n);
                if (m->be->err.code)
                    return;
                m->bytes_weights += n * dtype_size(m->be->act_dt);
                for (size_t off = 0, p = (size_t)first; p < (size_t)(first + count); p++) {
                    L->w[p]->w = tensor_view(L->fused_w[g], off, L->w[p]->n);
                    off += L->w[p]->n;
                }
            }
            size_t nb = 0;
            int biased = 0;
            for (int p = first; p < first + count; p++) {
                nb += (size_t)L->w[p]->shape[0];
                biased |= L->b[p] != NULL;
            }
            if (!biased)
                continue;
            L->fused_b[g] = be_alloc(m->be, m->be->act_dt, nb); /* zeros where no bias */
            if (m->be->err.code)
                return;
            m->bytes_weights += nb * dtype_size(m->be->act_dt);
            for (size_t off = 0, p = (size_t)first; p < (size_t)(first + count); p++) {
                if (L->b[p])
                    L->b[p]->w = tensor_view(L->fused_b[g], off, L->b[p]->n);
                off += (size_t)L->w[p]->shape[0];
            }
        }
}

/* p's weight or bias is a view into a fused group's (freed with the group). */
int model_fused_view(const model_t *m, const param_t *p)
{
    if ((p->kind != PK_WEIGHT && p->kind != PK_BIAS) || p->layer < 0 || p->proj == PROJ_O ||
        p->proj == PROJ_DOWN)
        return 0;
    const layer_params *L = &m->layers[p->layer];
    int g = p->proj < PROJ_O ? FUSE_QKV : FUSE_GATE_UP;
    return (p->kind == PK_WEIGHT ? L->fused_w[g] : L->fused_b[g]).p != NULL;
}

/* Sharded gradients: the bucket buffers the backward writes into (each
 * parameter's grad a view of its segment's buffer). */
static void alloc_grad_buckets(model_t *m)
{
    size_t len[3] = {0, 0, 0};
    for (int k = 0; k < m->nsegs; k++) {
        size_t n = seg_len(m, k);
        int b = m->seg_buf[k];
        len[b] = n > len[b] ? n : len[b];
    }
    /* buffers 0 and 1 alike, the largest segment either takes */
    len[0] = len[1] = len[0] > len[1] ? len[0] : len[1];
    m->grad_buckets_len = 0;
    for (int b = 0; b < 3; b++)
        if (len[b]) {
            m->grad_bufs[b] = be_alloc(m->be, DT_F32, len[b]);
            m->grad_buckets_len += len[b];
        }
}

static void point_grads_at_buckets(model_t *m)
{
    for (int k = 0; k < m->nsegs; k++) {
        size_t lo;
        tensor_t seg = model_grad_segment(m, k, &lo);
        for (int i = 0; i < m->nparams; i++) {
            param_t *p = &m->params[i];
            if (p->trainable && p->offset >= lo && p->offset < lo + seg.n)
                p->grad = tensor_view(seg, p->offset - lo, p->n);
        }
    }
}

/* Sharded optimizer: the compute copy whole, this rank's shard of
 * everything the optimizer keeps, and the gradient either whole (padded) or,
 * with sharded gradients, as bucket buffers. */
static void alloc_sharded(model_t *m)
{
    backend_t *be = m->be;
    size_t S = m->shard_len, padded = S * (size_t)m->shard_count;
    m->master = be_alloc(be, DT_F32, S);
    m->adam_m = be_alloc(be, DT_F32, S);
    m->adam_v = be_alloc(be, DT_F32, S);
    m->grad_shard = be_alloc(be, DT_F32, S);
    if (m->shard_grads)
        alloc_grad_buckets(m);
    else
        m->grad = be_alloc(be, DT_F32, padded);
    m->copy = be_alloc(be, be->act_dt, padded);
    m->bytes_trainable = padded * dtype_size(be->act_dt) + S * 16 +
                         (m->shard_grads ? m->grad_buckets_len : padded) * 4;
    if (be->err.code)
        return;
    model_zero_grads(m);
    be_zero(be, m->copy);
    for (int i = 0; i < m->nparams && !be->err.code; i++) {
        param_t *p = &m->params[i];
        if (p->trainable) {
            p->master = (tensor_t){0};
            p->grad = m->shard_grads ? (tensor_t){0} : tensor_view(m->grad, p->offset, p->n);
            p->w = tensor_view(m->copy, p->offset, p->n);
        } else if (!p->w.p) {
            p->w = be_alloc(be, be->act_dt, p->n);
            m->bytes_weights += p->n * dtype_size(be->act_dt);
        }
    }
    if (m->shard_grads)
        point_grads_at_buckets(m);
}

void model_alloc_params(model_t *m)
{
    backend_t *be = m->be;
    alloc_fused(m);
    m->upd = be_alloc(be, DT_F32, 10);
    if (m->shard_count > 1) {
        alloc_sharded(m);
        return;
    }
    size_t N = m->n_trainable ? m->n_trainable : 1, work = nf4_work_elems(&m->mc, &m->o);
    m->master = be_alloc(be, DT_F32, N);
    m->grad = be_alloc(be, DT_F32, N);
    m->adam_m = be_alloc(be, DT_F32, N);
    m->adam_v = be_alloc(be, DT_F32, N);
    if (be->act_dt != DT_F32)
        m->copy = be_alloc(be, be->act_dt, N);
    m->bytes_trainable = N * (16 + (be->act_dt != DT_F32 ? dtype_size(be->act_dt) : 0));
    for (int i = 0; i < m->nparams && !be->err.code; i++) {
        param_t *p = &m->params[i];
        if (p->trainable) {
            p->master = tensor_view(m->master, p->offset, p->n);
            p->grad = tensor_view(m->grad, p->offset, p->n);
            p->w = be->act_dt == DT_F32 ? p->master : tensor_view(m->copy, p->offset, p->n);
        } else if (m->o.nf4 && p->kind == PK_WEIGHT) {
            p->q_codes = be_alloc(be, DT_U8, nf4_code_bytes(p->n));
            p->q_absmax = be_alloc(be, DT_U8, nf4_blocks(p->n));
            p->q_nested = be_alloc(be, DT_F32, nf4_nested_blocks(p->n));
            m->bytes_weights += nf4_bytes(p->n);
        } else if (!p->w.p) {
            p->w = be_alloc(be, be->act_dt, p->n);
            m->bytes_weights += p->n * dtype_size(be->act_dt);
        }
    }
    if (m->o.nf4 && !be->err.code) {
        float maps[16 + 256];
        memcpy(maps, nf4_quant_map, sizeof nf4_quant_map);
        memcpy(maps + 16, nf4_dynamic_map, sizeof nf4_dynamic_map);
        m->nf4_maps = be_alloc(be, DT_F32, 16 + 256);
        m->nf4_work = be_alloc(be, be->act_dt, work ? work : 1);
        model_nf4_slots(&m->mc, &m->o, m->nf4_off);
        for (int p = 0; p < PROJ_COUNT; p++)
            m->nf4_held[p] = -1;
        const char *reuse = getenv("SPOTUNE_NF4_REUSE");
        m->nf4_reuse = !(reuse && strcmp(reuse, "0") == 0);
        m->bytes_acts += work * dtype_size(be->act_dt) + sizeof maps; /* scratch, as planned */
        if (!be->err.code)
            be_upload(be, m->nf4_maps, maps, DT_F32);
    }
}

