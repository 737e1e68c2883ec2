/* Each CPU op (fast path and reference path): forward against a
 * double-precision reference written here from the definitions, backward
 * against central finite differences of that double reference.
 * Tolerances: forward 1e-5 relative to the largest output (f32 storage
 * with double accumulation); backward 1e-4 relative to the largest gradient
 * (the difference quotient in double has error ~1e-9). */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/nf4.h"
#include "op_checks.h"

static backend_t *be;
static tensor_t owned[256]; /* every tensor a test allocates, freed by teardown */
static int nowned;

static void setup(void)
{
    sp_err err = {0};
    cr_assert_eq(backend_create(&be, "cpu", 2, 2, &err), 0, "%s", err.msg);
}

static void teardown(void)
{
    for (int i = 0; i < nowned; i++)
        be_free(be, &owned[i]);
    backend_destroy(be);
}

static tensor_t talloc(dtype_t dt, size_t n)
{
    tensor_t t = be_alloc(be, dt, n);
    cr_assert(t.p && nowned < 256);
    owned[nowned++] = t;
    return t;
}

TestSuite(ops, .init = setup, .fini = teardown);

static tensor_t no_tensor(void)
{
    tensor_t t = {0};
    return t;
}

static uint64_t g_seed = 42;

static float *rnd(size_t n, float scale)
{
    float *x = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++)
        x[i] = scale * (2.0f * sp_rng_uniform(g_seed, i) - 1.0f);
    g_seed++;
    return x;
}

static tensor_t dev(const float *host, size_t n)
{
    tensor_t t = talloc(DT_F32, n);
    if (host)
        be_upload(be, t, host, DT_F32);
    return t;
}

static float *host(tensor_t t)
{
    float *h = malloc(sizeof(float) * t.n);
    be_download(be, h, DT_F32, t);
    return h;
}

static double max_abs_d(const double *x, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++)
        if (fabs(x[i]) > m)
            m = fabs(x[i]);
    return m;
}

/* max |got - want| / max |want| */
static double rel_err(const float *got, const double *want, size_t n)
{
    double m = max_abs_d(want, n), e = 0;
    for (size_t i = 0; i < n; i++)
        if (fabs(got[i] - want[i]) > e)
            e = fabs(got[i] - want[i]);
    return m > 0 ? e / m : e;
}

#define FWD_TOL 1e-5
#define BWD_TOL 1e-4

/* ---- matmul ---------------------------------------------------------------- */

static void check_matmul(const char *kind, int M, int N, int K, int ta, int tb, float alpha,
                         float beta)
{
    backend_t *b2;
    sp_err err = {0};
    cr_assert_eq(backend_create(&b2, kind, 0, 2, &err), 0);
    float *A = rnd((size_t)M * K, 1), *B = rnd((size_t)K * N, 1), *C = rnd((size_t)M * N, 1);
    double *want = malloc(sizeof(double) * M * N);
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double acc = 0;
            for (int k = 0; k < K; k++)
                acc += (double)(ta ? A[k * M + i] : A[i * K + k]) *
                       (tb ? B[j * K + k] : B[k * N + j]);
            want[i * N + j] = alpha * acc + beta * C[i * N + j];
        }
    tensor_t tA = be_alloc(b2, DT_F32, (size_t)M * K), tB = be_alloc(b2, DT_F32, (size_t)K * N),
             tC = be_alloc(b2, DT_F32, (size_t)M * N);
    be_upload(b2, tA, A, DT_F32);
    be_upload(b2, tB, B, DT_F32);
    be_upload(b2, tC, C, DT_F32);
    be_matmul(b2, tC, tA, tB, M, N, K, ta, tb, alpha, beta);
    float *got = malloc(sizeof(float) * M * N);
    be_download(b2, got, DT_F32, tC);
    double e = rel_err(got, want, (size_t)M * N);
    cr_expect_lt(e, FWD_TOL, "%s matmul %dx%dx%d ta=%d tb=%d: rel err %g", kind, M, N, K, ta, tb, e);
    be_free(b2, &tA);
    be_free(b2, &tB);
    be_free(b2, &tC);
    backend_destroy(b2);
    free(A), free(B), free(C), free(want), free(got);
}

Test(ops, matmul_all_transposes_odd_sizes)
{
    const char *kinds[] = {"cpu", "cpu-ref"};
    for (int k = 0; k < 2; k++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                check_matmul(kinds[k], 7, 13, 5, ta, tb, 1.0f, 0.0f);
                check_matmul(kinds[k], 33, 17, 65, ta, tb, 0.5f, 1.0f);
            }
}

/* ---- RMSNorm ----------------------------------------------------------------- */

static void rmsnorm_ref(double *out, const double *x, const double *w, int rows, int cols,
                        double eps)
{
    for (int r = 0; r < rows; r++) {
        double ss = 0;
        for (int c = 0; c < cols; c++)
            ss += x[r * cols + c] * x[r * cols + c];
        double s = 1.0 / sqrt(ss / cols + eps);
        for (int c = 0; c < cols; c++)
            out[r * cols + c] = w[c] * x[r * cols + c] * s;
    }
}

static double *to_d(const float *f, size_t n)
{
    double *d = malloc(sizeof(double) * n);
    for (size_t i = 0; i < n; i++)
        d[i] = f[i];
    return d;
}

/* <R, f(x)> in double, for finite differences */
static double dot_d(const double *a, const float *R, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += a[i] * R[i];
    return s;
}

Test(ops, rmsnorm_forward_backward)
{
    int rows = 5, cols = 37;
    size_t n = (size_t)rows * cols;
    float *x = rnd(n, 2), *w = rnd((size_t)cols, 1), *R = rnd(n, 1);
    double eps = 1e-5;
    tensor_t tx = dev(x, n), tw = dev(w, (size_t)cols), to = dev(NULL, n), tr = dev(NULL, (size_t)rows);
    be_rmsnorm_forward(be, to, tr, tx, tw, rows, cols, (float)eps);
    double *xd = to_d(x, n), *wd = to_d(w, (size_t)cols), *want = malloc(sizeof(double) * n);
    rmsnorm_ref(want, xd, wd, rows, cols, eps);
    float *got = host(to);
    cr_expect_lt(rel_err(got, want, n), FWD_TOL);
    /* backward with dout = R; dx accumulates onto a non-zero start */
    float *dx0 = rnd(n, 1);
    tensor_t tdo = dev(R, n), tdx = dev(dx0, n), tdw = dev(NULL, (size_t)cols);
    be_rmsnorm_backward(be, tdx, tdw, tdo, tx, tw, tr, rows, cols);
    float *dx = host(tdx), *dw = host(tdw);
    double *fdx = malloc(sizeof(double) * n), *fdw = malloc(sizeof(double) * cols);
    double h = 1e-6, *tmp = malloc(sizeof(double) * n);
    for (size_t i = 0; i < n; i++) {
        double keep = xd[i];
        xd[i] = keep + h;
        rmsnorm_ref(tmp, xd, wd, rows, cols, eps);
        double lp = dot_d(tmp, R, n);
        xd[i] = keep - h;
        rmsnorm_ref(tmp, xd, wd, rows, cols, eps);
        double lm = dot_d(tmp, R, n);
        xd[i] = keep;
        fdx[i] = (lp - lm) / (2 * h) + dx0[i];
    }
    for (int c = 0; c < cols; c++) {
        double keep = wd[c];
        wd[c] = keep + h;
        rmsnorm_ref(tmp, xd, wd, rows, cols, eps);
        double lp = dot_d(tmp, R, n);
        wd[c] = keep - h;
        rmsnorm_ref(tmp, xd, wd, rows, cols, eps);
        double lm = dot_d(tmp, R, n);
        wd[c] = keep;
        fdw[c] = (lp - lm) / (2 * h);
    }
    cr_expect_lt(rel_err(dx, fdx, n), BWD_TOL, "dx rel err %g", rel_err(dx, fdx, n));
    cr_expect_lt(rel_err(dw, fdw, (size_t)cols), BWD_TOL, "dw rel err %g", rel_err(dw, fdw, (size_t)cols));
    free(x), free(w), free(R), free(xd), free(wd), free(want), free(got), free(dx0), free(dx), free(dw);
    free(fdx), free(fdw), free(tmp);
}

/* ---- RoPE ---------------------------------------------------------------------- */

/* pos: the position of each token (NULL: t) */
static void rope_ref(double *out, const double *x, const float *cs, const float *sn,
                     const int32_t *pos, int B, int T, int nh, int hd)
{
    int half = hd / 2;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < nh; h++) {
                size_t o = (((size_t)b * T + t) * nh + h) * hd;
                int p = pos ? pos[b * T + t] : t;
                for (int i = 0; i < half; i++) {
                    double c = cs[p * half + i], s = sn[p * half + i];
                    out[o + i] = x[o + i] * c - x[o + i + half] * s;
                    out[o + i + half] = x[o + i + half] * c + x[o + i] * s;
                }
            }
}

/* cos and sin [T, hd/2] of theta 1e4 */
static void rope_tables(float *cs, float *sn, int T, int hd)
{
    int half = hd / 2;
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            double a = t * pow(10000.0, -2.0 * i / hd);
            cs[t * half + i] = (float)cos(a);
            sn[t * half + i] = (float)sin(a);
        }
}

Test(ops, rope_forward_and_inverse)
{
    int B = 2, T = 7, nh = 3, hd = 8, half = hd / 2;
    size_t n = (size_t)B * T * nh * hd;
    float *x = rnd(n, 1), *cs = malloc(sizeof(float) * T * half), *sn = malloc(sizeof(float) * T * half);
    rope_tables(cs, sn, T, hd);
    tensor_t tx = dev(x, n), tc = dev(cs, (size_t)T * half), ts = dev(sn, (size_t)T * half);
    be_rope(be, tx, tc, ts, no_tensor(), B, T, nh, hd, 0);
    double *xd = to_d(x, n), *want = malloc(sizeof(double) * n);
    rope_ref(want, xd, cs, sn, NULL, B, T, nh, hd);
    float *got = host(tx);
    cr_expect_lt(rel_err(got, want, n), FWD_TOL);
    /* the inverse is the transpose: <R, rope(x)> = <rope^T(R), x> */
    float *R = rnd(n, 1);
    tensor_t tR = dev(R, n);
    be_rope(be, tR, tc, ts, no_tensor(), B, T, nh, hd, 1);
    float *rt = host(tR);
    double lhs = dot_d(want, R, n), rhs = 0;
    for (size_t i = 0; i < n; i++)
        rhs += (double)rt[i] * x[i];
    cr_expect_lt(fabs(lhs - rhs), 1e-4 * (fabs(lhs) + 1));
    /* and by finite differences of L(x) = <R, rope(x)> on the op itself:
     * dL/dx_i = rope^T(R)_i (central differences, h = 1e-2: L is linear, so
     * only float rounding separates them) */
    for (int probe = 0; probe < 12; probe++) {
        size_t i = (size_t)(sp_rng_u64(77, (uint64_t)probe) % n);
        double L[2];
        for (int sgn = 0; sgn < 2; sgn++) {
            float *xp = malloc(sizeof(float) * n);
            memcpy(xp, x, sizeof(float) * n);
            xp[i] += sgn ? -1e-2f : 1e-2f;
            tensor_t tp = dev(xp, n);
            be_rope(be, tp, tc, ts, no_tensor(), B, T, nh, hd, 0);
            float *yp = host(tp);
            L[sgn] = 0;
            for (size_t k = 0; k < n; k++)
                L[sgn] += (double)R[k] * yp[k];
            free(xp), free(yp);
        }
        double fd = (L[0] - L[1]) / (2 * (double)1e-2f);
        cr_expect_lt(fabs(fd - rt[i]), 2e-3 * (fabs(rt[i]) + 1), "x[%zu]: fd %g, backward %g", i,
                     fd, (double)rt[i]);
    }
    free(x), free(cs), free(sn), free(xd), free(want), free(got), free(R), free(rt);
}

/* ---- attention --------------------------------------------------------------- */

/* seg: the first key each query attends to (NULL: 0) */
static void attn_ref(double *out, const double *q, const double *k, const double *v,
                     const int32_t *seg, int B, int T, int nh, int nkv, int hd)
{
    int g = nh / nkv;
    double *p = malloc(sizeof(double) * T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < nh; h++)
            for (int t = 0; t < T; t++) {
                const double *qt = q + (((size_t)b * T + t) * nh + h) * hd;
                int lo = seg ? seg[b * T + t] : 0;
                double m = -1e300, l = 0;
                for (int j = lo; j <= t; j++) {
                    const double *kj = k + (((size_t)b * T + j) * nkv + h / g) * hd;
                    double s = 0;
                    for (int d = 0; d < hd; d++)
                        s += qt[d] * kj[d];
                    p[j] = s / sqrt((double)hd);
                    if (p[j] > m)
                        m = p[j];
                }
                for (int j = lo; j <= t; j++)
                    l += (p[j] = exp(p[j] - m));
                double *o = out + (((size_t)b * T + t) * nh + h) * hd;
                for (int d = 0; d < hd; d++) {
                    double acc = 0;
                    for (int j = lo; j <= t; j++)
                        acc += p[j] * v[(((size_t)b * T + j) * nkv + h / g) * hd + d];
                    o[d] = acc / l;
                }
            }
    free(p);
}

/* seg: packed documents ([B*T] first keys) or NULL */
static void check_attention_seg(int B, int T, int nh, int nkv, int hd, const int32_t *seg)
{
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd;
    float *q = rnd(nq, 1), *k = rnd(nk, 1), *v = rnd(nk, 1), *R = rnd(nq, 1);
    tensor_t tq = dev(q, nq), tk = dev(k, nk), tv = dev(v, nk), to = dev(NULL, nq),
             tl = dev(NULL, (size_t)B * nh * T), ts = no_tensor();
    if (seg) {
        ts = talloc(DT_I32, (size_t)B * T);
        be_upload(be, ts, seg, DT_I32);
    }
    be_attention_forward(be, to, tl, tq, tk, tv, ts, B, T, nh, nkv, hd);
    double *qd = to_d(q, nq), *kd = to_d(k, nk), *vd = to_d(v, nk), *want = malloc(sizeof(double) * nq);
    attn_ref(want, qd, kd, vd, seg, B, T, nh, nkv, hd);
    float *got = host(to);
    cr_expect_lt(rel_err(got, want, nq), FWD_TOL, "attention fwd %d %d %d %d %d", B, T, nh, nkv, hd);
    tensor_t tdo = dev(R, nq), tdq = dev(NULL, nq), tdk = dev(NULL, nk), tdv = dev(NULL, nk);
    be_attention_backward(be, tdq, tdk, tdv, tdo, to, tl, tq, tk, tv, ts, B, T, nh, nkv, hd);
    float *dq = host(tdq), *dk = host(tdk), *dv = host(tdv);
    double h = 1e-6, *tmp = malloc(sizeof(double) * nq);
    double *fd[3] = {malloc(sizeof(double) * nq), malloc(sizeof(double) * nk), malloc(sizeof(double) * nk)};
    double *xs[3] = {qd, kd, vd};
    size_t ns[3] = {nq, nk, nk};
    for (int which = 0; which < 3; which++)
        for (size_t i = 0; i < ns[which]; i++) {
            double keep = xs[which][i];
            xs[which][i] = keep + h;
            attn_ref(tmp, qd, kd, vd, seg, B, T, nh, nkv, hd);
            double lp = dot_d(tmp, R, nq);
            xs[which][i] = keep - h;
            attn_ref(tmp, qd, kd, vd, seg, B, T, nh, nkv, hd);
            double lm = dot_d(tmp, R, nq);
            xs[which][i] = keep;
            fd[which][i] = (lp - lm) / (2 * h);
        }
    cr_expect_lt(rel_err(dq, fd[0], nq), BWD_TOL, "dq %g", rel_err(dq, fd[0], nq));
    cr_expect_lt(rel_err(dk, fd[1], nk), BWD_TOL, "dk %g", rel_err(dk, fd[1], nk));
    cr_expect_lt(rel_err(dv, fd[2], nk), BWD_TOL, "dv %g", rel_err(dv, fd[2], nk));
    free(q), free(k), free(v), free(R), free(qd), free(kd), free(vd), free(want), free(got);
    free(dq), free(dk), free(dv), free(tmp), free(fd[0]), free(fd[1]), free(fd[2]);
}

static void check_attention(int B, int T, int nh, int nkv, int hd)
{
    check_attention_seg(B, T, nh, nkv, hd, NULL);
}

/* Rows of packed documents: row 0 holds documents of 3, 1 and 5 tokens,
 * row 1 one of 4 then 5 tokens (T = 9). */
static const int32_t packed_seg[18] = {0, 0, 0, 3, 4, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4, 4};

/* Packed rows: forward and backward against the reference restricted to
 * each document, and, independently of that reference, each document's
 * output equals attention over that document alone (no token sees
 * another document), on the fast and the reference path. */
static void check_packed_attention(void)
{
    int B = 2, T = 9, nh = 4, nkv = 2, hd = 4;
    check_attention_seg(B, T, nh, nkv, hd, packed_seg);
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd;
    float *q = rnd(nq, 1), *k = rnd(nk, 1), *v = rnd(nk, 1);
    tensor_t ts = talloc(DT_I32, (size_t)B * T), to = dev(NULL, nq),
             tl = dev(NULL, (size_t)B * nh * T);
    be_upload(be, ts, packed_seg, DT_I32);
    be_attention_forward(be, to, tl, dev(q, nq), dev(k, nk), dev(v, nk), ts, B, T, nh, nkv, hd);
    float *got = host(to);
    for (int b = 0; b < B; b++)
        for (int s0 = 0; s0 < T;) {
            int n = 1;
            while (s0 + n < T && packed_seg[b * T + s0 + n] == s0)
                n++;
            /* the document [s0, s0 + n) alone, as a batch of one row of n */
            size_t qo = ((size_t)b * T + s0) * nh * hd, ko = ((size_t)b * T + s0) * nkv * hd;
            tensor_t ao = dev(NULL, (size_t)n * nh * hd), al = dev(NULL, (size_t)nh * n);
            be_attention_forward(be, ao, al, dev(q + qo, (size_t)n * nh * hd),
                                 dev(k + ko, (size_t)n * nkv * hd), dev(v + ko, (size_t)n * nkv * hd),
                                 no_tensor(), 1, n, nh, nkv, hd);
            float *alone = host(ao);
            for (size_t i = 0; i < (size_t)n * nh * hd; i++)
                cr_expect_float_eq(got[qo + i], alone[i], 1e-6f, "row %d document at %d: %g vs %g",
                                   b, s0, (double)got[qo + i], (double)alone[i]);
            free(alone);
            s0 += n;
        }
    free(q), free(k), free(v), free(got);
}

Test(ops, attention_gqa_causal)
{
    check_attention(2, 5, 4, 2, 4);  /* grouped query */
    check_attention(1, 9, 3, 3, 6);  /* multi-head, odd T */
    check_attention(1, 3, 4, 1, 2);  /* multi-query */
}

Test(ops, attention_packed_documents)
{
    check_packed_attention();
}

/* RoPE with positions restarting at each packed document: each token is
 * rotated by its own position (the reference), and a document placed at
 * offset s0 is rotated exactly as the same document at the start of a row. */
Test(ops, rope_positions_of_packed_documents)
{
    int B = 2, T = 9, nh = 2, hd = 6, half = hd / 2;
    size_t n = (size_t)B * T * nh * hd;
    int32_t pos[18];
    for (int i = 0; i < B * T; i++)
        pos[i] = i % T - packed_seg[i];
    float *x = rnd(n, 1), *cs = malloc(sizeof(float) * T * half), *sn = malloc(sizeof(float) * T * half);
    rope_tables(cs, sn, T, hd);
    tensor_t tx = dev(x, n), tc = dev(cs, (size_t)T * half), ts = dev(sn, (size_t)T * half);
    tensor_t tp = talloc(DT_I32, (size_t)B * T);
    be_upload(be, tp, pos, DT_I32);
    be_rope(be, tx, tc, ts, tp, B, T, nh, hd, 0);
    double *xd = to_d(x, n), *want = malloc(sizeof(double) * n);
    rope_ref(want, xd, cs, sn, pos, B, T, nh, hd);
    float *got = host(tx);
    cr_expect_lt(rel_err(got, want, n), FWD_TOL);
    /* row 1's second document (5 tokens at offset 4) against itself at offset 0 */
    size_t o = ((size_t)1 * T + 4) * nh * hd, len = (size_t)5 * nh * hd;
    tensor_t alone = dev(x + o, len);
    be_rope(be, alone, tc, ts, no_tensor(), 1, 5, nh, hd, 0);
    float *ga = host(alone);
    for (size_t i = 0; i < len; i++)
        cr_expect_float_eq(got[o + i], ga[i], 0.0f, "element %zu", i);
    /* the inverse with positions undoes the forward */
    be_rope(be, tx, tc, ts, tp, B, T, nh, hd, 1);
    float *back = host(tx);
    for (size_t i = 0; i < n; i++)
        cr_expect_float_eq(back[i], x[i], 1e-6f, "inverse, element %zu", i);
    free(x), free(cs), free(sn), free(xd), free(want), free(got), free(ga), free(back);
}

/* ---- SwiGLU, embedding, bias, add ------------------------------------------- */

Test(ops, swiglu_forward_backward)
{
    size_t n = 301;
    float *g = rnd(n, 4), *u = rnd(n, 2), *R = rnd(n, 1);
    tensor_t tg = dev(g, n), tu = dev(u, n), to = dev(NULL, n);
    be_swiglu_forward(be, to, tg, tu, n);
    float *got = host(to);
    double *want = malloc(sizeof(double) * n), *fg = malloc(sizeof(double) * n), *fu = malloc(sizeof(double) * n);
    for (size_t i = 0; i < n; i++) {
        double G = g[i], U = u[i], h = 1e-6;
#define SW(a, b) ((a) / (1 + exp(-(a))) * (b))
        want[i] = SW(G, U);
        fg[i] = R[i] * (SW(G + h, U) - SW(G - h, U)) / (2 * h);
        fu[i] = R[i] * (SW(G, U + h) - SW(G, U - h)) / (2 * h);
#undef SW
    }
    cr_expect_lt(rel_err(got, want, n), FWD_TOL);
    tensor_t tdo = dev(R, n), tdg = dev(NULL, n), tdu = dev(NULL, n);
    be_swiglu_backward(be, tdg, tdu, tdo, tg, tu, n);
    float *dg = host(tdg), *du = host(tdu);
    cr_expect_lt(rel_err(dg, fg, n), BWD_TOL);
    cr_expect_lt(rel_err(du, fu, n), BWD_TOL);
    free(g), free(u), free(R), free(got), free(want), free(fg), free(fu), free(dg), free(du);
}

Test(ops, embedding_forward_backward)
{
    int V = 11, H = 6, n = 9;
    int32_t tok[9] = {3, 0, 10, 3, 7, 7, 7, 1, 3};
    float *W = rnd((size_t)V * H, 1), *R = rnd((size_t)n * H, 1);
    tensor_t tW = dev(W, (size_t)V * H), to = dev(NULL, (size_t)n * H);
    tensor_t tt = talloc(DT_I32, (size_t)n);
    be_upload(be, tt, tok, DT_I32);
    be_embedding_forward(be, to, tW, tt, n, H);
    float *got = host(to);
    for (int i = 0; i < n; i++)
        cr_expect_eq(memcmp(got + i * H, W + tok[i] * H, sizeof(float) * H), 0);
    tensor_t tdW = dev(NULL, (size_t)V * H), tdo = dev(R, (size_t)n * H);
    be_embedding_backward(be, tdW, tdo, tt, n, H);
    float *dW = host(tdW);
    double *want = calloc((size_t)V * H, sizeof(double));
    for (int i = 0; i < n; i++)
        for (int c = 0; c < H; c++)
            want[tok[i] * H + c] += R[i * H + c];
    cr_expect_lt(rel_err(dW, want, (size_t)V * H), FWD_TOL);
    /* finite differences of L(W) = <R, embedding(W)> on the op itself, for a
     * row used three times (3), once (0), and never (5) */
    const int probes[][2] = {{3, 0}, {3, 5}, {0, 2}, {5, 1}, {7, 4}};
    for (size_t p = 0; p < sizeof probes / sizeof probes[0]; p++) {
        size_t j = (size_t)(probes[p][0] * H + probes[p][1]);
        double L[2];
        for (int sgn = 0; sgn < 2; sgn++) {
            float *Wp = malloc(sizeof(float) * (size_t)V * H);
            memcpy(Wp, W, sizeof(float) * (size_t)V * H);
            Wp[j] += sgn ? -1e-2f : 1e-2f;
            tensor_t tWp = dev(Wp, (size_t)V * H), top = dev(NULL, (size_t)n * H);
            be_embedding_forward(be, top, tWp, tt, n, H);
            float *yp = host(top);
            L[sgn] = 0;
            for (size_t k = 0; k < (size_t)n * H; k++)
                L[sgn] += (double)R[k] * yp[k];
            free(Wp), free(yp);
        }
        double fd = (L[0] - L[1]) / (2 * (double)1e-2f);
        cr_expect_lt(fabs(fd - dW[j]), 2e-3 * (fabs(dW[j]) + 1), "W[%zu]: fd %g, backward %g", j,
                     fd, (double)dW[j]);
    }
    free(W), free(R), free(got), free(dW), free(want);
}

Test(ops, bias_add_and_backward)
{
    int rows = 6, cols = 5;
    float *y = rnd((size_t)rows * cols, 1), *b = rnd((size_t)cols, 1);
    tensor_t ty = dev(y, (size_t)rows * cols), tb = dev(b, (size_t)cols), tdb = dev(NULL, (size_t)cols);
    be_add_bias(be, ty, tb, rows, cols);
    float *got = host(ty);
    double want[30], dbw[5] = {0};
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            want[r * cols + c] = (double)y[r * cols + c] + b[c];
            dbw[c] += y[r * cols + c];
        }
    cr_expect_lt(rel_err(got, want, 30), FWD_TOL);
    tensor_t ty0 = dev(y, (size_t)rows * cols);
    be_bias_backward(be, tdb, ty0, rows, cols);
    float *db = host(tdb);
    cr_expect_lt(rel_err(db, dbw, 5), FWD_TOL);
    free(y), free(b), free(got), free(db);
}

/* copy2d: a block of columns out of a wider matrix and back, exactly; the
 * columns outside the block and the padding of each row untouched. */
Test(ops, copy2d_splits_and_joins_column_blocks)
{
    int rows = 5, wide = 7, col = 2, cols = 3;
    float *w = rnd((size_t)rows * wide, 1), *z = rnd((size_t)rows * wide, 1);
    tensor_t tw = dev(w, (size_t)rows * wide), part = dev(NULL, (size_t)rows * cols);
    tensor_t back = dev(z, (size_t)rows * wide);
    be_copy2d(be, part, tensor_view(tw, (size_t)col, tw.n - (size_t)col), rows, cols, cols, wide);
    be_copy2d(be, tensor_view(back, (size_t)col, back.n - (size_t)col), part, rows, cols, wide,
              cols);
    sp_err err = {0};
    cr_assert_eq(be_check(be, &err), 0, "%s", err.msg);
    float *got = host(part), *joined = host(back);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < wide; c++) {
            int in = c >= col && c < col + cols;
            if (in)
                cr_expect_eq(got[r * cols + c - col], w[r * wide + c], "(%d, %d)", r, c);
            cr_expect_eq(joined[r * wide + c], in ? w[r * wide + c] : z[r * wide + c],
                         "(%d, %d)", r, c);
        }
    free(w), free(z), free(got), free(joined);
}

/* DoRA's ops against plain double loops: the row norms of W + s B A (and of
 * W alone with r = 0), y * num / den per column, and the column dot
 * products over den accumulated into out. FWD_TOL on both CPU paths. */
Test(ops, dora_weight_norm_col_scale_and_col_dot)
{
    const char *kinds[] = {"cpu", "cpu-ref"};
    int out = 7, in = 9, r = 3, rows = 5;
    float s = 0.75f;
    float *W = rnd((size_t)out * in, 1), *A = rnd((size_t)r * in, 1), *B = rnd((size_t)out * r, 1);
    float *y = rnd((size_t)rows * out, 1), *x = rnd((size_t)rows * out, 1);
    float *num = rnd((size_t)out, 1), *den = rnd((size_t)out, 1), *acc0 = rnd((size_t)out, 1);
    for (int o = 0; o < out; o++)
        den[o] = 0.5f + fabsf(den[o]); /* a norm: positive */
    double nw[7], n0[7], ys[35], dot[7];
    for (int o = 0; o < out; o++) {
        double ss = 0, ss0 = 0;
        for (int j = 0; j < in; j++) {
            double v = 0;
            for (int k = 0; k < r; k++)
                v += (double)B[o * r + k] * A[k * in + j];
            double w = W[o * in + j] + (double)s * v;
            ss += w * w;
            ss0 += (double)W[o * in + j] * W[o * in + j];
        }
        nw[o] = sqrt(ss);
        n0[o] = sqrt(ss0);
        double d = 0;
        for (int i = 0; i < rows; i++) {
            ys[i * out + o] = (double)y[i * out + o] * num[o] / den[o];
            d += (double)x[i * out + o] * y[i * out + o];
        }
        dot[o] = acc0[o] + d / den[o];
    }
    for (int kind = 0; kind < 2; kind++) {
        backend_t *b2;
        sp_err err = {0};
        cr_assert_eq(backend_create(&b2, kinds[kind], 0, 2, &err), 0, "%s", err.msg);
        tensor_t tW = be_alloc(b2, DT_F32, (size_t)out * in), tA = be_alloc(b2, DT_F32, (size_t)r * in);
        tensor_t tB = be_alloc(b2, DT_F32, (size_t)out * r), tn = be_alloc(b2, DT_F32, (size_t)out);
        tensor_t ty = be_alloc(b2, DT_F32, (size_t)rows * out), tx = be_alloc(b2, DT_F32, (size_t)rows * out);
        tensor_t tnum = be_alloc(b2, DT_F32, (size_t)out), tden = be_alloc(b2, DT_F32, (size_t)out);
        tensor_t tacc = be_alloc(b2, DT_F32, (size_t)out);
        be_upload(b2, tW, W, DT_F32), be_upload(b2, tA, A, DT_F32), be_upload(b2, tB, B, DT_F32);
        be_upload(b2, ty, y, DT_F32), be_upload(b2, tx, x, DT_F32);
        be_upload(b2, tnum, num, DT_F32), be_upload(b2, tden, den, DT_F32);
        be_upload(b2, tacc, acc0, DT_F32);
        float got[35];
        be_weight_norm(b2, tn, tW, tA, tB, s, out, in, r);
        be_download(b2, got, DT_F32, tn);
        cr_expect_lt(rel_err(got, nw, (size_t)out), FWD_TOL, "%s weight_norm", kinds[kind]);
        be_weight_norm(b2, tn, tW, (tensor_t){0}, (tensor_t){0}, s, out, in, 0);
        be_download(b2, got, DT_F32, tn);
        cr_expect_lt(rel_err(got, n0, (size_t)out), FWD_TOL, "%s weight_norm r = 0", kinds[kind]);
        be_col_dot(b2, tacc, tx, ty, tden, rows, out);
        be_download(b2, got, DT_F32, tacc);
        cr_expect_lt(rel_err(got, dot, (size_t)out), FWD_TOL, "%s col_dot", kinds[kind]);
        be_col_scale(b2, ty, tnum, tden, rows, out);
        be_download(b2, got, DT_F32, ty);
        cr_expect_lt(rel_err(got, ys, (size_t)rows * out), FWD_TOL, "%s col_scale", kinds[kind]);
        cr_expect_eq(be_check(b2, &err), 0, "%s", err.msg);
        tensor_t *all[] = {&tW, &tA, &tB, &tn, &ty, &tx, &tnum, &tden, &tacc};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            be_free(b2, all[i]);
        backend_destroy(b2);
    }
    free(W), free(A), free(B), free(y), free(x), free(num), free(den), free(acc0);
}

/* ---- cross-entropy ------------------------------------------------------------ */

Test(ops, cross_entropy_loss_and_gradient)
{
    int rows = 4, V = 13;
    int32_t tg[4] = {2, -1, 12, 0};
    float *x = rnd((size_t)rows * V, 5);
    float scale = 0.25f;
    tensor_t tx = dev(x, (size_t)rows * V), tl = dev(NULL, (size_t)rows);
    tensor_t tt = talloc(DT_I32, (size_t)rows);
    be_upload(be, tt, tg, DT_I32);
    be_cross_entropy(be, tx, tl, tt, rows, V, scale);
    float *loss = host(tl), *dx = host(tx);
    double h = 1e-6;
    for (int r = 0; r < rows; r++) {
        double m = -1e300, s = 0;
        for (int i = 0; i < V; i++)
            m = fmax(m, x[r * V + i]);
        for (int i = 0; i < V; i++)
            s += exp(x[r * V + i] - m);
        double lse = m + log(s);
        if (tg[r] < 0) {
            cr_expect_eq(loss[r], 0.0f);
            for (int i = 0; i < V; i++)
                cr_expect_eq(dx[r * V + i], 0.0f, "ignored row has a gradient");
            continue;
        }
        cr_expect_lt(fabs(loss[r] - (lse - x[r * V + tg[r]])), 1e-5 * (lse + 1));
        for (int i = 0; i < V; i++) {
            /* d(scale * loss)/dx_i by finite differences in double */
            double xp[13];
            for (int j = 0; j < V; j++)
                xp[j] = x[r * V + j];
            double f[2];
            for (int sgn = 0; sgn < 2; sgn++) {
                xp[i] = x[r * V + i] + (sgn ? -h : h);
                double mm = -1e300, ss = 0;
                for (int j = 0; j < V; j++)
                    mm = fmax(mm, xp[j]);
                for (int j = 0; j < V; j++)
                    ss += exp(xp[j] - mm);
                f[sgn] = scale * (mm + log(ss) - xp[tg[r]]);
            }
            double want = (f[0] - f[1]) / (2 * h);
            cr_expect_lt(fabs(dx[r * V + i] - want), 1e-5, "row %d col %d: %g vs %g", r, i, dx[r * V + i], want);
        }
    }
    free(x), free(loss), free(dx);
}

/* ---- dropout, sumsq, adamw, fills --------------------------------------------- */

Test(ops, dropout_mask_is_a_pure_function)
{
    size_t n = 100000;
    float *x = rnd(n, 1);
    tensor_t tx = dev(x, n), a = dev(NULL, n), b = dev(NULL, n);
    be_dropout(be, a, tx, n, 0.25f, 77, 1000);
    be_dropout(be, b, tx, n, 0.25f, 77, 1000);
    float *ha = host(a), *hb = host(b);
    cr_expect_eq(memcmp(ha, hb, sizeof(float) * n), 0, "same stream, same mask");
    size_t dropped = 0;
    for (size_t i = 0; i < n; i++) {
        if (ha[i] == 0.0f)
            dropped++;
        else
            cr_assert_lt(fabsf(ha[i] - x[i] / 0.75f), 1e-6f);
    }
    /* binomial(1e5, 0.25): sd ~ 137; 6 sd */
    cr_expect_lt(fabs((double)dropped - 25000.0), 822.0, "dropped %zu", dropped);
    be_dropout(be, b, tx, n, 0.0f, 77, 1000);
    float *hc = host(b);
    cr_expect_eq(memcmp(hc, x, sizeof(float) * n), 0, "p = 0 copies");
    free(x), free(ha), free(hb), free(hc);
}

Test(ops, sumsq_is_exact_and_thread_independent)
{
    size_t n = 1000003;
    float *x = rnd(n, 3);
    double want = 0;
    for (size_t i = 0; i < n; i++)
        want += (double)x[i] * x[i];
    tensor_t tx = dev(x, n);
    double got = be_sumsq(be, tx, n);
    cr_expect_lt(fabs(got - want), 1e-9 * want);
    backend_t *one;
    sp_err err = {0};
    backend_create(&one, "cpu", 0, 1, &err);
    double got1 = be_sumsq(one, tx, n);
    cr_expect_eq(got, got1, "1 thread %.17g vs 2 threads %.17g", got1, got);
    backend_destroy(one);
    free(x);
}

Test(ops, adamw_matches_the_pytorch_formula)
{
    size_t n = 257;
    float *p = rnd(n, 1), *g = rnd(n, 1), *m = rnd(n, 0.1f), *v = rnd(n, 0.1f);
    for (size_t i = 0; i < n; i++)
        v[i] = fabsf(v[i]);
    adamw_args a = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f,
                    .grad_scale = 0.5f, .step = 3};
    tensor_t tp = dev(p, n), tg = dev(g, n), tm = dev(m, n), tv = dev(v, n);
    be_adamw(be, tp, (tensor_t){0}, tg, tm, tv, n, &a);
    float *hp = host(tp);
    double *want = malloc(sizeof(double) * n);
    for (size_t i = 0; i < n; i++) {
        double gi = g[i] * 0.5, mi = 0.9 * m[i] + 0.1 * gi, vi = 0.95 * v[i] + 0.05 * gi * gi;
        double pi = p[i] * (1 - 1e-2 * 0.1);
        double bc1 = 1 - pow(0.9, 3), bc2 = 1 - pow(0.95, 3);
        want[i] = pi - 1e-2 / bc1 * mi / (sqrt(vi) / sqrt(bc2) + 1e-8);
    }
    cr_expect_lt(rel_err(hp, want, n), 1e-6);
    free(p), free(g), free(m), free(v), free(hp), free(want);
}

Test(ops, fills_have_the_right_distribution)
{
    size_t n = 200000;
    tensor_t t = dev(NULL, n);
    be_fill_uniform(be, t, n, -0.5f, 1.5f, 9, 0);
    float *u = host(t);
    double mean = 0;
    for (size_t i = 0; i < n; i++) {
        cr_assert(u[i] >= -0.5f && u[i] < 1.5f);
        mean += u[i];
    }
    /* sd of the mean: (2/sqrt 12)/sqrt n = 1.3e-3; 6 sd */
    cr_expect_lt(fabs(mean / n - 0.5), 8e-3);
    be_fill_normal(be, t, n, 1.0f, 0.02f, 9, 0);
    float *g = host(t);
    double s = 0, ss = 0;
    for (size_t i = 0; i < n; i++) {
        s += g[i];
        ss += (double)(g[i] - 1.0) * (g[i] - 1.0);
    }
    cr_expect_lt(fabs(s / n - 1.0), 6 * 0.02 / sqrt((double)n));
    cr_expect_lt(fabs(sqrt(ss / n) - 0.02), 0.02 * 0.02);
    free(u), free(g);
}

/* The reference backend's attention (plain loops) against the same double
 * reference and finite differences. */
Test(ops, attention_reference_path)
{
    sp_err err = {0};
    backend_destroy(be);
    cr_assert_eq(backend_create(&be, "cpu-ref", 0, 2, &err), 0, "%s", err.msg);
    check_attention(2, 5, 4, 2, 4);
    check_attention(1, 9, 3, 3, 6);
    check_packed_attention();
}

/* ---- the blocked (flash) attention against the plain loops ------------------
 * The fast backend's attention (kind "cpu": tiles of 64 query rows x 64 keys,
 * online softmax, kernels/cpu/cpu_attention_flash.c) against the reference
 * backend's plain loops (kind "cpu-ref", checked above against the double
 * reference and finite differences), forward (out, lse) and backward (dq,
 * dk, dv) from the same inputs, each tensor within 1e-5 of its largest
 * value (both fp32; only the order of the sums differs). T 1, 7, 37, 130
 * leave partial edge tiles (130: three query tiles, the last of two rows). */
#define FLASH_TOL 1e-5

/* max |a - b| / max |b| (float) */
static double rel_err_f(const float *a, const float *b, size_t n)
{
    double m = 0, e = 0;
    for (size_t i = 0; i < n; i++) {
        if (fabs((double)b[i]) > m)
            m = fabs((double)b[i]);
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > e || d != d)
            e = d != d ? INFINITY : d;
    }
    return m > 0 ? e / m : e;
}

/* Packed documents of 1..max_len tokens (a fixed draw): seg[b*T + t] is the
 * first position of t's document. */
static void flash_packed_rows(int B, int T, int max_len, int32_t *seg)
{
    uint64_t draw = 0;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T;) {
            int len = 1 + (int)(sp_rng_u64(0xf1a5, draw++) % (uint64_t)max_len);
            for (int i = t; i < t + len && i < T; i++)
                seg[b * T + i] = t;
            t += len;
        }
}

/* The five outputs of forward + backward on backend x (inputs uploaded). */
typedef struct attn_run {
    float *out, *lse, *dq, *dk, *dv;
} attn_run;

static attn_run run_attention(backend_t *x, const float *q, const float *k, const float *v,
                              const float *dout, const int32_t *seg, int B, int T, int nh,
                              int nkv, int hd)
{
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    tensor_t t[10] = {0};
    size_t ns[9] = {nq, nk, nk, nq, nq, nl, nq, nk, nk};
    for (int i = 0; i < 9; i++) {
        t[i] = be_alloc(x, DT_F32, ns[i]);
        cr_assert(t[i].p);
    }
    be_upload(x, t[0], q, DT_F32), be_upload(x, t[1], k, DT_F32), be_upload(x, t[2], v, DT_F32);
    be_upload(x, t[3], dout, DT_F32);
    if (seg) {
        t[9] = be_alloc(x, DT_I32, (size_t)B * T);
        cr_assert(t[9].p);
        be_upload(x, t[9], seg, DT_I32);
    }
    be_attention_forward(x, t[4], t[5], t[0], t[1], t[2], t[9], B, T, nh, nkv, hd);
    be_attention_backward(x, t[6], t[7], t[8], t[3], t[4], t[5], t[0], t[1], t[2], t[9], B, T,
                          nh, nkv, hd);
    sp_err err = {0};
    cr_assert_eq(be_check(x, &err), 0, "%s", err.msg);
    attn_run r;
    float **dst[5] = {&r.out, &r.lse, &r.dq, &r.dk, &r.dv};
    for (int i = 0; i < 5; i++) {
        tensor_t src = t[4 + i];
        *dst[i] = malloc(sizeof(float) * src.n);
        be_download(x, *dst[i], DT_F32, src);
    }
    for (int i = 0; i < 10; i++)
        be_free(x, &t[i]);
    return r;
}

static void free_run(attn_run *r)
{
    free(r->out), free(r->lse), free(r->dq), free(r->dk), free(r->dv);
}

/* The fast backend with the blocked attention at every length (by default
 * only from 2048 tokens). */
static backend_t *make_flash(void)
{
    backend_t *fl = NULL;
    sp_err err = {0};
    setenv("SPOTUNE_CPU_ATTENTION", "flash", 1);
    cr_assert_eq(backend_create(&fl, "cpu", 0, 2, &err), 0, "%s", err.msg);
    unsetenv("SPOTUNE_CPU_ATTENTION");
    return fl;
}

/* Blocked (the fast backend forced to it) against plain loops (ref) on one shape, with or without
 * packed documents of up to 50 tokens (they cross the 64-row tiles). */
static void check_flash(backend_t *ref, int B, int T, int nh, int nkv, int hd, int packed)
{
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    float *q = rnd(nq, 1.5f), *k = rnd(nk, 1.5f), *v = rnd(nk, 1), *dout = rnd(nq, 1);
    int32_t *seg = NULL;
    if (packed) {
        seg = malloc(sizeof(int32_t) * (size_t)B * T);
        flash_packed_rows(B, T, 50, seg);
    }
    backend_t *fl = make_flash();
    attn_run a = run_attention(fl, q, k, v, dout, seg, B, T, nh, nkv, hd);
    attn_run w = run_attention(ref, q, k, v, dout, seg, B, T, nh, nkv, hd);
    backend_destroy(fl);
    const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
    float *got[5] = {a.out, a.lse, a.dq, a.dk, a.dv}, *want[5] = {w.out, w.lse, w.dq, w.dk, w.dv};
    size_t ns[5] = {nq, nl, nq, nk, nk};
    for (int i = 0; i < 5; i++) {
        double e = rel_err_f(got[i], want[i], ns[i]);
        cr_expect(e <= FLASH_TOL, "flash B%d T%d nh%d nkv%d hd%d%s %s: rel err %.3g > %.0e", B, T,
                  nh, nkv, hd, packed ? " packed" : "", names[i], e, FLASH_TOL);
    }
    free_run(&a), free_run(&w);
    free(q), free(k), free(v), free(dout), free(seg);
}

static backend_t *make_ref(void)
{
    backend_t *ref = NULL;
    sp_err err = {0};
    cr_assert_eq(backend_create(&ref, "cpu-ref", 0, 2, &err), 0, "%s", err.msg);
    cr_assert_str_eq(be->name, "cpu");
    return ref;
}

static void check_flash_shapes(int hd, int packed)
{
    static const int Ts[] = {1, 7, 37, 130};
    static const int heads[][2] = {{2, 2}, {4, 1}, {8, 1}}; /* groups 1, 4, 8 */
    backend_t *ref = make_ref();
    for (int i = 0; i < 4; i++)
        for (int g = 0; g < 3; g++)
            check_flash(ref, 2, Ts[i], heads[g][0], heads[g][1], hd, packed);
    backend_destroy(ref);
}

Test(ops, flash_attention_matches_plain_hd64)
{
    check_flash_shapes(64, 0);
}

Test(ops, flash_attention_matches_plain_hd128)
{
    check_flash_shapes(128, 0);
}

Test(ops, flash_attention_matches_plain_packed_documents)
{
    check_flash_shapes(64, 1);
    check_flash_shapes(128, 1);
}

/* The head dims and shapes of the tests above (hd 2..6, two kv heads of
 * eight query heads), and a packed row whose documents skip whole key tiles
 * (one of 150 tokens after 100: tile 3's queries never see key tile 0). */
Test(ops, flash_attention_matches_plain_small_heads_and_long_documents)
{
    backend_t *ref = make_ref();
    check_flash(ref, 2, 5, 4, 2, 4, 0);
    check_flash(ref, 1, 9, 3, 3, 6, 0);
    check_flash(ref, 1, 3, 4, 1, 2, 0);
    check_flash(ref, 2, 67, 8, 2, 16, 1);
    int T = 250, nh = 2, nkv = 1, hd = 64;
    int32_t seg[250];
    for (int t = 0; t < T; t++)
        seg[t] = t < 100 ? 0 : 100;
    size_t nq = (size_t)T * nh * hd, nk = (size_t)T * nkv * hd;
    float *q = rnd(nq, 1.5f), *k = rnd(nk, 1.5f), *v = rnd(nk, 1), *dout = rnd(nq, 1);
    backend_t *fl = make_flash();
    attn_run a = run_attention(fl, q, k, v, dout, seg, 1, T, nh, nkv, hd);
    attn_run w = run_attention(ref, q, k, v, dout, seg, 1, T, nh, nkv, hd);
    backend_destroy(fl);
    cr_expect(rel_err_f(a.out, w.out, nq) <= FLASH_TOL, "out %g", rel_err_f(a.out, w.out, nq));
    cr_expect(rel_err_f(a.dq, w.dq, nq) <= FLASH_TOL, "dq %g", rel_err_f(a.dq, w.dq, nq));
    cr_expect(rel_err_f(a.dk, w.dk, nk) <= FLASH_TOL, "dk %g", rel_err_f(a.dk, w.dk, nk));
    cr_expect(rel_err_f(a.dv, w.dv, nk) <= FLASH_TOL, "dv %g", rel_err_f(a.dv, w.dv, nk));
    free_run(&a), free_run(&w);
    free(q), free(k), free(v), free(dout);
    backend_destroy(ref);
}

/* Each output has one writer in a fixed order: one thread and two give the
 * same bits. */
Test(ops, flash_attention_does_not_depend_on_the_thread_count)
{
    backend_t *one = NULL;
    sp_err err = {0};
    setenv("SPOTUNE_CPU_ATTENTION", "flash", 1);
    cr_assert_eq(backend_create(&one, "cpu", 0, 1, &err), 0, "%s", err.msg);
    int B = 2, T = 130, nh = 8, nkv = 2, hd = 64;
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    float *q = rnd(nq, 1.5f), *k = rnd(nk, 1.5f), *v = rnd(nk, 1), *dout = rnd(nq, 1);
    attn_run a = run_attention(one, q, k, v, dout, NULL, B, T, nh, nkv, hd);
    backend_destroy(one);
    cr_assert_eq(backend_create(&one, "cpu", 0, 2, &err), 0, "%s", err.msg);
    attn_run b = run_attention(one, q, k, v, dout, NULL, B, T, nh, nkv, hd);
    backend_destroy(one);
    cr_expect(memcmp(a.out, b.out, sizeof(float) * nq) == 0, "out differs");
    cr_expect(memcmp(a.lse, b.lse, sizeof(float) * nl) == 0, "lse differs");
    cr_expect(memcmp(a.dq, b.dq, sizeof(float) * nq) == 0, "dq differs");
    cr_expect(memcmp(a.dk, b.dk, sizeof(float) * nk) == 0, "dk differs");
    cr_expect(memcmp(a.dv, b.dv, sizeof(float) * nk) == 0, "dv differs");
    free_run(&a), free_run(&b);
    free(q), free(k), free(v), free(dout);
}

/* ---- argument checks -------------------------------------------------------- */

/* The same malformed calls on the fast and the reference backend: each is
 * refused with the same message naming the op and the argument, and
 * changes no memory (tests/op_checks.c; the CUDA suite makes them too). */
Test(ops, malformed_calls_are_refused_alike_on_cpu_and_cpu_ref)
{
    const char *kinds[] = {"cpu", "cpu-ref"};
    int cases[2];
    for (int k = 0; k < 2; k++) {
        backend_t *b;
        sp_err err = {0};
        cr_assert_eq(backend_create(&b, kinds[k], 0, 2, &err), 0, "%s", err.msg);
        cases[k] = op_checks_run(b);
        backend_destroy(b);
    }
    cr_expect_gt(cases[0], 150, "only %d malformed calls checked", cases[0]);
    cr_expect_eq(cases[0], cases[1]);
}

Test(ops, ids_and_targets_outside_the_table_read_and_train_nothing)
{
    const char *kinds[] = {"cpu", "cpu-ref"};
    for (int k = 0; k < 2; k++) {
        backend_t *b;
        sp_err err = {0};
        cr_assert_eq(backend_create(&b, kinds[k], 0, 2, &err), 0, "%s", err.msg);
        op_checks_ids_outside(b);
        backend_destroy(b);
    }
}

/* The CPU computes in F32: a BF16 or F16 tensor (which CUDA would take, or
 * not) is refused by name, before its 2-byte elements are read as 4. */
Test(ops, the_cpu_refuses_other_float_dtypes)
{
    tensor_t y = talloc(DT_F32, 8), h = talloc(DT_BF16, 8), f16 = talloc(DT_F16, 8);
    be_add(be, y, h, 1.0f, 8);
    op_checks_expect_refused(be, "add: x has dtype BF16; this backend computes in F32 only",
                             __FILE__, "add of BF16 on the CPU");
    be_matmul(be, y, f16, y, 2, 2, 2, 0, 0, 1.0f, 0.0f);
    op_checks_expect_refused(be, "matmul: A has dtype F16; this backend computes in F32 only",
                             __FILE__, "matmul of F16 on the CPU");
    /* converting copies are the CPU's to make */
    be_copy(be, h, y);
    be_copy(be, f16, h);
    sp_err err = {0};
    cr_expect_eq(be_check(be, &err), 0, "%s", err.msg);
}

/* dequant_nf4 on cpu and cpu-ref: a matrix quantized by kernels/nf4.h
 * (checked against bitsandbytes in test_nf4) of 16384 + 3 * 64 + 37
 * elements (two nested blocks, a partial block, an odd count), dequantized
 * whole and from a view starting mid-block; bit-identical to the host
 * dequantization. */
Test(ops, dequant_nf4_matches_the_host_dequantization)
{
    const char *kinds[] = {"cpu", "cpu-ref"};
    size_t n = 16384 + 3 * 64 + 37, nb = nf4_blocks(n), nn = nf4_nested_blocks(n);
    float *x = rnd(n, 0.1f), *absmax = malloc(sizeof(float) * nb), *nested = malloc(sizeof(float) * nn);
    uint8_t *codes = malloc(nf4_code_bytes(n)), *q = malloc(nb);
    float *want = malloc(sizeof(float) * n), *got = malloc(sizeof(float) * n), maps[272];
    cr_assert(absmax && nested && codes && q && want && got);
    nf4_quantize_codes(x, n, codes, absmax);
    float offset = nf4_absmax_offset(absmax, nb);
    nf4_quantize_absmax(absmax, nb, offset, nf4_dynamic_map, q, nested);
    nf4_dequantize_absmax(q, nested, nf4_dynamic_map, offset, nb, absmax);
    nf4_dequantize_codes(codes, absmax, nf4_quant_map, n, want);
    memcpy(maps, nf4_quant_map, sizeof nf4_quant_map);
    memcpy(maps + 16, nf4_dynamic_map, sizeof nf4_dynamic_map);
    for (int kind = 0; kind < 2; kind++) {
        backend_t *b2;
        sp_err err = {0};
        cr_assert_eq(backend_create(&b2, kinds[kind], 0, 2, &err), 0, "%s", err.msg);
        tensor_t tc = be_alloc(b2, DT_U8, nf4_code_bytes(n)), tq = be_alloc(b2, DT_U8, nb);
        tensor_t tn = be_alloc(b2, DT_F32, nn), tm = be_alloc(b2, DT_F32, 272);
        tensor_t to = be_alloc(b2, DT_F32, n);
        be_upload(b2, tc, codes, DT_U8);
        be_upload(b2, tq, q, DT_U8);
        be_upload(b2, tn, nested, DT_F32);
        be_upload(b2, tm, maps, DT_F32);
        be_dequant_nf4(b2, to, tc, tq, tn, tm, offset, n);
        be_download(b2, got, DT_F32, to);
        cr_assert_eq(be_check(b2, &err), 0, "%s", err.msg);
        cr_assert(memcmp(got, want, sizeof(float) * n) == 0, "%s: not bit-identical", kinds[kind]);
        tensor_t part = tensor_view(to, 0, 100);
        be_dequant_nf4(b2, part, tc, tq, tn, tm, offset, 100);
        be_download(b2, got, DT_F32, part);
        cr_assert(memcmp(got, want, sizeof(float) * 100) == 0, "%s: first 100", kinds[kind]);
        be_free(b2, &tc);
        be_free(b2, &tq);
        be_free(b2, &tn);
        be_free(b2, &tm);
        be_free(b2, &to);
        backend_destroy(b2);
    }
    free(x);
    free(absmax);
    free(nested);
    free(codes);
    free(q);
    free(want);
    free(got);
}

/* Which attention the fast backend runs by default: the sgemm one under
 * 2048 tokens a window, the blocked one from 2048 (the same bits as the
 * backend forced to each, SPOTUNE_CPU_ATTENTION). */
static attn_run attention_with(const char *kind, int T)
{
    backend_t *b = NULL;
    sp_err err = {0};
    if (kind)
        setenv("SPOTUNE_CPU_ATTENTION", kind, 1);
    cr_assert_eq(backend_create(&b, "cpu", 0, 2, &err), 0, "%s", err.msg);
    unsetenv("SPOTUNE_CPU_ATTENTION");
    int nh = 2, nkv = 1, hd = 8;
    size_t nq = (size_t)T * nh * hd, nk = (size_t)T * nkv * hd;
    g_seed = 77;
    float *q = rnd(nq, 1.5f), *k = rnd(nk, 1.5f), *v = rnd(nk, 1), *dout = rnd(nq, 1);
    attn_run r = run_attention(b, q, k, v, dout, NULL, 1, T, nh, nkv, hd);
    backend_destroy(b);
    free(q), free(k), free(v), free(dout);
    return r;
}

Test(ops, default_attention_is_blocked_from_2048_tokens)
{
    const int Ts[2] = {2047, 2048};
    const char *same[2] = {"blas", "flash"}, *other[2] = {"flash", "blas"};
    for (int i = 0; i < 2; i++) {
        size_t nq = (size_t)Ts[i] * 2 * 8;
        attn_run d = attention_with(NULL, Ts[i]), s = attention_with(same[i], Ts[i]),
                 o = attention_with(other[i], Ts[i]);
        cr_expect(memcmp(d.out, s.out, sizeof(float) * nq) == 0 &&
                      memcmp(d.dq, s.dq, sizeof(float) * nq) == 0,
                  "T %d: the default is not the %s attention", Ts[i], same[i]);
        cr_expect(memcmp(d.dq, o.dq, sizeof(float) * nq) != 0,
                  "T %d: %s and %s give the same bits: the check cannot tell them apart", Ts[i],
                  same[i], other[i]);
        free_run(&d), free_run(&s), free_run(&o);
    }
}
