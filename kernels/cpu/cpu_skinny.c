/* kernels/cpu/cpu_skinny.c — the CPU fast path's products with one side of
 * at most CPU_SKINNY_MAX (64): LoRA's rank-r products (x A^T, xr B^T, dy B,
 * dy^T xr, dxr^T x, dxr A). OpenBLAS packs the large operand of such a
 * product into its panel layout before a kernel that then does little work
 * on it, and runs them at 50-170 GFLOP/s on two cores against about 330 for
 * the frozen weights' products. Here the small operand is packed once (a
 * few hundred KiB at most), the large one is read where it lies, and each
 * output tile of up to 8 rows by 64 columns stays in AVX-512 registers (up
 * to 8 x 8 or 3 x 32 in AVX2's, on CPUs without AVX-512) over the
 * whole reduction. Every output element is one thread's sum over k in
 * order, so results do not depend on the thread count. AVX2's tiles leave
 * the second and third ways below to OpenBLAS when the reduction is longer
 * than 64 (cpu_skinny_matmul says why).
 *
 * C[M,N] = alpha op(A)[M,K] op(B)[K,N] + beta C, row-major, as cblas_sgemm
 * (beta 0: C is not read). Four ways in, each a loop of register tiles
 * (sk_rows) whose vector side is read row by row:
 *   N small with op(A) = A, or K small: op(B) packed as [K, N16], the rows
 *   of op(A) broadcast, straight into C;
 *   N small with op(A) = A^T (dB = dy^T xr): C^T = op(B)^T op(A)^T, A's
 *   rows as they lie the vector side, into a scratch added into C;
 *   M small with op(B) = B (dA = dxr^T x): B's rows as they lie, into C;
 *   M small with op(B) = B^T: C^T with op(A)^T packed, into a scratch. */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define SK_TARGET __attribute__((target("avx512f")))
#define SK2_TARGET __attribute__((target("avx2,fma")))
#define SK_PF 8 /* rows ahead of the one read that a prefetch asks for */
/* Under AddressSanitizer the tiles (always inlined) take their checks from
 * the block they are inlined into (SK_BLOCK), and carry no marks of their
 * own: the marks of an inlined function's locals would poison the stack
 * where the block is not checked, for the code that next uses it. */
#if defined(__SANITIZE_ADDRESS__)
#define SK_TILE_ASAN __attribute__((no_sanitize_address))
#else
#define SK_TILE_ASAN
#endif

/* op(X)[k, n] for k < K, n < N into w[k * ldw + n], zero from N to ldw */
static void sk_pack(float *w, size_t ldw, const float *X, size_t ldx, int trans, int K, int N)
{
    for (int k = 0; k < K; k++) {
        float *dst = w + (size_t)k * ldw;
        if (trans)
            for (int n = 0; n < N; n++)
                dst[n] = X[(size_t)n * ldx + (size_t)k];
        else
            memcpy(dst, X + (size_t)k * ldx, sizeof(float) * (size_t)N);
        for (size_t n = (size_t)N; n < ldw; n++)
            dst[n] = 0.0f;
    }
}

/* C[i, 0:ncols] (i < MB) = alpha sum_k a(i,k) w[k, 0:ncols] + beta C, with
 * a(i,k) = a[i*am + k*ak] and NZ = ceil(ncols/16) vectors a row; MB, NZ and
 * MW are constants at every call, so the tile is registers. MW: w is a
 * matrix as it lies (its last vector's columns masked), not a padded pack. */
static inline __attribute__((always_inline)) SK_TARGET SK_TILE_ASAN void
sk_tile(const int MB, const int NZ, const int MW, const float *a, size_t am, size_t ak,
        const float *w, size_t ldw, int K, float *c, size_t ldc, int ncols, float alpha,
        float beta)
{
    __m512 acc[8][4];
    int left = ncols - 16 * (NZ - 1);
    __mmask16 last = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
#pragma GCC unroll 8
    for (int i = 0; i < MB; i++)
#pragma GCC unroll 4
        for (int z = 0; z < NZ; z++)
            acc[i][z] = _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        __m512 wv[4];
        const float *wk = w + (size_t)k * ldw;
#pragma GCC unroll 4
        for (int z = 0; z < NZ; z++) {
            if (MW && z == NZ - 1)
                wv[z] = _mm512_maskz_loadu_ps(last, wk + 16 * z);
            else
                wv[z] = _mm512_loadu_ps(wk + 16 * z);
            /* a strip of a large row-major w: rows a page or more apart,
             * which the hardware prefetchers do not follow */
            _mm_prefetch((const char *)(wk + SK_PF * ldw + 16 * z), _MM_HINT_T0);
        }
        const float *ak_ = a + (size_t)k * ak;
#pragma GCC unroll 8
        for (int i = 0; i < MB; i++) {
            __m512 av = _mm512_set1_ps(ak_[(size_t)i * am]);
#pragma GCC unroll 4
            for (int z = 0; z < NZ; z++)
                acc[i][z] = _mm512_fmadd_ps(av, wv[z], acc[i][z]);
        }
    }
    __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 8
    for (int i = 0; i < MB; i++) {
        float *ci = c + (size_t)i * ldc;
#pragma GCC unroll 4
        for (int z = 0; z < NZ; z++) {
            __mmask16 m = z == NZ - 1 ? last : (__mmask16)0xFFFF;
            __m512 r = _mm512_mul_ps(va, acc[i][z]);
            if (beta != 0.0f)
                r = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m, ci + 16 * z), r);
            _mm512_mask_storeu_ps(ci + 16 * z, m, r);
        }
    }
}

/* mb rows (< the tile's) one at a time through the 1-row tile */
#define SK_TAIL(NZ_, MW_)                                                                          \
    do {                                                                                           \
        for (int i = 0; i < mb; i++)                                                               \
            sk_tile(1, NZ_, MW_, a + (size_t)i * am, am, ak, w, ldw, K, c + (size_t)i * ldc, ldc,  \
                    ncols, alpha, beta);                                                           \
    } while (0)

#define SK_T(MB_, NZ_, MW_) sk_tile(MB_, NZ_, MW_, a, am, ak, w, ldw, K, c, ldc, ncols, alpha, beta)

/* The tiles: 8 x 16 and 4 x 16; 8 x 32, 6 x 32 and 4 x 32; 4 x 48; 4 x 64 */
#define SK_DISPATCH(MW_)                                                                           \
    switch (nz) {                                                                                  \
    case 1:                                                                                        \
        if (mb == 8)                                                                               \
            SK_T(8, 1, MW_);                                                                       \
        else if (mb == 4)                                                                          \
            SK_T(4, 1, MW_);                                                                       \
        else                                                                                       \
            SK_TAIL(1, MW_);                                                                       \
        break;                                                                                     \
    case 2:                                                                                        \
        if (mb == 8)                                                                               \
            SK_T(8, 2, MW_);                                                                       \
        else if (mb == 6)                                                                          \
            SK_T(6, 2, MW_);                                                                       \
        else if (mb == 4)                                                                          \
            SK_T(4, 2, MW_);                                                                       \
        else                                                                                       \
            SK_TAIL(2, MW_);                                                                       \
        break;                                                                                     \
    case 3:                                                                                        \
        if (mb == 4)                                                                               \
            SK_T(4, 3, MW_);                                                                       \
        else                                                                                       \
            SK_TAIL(3, MW_);                                                                       \
        break;                                                                                     \
    default:                                                                                       \
        if (mb == 4)                                                                               \
            SK_T(4, 4, MW_);                                                                       \
        else                                                                                       \
            SK_TAIL(4, MW_);                                                                       \
        break;                                                                                     \
    }

/* A block of mb rows by a set's tiles (DISPATCH_: SK_DISPATCH or
 * SK2_DISPATCH): sk_block and sk_block2, and under AddressSanitizer
 * sk_block_unchecked and sk_block2_unchecked, the same tiles with their
 * loads and stores not checked one by one (sk_rows checks the operands'
 * spans instead: SK_SPANS) */
typedef void sk_block_fn(int mb, int nz, int mw, const float *a, size_t am, size_t ak,
                         const float *w, size_t ldw, int K, float *c, size_t ldc, int ncols,
                         float alpha, float beta);
#define SK_BLOCK(NAME_, TARGET_, DISPATCH_, ATTR_)                                                 \
    static TARGET_ ATTR_ void NAME_(int mb, int nz, int mw, const float *a, size_t am, size_t ak,  \
                                    const float *w, size_t ldw, int K, float *c, size_t ldc,       \
                                    int ncols, float alpha, float beta)                            \
    {                                                                                              \
        if (mw) {                                                                                  \
            DISPATCH_(1)                                                                           \
        } else {                                                                                   \
            DISPATCH_(0)                                                                           \
        }                                                                                          \
    }
SK_BLOCK(sk_block, SK_TARGET, SK_DISPATCH, )

/* AVX2 (with FMA): sk_tile with 8-float vectors in 16 registers. The last
 * vector's columns are masked by vmaskmov (masked lanes are not read, so a
 * matrix as it lies is not over-read). */
static inline __attribute__((always_inline)) SK2_TARGET SK_TILE_ASAN void
sk_tile2(const int MB, const int NZ, const int MW, const float *a, size_t am, size_t ak,
         const float *w, size_t ldw, int K, float *c, size_t ldc, int ncols, float alpha,
         float beta)
{
    __m256 acc[8][4];
    int left = ncols - 8 * (NZ - 1);
    __m256i last = _mm256_cmpgt_epi32(_mm256_set1_epi32(left),
                                      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
#pragma GCC unroll 8
    for (int i = 0; i < MB; i++)
#pragma GCC unroll 4
        for (int z = 0; z < NZ; z++)
            acc[i][z] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        __m256 wv[4];
        const float *wk = w + (size_t)k * ldw;
#pragma GCC unroll 4
        for (int z = 0; z < NZ; z++) {
            if (MW && z == NZ - 1)
                wv[z] = _mm256_maskload_ps(wk + 8 * z, last);
            else
                wv[z] = _mm256_loadu_ps(wk + 8 * z);
            if (z % 2 == 0) /* one a 64-byte line */
                _mm_prefetch((const char *)(wk + SK_PF * ldw + 8 * z), _MM_HINT_T0);
        }
        const float *ak_ = a + (size_t)k * ak;
#pragma GCC unroll 8
        for (int i = 0; i < MB; i++) {
            __m256 av = _mm256_broadcast_ss(ak_ + (size_t)i * am);
#pragma GCC unroll 4
            for (int z = 0; z < NZ; z++)
                acc[i][z] = _mm256_fmadd_ps(av, wv[z], acc[i][z]);
        }
    }
    __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
#pragma GCC unroll 8
    for (int i = 0; i < MB; i++) {
        float *ci = c + (size_t)i * ldc;
#pragma GCC unroll 4
        for (int z = 0; z < NZ; z++) {
            __m256 r = _mm256_mul_ps(va, acc[i][z]);
            if (z == NZ - 1 && left < 8) {
                if (beta != 0.0f)
                    r = _mm256_fmadd_ps(vb, _mm256_maskload_ps(ci + 8 * z, last), r);
                _mm256_maskstore_ps(ci + 8 * z, last, r);
            } else {
                if (beta != 0.0f)
                    r = _mm256_fmadd_ps(vb, _mm256_loadu_ps(ci + 8 * z), r);
                _mm256_storeu_ps(ci + 8 * z, r);
            }
        }
    }
}

/* A block of mb rows through the tallest of the tile heights for nz
 * vectors a row that fits, then the next (AVX2: 8, 6, 4, 3, 2, 1 x 8
 * floats; 6, 4, 3, 2, 1 x 16; 4, 3, 2, 1 x 24; 3, 2, 1 x 32: at most 12
 * accumulators of the 16 registers) */
#define SK2_T(MB_, NZ_, MW_)                                                                       \
    if (rem >= MB_) {                                                                              \
        sk_tile2(MB_, NZ_, MW_, a + (size_t)r * am, am, ak, w, ldw, K, c + (size_t)r * ldc, ldc,   \
                 ncols, alpha, beta);                                                              \
        r += MB_;                                                                                  \
        continue;                                                                                  \
    }

#define SK2_DISPATCH(MW_)                                                                          \
    for (int r = 0; r < mb;) {                                                                     \
        int rem = mb - r;                                                                          \
        switch (nz) {                                                                              \
        case 1:                                                                                    \
            SK2_T(8, 1, MW_) SK2_T(6, 1, MW_) SK2_T(4, 1, MW_) SK2_T(3, 1, MW_)                    \
            SK2_T(2, 1, MW_) SK2_T(1, 1, MW_) break;                                               \
        case 2:                                                                                    \
            SK2_T(6, 2, MW_) SK2_T(4, 2, MW_) SK2_T(3, 2, MW_) SK2_T(2, 2, MW_)                    \
            SK2_T(1, 2, MW_) break;                                                                \
        case 3:                                                                                    \
            SK2_T(4, 3, MW_) SK2_T(3, 3, MW_) SK2_T(2, 3, MW_) SK2_T(1, 3, MW_) break;             \
        default:                                                                                   \
            SK2_T(3, 4, MW_) SK2_T(2, 4, MW_) SK2_T(1, 4, MW_) break;                              \
        }                                                                                          \
    }

SK_BLOCK(sk_block2, SK2_TARGET, SK2_DISPATCH, )

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
/* Under AddressSanitizer each of the tiles' loads checked as it happens was
 * 60% of a training test's time. So there, by default, sk_rows checks once that each operand's whole
 * span is memory it may read (or write: C), reporting as AddressSanitizer
 * does, and runs the tiles unchecked. SPOTUNE_ASAN_SKINNY=loads checks
 * every load and store instead (the ops suite, which drives the tiles'
 * edges: tests/trainer.cmake). */
#define SK_NO_ASAN __attribute__((no_sanitize_address))
SK_BLOCK(sk_block_unchecked, SK_TARGET, SK_DISPATCH, SK_NO_ASAN)
SK_BLOCK(sk_block2_unchecked, SK2_TARGET, SK2_DISPATCH, SK_NO_ASAN)

static int sk_check_loads(void)
{
    static int v = -1; /* the same answer from every thread */
    int r = __atomic_load_n(&v, __ATOMIC_RELAXED);
    if (r < 0) {
        const char *e = getenv("SPOTUNE_ASAN_SKINNY");
        r = e && strcmp(e, "loads") == 0;
        __atomic_store_n(&v, r, __ATOMIC_RELAXED);
    }
    return r;
}

/* n floats from p, all addressable, or AddressSanitizer's report of the
 * first that is not (it ends the process), after a line naming the span */
static void __attribute__((noinline)) sk_span(const float *p, size_t n, int is_write,
                                              const char *what)
{
    void *bad = __asan_region_is_poisoned((void *)(uintptr_t)p, sizeof(float) * n);
    if (bad) {
        fprintf(stderr, "spotune: a skinny product's %s (%zu floats from %p) is not all memory "
                        "it may %s (its span checked before its tiles; SPOTUNE_ASAN_SKINNY=loads "
                        "checks each load)\n",
                what, n, (const void *)p, is_write ? "write" : "read");
        __asan_report_error(__builtin_return_address(0), __builtin_frame_address(0),
                            __builtin_frame_address(0), bad, is_write, sizeof(float));
    }
}

/* the spans the tiles of sk_rows read and write: a(m, k) for m < M, k < K;
 * w's K rows (as they lie: N columns; packed: ldw); C's M rows of N */
#define SK_SPANS()                                                                                 \
    do {                                                                                           \
        sk_span(a, (size_t)(M - 1) * am + (size_t)(K - 1) * ak + 1, 0, "broadcast operand");       \
        sk_span(w, (size_t)(K - 1) * ldw + (mw ? (size_t)N : ldw), 0, "vector operand");           \
        sk_span(c, (size_t)(M - 1) * ldc + (size_t)N, 1, "output");                                \
    } while (0)
#define SK_UNCHECKED() (!sk_check_loads())
#else
#define SK_SPANS() ((void)0)
#define SK_UNCHECKED() 0
#define sk_block_unchecked sk_block
#define sk_block2_unchecked sk_block2
#endif

/* The register tiles of an instruction set: vector width in floats; column
 * chunks of four vectors (64 or 32 floats), and for a few rows of a wide
 * output, chunks of 32 or 24 with their rows (8 or 4; AVX2's 4 x 24 against
 * 6 x 16, 3 x 32 and 8 x 8 on LoRA's dA shapes: 5-25% faster); rows[nz]
 * for nz vectors a row (AVX-512: 8 x 16, 6 x 32, 4 x 48, 4 x 64
 * accumulators, 8 to 16 of the 32 registers, the rest for op(B)'s row and
 * the broadcasts; AVX2: 8 x 8, 6 x 16, 4 x 24, 3 x 32, 8 to 12 of the 16). */
typedef struct sk_isa {
    int vw, cw, cw_few, rows_few, rows[5];
} sk_isa;

static const sk_isa sk_avx512 = {16, 64, 32, 8, {0, 8, 6, 4, 4}};
static const sk_isa sk_avx2 = {8, 32, 24, 4, {0, 8, 6, 4, 3}};

/* C[m, :] for m < M over column chunks by isa's tiles: a(m,k) = a[m*am +
 * k*ak] (the broadcast side), w[k * ldw + n] (the vector side; mw: as it
 * lies, not a padded pack). Threads split the row blocks, or the column
 * chunks where there are more of those or few rows (each chunk's column
 * strip of w is then read by one thread while it stays in its cache). */
static void sk_rows(int isa, int M, int N, int K, const float *a, size_t am, size_t ak,
                    const float *w, size_t ldw, int mw, float *c, size_t ldc, float alpha,
                    float beta)
{
    const sk_isa *t = isa == CPU_SKINNY_AVX512 ? &sk_avx512 : &sk_avx2;
    /* a few rows of a wide output: tiles of 8 x 32 (AVX-512), each column
     * strip of w read by few tiles while it is in the cache (8 x 32 against
     * 4 x 64 and 16 x 16: 10-40% faster on LoRA's dA and dB shapes);
     * otherwise chunks of four vectors */
    int few = M <= CPU_SKINNY_MAX && N > 64;
    int cw = few ? t->cw_few : t->cw;
    int nchunks = (N + cw - 1) / cw;
    int nz_last = ((N - cw * (nchunks - 1)) + t->vw - 1) / t->vw;
    int rows = few ? t->rows_few : nchunks == 1 ? t->rows[nz_last] : t->rows[cw / t->vw];
    int nblocks = (M + rows - 1) / rows;
    int by_chunk = nchunks > 1 && (nchunks > nblocks || few);
    int ntask = nblocks * nchunks;
    double work = (double)M * (double)N * (double)K;
    int unchecked = SK_UNCHECKED();
    if (unchecked)
        SK_SPANS();
    sk_block_fn *block = isa == CPU_SKINNY_AVX512 ? (unchecked ? sk_block_unchecked : sk_block)
                                                  : (unchecked ? sk_block2_unchecked : sk_block2);
#pragma omp parallel for schedule(static) if (work > 262144.0 && !omp_in_parallel())
    for (int t_ = 0; t_ < ntask; t_++) {
        int bi = by_chunk ? t_ % nblocks : t_ / nchunks;
        int ch = by_chunk ? t_ / nblocks : t_ % nchunks;
        int m0 = bi * rows;
        int mb = M - m0 < rows ? M - m0 : rows;
        int n0 = ch * cw;
        int ncols = N - n0 < cw ? N - n0 : cw;
        int nz = (ncols + t->vw - 1) / t->vw;
        const float *ab = a + (size_t)m0 * am;
        float *cb = c + (size_t)m0 * ldc + (size_t)n0;
        block(mb, nz, mw, ab, am, ak, w + n0, ldw, K, cb, ldc, ncols, alpha, beta);
    }
}

/* C[m, j] = alpha s[j * lds + m] + beta C[m, j] for m < M, j < N */
static void sk_add_transposed(float *C, size_t ldc, const float *s, size_t lds, int M, int N,
                              float alpha, float beta)
{
#pragma omp parallel for schedule(static) if ((double)M * (double)N > 65536.0 && !omp_in_parallel())
    for (int m = 0; m < M; m++) {
        float *cm = C + (size_t)m * ldc;
        if (beta == 0.0f)
            for (int j = 0; j < N; j++)
                cm[j] = alpha * s[(size_t)j * lds + (size_t)m];
        else
            for (int j = 0; j < N; j++)
                cm[j] = alpha * s[(size_t)j * lds + (size_t)m] + beta * cm[j];
    }
}

static unsigned long sk_count;

unsigned long cpu_skinny_count(void)
{
    return __atomic_load_n(&sk_count, __ATOMIC_RELAXED);
}

int cpu_skinny_isa(void)
{
    if (__builtin_cpu_supports("avx512f"))
        return CPU_SKINNY_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return CPU_SKINNY_AVX2;
    return CPU_SKINNY_NONE;
}

int cpu_skinny_matmul(int isa, float *C, const float *A, const float *B, int M, int N, int K,
                      int transA, int transB, float alpha, float beta, int lda, int ldb, int ldc)
{
    if (M <= 0 || N <= 0 || K <= 0 || isa <= CPU_SKINNY_NONE || isa > cpu_skinny_isa())
        return 0;
    int small_n = N <= CPU_SKINNY_MAX, small_k = K <= CPU_SKINNY_MAX;
    int small_m = M <= CPU_SKINNY_MAX;
    if (!small_n && !small_k && !small_m)
        return 0;
    /* AVX2: a few rows of a wide output over a long reduction (dA = dxr^T
     * x, and dB = dy^T xr through its transpose) stay OpenBLAS's. Its
     * 16-register tiles are too short to read the wide operand few times:
     * 0.58-0.78x OpenBLAS's speed on LoRA's shapes in a training step,
     * against 1.1-2.7x on the others (docs/perf.md). */
    if (isa == CPU_SKINNY_AVX2 && !small_k &&
        ((small_m && !small_n && !transB) || (small_n && transA && M > CPU_SKINNY_MAX)))
        return 0;
    __atomic_fetch_add(&sk_count, 1ul, __ATOMIC_RELAXED);
    size_t am = transA ? 1 : (size_t)lda, ak = transA ? (size_t)lda : 1;
    size_t bk = transB ? 1 : (size_t)ldb, bn = transB ? (size_t)ldb : 1;
    if (small_m && !small_n && !transB) {
        /* a few rows of a wide output (dA = dxr^T x): op(B)'s rows are
         * contiguous, the vector side as they lie */
        sk_rows(isa, M, N, K, A, am, ak, B, (size_t)ldb, 1, C, (size_t)ldc, alpha, beta);
        return 1;
    }
    if (small_n && transA) {
        /* C^T = op(B)^T op(A)^T (dB = dy^T xr): op(A)^T's rows are A's */
        size_t ldw = ((size_t)N + 15) & ~(size_t)15, lds = ((size_t)M + 15) & ~(size_t)15;
        float *w = aligned_alloc(64, sizeof(float) * ldw * (size_t)K);
        float *s = aligned_alloc(64, sizeof(float) * lds * (size_t)N);
        if (!w || !s) {
            free(w);
            free(s);
            return 0;
        }
        sk_pack(w, ldw, B, (size_t)ldb, transB, K, N);
        sk_rows(isa, N, M, K, w, 1, ldw, A, (size_t)lda, 1, s, lds, 1.0f, 0.0f);
        sk_add_transposed(C, (size_t)ldc, s, lds, M, N, alpha, beta);
        free(w);
        free(s);
        return 1;
    }
    if (small_n || small_k) {
        /* op(B) packed [K, N16], the rows of op(A) broadcast */
        size_t ldw = ((size_t)N + 15) & ~(size_t)15;
        float *w = aligned_alloc(64, sizeof(float) * ldw * (size_t)K);
        if (!w)
            return 0;
        sk_pack(w, ldw, B, (size_t)ldb, transB, K, N);
        sk_rows(isa, M, N, K, A, am, ak, w, ldw, 0, C, (size_t)ldc, alpha, beta);
        free(w);
        return 1;
    }
    /* M small, op(B) = B^T: S[N, M16] = op(B)^T op(A)^T with B's rows
     * broadcast, then C = alpha S^T + beta C */
    size_t ldw = ((size_t)M + 15) & ~(size_t)15;
    float *w = aligned_alloc(64, sizeof(float) * ldw * (size_t)K);
    float *s = aligned_alloc(64, sizeof(float) * ldw * (size_t)N);
    if (!w || !s) {
        free(w);
        free(s);
        return 0;
    }
    /* op(A)^T[k, m] = a(m, k): op(A) stored transposed is A with !transA */
    sk_pack(w, ldw, A, (size_t)lda, !transA, K, M);
    sk_rows(isa, N, M, K, B, bn, bk, w, ldw, 0, s, ldw, 1.0f, 0.0f);
    sk_add_transposed(C, (size_t)ldc, s, ldw, M, N, alpha, beta);
    free(w);
    free(s);
    return 1;
}

#else

unsigned long cpu_skinny_count(void)
{
    return 0;
}

int cpu_skinny_isa(void)
{
    return CPU_SKINNY_NONE;
}

int cpu_skinny_matmul(int isa, float *C, const float *A, const float *B, int M, int N, int K,
                      int transA, int transB, float alpha, float beta, int lda, int ldb, int ldc)
{
    (void)isa, (void)C, (void)A, (void)B, (void)M, (void)N, (void)K, (void)transA, (void)transB;
    (void)alpha, (void)beta, (void)lda, (void)ldb, (void)ldc;
    return 0;
}

#endif
