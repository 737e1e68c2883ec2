/* Launch traces and captured spans (the API in backend.h): the digest the
 * checked ops feed (backend_trace.h, BE_DISPATCH), the barriers, and the
 * graphs: CUDA's own where the backend has them, else the recorded op list,
 * replayed here with the arguments it was recorded with. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_trace.h"

static uint64_t mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static void word(backend_t *be, uint64_t w)
{
    be_trace *t = be->trace;
    t->digest = mix(t->digest ^ w);
    if (!t->record || t->nwords == SIZE_MAX)
        return;
    if (t->nwords == t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 4096;
        uint64_t *p = realloc(t->words, cap * sizeof *p);
        if (!p) { /* the recording is unusable; graph_end says so */
            t->nwords = SIZE_MAX;
            return;
        }
        t->words = p;
        t->cap = cap;
    }
    t->words[t->nwords++] = w;
}

void be_trace_start(backend_t *be, be_trace *t, int dry)
{
    memset(t, 0, sizeof *t);
    t->dry = dry;
    t->digest = 0x5370746e65ULL;
    be->trace = t;
}

void be_trace_stop(backend_t *be)
{
    be->trace = NULL;
}

void be_trace_op(backend_t *be, int op)
{
    be->trace->ops++;
    word(be, 0xfeed000000000000ULL | (uint64_t)op);
}

void be_trace_tensor(backend_t *be, tensor_t t)
{
    word(be, (uint64_t)(uintptr_t)t.p);
    word(be, (uint64_t)t.n);
    word(be, (uint64_t)t.dt);
}

void be_trace_int(backend_t *be, int v)
{
    word(be, (uint64_t)(int64_t)v);
}

void be_trace_float(backend_t *be, float v)
{
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    word(be, b);
}

void be_trace_u64(backend_t *be, unsigned long v)
{
    word(be, (uint64_t)v);
}

void be_trace_u64ll(backend_t *be, unsigned long long v)
{
    word(be, (uint64_t)v);
}

void be_trace_adamw(backend_t *be, const adamw_args *a)
{
    be_trace_float(be, a->lr);
    be_trace_float(be, a->beta1);
    be_trace_float(be, a->beta2);
    be_trace_float(be, a->eps);
    be_trace_float(be, a->weight_decay);
    be_trace_float(be, a->grad_scale);
    word(be, (uint64_t)a->step);
    be_trace_tensor(be, a->hyper);
    be_trace_tensor(be, a->sumsq);
    uint64_t b;
    memcpy(&b, &a->max_norm, sizeof b);
    word(be, b);
}

int be_trace_runs(backend_t *be)
{
    return !be->trace->dry;
}

int be_trace_barrier(backend_t *be, const char *what, const char *file, int line)
{
    be_trace *t = be->trace;
    if (!t)
        return 1;
    if (t->barriers++ == 0) {
        if (file)
            snprintf(t->first_barrier, sizeof t->first_barrier, "%s at %s:%d", what, file, line);
        else
            snprintf(t->first_barrier, sizeof t->first_barrier, "%s", what);
    }
    return !t->dry;
}

/* ---- the recorded op list, replayed -------------------------------------------- */

typedef struct reader {
    const uint64_t *w;
    size_t i, n;
} reader;

static uint64_t rw(reader *r)
{
    return r->i < r->n ? r->w[r->i++] : 0;
}

static tensor_t rt(reader *r)
{
    tensor_t t;
    t.p = (void *)(uintptr_t)rw(r);
    t.n = (size_t)rw(r);
    t.dt = (dtype_t)rw(r);
    return t;
}

static int ri(reader *r)
{
    return (int)(int64_t)rw(r);
}

static float rf(reader *r)
{
    uint32_t b = (uint32_t)rw(r);
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* Runs one recorded op (its id read); -1 when the list is malformed. The
 * arguments are read into locals in the op's order first (the order in
 * which a call's arguments are evaluated is unspecified). */
static int replay_one(backend_t *be, reader *r)
{
    uint64_t id = rw(r);
    if ((id >> 48) != 0xfeed)
        return -1;
    const backend_ops *o = be->ops;
    switch ((int)(id & 0xffff)) {
    case OP_zero: {
        tensor_t t = rt(r);
        o->zero(be, t);
        return 0;
    }
    case OP_copy: {
        tensor_t d = rt(r), s = rt(r);
        o->copy(be, d, s);
        return 0;
    }
    case OP_copy2d: {
        tensor_t d = rt(r), s = rt(r);
        int rows = ri(r), cols = ri(r), dl = ri(r), sl = ri(r);
        o->copy2d(be, d, s, rows, cols, dl, sl);
        return 0;
    }
    case OP_matmul: {
        tensor_t C = rt(r), A = rt(r), B = rt(r);
        int M = ri(r), N = ri(r), K = ri(r), ta = ri(r), tb = ri(r);
        float al = rf(r), bt = rf(r);
        int lda = ri(r), ldb = ri(r), ldc = ri(r);
        o->matmul(be, C, A, B, M, N, K, ta, tb, al, bt, lda, ldb, ldc);
        return 0;
    }
    case OP_matmul_batched: {
        tensor_t C = rt(r), A = rt(r), B = rt(r);
        int M = ri(r), N = ri(r), K = ri(r), ta = ri(r), tb = ri(r);
        float al = rf(r), bt = rf(r);
        int lda = ri(r), ldb = ri(r), ldc = ri(r), batch = ri(r);
        unsigned long sa = (unsigned long)rw(r), sb = (unsigned long)rw(r);
        unsigned long sc = (unsigned long)rw(r);
        o->matmul_batched(be, C, A, B, M, N, K, ta, tb, al, bt, lda, ldb, ldc, batch, sa, sb, sc);
        return 0;
    }
    case OP_matmul_cd: {
        tensor_t D = rt(r), C = rt(r), A = rt(r), B = rt(r);
        int M = ri(r), N = ri(r), K = ri(r), ta = ri(r), tb = ri(r);
        float al = rf(r), bt = rf(r);
        o->matmul_cd(be, D, C, A, B, M, N, K, ta, tb, al, bt);
        return 0;
    }
    case OP_rmsnorm_forward: {
        tensor_t out = rt(r), rstd = rt(r), x = rt(r), w = rt(r);
        int rows = ri(r), cols = ri(r);
        float eps = rf(r);
        o->rmsnorm_forward(be, out, rstd, x, w, rows, cols, eps);
        return 0;
    }
    case OP_rmsnorm_backward: {
        tensor_t dx = rt(r), dw = rt(r), dout = rt(r), x = rt(r), w = rt(r), rstd = rt(r);
        int rows = ri(r), cols = ri(r);
        o->rmsnorm_backward(be, dx, dw, dout, x, w, rstd, rows, cols);
        return 0;
    }
    case OP_rope: {
        tensor_t x = rt(r), src = rt(r), cs = rt(r), sn = rt(r), pos = rt(r);
        int B = ri(r), T = ri(r), nh = ri(r), hd = ri(r), inv = ri(r), xl = ri(r), sl = ri(r);
        o->rope(be, x, src, cs, sn, pos, B, T, nh, hd, inv, xl, sl);
        return 0;
    }
    case OP_attention_forward: {
        tensor_t out = rt(r), lse = rt(r), q = rt(r), k = rt(r), v = rt(r), seg = rt(r);
        int B = ri(r), T = ri(r), nh = ri(r), nkv = ri(r), hd = ri(r), ql = ri(r), kl = ri(r);
        o->attention_forward(be, out, lse, q, k, v, seg, B, T, nh, nkv, hd, ql, kl);
        return 0;
    }
    case OP_attention_backward: {
        tensor_t dq = rt(r), dk = rt(r), dv = rt(r), dout = rt(r), out = rt(r), lse = rt(r);
        tensor_t q = rt(r), k = rt(r), v = rt(r), seg = rt(r);
        int B = ri(r), T = ri(r), nh = ri(r), nkv = ri(r), hd = ri(r), ql = ri(r), kl = ri(r);
        int dql = ri(r), dkl = ri(r);
        o->attention_backward(be, dq, dk, dv, dout, out, lse, q, k, v, seg, B, T, nh, nkv, hd, ql,
                              kl, dql, dkl);
        return 0;
    }
    case OP_swiglu_forward: {
        tensor_t out = rt(r), g = rt(r), u = rt(r);
        int rows = ri(r), cols = ri(r), ld = ri(r);
        o->swiglu_forward(be, out, g, u, rows, cols, ld);
        return 0;
    }
    case OP_swiglu_backward: {
        tensor_t dg = rt(r), du = rt(r), dout = rt(r), g = rt(r), u = rt(r);
        int rows = ri(r), cols = ri(r), ld = ri(r);
        o->swiglu_backward(be, dg, du, dout, g, u, rows, cols, ld);
        return 0;
    }
    case OP_embedding_forward: {
        tensor_t out = rt(r), table = rt(r), tok = rt(r);
        int n = ri(r), H = ri(r);
        o->embedding_forward(be, out, table, tok, n, H);
        return 0;
    }
    case OP_embedding_backward: {
        tensor_t dt = rt(r), dout = rt(r), tok = rt(r), ord = rt(r), runs = rt(r);
        int n = ri(r), H = ri(r);
        o->embedding_backward(be, dt, dout, tok, ord, runs, n, H);
        return 0;
    }
    case OP_cross_entropy: {
        tensor_t lg = rt(r), loss = rt(r), tg = rt(r);
        int rows = ri(r), V = ri(r);
        float gs = rf(r);
        tensor_t sc = rt(r);
        o->cross_entropy(be, lg, loss, tg, rows, V, gs, sc);
        return 0;
    }
    case OP_add: {
        tensor_t y = rt(r), x = rt(r);
        float al = rf(r);
        size_t n = (size_t)rw(r);
        o->add(be, y, x, al, n);
        return 0;
    }
    case OP_add_bias: {
        tensor_t y = rt(r), b = rt(r);
        int rows = ri(r), cols = ri(r);
        o->add_bias(be, y, b, rows, cols);
        return 0;
    }
    case OP_bias_backward: {
        tensor_t db = rt(r), dy = rt(r);
        int rows = ri(r), cols = ri(r);
        o->bias_backward(be, db, dy, rows, cols);
        return 0;
    }
    case OP_weight_norm: {
        tensor_t n = rt(r), W = rt(r), A = rt(r), B = rt(r);
        float sc = rf(r);
        int out = ri(r), in = ri(r), rk = ri(r);
        o->weight_norm(be, n, W, A, B, sc, out, in, rk);
        return 0;
    }
    case OP_col_scale: {
        tensor_t y = rt(r), num = rt(r), den = rt(r);
        int rows = ri(r), cols = ri(r);
        o->col_scale(be, y, num, den, rows, cols);
        return 0;
    }
    case OP_col_dot: {
        tensor_t out = rt(r), x = rt(r), y = rt(r), den = rt(r);
        int rows = ri(r), cols = ri(r);
        o->col_dot(be, out, x, y, den, rows, cols);
        return 0;
    }
    case OP_dequant_nf4: {
        tensor_t out = rt(r), codes = rt(r), am = rt(r), nest = rt(r), maps = rt(r);
        float off = rf(r);
        size_t n = (size_t)rw(r);
        o->dequant_nf4(be, out, codes, am, nest, maps, off, n);
        return 0;
    }
    case OP_quantize_nf4: {
        tensor_t codes = rt(r), am = rt(r), x = rt(r), maps = rt(r);
        size_t n = (size_t)rw(r);
        o->quantize_nf4(be, codes, am, x, maps, n);
        return 0;
    }
    case OP_dropout: {
        tensor_t out = rt(r), in = rt(r);
        size_t n = (size_t)rw(r);
        float p = rf(r);
        uint64_t seed = rw(r);
        tensor_t sd = rt(r);
        uint64_t off = rw(r);
        o->dropout(be, out, in, n, p, seed, sd, off);
        return 0;
    }
    case OP_adamw: {
        tensor_t p = rt(r), pc = rt(r), g = rt(r), m = rt(r), v = rt(r);
        size_t n = (size_t)rw(r);
        adamw_args a;
        a.lr = rf(r);
        a.beta1 = rf(r);
        a.beta2 = rf(r);
        a.eps = rf(r);
        a.weight_decay = rf(r);
        a.grad_scale = rf(r);
        a.step = (int64_t)rw(r);
        a.hyper = rt(r);
        a.sumsq = rt(r);
        uint64_t b = rw(r);
        memcpy(&a.max_norm, &b, sizeof b);
        o->adamw(be, p, pc, g, m, v, n, &a);
        return 0;
    }
    case OP_sumsq_into: {
        tensor_t out = rt(r), x = rt(r);
        size_t n = (size_t)rw(r);
        o->sumsq_into(be, out, x, n);
        return 0;
    }
    case OP_sum_add: {
        tensor_t acc = rt(r), x = rt(r);
        size_t n = (size_t)rw(r);
        o->sum_add(be, acc, x, n);
        return 0;
    }
    case OP_fill_uniform:
    case OP_fill_normal: {
        tensor_t x = rt(r);
        size_t n = (size_t)rw(r);
        float a = rf(r), b = rf(r);
        uint64_t seed = rw(r), off = rw(r);
        if ((id & 0xffff) == OP_fill_uniform)
            o->fill_uniform(be, x, n, a, b, seed, off);
        else
            o->fill_normal(be, x, n, a, b, seed, off);
        return 0;
    }
    default:
        return -1;
    }
}

/* ---- captured spans -------------------------------------------------------------- */

int be_graph_begin(backend_t *be)
{
    if (be->err.code)
        return -1;
    if (be->trace) {
        be_fail(be, __FILE__, __LINE__, "be_graph_begin: a trace is already being taken");
        return -1;
    }
    be_trace *t = malloc(sizeof *t);
    if (!t) {
        be_fail(be, __FILE__, __LINE__, "be_graph_begin: out of host memory");
        return -1;
    }
    int native = be->ops->graph_begin != NULL;
    if (native && be->ops->graph_begin(be)) {
        free(t);
        return -1;
    }
    /* CUDA: the ops run, into the capture; elsewhere they are recorded */
    be_trace_start(be, t, !native);
    t->record = !native;
    return 0;
}

be_graph *be_graph_end(backend_t *be, char *why, size_t n)
{
    be_trace *t = be->trace;
    if (!t) {
        snprintf(why, n, "no capture was begun");
        return NULL;
    }
    be_trace_stop(be);
    void *exec = NULL;
    char dev_why[256] = "";
    if (be->ops->graph_begin) {
        exec = be->ops->graph_end(be, dev_why, sizeof dev_why); /* always ends the capture */
        if (!exec && !t->barriers) {
            snprintf(why, n, "%s", dev_why);
            free(t);
            return NULL;
        }
    }
    if (be->graph_refuse && !t->barriers) {
        if (exec)
            be->ops->graph_free(be, exec);
        snprintf(why, n, "%s", be->graph_refuse);
        free(t->words);
        free(t);
        return NULL;
    }
    be_graph *g = NULL;
    if (t->barriers) /* named by the call, before what the device said of it */
        snprintf(why, n, "%zu call(s) a graph cannot hold, the first: %s%s%s%s", t->barriers,
                 t->first_barrier, dev_why[0] ? " (the device: " : "", dev_why,
                 dev_why[0] ? ")" : "");
    else if (t->record && t->nwords == SIZE_MAX)
        snprintf(why, n, "out of host memory recording %zu ops", t->ops);
    else if (!(g = calloc(1, sizeof *g)))
        snprintf(why, n, "out of host memory");
    if (!g) {
        if (exec)
            be->ops->graph_free(be, exec);
        free(t->words);
        free(t);
        return NULL;
    }
    g->digest = t->digest;
    g->ops = t->ops;
    g->exec = exec;
    g->words = t->words;
    g->nwords = t->nwords;
    free(t);
    return g;
}

int be_graph_launch(backend_t *be, be_graph *g)
{
    if (be->err.code)
        return -1;
    if (g->exec)
        return be->ops->graph_launch(be, g->exec);
    reader r = {g->words, 0, g->nwords};
    while (r.i < r.n && !be->err.code)
        if (replay_one(be, &r)) {
            be_fail(be, __FILE__, __LINE__, "a recorded op list is malformed at word %zu",
                    r.i);
            return -1;
        }
    return be->err.code ? -1 : 0;
}

void be_graph_free(backend_t *be, be_graph *g)
{
    if (!g)
        return;
    if (g->exec)
        be->ops->graph_free(be, g->exec);
    free(g->words);
    free(g);
}
