/* A step as the trainer runs it: each micro-batch's host values staged in
 * device memory, every launch of its forward, loss and backward
 * (model_graph.c), its loss read back; the update (the gradient norm and
 * AdamW, reading the step's values from device memory); and, with
 * model_opts.graphs, each of those as a captured span replayed while its
 * launch trace stays the same. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "model_internal.h"

#define RNG_TAG_DROPOUT 0x2001

/* The loss sums in device memory (m->upd): the training micro-batches' and
 * an evaluation's. */
static tensor_t loss_acc(const model_t *m, int training)
{
    return tensor_view(m->upd, training ? 6 : 8, 2);
}

static int take(model_t *m, int training, double *loss_sum, sp_err *err)
{
    tensor_t acc = loss_acc(m, training);
    double v = 0.0;
    be_d2h(m->be, &v, acc.p, sizeof v);
    be_zero(m->be, acc);
    if (be_check(m->be, err))
        return err->code;
    *loss_sum += v;
    return 0;
}

int model_loss_take(model_t *m, double *loss_sum, sp_err *err)
{
    return take(m, 1, loss_sum, err);
}

/* The micro-batch's per-token losses (s->loss) summed into its loss sum. */
static void add_loss(const step_ctx *c)
{
    be_sum_add(c->m->be, loss_acc(c->m, c->training), MODEL_SCRATCH(c->m)->loss,
               (size_t)c->rows);
}

static int check_batch(model_t *m, const model_batch *b, sp_err *err)
{
    if (b->B < 1 || b->B > m->o.max_batch || b->T < 1 || b->T > m->o.seq_len)
        return sp_fail(err, SP_EXIT_OTHER,
                       "micro-batch %dx%d exceeds the model's activations (%lldx%lld)", b->B,
                       b->T, (long long)m->o.max_batch, (long long)m->o.seq_len);
    size_t n = (size_t)b->B * (size_t)b->T;
    for (size_t i = 0; i < n; i++)
        if (b->inputs[i] < 0 || b->inputs[i] >= m->mc.vocab || b->targets[i] >= m->mc.vocab)
            return sp_fail(err, SP_EXIT_INPUT, "token id %d at position %zu is outside the "
                                               "vocabulary (%lld)",
                           b->inputs[i] < 0 || b->inputs[i] >= m->mc.vocab ? b->inputs[i]
                                                                             : b->targets[i],
                           i, (long long)m->mc.vocab);
    /* packed documents: the data layer's promise, checked (an out-of-range
     * position or segment would silently attend or rotate wrongly) */
    for (size_t i = 0; i < n && (b->pos || b->seg); i++) {
        int t = (int)(i % (size_t)b->T);
        if ((b->pos && (b->pos[i] < 0 || b->pos[i] > t)) ||
            (b->seg && (b->seg[i] < 0 || b->seg[i] > t)))
            return sp_fail(err, SP_EXIT_OTHER,
                           "packed batch: position %d or document start %d at row position %d "
                           "is out of range",
                           b->pos ? b->pos[i] : 0, b->seg ? b->seg[i] : 0, t);
    }
    return 0;
}

/* One staged value: n words at h + *at into t's first n elements. */
static void stage_words(backend_t *be, tensor_t t, int32_t *h, size_t *at, const void *src,
                        size_t n)
{
    if (src)
        memcpy(h + *at, src, n * sizeof(int32_t));
    be_upload_staged(be, tensor_view(t, 0, n), h + *at);
    *at += n;
}

/* The micro-batch's host values into device memory, where its launches
 * read them: tokens, targets, packed positions and document starts, and in
 * training the windows' dropout seeds and the loss gradient's scale. The
 * copies go through pinned memory (s->host) and nothing waits for them or
 * for the micro-batch before (they run after it, in stream order), but the
 * previous micro-batch's copies, which ran before that micro-batch
 * started: so on a device the host stages a micro-batch while the one
 * before is computed. */
static int stage(const step_ctx *c, sp_err *err)
{
    model_t *m = c->m;
    backend_t *be = m->be;
    model_scratch *s = MODEL_SCRATCH(m);
    size_t n = (size_t)c->rows, at = 0;
    if (check_batch(m, c->b, err))
        return err->code;
    int32_t *h = s->host;
    be_staged_wait(be); /* h may be written again */
    stage_words(be, s->tokens, h, &at, c->b->inputs, n);
    stage_words(be, s->targets, h, &at, c->b->targets, n);
    if (c->b->pos)
        stage_words(be, s->pos, h, &at, c->b->pos, n);
    s->doc_cap = 0;
    if (c->b->seg) {
        stage_words(be, s->seg, h, &at, c->b->seg, n);
        /* the documents' table after the starts, for a backend that runs
         * them as sequences of their own (be->doc_table) */
        int cap = be->doc_table ? packed_doc_table(c->b->seg, c->b->B, c->b->T, h + at) : 0;
        if (cap > 0) {
            be_upload_staged(be, tensor_view(s->seg, n, (size_t)cap + 1), h + at);
            at += (size_t)cap + 1;
            s->doc_cap = cap;
        }
    }
    if (!c->training)
        return be_check(be, err);
    if (m->o.lora_dropout > 0) { /* the windows' LoRA dropout seeds */
        uint64_t stream = sp_rng_stream(m->o.seed, RNG_TAG_DROPOUT);
        for (int w = 0; w < c->b->B; w++) {
            uint64_t seed = sp_rng_stream(stream, c->b->sample_ids[w]);
            memcpy(h + at + 2 * (size_t)w, &seed, sizeof seed);
        }
        stage_words(be, s->seeds, h, &at, NULL, 2 * (size_t)c->b->B);
    }
    stage_words(be, s->gscale, h, &at, &c->b->grad_scale, 1);
    if (m->embed->trainable) { /* the tokens grouped by id: a deterministic backward */
        if (embedding_order(c->b->inputs, (int)n, h + at, h + at + n))
            return sp_fail(err, SP_EXIT_OTHER, "out of host memory");
        stage_words(be, s->emb_order, h, &at, NULL, n);
        stage_words(be, s->emb_runs, h, &at, NULL, n + 2);
    }
    return be_check(be, err);
}

static void grads_ready(model_t *m, const model_batch *b, size_t upto)
{
    if ((b->last || m->shard_grads) && m->grads_ready && upto > 0)
        m->grads_ready(m->grads_ready_ctx, upto);
}

/* Every launch of a training micro-batch, from its staged inputs to its
 * gradients; the reductions of finished gradients begin in between
 * (grads_ready) on the step's last micro-batch. */
static void launch_step(const step_ctx *c)
{
    model_t *m = c->m;
    const model_batch *b = c->b;
    model_graph_forward(c);
    model_graph_head(c, 1);
    add_loss(c);
    grads_ready(m, b, m->ready_upto[0]);
    for (int l = (int)m->mc.layers - 1; l >= 0; l--) {
        model_graph_layer_backward(c, l);
        grads_ready(m, b, m->ready_upto[1 + l]);
    }
    if (m->embed->trainable) {
        model_scratch *s = MODEL_SCRATCH(m);
        size_t n = (size_t)c->rows;
        be_embedding_backward(m->be, m->embed->grad, s->dres, s->tokens,
                              tensor_view(s->emb_order, 0, n), tensor_view(s->emb_runs, 0, n + 2),
                              c->rows, (int)m->mc.hidden);
    }
    grads_ready(m, b, m->n_trainable);
}

/* ---- captured micro-batches (model_opts.graphs) ------------------------------ */

#define GRAPH_SLOTS 4

/* The graphs kept for one kind of span (a handful: the micro-batch shapes
 * of a run are few, e.g. full and the last of an epoch; the update has
 * one), replaced in turn; seen: the digest of the last span run eagerly, so
 * a span is captured the second time it comes (the first warms up what the
 * backend sizes on first use). */
typedef struct model_graphs {
    be_graph *g[GRAPH_SLOTS];
    int next;
    uint64_t seen;
    int have_seen;
} model_graphs;

static void cache_free(backend_t *be, model_graphs **G)
{
    if (!*G)
        return;
    for (int i = 0; i < GRAPH_SLOTS; i++)
        be_graph_free(be, (*G)->g[i]);
    free(*G);
    *G = NULL;
}

void model_graphs_free(model_t *m)
{
    cache_free(m->be, &m->graphs);
    cache_free(m->be, &m->graphs_upd);
}

static void graphs_off(model_t *m, const char *why)
{
    m->o.graphs = 0;
    snprintf(m->graph_off, sizeof m->graph_off, "%s", why);
    model_graphs_free(m);
}

/* One kind of captured span: its launches (launch(arg)), its graphs, its
 * counts, and what it is called in messages ("a micro-batch"). */
typedef struct span {
    void (*launch)(const void *arg);
    const void *arg;
    model_graphs **cache;
    model_graph_count *count;
    const char *what;
} span;

static void eager(const span *s)
{
    s->count->eager++;
    s->launch(s->arg);
}

/* The span's launches as a captured span: traced dry first; a graph with
 * the same digest replays it, else it runs eagerly (first sight of a
 * digest) or is captured (second sight) and replayed. Whatever cannot be
 * captured turns graphs off for the run and runs eagerly. */
static void launch_graphed(model_t *m, const span *s)
{
    backend_t *be = m->be;
    be_trace t;
    be_trace_start(be, &t, 1);
    s->launch(s->arg);
    be_trace_stop(be);
    if (be->err.code) /* a refused op: reported by the caller */
        return;
    char why[256];
    if (t.barriers) {
        snprintf(why, sizeof why, "%s holds %zu call(s) a graph cannot, the first: %s", s->what,
                 t.barriers, t.first_barrier);
        graphs_off(m, why);
        eager(s);
        return;
    }
    if (!*s->cache && !(*s->cache = calloc(1, sizeof **s->cache))) {
        eager(s);
        return;
    }
    model_graphs *G = *s->cache;
    int emptied = -1; /* the slot of a stale graph, which the new one takes */
    for (int i = 0; i < GRAPH_SLOTS; i++) {
        if (!G->g[i] || G->g[i]->digest != t.digest)
            continue;
        int rc = be_graph_launch(be, G->g[i]);
        if (rc <= 0) {
            s->count->replays += rc == 0;
            return;
        }
        be_graph_free(be, G->g[i]); /* stale: captured again below */
        G->g[i] = NULL;
        emptied = i;
        G->have_seen = 1;
        G->seen = t.digest;
        break;
    }
    if (!G->have_seen || G->seen != t.digest) {
        G->have_seen = 1;
        G->seen = t.digest;
        eager(s);
        return;
    }
    if (be_graph_begin(be))
        return; /* the sticky error says why */
    s->launch(s->arg);
    be_graph *g = be_graph_end(be, why, sizeof why);
    if (g && g->digest != t.digest) { /* the host code launched something else */
        snprintf(why, sizeof why, "%s launched differently when captured "
                                  "(%zu ops traced, %zu captured)", s->what, t.ops, g->ops);
        be_graph_free(be, g);
        g = NULL;
    }
    if (!g) {
        char off[300];
        snprintf(off, sizeof off, "capture failed: %s", why);
        graphs_off(m, off);
        eager(s);
        return;
    }
    if (emptied >= 0) {
        G->g[emptied] = g;
    } else {
        be_graph_free(be, G->g[G->next]);
        G->g[G->next] = g;
        G->next = (G->next + 1) % GRAPH_SLOTS;
    }
    s->count->captures++;
    s->count->ops = g->ops;
    int rc = be_graph_launch(be, g);
    if (rc == 0)
        s->count->replays++;
    else if (rc == 1) /* stale already: nothing of the span has run */
        eager(s);
}

static void launch_step_span(const void *c)
{
    launch_step(c);
}

int model_forward_backward(model_t *m, const model_batch *b, double *loss_sum, sp_err *err)
{
    step_ctx c = {m, b, b->B * b->T, 1};
    if (m->shard_grads && !m->grads_ready)
        return sp_fail(err, SP_EXIT_OTHER,
                       "the gradients are sharded but nothing reduces them: call "
                       "grad_sync_begin before the backward");
    if (stage(&c, err))
        return err->code;
    /* eager: a profiled step, or reductions started during the backward */
    int reduces = m->grads_ready && (b->last || m->shard_grads);
    if (m->o.graphs && !m->be->prof && !reduces) {
        span sp = {launch_step_span, &c, &m->graphs, &m->graph_mb, "a micro-batch"};
        launch_graphed(m, &sp);
    } else {
        launch_step(&c);
    }
    if (be_check(m->be, err))
        return err->code;
    return loss_sum ? take(m, 1, loss_sum, err) : 0;
}

/* ---- the step's update ---------------------------------------------------------- */

typedef struct update_ctx {
    model_t *m;
    const adamw_args *a;
} update_ctx;

/* The norm into device memory, and AdamW reading it there. */
static void launch_update(const void *arg)
{
    const update_ctx *u = arg;
    be_sumsq_into(u->m->be, u->a->sumsq, u->m->grad, u->m->n_trainable);
    model_adamw(u->m, u->a);
}

int model_update(model_t *m, const adamw_args *a, double max_norm, double *gnorm, sp_err *err)
{
    *gnorm = 0.0;
    if (m->shard_count > 1)
        return sp_fail(err, SP_EXIT_OTHER,
                       "model_update: the optimizer is sharded, its gradient norm is summed "
                       "over the ranks (grad_sync_update)");
    if (!m->n_trainable)
        return 0;
    float hyper[3];
    adamw_hyper(a, hyper);
    /* the values that change every step are in device memory, so the
     * launches (and their trace) are the same every step */
    adamw_args d = *a;
    d.lr = 0.0f;
    d.step = 0;
    d.grad_scale = 0.0f;
    d.hyper = tensor_view(m->upd, 0, 3);
    d.sumsq = tensor_view(m->upd, 4, 2);
    d.max_norm = max_norm;
    be_upload(m->be, d.hyper, hyper, DT_F32);
    update_ctx u = {m, &d};
    if (m->o.graphs && !m->be->prof) {
        span sp = {launch_update, &u, &m->graphs_upd, &m->graph_upd, "the update"};
        launch_graphed(m, &sp);
    } else {
        launch_update(&u);
    }
    double sumsq = 0.0;
    be_d2h(m->be, &sumsq, d.sumsq.p, sizeof sumsq);
    if (be_check(m->be, err))
        return err->code;
    *gnorm = sqrt(sumsq);
    return 0;
}

int model_evaluate(model_t *m, const model_batch *b, double *loss_sum, sp_err *err)
{
    step_ctx c = {m, b, b->B * b->T, 0};
    if (stage(&c, err))
        return err->code;
    model_graph_forward(&c);
    model_graph_head(&c, 0);
    add_loss(&c);
    if (be_check(m->be, err))
        return err->code;
    return take(m, 0, loss_sum, err);
}

int model_forward_logits(model_t *m, const model_batch *b, float *logits, sp_err *err)
{
    step_ctx c = {m, b, b->B * b->T, 0};
    model_scratch *s = MODEL_SCRATCH(m);
    int H = (int)m->mc.hidden, V = (int)m->mc.vocab;
    if (stage(&c, err))
        return err->code;
    model_graph_forward(&c);
    be_rmsnorm_forward(m->be, s->hf, s->rstd_f, s->x_final, m->final_norm->w, c.rows, H,
                       (float)m->mc.rms_eps);
    for (int r0 = 0; r0 < c.rows; r0 += (int)s->chunk_rows) {
        int cr = c.rows - r0 < (int)s->chunk_rows ? c.rows - r0 : (int)s->chunk_rows;
        tensor_t out = tensor_view(s->logits, 0, (size_t)cr * (size_t)V);
        be_matmul(m->be, out, tensor_view(s->hf, (size_t)r0 * H, (size_t)cr * H),
                  m->lm_head->w, cr, V, H, 0, 1, 1.0f, 0.0f);
        be_download(m->be, logits + (size_t)r0 * V, DT_F32, out);
    }
    return be_check(m->be, err);
}
