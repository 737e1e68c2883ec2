/* Training with captured micro-batches (model_opts.graphs) against the same
 * training without, on one backend (tests/graphs_util.h). */
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

#define NB 2
#define NT 24
#define GA 2
#define STEPS 5

typedef struct run_out {
    float *params;
    size_t n;
    double loss[STEPS], gnorm[STEPS];
    model_graph_count mb, upd;
    char off[320];
} run_out;

/* The update with one gradient element NaN: the norm it gives is NaN, and
 * the weights, moments and compute copy are as they were. */
static void nan_update(model_t *m, const adamw_args *a, double *gnorm)
{
    backend_t *be = m->be;
    sp_err err = {0};
    tensor_t state[] = {m->master, m->adam_m, m->adam_v};
    float *before[3], *after[3];
    size_t n = m->n_trainable;
    for (int i = 0; i < 3; i++) {
        before[i] = malloc(sizeof(float) * n), after[i] = malloc(sizeof(float) * n);
        be_download(be, before[i], DT_F32, tensor_view(state[i], 0, n));
    }
    float nan = NAN;
    be_h2d(be, (float *)m->grad.p + n / 2, &nan, sizeof nan);
    cr_assert_eq(model_update(m, a, 0.05, gnorm, &err), 0, "%s", err.msg);
    cr_assert(isnan(*gnorm), "a NaN gradient gave the norm %g", *gnorm);
    const char *names[] = {"weights", "first moments", "second moments"};
    for (int i = 0; i < 3; i++) {
        be_download(be, after[i], DT_F32, tensor_view(state[i], 0, n));
        cr_assert_eq(memcmp(before[i], after[i], sizeof(float) * n), 0,
                     "a NaN gradient changed the %s", names[i]);
        free(before[i]), free(after[i]);
    }
}

/* refuse: every capture refused with this reason (backend_t.graph_refuse) */
static void train(const char *backend, const graphs_case *rc, int graphs, const char *refuse,
                  run_out *out)
{
    backend_t *be;
    sp_err err = {0};
    cr_assert_eq(backend_create(&be, backend, 0, 2, &err), 0, "%s", err.msg);
    be->graph_refuse = refuse;
    model_config_t mc;
    cr_assert_eq(model_config_preset(&mc, "tiny"), 0);
    mc.layers = 2;
    model_opts o = {.mode = rc->mode, .lora_r = 4, .lora_alpha = 8, .lora_dropout = rc->dropout,
                    .lora_targets = (1 << PROJ_COUNT) - 1, .max_batch = NB, .seq_len = NT,
                    .recompute = rc->recompute, .seed = 11, .graphs = graphs,
                    .dora = rc->dora, .nf4 = rc->nf4};
    model_t *m;
    cr_assert_eq(model_create(&m, be, &mc, &o, &err), 0, "%s", err.msg);
    model_init_base_random(m, 3);
    if (rc->mode == MODE_LORA)
        model_init_lora(m, 4);
    int32_t in[NB * NT], tg[NB * NT], pos[NB * NT], seg[NB * NT];
    uint64_t ids[NB];
    for (int s = 0; s < STEPS; s++) {
        model_zero_grads(m);
        /* the step's trained tokens change with it: so does the loss scale */
        int ignored = s % 3, trained = GA * NB * NT - GA * ignored;
        double loss = 0;
        for (int k = 0; k < GA; k++) {
            int nb = rc->odd_last && s == 3 && k == GA - 1 ? 1 : NB;
            for (int i = 0; i < nb * NT; i++) {
                in[i] = (int32_t)(sp_rng_u64(100 + (uint64_t)(s * GA + k), (uint64_t)i) %
                                  (uint64_t)mc.vocab);
                tg[i] = i < ignored ? -1
                                    : (int32_t)(sp_rng_u64(200 + (uint64_t)(s * GA + k),
                                                           (uint64_t)i) %
                                                (uint64_t)mc.vocab);
                int t = i % NT, start = t < 5 + s ? 0 : 5 + s; /* documents move every step */
                pos[i] = t - start;
                seg[i] = start;
            }
            if (nb < NB)
                trained -= (NB - nb) * NT;
            for (int w = 0; w < nb; w++)
                ids[w] = (uint64_t)((s * GA + k) * NB + w);
            model_batch b = {.inputs = in, .targets = tg, .sample_ids = ids, .B = nb, .T = NT,
                             .grad_scale = 1.0f / (float)(GA * NB * NT - GA * ignored),
                             .last = k == GA - 1, .pos = rc->packed ? pos : NULL,
                             .seg = rc->packed ? seg : NULL};
            cr_assert_eq(model_forward_backward(m, &b, &loss, &err), 0, "%s", err.msg);
        }
        out->loss[s] = loss / trained;
        /* the learning rate changes every step too; the clip bound is
         * below the norms */
        adamw_args a = {.lr = 1e-2f / (float)(s + 1), .beta1 = 0.9f, .beta2 = 0.999f,
                        .eps = 1e-8f, .weight_decay = 0.01f, .step = s + 1};
        if (s + 1 == rc->nan_step) {
            nan_update(m, &a, &out->gnorm[s]);
            continue;
        }
        cr_assert_eq(model_update(m, &a, 0.05, &out->gnorm[s], &err), 0, "%s", err.msg);
        cr_assert(isfinite(out->gnorm[s]) && out->gnorm[s] > 0.05, "step %d: grad norm %g",
                  s + 1, out->gnorm[s]);
        if (rc->eval_between) {
            for (int i = 0; i < NB * NT; i++)
                in[i] = tg[i] = (int32_t)((7 * i + s) % mc.vocab);
            model_batch e = {.inputs = in, .targets = tg, .sample_ids = ids, .B = NB, .T = NT};
            double eval_loss = 0;
            cr_assert_eq(model_evaluate(m, &e, &eval_loss, &err), 0, "%s", err.msg);
            const param_t *w = m->layers[mc.layers - 1].w[PROJ_DOWN];
            float *h = malloc(sizeof(float) * w->n);
            cr_assert(h);
            model_param_download(m, w, h);
            free(h);
        }
    }
    out->n = m->n_trainable;
    out->params = malloc(sizeof(float) * out->n);
    be_download(be, out->params, DT_F32, tensor_view(m->master, 0, out->n));
    out->mb = m->graph_mb;
    out->upd = m->graph_upd;
    snprintf(out->off, sizeof out->off, "%s", m->graph_off);
    model_destroy(m);
    backend_destroy(be);
}

static void same_run(const run_out *e, const run_out *g, const char *what)
{
    for (int s = 0; s < STEPS; s++) {
        cr_assert(e->loss[s] == g->loss[s], "%s: step %d loss %.9g eager, %.9g with graphs", what,
                  s + 1, e->loss[s], g->loss[s]);
        if (isnan(e->gnorm[s]) && isnan(g->gnorm[s]))
            continue; /* the step whose gradient was NaN */
        cr_assert(e->gnorm[s] == g->gnorm[s], "%s: step %d grad norm %.9g eager, %.9g with graphs",
                  what, s + 1, e->gnorm[s], g->gnorm[s]);
    }
    cr_assert_eq(e->n, g->n);
    for (size_t i = 0; i < e->n; i++)
        cr_assert(memcmp(&e->params[i], &g->params[i], sizeof(float)) == 0,
                  "%s: parameter %zu is %.9g eager, %.9g with graphs", what, i,
                  (double)e->params[i], (double)g->params[i]);
}

void graphs_same_as_eager(const char *backend, const graphs_case *rc, const char *what)
{
    run_out e = {0}, g = {0};
    train(backend, rc, 0, NULL, &e);
    train(backend, rc, 1, NULL, &g);
    cr_assert_str_empty(g.off, "%s: graphs turned off: %s", what, g.off);
    same_run(&e, &g, what);
    /* the usual shape: eager once, captured on the second, replayed after;
     * the odd one: eager the one time it comes */
    size_t total = STEPS * GA, odd = rc->odd_last ? 1 : 0;
    cr_assert_eq(g.mb.captures, 1, "%s: %zu captures", what, g.mb.captures);
    cr_assert_eq(g.mb.eager, 1 + odd, "%s: %zu eager micro-batches", what, g.mb.eager);
    cr_assert_eq(g.mb.replays, total - 1 - odd, "%s: %zu of %zu micro-batches replayed", what,
                 g.mb.replays, total);
    /* the update: the same launches every step (its values in memory) */
    cr_assert_eq(g.upd.captures, 1, "%s: %zu update captures", what, g.upd.captures);
    cr_assert_eq(g.upd.eager, 1, "%s: %zu eager updates", what, g.upd.eager);
    cr_assert_eq(g.upd.replays, STEPS - 1, "%s: %zu of %d updates replayed", what,
                 g.upd.replays, STEPS);
    cr_assert_eq(e.mb.replays + e.mb.captures + e.mb.eager + e.upd.replays + e.upd.captures +
                     e.upd.eager,
                 0, "graphs off, yet counted");
    free(e.params);
    free(g.params);
}


void graphs_refused_run_eagerly(const char *backend, const graphs_case *rc, const char *what)
{
    run_out e = {0}, g = {0};
    const char *reason = "the device refused (a test's reason)";
    train(backend, rc, 0, NULL, &e);
    train(backend, rc, 1, reason, &g);
    char want[200];
    snprintf(want, sizeof want, "capture failed: %s", reason);
    cr_assert_str_eq(g.off, want, "%s: why graphs are off", what);
    same_run(&e, &g, what);
    /* the first micro-batch eager, the second's capture refused and run
     * eagerly; then graphs are off: nothing more counted, the update never
     * captured */
    cr_assert_eq(g.mb.eager, 2, "%s: %zu eager micro-batches", what, g.mb.eager);
    cr_assert_eq(g.mb.captures + g.mb.replays + g.upd.captures + g.upd.replays + g.upd.eager, 0,
                 "%s: graphs counted after they were turned off", what);
    free(e.params);
    free(g.params);
}

void graphs_run_twice_the_same(const char *backend, const graphs_case *rc, const char *what)
{
    run_out a = {0}, b = {0};
    train(backend, rc, 0, NULL, &a);
    train(backend, rc, 0, NULL, &b);
    same_run(&a, &b, what);
    free(a.params);
    free(b.params);
}
