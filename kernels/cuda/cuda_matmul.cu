/* kernels/cuda/cuda_matmul.cu — every matmul of the backend (the op, and the
 * batched products inside attention) through cuBLASLt: BF16 (or F32)
 * operands, fp32 accumulation (CUBLAS_COMPUTE_32F), C in BF16 or F32.
 *
 * Row-major C[M,N] = op(A) op(B) is column-major C^T[N,M] = op(B)^T op(A)^T,
 * so cuBLASLt sees B as its first operand and A as its second. A plan (the
 * matmul descriptor, the three layouts and the heuristic's algorithm) is
 * built once per (shape, transposes, dtypes, leading dimensions, batch,
 * alignment, beta == 0) and kept in a cache for the backend's lifetime; the
 * workspace is allocated once. When cuBLASLt offers no algorithm for a
 * plan, or refuses one at run time, the plan falls back to
 * cublasGemmStridedBatchedEx, which takes any alignment. */
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

#define MM_WORKSPACE_BYTES ((size_t)32 << 20) /* cuBLAS's advice for Hopper */

typedef struct mm_key {
    int M, N, K, transA, transB, adt, bdt, cdt, batch, beta_zero;
    int align_a, align_b, align_c, pad;
    int64_t lda, ldb, ldc, sa, sb, sc;
} mm_key;

typedef struct mm_plan {
    mm_key key;
    int use_lt; /* 0: cublasGemmStridedBatchedEx */
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc; /* cuBLASLt's A (our B), B (our A), C = D */
    cublasLtMatmulAlgo_t algo;
} mm_plan;

struct mm_cache {
    mm_plan *plans;
    int n, cap;
    int last; /* the previous hit, tried first */
};

extern "C" int cuda_mm_init(backend_t *be)
{
    cuda_impl *im = CUDA_IMPL(be);
    im->mm = (mm_cache *)calloc(1, sizeof *im->mm);
    if (!im->mm) {
        cuda_fail(be, __FILE__, __LINE__, "out of host memory for the matmul cache");
        return -1;
    }
    /* the workspace, then the skinny products' counters (cuda_skinny.cu),
     * zero between its launches */
    size_t counters = sizeof(unsigned) * CUDA_SKINNY_COUNTERS;
    if (CUDA_OK(be, cudaMalloc(&im->mm_ws, MM_WORKSPACE_BYTES + counters)))
        return -1;
    im->mm_ws_bytes = MM_WORKSPACE_BYTES;
    im->skinny_count = (unsigned *)((char *)im->mm_ws + MM_WORKSPACE_BYTES);
    if (CUDA_OK(be, cudaMemsetAsync(im->skinny_count, 0, counters, im->stream)))
        return -1;
    be->bytes_in_use += MM_WORKSPACE_BYTES + counters;
    if (be->bytes_in_use > be->bytes_peak)
        be->bytes_peak = be->bytes_in_use;
    return CUBLAS_OK(be, cublasSetWorkspace(im->blas, im->mm_ws, im->mm_ws_bytes));
}

static void plan_release(mm_plan *p)
{
    if (p->lc)
        cublasLtMatrixLayoutDestroy(p->lc);
    if (p->lb)
        cublasLtMatrixLayoutDestroy(p->lb);
    if (p->la)
        cublasLtMatrixLayoutDestroy(p->la);
    if (p->op)
        cublasLtMatmulDescDestroy(p->op);
    p->lc = p->lb = p->la = NULL;
    p->op = NULL;
}

extern "C" void cuda_mm_destroy(backend_t *be)
{
    cuda_impl *im = CUDA_IMPL(be);
    if (im->mm) {
        for (int i = 0; i < im->mm->n; i++)
            plan_release(&im->mm->plans[i]);
        free(im->mm->plans);
        free(im->mm);
        im->mm = NULL;
    }
    if (im->mm_ws) {
        cudaFree(im->mm_ws);
        be->bytes_in_use -= im->mm_ws_bytes + sizeof(unsigned) * CUDA_SKINNY_COUNTERS;
        im->mm_ws = NULL;
        im->skinny_count = NULL;
    }
}

static cudaDataType_t cuda_type(int dt)
{
    return dt == DT_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

/* The largest power of two (<= 256) dividing the address and, since every
 * row and batch starts there too, the row and batch strides in bytes. */
static int alignment(const void *p, int64_t ld, int batch, int64_t stride, size_t esz)
{
    uintptr_t v = (uintptr_t)p | (uintptr_t)((size_t)ld * esz);
    if (batch > 1)
        v |= (uintptr_t)((size_t)stride * esz);
    int a = 256;
    while (a > 1 && (v & (uintptr_t)(a - 1)))
        a >>= 1;
    return a;
}

static int layout(backend_t *be, cublasLtMatrixLayout_t *l, int dt, uint64_t rows, uint64_t cols,
                  int64_t ld, int batch, int64_t stride)
{
    if (CUBLAS_OK(be, cublasLtMatrixLayoutCreate(l, cuda_type(dt), rows, cols, ld)))
        return -1;
    if (batch > 1) {
        int32_t b = batch;
        if (CUBLAS_OK(be, cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                           &b, sizeof b)) ||
            CUBLAS_OK(be, cublasLtMatrixLayoutSetAttribute(
                              *l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                              sizeof stride)))
            return -1;
    }
    return 0;
}

/* Builds the cuBLASLt objects of a plan and asks the heuristic for one
 * algorithm; use_lt stays 0 when it has none (the fallback then serves). */
static int plan_build(backend_t *be, mm_plan *p)
{
    cuda_impl *im = CUDA_IMPL(be);
    const mm_key *k = &p->key;
    cublasOperation_t ta = k->transB ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t tb = k->transA ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (CUBLAS_OK(be, cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F)) ||
        CUBLAS_OK(be, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta,
                                                     sizeof ta)) ||
        CUBLAS_OK(be, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb,
                                                     sizeof tb)))
        return -1;
    /* stored shapes, column-major: our B is N x K (K x N when transposed) */
    if (layout(be, &p->la, k->bdt, k->transB ? k->K : k->N, k->transB ? k->N : k->K, k->ldb,
               k->batch, k->sb) ||
        layout(be, &p->lb, k->adt, k->transA ? k->M : k->K, k->transA ? k->K : k->M, k->lda,
               k->batch, k->sa) ||
        layout(be, &p->lc, k->cdt, k->N, k->M, k->ldc, k->batch, k->sc))
        return -1;
    cublasLtMatmulPreference_t pref;
    if (CUBLAS_OK(be, cublasLtMatmulPreferenceCreate(&pref)))
        return -1;
    uint64_t ws = im->mm_ws_bytes;
    uint32_t al_a = (uint32_t)k->align_b, al_b = (uint32_t)k->align_a, al_c = (uint32_t)k->align_c;
    int rc = CUBLAS_OK(be, cublasLtMatmulPreferenceSetAttribute(
                               pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws)) ||
             CUBLAS_OK(be, cublasLtMatmulPreferenceSetAttribute(
                               pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a,
                               sizeof al_a)) ||
             CUBLAS_OK(be, cublasLtMatmulPreferenceSetAttribute(
                               pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b,
                               sizeof al_b)) ||
             CUBLAS_OK(be, cublasLtMatmulPreferenceSetAttribute(
                               pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c,
                               sizeof al_c)) ||
             CUBLAS_OK(be, cublasLtMatmulPreferenceSetAttribute(
                               pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c,
                               sizeof al_c));
    if (!rc) {
        cublasLtMatmulHeuristicResult_t res;
        int found = 0;
        memset(&res, 0, sizeof res);
        /* "not supported" here is an answer (no algorithm), not a failure */
        cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(im->lt, p->op, p->la, p->lb, p->lc,
                                                          p->lc, pref, 1, &res, &found);
        if (s == CUBLAS_STATUS_SUCCESS && found > 0 && res.state == CUBLAS_STATUS_SUCCESS) {
            p->algo = res.algo;
            p->use_lt = 1;
        } else if (s != CUBLAS_STATUS_SUCCESS && s != CUBLAS_STATUS_NOT_SUPPORTED) {
            rc = CUBLAS_OK(be, s);
        }
    }
    cublasLtMatmulPreferenceDestroy(pref);
    return rc ? -1 : 0;
}

static mm_plan *plan_get(backend_t *be, const mm_key *key)
{
    mm_cache *c = CUDA_IMPL(be)->mm;
    if (c->last < c->n && memcmp(&c->plans[c->last].key, key, sizeof *key) == 0)
        return &c->plans[c->last];
    for (int i = 0; i < c->n; i++)
        if (memcmp(&c->plans[i].key, key, sizeof *key) == 0) {
            c->last = i;
            return &c->plans[i];
        }
    if (c->n == c->cap) {
        int cap = c->cap ? 2 * c->cap : 64;
        mm_plan *np = (mm_plan *)realloc(c->plans, sizeof *np * (size_t)cap);
        if (!np) {
            cuda_fail(be, __FILE__, __LINE__, "out of host memory for the matmul cache");
            return NULL;
        }
        c->plans = np;
        c->cap = cap;
    }
    mm_plan *p = &c->plans[c->n];
    memset(p, 0, sizeof *p);
    p->key = *key;
    if (plan_build(be, p)) {
        plan_release(p);
        return NULL;
    }
    c->last = c->n++;
    return p;
}

static int run_fallback(backend_t *be, const mm_key *k, const void *A, const void *B, void *C,
                        float alpha, float beta)
{
    cuda_impl *im = CUDA_IMPL(be);
    return CUBLAS_OK(
        be, cublasGemmStridedBatchedEx(
                im->blas, k->transB ? CUBLAS_OP_T : CUBLAS_OP_N,
                k->transA ? CUBLAS_OP_T : CUBLAS_OP_N, k->N, k->M, k->K, &alpha, B,
                cuda_type(k->bdt), (int)k->ldb, k->sb, A, cuda_type(k->adt), (int)k->lda, k->sa,
                &beta, C, cuda_type(k->cdt), (int)k->ldc, k->sc, k->batch, CUBLAS_COMPUTE_32F,
                CUBLAS_GEMM_DEFAULT));
}

/* C := Cin, [M, N] of each batch with C's strides (the paths that compute
 * in place) */
static void copy_into(backend_t *be, const gemm_desc *d, const void *Cin, void *C)
{
    size_t es = dtype_size(d->cdt);
    for (int b = 0; b < d->batch && !be->err.code; b++)
        CUDA_OK(be, cudaMemcpy2DAsync((char *)C + (size_t)b * d->sc * es, (size_t)d->ldc * es,
                                      (const char *)Cin + (size_t)b * d->sc * es,
                                      (size_t)d->ldc * es, (size_t)d->N * es, (size_t)d->M,
                                      cudaMemcpyDeviceToDevice, CUDA_IMPL(be)->stream));
}

extern "C" void cuda_gemm(backend_t *be, const gemm_desc *d, const void *A, const void *B,
                          void *C, float alpha, float beta)
{
    cuda_gemm_cd(be, d, A, B, C, C, alpha, beta);
}

extern "C" void cuda_gemm_cd(backend_t *be, const gemm_desc *d, const void *A, const void *B,
                             const void *Cin, void *C, float alpha, float beta)
{
    if (be->err.code || !GEMM_DTYPES_OK(be, d) || d->M <= 0 || d->N <= 0 || d->batch <= 0)
        return;
    mm_key key;
    memset(&key, 0, sizeof key); /* padding too: keys compare with memcmp */
    key.M = d->M;
    key.N = d->N;
    key.K = d->K;
    key.transA = d->transA;
    key.transB = d->transB;
    key.adt = d->adt;
    key.bdt = d->bdt;
    key.cdt = d->cdt;
    key.batch = d->batch;
    key.beta_zero = beta == 0.0f;
    key.lda = d->lda;
    key.ldb = d->ldb;
    key.ldc = d->ldc;
    key.sa = d->batch > 1 ? d->sa : 0;
    key.sb = d->batch > 1 ? d->sb : 0;
    key.sc = d->batch > 1 ? d->sc : 0;
    key.align_a = alignment(A, d->lda, d->batch, d->sa, dtype_size(d->adt));
    key.align_b = alignment(B, d->ldb, d->batch, d->sb, dtype_size(d->bdt));
    key.align_c = alignment(C, d->ldc, d->batch, d->sc, dtype_size(d->cdt));
    if (Cin != C) { /* cuBLASLt reads Cin and writes C: both aligned so */
        int a = alignment(Cin, d->ldc, d->batch, d->sc, dtype_size(d->cdt));
        key.align_c = a < key.align_c ? a : key.align_c;
    }
    int in_place_from = Cin != C && beta != 0.0f; /* paths that need C := Cin first */
    if (d->K == 0) { /* no products: C = beta C */
        if (in_place_from)
            copy_into(be, d, Cin, C);
        for (int b = 0; b < d->batch && !be->err.code; b++)
            for (int r = 0; r < d->M; r++)
                cuda_scale(be, (char *)C + ((size_t)b * d->sc + (size_t)r * d->ldc) *
                                               dtype_size(d->cdt),
                           d->cdt, (size_t)d->N, beta);
        return;
    }
    mm_plan *p = plan_get(be, &key);
    if (!p)
        return;
    cuda_impl *im = CUDA_IMPL(be);
    if (p->use_lt) {
        cublasStatus_t s = cublasLtMatmul(im->lt, p->op, &alpha, B, p->la, A, p->lb, &beta,
                                          beta != 0.0f ? Cin : C, p->lc, C, p->lc, &p->algo,
                                          im->mm_ws, im->mm_ws_bytes, im->stream);
        if (s == CUBLAS_STATUS_SUCCESS)
            return;
        if (s != CUBLAS_STATUS_NOT_SUPPORTED) {
            CUBLAS_OK(be, s);
            return;
        }
        p->use_lt = 0; /* refused at run time: the fallback serves this plan from now on */
    }
    if (in_place_from)
        copy_into(be, d, Cin, C);
    run_fallback(be, &key, A, B, C, alpha, beta);
}
