/* kernels/cuda/cuda_flash_kernels.cuh — the device code of the fused
 * attention's forward (cuda_flash.cu launches it) and what its backward
 * (cuda_flash_backward.cuh) shares: the arguments, tile sizes, masks,
 * reductions and the exponential, the forward kernel and its launch shape.
 * Self-contained (cuda_device.h), so that the same source also runs under
 * the CPU emulation of the device (tests/cuda_emu).
 *
 * Fused causal grouped-query attention (FlashAttention-2), forward and
 * backward, for BF16 tensors and head dims 64 and 128; the CUDA backend's
 * attention for those shapes (cuda_attention.cu dispatches, and keeps the
 * unfused path for the rest).
 *
 * Math: backend.h (scale 1/sqrt(hd), query t sees keys [lo(t), t] with
 * lo(t) = seg[b,t] clamped to [0, t], or 0 without seg). Products on tensor
 * cores, mma.sync m16n8k16 (bf16 in, fp32 accumulate; sm_80 and later), P
 * and dS / scale rounded to bf16 before their products (one cvt.rn.bf16x2
 * a pair; the unfused path rounds P and dS too), the scale applied to dQ
 * and dK in fp32 at the end; exponentials in base 2 with the scale folded
 * into one FFMA an element (ex2.approx.ftz); row statistics, lse and D in
 * fp32.
 *
 * Forward: one block of four warps per (64 query rows, batch row, head);
 * each warp owns 16 rows, keeps its Q fragments and fp32 output accumulator
 * in registers, and walks the 64-key tiles of K and V (staged in shared
 * memory) from the first tile any row of the block sees (the smallest
 * document start) to the diagonal, with a running max and sum per row
 * (online softmax; m the raw max score). Tiles wholly above the diagonal
 * or before every document of the warp's rows are skipped. lse = m scale +
 * log(l) is saved.
 *
 * Backward: cuda_flash_backward.cuh. Grids: blockIdx.x the (batch row,
 * head) pair, y the block of rows or keys, so the longest blocks of every
 * head start first (fa_row_block). No atomics: every output element has one
 * writer, and its sums run in a fixed order, so the forward is
 * deterministic (bit for bit from run to run on one GPU model).
 *
 * The tensor-core primitives (the product, ldmatrix, cp.async, the staged
 * tile products): cuda_mma.cuh.
 *
 * GQA by indexing: query head h reads kv head h / (nh / nkv) in place.
 * Packed rows (seg) are handled per element (no mask tensor); any T (rows
 * and keys past T are zero in the staged tiles and masked). */
#ifndef SPOTUNE_CUDA_FLASH_KERNELS_CUH
#define SPOTUNE_CUDA_FLASH_KERNELS_CUH

#include <limits.h>
#include <stdint.h>

#include "cuda_device.h"
#include "cuda_mma.cuh"

#define FA_BR 64   /* query rows per forward / dQ block (four warps of 16) */
#define FA_BC 64   /* keys per tile; keys per dK/dV block */
#define FA_BQ 32   /* query rows per tile of the dK/dV kernel */
#define FA_THREADS 128
/* Forward blocks a multiprocessor must hold: the register cap (3 x 128
 * threads is 168 registers a thread) gives 12 warps instead of 8, and the
 * forward 11% more speed on an H200 (16 bytes spilled, outside the loop).
 * The backward kernels stay at 2 (about 250 registers: their dK, dV or dQ
 * accumulators and two fragment sets): capped at 3, the dK/dV kernel
 * spilled 300 bytes in its loop and ran 18% slower, and a dQ kernel
 * rearranged to fit 3 (dO staged, half tiles) gained under 2%
 * (docs/perf.md). */
#define FA_FWD_MIN_BLOCKS 3

typedef struct flash_args {
    const uint16_t *q, *k, *v, *o, *dout;
    uint16_t *out, *dq, *dk, *dv;
    float *lse;      /* [B, nh, T] */
    float *D;        /* [B, nh, T], backward */
    const int *seg;  /* [B, T] or NULL */
    /* the split dK/dV of grouped-query attention (fa_dkdv_split): each
     * query head's share, fp32 [B, T, nh, hd], summed over the group by
     * flash_dkdv_reduce_kernel; NULL: a block sums its whole group */
    float *dk_part, *dv_part;
    int B, T, nh, nkv;
    /* row strides (elements between tokens): q; k and v; out and dout (nh
     * hd: contiguous); dq; dk and dv (backend.h, attention) */
    int ldq, ldk, ldo, lddq, lddk;
    float scale;
    int pair0; /* the chunk's first (batch row, query head) pair: a multiple of nh / nkv */
    /* dS / scale of this chunk's query pairs (b*nh + h from pair0), bf16
     * tiles (fa_ds_tile); NULL: not stored (flash_dq_kernel recomputes) */
    uint16_t *ds;
} flash_args;

/* ---- masks and reductions ---------------------------------------------------------- */

/* The first key query t sees (seg row of this batch row, or NULL). */
static __device__ __forceinline__ int fa_lo(const int *seg, int t)
{
    if (!seg)
        return 0;
    int v = seg[t];
    return v < 0 ? 0 : v > t ? t : v;
}

static __device__ __forceinline__ int warp_min_i(int v)
{
    for (int o = 16; o > 0; o >>= 1) {
        int w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w < v ? w : v;
    }
    return v;
}

static __device__ __forceinline__ int warp_max_i(int v)
{
    for (int o = 16; o > 0; o >>= 1) {
        int w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    return v;
}

/* Reduction over the four lanes of a quad (the lanes sharing a row). */
static __device__ __forceinline__ float quad_max(float v)
{
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

static __device__ __forceinline__ float quad_sum(float v)
{
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

/* The smallest first key of query rows [r0, r1) (block-wide, via sh). */
static __device__ int block_min_lo(const int *seg, int r0, int r1, int *sh)
{
    if (threadIdx.x == 0)
        *sh = INT_MAX;
    __syncthreads();
    int lo = INT_MAX;
    for (int t = r0 + threadIdx.x; t < r1; t += blockDim.x) {
        int l = fa_lo(seg, t);
        lo = l < lo ? l : lo;
    }
    atomicMin(sh, lo); /* a min: the result does not depend on the order */
    __syncthreads();
    return *sh;
}

#define FA_LOG2E 1.4426950408889634f

/* 2^x for the softmax: one ex2.approx.ftz on the device (about 2 ulp; a
 * result below 2^-126 is 0, far under what a bf16 P or an fp32 sum of
 * probabilities keeps), where exp2f also scales and squares to keep
 * subnormal results (three more instructions an element). exp2(-inf) = 0. */
static __device__ __forceinline__ float fa_exp2(float x)
{
#if !defined(SPOTUNE_CUDA_EMU) && defined(__CUDA_ARCH__)
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
#else
    return exp2f(x);
#endif
}

/* ---- forward ---------------------------------------------------------------------- */

/* -inf where the warp's 16 rows (rowA: this lane's first; loA, loB: its
 * rows' first keys) do not see keys j0.. of a tile of raw scores: past the
 * row (the diagonal), before its document, or a row past T. */
template <int NT>
static __device__ __forceinline__ void mask_tile(float s[NT][4], int j0, int rowA, int loA, int loB,
                                                 int T)
{
    int t = threadIdx.x & 3;
    FA_UNROLL
    for (int nt = 0; nt < NT; nt++)
        FA_UNROLL
        for (int e = 0; e < 4; e++) {
            int row = e < 2 ? rowA : rowA + 8, lo = e < 2 ? loA : loB;
            int j = j0 + nt * 8 + 2 * t + (e & 1);
            if (!(row < T && j <= row && j >= lo))
                s[nt][e] = -INFINITY;
        }
}

/* Raw scores of the warp's 16 rows against the 64 staged keys: s = Q K^T
 * (unscaled: the scale is folded into the exponent, below), -inf where
 * masked. Only a tile that crosses the diagonal, a document start or T
 * (mask) is masked element by element. */
template <int HD, int NT>
static __device__ __forceinline__ void scores_tile(float s[NT][4], const uint32_t qa[HD / 16][4],
                                                   const uint16_t *Ks, int j0, int rowA, int loA,
                                                   int loB, int T, int mask)
{
    a_times_staged_t<HD, NT>(s, qa, Ks);
    if (mask)
        mask_tile<NT>(s, j0, rowA, loA, loB, T);
}

/* Online softmax over one tile of raw scores for this lane's two rows: s
 * becomes P = exp2(s sl2 - m sl2) (fp32, 0 where masked: exp2(-inf)), m
 * (the raw running max) and l (lane-partial sums) are updated, o
 * rescaled. One FFMA and one exp2 an element (FlashAttention-2's folding
 * of the scale); a row that has seen no key yet (m = -inf) subtracts 0. */
template <int HD>
static __device__ __forceinline__ void online_tile(float s[8][4], float m[2], float l[2],
                                                   float o[HD / 8][4], float sl2)
{
    FA_UNROLL
    for (int r = 0; r < 2; r++) {
        float mx = m[r];
        FA_UNROLL
        for (int nt = 0; nt < 8; nt++)
            mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
        mx = quad_max(mx);
        float mxs = mx == -INFINITY ? 0.0f : mx * sl2;
        float corr = fa_exp2(m[r] * sl2 - mxs); /* 0 when m was -inf */
        float sum = 0.0f;
        FA_UNROLL
        for (int nt = 0; nt < 8; nt++)
            FA_UNROLL
            for (int e = 2 * r; e < 2 * r + 2; e++) {
                s[nt][e] = fa_exp2(fmaf(s[nt][e], sl2, -mxs));
                sum += s[nt][e];
            }
        m[r] = mx;
        l[r] = l[r] * corr + sum;
        FA_UNROLL
        for (int nt = 0; nt < HD / 8; nt++) {
            o[nt][2 * r] *= corr;
            o[nt][2 * r + 1] *= corr;
        }
    }
}

/* Writes 16 rows x HD of fp32 accumulators (times mul[r]) as bf16. */
template <int HD>
static __device__ __forceinline__ void store_rows(uint16_t *base, size_t ld, int rowA, int T,
                                                  const float acc[HD / 8][4], const float mul[2])
{
    int t = threadIdx.x & 3;
    FA_UNROLL
    for (int r = 0; r < 2; r++) {
        int row = rowA + 8 * r;
        if (row >= T)
            continue;
        uint16_t *dst = base + (size_t)row * ld + 2 * t;
        FA_UNROLL
        for (int nt = 0; nt < HD / 8; nt++)
            *(uint32_t *)(dst + nt * 8) =
                pack2(acc[nt][2 * r] * mul[r], acc[nt][2 * r + 1] * mul[r]);
    }
}

/* The same as fp32 (the split dK/dV shares). */
template <int HD>
static __device__ __forceinline__ void store_rows_f32(float *base, size_t ld, int rowA, int T,
                                                      const float acc[HD / 8][4])
{
    int t = threadIdx.x & 3;
    FA_UNROLL
    for (int r = 0; r < 2; r++) {
        int row = rowA + 8 * r;
        if (row >= T)
            continue;
        float *dst = base + (size_t)row * ld + 2 * t;
        FA_UNROLL
        for (int nt = 0; nt < HD / 8; nt++) {
            dst[nt * 8] = acc[nt][2 * r];
            dst[nt * 8 + 1] = acc[nt][2 * r + 1];
        }
    }
}

/* The grids: blockIdx.x the (batch row, head) pair, blockIdx.y the block
 * of query rows or keys, so that blocks start (x fastest) in order of
 * their work, the longest first for every head before any shorter one
 * (with the pair as y, the first wave held every block of a few heads,
 * long and short, and the long ones trailed at the end).
 *
 * The query-row block of this forward or dQ block: the last rows first
 * (they see the most keys). */
static __device__ __forceinline__ int fa_row_block(void)
{
    return (int)(gridDim.y - 1 - blockIdx.y);
}

/* Whether a warp's 16 rows [w0, w0 + 16) against keys [j0, j0 + nk) need
 * the element mask: some key past some row (the diagonal), a row past T,
 * or a row whose document starts after j0 (hi_lo: the warp's largest
 * first key). */
static __device__ __forceinline__ int fa_needs_mask(int w0, int j0, int nk, int T, int hi_lo)
{
    return j0 + nk - 1 > w0 || w0 + 15 >= T || hi_lo > j0;
}

/* Its dynamic shared memory: the K and V tiles, and with QS the block's Q
 * rows (52 KiB at head dim 128: the host raises the kernel's limit). */
static __host__ __device__ __forceinline__ size_t fa_forward_smem(int hd, int qs)
{
    return ((size_t)2 * FA_BC + (qs ? FA_BR : 0)) * (size_t)(hd + FA_PAD) * sizeof(uint16_t);
}

/* QS 1 (head dim 128 where shared memory allows: cuda_flash.cu,
 * cuda_flash_operands_staged): the block's 64 query rows are staged with
 * the first K tile and each warp reads its 16 rows' fragments by ldmatrix
 * for every S = Q K^T. QS 0 (head dim 64, a GPU with less shared memory,
 * and SPOTUNE_CUDA_ATTENTION=fused-regs): the fragments are held in
 * registers, which at head dim 128 (64 a thread) under the 168-register
 * cap spilled inside the tile loop (15 local loads and stores a trip). */
template <int HD, int QS>
__global__ void __launch_bounds__(FA_THREADS, FA_FWD_MIN_BLOCKS) flash_forward_kernel(flash_args a)
{
    DYNAMIC_SHARED(uint16_t, sm);
    uint16_t *Ks = sm, *Vs = sm + FA_BC * (HD + FA_PAD), *Qs = Vs + FA_BC * (HD + FA_PAD);
    __shared__ int sh_lo;
    int b = blockIdx.x / a.nh, h = blockIdx.x % a.nh, kh = h / (a.nh / a.nkv), T = a.T;
    int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
    int q0 = fa_row_block() * FA_BR, q1 = min(q0 + FA_BR, T), w0 = q0 + warp * 16;
    size_t ldq = (size_t)a.ldq, ldk = (size_t)a.ldk, ldo = (size_t)a.ldo;
    const uint16_t *qb = a.q + (size_t)b * T * ldq + (size_t)h * HD;
    const uint16_t *kb = a.k + (size_t)b * T * ldk + (size_t)kh * HD;
    const uint16_t *vb = a.v + (size_t)b * T * ldk + (size_t)kh * HD;
    const int *seg = a.seg ? a.seg + (size_t)b * T : NULL;
    int rowA = w0 + g;
    int loA = rowA < T ? fa_lo(seg, rowA) : INT_MAX, loB = rowA + 8 < T ? fa_lo(seg, rowA + 8) : INT_MAX;
    int wlo = warp_min_i(min(loA, loB));
    int whi = warp_max_i(max(rowA < T ? loA : 0, rowA + 8 < T ? loB : 0));
    int kstart = block_min_lo(seg, q0, q1, &sh_lo) / FA_BC * FA_BC;
    float sl2 = a.scale * FA_LOG2E;

    stage_rows_async<HD>(Ks, kb, ldk, kstart, FA_BC, T);
    if constexpr (QS)
        stage_rows_async<HD>(Qs, qb, ldq, q0, FA_BR, T);
    cp_async_commit();
    const uint16_t *qw = Qs + warp * 16 * (HD + FA_PAD);
    uint32_t qa[QS ? 1 : HD / 16][4];
    if constexpr (!QS)
        load_a_rows<HD>(qa, qb, ldq, w0, T);
    float o[HD / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    FA_UNROLL
    for (int nt = 0; nt < HD / 8; nt++)
        o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    /* K of a tile is copied while the previous tile's P V runs, V while
     * its own scores and softmax run */
    for (int j0 = kstart; j0 < q1; j0 += FA_BC) {
        cp_async_wait<0>();
        __syncthreads(); /* K(j0) is in; every warp is done with V(j0 - 64) */
        stage_rows_async<HD>(Vs, vb, ldk, j0, FA_BC, T);
        cp_async_commit();
        /* warp-uniform: some row of the warp sees some key of the tile */
        int act = !(w0 >= T || j0 > min(w0 + 15, T - 1) || wlo > j0 + FA_BC - 1);
        float s[8][4];
        if (act) {
            if constexpr (QS)
                staged_times_staged_t<HD, 8>(s, qw, Ks); /* S = Q K^T */
            else
                a_times_staged_t<HD, 8>(s, qa, Ks);
            if (fa_needs_mask(w0, j0, FA_BC, T, whi))
                mask_tile<8>(s, j0, rowA, loA, loB, T); /* -inf where masked */
            online_tile<HD>(s, m, l, o, sl2);
        }
        cp_async_wait<0>();
        __syncthreads(); /* V(j0) is in; every warp is done with K(j0) */
        if (j0 + FA_BC < q1) {
            stage_rows_async<HD>(Ks, kb, ldk, j0 + FA_BC, FA_BC, T);
            cp_async_commit();
        }
        if (act)
            c_times_staged<HD, 4>(o, s, Vs);
    }
    float inv[2];
    for (int r = 0; r < 2; r++) {
        l[r] = quad_sum(l[r]);
        inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    }
    store_rows<HD>(a.out + (size_t)b * T * ldo + (size_t)h * HD, ldo, rowA, T, o, inv);
    if ((threadIdx.x & 3) == 0)
        for (int r = 0; r < 2; r++)
            if (rowA + 8 * r < T) /* m: the raw max score */
                a.lse[((size_t)b * a.nh + h) * T + rowA + 8 * r] = m[r] * a.scale + logf(l[r]);
}

/* ---- launch shapes (the host code and the emulation tests) ----------------------- */

static inline unsigned fa_row_blocks(int T) /* forward and dQ: grid.y; grid.x B * nh */
{
    return (unsigned)((T + FA_BR - 1) / FA_BR);
}

#endif
