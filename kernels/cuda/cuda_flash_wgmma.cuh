/* kernels/cuda/cuda_flash_wgmma.cuh — the device code of the fused
 * attention's forward, dK/dV and dQ-from-stored-dS kernels with Hopper
 * warpgroup products
 * (wgmma, cuda_wgmma.cuh), and a probe of their descriptors;
 * cuda_flash_wgmma.cu, compiled for sm_90a alone (kernels/cuda/
 * CMakeLists.txt), launches them. Selected by
 * SPOTUNE_CUDA_ATTENTION=fused-wgmma on a GPU of compute capability 9.0
 * (cuda_flash.cu); a dQ that recomputes S and dP stays mma.sync.
 * Self-contained like cuda_flash_kernels.cuh, so that the same source also
 * runs under the CPU emulation of the device (tests/cuda_emu).
 *
 * The algorithms, blocks, masks, online softmax and stores are those of
 * flash_forward_kernel and flash_dkdv_kernel (cuda_flash_kernels.cuh,
 * cuda_flash_backward.cuh), the same results under the emulation. What
 * changes is the products. Forward: one block of four warps (one
 * warpgroup) per 64 query rows, each warp's 16 rows of Q as A fragments;
 * S = Q K^T is HD/16 wgmma m64n64k16 and O += P V four wgmma m64nHDk16,
 * which read K and V from shared memory themselves, once for the whole
 * warpgroup, where mma.sync has every warp load every fragment of them by
 * ldmatrix (four times the shared-memory reads: the forward's bound,
 * docs/perf.md). dK/dV and dQ from the stored dS: the same for their
 * products (below). The four
 * warps issue every product together, so a warp whose rows (or keys) see
 * none of a tile computes it too, masked to nothing (forward: its rows
 * have seen no key yet, or are past T, and the online softmax leaves them
 * as they are; dK/dV: P and dS are 0).
 *
 * Run on an H100 (docs/perf.md, run 5): right, the descriptors as the
 * emulation transcribes them from the PTX ISA, and slower than the
 * mma.sync kernels, waiting on their copies; since then the forward and dQ
 * copy a whole tile ahead (two buffers), not yet run on a GPU. */
#ifndef SPOTUNE_CUDA_FLASH_WGMMA_CUH
#define SPOTUNE_CUDA_FLASH_WGMMA_CUH

#include <limits.h>
#include <stdint.h>

#include "cuda_flash_backward.cuh" /* and cuda_flash_kernels.cuh */
#include "cuda_wgmma.cuh"

/* acc += X Y: X [64 x 16 KS] as this warp's A fragments a[kk] (P, dS:
 * C fragments rounded to bf16), Y the 16 KS staged rows at addr, core
 * matrices read as MN-major B (the rows are K: V of O += P V; dO and Q of
 * dV and dK; K of dQ). Issued, not committed: the caller fences before
 * and commits after. */
template <int HD, int KS>
static __device__ __forceinline__ void wg_frags_times(float acc[HD / 8][4], const uint32_t a[KS][4],
                                                      uint32_t addr)
{
    const uint32_t lbo = HD / 8 * 128, sbo = 128; /* the next 8 rows; the next 8 hd columns */
    FA_UNROLL
    for (int kk = 0; kk < KS; kk++) {
        uint64_t desc = wg_desc(addr + (uint32_t)kk * 2 * lbo, lbo, sbo);
        if constexpr (HD == 64)
            wg_m64n64k16<1>(acc, a[kk], desc, 1);
        else
            wg_m64n128k16<1>(acc, a[kk], desc, 1);
    }
}

/* acc += X Y as wg_frags_times, X given as C fragments c (8-column tiles,
 * 2 KS of them: P or dS), rounded to bf16 as A fragments here and fenced
 * (the fragments and acc written before the products read them). */
template <int HD, int KS>
static __device__ __forceinline__ void wg_c_times(float acc[HD / 8][4], const float c[2 * KS][4],
                                                  uint32_t addr)
{
    uint32_t a[KS][4];
    FA_UNROLL
    for (int kk = 0; kk < KS; kk++)
        c_to_a(a[kk], c[2 * kk], c[2 * kk + 1]);
    wg_fence();
    wg_frags_times<HD, KS>(acc, a, addr);
}

/* S = Q K^T for the warpgroup's 64 rows against the 64 keys staged at
 * kaddr (raw scores, this warp's rows as 8 C fragments). */
template <int HD>
static __device__ __forceinline__ void wg_scores(float s[8][4], const uint32_t qa[HD / 16][4],
                                                 uint32_t kaddr)
{
    const uint32_t lbo = 128, sbo = HD / 8 * 128; /* the next 8 hd columns; the next 8 keys */
    wg_fence();
    FA_UNROLL
    for (int ks = 0; ks < HD / 16; ks++)
        wg_m64n64k16<0>(s, qa[ks], wg_desc(kaddr + (uint32_t)ks * 256, lbo, sbo), ks > 0);
    wg_commit();
    wg_wait<0>();
    wg_hold<8>(s);
}

/* o += P V, P the probabilities in s (rounded to bf16 as A fragments), V
 * the 64 keys staged at vaddr. */
template <int HD>
static __device__ __forceinline__ void wg_pv(float o[HD / 8][4], const float s[8][4],
                                             uint32_t vaddr)
{
    wg_c_times<HD, 4>(o, s, vaddr); /* after the rescaled o is written */
    wg_commit();
    wg_wait<0>();
    wg_hold<HD / 8>(o);
}

template <int HD>
__global__ void __launch_bounds__(FA_THREADS, FA_FWD_MIN_BLOCKS)
    flash_forward_wgmma_kernel(flash_args a)
{
    /* two buffers, each K then V of one tile (64 x HD each, as core matrices) */
    DYNAMIC_SHARED(uint16_t, sm);
    const int kv = FA_BC * HD; /* elements of one staged K or V */
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
    int whi = warp_max_i(max(rowA < T ? loA : 0, rowA + 8 < T ? loB : 0));
    int kstart = block_min_lo(seg, q0, q1, &sh_lo) / FA_BC * FA_BC;
    float sl2 = a.scale * FA_LOG2E;
    uint32_t base = smem_addr(sm);

    /* The tiles of keys j0 + 64 are copied while those of j0 are used: a
     * whole tile's products and softmax to hide the copy (with one buffer,
     * as the mma.sync forward, the products here finish before it: the
     * warps waited on global memory, docs/perf.md run 5) */
    stage_core_async<HD>(sm, kb, ldk, kstart, FA_BC, T);
    stage_core_async<HD>(sm + kv, vb, ldk, kstart, FA_BC, T);
    cp_async_commit();
    uint32_t qa[HD / 16][4];
    load_a_rows<HD>(qa, qb, ldq, w0, T);
    float o[HD / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    FA_UNROLL
    for (int nt = 0; nt < HD / 8; nt++)
        o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    for (int j0 = kstart, bf = 0; j0 < q1; j0 += FA_BC, bf ^= 1) {
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads(); /* K(j0), V(j0) are in buffer bf; every warp's products of buffer bf ^ 1 are complete */
        if (j0 + FA_BC < q1) {
            uint16_t *next = sm + (bf ^ 1) * 2 * kv;
            stage_core_async<HD>(next, kb, ldk, j0 + FA_BC, FA_BC, T);
            stage_core_async<HD>(next + kv, vb, ldk, j0 + FA_BC, FA_BC, T);
            cp_async_commit();
        }
        uint32_t kaddr = base + (uint32_t)(bf * 2 * kv) * 2u, vaddr = kaddr + (uint32_t)kv * 2u;
        float s[8][4];
        wg_scores<HD>(s, qa, kaddr);
        if (fa_needs_mask(w0, j0, FA_BC, T, whi))
            mask_tile<8>(s, j0, rowA, loA, loB, T);
        online_tile<HD>(s, m, l, o, sl2);
        wg_pv<HD>(o, s, vaddr);
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

/* ---- backward: dK, dV ------------------------------------------------------------- */

/* The staged Q and dO tiles of the dK/dV kernel (FA_BQ rows as core
 * matrices): lbo_k/sbo_k as K-major B (S^T = K Q^T: N = queries, K = hd),
 * lbo_m/sbo_m as MN-major B (dK += dS^T Q: K = queries, N = hd). */
template <int HD>
static __device__ __forceinline__ void wg_rows_t(float x[4][4], const uint32_t a[HD / 16][4],
                                                 uint32_t addr)
{
    FA_UNROLL
    for (int ks = 0; ks < HD / 16; ks++)
        wg_m64n32k16<0>(x, a[ks], wg_desc(addr + (uint32_t)ks * 256, 128, HD / 8 * 128), ks > 0);
}

/* dK, dV (and the stored dS) as flash_dkdv_kernel (cuda_flash_backward.cuh),
 * with its four products by warpgroup products: S^T = K Q^T and dP^T = V
 * dO^T from the K and V fragments in registers against the staged Q and dO
 * (K-major), dV += P^T dO and dK += dS^T Q from P and dS as A fragments
 * against the same tiles (MN-major). Staging, items, masks, the stored dS
 * and the stores are flash_dkdv_kernel's; the four warps compute every
 * tile together (a warp whose keys no query of the tile sees gets P = 0
 * and dS = 0, masked, where the mma.sync kernel skips it and writes the
 * zeros). Dynamic shared memory: the two buffers of Q and dO tiles. */
template <int HD>
__global__ void __launch_bounds__(FA_THREADS) flash_dkdv_wgmma_kernel(flash_args a)
{
    DYNAMIC_SHARED(uint16_t, sm); /* Q, Q, dO, dO: FA_BQ x HD each, core matrices */
    const int tile = FA_BQ * HD;   /* elements; buffer bf's Q at sm + bf tile, dO 2 tiles on */
    __shared__ __align__(16) float lse_s[2][FA_BQ], D_s[2][FA_BQ];
    __shared__ __align__(16) int seg_s[2][FA_BQ];
    int T = a.T, group = a.nh / a.nkv, split = a.dk_part != NULL;
    int bx = (int)blockIdx.x + (split ? a.pair0 : a.pair0 / group);
    int b = bx / (split ? a.nh : a.nkv), hy = bx % (split ? a.nh : a.nkv);
    int kh = split ? hy / group : hy, h_first = split ? hy : hy * group, nheads = split ? 1 : group;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    int k0 = blockIdx.y * FA_BC, w0 = k0 + warp * 16, keyA = w0 + g;
    size_t ldk = (size_t)a.ldk;
    size_t koff = (size_t)b * T * ldk + (size_t)kh * HD;
    size_t dkoff = (size_t)b * T * a.lddk + (size_t)kh * HD;
    const int *seg = a.seg ? a.seg + (size_t)b * T : NULL;
    int has_seg = seg != NULL;
    float sl2 = a.scale * FA_LOG2E;
    int i_first = k0 / FA_BQ * FA_BQ, ntiles = (T - i_first + FA_BQ - 1) / FA_BQ;
    int nitems = nheads * ntiles;
    uint32_t qaddr = smem_addr(sm), oaddr = qaddr + 2 * tile * 2; /* buffer bf: + bf tile 2 */

    if (nitems > 0)
        dkdv_stage<HD, 1>(a, b, h_first, i_first, ntiles, 0, seg, sm, sm + 2 * tile, lse_s[0],
                          D_s[0], seg_s[0]);
    uint32_t ka[HD / 16][4], va[HD / 16][4];
    load_a_rows<HD>(ka, a.k + koff, ldk, w0, T);
    load_a_rows<HD>(va, a.v + koff, ldk, w0, T);
    float dk[HD / 8][4], dv[HD / 8][4];
    FA_UNROLL
    for (int nt = 0; nt < HD / 8; nt++)
        FA_UNROLL
        for (int e = 0; e < 4; e++)
            dk[nt][e] = dv[nt][e] = 0.0f;
    for (int n = 0; n < nitems; n++) {
        int bf = n & 1;
        if (n + 1 < nitems) {
            /* buffer bf ^ 1: every warp's products of item n - 1 completed before the barrier */
            dkdv_stage<HD, 1>(a, b, h_first, i_first, ntiles, n + 1, seg, sm + (bf ^ 1) * tile,
                              sm + (2 + (bf ^ 1)) * tile, lse_s[bf ^ 1], D_s[bf ^ 1],
                              seg_s[bf ^ 1]);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        fence_proxy_async();
        __syncthreads(); /* item n is in */
        fa_item it = fa_dkdv_item(n, h_first, i_first, ntiles);
        int i0 = it.i0;
        uint16_t *dst = fa_ds_dst(a, b, warp, g, lane, it.h, i0, T); /* this warp's part of dS */
        int lo = fa_lo_staged(seg_s[bf], lane, i0, T, has_seg); /* FA_BQ == 32: a row a lane */
        int thi = warp_max_i(lo == INT_MAX ? 0 : lo);
        /* the element mask wherever some key of the warp is not seen by some
         * query of the tile (as flash_dkdv_kernel, whose warps that see none
         * skip the tile: here they compute it, all masked) */
        int mask = w0 + 15 > i0 || i0 + FA_BQ - 1 >= T || w0 + 15 >= T || thi > w0;
        /* four groups of products, each overlapping the arithmetic after it:
         * P while dP^T runs, dS while dV += P^T dO runs */
        float s[4][4], dp[4][4];
        uint32_t qa_bf = qaddr + (uint32_t)(bf * tile * 2), oa_bf = oaddr + (uint32_t)(bf * tile * 2);
        wg_fence();
        wg_rows_t<HD>(s, ka, qa_bf); /* S^T = K Q^T */
        wg_commit();
        wg_rows_t<HD>(dp, va, oa_bf); /* dP^T = V dO^T */
        wg_commit();
        wg_wait<1>(); /* S^T is complete */
        wg_hold<4>(s);
        fa_probs(s, keyA, i0, lse_s[bf], seg_s[bf], has_seg, T, sl2, mask);
        wg_c_times<HD, 2>(dv, s, oa_bf); /* dV += P^T dO */
        wg_commit();
        wg_wait<1>(); /* dP^T is complete (dV may not be) */
        wg_hold<4>(dp);
        fa_ds_of(dp, s, D_s[bf]);
        if (dst) {
            fa_ds_write(dst, dp);
            fa_ds_zero_past_t(dst, i0, T);
        }
        wg_c_times<HD, 2>(dk, dp, qa_bf); /* dK += dS^T Q */
        wg_commit();
        wg_wait<0>();
        wg_hold<HD / 8>(dv);
        wg_hold<HD / 8>(dk);
        __syncthreads(); /* every warp is done with buffer bf */
    }
    fa_dkdv_finish<HD>(a, split, b, h_first, dkoff, keyA, T, dk, dv);
}

/* ---- backward: dQ from the stored dS ---------------------------------------------- */

/* dQ += dS K as flash_dq_stored_kernel (cuda_flash_backward.cuh), by
 * warpgroup products: each warp's 16 rows of the staged dS tile as A
 * fragments (ldmatrix.trans, as there), K staged as core matrices and read
 * by the products (MN-major B). Every warp multiplies every tile: where a
 * row sees none of its keys the stored dS is 0. Two buffers, as there: the
 * tiles of keys j0 + 64 are copied while those of j0 are multiplied.
 * Dynamic shared memory (fa_dq_wgmma_smem): K, K (core matrices), then
 * dS^T, dS^T. */
template <int HD>
__global__ void __launch_bounds__(FA_THREADS) flash_dq_stored_wgmma_kernel(flash_args a)
{
    DYNAMIC_SHARED(uint16_t, sm);
    const int ktile = FA_BC * HD, stile = FA_BC * (FA_BR + FA_PAD);
    uint16_t *Ss = sm + 2 * ktile; /* buffer bf: K at sm + bf ktile, dS^T at Ss + bf stile */
    __shared__ int sh_lo;
    int bx = (int)blockIdx.x + a.pair0;
    int b = bx / a.nh, h = bx % a.nh, kh = h / (a.nh / a.nkv), T = a.T;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    int qb = fa_row_block(), q0 = qb * FA_BR, q1 = min(q0 + FA_BR, T), w0 = q0 + warp * 16;
    int rowA = w0 + g;
    size_t ldk = (size_t)a.ldk, lddq = (size_t)a.lddq;
    size_t dqoff = (size_t)b * T * lddq + (size_t)h * HD, koff = (size_t)b * T * ldk + (size_t)kh * HD;
    const int *seg = a.seg ? a.seg + (size_t)b * T : NULL;
    int kstart = block_min_lo(seg, q0, q1, &sh_lo) / FA_BC * FA_BC;
    const uint16_t *dsp = a.ds + (size_t)blockIdx.x * fa_ds_pair(T);
    const uint16_t *sr = Ss + ((lane & 7) + (lane >> 4) * 8) * (FA_BR + FA_PAD) + warp * 16 +
                         ((lane >> 3) & 1) * 8;
    uint32_t kaddr = smem_addr(sm);
    float dq[HD / 8][4];
    FA_UNROLL
    for (int nt = 0; nt < HD / 8; nt++)
        dq[nt][0] = dq[nt][1] = dq[nt][2] = dq[nt][3] = 0.0f;
    if (kstart < q1) {
        stage_core_async<HD>(sm, a.k + koff, ldk, kstart, FA_BC, T);
        stage_rows_async<FA_BR>(Ss, dsp + fa_ds_tile(kstart / FA_BC, qb), FA_BR, 0, FA_BC, FA_BC);
        cp_async_commit();
    }
    for (int j0 = kstart, bf = 0; j0 < q1; j0 += FA_BC, bf ^= 1) {
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads(); /* K(j0), dS(j0) are in buffer bf; every warp is done with buffer bf ^ 1 */
        if (j0 + FA_BC < q1) {
            int nb = bf ^ 1, jn = j0 + FA_BC;
            stage_core_async<HD>(sm + nb * ktile, a.k + koff, ldk, jn, FA_BC, T);
            stage_rows_async<FA_BR>(Ss + nb * stile, dsp + fa_ds_tile(jn / FA_BC, qb), FA_BR, 0,
                                    FA_BC, FA_BC);
            cp_async_commit();
        }
        uint32_t sa[FA_BC / 16][4]; /* dS rows w0.. x keys j0 + 16 kk.. */
        FA_UNROLL
        for (int kk = 0; kk < FA_BC / 16; kk++)
            ldsm_x4(sa[kk], sr + bf * stile + kk * 16 * (FA_BR + FA_PAD), 1);
        wg_fence();
        wg_frags_times<HD, FA_BC / 16>(dq, sa, kaddr + (uint32_t)(bf * ktile) * 2u); /* dQ += dS K */
        wg_commit();
        wg_wait<0>();
        wg_hold<HD / 8>(dq);
    }
    const float sc[2] = {a.scale, a.scale}; /* dQ = scale (dS / scale) K */
    store_rows<HD>(a.dq + dqoff, lddq, rowA, T, dq, sc);
}

/* Its dynamic shared memory: two buffers of the K (core matrices) and dS^T
 * tiles (50 KiB at head dim 128: the host raises the kernel's limit). */
static inline size_t fa_dq_wgmma_smem(int hd)
{
    return 2u * FA_BC * ((size_t)hd + (FA_BR + FA_PAD)) * sizeof(uint16_t);
}

/* The dK/dV kernel's dynamic shared memory: two buffers of Q and dO tiles. */
static inline size_t fa_dkdv_wgmma_smem(int hd)
{
    return 4u * FA_BQ * (size_t)hd * sizeof(uint16_t);
}

/* ---- the probe of the descriptors (cuda_wgmma_probe) -------------------------------- */

/* Small integers, exact in bf16 and in any order of summation. */
static __host__ __device__ __forceinline__ float probe_a(int r, int k)
{
    return (float)((r * 5 + k * 2) % 7 - 3);
}

static __host__ __device__ __forceinline__ float probe_b(int k, int n)
{
    return (float)((k * 7 + n * 3) % 11 - 5);
}

#define WG_PROBE_SMEM 16384 /* room for a wrong stride's reads; the rest 1024.0 */
#define WG_PROBE_VARIANTS 4

/* One warpgroup computes D [64 x 64] = A [64 x 16] B [16 x 64] four ways:
 * B staged K-major (as K is) with LBO and SBO as wg_scores takes them
 * (variant 0) and swapped (1), and MN-major (as V is) as wg_pv takes
 * them (2) and swapped (3); out[v][row][col]. Whichever variants equal A B
 * say how this GPU reads a descriptor, should the forward's products be
 * wrong on it. */
__global__ void __launch_bounds__(FA_THREADS) wgmma_probe_kernel(float *out)
{
    DYNAMIC_SHARED(uint16_t, sm);
    uint16_t *bk = sm, *bm = sm + 1024; /* each 16 x 64: 2 KiB */
    for (int i = threadIdx.x; i < WG_PROBE_SMEM / 2; i += blockDim.x)
        sm[i] = f32_to_bf16(1024.0f);
    __syncthreads();
    for (int i = threadIdx.x; i < 1024; i += blockDim.x) {
        int n = i / 16, k = i % 16; /* K-major: 8 n x 8 k core matrices, k chunks 128 B apart */
        bk[((n / 8) * 2 + k / 8) * 64 + (n % 8) * 8 + k % 8] = f32_to_bf16(probe_b(k, n));
        int k2 = i / 64, n2 = i % 64; /* MN-major: rows of k, n chunks 128 B apart */
        bm[((k2 / 8) * 8 + n2 / 8) * 64 + (k2 % 8) * 8 + n2 % 8] = f32_to_bf16(probe_b(k2, n2));
    }
    fence_proxy_async();
    __syncthreads();
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, r = (threadIdx.x >> 5) * 16 + g;
    uint32_t a[4];
    a[0] = pack2(probe_a(r, 2 * t), probe_a(r, 2 * t + 1));
    a[1] = pack2(probe_a(r + 8, 2 * t), probe_a(r + 8, 2 * t + 1));
    a[2] = pack2(probe_a(r, 2 * t + 8), probe_a(r, 2 * t + 9));
    a[3] = pack2(probe_a(r + 8, 2 * t + 8), probe_a(r + 8, 2 * t + 9));
    uint32_t ka = smem_addr(bk), ma = smem_addr(bm);
    for (int v = 0; v < WG_PROBE_VARIANTS; v++) {
        float d[8][4];
        wg_fence();
        if (v == 0)
            wg_m64n64k16<0>(d, a, wg_desc(ka, 128, 256), 0);
        else if (v == 1)
            wg_m64n64k16<0>(d, a, wg_desc(ka, 256, 128), 0);
        else if (v == 2)
            wg_m64n64k16<1>(d, a, wg_desc(ma, 1024, 128), 0);
        else
            wg_m64n64k16<1>(d, a, wg_desc(ma, 128, 1024), 0);
        wg_commit();
        wg_wait<0>();
        wg_hold<8>(d);
        for (int nt = 0; nt < 8; nt++)
            for (int e = 0; e < 4; e++)
                out[(size_t)v * 4096 + (size_t)(r + 8 * (e >> 1)) * 64 + nt * 8 + 2 * t + (e & 1)] =
                    d[nt][e];
    }
}

/* The forward's dynamic shared memory: two buffers of the K and V tiles. */
static inline size_t fa_wgmma_smem(int hd)
{
    return 4u * FA_BC * (size_t)hd * sizeof(uint16_t);
}

#endif
