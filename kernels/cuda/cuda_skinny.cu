/* kernels/cuda/cuda_skinny.cu — the products with a narrow output and a
 * long reduction, C[M,N] = alpha A[M,K] op(B)[K,N] + beta C with N <= 64:
 * LoRA's down products xr = x A^T (B stored [N,K]) and d(xr) = dy B (B
 * stored [K,N]), where N is the rank (times the projections of a fused
 * group) and K the hidden or intermediate width. cuBLASLt runs them as a
 * split-K product into its workspace and a second kernel that sums the
 * splits (run 4's profile of a 7B step: 8.5 + 3.6 us for x A^T at hidden
 * 4096, whose 16.8 MB of x take 3.5 us to read at an H200's bandwidth).
 * Here one kernel reads A where it lies, once, straight into tensor-core
 * fragments, and the block that finishes a row tile last sums its splits.
 *
 * The fragments without shared memory: a lane (g = lane/4, t = lane%4)
 * loads 16 bytes, k = c + 8t .. c + 8t + 7, of rows g and g + 8 of its
 * warp's 16 rows for each 32-wide chunk c of the reduction, and the same 8
 * k of B's column g. The two m16n8k16 products of the chunk take them as
 * their k in the order 2t, 2t+1, 2t+8, 2t+9 (first product) and the same
 * for the second: each logical k of a product is one physical k, the same
 * for A and for B, so the sum over the chunk is the product's (a
 * permutation of the reduction index).
 *
 * Deterministic: each split's partial fragments go to the matmul workspace
 * (the cuBLASLt workspace, unused by any product running at the same time:
 * one stream), and the last block of a row tile to arrive (an atomic count
 * per tile, reset by that block) sums them in split order, whichever block
 * that is. The splits are chosen from the shape and the number of
 * multiprocessors, so the bits are those of the same GPU model's.
 *
 * SPOTUNE_CUDA_SKINNY: unset or 1, this path takes the products it can;
 * 0, cuBLASLt takes every product; splits=N, this path with N splits
 * (tests and the workbench, kernels/cuda/dev/mm_bench.c). */
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

/* Grid: x the row tiles of SK_ROWS, y the splits of the reduction (kper
 * each, a multiple of SK_CHUNK), z the batch. NT = N / 8. */
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
    if (a.splits > 1) {
        /* this split's fragments, lane-major so the stores coalesce */
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
                size_t i = (size_t)row * a.ldc + (size_t)(nt * 8 + 2 * t + e);
                float v = a.alpha * acc[nt][2 * h + e];
                if (a.beta != 0.0f)
                    v += a.beta * ld_f(C, a.cdt, i);
                st_f(C, a.cdt, i, v);
            }
        }
    }
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

extern "C" int cuda_skinny_enabled(void)
{
    return skinny_mode() != 0;
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
 * a multiprocessor, each split at least SK_MIN_KPER long, and the partials
 * within the workspace and the counters; *kper their length. */
static int skinny_splits(const cuda_impl *im, int mode, int tiles, int K, int N, int *kper)
{
    int s;
    if (mode > 0) {
        s = mode;
    } else {
        int target = 2 * (im->sms > 0 ? im->sms : 1);
        s = (target + tiles - 1) / tiles;
        int by_k = K / SK_MIN_KPER;
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

extern "C" int cuda_skinny_matmul(backend_t *be, tensor_t C, tensor_t A, tensor_t B, int M, int N,
                                  int K, int transA, int transB, float alpha, float beta, int lda,
                                  int ldb, int ldc, int batch, unsigned long sa, unsigned long sb,
                                  unsigned long sc)
{
    int mode = skinny_mode();
    cuda_impl *im = CUDA_IMPL(be);
    if (!mode || transA || N > 64 || N % 8 || K < 256 || K % 8 || M < 1 || batch < 1 ||
        A.dt != DT_BF16 || B.dt != DT_BF16 || (C.dt != DT_BF16 && C.dt != DT_F32) ||
        !im->skinny_count)
        return 0;
    /* 16-byte loads of A's rows (and of B's, stored [N,K]) */
    if (((uintptr_t)A.p & 15u) || lda % 8 || (batch > 1 && sa % 8))
        return 0;
    if (transB && (((uintptr_t)B.p & 15u) || ldb % 8 || (batch > 1 && sb % 8)))
        return 0;
    int tiles_b = (M + SK_ROWS - 1) / SK_ROWS, kper;
    if (batch > 65535)
        return 0;
    int splits = skinny_splits(im, mode, tiles_b * batch, K, N, &kper);
    skinny_args a;
    memset(&a, 0, sizeof a);
    a.A = (const uint16_t *)A.p;
    a.B = (const uint16_t *)B.p;
    a.C = C.p;
    a.ws = (float *)im->mm_ws;
    a.count = im->skinny_count;
    a.M = M, a.K = K, a.lda = lda, a.ldb = ldb, a.ldc = ldc, a.cdt = C.dt;
    a.sa = batch > 1 ? (long long)sa : 0;
    a.sb = batch > 1 ? (long long)sb : 0;
    a.sc = batch > 1 ? (long long)sc : 0;
    a.alpha = alpha, a.beta = beta;
    a.splits = splits, a.kper = kper;
    skinny_fn fn = transB ? skinny_pick<1>(N / 8) : skinny_pick<0>(N / 8);
    LAUNCH(fn, dim3((unsigned)tiles_b, (unsigned)splits, (unsigned)batch), dim3(SK_THREADS), 0,
           im->stream)(a);
    LAUNCHED(be, "skinny_kernel");
    return 1;
}
