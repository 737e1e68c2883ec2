/* kernels/cuda/cuda_skinny.cu — LoRA's products with a narrow side (the
 * rank r, or 3r and 2r for a fused group's branches batched) over a long
 * reduction, C = alpha op(A) op(B) + beta C:
 *  - A as it lies, N <= 64 (skinny_kernel): the down products xr = x A^T
 *    (B stored [N,K]) and d(xr) = dy B (B stored [K,N]), reducing over the
 *    hidden or intermediate width;
 *  - A transposed, B as it lies, N or M <= 64 (skinny_t_kernel): the
 *    weight gradients dB = s dy^T xr and dA = d(xr)^T x (made as C^T =
 *    x^T d(xr), written transposed), reducing over the tokens.
 * cuBLASLt runs such shapes as a split-K product into its workspace and a
 * second kernel that sums the splits (run 4's profile of a 7B step: 8.5 +
 * 3.6 us for x A^T at hidden 4096, whose 16.8 MB of x take 3.5 us to read
 * at an H200's bandwidth). Here each is one kernel that reads its wide
 * operand once, and the block that finishes a row tile last sums its
 * splits.
 *
 * skinny_kernel's fragments without shared memory: a lane (g = lane/4, t =
 * lane%4) loads 16 bytes, k = c + 8t .. c + 8t + 7, of rows g and g + 8 of
 * its warp's 16 rows for each 32-wide chunk c of the reduction, and the
 * same 8 k of B's column g. The two m16n8k16 products of the chunk take
 * them as their k in the order 2t, 2t+1, 2t+8, 2t+9 (first product) and
 * the same for the second: each logical k of a product is one physical k,
 * the same for A and for B, so the sum over the chunk is the product's (a
 * permutation of the reduction index). skinny_t_kernel's pieces lie along
 * the wide side instead, so its chunks are staged in shared memory and
 * read by ldmatrix.trans.
 *
 * Deterministic: each split's partial fragments go to the matmul workspace
 * (the cuBLASLt workspace, unused by any product running at the same time:
 * one stream), and the last block of a row tile to arrive (an atomic count
 * per tile, reset by that block) sums them in split order, whichever block
 * that is. The splits are chosen from the shape and the number of
 * multiprocessors, so the bits are those of the same GPU model's.
 *
 * SPOTUNE_CUDA_SKINNY: unset or 1, these kernels take the products they
 * can; 0, cuBLASLt takes every product; splits=N, these kernels with N
 * splits (tests and the workbench, kernels/cuda/dev/mm_bench.c). */
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "cuda_mma.cuh"

#define SK_ROWS 64    /* rows a block: 4 warps of 16 */
#define SK_THREADS 128
#define SK_CHUNK 32   /* k a lane step: two m16n8k16 products */
#define SK_UNROLL 8   /* chunks whose A loads are in flight at once */
#define SK_MIN_KPER 512

typedef struct skinny_args {
    const uint16_t *A, *B;
    void *C;
    float *ws;
    unsigned *count;
    int M, K, lda, ldb, ldc, cdt;
    long long sa, sb, sc;
    float alpha, beta;
    int splits, kper;
} skinny_args;

static __device__ __forceinline__ uint4 sk_ld16(const uint16_t *p)
{
    return *(const uint4 *)p;
}

/* The 8 k from k of B's column n as bf16 pairs: B stored [N,K] (TB), a
 * 16-byte load; stored [K,N], eight loads down the column. */
template <int TB>
static __device__ __forceinline__ uint4 sk_b(const uint16_t *B, int ldb, int n, int k)
{
    if (TB)
        return sk_ld16(B + (size_t)n * ldb + k);
    const uint16_t *p = B + (size_t)k * ldb + n;
    uint32_t h[8];
    FA_UNROLL
    for (int j = 0; j < 8; j++)
        h[j] = p[(size_t)j * ldb];
    return make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
}

/* SK_UNROLL chunks from c: every A load issued before the first product
 * (MASKED: the k from k1 on read as zeros, for the split's last group). */
template <int NT, int TB, int MASKED>
static __device__ __forceinline__ void sk_group(float (&acc)[NT][4], const uint16_t *pa,
                                                const uint16_t *pb, const uint16_t *B, int ldb,
                                                int c, int k1, int g, int t)
{
    uint4 va[SK_UNROLL], vb[SK_UNROLL];
    FA_UNROLL
    for (int u = 0; u < SK_UNROLL; u++) {
        int k = c + u * SK_CHUNK + 8 * t; /* K % 8 == 0: 8 k in or out together */
        if (!MASKED || k < k1) {
            va[u] = sk_ld16(pa + k);
            vb[u] = sk_ld16(pb + k);
        } else {
            va[u] = vb[u] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    FA_UNROLL
    for (int u = 0; u < SK_UNROLL; u++) {
        int k = c + u * SK_CHUNK + 8 * t;
        uint32_t f0[4] = {va[u].x, vb[u].x, va[u].y, vb[u].y};
        uint32_t f1[4] = {va[u].z, vb[u].z, va[u].w, vb[u].w};
        FA_UNROLL
        for (int nt = 0; nt < NT; nt++) {
            uint4 w = !MASKED || k < k1 ? sk_b<TB>(B, ldb, nt * 8 + g, k)
                                        : make_uint4(0u, 0u, 0u, 0u);
            mma16816(acc[nt], f0, w.x, w.y);
            mma16816(acc[nt], f1, w.z, w.w);
        }
    }
}

/* The end of a block: with splits, this split's fragments to the
 * workspace and, in the block that counts last for its tile, the sum of
 * every split's in split order; then C = alpha acc + beta C for the rows
 * r0 + g, r0 + g + 8 of this warp below M (TC: C transposed, element
 * (row, col) at col * ldc + row). 0 when this block is not the last. */
template <int NT, int TC>
static __device__ __forceinline__ void sk_finish(float (&acc)[NT][4], const skinny_args &a,
                                                 int r0, int g, int t)
{
    int tid = threadIdx.x, split = blockIdx.y, bz = blockIdx.z;
    if (a.splits > 1) {
        /* lane-major, so the stores and the loads coalesce */
        size_t tile = (size_t)bz * gridDim.x + blockIdx.x, part = (size_t)SK_THREADS * NT * 4;
        float *w = a.ws + (tile * (size_t)a.splits + (size_t)split) * part;
        FA_UNROLL
        for (int i = 0; i < NT * 4; i++)
            w[(size_t)i * SK_THREADS + tid] = acc[i / 4][i % 4];
        __threadfence();
        __shared__ int last;
        __syncthreads();
        if (tid == 0)
            last = atomicAdd(a.count + tile, 1u) == (unsigned)(a.splits - 1);
        __syncthreads();
        if (!last)
            return;
        __threadfence();
        const float *w0 = a.ws + tile * (size_t)a.splits * part;
        FA_UNROLL
        for (int i = 0; i < NT * 4; i++) {
            float s = 0.0f;
            for (int sp = 0; sp < a.splits; sp++)
                s += __ldcg(w0 + (size_t)sp * part + (size_t)i * SK_THREADS + tid);
            acc[i / 4][i % 4] = s;
        }
        if (tid == 0)
            a.count[tile] = 0u; /* for the next launch */
    }
    char *C = (char *)a.C + (size_t)bz * (size_t)a.sc * (a.cdt == DT_BF16 ? 2 : 4);
    FA_UNROLL
    for (int nt = 0; nt < NT; nt++) {
        FA_UNROLL
        for (int h = 0; h < 2; h++) {
            int row = r0 + g + 8 * h;
            if (row >= a.M)
                continue;
            FA_UNROLL
            for (int e = 0; e < 2; e++) {
                size_t col = (size_t)(nt * 8 + 2 * t + e);
                size_t i = TC ? col * a.ldc + (size_t)row : (size_t)row * a.ldc + col;
                float v = a.alpha * acc[nt][2 * h + e];
                if (a.beta != 0.0f)
                    v += a.beta * ld_f(C, a.cdt, i);
                st_f(C, a.cdt, i, v);
            }
        }
    }
}

/* C = alpha A B (+ beta C), A [M,K] as it lies. Grid: x the row tiles of
 * SK_ROWS, y the splits of the reduction (kper each, a multiple of
 * SK_CHUNK), z the batch. NT = N / 8. */
template <int NT, int TB>
__global__ void __launch_bounds__(SK_THREADS) skinny_kernel(skinny_args a)
{
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    int split = blockIdx.y, bz = blockIdx.z;
    const uint16_t *A = a.A + (size_t)bz * (size_t)a.sa, *B = a.B + (size_t)bz * (size_t)a.sb;
    int r0 = blockIdx.x * SK_ROWS + warp * 16;
    /* rows past M read row M - 1 and are not written */
    const uint16_t *pa = A + (size_t)min(r0 + g, a.M - 1) * a.lda;
    const uint16_t *pb = A + (size_t)min(r0 + g + 8, a.M - 1) * a.lda;
    int k0 = split * a.kper, k1 = min(k0 + a.kper, a.K), c = k0;
    float acc[NT][4];
    FA_UNROLL
    for (int nt = 0; nt < NT; nt++)
        acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    for (; c + SK_CHUNK * SK_UNROLL <= k1; c += SK_CHUNK * SK_UNROLL)
        sk_group<NT, TB, 0>(acc, pa, pb, B, a.ldb, c, k1, g, t);
    if (c < k1)
        sk_group<NT, TB, 1>(acc, pa, pb, B, a.ldb, c, k1, g, t);
    sk_finish<NT, 0>(acc, a, r0, g, t);
}

/* ---- the reduction over rows: C = alpha A^T B ----------------------------------------- */

/* LoRA's weight gradients: dB = s dy^T xr (A = dy [K,M], B = xr [K,N]) and,
 * transposed, dA = d(xr)^T x (C^T = x^T d(xr): A = x, B = d(xr), TC), a
 * reduction over the token rows whose 16-byte pieces lie along the wide
 * side. Both operands are staged a chunk of SK_CHUNK rows at a time in
 * shared memory by cp.async, SKT_STAGES chunks in flight, and read as
 * fragments by ldmatrix.trans (the A operand's 8 x 8 blocks transposed are
 * A^T's fragments, B's are right operands as they lie). A block: SK_ROWS
 * of M (a warp 16) by all N, one split of K. */
#define SKT_STAGES 4
#define SKT_LDA (SK_ROWS + 8)   /* staged A row: SK_ROWS columns, padded */
#define SKT_LDB (64 + 8)        /* staged B row: N <= 64 columns, padded */
#define SKT_MIN_KPER 256

/* Chunk c (rows c .. c + SK_CHUNK - 1 below k1; zeros past them, and past M
 * for A's columns) into stage buffers as, bs; one commit. */
static __device__ __forceinline__ void skt_stage(uint16_t *as, uint16_t *bs, const uint16_t *A,
                                                 const uint16_t *B, const skinny_args &a, int m0,
                                                 int n, int c, int k1)
{
    const int apieces = SK_CHUNK * (SK_ROWS / 8);
    int bpr = n / 8, bpieces = SK_CHUNK * bpr;
    for (int i = threadIdx.x; i < apieces + bpieces; i += SK_THREADS) {
        if (i < apieces) {
            int r = i / (SK_ROWS / 8), col = (i % (SK_ROWS / 8)) * 8, k = c + r;
            int ok = k < k1 && m0 + col < a.M;
            cp_async16(as + r * SKT_LDA + col, A + (ok ? (size_t)k * a.lda + m0 + col : 0), ok);
        } else {
            int j = i - apieces, r = j / bpr, col = (j % bpr) * 8, k = c + r, ok = k < k1;
            cp_async16(bs + r * SKT_LDB + col, B + (ok ? (size_t)k * a.ldb + col : 0), ok);
        }
    }
    cp_async_commit();
}

/* NT = N / 8; TC: C transposed. */
template <int NT, int TC>
__global__ void __launch_bounds__(SK_THREADS) skinny_t_kernel(skinny_args a)
{
    __shared__ __align__(16) uint16_t as_[SKT_STAGES][SK_CHUNK * SKT_LDA];
    __shared__ __align__(16) uint16_t bs_[SKT_STAGES][SK_CHUNK * SKT_LDB];
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    int split = blockIdx.y, bz = blockIdx.z, m0 = blockIdx.x * SK_ROWS;
    const uint16_t *A = a.A + (size_t)bz * (size_t)a.sa, *B = a.B + (size_t)bz * (size_t)a.sb;
    int k0 = split * a.kper, k1 = min(k0 + a.kper, a.K);
    int chunks = (k1 - k0 + SK_CHUNK - 1) / SK_CHUNK;
    float acc[NT][4];
    FA_UNROLL
    for (int nt = 0; nt < NT; nt++)
        acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    FA_UNROLL
    for (int s = 0; s < SKT_STAGES - 1; s++)
        skt_stage(as_[s], bs_[s], A, B, a, m0, NT * 8, k0 + s * SK_CHUNK, s < chunks ? k1 : k0);
    /* this lane's ldmatrix rows: A's matrix l/8 is rows +8 (l/16 odd:
     * the k-step's second half), columns +8 (l/8 odd: the warp's rows
     * g + 8); B's as staged_b_row */
    int arow = (lane & 7) + ((lane >> 4) & 1) * 8, acol = warp * 16 + ((lane >> 3) & 1) * 8;
    int brow = (lane & 7) + ((lane >> 3) & 1) * 8, bcol = (lane >> 4) * 8;
    for (int i = 0; i < chunks; i++) {
        cp_async_wait<SKT_STAGES - 2>();
        __syncthreads(); /* chunk i landed for every thread; chunk i - 1's buffers are free */
        int nx = i + SKT_STAGES - 1, sx = nx % SKT_STAGES;
        skt_stage(as_[sx], bs_[sx], A, B, a, m0, NT * 8, k0 + nx * SK_CHUNK, nx < chunks ? k1 : k0);
        const uint16_t *as = as_[i % SKT_STAGES], *bs = bs_[i % SKT_STAGES];
        FA_UNROLL
        for (int kk = 0; kk < SK_CHUNK / 16; kk++) {
            uint32_t f[4];
            ldsm_x4(f, as + (kk * 16 + arow) * SKT_LDA + acol, 1);
            FA_UNROLL
            for (int n2 = 0; n2 < (NT + 1) / 2; n2++) {
                uint32_t b[4]; /* n-tiles 2 n2 (b0, b1) and 2 n2 + 1 (b2, b3) */
                ldsm_x4(b, bs + (kk * 16 + brow) * SKT_LDB + n2 * 16 + bcol, 1);
                mma16816(acc[2 * n2], f, b[0], b[1]);
                if (2 * n2 + 1 < NT) /* (an odd NT's last tile has no pair) */
                    mma16816(acc[min(2 * n2 + 1, NT - 1)], f, b[2], b[3]);
            }
        }
    }
    cp_async_wait<0>(); /* the empty groups of the last chunks */
    sk_finish<NT, TC>(acc, a, m0 + warp * 16, g, t);
}

/* ---- host -------------------------------------------------------------------------- */

/* 0: off; -1: on, splits chosen; N > 0: on with N splits */
static int skinny_mode(void)
{
    const char *e = getenv("SPOTUNE_CUDA_SKINNY");
    if (!e || !*e || strcmp(e, "1") == 0)
        return -1;
    if (strncmp(e, "splits=", 7) == 0) {
        int n = atoi(e + 7);
        return n >= 1 && n <= 64 ? n : -1;
    }
    return 0;
}

typedef void (*skinny_fn)(skinny_args);

template <int TB> static skinny_fn skinny_pick(int nt)
{
    switch (nt) {
    case 1: return skinny_kernel<1, TB>;
    case 2: return skinny_kernel<2, TB>;
    case 3: return skinny_kernel<3, TB>;
    case 4: return skinny_kernel<4, TB>;
    case 5: return skinny_kernel<5, TB>;
    case 6: return skinny_kernel<6, TB>;
    case 7: return skinny_kernel<7, TB>;
    default: return skinny_kernel<8, TB>;
    }
}

/* The splits of a reduction of K over `tiles` row tiles: about two blocks
 * a multiprocessor, each split at least min_kper long, and the partials
 * within the workspace and the counters; *kper their length. */
static int skinny_splits(const cuda_impl *im, int mode, int tiles, int K, int N, int min_kper,
                         int *kper)
{
    int s;
    if (mode > 0) {
        s = mode;
    } else {
        int target = 2 * (im->sms > 0 ? im->sms : 1);
        s = (target + tiles - 1) / tiles;
        int by_k = K / min_kper;
        if (s > by_k)
            s = by_k;
    }
    if (s < 1 || tiles > CUDA_SKINNY_COUNTERS)
        s = 1;
    while (s > 1 && (size_t)tiles * (size_t)s * (size_t)SK_ROWS * (size_t)N * sizeof(float) >
                        im->mm_ws_bytes)
        s--;
    int per = (K + s - 1) / s;
    per = (per + SK_CHUNK - 1) / SK_CHUNK * SK_CHUNK;
    *kper = per;
    return (K + per - 1) / per;
}

/* What both kernels take beyond their operands (a->A, a->B, a->lda,
 * a->ldb, a->sa, a->sb and a->M, the rows the grid's tiles cover): C,
 * the workspace, the splits of K for `narrow` output columns; then fn's
 * launch (name: "launch of KERNEL", as LAUNCHED reports it). */
static void skinny_launch(backend_t *be, cuda_impl *im, skinny_fn fn, const char *name,
                          skinny_args *a, int mode, tensor_t C, int K, int ldc, float alpha,
                          float beta, int batch, unsigned long sc, int narrow, int min_kper)
{
    int tiles_b = (a->M + SK_ROWS - 1) / SK_ROWS;
    a->splits = skinny_splits(im, mode, tiles_b * batch, K, narrow, min_kper, &a->kper);
    a->C = C.p;
    a->ws = (float *)im->mm_ws;
    a->count = im->skinny_count;
    a->K = K, a->ldc = ldc, a->cdt = C.dt;
    a->sc = batch > 1 ? (long long)sc : 0;
    a->alpha = alpha, a->beta = beta;
    LAUNCH(fn, dim3((unsigned)tiles_b, (unsigned)a->splits, (unsigned)batch), dim3(SK_THREADS), 0,
           im->stream)(*a);
    cuda_ok(be, cudaGetLastError(), name, __FILE__, __LINE__); /* LAUNCHED's, named at run time */
}

template <int TC> static skinny_fn skinny_t_pick(int nt)
{
    switch (nt) {
    case 1: return skinny_t_kernel<1, TC>;
    case 2: return skinny_t_kernel<2, TC>;
    case 3: return skinny_t_kernel<3, TC>;
    case 4: return skinny_t_kernel<4, TC>;
    case 5: return skinny_t_kernel<5, TC>;
    case 6: return skinny_t_kernel<6, TC>;
    case 7: return skinny_t_kernel<7, TC>;
    default: return skinny_t_kernel<8, TC>;
    }
}

/* C = alpha A^T B + beta C, A stored [K,M], B [K,N]: by skinny_t_kernel
 * with N narrow (dB = dy^T xr), or with M narrow as C^T = B^T A written
 * transposed (dA = d(xr)^T x); 0 when neither side is (or the staged
 * 16-byte pieces would not be aligned). */
static int skinny_t(backend_t *be, cuda_impl *im, int mode, tensor_t C, tensor_t A, tensor_t B,
                    int M, int N, int K, float alpha, float beta, int lda, int ldb, int ldc,
                    int batch, unsigned long sa, unsigned long sb, unsigned long sc)
{
    int tc;
    if (N <= 64 && N % 8 == 0 && M % 8 == 0)
        tc = 0;
    else if (M <= 64 && M % 8 == 0 && N % 8 == 0)
        tc = 1;
    else
        return 0;
    if (!cuda_rows_aligned16(A.p, lda, batch, sa) || !cuda_rows_aligned16(B.p, ldb, batch, sb))
        return 0;
    skinny_args a;
    memset(&a, 0, sizeof a);
    /* the wide operand is staged as A (its columns the output's rows) */
    a.A = (const uint16_t *)(tc ? B.p : A.p);
    a.B = (const uint16_t *)(tc ? A.p : B.p);
    a.lda = tc ? ldb : lda, a.ldb = tc ? lda : ldb;
    a.sa = batch > 1 ? (long long)(tc ? sb : sa) : 0;
    a.sb = batch > 1 ? (long long)(tc ? sa : sb) : 0;
    a.M = tc ? N : M;
    int narrow = tc ? M : N;
    skinny_launch(be, im, tc ? skinny_t_pick<1>(narrow / 8) : skinny_t_pick<0>(narrow / 8),
                  "launch of skinny_t_kernel", &a, mode, C, K, ldc, alpha, beta, batch, sc, narrow,
                  SKT_MIN_KPER);
    return 1;
}

extern "C" int cuda_skinny_matmul(backend_t *be, tensor_t C, tensor_t A, tensor_t B, int M, int N,
                                  int K, int transA, int transB, float alpha, float beta, int lda,
                                  int ldb, int ldc, int batch, unsigned long sa, unsigned long sb,
                                  unsigned long sc)
{
    int mode = skinny_mode();
    cuda_impl *im = CUDA_IMPL(be);
    if (!mode || K < 256 || M < 1 || N < 1 || batch < 1 || batch > 65535 || A.dt != DT_BF16 ||
        B.dt != DT_BF16 || (C.dt != DT_BF16 && C.dt != DT_F32) || !im->skinny_count)
        return 0;
    if (transA && !transB)
        return skinny_t(be, im, mode, C, A, B, M, N, K, alpha, beta, lda, ldb, ldc, batch, sa, sb,
                        sc);
    if (transA || N > 64 || N % 8 || K % 8)
        return 0;
    /* 16-byte loads of A's rows (and of B's, stored [N,K]) */
    if (!cuda_rows_aligned16(A.p, lda, batch, sa) ||
        (transB && !cuda_rows_aligned16(B.p, ldb, batch, sb)))
        return 0;
    skinny_args a;
    memset(&a, 0, sizeof a);
    a.A = (const uint16_t *)A.p;
    a.B = (const uint16_t *)B.p;
    a.M = M, a.lda = lda, a.ldb = ldb;
    a.sa = batch > 1 ? (long long)sa : 0;
    a.sb = batch > 1 ? (long long)sb : 0;
    skinny_launch(be, im, transB ? skinny_pick<1>(N / 8) : skinny_pick<0>(N / 8),
                  "launch of skinny_kernel", &a, mode, C, K, ldc, alpha, beta, batch, sc, N,
                  SK_MIN_KPER);
    return 1;
}
