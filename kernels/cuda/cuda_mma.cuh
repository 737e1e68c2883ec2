/* kernels/cuda/cuda_mma.cuh — the tensor-core primitives of the fused
 * attention kernels (cuda_flash_kernels.cuh, cuda_flash_backward.cuh): the
 * m16n8k16 bf16 product and its fragment layouts, ldmatrix loads of right
 * operands from shared memory, cp.async copies from global to shared
 * memory, and the staged tile products built from them. Device code only, self-contained
 * (cuda_device.h), so the CPU emulation of the device (tests/cuda_emu) runs
 * it too: there the product, ldmatrix and the copies are the emulator's.
 *
 * Layouts: a staged tile is rows of HD bf16 padded by FA_PAD (row stride HD
 * + FA_PAD: 16-byte aligned rows whose ldmatrix phases hit distinct banks).
 * A lane (g = lane/4, t = lane%4) of a warp holds an A fragment as rows g,
 * g+8 x columns 2t..2t+1 and 2t+8..2t+9; a B fragment as rows 2t..2t+1 and
 * 2t+8..2t+9 of column g; a C fragment as rows g, g+8 x columns 2t, 2t+1. */
#ifndef SPOTUNE_CUDA_MMA_CUH
#define SPOTUNE_CUDA_MMA_CUH

#include <stdint.h>
#include <string.h>

#include "cuda_device.h"

#define FA_PAD 8 /* shared-memory row padding (bf16): conflict-free fragment loads */

/* Full unrolling of the fragment loops (the register arrays need
 * compile-time indices); nothing under the emulation. */
#if defined(SPOTUNE_CUDA_EMU)
#define FA_UNROLL
#else
#define FA_UNROLL _Pragma("unroll")
#endif

/* ---- fragments -------------------------------------------------------------------- */

/* Two floats as a bf16 pair (lo in the low half), rounded to nearest even:
 * one cvt.rn.bf16x2.f32 on the device (the integer rounding of
 * f32_to_bf16 costs about seven instructions a value, and the kernels
 * round every P and dS they multiply); the same bits but for a NaN's
 * payload (the instruction gives the canonical NaN). */
static __device__ __forceinline__ uint32_t pack2(float lo, float hi)
{
#if !defined(SPOTUNE_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (uint32_t)f32_to_bf16(lo) | ((uint32_t)f32_to_bf16(hi) << 16);
#endif
}

static __device__ __forceinline__ uint32_t ld32(const uint16_t *p)
{
    return *(const uint32_t *)p;
}

/* c += a b: A 16x16 bf16 row-major, B 16x8 bf16 column-major, C 16x8 fp32.
 * Lane (g = lane/4, t = lane%4) holds a = rows g, g+8 x cols 2t..2t+1 and
 * 2t+8..2t+9; b = rows 2t..2t+1 and 2t+8..2t+9 of column g; c = rows g,
 * g+8 x cols 2t, 2t+1. Not volatile: the compiler may interleave
 * independent products (and the loads feeding them). */
static __device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0,
                                                uint32_t b1)
{
#if defined(SPOTUNE_CUDA_EMU)
    emu_mma_m16n8k16_bf16(c, a, b0, b1);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    (void)c, (void)a, (void)b0, (void)b1;
    __trap(); /* never launched: the host checks for compute capability 8.0 */
#endif
}

/* Four 8x8 bf16 matrices from shared memory (ldmatrix.x4): lane l gives
 * the address of row l%8 of matrix l/8 (16 bytes, 16-byte aligned); r[i]
 * is this lane's part of matrix i: row lane/4, columns 2(lane%4) and +1,
 * or with trans the same of its transpose (rows 2(lane%4) and +1 of
 * column lane/4): exactly an mma B fragment half, either way round. */
static __device__ __forceinline__ void ldsm_x4(uint32_t r[4], const uint16_t *row, int trans)
{
#if defined(SPOTUNE_CUDA_EMU)
    emu_ldmatrix_x4(r, row, trans);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned addr = (unsigned)__cvta_generic_to_shared(row);
    if (trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
#else
    (void)r, (void)row, (void)trans;
    __trap();
#endif
}

/* BYTES (16 or 4, both addresses aligned to it) from global to shared
 * memory without passing through registers (cp.async, sm_80: .cg for 16,
 * .ca for 4), or zeros when !valid (src is then not read, but must still
 * be a mapped address). Complete after cp_async_wait and a barrier. */
template <int BYTES>
static __device__ __forceinline__ void cp_async_n(void *dst, const void *src, int valid)
{
    static_assert(BYTES == 16 || BYTES == 4, "cp.async of 16 or 4 bytes");
#if defined(SPOTUNE_CUDA_EMU)
    emu_cp_async(dst, src, BYTES, valid);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned addr = (unsigned)__cvta_generic_to_shared(dst);
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src),
                     "r"(valid ? 16 : 0)
                     : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(addr), "l"(src),
                     "r"(valid ? 4 : 0)
                     : "memory");
#else
    if (valid)
        memcpy(dst, src, BYTES);
    else
        memset(dst, 0, BYTES);
#endif
}

/* A tile's 16-byte pieces (bf16 rows). */
static __device__ __forceinline__ void cp_async16(uint16_t *dst, const uint16_t *src, int valid)
{
    cp_async_n<16>(dst, src, valid);
}

/* A tile's per-row floats and ints. */
static __device__ __forceinline__ void cp_async4(void *dst, const void *src, int valid)
{
    cp_async_n<4>(dst, src, valid);
}

static __device__ __forceinline__ void cp_async_commit(void)
{
#if defined(SPOTUNE_CUDA_EMU)
    emu_cp_async_commit();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

/* Waits until at most n of this thread's committed groups are in flight. */
template <int N> static __device__ __forceinline__ void cp_async_wait(void)
{
#if defined(SPOTUNE_CUDA_EMU)
    emu_cp_async_wait(N);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

/* The A fragments of 16 rows x HD columns of a global row-major matrix
 * (row r at base + r * ld); rows at or past nrows read as zero. */
template <int HD>
static __device__ __forceinline__ void load_a_rows(uint32_t a[HD / 16][4], const uint16_t *base,
                                                   size_t ld, int r0, int nrows)
{
    int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    int rA = r0 + g, rB = rA + 8;
    FA_UNROLL
    for (int ks = 0; ks < HD / 16; ks++) {
        int c = ks * 16 + 2 * t;
        a[ks][0] = rA < nrows ? ld32(base + (size_t)rA * ld + c) : 0u;
        a[ks][1] = rB < nrows ? ld32(base + (size_t)rB * ld + c) : 0u;
        a[ks][2] = rA < nrows ? ld32(base + (size_t)rA * ld + c + 8) : 0u;
        a[ks][3] = rB < nrows ? ld32(base + (size_t)rB * ld + c + 8) : 0u;
    }
}

/* The A fragment of k-step kk from C fragments of 8-column tiles 2kk, 2kk+1
 * (rounded to bf16): P or dS reused as the left operand. */
static __device__ __forceinline__ void c_to_a(uint32_t a[4], const float c0[4], const float c1[4])
{
    a[0] = pack2(c0[0], c0[1]);
    a[1] = pack2(c0[2], c0[3]);
    a[2] = pack2(c1[0], c1[1]);
    a[3] = pack2(c1[2], c1[3]);
}

/* Starts copying rows [r0, r0 + nrows) of a [.., HD] slice (row r at src +
 * r * ld) into dst (row stride HD + FA_PAD), zeros past T; the whole block
 * helps, and one commit closes the group. */
template <int HD>
static __device__ __forceinline__ void stage_rows_async(uint16_t *dst, const uint16_t *src,
                                                        size_t ld, int r0, int nrows, int T)
{
    const int chunks = HD / 8; /* 16-byte pieces per row */
    for (int i = threadIdx.x; i < nrows * chunks; i += blockDim.x) {
        int r = i / chunks, c = (i % chunks) * 8, row = r0 + r, ok = row < T;
        cp_async16(dst + r * (HD + FA_PAD) + c, src + (size_t)(ok ? row : 0) * ld + c, ok);
    }
}

/* Starts copying rows [r0, r0 + nrows) (a multiple of 8) of a [.., HD]
 * slice (row r at src + r * ld) into dst as 8 x 8 core matrices (the layout of
 * the wgmma kernels' operands, cuda_wgmma.cuh): row r, column c at
 * ((r/8) (HD/8) + c/8) 64 + (r%8) 8 + c%8, zeros past T; the whole block helps, one commit closes the
 * group. Eight consecutive threads fill one core matrix: 128 contiguous
 * bytes, no bank conflict; a warp reads 64 contiguous bytes of 8 rows. */
template <int HD>
static __device__ __forceinline__ void stage_core_async(uint16_t *dst, const uint16_t *src,
                                                        size_t ld, int r0, int nrows, int T)
{
    const int chunks = HD / 8; /* 16-byte pieces, core matrices, a row */
    for (int i = threadIdx.x; i < nrows * chunks; i += blockDim.x) {
        int r8 = i & 7, rest = i >> 3, c8 = rest % chunks, rg = rest / chunks;
        int row = r0 + rg * 8 + r8, ok = row < T;
        cp_async16(dst + (rg * chunks + c8) * 64 + r8 * 8, src + (size_t)(ok ? row : 0) * ld + c8 * 8,
                   ok);
    }
}

/* x[16 x 8 NT] = A[16 x HD] Y^T, A in registers (a[ks], k-steps of 16), Y
 * NT x 8 rows staged (row stride HD + FA_PAD): S = Q K^T, dP = dO V^T,
 * S^T = K Q^T, dP^T = V dO^T. Every product of a k-step pair is issued
 * before the next pair's (NT independent accumulators in flight). */
template <int HD, int NT>
static __device__ __forceinline__ void a_times_staged_t(float x[NT][4],
                                                        const uint32_t a[HD / 16][4],
                                                        const uint16_t *Y)
{
    int lane = threadIdx.x & 31;
    const uint16_t *yr = Y + (lane & 7) * (HD + FA_PAD) + (lane >> 3) * 8;
    FA_UNROLL
    for (int nt = 0; nt < NT; nt++)
        x[nt][0] = x[nt][1] = x[nt][2] = x[nt][3] = 0.0f;
    FA_UNROLL
    for (int k2 = 0; k2 < HD / 32; k2++)
        FA_UNROLL
        for (int nt = 0; nt < NT; nt++) {
            uint32_t b[4]; /* k-steps 2 k2 (b0, b1) and 2 k2 + 1 (b2, b3) of key rows nt */
            ldsm_x4(b, yr + nt * 8 * (HD + FA_PAD) + k2 * 32, 0);
            mma16816(x[nt], a[2 * k2], b[0], b[1]);
            mma16816(x[nt], a[2 * k2 + 1], b[2], b[3]);
        }
}

/* As a_times_staged_t with A's 16 rows staged too (row stride HD + FA_PAD,
 * from X): each k-step pair's A fragments are read by ldmatrix when they
 * are needed instead of being held in registers (the dK/dV kernel's K and
 * V: 64 registers a thread it needs for the rest). */
template <int HD, int NT>
static __device__ __forceinline__ void staged_times_staged_t(float x[NT][4], const uint16_t *X,
                                                             const uint16_t *Y)
{
    int lane = threadIdx.x & 31;
    /* A: matrices rows 0-7 / 8-15 (lanes 0-15) x columns +0 / +8 (lanes 16-31) */
    const uint16_t *xr = X + (lane & 15) * (HD + FA_PAD) + (lane >> 4) * 8;
    const uint16_t *yr = Y + (lane & 7) * (HD + FA_PAD) + (lane >> 3) * 8;
    FA_UNROLL
    for (int nt = 0; nt < NT; nt++)
        x[nt][0] = x[nt][1] = x[nt][2] = x[nt][3] = 0.0f;
    FA_UNROLL
    for (int k2 = 0; k2 < HD / 32; k2++) {
        uint32_t a0[4], a1[4]; /* k-steps 2 k2 and 2 k2 + 1 */
        ldsm_x4(a0, xr + k2 * 32, 0);
        ldsm_x4(a1, xr + k2 * 32 + 16, 0);
        FA_UNROLL
        for (int nt = 0; nt < NT; nt++) {
            uint32_t b[4];
            ldsm_x4(b, yr + nt * 8 * (HD + FA_PAD) + k2 * 32, 0);
            mma16816(x[nt], a0, b[0], b[1]);
            mma16816(x[nt], a1, b[2], b[3]);
        }
    }
}

/* acc[16 x HD] += A[16 x 16] Y[16 x HD], A one k-step's fragment, Y 16
 * staged rows (row stride HD + FA_PAD) from yr, this lane's ldmatrix row
 * (staged_b_row). */
template <int HD>
static __device__ __forceinline__ void frag_times_staged(float acc[HD / 8][4], const uint32_t a[4],
                                                         const uint16_t *yr)
{
    FA_UNROLL
    for (int n2 = 0; n2 < HD / 16; n2++) {
        uint32_t b[4]; /* columns 16 n2.. (b0, b1) and 16 n2 + 8.. (b2, b3) */
        ldsm_x4(b, yr + n2 * 16, 1);
        mma16816(acc[2 * n2], a, b[0], b[1]);
        mma16816(acc[2 * n2 + 1], a, b[2], b[3]);
    }
}

/* This lane's ldmatrix row of 16 staged rows of HD columns read as right
 * operands (.trans): matrix m = lane/8 is rows +8 (m odd), columns +8
 * (m >= 2). */
template <int HD>
static __device__ __forceinline__ const uint16_t *staged_b_row(const uint16_t *Y)
{
    int lane = threadIdx.x & 31;
    return Y + ((lane & 7) + ((lane >> 3) & 1) * 8) * (HD + FA_PAD) + (lane >> 4) * 8;
}

/* acc[16 x HD] += X[16 x 16 KK] Y[16 KK x HD], X from C fragments (rounded
 * to bf16), Y staged (row stride HD + FA_PAD): O += P V, dQ += dS K,
 * dV += P^T dO, dK += dS^T Q. */
template <int HD, int KK>
static __device__ __forceinline__ void c_times_staged(float acc[HD / 8][4], const float x[2 * KK][4],
                                                      const uint16_t *Y)
{
    const uint16_t *yr = staged_b_row<HD>(Y);
    FA_UNROLL
    for (int kk = 0; kk < KK; kk++) {
        uint32_t a[4];
        c_to_a(a, x[2 * kk], x[2 * kk + 1]);
        frag_times_staged<HD>(acc, a, yr + kk * 16 * (HD + FA_PAD));
    }
}

#endif
