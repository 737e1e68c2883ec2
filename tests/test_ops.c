/* The CPU ops but attention and RoPE (tests/test_ops_attention.c), on the
 * fast path and the reference path: matmul, RMSNorm, SwiGLU, embedding,
 * bias, copy2d, DoRA's norms and scales, cross-entropy and dequant_nf4
 * (dropout, sumsq, AdamW and the fills: tests/test_ops_step.c, the same
 * suite and fixture), forward against a double-precision
 * reference written here from the definitions, backward against central
 * finite differences of that double reference (tolerances: ops_util.h);
 * and the malformed calls of tests/op_checks.c, refused alike on cpu and
 * cpu-ref. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/nf4.h"
#include "op_checks.h"
#include "op_specs.h"
#include "ops_util.h"

TestSuite(ops, .init = ops_setup, .fini = ops_teardown);

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

/* Products on column blocks of wider matrices (be_matmul_ld, the batched
 * LoRA's): A, B and C stored with row strides 3 to 9 beyond their widths,
 * every transpose, on both backends against double loops (1e-5); the
 * columns of C outside the block are left as they were (exact). */
static tensor_t dev_on(backend_t *b, const float *h, size_t n)
{
    tensor_t t = be_alloc(b, DT_F32, n);
    be_upload(b, t, h, DT_F32);
    return t;
}

static void check_matmul_ld(const char *kind, int M, int N, int K, int ta, int tb, int pad)
{
    backend_t *b2;
    sp_err err = {0};
    cr_assert_eq(backend_create(&b2, kind, 0, 2, &err), 0);
    int ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    int lda = ac + pad, ldb = bc + pad + 2, ldc = N + pad + 4;
    size_t na = (size_t)ar * lda, nb = (size_t)br * ldb, nc = (size_t)M * ldc;
    float *A = rnd(na, 1), *B = rnd(nb, 1), *C = rnd(nc, 1), *got = malloc(sizeof(float) * nc);
    double *want = to_d(C, nc);
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double acc = 0;
            for (int k = 0; k < K; k++)
                acc += (double)(ta ? A[k * lda + i] : A[i * lda + k]) *
                       (tb ? B[j * ldb + k] : B[k * ldb + j]);
            want[i * ldc + j] = 0.5 * acc + C[i * ldc + j];
        }
    tensor_t tA = dev_on(b2, A, na), tB = dev_on(b2, B, nb), tC = dev_on(b2, C, nc);
    be_matmul_ld(b2, tC, tA, tB, M, N, K, ta, tb, 0.5f, 1.0f, lda, ldb, ldc);
    cr_assert_eq(b2->err.code, 0, "%s", b2->err.msg);
    be_download(b2, got, DT_F32, tC);
    double e = rel_err(got, want, nc);
    cr_expect_lt(e, FWD_TOL, "%s matmul_ld %dx%dx%d ta=%d tb=%d: rel err %g", kind, M, N, K, ta, tb,
                 e);
    size_t kept = 0, outside = 0;
    for (int i = 0; i < M; i++)
        for (int j = N; j < ldc; j++)
            outside++, kept += got[i * ldc + j] == C[i * ldc + j];
    cr_expect_eq(kept, outside, "%s: %zu of %zu elements outside C's block changed", kind,
                 outside - kept, outside);
    be_free(b2, &tA), be_free(b2, &tB), be_free(b2, &tC);
    backend_destroy(b2);
    free(A), free(B), free(C), free(got), free(want);
}

/* D = alpha A B + beta C with C and D distinct (the residual stream's add,
 * be_matmul_into): D against double loops (1e-5), C left as it was (exact),
 * on both backends, beta 1 and 0 */
Test(ops, matmul_into_reads_c_and_writes_d)
{
    const char *kinds[] = {"cpu", "cpu-ref"};
    int M = 17, N = 23, K = 9;
    for (int k = 0; k < 2; k++)
        for (int bi = 0; bi < 2; bi++) {
            backend_t *b2;
            sp_err err = {0};
            cr_assert_eq(backend_create(&b2, kinds[k], 0, 2, &err), 0);
            float beta = bi ? 1.0f : 0.0f;
            float *A = rnd((size_t)M * K, 1), *B = rnd((size_t)N * K, 1), *C = rnd((size_t)M * N, 1);
            float *got = malloc(sizeof(float) * M * N), *c_after = malloc(sizeof(float) * M * N);
            double *want = malloc(sizeof(double) * M * N);
            for (int i = 0; i < M; i++)
                for (int j = 0; j < N; j++) {
                    double acc = 0;
                    for (int q = 0; q < K; q++)
                        acc += (double)A[i * K + q] * B[j * K + q];
                    want[i * N + j] = acc + beta * C[i * N + j];
                }
            tensor_t tA = dev_on(b2, A, (size_t)M * K), tB = dev_on(b2, B, (size_t)N * K);
            float *old = rnd((size_t)M * N, 7); /* D's old values must not matter */
            tensor_t tC = dev_on(b2, C, (size_t)M * N), tD = dev_on(b2, old, (size_t)M * N);
            free(old);
            be_matmul_into(b2, tD, tA, tB, tC, M, N, K, 0, 1, 1.0f, beta);
            cr_assert_eq(b2->err.code, 0, "%s", b2->err.msg);
            be_download(b2, got, DT_F32, tD);
            be_download(b2, c_after, DT_F32, tC);
            double e = rel_err(got, want, (size_t)M * N);
            cr_expect_lt(e, FWD_TOL, "%s beta %g: rel err %g", kinds[k], beta, e);
            cr_expect(memcmp(C, c_after, sizeof(float) * M * N) == 0, "%s: C changed", kinds[k]);
            be_free(b2, &tA), be_free(b2, &tB), be_free(b2, &tC), be_free(b2, &tD);
            backend_destroy(b2);
            free(A), free(B), free(C), free(got), free(c_after), free(want);
        }
}

Test(ops, matmul_on_column_blocks_of_wider_matrices)
{
    const char *kinds[] = {"cpu", "cpu-ref"};
    for (int k = 0; k < 2; k++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                check_matmul_ld(kinds[k], 7, 13, 5, ta, tb, 3);
                check_matmul_ld(kinds[k], 33, 16, 48, ta, tb, 5);
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

/* ---- SwiGLU, embedding, bias, add ------------------------------------------- */

Test(ops, swiglu_forward_backward)
{
    size_t n = 301;
    float *g = rnd(n, 4), *u = rnd(n, 2), *R = rnd(n, 1);
    tensor_t tg = dev(g, n), tu = dev(u, n), to = dev(NULL, n);
    be_swiglu_forward(be, to, tg, tu, 1, (int)n, (int)n);
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
    be_swiglu_backward(be, tdg, tdu, tdo, tg, tu, 1, (int)n, (int)n);
    float *dg = host(tdg), *du = host(tdu);
    cr_expect_lt(rel_err(dg, fg, n), BWD_TOL);
    cr_expect_lt(rel_err(du, fu, n), BWD_TOL);
    free(g), free(u), free(R), free(got), free(want), free(fg), free(fu), free(dg), free(du);
}

/* On the two column halves of one [rows, 2 cols] matrix (the fused gate/up
 * product) with row stride 2 cols, the backward writing over them in place:
 * the same values as on contiguous g and u, bit for bit. */
Test(ops, swiglu_on_column_halves_in_place_matches_contiguous)
{
    int rows = 7, cols = 13;
    size_t n = (size_t)rows * cols;
    float *g = rnd(n, 4), *u = rnd(n, 2), *R = rnd(n, 1), *gu = malloc(sizeof(float) * 2 * n);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            gu[(size_t)r * 2 * cols + c] = g[(size_t)r * cols + c];
            gu[(size_t)r * 2 * cols + cols + c] = u[(size_t)r * cols + c];
        }
    tensor_t tg = dev(g, n), tu = dev(u, n), to = dev(NULL, n), tdo = dev(R, n);
    tensor_t tdg = dev(NULL, n), tdu = dev(NULL, n), tgu = dev(gu, 2 * n), to2 = dev(NULL, n);
    tensor_t up = tensor_view(tgu, (size_t)cols, 2 * n - cols);
    be_swiglu_forward(be, to, tg, tu, rows, cols, cols);
    be_swiglu_forward(be, to2, tgu, up, rows, cols, 2 * cols);
    be_swiglu_backward(be, tdg, tdu, tdo, tg, tu, rows, cols, cols);
    be_swiglu_backward(be, tgu, up, tdo, tgu, up, rows, cols, 2 * cols);
    float *o = host(to), *o2 = host(to2), *dg = host(tdg), *du = host(tdu), *dgu = host(tgu);
    cr_expect_eq(memcmp(o, o2, sizeof(float) * n), 0, "forward on the halves differs");
    size_t bad = 0;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            size_t i = (size_t)r * cols + c, j = (size_t)r * 2 * cols + c;
            bad += memcmp(&dgu[j], &dg[i], sizeof(float)) != 0;
            bad += memcmp(&dgu[j + cols], &du[i], sizeof(float)) != 0;
        }
    cr_expect_eq(bad, 0, "%zu gradients in place differ from the contiguous ones", bad);
    free(g), free(u), free(R), free(gu), free(o), free(o2), free(dg), free(du), free(dgu);
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
    tensor_t tdW = dev(NULL, (size_t)V * H), tdo = dev(R, (size_t)n * H), tord, truns;
    op_embedding_order(be, tok, n, &tord, &truns);
    be_embedding_backward(be, tdW, tdo, tt, tord, truns, n, H);
    float *dW = host(tdW);
    { /* one thread: the same bits (each id's rows summed in position order) */
        backend_t *one;
        sp_err err = {0};
        cr_assert_eq(backend_create(&one, be->name, 0, 1, &err), 0, "%s", err.msg);
        tensor_t dW1 = be_alloc(one, DT_F32, (size_t)V * H), o1, r1;
        op_embedding_order(one, tok, n, &o1, &r1);
        be_embedding_backward(one, dW1, tdo, tt, o1, r1, n, H);
        float *h1 = malloc(sizeof(float) * (size_t)V * H);
        be_download(one, h1, DT_F32, dW1);
        cr_expect_eq(memcmp(h1, dW, sizeof(float) * (size_t)V * H), 0,
                     "1 thread and 2 threads give other bits");
        free(h1);
        be_free(one, &dW1), be_free(one, &o1), be_free(one, &r1);
        backend_destroy(one);
    }
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
    be_free(be, &tord), be_free(be, &truns);
    free(W), free(R), free(got), free(dW), free(want);
}

/* embedding_order: the positions sorted by id, stably (each id's in
 * position order), and the runs of each id; ids negative and past 2^16 (the
 * sort's two digits) included. */
Test(ops, embedding_order_groups_positions_by_id_in_order)
{
    enum { N = 5000 };
    static int32_t tok[N], order[N], runs[N + 2];
    for (int i = 0; i < N; i++) {
        uint64_t r = sp_rng_u64(17, (uint64_t)i);
        tok[i] = i % 97 == 0 ? -1 - (int32_t)(r % 3)
                             : (int32_t)(r % 40) * (i % 2 ? 1 : 70001); /* repeats, and large */
    }
    cr_assert_eq(embedding_order(tok, N, order, runs), 0);
    int u = runs[0];
    cr_assert(u > 0 && u <= N, "%d runs", u);
    cr_expect_eq(runs[1], 0);
    cr_expect_eq(runs[1 + u], N);
    static unsigned char seen[N];
    memset(seen, 0, sizeof seen);
    for (int j = 0; j < u; j++) {
        cr_assert_lt(runs[1 + j], runs[2 + j], "run %d is empty", j);
        for (int k = runs[1 + j]; k < runs[2 + j]; k++) {
            cr_assert(order[k] >= 0 && order[k] < N && !seen[order[k]], "position %d", order[k]);
            seen[order[k]] = 1;
            cr_expect_eq(tok[order[k]], tok[order[runs[1 + j]]], "run %d mixes ids", j);
            if (k > runs[1 + j])
                cr_expect_lt(order[k - 1], order[k], "run %d out of position order", j);
        }
        if (j > 0) /* one run per id */
            for (int i = 0; i < j; i++)
                cr_expect_neq(tok[order[runs[1 + i]]], tok[order[runs[1 + j]]],
                              "id %d in two runs", tok[order[runs[1 + j]]]);
    }
    int32_t one = 5, o1, r1[3];
    cr_assert_eq(embedding_order(&one, 1, &o1, r1), 0);
    cr_expect(o1 == 0 && r1[0] == 1 && r1[1] == 0 && r1[2] == 1);
    cr_assert_eq(embedding_order(NULL, 0, NULL, r1), 0);
    cr_expect(r1[0] == 0 && r1[1] == 0, "no ids: no runs");
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
    be_cross_entropy(be, tx, tl, tt, rows, V, scale, (tensor_t){0});
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

/* The scale from device memory multiplies the argument (what a captured
 * step reads each time): 0.5 x 0.5 and 1 x 0.25 give 0.25's bits. */
Test(ops, cross_entropy_scale_from_device_memory)
{
    int rows = 3, V = 11;
    int32_t tg[3] = {4, -1, 10};
    float *x = rnd((size_t)rows * V, 6);
    tensor_t tt = talloc(DT_I32, (size_t)rows), tl = dev(NULL, (size_t)rows);
    be_upload(be, tt, tg, DT_I32);
    tensor_t want = dev(x, (size_t)rows * V);
    be_cross_entropy(be, want, tl, tt, rows, V, 0.25f, (tensor_t){0});
    float *hw = host(want);
    float args[2] = {0.5f, 1.0f}, devs[2] = {0.5f, 0.25f};
    for (int k = 0; k < 2; k++) {
        tensor_t tx = dev(x, (size_t)rows * V), ts = dev(&devs[k], 1);
        be_cross_entropy(be, tx, tl, tt, rows, V, args[k], ts);
        float *hx = host(tx);
        cr_expect_eq(memcmp(hx, hw, sizeof(float) * (size_t)rows * V), 0,
                     "%g x %g from device memory differs from 0.25", (double)args[k],
                     (double)devs[k]);
        free(hx);
    }
    free(x), free(hw);
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

/* Every op captured (the recorded op list) and replayed gives what it gives
 * eagerly, bit for bit (tests/op_checks.c, op_checks_replay). */
Test(ops, every_op_replays_as_recorded_on_cpu_and_cpu_ref)
{
    const char *kinds[] = {"cpu", "cpu-ref"};
    for (int k = 0; k < 2; k++) {
        backend_t *b;
        sp_err err = {0};
        cr_assert_eq(backend_create(&b, kinds[k], 0, 2, &err), 0, "%s", err.msg);
        int n = op_checks_replay(b);
        cr_expect_eq(n, 34, "%s: %d ops checked", kinds[k], n);
        backend_destroy(b);
    }
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

/* quantize_nf4 on cpu and cpu-ref: the codes and block maxima of
 * nf4_quantize_codes bit for bit, from F32 and from BF16 values (those
 * converted on upload), n = 16384 + 3 * 64 + 37 (a partial block,
 * an odd count) with a block of zeros and a NaN and an infinity in others. */
Test(ops, quantize_nf4_is_the_host_quantization)
{
    const char *kinds[] = {"cpu", "cpu-ref"};
    size_t n = 16384 + 3 * 64 + 37, nb = nf4_blocks(n), cb = nf4_code_bytes(n);
    float *x = rnd(n, 0.1f), *want_am = malloc(sizeof(float) * nb);
    float *got_am = malloc(sizeof(float) * nb), *xb = malloc(sizeof(float) * n), maps[272];
    uint8_t *want = malloc(cb), *got = malloc(cb), *bf = malloc(2 * n);
    cr_assert(want_am && got_am && xb && want && got && bf);
    memset(x + 64, 0, sizeof(float) * 64); /* block 1: zeros */
    x[200] = NAN;
    x[300] = INFINITY;
    memcpy(maps, nf4_quant_map, sizeof nf4_quant_map);
    memcpy(maps + 16, nf4_dynamic_map, sizeof nf4_dynamic_map);
    cr_assert_eq(dtype_convert(bf, DT_BF16, x, DT_F32, n), 0);
    cr_assert_eq(dtype_convert(xb, DT_F32, bf, DT_BF16, n), 0);
    for (int kind = 0; kind < 2; kind++)
        for (int src = 0; src < 2; src++) { /* F32, BF16 */
            backend_t *b2;
            sp_err err = {0};
            cr_assert_eq(backend_create(&b2, kinds[kind], 0, 2, &err), 0, "%s", err.msg);
            nf4_quantize_codes(src ? xb : x, n, want, want_am);
            /* the CPU's tensors are F32: BF16 values arrive converted */
            tensor_t tx = be_alloc(b2, DT_F32, n), tm = be_alloc(b2, DT_F32, 272);
            tensor_t tc = be_alloc(b2, DT_U8, cb), ta = be_alloc(b2, DT_F32, nb);
            be_upload(b2, tx, src ? (const void *)bf : (const void *)x, src ? DT_BF16 : DT_F32);
            be_upload(b2, tm, maps, DT_F32);
            be_quantize_nf4(b2, tc, ta, tx, tm, n);
            be_download(b2, got, DT_U8, tc);
            be_download(b2, got_am, DT_F32, ta);
            cr_assert_eq(be_check(b2, &err), 0, "%s", err.msg);
            cr_expect(memcmp(got, want, cb) == 0, "%s, %s values: codes differ", kinds[kind],
                      src ? "BF16" : "F32");
            cr_expect(memcmp(got_am, want_am, sizeof(float) * nb) == 0,
                      "%s, %s values: block maxima differ", kinds[kind], src ? "BF16" : "F32");
            cr_expect(want_am[1] == 0.0f && want[64 / 2] == (7 << 4 | 7),
                      "the zero block: maximum 0 and 0.0's code (7)");
            be_free(b2, &tx);
            be_free(b2, &tm);
            be_free(b2, &tc);
            be_free(b2, &ta);
            backend_destroy(b2);
        }
    free(x), free(want_am), free(got_am), free(xb), free(want), free(got), free(bf);
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
