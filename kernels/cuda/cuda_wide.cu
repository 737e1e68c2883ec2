/* kernels/cuda/cuda_wide.cu — LoRA's products whose reduction is the rank
 * (r, or 3r and 2r for a fused group's branches stacked): C = alpha A
 * op(B) + beta C with K <= 64 and a wide C (N >= 128 columns):
 *  - the forward's up products s xr B^T, B stored [N,K], each branch
 *    writing its column block of the group's output (beta 0, a batch of
 *    equal widths in one launch), or adding to a projection's output (o,
 *    down: beta 1);
 *  - the backward's d(xr) A into the input gradient, A stored [K,N]
 *    (beta 0: the base product adds to it afterwards).
 * Such a product reads little (xr [rows, K], B [N, K]) and writes all of
 * C: its time is the time C takes to be written (and read, beta != 0).
 * Run 4's profile of a 7B step had cuBLASLt's kernel for these at about
 * half the card's bandwidth; here a block computes a 64 x 128 tile with
 * one pass of tensor-core products over the staged operands and writes it
 * row by row, each warp instruction 256 contiguous bytes of C.
 *
 * A block: 4 warps, 64 rows (a warp 16) x 128 columns of C, batch item
 * blockIdx.z. A's 64 x K and B's 128 columns x K are staged by cp.async
 * (zeros past K up to the k-steps' 16, past M and past N) and read by
 * ldmatrix (B stored [K,N]: .trans); then each warp's fp32 16 x 128 goes
 * through shared memory so that a lane writes 4 consecutive values of a
 * row: alpha acc + beta C in fp32, rounded to bf16 once, as cuBLASLt.
 * No atomics, no splits: the same bits every run.
 *
 * SPOTUNE_CUDA_WIDE: unset or 1, this kernel takes the products it can;
 * 0, cuBLASLt takes every product (tests and the workbench,
 * kernels/cuda/dev/mm_bench.c). */
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "cuda_mma.cuh"

#define WD_ROWS 64
#define WD_COLS 128
#define WD_THREADS 128
#define WD_KMAX 64
#define WD_LDK (WD_KMAX + 8) /* a staged row of A, or of B stored [N,K]: conflict-free ldmatrix */
#define WD_LDN (WD_COLS + 8) /* a staged row of B stored [K,N] */
#define WD_LDO (WD_COLS + 8) /* a warp's fp32 output row: conflict-free 8-byte stores */

/* the staged operands, then (after a barrier) the warps' fp32 outputs */
#define WD_STAGE_BYTES (2 * (WD_ROWS * WD_LDK + WD_COLS * WD_LDK))
#define WD_OUT_BYTES (4 * (WD_THREADS / 32) * 16 * WD_LDO)
#define WD_SMEM_BYTES (WD_STAGE_BYTES > WD_OUT_BYTES ? WD_STAGE_BYTES : WD_OUT_BYTES)
static_assert(WD_COLS * WD_LDK >= WD_KMAX * WD_LDN, "B stored [K,N] fits B's staging");

typedef struct wide_args {
    const uint16_t *A, *B;
    uint16_t *C;
    int M, N, K, lda, ldb, ldc;
    long long sa, sb, sc;
    float alpha, beta;
} wide_args;

/* Stages A's rows m0.. and B's columns n0.. (KS k-steps of 16); one commit. */
template <int KS, int TB>
static __device__ __forceinline__ void wd_stage(uint16_t *as, uint16_t *bs, const uint16_t *A,
                                                const uint16_t *B, const wide_args &a, int m0,
                                                int n0)
{
    const int kp = KS * 2; /* 16-byte pieces of a staged row */
    for (int i = threadIdx.x; i < WD_ROWS * kp; i += WD_THREADS) {
        int r = i / kp, k = (i % kp) * 8, row = m0 + r, ok = row < a.M && k < a.K;
        cp_async16(as + r * WD_LDK + k, A + (ok ? (size_t)row * a.lda + k : 0), ok);
    }
    if (TB) { /* B stored [N,K]: a staged row a column of C */
        for (int i = threadIdx.x; i < WD_COLS * kp; i += WD_THREADS) {
            int n = i / kp, k = (i % kp) * 8, col = n0 + n, ok = col < a.N && k < a.K;
            cp_async16(bs + n * WD_LDK + k, B + (ok ? (size_t)col * a.ldb + k : 0), ok);
        }
    } else { /* stored [K,N]: a staged row a k */
        const int np = WD_COLS / 8;
        for (int i = threadIdx.x; i < KS * 16 * np; i += WD_THREADS) {
            int k = i / np, n = (i % np) * 8, col = n0 + n, ok = k < a.K && col < a.N;
            cp_async16(bs + k * WD_LDN + n, B + (ok ? (size_t)k * a.ldb + col : 0), ok);
        }
    }
    cp_async_commit();
}

/* C = alpha A op(B) + beta C, A [M,K] as it lies, B stored [N,K] (TB) or
 * [K,N], K <= 16 KS. Grid: x the column tiles, y the row tiles, z the
 * batch. */
template <int KS, int TB>
__global__ void __launch_bounds__(WD_THREADS) wide_kernel(wide_args a)
{
    __shared__ __align__(16) unsigned char sm[WD_SMEM_BYTES];
    uint16_t *as = (uint16_t *)sm, *bs = as + WD_ROWS * WD_LDK;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    int n0 = blockIdx.x * WD_COLS, m0 = blockIdx.y * WD_ROWS, bz = blockIdx.z;
    wd_stage<KS, TB>(as, bs, a.A + (size_t)bz * (size_t)a.sa, a.B + (size_t)bz * (size_t)a.sb, a,
                     m0, n0);
    float acc[WD_COLS / 8][4];
    FA_UNROLL
    for (int nt = 0; nt < WD_COLS / 8; nt++)
        acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    cp_async_wait<0>();
    __syncthreads(); /* the operands landed for every thread */
    /* A's fragments: ldmatrix matrix lane/8 is rows +8 (odd), k +8 (>= 2) */
    const uint16_t *ar = as + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * WD_LDK +
                         (lane >> 4) * 8;
    FA_UNROLL
    for (int ks = 0; ks < KS; ks++) {
        uint32_t f[4];
        ldsm_x4(f, ar + ks * 16, 0);
        FA_UNROLL
        for (int n2 = 0; n2 < WD_COLS / 16; n2++) {
            uint32_t b[4]; /* column tiles 2 n2 (b0, b1) and 2 n2 + 1 (b2, b3) */
            if (TB) /* matrix lane/8: k +8 (odd), columns +8 (>= 2) */
                ldsm_x4(b,
                        bs + (n2 * 16 + (lane & 7) + (lane >> 4) * 8) * WD_LDK + ks * 16 +
                            ((lane >> 3) & 1) * 8,
                        0);
            else /* staged_b_row's: rows (k) +8 (odd), columns +8 (>= 2) */
                ldsm_x4(b,
                        bs + (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * WD_LDN + n2 * 16 +
                            (lane >> 4) * 8,
                        1);
            mma16816(acc[2 * n2], f, b[0], b[1]);
            mma16816(acc[2 * n2 + 1], f, b[2], b[3]);
        }
    }
    __syncthreads(); /* every warp is done with the staged operands */
    float *o = (float *)sm + warp * 16 * WD_LDO;
    FA_UNROLL
    for (int nt = 0; nt < WD_COLS / 8; nt++) {
        *(float2 *)(o + g * WD_LDO + nt * 8 + 2 * t) = make_float2(acc[nt][0], acc[nt][1]);
        *(float2 *)(o + (g + 8) * WD_LDO + nt * 8 + 2 * t) = make_float2(acc[nt][2], acc[nt][3]);
    }
    __syncthreads(); /* (each warp reads only its own rows) */
    int col = n0 + 4 * lane; /* N % 8 == 0: 4 columns in or out together */
    if (col >= a.N)
        return;
    uint16_t *C = a.C + (size_t)bz * (size_t)a.sc + col;
    for (int r = 0; r < 16; r++) {
        int row = m0 + warp * 16 + r;
        if (row >= a.M)
            break;
        float4 v = *(const float4 *)(o + r * WD_LDO + 4 * lane);
        uint16_t *p = C + (size_t)row * a.ldc;
        float x0 = a.alpha * v.x, x1 = a.alpha * v.y, x2 = a.alpha * v.z, x3 = a.alpha * v.w;
        if (a.beta != 0.0f) {
            uint2 c = *(const uint2 *)p;
            x0 += a.beta * bf16_to_f32((uint16_t)(c.x & 0xffffu));
            x1 += a.beta * bf16_to_f32((uint16_t)(c.x >> 16));
            x2 += a.beta * bf16_to_f32((uint16_t)(c.y & 0xffffu));
            x3 += a.beta * bf16_to_f32((uint16_t)(c.y >> 16));
        }
        *(uint2 *)p = make_uint2(pack2(x0, x1), pack2(x2, x3));
    }
}

/* ---- host -------------------------------------------------------------------------- */

typedef void (*wide_fn)(wide_args);

template <int TB> static wide_fn wide_pick(int ks)
{
    switch (ks) { /* boilerplate: one instance per k-step count */
    case 1: return wide_kernel<1, TB>;
    case 2: return wide_kernel<2, TB>;
    case 3: return wide_kernel<3, TB>;
    default: return wide_kernel<4, TB>;
    }
}

extern "C" int cuda_wide_matmul(backend_t *be, tensor_t C, tensor_t A, tensor_t B, int M, int N,
                                int K, int transA, int transB, float alpha, float beta, int lda,
                                int ldb, int ldc, int batch, unsigned long sa, unsigned long sb,
                                unsigned long sc)
{
    const char *e = getenv("SPOTUNE_CUDA_WIDE");
    if (e && *e && strcmp(e, "1") != 0)
        return 0;
    if (transA || K < 8 || K > WD_KMAX || K % 8 || N < WD_COLS || N % 8 || M < 1 || batch < 1 ||
        batch > 65535 || (M + WD_ROWS - 1) / WD_ROWS > 65535 || A.dt != DT_BF16 ||
        B.dt != DT_BF16 || C.dt != DT_BF16)
        return 0;
    /* 16-byte staging of A's and B's rows; C's rows written 8 bytes at a time */
    if (!cuda_rows_aligned16(A.p, lda, batch, sa) || !cuda_rows_aligned16(B.p, ldb, batch, sb) ||
        !cuda_rows_aligned16(C.p, ldc, batch, sc))
        return 0;
    wide_args a;
    memset(&a, 0, sizeof a);
    a.A = (const uint16_t *)A.p, a.B = (const uint16_t *)B.p, a.C = (uint16_t *)C.p;
    a.M = M, a.N = N, a.K = K, a.lda = lda, a.ldb = ldb, a.ldc = ldc;
    a.sa = batch > 1 ? (long long)sa : 0;
    a.sb = batch > 1 ? (long long)sb : 0;
    a.sc = batch > 1 ? (long long)sc : 0;
    a.alpha = alpha, a.beta = beta;
    int ks = (K + 15) / 16;
    cuda_impl *im = CUDA_IMPL(be);
    wide_fn fn = transB ? wide_pick<1>(ks) : wide_pick<0>(ks);
    LAUNCH(fn,
           dim3((unsigned)((N + WD_COLS - 1) / WD_COLS), (unsigned)((M + WD_ROWS - 1) / WD_ROWS),
                (unsigned)batch),
           dim3(WD_THREADS), 0, im->stream)(a);
    LAUNCHED(be, "wide_kernel");
    return 1;
}
