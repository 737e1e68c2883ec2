/* The products as callers run them (backend.h: be_matmul, be_matmul_into,
 * be_matmul_ld, be_matmul_batched): sizes, strides and operands checked
 * here, once for every backend, then the backend's op. */
#include <stdint.h>
#include <stdlib.h>

#include "backend_check.h"

/* A strided batch of products (be_matmul_batched): batch of them, the
 * matrices of product b sa, sb, sc elements after product b - 1's. */
typedef struct mm_batch {
    int batch;
    size_t sa, sb, sc;
} mm_batch;

/* The elements a batch's operand spans (need: one product's; s: its
 * stride), and the shape that says so in a refusal (into buf). */
static size_t batch_need(const mm_batch *bt, size_t need, size_t s, const char *sname,
                         const char *shape, char *buf, size_t n)
{
    if (!bt || bt->batch <= 1) {
        snprintf(buf, n, "%s", shape);
        return need;
    }
    snprintf(buf, n, "(batch-1) x %s + %s", sname, shape);
    size_t head = mul((size_t)(bt->batch - 1), s);
    return head > SIZE_MAX - need ? SIZE_MAX : head + need;
}

/* The checks every product makes: sizes, C (the output, and the input C of
 * be_matmul_into when distinct), A and B as stored with their row strides
 * (the natural ones but for be_matmul_ld), one float dtype for A and B;
 * with bt, each operand spans its batch (the products' matrices may
 * interleave: the column blocks of one wider matrix). */
static call matmul_checks(backend_t *be, const char *op, const char *file, int line, tensor_t C,
                          tensor_t Cin, tensor_t A, tensor_t B, int M, int N, int K, int transA,
                          int transB, int lda, int ldb, int ldc, const mm_batch *bt)
{
    call c = begin(be, op, file, line);
    size_arg(&c, "M", M);
    size_arg(&c, "N", N);
    size_arg(&c, "K", K);
    if (bt)
        size_arg(&c, "batch", bt->batch);
    if (c.bad)
        return c;
    /* stored shapes: A is ar x ac, B is br x bc, C is M x N */
    int ar = transA ? K : M, ac = transA ? M : K, br = transB ? N : K, bc = transB ? K : N;
    if (ldc < N || (K > 0 && (lda < ac || ldb < bc))) {
        refuse(&c, "lda = %d, ldb = %d, ldc = %d must be at least the stored widths %d, %d, %d",
               lda, ldb, ldc, ac, bc, N);
        return c;
    }
    int natural = lda == ac && ldb == bc && ldc == N;
    const char *name = Cin.p ? "D" : "C";
    char shape[64];
    size_t need = natural ? mul((size_t)M, (size_t)N) : span2d(M, N, ldc);
    need = batch_need(bt, need, bt ? bt->sc : 0, "sc", natural ? "M x N" : "(M-1) x ldc + N",
                      shape, sizeof shape);
    tensor_arg(&c, name, C, need, shape, TAKES_FLOAT);
    if (Cin.p || Cin.n) {
        tensor_arg(&c, "C", Cin, mul((size_t)M, (size_t)N), "M x N", TAKES_FLOAT);
        const char *names[] = {"D", "C"};
        tensor_t ts[] = {C, Cin};
        same_dtype(&c, names, ts, 2, "D and C");
    }
    if (K > 0) { /* K == 0: C = beta C, A and B are not read */
        need = natural ? mul((size_t)M, (size_t)K) : span2d(ar, ac, lda);
        need = batch_need(bt, need, bt ? bt->sa : 0, "sa",
                          natural ? "M x K" : "(rows-1) x lda + cols", shape, sizeof shape);
        tensor_arg(&c, "A", A, need, shape, TAKES_FLOAT);
        need = natural ? mul((size_t)K, (size_t)N) : span2d(br, bc, ldb);
        need = batch_need(bt, need, bt ? bt->sb : 0, "sb",
                          natural ? "K x N" : "(rows-1) x ldb + cols", shape, sizeof shape);
        tensor_arg(&c, "B", B, need, shape, TAKES_FLOAT);
        const char *names[] = {"A", "B"};
        tensor_t ts[] = {A, B};
        same_dtype(&c, names, ts, 2, "the operands");
    }
    return c;
}

void be_matmul_at(const char *file, int line, backend_t *be, tensor_t C, tensor_t A, tensor_t B,
                  int M, int N, int K, int transA, int transB, float alpha, float beta)
{
    /* the natural row strides */
    be_matmul_ld_at(file, line, be, C, A, B, M, N, K, transA, transB, alpha, beta,
                    transA ? M : K, transB ? K : N, N);
}

void be_matmul_into_at(const char *file, int line, backend_t *be, tensor_t D, tensor_t A,
                       tensor_t B, tensor_t C, int M, int N, int K, int transA, int transB,
                       float alpha, float beta)
{
    if (D.p == C.p && D.dt == C.dt) {
        be_matmul_at(file, line, be, D, A, B, M, N, K, transA, transB, alpha, beta);
        return;
    }
    int lda = transA ? M : K, ldb = transB ? K : N;
    if (!C.p && !C.n)
        C.n = 1; /* absent: refused as "not allocated", not taken for no C */
    call c = matmul_checks(be, "matmul", file, line, D, C, A, B, M, N, K, transA, transB, lda, ldb,
                           N, NULL);
    size_t mn = (size_t)M * (size_t)N;
    if (c.bad || !mn)
        return;
    if (be->ops->matmul_cd) {
        BE_DISPATCH(0, be, matmul_cd, D, C, A, B, M, N, K, transA, transB, alpha, beta);
        return;
    }
    tensor_t d0 = tensor_view(D, 0, mn), c0 = tensor_view(C, 0, mn);
    BE_DISPATCH(beta == 0.0f, be, copy, d0, c0);
    BE_DISPATCH(0, be, matmul, D, A, B, M, N, K, transA, transB, alpha, beta, lda, ldb, N);
}

void be_matmul_ld_at(const char *file, int line, backend_t *be, tensor_t C, tensor_t A,
                     tensor_t B, int M, int N, int K, int transA, int transB, float alpha,
                     float beta, int lda, int ldb, int ldc)
{
    tensor_t none = {0};
    call c = matmul_checks(be, "matmul", file, line, C, none, A, B, M, N, K, transA, transB, lda,
                           ldb, ldc, NULL);
    BE_DISPATCH(c.bad, be, matmul, C, A, B, M, N, K, transA, transB, alpha, beta, lda, ldb, ldc);
}

void be_matmul_batched_at(const char *file, int line, backend_t *be, tensor_t C, tensor_t A,
                          tensor_t B, int M, int N, int K, int transA, int transB, float alpha,
                          float beta, int lda, int ldb, int ldc, int batch, size_t sa, size_t sb,
                          size_t sc)
{
    tensor_t none = {0};
    mm_batch bt = {batch, sa, sb, sc};
    call c = matmul_checks(be, "matmul_batched", file, line, C, none, A, B, M, N, K, transA,
                           transB, lda, ldb, ldc, &bt);
    if (c.bad || batch == 0 || M == 0 || N == 0)
        return;
    if (be->ops->matmul_batched) {
        BE_DISPATCH(0, be, matmul_batched, C, A, B, M, N, K, transA, transB, alpha, beta, lda, ldb,
                    ldc, batch, (unsigned long)sa, (unsigned long)sb, (unsigned long)sc);
        return;
    }
    for (int b = 0; b < batch; b++) { /* views of each product's matrices */
        size_t cn = (size_t)(M - 1) * (size_t)ldc + (size_t)N;
        size_t an = K ? (size_t)((transA ? K : M) - 1) * (size_t)lda + (size_t)(transA ? M : K) : 0;
        size_t bn = K ? (size_t)((transB ? N : K) - 1) * (size_t)ldb + (size_t)(transB ? K : N) : 0;
        tensor_t Cb = tensor_view(C, (size_t)b * sc, cn);
        tensor_t Ab = K ? tensor_view(A, (size_t)b * sa, an) : A;
        tensor_t Bb = K ? tensor_view(B, (size_t)b * sb, bn) : B;
        BE_DISPATCH(0, be, matmul, Cb, Ab, Bb, M, N, K, transA, transB, alpha, beta, lda, ldb,
                    ldc);
    }
}
