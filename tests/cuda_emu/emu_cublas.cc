/* tests/cuda_emu/emu_cublas.cc — cuBLAS and cuBLASLt on the emulated
 * device: the calls kernels/cuda/cuda_matmul.cu makes (handles, the
 * workspace, the matmul descriptor, layouts, preferences, the heuristic,
 * cublasLtMatmul, the fallback cublasGemmStridedBatchedEx, and the
 * doctor's cublasGemmEx), written
 * from their documentation, not from the backend: column-major matrices
 * (the layout's rows, columns and leading dimension, ld >= rows), op(A) is
 * m x k, op(B) k x n, C and D m x n, one batch count for all four with
 * strides in elements, D = alpha op(A) op(B) + beta C (C not read when beta
 * is 0; C == D only with one layout), attribute values of the documented
 * types and sizes, an algorithm valid only for the problem it was found
 * for, with the workspace and the alignments it was chosen for. What the
 * library would refuse, this refuses (CUBLAS_STATUS_INVALID_VALUE or
 * NOT_SUPPORTED, with a line on stderr naming the reason), so the backend's
 * row-major-to-column-major mapping, its plan cache and its fallback run
 * here as they will on a GPU, and the emulated suites check their products
 * against the CPU backend.
 *
 * Each product is a plain loop: fp32 accumulation over k in order
 * (CUBLAS_COMPUTE_32F), D in BF16 (rounded to nearest even) or F32, run in
 * stream order (recorded while the stream is captured; host-mode alpha and
 * beta read at the call).
 *
 * SPOTUNE_CUDA_EMU_CUBLASLT chooses what cuBLASLt does, read at each call:
 * unset or "on", an algorithm for every supported problem; "no-algorithm",
 * the heuristic finds none (CUBLAS_STATUS_NOT_SUPPORTED, as for a problem
 * no kernel takes), so the backend must use the fallback; "refuses",
 * cublasLtMatmul answers CUBLAS_STATUS_NOT_SUPPORTED without running (as
 * the library may for an algorithm at run time). spotune_emu_blas_counts()
 * tells how many products took each path.
 *
 * SPOTUNE_CUDA_EMU_CUBLAS=corrupt: every product's last element (of each
 * batch) comes out 1 too large, as from a GPU whose arithmetic fails
 * silently (for the doctor's check of its GEMM's results). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_emu_runtime.h"
#include "emu_bf16.h"

#define ALGO_MAGIC 0x656d75636c74616cull /* "emucltal" */
#define ALGO_WORKSPACE ((size_t)1 << 20) /* what an algorithm needs when offered it */

struct emu_blas {
    cudaStream_t stream;
    void *ws;
    size_t ws_bytes;
};

struct emu_lt_desc {
    int compute, scale, transa, transb;
};

struct emu_lt_layout {
    int type;
    uint64_t rows, cols;
    int64_t ld;
    int32_t batch;
    int64_t stride;
};

struct emu_lt_pref {
    uint64_t max_ws;
    uint32_t align[4]; /* A, B, C, D */
};

static long n_lt, n_fallback, n_refused;

/* how many products cublasLtMatmul ran, how many cublasGemmStridedBatchedEx
 * (or cublasGemmEx) ran, and how many cublasLtMatmul refused ("refuses"
 * mode) */
extern "C" void spotune_emu_blas_counts(long counts[3])
{
    counts[0] = n_lt;
    counts[1] = n_fallback;
    counts[2] = n_refused;
}

static cublasStatus_t refuse(cublasStatus_t s, const char *call, const char *why)
{
    fprintf(stderr, "emulated %s: %s\n", call, why);
    return s;
}

static int lt_mode_is(const char *m)
{
    const char *env = getenv("SPOTUNE_CUDA_EMU_CUBLASLT");
    return env && strcmp(env, m) == 0;
}

/* ---- values ------------------------------------------------------------------------ */

static size_t type_size(int t)
{
    return t == CUDA_R_16BF ? 2 : 4;
}

static float load(const void *p, int t, size_t i)
{
    return t == CUDA_R_16BF ? emu_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static void store(void *p, int t, size_t i, float v)
{
    if (t == CUDA_R_16BF)
        ((uint16_t *)p)[i] = emu_f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* The combinations of the documentation's table that the backend may ask
 * for, with CUBLAS_COMPUTE_32F and a CUDA_R_32F scale: BF16 x BF16 into
 * BF16 or F32, and F32 throughout. */
static int types_supported(int a, int b, int c)
{
    return a == b && ((a == CUDA_R_16BF && (c == CUDA_R_16BF || c == CUDA_R_32F)) ||
                      (a == CUDA_R_32F && c == CUDA_R_32F));
}

/* ---- the product ------------------------------------------------------------------- */

typedef struct gemm_cm {
    int transa, transb, m, n, k, batch, at, bt, ct, pad; /* no padding: fingerprint() */
    int64_t lda, ldb, ldc, ldd, sa, sb, sc, sd;
} gemm_cm;

/* D = alpha op(A) op(B) + beta C, column-major, batch by batch: op(A)'s
 * rows and op(B)'s columns are gathered into fp32 first, each element of D
 * a dot product over k in order. */
static void gemm_run(gemm_cm g, float alpha, const void *A, const void *B, float beta,
                     const void *C, void *D)
{
    size_t k = g.k > 0 ? (size_t)g.k : 0, kk = k ? k : 1;
    const char *fault = getenv("SPOTUNE_CUDA_EMU_CUBLAS");
    int corrupt = fault && strcmp(fault, "corrupt") == 0;
    float *ra = (float *)malloc(sizeof(float) * (size_t)g.m * kk);
    float *cb = (float *)malloc(sizeof(float) * (size_t)g.n * kk);
    if (!ra || !cb) {
        fprintf(stderr, "emulated cuBLAS: out of host memory\n");
        abort();
    }
    for (int b = 0; b < g.batch; b++) {
        size_t oa = (size_t)b * (size_t)g.sa, ob = (size_t)b * (size_t)g.sb;
        size_t oc = (size_t)b * (size_t)g.sc, od = (size_t)b * (size_t)g.sd;
        for (int i = 0; i < g.m; i++) /* op(A)[i, p] */
            for (size_t p = 0; p < k; p++)
                ra[i * k + p] = load(A, g.at, oa + (g.transa ? p + (size_t)i * g.lda
                                                            : (size_t)i + p * g.lda));
        for (int j = 0; j < g.n; j++) /* op(B)[p, j] */
            for (size_t p = 0; p < k; p++)
                cb[j * k + p] = load(B, g.bt, ob + (g.transb ? (size_t)j + p * g.ldb
                                                            : p + (size_t)j * g.ldb));
        for (int j = 0; j < g.n; j++)
            for (int i = 0; i < g.m; i++) {
                const float *x = ra + i * k, *y = cb + j * k;
                float acc = 0.0f;
                for (size_t p = 0; p < k; p++)
                    acc += x[p] * y[p];
                float v = alpha * acc;
                if (beta != 0.0f)
                    v += beta * load(C, g.ct, oc + (size_t)i + (size_t)j * g.ldc);
                store(D, g.ct, od + (size_t)i + (size_t)j * g.ldd, v);
            }
        if (corrupt && g.m > 0 && g.n > 0) { /* D's last element of each batch off by one */
            size_t last = od + (size_t)(g.m - 1) + (size_t)(g.n - 1) * g.ldd;
            store(D, g.ct, last, load(D, g.ct, last) + 1.0f);
        }
    }
    free(ra);
    free(cb);
}

/* ---- cuBLAS ------------------------------------------------------------------------ */

cublasStatus_t cublasCreate(cublasHandle_t *h)
{
    *h = (emu_blas *)calloc(1, sizeof(emu_blas));
    return *h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_ALLOC_FAILED;
}

cublasStatus_t cublasDestroy(cublasHandle_t h)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    free(h);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    h->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void *ws, size_t bytes)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    if (bytes && !ws)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasSetWorkspace", "a size without memory");
    if (((uintptr_t)ws & 255u) != 0) /* the documentation asks for 256-byte alignment */
        return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasSetWorkspace",
                      "the workspace is not 256-byte aligned");
    h->ws = ws;
    h->ws_bytes = bytes;
    return CUBLAS_STATUS_SUCCESS;
}

const char *cublasGetStatusString(cublasStatus_t s)
{
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

/* cublasGemmStridedBatchedEx (and cublasGemmEx, one product of it) as
 * documented: lda >= max(1, m) for A not transposed (max(1, k) transposed),
 * ldb >= max(1, k) (max(1, n)), ldc >= max(1, m); host pointer mode (alpha
 * and beta are floats for CUBLAS_COMPUTE_32F); C is computed in place. */
static cublasStatus_t gemm_ex(const char *call, cublasHandle_t h, cublasOperation_t transa,
                              cublasOperation_t transb, int m, int n, int k, const void *alpha,
                              const void *A, cudaDataType_t Atype, int lda, long long strideA,
                              const void *B, cudaDataType_t Btype, int ldb, long long strideB,
                              const void *beta, void *C, cudaDataType_t Ctype, int ldc,
                              long long strideC, int batchCount, cublasComputeType_t computeType,
                              cublasGemmAlgo_t algo)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    if (m < 0 || n < 0 || k < 0 || batchCount < 0 || !alpha || !beta)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "a negative size or no alpha/beta");
    int ra = transa == CUBLAS_OP_N ? m : k, rb = transb == CUBLAS_OP_N ? k : n;
    if (lda < (ra > 1 ? ra : 1) || ldb < (rb > 1 ? rb : 1) || ldc < (m > 1 ? m : 1))
        return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "a leading dimension below its rows");
    if ((transa != CUBLAS_OP_N && transa != CUBLAS_OP_T) ||
        (transb != CUBLAS_OP_N && transb != CUBLAS_OP_T))
        return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "an unknown operation");
    if (computeType != CUBLAS_COMPUTE_32F || algo != CUBLAS_GEMM_DEFAULT ||
        !types_supported(Atype, Btype, Ctype))
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, call, "types or algorithm not supported");
    if (m == 0 || n == 0 || batchCount == 0)
        return CUBLAS_STATUS_SUCCESS;
    if (!A || !B || !C)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "a NULL matrix");
    gemm_cm g = {transa == CUBLAS_OP_T, transb == CUBLAS_OP_T, m, n, k, batchCount, Atype, Btype,
                 Ctype, 0, lda, ldb, ldc, ldc, strideA, strideB, strideC, strideC};
    float al = *(const float *)alpha, be = *(const float *)beta;
    n_fallback++;
    emu_enqueue(h->stream, [=]() { gemm_run(g, al, A, B, be, C, C); });
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t transa,
                                          cublasOperation_t transb, int m, int n, int k,
                                          const void *alpha, const void *A, cudaDataType_t Atype,
                                          int lda, long long strideA, const void *B,
                                          cudaDataType_t Btype, int ldb, long long strideB,
                                          const void *beta, void *C, cudaDataType_t Ctype, int ldc,
                                          long long strideC, int batchCount,
                                          cublasComputeType_t computeType, cublasGemmAlgo_t algo)
{
    return gemm_ex("cublasGemmStridedBatchedEx", h, transa, transb, m, n, k, alpha, A, Atype, lda,
                   strideA, B, Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount,
                   computeType, algo);
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t transa, cublasOperation_t transb,
                            int m, int n, int k, const void *alpha, const void *A,
                            cudaDataType_t Atype, int lda, const void *B, cudaDataType_t Btype,
                            int ldb, const void *beta, void *C, cudaDataType_t Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo)
{
    return gemm_ex("cublasGemmEx", h, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype,
                   ldb, 0, beta, C, Ctype, ldc, 0, 1, computeType, algo);
}

/* ---- cuBLASLt objects -------------------------------------------------------------- */

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h)
{
    return cublasCreate(h);
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t h)
{
    return cublasDestroy(h);
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute,
                                        cudaDataType_t scale)
{
    *d = (emu_lt_desc *)calloc(1, sizeof(emu_lt_desc));
    if (!*d)
        return CUBLAS_STATUS_ALLOC_FAILED;
    (*d)->compute = compute;
    (*d)->scale = scale;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d)
{
    free(d);
    return CUBLAS_STATUS_SUCCESS;
}

/* an attribute's value of the documented size, copied out */
static cublasStatus_t attr_value(const char *call, const void *buf, size_t bytes, size_t want,
                                 void *out)
{
    if (!buf || bytes != want)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "an attribute value of the wrong size");
    memcpy(out, buf, want);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t a, const void *buf,
                                              size_t bytes)
{
    const char *call = "cublasLtMatmulDescSetAttribute";
    int32_t v;
    if (!d || (a != CUBLASLT_MATMUL_DESC_TRANSA && a != CUBLASLT_MATMUL_DESC_TRANSB))
        return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "no descriptor, or an attribute not emulated");
    cublasStatus_t s = attr_value(call, buf, bytes, sizeof(int32_t), &v);
    if (s != CUBLAS_STATUS_SUCCESS)
        return s;
    if (v != CUBLAS_OP_N && v != CUBLAS_OP_T)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "an unknown operation");
    (a == CUBLASLT_MATMUL_DESC_TRANSA ? d->transa : d->transb) = v;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType_t type,
                                          uint64_t rows, uint64_t cols, int64_t ld)
{
    if (type != CUDA_R_16BF && type != CUDA_R_32F)
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatrixLayoutCreate", "a type not emulated");
    *l = (emu_lt_layout *)calloc(1, sizeof(emu_lt_layout));
    if (!*l)
        return CUBLAS_STATUS_ALLOC_FAILED;
    (*l)->type = type;
    (*l)->rows = rows;
    (*l)->cols = cols;
    (*l)->ld = ld;
    (*l)->batch = 1;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l)
{
    free(l);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l,
                                                cublasLtMatrixLayoutAttribute_t a,
                                                const void *buf, size_t bytes)
{
    const char *call = "cublasLtMatrixLayoutSetAttribute";
    if (!l)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "no layout");
    if (a == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT)
        return attr_value(call, buf, bytes, sizeof(int32_t), &l->batch);
    if (a == CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET)
        return attr_value(call, buf, bytes, sizeof(int64_t), &l->stride);
    return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "an attribute not emulated");
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p)
{
    *p = (emu_lt_pref *)calloc(1, sizeof(emu_lt_pref));
    if (!*p)
        return CUBLAS_STATUS_ALLOC_FAILED;
    for (int i = 0; i < 4; i++)
        (*p)->align[i] = 256; /* the documented defaults: no workspace, 256 bytes */
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p)
{
    free(p);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t a,
                                                    const void *buf, size_t bytes)
{
    const char *call = "cublasLtMatmulPreferenceSetAttribute";
    if (!p)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "no preference");
    if (a == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES)
        return attr_value(call, buf, bytes, sizeof(uint64_t), &p->max_ws);
    if (a >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES &&
        a <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES) {
        uint32_t v = 0;
        cublasStatus_t s = attr_value(call, buf, bytes, sizeof(uint32_t), &v);
        if (s != CUBLAS_STATUS_SUCCESS)
            return s;
        if (v == 0 || (v & (v - 1)) != 0)
            return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "an alignment not a power of two");
        p->align[a - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES] = v;
        return s;
    }
    return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "an attribute not emulated");
}

/* ---- the problem, the heuristic and the product -------------------------------------- */

/* The problem a descriptor and four layouts state, checked: the shapes
 * agree, each ld >= rows, one batch count, supported types. */
static cublasStatus_t problem(const char *call, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t A,
                              cublasLtMatrixLayout_t B, cublasLtMatrixLayout_t C,
                              cublasLtMatrixLayout_t D, gemm_cm *g)
{
    if (!op || !A || !B || !C || !D)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "a NULL descriptor or layout");
    if (op->compute != CUBLAS_COMPUTE_32F || op->scale != CUDA_R_32F)
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, call, "a compute or scale type not emulated");
    if (!types_supported(A->type, B->type, D->type) || C->type != D->type)
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, call, "a type combination not supported");
    uint64_t m = op->transa ? A->cols : A->rows, k = op->transa ? A->rows : A->cols;
    uint64_t kb = op->transb ? B->cols : B->rows, n = op->transb ? B->rows : B->cols;
    if (k != kb || C->rows != m || C->cols != n || D->rows != m || D->cols != n)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, call,
                      "shapes that do not agree (op(A) m x k, op(B) k x n, C and D m x n)");
    const cublasLtMatrixLayout_t ls[4] = {A, B, C, D};
    for (int i = 0; i < 4; i++) {
        if (ls[i]->ld < (int64_t)(ls[i]->rows > 1 ? ls[i]->rows : 1))
            return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "a leading dimension below its rows");
        if (ls[i]->batch != A->batch || ls[i]->batch < 1 || ls[i]->stride < 0)
            return refuse(CUBLAS_STATUS_INVALID_VALUE, call,
                          "batch counts that differ, or a negative batch stride");
    }
    if (m > (1u << 30) || n > (1u << 30) || k > (1u << 30))
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, call, "a dimension too large to emulate");
    *g = {op->transa, op->transb, (int)m, (int)n, (int)k, A->batch, A->type, B->type, D->type, 0,
          A->ld, B->ld, C->ld, D->ld, A->stride, B->stride, C->stride, D->stride};
    return CUBLAS_STATUS_SUCCESS;
}

/* FNV-1a over the problem: an algorithm belongs to the problem it was found
 * for */
static uint64_t fingerprint(const gemm_cm *g)
{
    const unsigned char *p = (const unsigned char *)g;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof *g; i++)
        h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t op,
                                              cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t B,
                                              cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t *res, int *found)
{
    const char *call = "cublasLtMatmulAlgoGetHeuristic";
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!pref || requested < 1 || !res || !found)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "no preference or no room for a result");
    *found = 0;
    gemm_cm g;
    memset(&g, 0, sizeof g);
    cublasStatus_t s = problem(call, op, A, B, C, D, &g);
    if (s != CUBLAS_STATUS_SUCCESS)
        return s;
    if (lt_mode_is("no-algorithm"))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    memset(res, 0, sizeof *res);
    uint64_t *a = res->algo.data;
    a[0] = ALGO_MAGIC;
    a[1] = fingerprint(&g);
    a[2] = pref->max_ws >= ALGO_WORKSPACE ? ALGO_WORKSPACE : 0;
    for (int i = 0; i < 4; i++)
        a[3 + i] = pref->align[i];
    res->workspaceSize = (size_t)a[2];
    res->state = CUBLAS_STATUS_SUCCESS;
    res->wavesCount = 1.0f;
    *found = 1;
    return CUBLAS_STATUS_SUCCESS;
}

/* the largest power of two (<= 256) dividing the address and the starts of
 * its columns and batches */
static uint32_t aligned_to(const void *p, int64_t ld, int batch, int64_t stride, size_t es)
{
    uintptr_t v = (uintptr_t)p | (uintptr_t)((size_t)ld * es);
    if (batch > 1)
        v |= (uintptr_t)((size_t)stride * es);
    uint32_t a = 256;
    while (a > 1 && (v & (uintptr_t)(a - 1)))
        a >>= 1;
    return a;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t op, const void *alpha,
                              const void *A, cublasLtMatrixLayout_t Adesc, const void *B,
                              cublasLtMatrixLayout_t Bdesc, const void *beta, const void *C,
                              cublasLtMatrixLayout_t Cdesc, void *D, cublasLtMatrixLayout_t Ddesc,
                              const cublasLtMatmulAlgo_t *algo, void *ws, size_t ws_bytes,
                              cudaStream_t stream)
{
    const char *call = "cublasLtMatmul";
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!alpha || !beta || !A || !B || !D || !algo)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "a NULL scalar, matrix or algorithm");
    gemm_cm g;
    memset(&g, 0, sizeof g);
    cublasStatus_t s = problem(call, op, Adesc, Bdesc, Cdesc, Ddesc, &g);
    if (s != CUBLAS_STATUS_SUCCESS)
        return s;
    const uint64_t *a = algo->data;
    if (a[0] != ALGO_MAGIC || a[1] != fingerprint(&g))
        return refuse(CUBLAS_STATUS_INVALID_VALUE, call,
                      "an algorithm found for another problem (descriptor or layouts)");
    if (ws_bytes < a[2] || (a[2] && !ws))
        return refuse(CUBLAS_STATUS_INVALID_VALUE, call,
                      "less workspace than the algorithm was found with");
    float be = *(const float *)beta;
    if (be != 0.0f && !C)
        return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "beta != 0 and no C");
    if (C == D && (Cdesc->ld != Ddesc->ld || Cdesc->stride != Ddesc->stride))
        return refuse(CUBLAS_STATUS_INVALID_VALUE, call, "C == D with two layouts");
    const void *ptr[4] = {A, B, C ? C : D, D};
    const cublasLtMatrixLayout_t ls[4] = {Adesc, Bdesc, Cdesc, Ddesc};
    for (int i = 0; i < 4; i++)
        if (aligned_to(ptr[i], ls[i]->ld, ls[i]->batch, ls[i]->stride, type_size(ls[i]->type)) <
            a[3 + i]) {
            char why[96];
            snprintf(why, sizeof why, "matrix %c less aligned than the algorithm was found for (%u)",
                     "ABCD"[i], (unsigned)a[3 + i]);
            return refuse(CUBLAS_STATUS_INVALID_VALUE, call, why);
        }
    if (lt_mode_is("refuses")) {
        n_refused++;
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    float al = *(const float *)alpha;
    n_lt++;
    emu_enqueue(stream, [=]() { gemm_run(g, al, A, B, be, C, D); });
    return CUBLAS_STATUS_SUCCESS;
}
