/* kernels/cuda/cuda_flash_backward.cuh — the device code of the fused
 * attention's backward (cuda_flash.cu launches it): its kernels, the
 * layout of the stored dS and the chunks it is made in, and the launch
 * shapes. The forward, the arguments and what both share (masks,
 * reductions, the exponential): cuda_flash_kernels.cuh; the tensor-core
 * primitives: cuda_mma.cuh. Self-contained like them, so that the same
 * source also runs under the CPU emulation of the device (tests/cuda_emu).
 *
 * D = rowsum(dO * O) (fp32, [B, nh, T] in the backend's scratch), then
 * two kernels:
 *  - dK, dV: one block per (64 keys, batch row, kv head); each warp owns 16
 *    keys (K and V staged once, dK, dV accumulators in registers) and walks
 *    every query head of the group and the 32-row query tiles at and after
 *    its keys, recomputing P = exp(S - lse) from Q, K and lse:
 *    dV += P^T dO, dP^T = V dO^T, dS = P (dP - D) scale, dK += dS^T Q.
 *    With a dS buffer (a.ds) it also writes dS / scale, rounded to bf16 as
 *    its products use it, in 64 x 64 tiles (fa_ds_tile): five products in
 *    all instead of seven.
 *  - dQ, from the stored dS (flash_dq_stored_kernel): one block per (64
 *    query rows, batch row, head) reads its tiles of dS and K: dQ += dS K,
 *    one product a tile.
 *  - or dQ recomputing (flash_dq_kernel, when the buffer would not fit
 *    or is not asked for): the same blocks recompute S and dP as the
 *    forward does: dP = dO V^T, dS = P (dP - D) scale, dQ += dS K.
 * The dS buffer holds the causal tiles of a chunk of (batch row, head)
 * pairs (fa_ds_chunks: at most FA_DS_BUDGET bytes with the split shares);
 * the host runs dK/dV then dQ chunk by chunk.
 * Grids: blockIdx.x the (batch row, head) pair, y the block of rows or
 * keys, so the longest blocks of every head start first (fa_row_block).
 * No atomics: every output element has one writer, and its sums run in a
 * fixed order, so the backward is deterministic (bit for bit from run to
 * run on one GPU model), either way dQ is made. */
#ifndef SPOTUNE_CUDA_FLASH_BACKWARD_CUH
#define SPOTUNE_CUDA_FLASH_BACKWARD_CUH

#include <limits.h>
#include <stdint.h>

#include "cuda_flash_kernels.cuh"

static_assert(FA_BR == 64 && FA_BC == 64, "the stored dS is in 64 x 64 tiles");

/* The stored dS: for each (batch row, query head) pair the 64 x 64 tiles of
 * keys [64 kb, 64 kb + 64) x queries [64 qb, 64 qb + 64) with qb >= kb (the
 * causal half), tile (kb, qb) at fa_ds_tile(kb, qb), each as 64 rows of
 * keys of 64 queries (dS^T, as the dK/dV kernel holds it). Every element
 * of every tile is written: past T (keys or queries) and where no query
 * sees the key, 0. */
static __host__ __device__ __forceinline__ size_t fa_ds_tile(int kb, int qb)
{
    return ((size_t)qb * (qb + 1) / 2 + (size_t)kb) * 64 * 64;
}

/* Elements of one pair's stored dS: the tiles at and below the diagonal. */
static __host__ __device__ __forceinline__ size_t fa_ds_pair(int T)
{
    int nb = (T + 63) / 64;
    return fa_ds_tile(0, nb);
}

/* ---- backward: D ------------------------------------------------------------------ */

/* D[(b*nh + h)*T + t] = dot(dO[b,t,h,:], O[b,t,h,:]) in fp32: one warp per
 * row. Static, as the reduction below: cuda_flash.cu and cuda_flash_wgmma.cu
 * include this header, and only the first launches them. */
static __global__ __attribute__((unused)) void flash_rowdot_kernel(flash_args a, int hd)
{
    size_t nrows = (size_t)a.B * a.T * a.nh;
    size_t r = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; /* (b*T + t)*nh + h */
    if (r >= nrows)
        return;
    int lane = threadIdx.x & 31;
    float acc = 0.0f;
    for (int d = lane; d < hd; d += 32)
        acc += bf16_to_f32(a.dout[r * hd + d]) * bf16_to_f32(a.o[r * hd + d]);
    acc = warp_sum(acc);
    if (lane == 0) {
        size_t h = r % a.nh, bt = r / a.nh, t = bt % a.T, b = bt / a.T;
        a.D[(b * a.nh + h) * a.T + t] = acc;
    }
}

/* ---- backward: dK, dV ------------------------------------------------------------- */

/* The first key query i0 + r of a staged item sees (fa_lo, INT_MAX past
 * T) from its staged segment row seg_s (not staged without segments). */
static __device__ __forceinline__ int fa_lo_staged(const int *seg_s, int r, int i0, int T,
                                                  int has_seg)
{
    int i = i0 + r;
    if (i >= T)
        return INT_MAX;
    if (!has_seg)
        return 0;
    int v = seg_s[r];
    return v < 0 ? 0 : v > i ? i : v;
}

/* P^T of the warp's 16 keys x 32 staged queries from S^T: exp2(s scale
 * log2(e) - lse[i] log2(e)) where query i sees the key, else 0 (only a
 * masked tile tests each element), into s. lse_s, seg_s: the item's staged
 * lse and segment rows (dkdv_stage). The wgmma kernel computes it while
 * dP^T's products run. */
static __device__ __forceinline__ void fa_probs(float s[4][4], int keyA, int i0,
                                                const float *lse_s, const int *seg_s,
                                                int has_seg, int T, float sl2, int mask)
{
    int t = threadIdx.x & 3;
    FA_UNROLL
    for (int nt = 0; nt < 4; nt++)
        FA_UNROLL
        for (int e = 0; e < 4; e++) {
            int r = nt * 8 + 2 * t + (e & 1);
            float p = fa_exp2(fmaf(s[nt][e], sl2, -(lse_s[r] * FA_LOG2E)));
            if (mask) {
                int key = e < 2 ? keyA : keyA + 8, i = i0 + r;
                if (!(i < T && key <= i && key >= fa_lo_staged(seg_s, r, i0, T, has_seg)))
                    p = 0.0f;
            }
            s[nt][e] = p;
        }
}

/* dS^T / scale = P (dP - D) into dp (the scale is applied to dK once, at
 * the end). */
static __device__ __forceinline__ void fa_ds_of(float dp[4][4], const float p[4][4],
                                                const float *D_s)
{
    int t = threadIdx.x & 3;
    FA_UNROLL
    for (int nt = 0; nt < 4; nt++)
        FA_UNROLL
        for (int e = 0; e < 4; e++)
            dp[nt][e] = p[nt][e] * (dp[nt][e] - D_s[nt * 8 + 2 * t + (e & 1)]);
}

/* Both (the mma.sync dK/dV kernel). */
static __device__ __forceinline__ void probs_and_ds(float s[4][4], float dp[4][4], int keyA,
                                                    int i0, const float *lse_s, const float *D_s,
                                                    const int *seg_s, int has_seg, int T,
                                                    float sl2, int mask)
{
    fa_probs(s, keyA, i0, lse_s, seg_s, has_seg, T, sl2, mask);
    fa_ds_of(dp, s, D_s);
}

/* The dK/dV block's work items, in order: every query head of the kv
 * group, and for each the 32-row query tiles at and after its keys. */
typedef struct fa_item {
    int h, i0;
} fa_item;

static __device__ __forceinline__ fa_item fa_dkdv_item(int n, int h_first, int i_first,
                                                       int ntiles)
{
    fa_item it;
    it.h = h_first + n / ntiles;
    it.i0 = i_first + (n % ntiles) * FA_BQ;
    return it;
}

/* Starts staging item n of the dK/dV block (batch row b, kv head kh) into
 * one buffer (the block's query heads from h_first), all by cp.async in
 * one group: Q and dO rows (CORE: as core matrices, stage_core_async), and
 * the rows' lse, D and (with segments) segment starts, zeros past T. No
 * thread waits for memory here: the loads the threads made themselves held
 * the first warp, and the block at the barrier after, a memory latency
 * every item. */
template <int HD, int CORE = 0>
static __device__ __forceinline__ void dkdv_stage(const flash_args &a, int b, int h_first, int i_first,
                                                  int ntiles, int n, const int *seg, uint16_t *Qs,
                                                  uint16_t *dOs, float *lse_s, float *D_s,
                                                  int *seg_s)
{
    int T = a.T;
    fa_item it = fa_dkdv_item(n, h_first, i_first, ntiles);
    size_t ldq = (size_t)a.ldq, qoff = (size_t)b * T * ldq + (size_t)it.h * HD;
    size_t ldo = (size_t)a.ldo, ooff = (size_t)b * T * ldo + (size_t)it.h * HD;
    if constexpr (CORE) { /* as 8 x 8 core matrices (the wgmma kernel, cuda_wgmma.cuh) */
        stage_core_async<HD>(Qs, a.q + qoff, ldq, it.i0, FA_BQ, T);
        stage_core_async<HD>(dOs, a.dout + ooff, ldo, it.i0, FA_BQ, T);
    } else {
        stage_rows_async<HD>(Qs, a.q + qoff, ldq, it.i0, FA_BQ, T);
        stage_rows_async<HD>(dOs, a.dout + ooff, ldo, it.i0, FA_BQ, T);
    }
    const float *lse = a.lse + ((size_t)b * a.nh + it.h) * T;
    const float *D = a.D + ((size_t)b * a.nh + it.h) * T;
    for (int r = threadIdx.x; r < FA_BQ; r += blockDim.x) {
        int i = it.i0 + r, ok = i < T, at = ok ? i : 0;
        cp_async4(lse_s + r, lse + at, ok);
        cp_async4(D_s + r, D + at, ok);
        if (seg)
            cp_async4(seg_s + r, seg + at, ok);
    }
    cp_async_commit();
}

/* This lane's first element of the warp's 16 keys x 32 queries of the
 * stored dS for the item of query head h at queries i0 (rows 16 warp + g
 * of the tile, queries from column i0 % 64), or NULL when not stored. */
static __device__ __forceinline__ uint16_t *fa_ds_dst(const flash_args &a, int b, int warp, int g,
                                                     int lane, int h, int i0, int T)
{
    return a.ds ? a.ds + (size_t)(b * a.nh + h - a.pair0) * fa_ds_pair(T) +
                      fa_ds_tile((int)blockIdx.y, i0 / 64) + (size_t)(warp * 16 + g) * 64 +
                      (i0 & 63) + 2 * (lane & 3)
                : NULL;
}

/* Writes this lane's part of dS / scale (keys g and g + 8), rounded to
 * bf16 as the products use it. */
static __device__ __forceinline__ void fa_ds_write(uint16_t *dst, const float dp[4][4])
{
    FA_UNROLL
    for (int nt = 0; nt < 4; nt++) {
        *(uint32_t *)(dst + nt * 8) = pack2(dp[nt][0], dp[nt][1]);
        *(uint32_t *)(dst + 8 * 64 + nt * 8) = pack2(dp[nt][2], dp[nt][3]);
    }
}

/* The tile's other 32 queries when they are past T (no item of theirs):
 * zeros, so that dQ stages no memory left unwritten. */
static __device__ __forceinline__ void fa_ds_zero_past_t(uint16_t *dst, int i0, int T)
{
    if ((i0 & 63) == 0 && i0 + FA_BQ >= T)
        FA_UNROLL
        for (int nt = 0; nt < 4; nt++)
            *(uint32_t *)(dst + FA_BQ + nt * 8) = *(uint32_t *)(dst + FA_BQ + 8 * 64 + nt * 8) = 0u;
}

/* The end of a dK/dV block: dK = scale (dS / scale)^T Q, then dK and dV
 * stored: this query head's fp32 shares with the split, else bf16 (at
 * dkoff, row stride a.lddk). */
template <int HD>
static __device__ __forceinline__ void fa_dkdv_finish(const flash_args &a, int split, int b,
                                                      int h_first, size_t dkoff, int keyA, int T,
                                                      float dk[HD / 8][4], float dv[HD / 8][4])
{
    FA_UNROLL
    for (int nt = 0; nt < HD / 8; nt++)
        FA_UNROLL
        for (int e = 0; e < 4; e++)
            dk[nt][e] *= a.scale;
    const float one[2] = {1.0f, 1.0f};
    if (split) {
        size_t ldp = (size_t)a.nh * HD, poff = (size_t)b * T * ldp + (size_t)h_first * HD;
        store_rows_f32<HD>(a.dk_part + poff, ldp, keyA, T, dk);
        store_rows_f32<HD>(a.dv_part + poff, ldp, keyA, T, dv);
        return;
    }
    store_rows<HD>(a.dk + dkoff, (size_t)a.lddk, keyA, T, dk, one);
    store_rows<HD>(a.dv + dkoff, (size_t)a.lddk, keyA, T, dv, one);
}

/* Its dynamic shared memory (KVS: with the block's K and V rows): two
 * buffers of Q and dO tiles, then K and V (70 KiB at head dim 128 with
 * them: the host raises the kernel's limit, cuda_flash.cu). */
static __host__ __device__ __forceinline__ size_t fa_dkdv_smem(int hd, int kvs)
{
    return ((size_t)4 * FA_BQ + (kvs ? 2 * FA_BC : 0)) * (size_t)(hd + FA_PAD) * sizeof(uint16_t);
}

/* KVS 1 (head dim 128 where shared memory allows: cuda_flash.cu,
 * cuda_flash_operands_staged): K and V of the block's 64 keys are staged
 * once and each warp reads its 16 rows' fragments by ldmatrix as S^T and
 * dP^T need them. KVS 0 (head dim 64, a GPU with less shared memory, and
 * SPOTUNE_CUDA_ATTENTION=fused-regs): they are held in registers,
 * which at head dim 128 (64 a thread, with dK and dV's 128) left the
 * compiler too few to keep more than one fragment load in flight, and it
 * spilled inside the item loop (7 local loads and stores a trip). */
template <int HD, int KVS>
__global__ void __launch_bounds__(FA_THREADS) flash_dkdv_kernel(flash_args a)
{
    /* two buffers: item n + 1 is copied in while item n is computed */
    DYNAMIC_SHARED(uint16_t, sm);
    const int qtile = FA_BQ * (HD + FA_PAD); /* buffer bf: Q at sm + bf qtile, dO 2 tiles on */
    __shared__ __align__(16) float lse_s[2][FA_BQ], D_s[2][FA_BQ];
    __shared__ __align__(16) int seg_s[2][FA_BQ];
    /* a block per kv head and its whole group, or (split) per query head */
    int T = a.T, group = a.nh / a.nkv, split = a.dk_part != NULL;
    int bx = (int)blockIdx.x + (split ? a.pair0 : a.pair0 / group); /* chunks: fa_ds_chunks */
    int b = bx / (split ? a.nh : a.nkv), hy = bx % (split ? a.nh : a.nkv);
    int kh = split ? hy / group : hy, h_first = split ? hy : hy * group, nheads = split ? 1 : group;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    int k0 = blockIdx.y * FA_BC, w0 = k0 + warp * 16, keyA = w0 + g; /* the first keys first */
    size_t ldk = (size_t)a.ldk;
    size_t koff = (size_t)b * T * ldk + (size_t)kh * HD;
    size_t dkoff = (size_t)b * T * a.lddk + (size_t)kh * HD;
    const int *seg = a.seg ? a.seg + (size_t)b * T : NULL;
    int has_seg = seg != NULL;
    float sl2 = a.scale * FA_LOG2E;
    int i_first = k0 / FA_BQ * FA_BQ, ntiles = (T - i_first + FA_BQ - 1) / FA_BQ;
    int nitems = nheads * ntiles;

    /* K, V (KVS) in the first group, with item 0 */
    uint16_t *kw = sm + 4 * qtile + warp * 16 * (HD + FA_PAD), *vw = kw + FA_BC * (HD + FA_PAD);
    if constexpr (KVS) {
        stage_rows_async<HD>(sm + 4 * qtile, a.k + koff, ldk, k0, FA_BC, T);
        stage_rows_async<HD>(sm + 4 * qtile + FA_BC * (HD + FA_PAD), a.v + koff, ldk, k0, FA_BC,
                             T);
    }
    if (nitems > 0)
        dkdv_stage<HD>(a, b, h_first, i_first, ntiles, 0, seg, sm, sm + 2 * qtile, lse_s[0],
                       D_s[0], seg_s[0]);
    else { /* no item (every block has one): no copy left in flight */
        cp_async_commit();
        cp_async_wait<0>();
    }
    uint32_t ka[KVS ? 1 : HD / 16][4], va[KVS ? 1 : HD / 16][4];
    if constexpr (!KVS) {
        load_a_rows<HD>(ka, a.k + koff, ldk, w0, T);
        load_a_rows<HD>(va, a.v + koff, ldk, w0, T);
    }
    float dk[HD / 8][4], dv[HD / 8][4];
    FA_UNROLL
    for (int nt = 0; nt < HD / 8; nt++)
        FA_UNROLL
        for (int e = 0; e < 4; e++)
            dk[nt][e] = dv[nt][e] = 0.0f;
    for (int n = 0; n < nitems; n++) {
        int bf = n & 1;
        if (n + 1 < nitems) {
            /* buffer bf ^ 1: its readers passed the barrier at the end of item n - 1 */
            dkdv_stage<HD>(a, b, h_first, i_first, ntiles, n + 1, seg, sm + (bf ^ 1) * qtile,
                           sm + (2 + (bf ^ 1)) * qtile, lse_s[bf ^ 1], D_s[bf ^ 1], seg_s[bf ^ 1]);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads(); /* item n is in */
        fa_item it = fa_dkdv_item(n, h_first, i_first, ntiles);
        int i0 = it.i0;
        const uint16_t *Qb = sm + bf * qtile, *dOb = sm + (2 + bf) * qtile;
        uint16_t *dst = fa_ds_dst(a, b, warp, g, lane, it.h, i0, T); /* this warp's part of dS */
        /* warp-uniform: some query of the tile sees some key of the warp */
        int lo = fa_lo_staged(seg_s[bf], lane, i0, T, has_seg); /* FA_BQ == 32: a row a lane */
        int tlo = warp_min_i(lo), thi = warp_max_i(lo == INT_MAX ? 0 : lo);
        if (!(w0 >= T || i0 + FA_BQ - 1 < w0 || tlo > min(w0 + 15, T - 1))) {
            /* the element mask: a key past some query, a query or key past
             * T, or a query whose document starts after the warp's first key */
            int mask = w0 + 15 > i0 || i0 + FA_BQ - 1 >= T || w0 + 15 >= T || thi > w0;
            float s[4][4], dp[4][4];
            if constexpr (KVS) {
                staged_times_staged_t<HD, 4>(s, kw, Qb);   /* S^T = K Q^T */
                staged_times_staged_t<HD, 4>(dp, vw, dOb); /* dP^T = V dO^T */
            } else {
                a_times_staged_t<HD, 4>(s, ka, Qb);
                a_times_staged_t<HD, 4>(dp, va, dOb);
            }
            probs_and_ds(s, dp, keyA, i0, lse_s[bf], D_s[bf], seg_s[bf], has_seg, T, sl2, mask);
            if (dst)
                fa_ds_write(dst, dp);
            c_times_staged<HD, 2>(dv, s, dOb); /* dV += P^T dO */
            c_times_staged<HD, 2>(dk, dp, Qb); /* dK += dS^T Q */
        } else if (dst) {
            /* no query of the tile sees a key of the warp: dS is 0 (dQ
             * reads every tile at and below the diagonal) */
            FA_UNROLL
            for (int nt = 0; nt < 4; nt++)
                *(uint32_t *)(dst + nt * 8) = *(uint32_t *)(dst + 8 * 64 + nt * 8) = 0u;
        }
        if (dst)
            fa_ds_zero_past_t(dst, i0, T);
        __syncthreads(); /* every warp is done with buffer bf */
    }
    fa_dkdv_finish<HD>(a, split, b, h_first, dkoff, keyA, T, dk, dv);
}

/* dK, dV [B, T, nkv, hd] (bf16, row stride a.lddk) = the sums over each
 * group's query heads of the split shares, head by head in order
 * (deterministic). */
static __global__ __attribute__((unused)) void flash_dkdv_reduce_kernel(flash_args a, int hd)
{
    int group = a.nh / a.nkv;
    size_t n = (size_t)a.B * a.T * a.nkv * hd;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (size_t)gridDim.x * blockDim.x) {
        size_t d = e % hd, r = e / hd; /* r = (b*T + t)*nkv + kh */
        size_t kh = r % a.nkv, bt = r / a.nkv;
        size_t p = (bt * a.nh + kh * group) * hd + d;
        float sk = 0.0f, sv = 0.0f;
        for (int g = 0; g < group; g++, p += hd) {
            sk += a.dk_part[p];
            sv += a.dv_part[p];
        }
        size_t o = bt * (size_t)a.lddk + kh * (size_t)hd + d;
        a.dk[o] = f32_to_bf16(sk);
        a.dv[o] = f32_to_bf16(sv);
    }
}

/* ---- backward: dQ ----------------------------------------------------------------- */

template <int HD>
__global__ void __launch_bounds__(FA_THREADS) flash_dq_kernel(flash_args a)
{
    __shared__ __align__(16) uint16_t Ks[FA_BC * (HD + FA_PAD)];
    __shared__ __align__(16) uint16_t Vs[FA_BC * (HD + FA_PAD)];
    __shared__ int sh_lo;
    int b = blockIdx.x / a.nh, h = blockIdx.x % a.nh, kh = h / (a.nh / a.nkv), T = a.T;
    int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
    int q0 = fa_row_block() * FA_BR, q1 = min(q0 + FA_BR, T), w0 = q0 + warp * 16, rowA = w0 + g;
    size_t ldq = (size_t)a.ldq, ldk = (size_t)a.ldk, ldo = (size_t)a.ldo, lddq = (size_t)a.lddq;
    size_t qoff = (size_t)b * T * ldq + (size_t)h * HD, koff = (size_t)b * T * ldk + (size_t)kh * HD;
    size_t ooff = (size_t)b * T * ldo + (size_t)h * HD, dqoff = (size_t)b * T * lddq + (size_t)h * HD;
    const int *seg = a.seg ? a.seg + (size_t)b * T : NULL;
    int loA = rowA < T ? fa_lo(seg, rowA) : INT_MAX, loB = rowA + 8 < T ? fa_lo(seg, rowA + 8) : INT_MAX;
    int wlo = warp_min_i(min(loA, loB));
    int whi = warp_max_i(max(rowA < T ? loA : 0, rowA + 8 < T ? loB : 0));
    int kstart = block_min_lo(seg, q0, q1, &sh_lo) / FA_BC * FA_BC;
    float sl2 = a.scale * FA_LOG2E;
    stage_rows_async<HD>(Ks, a.k + koff, ldk, kstart, FA_BC, T);
    stage_rows_async<HD>(Vs, a.v + koff, ldk, kstart, FA_BC, T);
    cp_async_commit();
    const float *lse = a.lse + ((size_t)b * a.nh + h) * T, *D = a.D + ((size_t)b * a.nh + h) * T;
    float lr[2], dr[2];
    for (int r = 0; r < 2; r++) {
        int row = rowA + 8 * r;
        lr[r] = row < T ? lse[row] * FA_LOG2E : 0.0f;
        dr[r] = row < T ? D[row] : 0.0f;
    }
    uint32_t qa[HD / 16][4], da[HD / 16][4];
    load_a_rows<HD>(qa, a.q + qoff, ldq, w0, T);
    load_a_rows<HD>(da, a.dout + ooff, ldo, w0, T);
    float dq[HD / 8][4];
    FA_UNROLL
    for (int nt = 0; nt < HD / 8; nt++)
        dq[nt][0] = dq[nt][1] = dq[nt][2] = dq[nt][3] = 0.0f;
    /* V of the next tile is copied while dS and dQ += dS K run */
    for (int j0 = kstart; j0 < q1; j0 += FA_BC) {
        cp_async_wait<0>();
        __syncthreads(); /* K(j0) and V(j0) are in */
        int act = !(w0 >= T || j0 > min(w0 + 15, T - 1) || wlo > j0 + FA_BC - 1);
        float s[8][4], dp[8][4];
        if (act) {
            scores_tile<HD, 8>(s, qa, Ks, j0, rowA, loA, loB, T,
                               fa_needs_mask(w0, j0, FA_BC, T, whi)); /* -inf where masked */
            a_times_staged_t<HD, 8>(dp, da, Vs);                    /* dP = dO V^T */
        }
        __syncthreads(); /* every warp is done with V(j0) */
        if (j0 + FA_BC < q1) {
            stage_rows_async<HD>(Vs, a.v + koff, ldk, j0 + FA_BC, FA_BC, T);
            cp_async_commit();
        }
        if (act) {
            FA_UNROLL
            for (int nt = 0; nt < 8; nt++)
                FA_UNROLL
                for (int e = 0; e < 4; e++) {
                    int r = e >> 1;
                    float p = fa_exp2(fmaf(s[nt][e], sl2, -lr[r])); /* 0 where masked */
                    s[nt][e] = p * (dp[nt][e] - dr[r]); /* dS / scale */
                }
            c_times_staged<HD, 4>(dq, s, Ks); /* dQ += dS K */
        }
        __syncthreads(); /* every warp is done with K(j0) */
        if (j0 + FA_BC < q1) {
            stage_rows_async<HD>(Ks, a.k + koff, ldk, j0 + FA_BC, FA_BC, T);
            cp_async_commit();
        }
    }
    const float sc[2] = {a.scale, a.scale}; /* dQ = scale (dS / scale) K */
    store_rows<HD>(a.dq + dqoff, lddq, rowA, T, dq, sc);
}

/* ---- backward: dQ from the stored dS ---------------------------------------------- */

/* One block per (64 query rows, batch row, query head) of the chunk (the
 * pair is a.pair0 + blockIdx.x), as flash_dq_kernel, walking the same key
 * tiles: K's tile and the tile of stored dS^T staged, each warp's 16 rows
 * of dS read as left operands by ldmatrix.trans, dQ += dS K. One product
 * a tile instead of three, no exponentials; the dS tiles are read once.
 * NBUF 2 buffers: the tiles of keys j0 + 64 are copied while those of j0
 * are multiplied (with one, each tile's copy was waited for in full: the
 * kernel's largest stall, docs/perf.md run 5), where a multiprocessor holds
 * four blocks of them (cuda_flash.cu); NBUF 1 elsewhere (an A100's or
 * sm_86/89 GPU's shared memory: half the blocks with two). Dynamic shared
 * memory (fa_dq_stored_smem): NBUF K tiles, then NBUF dS^T tiles. */
template <int HD, int NBUF>
__global__ void __launch_bounds__(FA_THREADS) flash_dq_stored_kernel(flash_args a)
{
    DYNAMIC_SHARED(uint16_t, sm);
    const int ktile = FA_BC * (HD + FA_PAD), stile = FA_BC * (FA_BR + FA_PAD);
    uint16_t *Ks = sm, *Ss = sm + NBUF * ktile; /* buffer bf: Ks + bf ktile, Ss + bf stile */
    __shared__ int sh_lo;
    int bx = (int)blockIdx.x + a.pair0;
    int b = bx / a.nh, h = bx % a.nh, kh = h / (a.nh / a.nkv), T = a.T;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    int qb = fa_row_block(), q0 = qb * FA_BR, q1 = min(q0 + FA_BR, T), w0 = q0 + warp * 16;
    int rowA = w0 + g;
    size_t ldk = (size_t)a.ldk, lddq = (size_t)a.lddq;
    size_t dqoff = (size_t)b * T * lddq + (size_t)h * HD, koff = (size_t)b * T * ldk + (size_t)kh * HD;
    const int *seg = a.seg ? a.seg + (size_t)b * T : NULL;
    int loA = rowA < T ? fa_lo(seg, rowA) : INT_MAX, loB = rowA + 8 < T ? fa_lo(seg, rowA + 8) : INT_MAX;
    int wlo = warp_min_i(min(loA, loB));
    int kstart = block_min_lo(seg, q0, q1, &sh_lo) / FA_BC * FA_BC;
    const uint16_t *dsp = a.ds + (size_t)blockIdx.x * fa_ds_pair(T);
    /* ldmatrix.trans row of this lane: matrix m = lane/8 is keys +8 (m >=
     * 2) x queries +8 (m odd) of the warp's 16 x 16 block of a k-step */
    const uint16_t *sr = Ss + ((lane & 7) + (lane >> 4) * 8) * (FA_BR + FA_PAD) + warp * 16 +
                         ((lane >> 3) & 1) * 8;
    const uint16_t *yr = staged_b_row<HD>(Ks);
    float dq[HD / 8][4];
    FA_UNROLL
    for (int nt = 0; nt < HD / 8; nt++)
        dq[nt][0] = dq[nt][1] = dq[nt][2] = dq[nt][3] = 0.0f;
    if (kstart < q1) {
        stage_rows_async<HD>(Ks, a.k + koff, ldk, kstart, FA_BC, T);
        stage_rows_async<FA_BR>(Ss, dsp + fa_ds_tile(kstart / FA_BC, qb), FA_BR, 0, FA_BC, FA_BC);
        cp_async_commit();
    }
    for (int j0 = kstart, bf = 0; j0 < q1; j0 += FA_BC, bf = (bf + 1) % NBUF) {
        cp_async_wait<0>();
        __syncthreads(); /* K(j0), dS(j0) are in buffer bf; every warp is done with buffer bf ^ 1 */
        int jn = j0 + FA_BC;
        if (NBUF == 2 && jn < q1) {
            int nb = bf ^ 1;
            stage_rows_async<HD>(Ks + nb * ktile, a.k + koff, ldk, jn, FA_BC, T);
            stage_rows_async<FA_BR>(Ss + nb * stile, dsp + fa_ds_tile(jn / FA_BC, qb), FA_BR, 0,
                                    FA_BC, FA_BC);
            cp_async_commit();
        }
        if (!(w0 >= T || j0 > min(w0 + 15, T - 1) || wlo > j0 + FA_BC - 1)) {
            FA_UNROLL
            for (int kk = 0; kk < FA_BC / 16; kk++) {
                uint32_t sa[4]; /* dS rows w0.. x keys j0 + 16 kk.. */
                ldsm_x4(sa, sr + bf * stile + kk * 16 * (FA_BR + FA_PAD), 1);
                frag_times_staged<HD>(dq, sa, yr + bf * ktile + kk * 16 * (HD + FA_PAD));
            }
        }
        if (NBUF == 1 && jn < q1) {
            __syncthreads(); /* every warp is done with the one buffer */
            stage_rows_async<HD>(Ks, a.k + koff, ldk, jn, FA_BC, T);
            stage_rows_async<FA_BR>(Ss, dsp + fa_ds_tile(jn / FA_BC, qb), FA_BR, 0, FA_BC, FA_BC);
            cp_async_commit();
        }
    }
    const float sc[2] = {a.scale, a.scale}; /* dQ = scale (dS / scale) K */
    store_rows<HD>(a.dq + dqoff, lddq, rowA, T, dq, sc);
}

/* Its dynamic shared memory: nbuf buffers of the K and dS^T tiles (53 KiB
 * with two at head dim 128: more than the 48 KiB a launch gets unasked, so
 * the host raises the kernel's limit, cuda_flash.cu). */
static __host__ __device__ __forceinline__ size_t fa_dq_stored_smem(int hd, int nbuf)
{
    return (size_t)nbuf * FA_BC * ((size_t)(hd + FA_PAD) + (FA_BR + FA_PAD)) * sizeof(uint16_t);
}

/* ---- launch shapes of the backward (the host code and the emulation tests) -------- */

/* Whether the dK/dV kernel splits grouped-query attention by query head
 * (a block per query head instead of per kv head: group times the blocks,
 * for a GPU full of them) into fp32 shares of 2 x B x T x nh x hd floats
 * that flash_dkdv_reduce_kernel sums: when there is a group and the shares
 * take at most 256 MiB. */
static inline int fa_dkdv_split(int B, int T, int nh, int nkv, int hd)
{
    return nh > nkv && 2.0 * 4.0 * B * T * nh * hd <= 256.0 * 1024 * 1024;
}

static inline unsigned fa_key_blocks(int T) /* dK, dV: grid.y; grid.x B * nkv (split: B * nh) */
{
    return (unsigned)((T + FA_BC - 1) / FA_BC);
}

#define FA_ROWDOT_THREADS 256 /* a warp per row */

static inline unsigned fa_rowdot_blocks(size_t nrows)
{
    return (unsigned)((nrows + FA_ROWDOT_THREADS / 32 - 1) / (FA_ROWDOT_THREADS / 32));
}

#define FA_REDUCE_THREADS 256 /* flash_dkdv_reduce_kernel: a grid-stride loop */

static inline unsigned fa_reduce_blocks(size_t n)
{
    size_t b = (n + FA_REDUCE_THREADS - 1) / FA_REDUCE_THREADS;
    return (unsigned)(b < 65536 ? (b ? b : 1) : 65536);
}

/* Offsets in the backward's scratch buffer (floats, each 256-byte aligned):
 * D [B, nh, T], then with the split the dK and dV shares, then the stored
 * dS of one chunk. */
static inline size_t fa_align64(size_t n)
{
    return (n + 63) / 64 * 64;
}

/* The most bytes the split shares and the stored dS of one chunk take
 * together: within the CUDA backend's planned workspace
 * (trainer/plan.h, PLAN_CUDA_WORKSPACE, which counts 256 MiB for the
 * attention's score blocks: the fused and unfused paths never run at once). */
#define FA_DS_BUDGET ((size_t)256 << 20)

/* How the stored-dS backward walks the (batch row, query head) pairs: in
 * chunks of `per_chunk` units of `unit` pairs (a dK/dV block's: the kv
 * group, or one pair with the split), `chunks` of them (the last may be
 * smaller), each chunk's dS `bytes`. chunks 0: one unit's dS does not fit
 * in budget bytes. */
typedef struct fa_ds_plan {
    int unit, units, per_chunk, chunks;
    size_t bytes;
} fa_ds_plan;

static inline fa_ds_plan fa_ds_chunks(int B, int T, int nh, int nkv, int split, size_t budget)
{
    fa_ds_plan p;
    p.unit = split ? 1 : nh / nkv;
    p.units = B * nh / p.unit;
    size_t per = (size_t)p.unit * fa_ds_pair(T) * sizeof(uint16_t);
    size_t fit = budget / per;
    if (fit == 0 || p.units <= 0) {
        p.per_chunk = p.chunks = 0;
        p.bytes = 0;
        return p;
    }
    p.chunks = (int)(((size_t)p.units + fit - 1) / fit);
    p.per_chunk = (p.units + p.chunks - 1) / p.chunks; /* balanced */
    p.bytes = (size_t)p.per_chunk * per;
    return p;
}

#endif
