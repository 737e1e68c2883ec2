/* The parameter table, creating and destroying a model, initialisation and
 * parameter values (the memory layout and allocation: model_alloc.c). */
#define _POSIX_C_SOURCE 200809L
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/nf4.h"
#include "model_internal.h"

#define RNG_TAG_BASE_INIT 0x1001
#define RNG_TAG_LORA_INIT 0x1002

static const char *proj_module(int p)
{
    return p <= PROJ_O ? "self_attn" : "mlp";
}

void model_base_name(char *buf, size_t n, int layer, int proj, int bias)
{
    snprintf(buf, n, "model.layers.%d.%s.%s.%s", layer, proj_module(proj),
             config_target_names[proj], bias ? "bias" : "weight");
}

void model_lora_name(char *buf, size_t n, int layer, int proj, int b_matrix)
{
    snprintf(buf, n, "base_model.model.model.layers.%d.%s.%s.lora_%c.weight", layer,
             proj_module(proj), config_target_names[proj], b_matrix ? 'B' : 'A');
}

void model_dora_name(char *buf, size_t n, int layer, int proj)
{
    snprintf(buf, n, "base_model.model.model.layers.%d.%s.%s.lora_magnitude_vector", layer,
             proj_module(proj), config_target_names[proj]);
}

static param_t *add_param(model_t *m, int kind, int layer, int proj, int64_t d0, int64_t d1,
                          int trainable, int decay, const char *name)
{
    param_t *p = &m->params[m->nparams++];
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", name);
    p->kind = kind;
    p->layer = layer;
    p->proj = proj;
    p->ndim = d1 ? 2 : 1;
    p->shape[0] = d0;
    p->shape[1] = d1;
    p->n = (size_t)d0 * (size_t)(d1 ? d1 : 1);
    p->trainable = trainable;
    p->decay = decay;
    return p;
}

int model_lora_on(const model_t *m, int proj)
{
    return m->o.mode == MODE_LORA && (m->o.lora_targets & (1 << proj));
}

static void build_table(model_t *m)
{
    const model_config_t *mc = &m->mc;
    int full = m->o.mode == MODE_FULL;
    char name[160];
    m->embed = add_param(m, PK_EMBED, -1, -1, mc->vocab, mc->hidden, full, 1,
                         "model.embed_tokens.weight");
    for (int l = 0; l < mc->layers; l++) {
        layer_params *L = &m->layers[l];
        snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
        L->attn_norm = add_param(m, PK_NORM, l, -1, mc->hidden, 0, full, 0, name);
        snprintf(name, sizeof name, "model.layers.%d.post_attention_layernorm.weight", l);
        L->mlp_norm = add_param(m, PK_NORM, l, -1, mc->hidden, 0, full, 0, name);
        for (int p = 0; p < PROJ_COUNT; p++) {
            int64_t in, out;
            model_config_proj_dims(mc, p, &in, &out);
            model_base_name(name, sizeof name, l, p, 0);
            L->w[p] = add_param(m, PK_WEIGHT, l, p, out, in, full, 1, name);
            if (mc->bias[p]) {
                model_base_name(name, sizeof name, l, p, 1);
                L->b[p] = add_param(m, PK_BIAS, l, p, out, 0, full, 0, name);
            }
            if (model_lora_on(m, p)) {
                model_lora_name(name, sizeof name, l, p, 0);
                L->lora_a[p] = add_param(m, PK_LORA_A, l, p, m->o.lora_r, in, 1, 1, name);
                model_lora_name(name, sizeof name, l, p, 1);
                L->lora_b[p] = add_param(m, PK_LORA_B, l, p, out, m->o.lora_r, 1, 1, name);
                if (m->o.dora) { /* a gain per output row: no decay, as the norm weights */
                    model_dora_name(name, sizeof name, l, p);
                    L->lora_m[p] = add_param(m, PK_LORA_M, l, p, out, 0, 1, 0, name);
                }
            }
        }
    }
    m->final_norm = add_param(m, PK_NORM, -1, -1, mc->hidden, 0, full, 0, "model.norm.weight");
    if (mc->tie_embeddings)
        m->lm_head = m->embed;
    else
        m->lm_head = add_param(m, PK_LM_HEAD, -1, -1, mc->vocab, mc->hidden, full, 1,
                               "lm_head.weight");
}

static int nf4_param(const param_t *p)
{
    return p->q_codes.p != NULL;
}

/* Every slot of the NF4 workspace forgets its weight: the workspace was
 * written otherwise, or a weight changed, or a forward pass begins (so
 * that a captured pass assumes nothing of what ran before it: an
 * evaluation, a download of a weight). */
void model_nf4_forget(model_t *m)
{
    for (int q = 0; q < PROJ_COUNT; q++)
        m->nf4_held[q] = -1;
}

/* Elements of projection q's weight (the same in every layer). */
static size_t proj_elems(const model_t *m, int q)
{
    int64_t in, out;
    model_config_proj_dims(&m->mc, q, &in, &out);
    return (size_t)in * (size_t)out;
}

tensor_t model_weight(model_t *m, const param_t *p)
{
    if (!nf4_param(p))
        return p->w;
    int s = p->proj;
    size_t lo = m->nf4_off[s], hi = lo + p->n;
    tensor_t w = tensor_view(m->nf4_work, lo, p->n);
    if (m->nf4_held[s] == p->layer && p->layer >= 0 && m->nf4_reuse)
        return w;
    for (int q = 0; q < PROJ_COUNT; q++) /* the slots it overwrites */
        if (m->nf4_off[q] < hi && lo < m->nf4_off[q] + proj_elems(m, q))
            m->nf4_held[q] = -1;
    be_dequant_nf4(m->be, w, p->q_codes, p->q_absmax, p->q_nested, m->nf4_maps, p->q_offset, p->n);
    m->nf4_held[s] = p->layer;
    m->nf4_dequants++;
    return w;
}

/* Quantizes host values x [p->n] into NF4 weight p. */
static void nf4_store(model_t *m, param_t *p, const float *x)
{
    model_nf4_forget(m);
    size_t nb = nf4_blocks(p->n), nn = nf4_nested_blocks(p->n);
    uint8_t *codes = malloc(nf4_code_bytes(p->n)), *q = malloc(nb);
    float *absmax = malloc(sizeof(float) * nb), *nested = malloc(sizeof(float) * nn);
    if (!codes || !q || !absmax || !nested) {
        be_fail(m->be, __FILE__, __LINE__, "out of memory quantizing %s", p->name);
    } else {
        nf4_quantize_codes(x, p->n, codes, absmax);
        p->q_offset = nf4_absmax_offset(absmax, nb);
        nf4_quantize_absmax(absmax, nb, p->q_offset, nf4_dynamic_map, q, nested);
        be_upload(m->be, p->q_codes, codes, DT_U8);
        be_upload(m->be, p->q_absmax, q, DT_U8);
        be_upload(m->be, p->q_nested, nested, DT_F32);
    }
    free(codes);
    free(q);
    free(absmax);
    free(nested);
}

/* Quantizes the first p->n values of x (a device tensor, F32 or BF16: the
 * NF4 workspace) into NF4 weight p: the codes and block maxima where the
 * values are (quantize_nf4: no copy of the weight to the host, which for
 * 13B took over a minute), the double quantization of the maxima (1/64 of
 * the values) on the host. Bit for bit nf4_store of the same values. */
static void nf4_store_dev(model_t *m, param_t *p, tensor_t x)
{
    model_nf4_forget(m); /* x is the workspace, and p changes */
    size_t nb = nf4_blocks(p->n), nn = nf4_nested_blocks(p->n);
    float *absmax = malloc(sizeof(float) * nb), *nested = malloc(sizeof(float) * nn);
    uint8_t *q = malloc(nb);
    tensor_t am = be_alloc(m->be, DT_F32, nb);
    if (!absmax || !nested || !q) {
        be_fail(m->be, __FILE__, __LINE__, "out of memory quantizing %s", p->name);
    } else {
        be_quantize_nf4(m->be, p->q_codes, am, x, m->nf4_maps, p->n);
        be_download(m->be, absmax, DT_F32, am);
        p->q_offset = nf4_absmax_offset(absmax, nb);
        nf4_quantize_absmax(absmax, nb, p->q_offset, nf4_dynamic_map, q, nested);
        be_upload(m->be, p->q_absmax, q, DT_U8);
        be_upload(m->be, p->q_nested, nested, DT_F32);
    }
    if (am.p)
        be_free(m->be, &am);
    free(absmax);
    free(nested);
    free(q);
}

int model_create(model_t **out, backend_t *be, const model_config_t *mc, const model_opts *o,
                 sp_err *err)
{
    *out = NULL;
    if (o->nf4 && o->mode != MODE_LORA)
        return sp_fail(err, SP_EXIT_USAGE, "model.quantize nf4 needs train.mode lora");
    if (o->shard_count > 1 && o->mode != MODE_FULL)
        return sp_fail(err, SP_EXIT_USAGE,
                       "a sharded optimizer (model_opts.shard_count %d) is for train.mode full; "
                       "LoRA's optimizer state is small and kept whole on every rank",
                       o->shard_count);
    model_t *m = calloc(1, sizeof *m);
    if (!m)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    m->mc = *mc;
    m->o = *o;
    m->be = be;
    int max_params = 4 + (int)mc->layers * (2 + 5 * PROJ_COUNT);
    m->params = calloc((size_t)max_params, sizeof *m->params);
    m->layers = calloc((size_t)mc->layers, sizeof *m->layers);
    m->acts = calloc((size_t)mc->layers, sizeof *m->acts);
    m->scratch = calloc(1, sizeof(model_scratch));
    if (!m->params || !m->layers || !m->acts || !m->scratch) {
        model_destroy(m);
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    }
    if (o->mode == MODE_LORA)
        m->lora_scale = (float)(o->rslora ? o->lora_alpha / sqrt((double)o->lora_r)
                                          : o->lora_alpha / (double)o->lora_r);
    build_table(m);
    if (model_layout_arenas(m, err)) {
        model_destroy(m);
        return err->code;
    }
    m->shard_count = o->shard_count > 1 && m->n_trainable > 0 ? o->shard_count : 1;
    m->shard_rank = m->shard_count > 1 ? o->shard_rank : 0;
    if (m->shard_rank < 0 || m->shard_rank >= m->shard_count) {
        model_destroy(m);
        return sp_fail(err, SP_EXIT_OTHER, "shard %d of %d does not exist", o->shard_rank,
                       o->shard_count);
    }
    m->shard_len = model_shard_len(m->n_trainable, m->shard_count);
    m->shard_lo = (size_t)m->shard_rank * m->shard_len;
    model_opts eff = *o;
    eff.shard_count = m->shard_count;
    m->shard_grads = model_shards_grads(&eff);
    if (m->shard_grads && model_layout_segments(m, err)) {
        model_destroy(m);
        return err->code;
    }
    model_alloc_params(m);
    if (!be->err.code)
        model_alloc_activations(m);
    if (be_check(be, err)) {
        model_destroy(m);
        return err->code;
    }
    *out = m;
    return 0;
}

/* whether a->xr[p] is a view of its fused group's block */
static int xr_in_block(const layer_acts *a, int p)
{
    for (int g = 0; g < FUSE_COUNT; g++) {
        const char *lo = a->xr_cat[g].p, *x = a->xr[p].p;
        if (lo && x >= lo && x < lo + a->xr_cat[g].n * dtype_size(a->xr_cat[g].dt))
            return 1;
    }
    return 0;
}

static void free_if_owned(backend_t *be, tensor_t *t, tensor_t *shared_with)
{
    if (t->p && (!shared_with || shared_with->p != t->p))
        be_free(be, t);
}

void model_destroy(model_t *m)
{
    if (!m)
        return;
    backend_t *be = m->be;
    model_graphs_free(m);
    for (int i = 0; i < m->nparams; i++)
        if (!m->params[i].trainable) {
            if (!model_fused_view(m, &m->params[i]))
                free_if_owned(be, &m->params[i].w, NULL);
            free_if_owned(be, &m->params[i].q_codes, NULL);
            free_if_owned(be, &m->params[i].q_absmax, NULL);
            free_if_owned(be, &m->params[i].q_nested, NULL);
        }
    for (int l = 0; m->layers && l < m->mc.layers; l++)
        for (int g = 0; g < FUSE_COUNT; g++) {
            free_if_owned(be, &m->layers[l].fused_w[g], NULL);
            free_if_owned(be, &m->layers[l].fused_b[g], NULL);
        }
    free_if_owned(be, &m->nf4_maps, NULL);
    free_if_owned(be, &m->nf4_work, NULL);
    tensor_t *arenas[] = {&m->master, &m->grad,       &m->adam_m,       &m->adam_v,
                          &m->copy,   &m->grad_shard, &m->grad_bufs[0], &m->grad_bufs[1],
                          &m->grad_bufs[2], &m->upd};
    for (size_t i = 0; i < sizeof arenas / sizeof arenas[0]; i++)
        free_if_owned(be, arenas[i], NULL);
    /* shared activation sets are freed once, through the last layer's handles */
    int L = m->acts ? (int)m->mc.layers : 0;
    for (int l = 0; l < L; l++) {
        layer_acts *a = &m->acts[l];
        layer_acts *next = l + 1 < L ? &m->acts[l + 1] : NULL;
        tensor_t *fields[] = {&a->rstd1, &a->h1, &a->qkv, &a->att, &a->lse,
                              &a->x_mid, &a->rstd2, &a->h2, &a->gu, &a->a};
        tensor_t *nfields[] = {next ? &next->rstd1 : NULL, next ? &next->h1 : NULL,
                               next ? &next->qkv : NULL, next ? &next->att : NULL,
                               next ? &next->lse : NULL, next ? &next->x_mid : NULL,
                               next ? &next->rstd2 : NULL, next ? &next->h2 : NULL,
                               next ? &next->gu : NULL, next ? &next->a : NULL};
        for (size_t f = 0; f < sizeof fields / sizeof fields[0]; f++)
            free_if_owned(be, fields[f], nfields[f]);
        for (int p = 0; p < PROJ_COUNT; p++) {
            if (!xr_in_block(a, p))
                free_if_owned(be, &a->xr[p], next ? &next->xr[p] : NULL);
            free_if_owned(be, &a->wnorm[p], next ? &next->wnorm[p] : NULL);
        }
        for (int g = 0; g < FUSE_COUNT; g++) /* after its views, xr[p] */
            free_if_owned(be, &a->xr_cat[g], next ? &next->xr_cat[g] : NULL);
        free_if_owned(be, &a->x, NULL);
    }
    model_scratch *s = m->scratch;
    if (s) {
        tensor_t *fields[] = {&s->x_final, &s->rstd_f, &s->hf, &s->dres, &s->dh,
                              &s->bwd, &s->dxr, &s->drop, &s->dora, &s->logits, &s->loss,
                              &s->tokens, &s->targets, &s->pos, &s->seg, &s->seeds, &s->gscale,
                              &s->emb_order, &s->emb_runs, &s->rope_cos, &s->rope_sin};
        for (size_t f = 0; f < sizeof fields / sizeof fields[0]; f++)
            free_if_owned(be, fields[f], NULL);
        be_host_free(be, s->host);
    }
    free(m->scratch);
    free(m->acts);
    free(m->layers);
    free(m->params);
    free(m->runs);
    free(m->ready_upto);
    free(m->seg_end);
    free(m->seg_buf);
    free(m);
}

/* Fills a parameter on the device: the master when trainable (then the
 * compute copy from it), else the weight itself. */
static tensor_t fill_target(model_t *m, param_t *p)
{
    return p->trainable && m->shard_count == 1 ? p->master : p->w;
}

/* The part of p inside this rank's optimizer shard: [*lo, *hi) of the arena. */
static int shard_overlap(const model_t *m, const param_t *p, size_t *lo, size_t *hi)
{
    size_t a = p->offset, b = p->offset + p->n, s = m->shard_lo, e = m->shard_lo + m->shard_len;
    *lo = a > s ? a : s;
    *hi = b < e ? b : e;
    return p->trainable && *lo < *hi;
}

static void sync_copy(model_t *m, param_t *p)
{
    size_t lo, hi;
    if (m->shard_count > 1) { /* the shard's masters from the values just written */
        if (shard_overlap(m, p, &lo, &hi))
            be_copy(m->be, tensor_view(m->master, lo - m->shard_lo, hi - lo),
                    tensor_view(m->copy, lo, hi - lo));
        return;
    }
    if (p->trainable && p->w.p != p->master.p)
        be_copy(m->be, p->w, p->master);
}

static void fill_const(model_t *m, param_t *p, float value)
{
    be_fill_uniform(m->be, fill_target(m, p), p->n, value, value, 0, 0);
    sync_copy(m, p);
}

void model_init_base_random(model_t *m, uint64_t seed)
{
    uint64_t s = sp_rng_stream(seed, RNG_TAG_BASE_INIT);
    for (int i = 0; i < m->nparams; i++) {
        param_t *p = &m->params[i];
        if (p->kind == PK_NORM) {
            fill_const(m, p, 1.0f);
        } else if (p->kind == PK_BIAS) {
            fill_const(m, p, 0.0f);
        } else if (nf4_param(p)) { /* drawn as a dense weight, then quantized */
            tensor_t w = tensor_view(m->nf4_work, 0, p->n);
            be_fill_normal(m->be, w, p->n, 0.0f, 0.02f, sp_rng_stream(s, (uint64_t)i), 0);
            nf4_store_dev(m, p, w);
        } else if (p->kind == PK_EMBED || p->kind == PK_WEIGHT || p->kind == PK_LM_HEAD) {
            uint64_t ps = sp_rng_stream(s, (uint64_t)i);
            size_t lo, hi;
            be_fill_normal(m->be, fill_target(m, p), p->n, 0.0f, 0.02f, ps, 0);
            if (m->shard_count > 1 && shard_overlap(m, p, &lo, &hi))
                /* the shard's masters drawn again in F32 (the same counters),
                 * not copied from the compute copy, which may hold them
                 * rounded to bf16 */
                be_fill_normal(m->be, tensor_view(m->master, lo - m->shard_lo, hi - lo), hi - lo,
                               0.0f, 0.02f, ps, lo - p->offset);
            else
                sync_copy(m, p);
        }
    }
}

void model_init_lora(model_t *m, uint64_t seed)
{
    uint64_t s = sp_rng_stream(seed, RNG_TAG_LORA_INIT);
    for (int i = 0; i < m->nparams; i++) {
        param_t *p = &m->params[i];
        if (p->kind == PK_LORA_A) {
            float bound = 1.0f / sqrtf((float)p->shape[1]);
            uint64_t tag = (uint64_t)p->layer * PROJ_COUNT + (uint64_t)p->proj;
            be_fill_uniform(m->be, fill_target(m, p), p->n, -bound, bound,
                            sp_rng_stream(s, tag), 0);
            sync_copy(m, p);
        } else if (p->kind == PK_LORA_B) {
            fill_const(m, p, 0.0f);
        }
    }
    /* DoRA's magnitude: the row norms of W + s B A with the A and B just drawn */
    for (int i = 0; i < m->nparams; i++) {
        param_t *p = &m->params[i];
        if (p->kind == PK_LORA_M) {
            const param_t *w = m->layers[p->layer].w[p->proj];
            model_dora_norm(m, p->layer, p->proj, model_weight(m, w), fill_target(m, p));
            sync_copy(m, p);
        }
    }
}

void model_dora_norm(model_t *m, int l, int p, tensor_t w, tensor_t n)
{
    const layer_params *L = &m->layers[l];
    int64_t in, out;
    model_config_proj_dims(&m->mc, p, &in, &out);
    be_weight_norm(m->be, n, w, L->lora_a[p]->w, L->lora_b[p]->w, m->lora_scale,
                   (int)out, (int)in, (int)m->o.lora_r);
}

void model_param_upload(model_t *m, param_t *p, const void *src, dtype_t src_dt)
{
    if (nf4_param(p) && (src_dt == m->be->act_dt || m->be->act_dt == DT_F32)) {
        /* the workspace holds the values exactly: quantized where they are */
        tensor_t w = tensor_view(m->nf4_work, 0, p->n);
        be_upload(m->be, w, src, src_dt);
        nf4_store_dev(m, p, w);
        return;
    }
    if (nf4_param(p)) { /* e.g. F32 values and BF16 activations: the host quantizes them exactly */
        float *x = malloc(sizeof(float) * p->n);
        if (!x || dtype_convert(x, DT_F32, src, src_dt, p->n)) {
            be_fail(m->be, __FILE__, __LINE__, "%s: cannot quantize %s values to NF4", p->name,
                    dtype_name(src_dt));
        } else {
            nf4_store(m, p, x);
        }
        free(x);
        return;
    }
    be_upload(m->be, fill_target(m, p), src, src_dt);
    size_t lo, hi;
    if (m->shard_count > 1) { /* the masters straight from src, not from the compute copy */
        if (shard_overlap(m, p, &lo, &hi))
            be_upload(m->be, tensor_view(m->master, lo - m->shard_lo, hi - lo),
                      (const char *)src + (lo - p->offset) * dtype_size(src_dt), src_dt);
        return;
    }
    sync_copy(m, p);
}

void model_param_set_nf4(model_t *m, param_t *p, const uint8_t *codes, const uint8_t *absmax,
                         const float *nested, float offset)
{
    if (!nf4_param(p)) {
        be_fail(m->be, __FILE__, __LINE__, "%s is not stored as NF4", p->name);
        return;
    }
    model_nf4_forget(m);
    be_upload(m->be, p->q_codes, codes, DT_U8);
    be_upload(m->be, p->q_absmax, absmax, DT_U8);
    be_upload(m->be, p->q_nested, nested, DT_F32);
    p->q_offset = offset;
}

void model_param_download(model_t *m, const param_t *p, float *dst)
{
    if (nf4_param(p)) {
        be_download(m->be, dst, DT_F32, model_weight(m, p));
        return;
    }
    be_download(m->be, dst, DT_F32, p->trainable && m->shard_count == 1 ? p->master : p->w);
}

param_t *model_find_param(model_t *m, const char *name)
{
    for (int i = 0; i < m->nparams; i++)
        if (strcmp(m->params[i].name, name) == 0)
            return &m->params[i];
    return NULL;
}

void model_zero_grads(model_t *m)
{
    if (!m->n_trainable)
        return;
    if (!m->shard_grads) {
        be_zero(m->be, m->grad);
        return;
    }
    be_zero(m->be, m->grad_shard);
    for (int b = 0; b < 3; b++)
        if (m->grad_bufs[b].p)
            be_zero(m->be, m->grad_bufs[b]);
}

double model_grad_sumsq(model_t *m)
{
    if (!m->n_trainable)
        return 0.0;
    if (m->shard_count > 1)
        return be_sumsq(m->be, m->grad_shard, m->shard_len);
    return be_sumsq(m->be, m->grad, m->n_trainable);
}

void model_adamw(model_t *m, const adamw_args *a)
{
    int sharded = m->shard_count > 1;
    tensor_t grad = sharded ? m->grad_shard : m->grad;
    size_t s = m->shard_lo, e = m->shard_lo + m->shard_len;
    for (int i = 0; i < m->nruns; i++) {
        const adamw_run *r = &m->runs[i];
        /* the run's part inside the shard (all of it when unsharded) */
        size_t lo = r->offset > s ? r->offset : s;
        size_t hi = r->offset + r->n < e ? r->offset + r->n : e;
        if (lo >= hi)
            continue;
        size_t n = hi - lo, at = lo - s;
        adamw_args ra = *a;
        if (!r->decay)
            ra.weight_decay = 0.0f;
        tensor_t copy = m->copy.p ? tensor_view(m->copy, lo, n) : (tensor_t){0};
        be_adamw(m->be, tensor_view(m->master, at, n), copy, tensor_view(grad, at, n),
                 tensor_view(m->adam_m, at, n), tensor_view(m->adam_v, at, n), n, &ra);
    }
}
