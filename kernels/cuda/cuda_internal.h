/* kernels/cuda/cuda_internal.h — private to the CUDA backend's .cu files:
 * its state, the checks that turn every failed CUDA/cuBLAS call into the
 * backend's sticky error (device ordinal, call, file:line), and the entry
 * points of each file (C linkage); the device helpers are cuda_device.h's. */
#ifndef SPOTUNE_CUDA_INTERNAL_H
#define SPOTUNE_CUDA_INTERNAL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#ifdef SPOTUNE_CUDA_EMU /* the emulated device (tests/cuda_emu) */
#include "cuda_emu_runtime.h"
#else
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

extern "C" {
#include "../backend.h"
}
#include "cuda_backend.h"
#include "cuda_device.h"

/* ---- state ------------------------------------------------------------------ */

typedef struct mm_cache mm_cache; /* cuda_matmul.cu */

typedef struct cuda_impl {
    int device;
    cudaStream_t stream;      /* every op runs on it */
    cudaStream_t aux;         /* a second stream for communication (created on demand) */
    cudaEvent_t fence;        /* reused by stream_fence */
    cublasHandle_t blas;      /* batched fallback when cuBLASLt has no algorithm */
    cublasLtHandle_t lt;
    void *mm_ws;              /* matmul workspace, allocated once */
    size_t mm_ws_bytes;
    unsigned *skinny_count;   /* CUDA_SKINNY_COUNTERS zeros after mm_ws (cuda_skinny.cu) */
    int sms;                  /* multiprocessors */
    mm_cache *mm;             /* matmul plans by shape, transposes, dtypes, alignment */
    void *scratch;            /* grow-only workspace of reductions and attention; */
    size_t scratch_bytes;     /* nothing in it survives an op */
    double *host_sum;         /* pinned: sumsq's result */
    cudaEvent_t staged;       /* recorded after each staged upload (h2d_async) */
    int staged_pending;       /* staged was recorded since the last h2d_wait */
    cudaEvent_t *prof_ev;     /* the step profile's marks (created on first use, reused) */
    int prof_cap;
    void *cudnn;              /* cuDNN's handle and graphs (cuda_cudnn.cu), made on first use */
    size_t cudnn_ws;          /* its workspace budget when asked for at creation, else 0 */
} cuda_impl;

#define CUDA_SKINNY_COUNTERS 4096 /* row tiles a skinny product splits at most */

#define CUDA_IMPL(be) ((cuda_impl *)(be)->impl)

/* ---- checks ----------------------------------------------------------------- */

extern "C" {
/* Return 0 when the call succeeded; else record it (first wins) and return -1. */
int cuda_ok(backend_t *be, cudaError_t e, const char *call, const char *file, int line);
int cublas_ok(backend_t *be, cublasStatus_t s, const char *call, const char *file, int line);
/* A failure that is not a CUDA status (bad argument, unsupported dtype). */
void cuda_fail(backend_t *be, const char *file, int line, const char *fmt, ...) SP_PRINTF(4, 5);
}

#define CUDA_OK(be, call) cuda_ok((be), (call), #call, __FILE__, __LINE__)

/* A host wait on the device's work, announced to be->wait_hook before
 * call runs and after it returns (backend.h): CUDA_OK(be, CUDA_WAITING(be,
 * "sync", cudaStreamSynchronize(s))). */
static inline cudaError_t cuda_waiting_begin(backend_t *be, const char *what)
{
    if (be->wait_hook)
        be->wait_hook(be->wait_ctx, what);
    return cudaSuccess;
}

static inline cudaError_t cuda_waited(backend_t *be, cudaError_t e)
{
    if (be->wait_hook)
        be->wait_hook(be->wait_ctx, NULL);
    return e;
}
#define CUDA_WAITING(be, what, call) (cuda_waiting_begin((be), (what)), cuda_waited((be), (call)))
#define CUBLAS_OK(be, call) cublas_ok((be), (call), #call, __FILE__, __LINE__)
/* After every kernel launch: a bad configuration is reported here, a fault
 * in the kernel at the next synchronising call. */
#define LAUNCHED(be, name) cuda_ok((be), cudaGetLastError(), "launch of " name, __FILE__, __LINE__)

extern "C" {
/* A device buffer of at least bytes, reused by every op (grown on demand,
 * after the stream drains); NULL with the sticky error set on failure. */
void *cuda_scratch(backend_t *be, size_t bytes);
}

/* AdamW's values for one call (cuda_ops.cu, cuda_vec.cu): given by the host
 * (hyper == NULL), or read by the kernel from device memory (adamw_args'
 * hyper and sumsq). adamw_k_resolve fills them in: 0 when the gradient's sum
 * is not finite (the kernel then updates nothing). */
typedef struct adamw_k {
    float beta1, beta2, eps, wd;
    float grad_scale, step_size, bc2_sqrt, decay;
    const float *hyper;
    const double *sumsq;
    double max_norm;
} adamw_k;

static __device__ __forceinline__ int adamw_k_resolve(adamw_k *k)
{
    if (!k->hyper)
        return 1;
    double s = *k->sumsq;
    if (!isfinite(s))
        return 0;
    k->grad_scale = (float)adamw_clip_scale(sqrt(s), k->max_norm);
    k->step_size = k->hyper[1];
    k->bc2_sqrt = k->hyper[2];
    k->decay = __fsub_rn(1.0f, __fmul_rn(k->hyper[0], k->wd)); /* as the host: no FMA */
    return 1;
}

/* RMSNorm backward's two expressions (the scalar kernel of cuda_ops.cu and
 * the vector one of cuda_vec.cu), every operation rounded on its own: left
 * to itself the compiler contracts them into fused multiply-adds, and not
 * the same ones in the two kernels (seen on an H200: 802 of 135168 values
 * of dx differed in the last bit). One step of the dot product mean(g xhat),
 * g = dout w, xhat = x rstd: */
static __device__ __forceinline__ float rms_dot_step(float dot, float d, float w, float x, float s)
{
    return __fadd_rn(dot, __fmul_rn(__fmul_rn(d, w), __fmul_rn(x, s)));
}

/* dx + rstd (g - xhat mean) */
static __device__ __forceinline__ float rms_dx(float dx, float d, float w, float x, float s,
                                               float mean)
{
    float g = __fmul_rn(d, w);
    return __fadd_rn(dx, __fmul_rn(s, __fsub_rn(g, __fmul_rn(__fmul_rn(x, s), mean))));
}
/* ---- the entry points of each file -------------------------------------------- */

/* Row-major C[M,N] = alpha op(A) op(B) + beta C over `batch` matrices at
 * element strides sa, sb, sc; leading dimensions are row strides. */
typedef struct gemm_desc {
    int M, N, K, transA, transB;
    dtype_t adt, bdt, cdt;
    int64_t lda, ldb, ldc;
    int batch;
    int64_t sa, sb, sc;
} gemm_desc;

/* The one builder of a gemm_desc: every field, in the struct's order (the
 * strides matter only when batch > 1). */
static inline gemm_desc gemm_desc_of(int M, int N, int K, int transA, int transB, dtype_t adt,
                                     dtype_t bdt, dtype_t cdt, int64_t lda, int64_t ldb,
                                     int64_t ldc, int batch, int64_t sa, int64_t sb, int64_t sc)
{
    gemm_desc d;
    d.M = M;
    d.N = N;
    d.K = K;
    d.transA = transA;
    d.transB = transB;
    d.adt = adt;
    d.bdt = bdt;
    d.cdt = cdt;
    d.lda = lda;
    d.ldb = ldb;
    d.ldc = ldc;
    d.batch = batch;
    d.sa = sa;
    d.sb = sb;
    d.sc = sc;
    return d;
}

/* The operand and result dtypes a product takes (BF16 x BF16 into BF16 or
 * F32, or F32 throughout): 1, or 0 with the sticky error set (naming the
 * caller's file and line). */
#define GEMM_DTYPES_OK(be, d) gemm_dtypes_ok_at((be), (d), __FILE__, __LINE__)
static inline int gemm_dtypes_ok_at(backend_t *be, const gemm_desc *d, const char *file,
                                    int line)
{
    if (d->adt == d->bdt && ((d->adt == DT_BF16 && (d->cdt == DT_BF16 || d->cdt == DT_F32)) ||
                             (d->adt == DT_F32 && d->cdt == DT_F32)))
        return 1;
    cuda_fail(be, file, line,
              "matmul: operands %s x %s into %s unsupported (BF16 x BF16 into BF16 or F32, or "
              "F32 throughout)",
              dtype_name(d->adt), dtype_name(d->bdt), dtype_name(d->cdt));
    return 0;
}

extern "C" {
/* cuda_matmul.cu (cuda_matmul_ops.cu: matmul, matmul_cd and matmul_batched) */
int cuda_mm_init(backend_t *be);
/* cuda_skinny.cu: C = alpha op(A) op(B) + beta C (batch products,
 * strides sa, sb, sc) by its kernels when they take the product (a side of
 * at most 64 over a reduction of at least 256: LoRA's rank-r products
 * x A^T, dy B, dy^T xr, d(xr)^T x; bf16 operands, aligned rows): 1, or 0
 * and nothing done (cuBLASLt's turn). */
int cuda_skinny_matmul(backend_t *be, tensor_t C, tensor_t A, tensor_t B, int M, int N, int K,
                       int transA, int transB, float alpha, float beta, int lda, int ldb,
                       int ldc, int batch, unsigned long sa, unsigned long sb, unsigned long sc);
/* Whether a bf16 matrix's rows (and a batch's matrices) start 16-byte
 * aligned: the 16-byte loads and staged copies of cuda_skinny.cu's and
 * cuda_wide.cu's kernels. */
static inline int cuda_rows_aligned16(const void *p, long long ld, int batch,
                                      unsigned long stride)
{
    return !((uintptr_t)p & 15u) && ld % 8 == 0 && (batch == 1 || stride % 8 == 0);
}
/* cuda_wide.cu: the same, by its kernel when it takes the product (a
 * reduction of at most 64, a multiple of 8, into at least 128 columns:
 * LoRA's xr B^T and d(xr) A; bf16 operands and C, aligned rows): 1, or 0
 * and nothing done. */
int cuda_wide_matmul(backend_t *be, tensor_t C, tensor_t A, tensor_t B, int M, int N, int K,
                     int transA, int transB, float alpha, float beta, int lda, int ldb, int ldc,
                     int batch, unsigned long sa, unsigned long sb, unsigned long sc);
void cuda_mm_destroy(backend_t *be);
void cuda_gemm(backend_t *be, const gemm_desc *d, const void *A, const void *B, void *C,
               float alpha, float beta);
/* cuda_gemm reading Cin and writing C (cuBLASLt's C and D) */
void cuda_gemm_cd(backend_t *be, const gemm_desc *d, const void *A, const void *B,
                  const void *Cin, void *C, float alpha, float beta);
void cuda_matmul_cd(backend_t *be, tensor_t D, tensor_t C, tensor_t A, tensor_t B, int M, int N,
                    int K, int transA, int transB, float alpha, float beta);
void cuda_matmul(backend_t *be, tensor_t C, tensor_t A, tensor_t B, int M, int N, int K,
                 int transA, int transB, float alpha, float beta, int lda, int ldb, int ldc);
void cuda_matmul_batched(backend_t *be, tensor_t C, tensor_t A, tensor_t B, int M, int N, int K,
                         int transA, int transB, float alpha, float beta, int lda, int ldb,
                         int ldc, int batch, unsigned long sa, unsigned long sb,
                         unsigned long sc);

/* cuda_ops.cu */
void cuda_convert(backend_t *be, void *dst, dtype_t ddt, const void *src, dtype_t sdt, size_t n);
/* rows x cols with row strides dst_ld, src_ld */
void cuda_convert2d(backend_t *be, void *dst, dtype_t ddt, int dst_ld, const void *src,
                    dtype_t sdt, int src_ld, int rows, int cols);
void cuda_scale(backend_t *be, void *x, dtype_t dt, size_t n, float alpha);
void cuda_rmsnorm_forward(backend_t *be, tensor_t out, tensor_t rstd, tensor_t x, tensor_t w,
                          int rows, int cols, float eps);
void cuda_rmsnorm_backward(backend_t *be, tensor_t dx, tensor_t dw, tensor_t dout, tensor_t x,
                           tensor_t w, tensor_t rstd, int rows, int cols);
void cuda_rope(backend_t *be, tensor_t x, tensor_t src, tensor_t cos, tensor_t sin, tensor_t pos,
               int B, int T, int nh, int hd, int inverse, int x_ld, int src_ld);
void cuda_swiglu_forward(backend_t *be, tensor_t out, tensor_t g, tensor_t u, int rows, int cols,
                         int ld);
void cuda_swiglu_backward(backend_t *be, tensor_t dg, tensor_t du, tensor_t dout, tensor_t g,
                          tensor_t u, int rows, int cols, int ld);
void cuda_embedding_forward(backend_t *be, tensor_t out, tensor_t table, tensor_t tokens, int n,
                            int H);
void cuda_embedding_backward(backend_t *be, tensor_t dtable, tensor_t dout, tensor_t tokens,
                             tensor_t order, tensor_t runs, int n, int H);
void cuda_cross_entropy(backend_t *be, tensor_t logits, tensor_t loss, tensor_t targets, int rows,
                        int V, float grad_scale, tensor_t scale);
void cuda_add(backend_t *be, tensor_t y, tensor_t x, float alpha, size_t n);
void cuda_add_bias(backend_t *be, tensor_t y, tensor_t b, int rows, int cols);
void cuda_bias_backward(backend_t *be, tensor_t db, tensor_t dy, int rows, int cols);
void cuda_weight_norm(backend_t *be, tensor_t n, tensor_t W, tensor_t A, tensor_t B, float scale,
                      int out, int in, int r);
void cuda_col_scale(backend_t *be, tensor_t y, tensor_t num, tensor_t den, int rows, int cols);
void cuda_col_dot(backend_t *be, tensor_t out, tensor_t x, tensor_t y, tensor_t den, int rows,
                  int cols);
void cuda_dequant_nf4(backend_t *be, tensor_t out, tensor_t codes, tensor_t absmax,
                      tensor_t nested, tensor_t maps, float offset, size_t n);
void cuda_quantize_nf4(backend_t *be, tensor_t codes, tensor_t absmax, tensor_t x, tensor_t maps,
                       size_t n);
void cuda_dropout(backend_t *be, tensor_t out, tensor_t in, size_t n, float p, uint64_t seed,
                  tensor_t seed_dev, uint64_t offset);
double cuda_sumsq(backend_t *be, tensor_t x, size_t n);
void cuda_sumsq_into(backend_t *be, tensor_t out, tensor_t x, size_t n);
void cuda_sum_add(backend_t *be, tensor_t acc, tensor_t x, size_t n);
void cuda_adamw(backend_t *be, tensor_t param, tensor_t param_copy, tensor_t grad, tensor_t m,
                tensor_t v, size_t n, const adamw_args *a);
void cuda_fill_uniform(backend_t *be, tensor_t x, size_t n, float lo, float hi, uint64_t seed,
                       uint64_t offset);
void cuda_fill_normal(backend_t *be, tensor_t x, size_t n, float mean, float std, uint64_t seed,
                      uint64_t offset);

/* cuda_vec.cu: the 16-byte vector paths of cuda_ops.cu's hot elementwise
 * ops, bit for bit the scalar kernels' results. Each returns 1 when it took
 * the call (launched, or failed with the sticky error set) and 0 when the
 * scalar kernel must run: SPOTUNE_CUDA_ELEMENTWISE=scalar, a pointer not
 * 16-byte aligned (dequant_nf4's codes: 4-byte), a dtype other than F32/BF16, a size (n, cols, hd/2) not
 * a multiple of 8, or RMSNorm rows over 46 KiB of shared memory. */
int cuda_elementwise_vector(void);
int cuda_vec_add(backend_t *be, tensor_t y, tensor_t x, float alpha, size_t n);
int cuda_vec_add_bias(backend_t *be, tensor_t y, tensor_t b, int rows, int cols);
int cuda_vec_swiglu_forward(backend_t *be, tensor_t out, tensor_t g, tensor_t u, int rows,
                            int cols, int ld);
int cuda_vec_swiglu_backward(backend_t *be, tensor_t dg, tensor_t du, tensor_t dout, tensor_t g,
                             tensor_t u, int rows, int cols, int ld);
int cuda_vec_dropout(backend_t *be, tensor_t out, tensor_t in, size_t n, float p,
                     float keep_scale, uint64_t seed, const uint64_t *seed_dev,
                     uint64_t offset);
int cuda_vec_rope(backend_t *be, tensor_t x, tensor_t src, tensor_t cos, tensor_t sin,
                  tensor_t pos, int B, int T, int nh, int hd, float sgn, int x_ld, int src_ld);
int cuda_vec_rmsnorm_forward(backend_t *be, tensor_t out, tensor_t rstd, tensor_t x, tensor_t w,
                             int rows, int cols, float eps);
int cuda_vec_rmsnorm_backward(backend_t *be, tensor_t dx, tensor_t dout, tensor_t x, tensor_t w,
                              tensor_t rstd, int rows, int cols);
int cuda_vec_adamw(backend_t *be, tensor_t param, void *copy, dtype_t cdt, tensor_t grad,
                   tensor_t m, tensor_t v, size_t n, const adamw_k *k);
int cuda_vec_dequant_nf4(backend_t *be, tensor_t out, tensor_t codes, tensor_t absmax,
                         tensor_t nested, tensor_t maps, float offset, size_t n);

/* cuda_attention.cu (backend.h's attention ops, row strides included) */
void cuda_attention_forward(backend_t *be, tensor_t out, tensor_t lse, tensor_t q, tensor_t k,
                            tensor_t v, tensor_t seg, int B, int T, int nh, int nkv, int hd,
                            int q_ld, int kv_ld);
void cuda_attention_backward(backend_t *be, tensor_t dq, tensor_t dk, tensor_t dv, tensor_t dout,
                             tensor_t out, tensor_t lse, tensor_t q, tensor_t k, tensor_t v,
                             tensor_t seg, int B, int T, int nh, int nkv, int hd, int q_ld,
                             int kv_ld, int dq_ld, int dkv_ld);

/* cuda_cudnn.cu: attention by cuDNN's fused attention, asked for by
 * SPOTUNE_CUDA_ATTENTION=cudnn (cuda_cudnn_requested). The two ops return
 * 1 when cuDNN ran the call, 0 when it did not (not a shape it takes, no
 * cuDNN, a graph it refuses: the reason printed once; the caller runs the
 * fused kernels), -1 on an error (recorded). cuda_cudnn_status: 1 when
 * cuDNN can be used, else 0, with the version or the reason in why;
 * cuda_cudnn_calls: how many calls cuDNN has run on this backend. */
int cuda_cudnn_requested(void);
int cuda_cudnn_attention_forward(backend_t *be, tensor_t out, tensor_t lse, tensor_t q,
                                 tensor_t k, tensor_t v, tensor_t seg, int B, int T, int nh,
                                 int nkv, int hd, int q_ld, int kv_ld);
int cuda_cudnn_attention_backward(backend_t *be, tensor_t dq, tensor_t dk, tensor_t dv,
                                  tensor_t dout, tensor_t out, tensor_t lse, tensor_t q,
                                  tensor_t k, tensor_t v, tensor_t seg, int B, int T, int nh,
                                  int nkv, int hd, int q_ld, int kv_ld, int dq_ld, int dkv_ld);
int cuda_cudnn_status(backend_t *be, char *why, size_t n);
long cuda_cudnn_calls(backend_t *be);
void cuda_cudnn_release(backend_t *be);
/* cuda_cudnn_workspace_allowed: whether a graph asking for ws bytes of
 * workspace may run (1; 0 over SPOTUNE_CUDNN_WORKSPACE_BUDGET, -1 that
 * variable malformed, with why); cuda_cudnn_setup_env: the frontend's dP
 * workspace limit from that budget, unless set (cuda_cudnn.cu). */
int cuda_cudnn_workspace_allowed(long long ws, char *why, size_t n);
void cuda_cudnn_setup_env(void);
/* the budget in bytes (the default where the variable is malformed) */
size_t cuda_cudnn_workspace_budget(void);

/* cuda_flash.cu: the fused kernels. cuda_flash_handles: 1 when they take
 * this call (BF16, hd 64 or 128, compute capability 8.0 or later, every
 * pointer 16-byte aligned and every row stride of lds a multiple of 8
 * elements, B x nh < 65536, SPOTUNE_CUDA_ATTENTION not "unfused"); 0
 * means the unfused path runs. The backward's dQ comes from the dS its
 * dK/dV kernel stores, where that fits (cuda_flash.cu). */
int cuda_flash_handles(backend_t *be, dtype_t dt, int B, int T, int nh, int nkv, int hd,
                       const void *const *ptrs, int nptrs, const int *lds, int nlds);
void cuda_flash_forward(backend_t *be, tensor_t out, tensor_t lse, tensor_t q, tensor_t k,
                        tensor_t v, tensor_t seg, int B, int T, int nh, int nkv, int hd, int q_ld,
                        int kv_ld);
void cuda_flash_backward(backend_t *be, tensor_t dq, tensor_t dk, tensor_t dv, tensor_t dout,
                         tensor_t out, tensor_t lse, tensor_t q, tensor_t k, tensor_t v,
                         tensor_t seg, int B, int T, int nh, int nkv, int hd, int q_ld, int kv_ld,
                         int dq_ld, int dkv_ld);

/* cuda_flash_wgmma.cu (compiled for sm_90a; where the build has it,
 * SPOTUNE_CUDA_SM90A): the forward, dK/dV and dQ-from-stored-dS kernels
 * by warpgroup products. cuda_flash_wgmma_usable: 1 on a GPU of compute
 * capability 9.0 that loads their image; cuda_flash_wgmma_launch launches
 * one (nonzero on a failed launch). cuda_flash.cu uses them for
 * SPOTUNE_CUDA_ATTENTION=fused-wgmma. */
struct flash_args;
int cuda_flash_wgmma_usable(backend_t *be);
enum { FA_WG_FORWARD, FA_WG_DKDV, FA_WG_DQ };
int cuda_flash_wgmma_launch(backend_t *be, const struct flash_args *a, int which, unsigned gx,
                            unsigned gy, int hd);
/* 1 when a forward of this backend would run the wgmma kernel now (the
 * variable set, the build and the GPU able): for the workbench's rows. */
int cuda_flash_wgmma_selected(backend_t *be);
/* Whether the forward (*fwd) and dK/dV (*dkdv) kernels at head dim hd
 * read their reused operands from shared memory (cuda_flash.cu). */
void cuda_flash_operands_staged(backend_t *be, int hd, int *fwd, int *dkdv);
/* Whether dQ from the stored dS runs with two buffers (cuda_flash.cu). */
int cuda_flash_dq_double_buffered(backend_t *be, int hd);
/* The descriptors' probe: ok[0..3] for K-major B as the forward builds its
 * descriptor and swapped, MN-major as built and swapped; 0, 1 where the
 * wgmma forward cannot run, -1 on a CUDA error (cuda_flash_wgmma.cu). */
int cuda_wgmma_probe(backend_t *be, int ok[4]);
}

#endif
