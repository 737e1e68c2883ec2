/* The CPU attention and RoPE, on the fast path and the reference path
 * (tests/test_ops.c has the other ops): RoPE and its inverse, with positions
 * restarting at each packed document; attention (grouped, multi-query,
 * packed documents) forward against a double-precision reference and
 * backward by central finite differences (tolerances: ops_util.h); the
 * blocked (flash) attention against the plain loops on odd shapes at 1e-5,
 * independent of the thread count; and which of the two the fast backend
 * runs by default (the blocked one from 2048 tokens). */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn_columns.h"
#include "kernels/backend.h"
#include "ops_util.h"

TestSuite(ops, .init = ops_setup, .fini = ops_teardown);

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

/* packed_doc_table: each document's first token (b T + t) in order, the
 * rest of the table B T; its capacity the count rounded up to a power of
 * two, at least 8, at most B T; 0 for starts that are not whole documents
 * (a query would attend across one), which then get no table. */
Test(ops, packed_doc_table_of_whole_documents)
{
    int32_t table[41];
    /* row 0: documents of 3, 1 and 5 tokens; row 1: one of 9 */
    const int32_t seg[18] = {0, 0, 0, 3, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    const int32_t want[9] = {0, 3, 4, 9, 18, 18, 18, 18, 18};
    cr_expect_eq(packed_doc_table(seg, 2, 9, table), 8);
    cr_expect_arr_eq(table, want, sizeof want, "the table of 4 documents in 2 rows of 9");
    /* 20 documents of 2 tokens: capacity 32, the tail 40 */
    int32_t pairs[40];
    for (int t = 0; t < 40; t++)
        pairs[t] = t & ~1;
    cr_expect_eq(packed_doc_table(pairs, 1, 40, table), 32);
    for (int i = 0; i <= 32; i++)
        cr_expect_eq(table[i], i < 20 ? 2 * i : 40, "table[%d] = %d", i, table[i]);
    /* 12 one-token documents: 16 would exceed the 12 tokens */
    int32_t ones[12];
    for (int t = 0; t < 12; t++)
        ones[t] = t % 6; /* starts are row positions */
    cr_expect_eq(packed_doc_table(ones, 2, 6, table), 12);
    for (int i = 0; i <= 12; i++)
        cr_expect_eq(table[i], i, "one-token documents: table[%d] = %d", i, table[i]);
    /* not whole documents: t 2 attends from 1, inside another run */
    const int32_t across[4] = {0, 0, 1, 1}, late[4] = {0, 0, 0, 2}, neg[3] = {0, -1, -1};
    cr_expect_eq(packed_doc_table(across, 1, 4, table), 0);
    cr_expect_eq(packed_doc_table(late, 1, 4, table), 0);
    cr_expect_eq(packed_doc_table(neg, 1, 3, table), 0);
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

/* RoPE out of and into column blocks of wider matrices (a fused q/k/v
 * product's, row stride N), with packed positions, forward and inverse:
 * the same bits as in place on contiguous heads, and the columns outside
 * the destination block untouched. */
Test(ops, rope_between_column_blocks_matches_in_place)
{
    int B = 2, T = 9, nh = 2, hd = 6, half = hd / 2, w = nh * hd, N = 3 * w + 5, col = w + 3;
    size_t n = (size_t)B * T * w, nw = (size_t)B * T * N;
    int32_t pos[18];
    for (int i = 0; i < B * T; i++)
        pos[i] = i % T - packed_seg[i];
    float *x = rnd(n, 1), *wide = rnd(nw, 1), *cs = malloc(sizeof(float) * T * half),
          *sn = malloc(sizeof(float) * T * half);
    for (int r = 0; r < B * T; r++) /* x is the block at column col of wide */
        memcpy(wide + (size_t)r * N + col, x + (size_t)r * w, sizeof(float) * w);
    rope_tables(cs, sn, T, hd);
    tensor_t tc = dev(cs, (size_t)T * half), ts = dev(sn, (size_t)T * half);
    tensor_t tp = talloc(DT_I32, (size_t)B * T);
    be_upload(be, tp, pos, DT_I32);
    for (int inverse = 0; inverse < 2; inverse++) {
        tensor_t tx = dev(x, n), tw = dev(wide, nw), tout = dev(NULL, n), tback = dev(wide, nw);
        be_rope(be, tx, tc, ts, tp, B, T, nh, hd, inverse);
        /* out of the block into contiguous heads, then back into the block */
        be_rope_ld(be, tout, tensor_view(tw, (size_t)col, nw - col), tc, ts, tp, B, T, nh, hd,
                   inverse, w, N);
        be_rope_ld(be, tensor_view(tback, (size_t)col, nw - col), tx, tc, ts, tp, B, T, nh, hd,
                   1 - inverse, N, w);
        float *want = host(tx), *got = host(tout), *back = host(tback);
        cr_expect_eq(memcmp(got, want, sizeof(float) * n), 0, "inverse %d: out of the block",
                     inverse);
        size_t bad = 0;
        for (int r = 0; r < B * T; r++)
            for (int c = 0; c < N; c++) {
                float v = back[(size_t)r * N + c], o = wide[(size_t)r * N + c];
                if (c < col || c >= col + w)
                    bad += memcmp(&v, &o, sizeof v) != 0; /* untouched */
                else
                    bad += fabsf(v - x[(size_t)r * w + c - col]) > 1e-5f * (fabsf(o) + 1);
            }
        cr_expect_eq(bad, 0, "inverse %d: into the block: %zu values wrong", inverse, bad);
        free(want), free(got), free(back);
    }
    free(x), free(wide), free(cs), free(sn);
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

/* The fast backend with one attention at every length: "flash", the
 * blocked one (by default only from 2048 tokens), or "blas", the sgemm one
 * over causal row blocks (by default under 2048). */
static backend_t *make_fast(const char *kind)
{
    backend_t *fl = NULL;
    sp_err err = {0};
    setenv("SPOTUNE_CPU_ATTENTION", kind, 1);
    cr_assert_eq(backend_create(&fl, "cpu", 0, 2, &err), 0, "%s", err.msg);
    unsetenv("SPOTUNE_CPU_ATTENTION");
    return fl;
}

/* The fast backend forced to attention `kind` against plain loops (ref) on
 * one shape, with or without packed documents of up to 50 tokens (they
 * cross the 64-row tiles and row blocks). */
static void check_fast(backend_t *ref, const char *kind, int B, int T, int nh, int nkv, int hd,
                       int packed)
{
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    float *q = rnd(nq, 1.5f), *k = rnd(nk, 1.5f), *v = rnd(nk, 1), *dout = rnd(nq, 1);
    int32_t *seg = NULL;
    if (packed) {
        seg = malloc(sizeof(int32_t) * (size_t)B * T);
        flash_packed_rows(B, T, 50, seg);
    }
    backend_t *fl = make_fast(kind);
    attn_run a = run_attention(fl, q, k, v, dout, seg, B, T, nh, nkv, hd);
    attn_run w = run_attention(ref, q, k, v, dout, seg, B, T, nh, nkv, hd);
    backend_destroy(fl);
    const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
    float *got[5] = {a.out, a.lse, a.dq, a.dk, a.dv}, *want[5] = {w.out, w.lse, w.dq, w.dk, w.dv};
    size_t ns[5] = {nq, nl, nq, nk, nk};
    for (int i = 0; i < 5; i++) {
        double e = rel_err_f(got[i], want[i], ns[i]);
        cr_expect(e <= FLASH_TOL, "%s B%d T%d nh%d nkv%d hd%d%s %s: rel err %.3g > %.0e", kind, B,
                  T, nh, nkv, hd, packed ? " packed" : "", names[i], e, FLASH_TOL);
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

static void check_fast_shapes(const char *kind, int hd, int packed)
{
    static const int Ts[] = {1, 7, 37, 130};
    static const int heads[][2] = {{2, 2}, {4, 1}, {8, 1}}; /* groups 1, 4, 8 */
    backend_t *ref = make_ref();
    for (int i = 0; i < 4; i++)
        for (int g = 0; g < 3; g++)
            check_fast(ref, kind, 2, Ts[i], heads[g][0], heads[g][1], hd, packed);
    backend_destroy(ref);
}

static void check_flash_shapes(int hd, int packed)
{
    check_fast_shapes("flash", hd, packed);
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
    check_fast(ref, "flash", 2, 5, 4, 2, 4, 0);
    check_fast(ref, "flash", 1, 9, 3, 3, 6, 0);
    check_fast(ref, "flash", 1, 3, 4, 1, 2, 0);
    check_fast(ref, "flash", 2, 67, 8, 2, 16, 1);
    int T = 250, nh = 2, nkv = 1, hd = 64;
    int32_t seg[250];
    for (int t = 0; t < T; t++)
        seg[t] = t < 100 ? 0 : 100;
    size_t nq = (size_t)T * nh * hd, nk = (size_t)T * nkv * hd;
    float *q = rnd(nq, 1.5f), *k = rnd(nk, 1.5f), *v = rnd(nk, 1), *dout = rnd(nq, 1);
    backend_t *fl = make_fast("flash");
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

/* The sgemm attention (the fast path's under 2048 tokens) takes its query
 * rows in causal blocks of 64 (cpu_attention_blas.c): against the plain
 * loops at 1e-5 on lengths within one block and across several, the last
 * one partial (1, 7, 37, 130, 200), groups 1, 4, 8, head dims 64 and 128,
 * with and without packed documents that cross the blocks. */
Test(ops, blas_attention_matches_plain_row_blocks)
{
    check_fast_shapes("blas", 64, 0);
    check_fast_shapes("blas", 128, 1);
    backend_t *ref = make_ref();
    check_fast(ref, "blas", 2, 200, 8, 2, 64, 0);
    check_fast(ref, "blas", 2, 200, 4, 1, 64, 1);
    check_fast(ref, "blas", 1, 64, 2, 2, 16, 0);
    check_fast(ref, "blas", 1, 65, 2, 2, 16, 1);
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

/* ---- row strides: q, k, v as the column blocks of one matrix ------------------- */

#define PAD_VALUE 1234.5f /* what the padding columns hold before and after */

/* Forward and backward with q, k, v read as the column blocks of one
 * [B T, qd + 2 kvd + pad] matrix and dq, dk, dv written as those of
 * another (the fused q/k/v product's output and its gradient, the
 * trainer's layout), the pad columns of both holding PAD_VALUE; returns
 * the outputs as contiguous arrays, and fails when a pad column changed. */
static attn_run run_attention_strided(backend_t *x, const float *q, const float *k,
                                      const float *v, const float *dout, const int32_t *seg,
                                      int B, int T, int nh, int nkv, int hd, int pad)
{
    int qd = nh * hd, kvd = nkv * hd, N = qd + 2 * kvd + pad, rows = B * T;
    size_t nm = (size_t)rows * N, nq = (size_t)rows * qd, nl = (size_t)B * nh * T;
    float *in = malloc(sizeof(float) * nm), *gr = malloc(sizeof(float) * nm);
    float *before = malloc(sizeof(float) * nm);
    cr_assert(in && gr && before);
    attn_to_columns(in, N, q, k, v, rows, qd, kvd, PAD_VALUE);
    for (size_t i = 0; i < nm; i++)
        gr[i] = PAD_VALUE;
    memcpy(before, in, sizeof(float) * nm);
    tensor_t tin = be_alloc(x, DT_F32, nm), tgr = be_alloc(x, DT_F32, nm);
    tensor_t to = be_alloc(x, DT_F32, nq), tl = be_alloc(x, DT_F32, nl);
    tensor_t tdo = be_alloc(x, DT_F32, nq), ts = {0};
    cr_assert(tin.p && tgr.p && to.p && tl.p && tdo.p);
    be_upload(x, tin, in, DT_F32), be_upload(x, tgr, gr, DT_F32), be_upload(x, tdo, dout, DT_F32);
    if (seg) {
        ts = be_alloc(x, DT_I32, (size_t)rows);
        cr_assert(ts.p);
        be_upload(x, ts, seg, DT_I32);
    }
    tensor_t tk = tensor_view(tin, (size_t)qd, nm - (size_t)qd);
    tensor_t tv = tensor_view(tin, (size_t)(qd + kvd), nm - (size_t)(qd + kvd));
    tensor_t gk = tensor_view(tgr, (size_t)qd, nm - (size_t)qd);
    tensor_t gv = tensor_view(tgr, (size_t)(qd + kvd), nm - (size_t)(qd + kvd));
    be_attention_forward_ld(x, to, tl, tin, tk, tv, ts, B, T, nh, nkv, hd, N, N);
    be_attention_backward_ld(x, tgr, gk, gv, tdo, to, tl, tin, tk, tv, ts, B, T, nh, nkv, hd, N,
                             N, N, N);
    sp_err err = {0};
    cr_assert_eq(be_check(x, &err), 0, "%s", err.msg);
    attn_run r = {malloc(sizeof(float) * nq), malloc(sizeof(float) * nl),
                  malloc(sizeof(float) * nq), malloc(sizeof(float) * (size_t)rows * kvd),
                  malloc(sizeof(float) * (size_t)rows * kvd)};
    be_download(x, r.out, DT_F32, to);
    be_download(x, r.lse, DT_F32, tl);
    be_download(x, gr, DT_F32, tgr);
    be_download(x, in, DT_F32, tin);
    int pad_ok = attn_from_columns(gr, N, r.dq, r.dk, r.dv, rows, qd, kvd, PAD_VALUE);
    cr_expect(pad_ok, "a padding column of the gradients was written");
    cr_expect(memcmp(in, before, sizeof(float) * nm) == 0, "q, k, v or their padding changed");
    be_free(x, &tin), be_free(x, &tgr), be_free(x, &to), be_free(x, &tl), be_free(x, &tdo);
    be_free(x, &ts);
    free(in), free(gr), free(before);
    return r;
}

/* Each CPU attention (the plain loops, the sgemm one, the blocked one)
 * with q, k, v and their gradients as column blocks of wider matrices
 * (backend.h's row strides): the same values as with them contiguous, to
 * 1e-6 of each tensor's largest (the same sums; only the addressing
 * differs), and nothing outside the blocks written. Groups 1 and 4,
 * packed documents, 8 padding columns or none. */
Test(ops, attention_on_column_blocks_matches_contiguous)
{
    static const char *kinds[] = {"cpu-ref", "blas", "flash"};
    static const int shapes[][5] = {{2, 37, 4, 1, 16}, {1, 70, 2, 2, 8}};
    for (int ki = 0; ki < 3; ki++) {
        backend_t *x = ki == 0 ? make_ref() : make_fast(kinds[ki]);
        for (int si = 0; si < 2; si++)
            for (int pad = 0; pad <= 8; pad += 8) {
                int B = shapes[si][0], T = shapes[si][1], nh = shapes[si][2], nkv = shapes[si][3];
                int hd = shapes[si][4];
                size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd;
                size_t nl = (size_t)B * nh * T;
                float *q = rnd(nq, 1.5f), *k = rnd(nk, 1.5f), *v = rnd(nk, 1), *dout = rnd(nq, 1);
                int32_t *seg = malloc(sizeof(int32_t) * (size_t)B * T);
                cr_assert(seg);
                flash_packed_rows(B, T, 20, seg);
                attn_run a = run_attention(x, q, k, v, dout, seg, B, T, nh, nkv, hd);
                attn_run s = run_attention_strided(x, q, k, v, dout, seg, B, T, nh, nkv, hd, pad);
                const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
                float *got[5] = {s.out, s.lse, s.dq, s.dk, s.dv};
                float *want[5] = {a.out, a.lse, a.dq, a.dk, a.dv};
                size_t ns[5] = {nq, nl, nq, nk, nk};
                for (int i = 0; i < 5; i++) {
                    double e = rel_err_f(got[i], want[i], ns[i]);
                    cr_expect(e <= 1e-6, "%s B%d T%d nh%d nkv%d hd%d pad %d %s: rel err %.3g",
                              kinds[ki], B, T, nh, nkv, hd, pad, names[i], e);
                }
                free_run(&a), free_run(&s);
                free(q), free(k), free(v), free(dout), free(seg);
            }
        backend_destroy(x);
    }
}

/* A row stride under the row's width is refused, naming it, and nothing
 * runs (op_checks.c: negative strides and tensors too short for theirs). */
Test(ops, attention_refuses_a_row_stride_under_the_width)
{
    int B = 1, T = 4, nh = 2, nkv = 1, hd = 8;
    size_t n = (size_t)B * T * (nh + 2 * nkv) * hd;
    for (int bwd = 0; bwd < 2; bwd++) {
        backend_t *x = make_ref();
        tensor_t a = be_alloc(x, DT_F32, n), o = be_alloc(x, DT_F32, n);
        tensor_t l = be_alloc(x, DT_F32, 64);
        cr_assert(a.p && o.p && l.p);
        float *before = malloc(sizeof(float) * n), *after = malloc(sizeof(float) * n);
        cr_assert(before && after);
        be_download(x, before, DT_F32, o);
        if (bwd)
            be_attention_backward_ld(x, o, o, o, a, a, l, a, a, a, no_tensor(), B, T, nh, nkv, hd,
                                     nh * hd, nkv * hd, nh * hd, nkv * hd - 1);
        else
            be_attention_forward_ld(x, o, l, a, a, a, no_tensor(), B, T, nh, nkv, hd, nh * hd - 1,
                                    nkv * hd);
        sp_err err = {0};
        cr_expect_neq(be_check(x, &err), 0);
        const char *want = bwd ? "attention_backward: dkv_ld = 7 must be at least 8"
                               : "attention_forward: q_ld = 15 must be at least 16";
        cr_expect(strstr(err.msg, want) != NULL, "got \"%s\", want \"%s\"", err.msg, want);
        be_download(x, after, DT_F32, o); /* (the CPU backend downloads despite the error) */
        cr_expect(memcmp(before, after, sizeof(float) * n) == 0, "the refused call wrote");
        be_free(x, &a), be_free(x, &o), be_free(x, &l);
        free(before), free(after);
        backend_destroy(x);
    }
}
