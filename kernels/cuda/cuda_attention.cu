/* kernels/cuda/cuda_attention.cu — causal grouped-query attention, forward
 * and backward, with the math of cpu_attention_forward/backward.
 *
 * Dispatch: the fused kernels of cuda_flash.cu run every call they handle
 * (BF16, hd 64 or 128, sm_80 or later; cuda_flash_handles); this file's
 * unfused path runs the rest, and every call when SPOTUNE_CUDA_ATTENTION=
 * unfused (for comparison). Both save the same lse, so a forward of one
 * and a backward of the other agree. SPOTUNE_CUDA_ATTENTION=cudnn hands
 * the calls cuDNN takes to its fused attention first (cuda_cudnn.cu; the
 * same lse again).
 *
 * The unfused path.
 * Algorithm: batched cuBLASLt products with a fused masked-softmax kernel,
 * tiled over query rows (not a single flash-style kernel). For each batch b,
 * query head offset g within a kv group, a chunk of kv heads and a block of
 * R query rows [r0, r0+R): S = scale Q K^T over keys [0, r0+R) only (the
 * causal bound: about 5/8 of the full T x T products at R = T/4), one
 * kernel turns S into P = exp(S - lse) (writing lse), and O = P V. The
 * backward recomputes P from lse (nothing T x T is kept between the
 * passes): dP = dO V^T, dS = P (dP - D) scale with D = rowsum(dO * O),
 * dQ = dS K, and dK += dS^T Q, dV += P^T dO accumulate in fp32 buffers over
 * row blocks and the query heads of a group, then are converted.
 *
 * Packed rows (seg, backend.h): the softmax kernels mask, for each query, the
 * keys before its document's first position as they mask those above the
 * diagonal (no T x T mask exists anywhere); the products still cover keys
 * [0, kend) of a row block.
 *
 * Memory: the score blocks live only inside the op, in the backend's
 * scratch buffer, bounded by ATTN_BUDGET (forward 6 bytes, backward 12 bytes
 * per score element for bf16), plus D (B x nh x T) and the two fp32 dK/dV
 * buffers of one batch (T x nkv x hd each) in the backward.
 * Precision: scores and softmax in fp32; P and dS are rounded to the
 * activation dtype (bf16) before their products, as flash attention does. */
#include <math.h>
#include <string.h>

#include "cuda_internal.h"

#define ATTN_BUDGET ((size_t)256 << 20)
#define ATTN_ROWS 512
#define SOFTMAX_BLOCK 128

typedef struct attn_plan {
    int R;     /* query rows per block */
    int nc;    /* kv heads per batched product */
    int ldS;   /* row stride of a score block (T rounded up to 8) */
    size_t hs; /* elements of one head's score block, R * ldS */
} attn_plan;

static attn_plan attn_plan_for(int T, int nkv, size_t bytes_per_score)
{
    attn_plan p;
    p.ldS = (T + 7) & ~7;
    p.R = T < ATTN_ROWS ? T : ATTN_ROWS;
    while (p.R > 64 && (size_t)p.R * p.ldS * bytes_per_score > ATTN_BUDGET)
        p.R /= 2;
    p.hs = (size_t)p.R * p.ldS;
    size_t nc = ATTN_BUDGET / (p.hs * bytes_per_score);
    if (nc < 1)
        nc = 1;
    if (nc > (size_t)nkv)
        nc = (size_t)nkv;
    p.nc = (int)nc;
    return p;
}

/* Reserves bytes at *off (256-byte aligned) and returns the offset. */
static size_t carve(size_t *off, size_t bytes)
{
    size_t at = (*off + 255) & ~(size_t)255;
    *off = at + bytes;
    return at;
}

/* ---- kernels -------------------------------------------------------------------- */

/* The first key query t attends to: the start of its document in a packed
 * row (seg, this batch row's T entries, clamped to [0, t]), or 0. */
__device__ __forceinline__ int attn_lo(const int *seg, int t)
{
    if (!seg)
        return 0;
    int v = seg[t];
    return v < 0 ? 0 : v > t ? t : v;
}

/* One block per (query row i of the block, head c of the chunk): the row's
 * max and sum of exponentials over keys lo <= j <= t (fp32), lse = m +
 * log(sum), P[j] = exp(S[j] - lse) there and 0 for the masked keys up to
 * kend (before the query's document and above the diagonal). */
__global__ void attn_softmax_forward_kernel(const float *S, void *P, int pdt, float *lse,
                                            const int *seg, size_t hs, int ldS, int r0, int kend,
                                            size_t lbase, size_t lstride)
{
    __shared__ float sh[33];
    int i = blockIdx.x, c = blockIdx.y, t = r0 + i, lo = attn_lo(seg, t);
    size_t row = (size_t)c * hs + (size_t)i * ldS;
    float m = -INFINITY, s = 0.0f;
    for (int j = lo + threadIdx.x; j <= t; j += blockDim.x)
        online_max_sum(S[row + j], m, s);
    float l = block_lse(m, s, sh);
    for (int j = threadIdx.x; j < kend; j += blockDim.x)
        st_f(P, pdt, row + j, j >= lo && j <= t ? expf(S[row + j] - l) : 0.0f);
    if (threadIdx.x == 0)
        lse[lbase + (size_t)c * lstride + t] = l;
}

/* D[(b*nh + h)*T + t] = dot(dO[b,t,h,:], O[b,t,h,:]): one warp per row */
__global__ void attn_rowdot_kernel(float *D, const void *dO, const void *O, int dt, int T, int nh,
                                   int hd, size_t nrows)
{
    size_t r = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; /* (b*T + t)*nh + h */
    if (r >= nrows)
        return; /* the whole warp leaves together */
    int lane = threadIdx.x & 31;
    float acc = 0.0f;
    for (int d = lane; d < hd; d += 32)
        acc += ld_f(dO, dt, r * hd + d) * ld_f(O, dt, r * hd + d);
    acc = warp_sum(acc);
    if (lane == 0) {
        size_t h = r % nh, bt = r / nh, t = bt % T, b = bt / T;
        D[(b * nh + h) * T + t] = acc;
    }
}

/* One block per (query row i of the block, head c of the chunk), threads
 * over keys j < kend: P = exp(S - lse), dS = P (dP - D) scale, both 0 for
 * the masked keys. */
__global__ void attn_softmax_backward_kernel(const float *S, const float *dP, void *P, void *dS,
                                             int dt, const float *lse, const float *D,
                                             const int *seg, size_t hs, int ldS, int r0, int kend,
                                             size_t lbase, size_t lstride, float scale)
{
    int i = blockIdx.x, c = blockIdx.y, t = r0 + i, lo = attn_lo(seg, t);
    size_t row = (size_t)c * hs + (size_t)i * ldS;
    size_t li = lbase + (size_t)c * lstride + t;
    float l = lse[li], d = D[li];
    for (int j = threadIdx.x; j < kend; j += blockDim.x) {
        float p = 0.0f, ds = 0.0f;
        if (j >= lo && j <= t) {
            p = expf(S[row + j] - l);
            ds = p * (dP[row + j] - d) * scale;
        }
        st_f(P, dt, row + j, p);
        st_f(dS, dt, row + j, ds);
    }
}

/* The row strides of an attention call (backend.h): q's, k's and v's,
 * out's and dout's (contiguous), dq's, dk's and dv's. */
typedef struct attn_lds {
    int q, kv, o, dq, dkv;
} attn_lds;

/* One block of the loops over (b, g, chunk k0, row block r0): the ncc heads
 * of the chunk, the rows of the block and the keys [0, kend) they see, and
 * where the block starts in q, in out and dout, in dq, in k and v, and in
 * lse. */
typedef struct attn_blk {
    int ncc, rows, kend;
    size_t qoff, ooff, dqoff, koff, lbase;
} attn_blk;

static attn_blk attn_block(const attn_plan *pl, const attn_lds *ld, int b, int g, int k0, int r0,
                           int T, int nh, int nkv, int group, int hd)
{
    attn_blk a;
    a.ncc = nkv - k0 < pl->nc ? nkv - k0 : pl->nc;
    a.rows = T - r0 < pl->R ? T - r0 : pl->R;
    a.kend = r0 + a.rows;
    size_t row = (size_t)b * T + r0, head = ((size_t)k0 * group + g) * hd;
    a.qoff = row * ld->q + head;
    a.ooff = row * ld->o + head;
    a.dqoff = row * ld->dq + head;
    a.koff = (size_t)b * T * ld->kv + (size_t)k0 * hd;
    a.lbase = ((size_t)b * nh + (size_t)k0 * group + g) * T;
    return a;
}

/* The product S = scale Q_blk K[0:kend]^T of one (b, g, chunk, row block),
 * and its twin dP = dO_blk V^T (same shapes); ldx: Q's or dO's row
 * stride, ldk: K's or V's. */
static void scores(backend_t *be, float *S, const char *Q, const char *K, dtype_t dt,
                   const attn_plan *pl, const attn_blk *a, int ldx, int ldk, int group, int hd,
                   float alpha)
{
    gemm_desc d = gemm_desc_of(a->rows, a->kend, hd, 0, 1, dt, dt, DT_F32, ldx, ldk, pl->ldS,
                               a->ncc, (int64_t)group * hd, hd, (int64_t)pl->hs);
    cuda_gemm(be, &d, Q, K, S, alpha, 0.0f);
}

/* The product out_blk = X KV[0:kend] of one (b, g, chunk, row block), written
 * over the query rows (row stride ldo): O = P V in the forward, dQ = dS K
 * in the backward. */
static void rows_times_kv(backend_t *be, char *out, const void *X, const char *KV, dtype_t dt,
                          const attn_plan *pl, const attn_blk *a, int ldkv, int ldo, int group,
                          int hd)
{
    gemm_desc d = gemm_desc_of(a->rows, hd, a->kend, 0, 0, dt, dt, dt, pl->ldS, ldkv, ldo, a->ncc,
                               (int64_t)pl->hs, hd, (int64_t)group * hd);
    cuda_gemm(be, &d, X, KV, out, 1.0f, 0.0f);
}

/* Batch row b's segment starts (packed documents), or NULL. */
static const int *seg_row(tensor_t seg, int b, int T)
{
    return seg.p ? (const int *)seg.p + (size_t)b * T : NULL;
}

/* ---- forward ----------------------------------------------------------------------- */

extern "C" void cuda_attention_forward(backend_t *be, tensor_t out, tensor_t lse, tensor_t q,
                                       tensor_t k, tensor_t v, tensor_t seg, int B, int T, int nh,
                                       int nkv, int hd, int q_ld, int kv_ld)
{
    /* the shape (positive, nh a multiple of nkv), sizes and dtypes (one
     * for q, k, v, out) have been checked (kernels/backend_ops.c) */
    if (be->err.code)
        return;
    if (cuda_cudnn_requested() &&
        cuda_cudnn_attention_forward(be, out, lse, q, k, v, seg, B, T, nh, nkv, hd, q_ld, kv_ld))
        return; /* ran, or failed (recorded) */
    const void *ptrs[] = {q.p, k.p, v.p, out.p};
    const int lds[] = {q_ld, kv_ld};
    if (cuda_flash_handles(be, q.dt, B, T, nh, nkv, hd, ptrs, 4, lds, 2)) {
        cuda_flash_forward(be, out, lse, q, k, v, seg, B, T, nh, nkv, hd, q_ld, kv_ld);
        return;
    }
    if (be->err.code)
        return;
    dtype_t dt = q.dt;
    size_t esz = dtype_size(dt);
    attn_plan pl = attn_plan_for(T, nkv, 4 + esz);
    size_t off = 0;
    size_t oS = carve(&off, 4 * pl.hs * pl.nc), oP = carve(&off, esz * pl.hs * pl.nc);
    char *ws = (char *)cuda_scratch(be, off);
    if (!ws)
        return;
    float *S = (float *)(ws + oS);
    void *P = ws + oP;
    cudaStream_t st = CUDA_IMPL(be)->stream;
    int group = nh / nkv;
    float scale = 1.0f / sqrtf((float)hd);
    attn_lds ld = {q_ld, kv_ld, nh * hd, 0, 0};
    for (int b = 0; b < B; b++)
        for (int g = 0; g < group; g++)
            for (int k0 = 0; k0 < nkv; k0 += pl.nc)
                for (int r0 = 0; r0 < T && !be->err.code; r0 += pl.R) {
                    attn_blk a = attn_block(&pl, &ld, b, g, k0, r0, T, nh, nkv, group, hd);
                    scores(be, S, (const char *)q.p + a.qoff * esz,
                           (const char *)k.p + a.koff * esz, dt, &pl, &a, ld.q, ld.kv, group, hd,
                           scale);
                    LAUNCH(attn_softmax_forward_kernel, dim3(a.rows, a.ncc), SOFTMAX_BLOCK, 0, st)(
                        S, P, dt, (float *)lse.p, seg_row(seg, b, T), pl.hs, pl.ldS, r0, a.kend,
                        a.lbase, (size_t)group * T);
                    if (LAUNCHED(be, "attn_softmax_forward_kernel"))
                        return;
                    rows_times_kv(be, (char *)out.p + a.ooff * esz, P,
                                  (const char *)v.p + a.koff * esz, dt, &pl, &a, ld.kv, ld.o, group,
                                  hd);
                }
}

/* ---- backward ---------------------------------------------------------------------- */

extern "C" void cuda_attention_backward(backend_t *be, tensor_t dq, tensor_t dk, tensor_t dv,
                                        tensor_t dout, tensor_t out, tensor_t lse, tensor_t q,
                                        tensor_t k, tensor_t v, tensor_t seg, int B, int T,
                                        int nh, int nkv, int hd, int q_ld, int kv_ld, int dq_ld,
                                        int dkv_ld)
{
    if (be->err.code) /* arguments checked as for the forward */
        return;
    if (cuda_cudnn_requested() &&
        cuda_cudnn_attention_backward(be, dq, dk, dv, dout, out, lse, q, k, v, seg, B, T, nh, nkv,
                                      hd, q_ld, kv_ld, dq_ld, dkv_ld))
        return;
    const void *ptrs[] = {q.p, k.p, v.p, out.p, dout.p, dq.p, dk.p, dv.p};
    const int lds[] = {q_ld, kv_ld, dq_ld, dkv_ld};
    if (cuda_flash_handles(be, q.dt, B, T, nh, nkv, hd, ptrs, 8, lds, 4)) {
        cuda_flash_backward(be, dq, dk, dv, dout, out, lse, q, k, v, seg, B, T, nh, nkv, hd, q_ld,
                            kv_ld, dq_ld, dkv_ld);
        return;
    }
    if (be->err.code)
        return;
    dtype_t dt = q.dt;
    size_t esz = dtype_size(dt);
    attn_plan pl = attn_plan_for(T, nkv, 8 + 2 * esz);
    size_t per_b = (size_t)T * nkv * hd, off = 0;
    size_t oS = carve(&off, 4 * pl.hs * pl.nc), odP = carve(&off, 4 * pl.hs * pl.nc);
    size_t oP = carve(&off, esz * pl.hs * pl.nc), odS = carve(&off, esz * pl.hs * pl.nc);
    size_t oD = carve(&off, 4 * (size_t)B * nh * T);
    size_t odK = carve(&off, 4 * per_b), odV = carve(&off, 4 * per_b);
    char *ws = (char *)cuda_scratch(be, off);
    if (!ws)
        return;
    float *S = (float *)(ws + oS), *dP = (float *)(ws + odP), *D = (float *)(ws + oD);
    float *dK32 = (float *)(ws + odK), *dV32 = (float *)(ws + odV);
    void *P = ws + oP, *dS = ws + odS;
    cudaStream_t st = CUDA_IMPL(be)->stream;
    int group = nh / nkv;
    float scale = 1.0f / sqrtf((float)hd);
    attn_lds ld = {q_ld, kv_ld, nh * hd, dq_ld, dkv_ld};

    size_t nrows = (size_t)B * T * nh;
    LAUNCH(attn_rowdot_kernel, (unsigned)((nrows + 7) / 8), 256, 0, st)(
        D, dout.p, out.p, dt, T, nh, hd, nrows);
    if (LAUNCHED(be, "attn_rowdot_kernel"))
        return;
    for (int b = 0; b < B && !be->err.code; b++) {
        if (CUDA_OK(be, cudaMemsetAsync(dK32, 0, 4 * per_b, st)) ||
            CUDA_OK(be, cudaMemsetAsync(dV32, 0, 4 * per_b, st)))
            return;
        for (int g = 0; g < group; g++)
            for (int k0 = 0; k0 < nkv; k0 += pl.nc)
                for (int r0 = 0; r0 < T && !be->err.code; r0 += pl.R) {
                    attn_blk a = attn_block(&pl, &ld, b, g, k0, r0, T, nh, nkv, group, hd);
                    const char *Qb = (const char *)q.p + a.qoff * esz;
                    const char *dOb = (const char *)dout.p + a.ooff * esz;
                    const char *Kb = (const char *)k.p + a.koff * esz;
                    const char *Vb = (const char *)v.p + a.koff * esz;
                    scores(be, S, Qb, Kb, dt, &pl, &a, ld.q, ld.kv, group, hd, scale);
                    scores(be, dP, dOb, Vb, dt, &pl, &a, ld.o, ld.kv, group, hd, 1.0f);
                    LAUNCH(attn_softmax_backward_kernel, dim3(a.rows, a.ncc), SOFTMAX_BLOCK, 0, st)(
                        S, dP, P, dS, dt, (const float *)lse.p, D, seg_row(seg, b, T), pl.hs,
                        pl.ldS, r0, a.kend, a.lbase, (size_t)group * T, scale);
                    if (LAUNCHED(be, "attn_softmax_backward_kernel"))
                        return;
                    /* dQ_blk = dS K[0:kend] (every query row written once) */
                    rows_times_kv(be, (char *)dq.p + a.dqoff * esz, dS, Kb, dt, &pl, &a, ld.kv,
                                  ld.dq, group, hd);
                    /* dK[0:kend] += dS^T Q_blk;  dV[0:kend] += P^T dO_blk (fp32,
                     * contiguous) */
                    gemm_desc dk_d = gemm_desc_of(a.kend, hd, a.rows, 1, 0, dt, dt, DT_F32,
                                                  pl.ldS, ld.q, (int64_t)nkv * hd, a.ncc,
                                                  (int64_t)pl.hs, (int64_t)group * hd, hd);
                    gemm_desc dv_d = gemm_desc_of(a.kend, hd, a.rows, 1, 0, dt, dt, DT_F32,
                                                  pl.ldS, ld.o, (int64_t)nkv * hd, a.ncc,
                                                  (int64_t)pl.hs, (int64_t)group * hd, hd);
                    cuda_gemm(be, &dk_d, dS, Qb, dK32 + (size_t)k0 * hd, 1.0f, 1.0f);
                    cuda_gemm(be, &dv_d, P, dOb, dV32 + (size_t)k0 * hd, 1.0f, 1.0f);
                }
        size_t boff = (size_t)b * T * ld.dkv * esz;
        cuda_convert2d(be, (char *)dk.p + boff, dt, ld.dkv, dK32, DT_F32, nkv * hd, T, nkv * hd);
        cuda_convert2d(be, (char *)dv.p + boff, dt, ld.dkv, dV32, DT_F32, nkv * hd, T, nkv * hd);
    }
}
