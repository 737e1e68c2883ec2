/* tests/cuda_emu/test_emu_cublas_api.cc — the emulated cuBLAS and cuBLASLt
 * themselves (emu_cublas.cc), called as cuda_matmul.cu calls them: a
 * column-major product with each transpose, batched with strides, against
 * a plain loop over the documented definition (exact: the same fp32 sums
 * in the same order, F32 throughout); and each refusal the backend relies
 * on the emulator to make as the library would: an ld below its rows,
 * shapes that do not agree, an attribute of the wrong size, an algorithm
 * used for another problem, a matrix less aligned than its algorithm was
 * found for, too little workspace, C == D with two layouts. Runs in every
 * build, the sanitizer build included. C++ only because the emulated
 * runtime is; written in the C style of the rest. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_emu_runtime.h"

#define S_OK CUBLAS_STATUS_SUCCESS

static cublasLtHandle_t lt;

static void setup(void)
{
    cr_assert_eq(cublasLtCreate(&lt), S_OK);
}

static void teardown(void)
{
    cublasLtDestroy(lt);
}

TestSuite(emu_cublas_api, .init = setup, .fini = teardown, .timeout = 30);

typedef struct problem {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
    size_t ws;
} problem;

/* a preference: at most ws bytes of workspace, every matrix aligned to al */
static cublasLtMatmulPreference_t pref_new(uint64_t ws, uint32_t al)
{
    cublasLtMatmulPreference_t pref;
    cr_assert_eq(cublasLtMatmulPreferenceCreate(&pref), S_OK);
    cr_assert_eq(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &ws, sizeof ws), S_OK);
    for (int i = 0; i < 4; i++)
        cr_assert_eq(cublasLtMatmulPreferenceSetAttribute(
                         pref, (cublasLtMatmulPreferenceAttributes_t)(
                                   CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES + i),
                         &al, sizeof al), S_OK);
    return pref;
}

/* op(A) m x k, op(B) k x n, F32, column-major, ld = rows + pad, batch with
 * strides of the matrices' sizes; its algorithm found with alignment al */
static void make(problem *p, int ta, int tb, int m, int n, int k, int pad, int batch,
                 uint32_t al, uint64_t ws)
{
    int32_t opa = ta, opb = tb;
    cr_assert_eq(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), S_OK);
    cr_assert_eq(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa,
                                                sizeof opa), S_OK);
    cr_assert_eq(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb,
                                                sizeof opb), S_OK);
    int ra = ta ? k : m, ca = ta ? m : k, rb = tb ? n : k, cb = tb ? k : n;
    cublasLtMatrixLayout_t *ls[3] = {&p->a, &p->b, &p->c};
    int rows[3] = {ra, rb, m}, cols[3] = {ca, cb, n};
    for (int i = 0; i < 3; i++) {
        int64_t ld = rows[i] + pad, stride = ld * cols[i];
        cr_assert_eq(cublasLtMatrixLayoutCreate(ls[i], CUDA_R_32F, (uint64_t)rows[i],
                                                (uint64_t)cols[i], ld), S_OK);
        cr_assert_eq(cublasLtMatrixLayoutSetAttribute(*ls[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                      &batch, sizeof batch), S_OK);
        cr_assert_eq(cublasLtMatrixLayoutSetAttribute(
                         *ls[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                         sizeof stride), S_OK);
    }
    cublasLtMatmulPreference_t pref = pref_new(ws, al);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    cr_assert_eq(cublasLtMatmulAlgoGetHeuristic(lt, p->op, p->a, p->b, p->c, p->c, pref, 1, &res,
                                                &found), S_OK);
    cr_assert_eq(found, 1);
    cr_assert_eq(res.state, S_OK);
    p->algo = res.algo;
    p->ws = res.workspaceSize;
    cublasLtMatmulPreferenceDestroy(pref);
}

static void release(problem *p)
{
    cublasLtMatrixLayoutDestroy(p->a);
    cublasLtMatrixLayoutDestroy(p->b);
    cublasLtMatrixLayoutDestroy(p->c);
    cublasLtMatmulDescDestroy(p->op);
}

static float *values(size_t n, float scale)
{
    float *v = (float *)malloc(sizeof(float) * n);
    cr_assert(v);
    for (size_t i = 0; i < n; i++)
        v[i] = scale * (float)((int)((i * 7919u) % 23u) - 11);
    return v;
}

/* D = alpha op(A) op(B) + beta C for every transpose pair, 2 batches, ld
 * padded by 2: each element equal to the definition's loop */
Test(emu_cublas_api, the_column_major_definition)
{
    const int m = 5, n = 4, k = 3, pad = 2, batch = 2;
    for (int t = 0; t < 4; t++) {
        int ta = t & 1, tb = t >> 1;
        problem p;
        make(&p, ta, tb, m, n, k, pad, batch, 4, 1 << 20);
        int lda = (ta ? k : m) + pad, ldb = (tb ? n : k) + pad, ldc = m + pad;
        size_t sa = (size_t)lda * (ta ? m : k), sb = (size_t)ldb * (tb ? k : n),
               sc = (size_t)ldc * n;
        float *A = values(sa * batch, 0.25f), *B = values(sb * batch, 0.5f);
        float *C = values(sc * batch, 1.0f), *D = values(sc * batch, 0.0f);
        float alpha = 1.5f, beta = -0.5f;
        void *ws = malloc(p.ws ? p.ws : 1);
        cr_assert_eq(cublasLtMatmul(lt, p.op, &alpha, A, p.a, B, p.b, &beta, C, p.c, D, p.c,
                                    &p.algo, ws, p.ws, NULL), S_OK);
        for (int b = 0; b < batch; b++)
            for (int j = 0; j < n; j++)
                for (int i = 0; i < m; i++) {
                    float acc = 0.0f;
                    for (int q = 0; q < k; q++) {
                        float x = ta ? A[b * sa + q + (size_t)i * lda] : A[b * sa + i + (size_t)q * lda];
                        float y = tb ? B[b * sb + j + (size_t)q * ldb] : B[b * sb + q + (size_t)j * ldb];
                        acc += x * y;
                    }
                    size_t o = b * sc + i + (size_t)j * ldc;
                    float want = alpha * acc + beta * C[o];
                    cr_expect_eq(D[o], want, "op %d%d batch %d D[%d,%d] %g, want %g", ta, tb, b,
                                 i, j, D[o], want);
                }
        /* the padding rows of D are not written */
        for (int b = 0; b < batch; b++)
            for (int j = 0; j < n; j++)
                for (int i = m; i < ldc; i++)
                    cr_expect_eq(D[b * sc + i + (size_t)j * ldc], 0.0f);
        free(A), free(B), free(C), free(D), free(ws);
        release(&p);
    }
}

Test(emu_cublas_api, what_the_library_refuses_is_refused)
{
    problem p, q;
    make(&p, 0, 0, 8, 8, 8, 0, 1, 16, 1 << 20);
    make(&q, 0, 1, 8, 8, 8, 0, 1, 16, 1 << 20);
    float *buf = (float *)aligned_alloc(256, 4096 * sizeof(float));
    cr_assert(buf);
    memset(buf, 0, 4096 * sizeof(float));
    float *A = buf, *B = buf + 512, *C = buf + 1024, one = 1.0f, zero = 0.0f;
    void *ws = malloc(p.ws);
    cr_assert(p.ws > 0);
    cr_expect_eq(cublasLtMatmul(lt, p.op, &one, A, p.a, B, p.b, &zero, C, p.c, C, p.c, &p.algo, ws,
                                p.ws, NULL), S_OK);
    /* an algorithm found for another problem (B transposed) */
    cr_expect_eq(cublasLtMatmul(lt, p.op, &one, A, p.a, B, p.b, &zero, C, p.c, C, p.c, &q.algo, ws,
                                q.ws, NULL), CUBLAS_STATUS_INVALID_VALUE);
    /* a matrix 4-byte aligned for an algorithm found for 16 */
    cr_expect_eq(cublasLtMatmul(lt, p.op, &one, A + 1, p.a, B, p.b, &zero, C, p.c, C, p.c, &p.algo,
                                ws, p.ws, NULL), CUBLAS_STATUS_INVALID_VALUE);
    /* less workspace than the algorithm was found with */
    cr_expect_eq(cublasLtMatmul(lt, p.op, &one, A, p.a, B, p.b, &zero, C, p.c, C, p.c, &p.algo, ws,
                                p.ws - 1, NULL), CUBLAS_STATUS_INVALID_VALUE);
    /* C == D with two layouts (another ld) */
    cublasLtMatrixLayout_t wide;
    cr_assert_eq(cublasLtMatrixLayoutCreate(&wide, CUDA_R_32F, 8, 8, 16), S_OK);
    cublasLtMatmulPreference_t pref = pref_new(p.ws, 16);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    cr_assert_eq(cublasLtMatmulAlgoGetHeuristic(lt, p.op, p.a, p.b, wide, p.c, pref, 1, &res,
                                                &found), S_OK);
    cr_assert_eq(found, 1);
    cr_expect_eq(cublasLtMatmul(lt, p.op, &one, A, p.a, B, p.b, &one, C, wide, C + 1024, p.c,
                                &res.algo, ws, p.ws, NULL), S_OK);
    cr_expect_eq(cublasLtMatmul(lt, p.op, &one, A, p.a, B, p.b, &one, C, wide, C, p.c, &res.algo,
                                ws, p.ws, NULL), CUBLAS_STATUS_INVALID_VALUE);
    /* an ld below its rows; shapes that do not agree */
    cublasLtMatrixLayout_t thin, tall;
    cr_assert_eq(cublasLtMatrixLayoutCreate(&thin, CUDA_R_32F, 8, 8, 7), S_OK);
    cr_assert_eq(cublasLtMatrixLayoutCreate(&tall, CUDA_R_32F, 9, 8, 9), S_OK);
    found = 7;
    cr_expect_eq(cublasLtMatmulAlgoGetHeuristic(lt, p.op, thin, p.b, p.c, p.c, pref, 1, &res,
                                                &found), CUBLAS_STATUS_INVALID_VALUE);
    cr_expect_eq(found, 0);
    cr_expect_eq(cublasLtMatmulAlgoGetHeuristic(lt, p.op, tall, p.b, p.c, p.c, pref, 1, &res,
                                                &found), CUBLAS_STATUS_INVALID_VALUE);
    /* BF16 operands into an F32 C but a BF16 D: not a supported combination */
    cublasLtMatrixLayout_t h16;
    cr_assert_eq(cublasLtMatrixLayoutCreate(&h16, CUDA_R_16BF, 8, 8, 8), S_OK);
    cr_expect_eq(cublasLtMatmulAlgoGetHeuristic(lt, p.op, h16, h16, p.c, h16, pref, 1, &res,
                                                &found), CUBLAS_STATUS_NOT_SUPPORTED);
    /* attributes of the wrong size (TRANSA is int32_t, the workspace
     * uint64_t, an alignment uint32_t and a power of two) */
    int64_t big = 1;
    uint32_t small = 1024, three = 3;
    cr_expect_eq(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &big, sizeof big),
                 CUBLAS_STATUS_INVALID_VALUE);
    cr_expect_eq(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &small, sizeof small),
                 CUBLAS_STATUS_INVALID_VALUE);
    cr_expect_eq(cublasLtMatmulPreferenceSetAttribute(
                     pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &three, sizeof three),
                 CUBLAS_STATUS_INVALID_VALUE);
    /* the fallback: ldb below k */
    cublasHandle_t h;
    cr_assert_eq(cublasCreate(&h), S_OK);
    cr_expect_eq(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 8, 8, 8, &one, A,
                                            CUDA_R_32F, 8, 0, B, CUDA_R_32F, 7, 0, &zero, C,
                                            CUDA_R_32F, 8, 0, 1, CUBLAS_COMPUTE_32F,
                                            CUBLAS_GEMM_DEFAULT),
                 CUBLAS_STATUS_INVALID_VALUE);
    cr_expect_eq(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_T, 8, 8, 8, &one, A,
                                            CUDA_R_32F, 8, 0, B, CUDA_R_32F, 8, 0, &zero, C,
                                            CUDA_R_32F, 8, 0, 1, CUBLAS_COMPUTE_32F,
                                            CUBLAS_GEMM_DEFAULT), S_OK);
    cublasDestroy(h);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(wide);
    cublasLtMatrixLayoutDestroy(thin);
    cublasLtMatrixLayoutDestroy(tall);
    cublasLtMatrixLayoutDestroy(h16);
    release(&p);
    release(&q);
    free(ws);
    free(buf);
}
