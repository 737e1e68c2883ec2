/* kernels/cuda/cuda_device.h — the device helpers of the kernel files:
 * launch shapes, fp32 loads and stores of F32/BF16 tensors, the device twins
 * of base.h's bf16 rounding and counter RNG, warp and block reductions,
 * online softmax. Apart from the backend's state (cuda_internal.h) so that
 * kernel source can also be compiled for the CPU emulation of the device
 * that runs it without a GPU (SPOTUNE_CUDA_EMU: tests/cuda_emu/cuda_emu.h
 * stands in for the CUDA runtime). */
#ifndef SPOTUNE_CUDA_DEVICE_H
#define SPOTUNE_CUDA_DEVICE_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#ifdef SPOTUNE_CUDA_EMU
#include "cuda_emu.h"
#include "cuda_emu_runtime.h"
#else
#include <cuda_runtime.h>
#endif

extern "C" {
#include "../backend.h"
}

/* A kernel launch, kernel<<<grid, block, smem, stream>>>(args), is written
 * LAUNCH(kernel, grid, block, smem, stream)(args): the same launch in a CUDA
 * build, and the emulated device's launcher where the <<< >>> syntax does
 * not compile (SPOTUNE_CUDA_EMU). A kernel's dynamic shared memory (the
 * launch's smem bytes) is declared DYNAMIC_SHARED(type, name), name[i]. */
#ifdef SPOTUNE_CUDA_EMU
#define LAUNCH(kernel, ...) emu_launcher(kernel, __VA_ARGS__)
#define DYNAMIC_SHARED(T, name) T *name = (T *)emu_dynamic_shared()
#else
#define LAUNCH(kernel, ...) kernel<<<__VA_ARGS__>>>
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

/* ---- launch shapes ---------------------------------------------------------- */

#define CUDA_BLOCK 256

/* Blocks for a grid-stride loop over n elements. */
static inline unsigned cuda_blocks(size_t n)
{
    size_t b = (n + CUDA_BLOCK - 1) / CUDA_BLOCK;
    if (b > (1u << 20))
        b = 1u << 20;
    return b ? (unsigned)b : 1u;
}

#define GRID_STRIDE(i, n)                                                                    \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                  \
         i += (size_t)gridDim.x * blockDim.x)

/* Where the i-th element of a row-major walk over [rows, cols] lies in a
 * matrix of row stride ld (i itself when ld == cols; 32-bit division where
 * i fits). The same for 8-element vectors with cols and ld counted in them. */
static __device__ __forceinline__ size_t strided_index(size_t i, size_t cols, size_t ld)
{
    if (ld == cols)
        return i;
    if (i <= 0xffffffffu)
        return (size_t)((unsigned)i / (unsigned)cols) * ld + (unsigned)i % (unsigned)cols;
    return i / cols * ld + i % cols;
}

/* ---- bf16 and dtype-generic loads/stores (fp32 in registers) ---------------- */

/* Twins of sp_bf16_to_f32 / sp_f32_to_bf16 (round to nearest even, NaN
 * stays a quiet NaN), bit for bit. */
static __device__ __forceinline__ float bf16_to_f32(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
}

static __device__ __forceinline__ uint16_t f32_to_bf16(float f)
{
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Element i of an F32 or BF16 buffer, as float; the dtype is uniform across
 * a launch, so the branch costs nothing. */
static __device__ __forceinline__ float ld_f(const void *p, int dt, size_t i)
{
    if (dt == DT_BF16)
        return bf16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

static __device__ __forceinline__ void st_f(void *p, int dt, size_t i, float v)
{
    if (dt == DT_BF16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* ---- the counter RNG: twins of base.h, bit for bit -------------------------- */

static __device__ __forceinline__ uint64_t d_mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static __device__ __forceinline__ uint64_t d_rng_u64(uint64_t seed, uint64_t ctr)
{
    return d_mix64(d_mix64(seed) ^ ctr);
}

static __device__ __forceinline__ float d_rng_uniform(uint64_t seed, uint64_t ctr)
{
    return __fmul_rn((float)(d_rng_u64(seed, ctr) >> 40), 1.0f / 16777216.0f);
}

/* Box-Muller in double as sp_rng_normal; CUDA's log and cos are within an
 * ulp or two of glibc's, so the float result agrees to about 1e-7. */
static __device__ __forceinline__ float d_rng_normal(uint64_t seed, uint64_t ctr)
{
    double u1 = ((double)(d_rng_u64(seed, 2 * ctr) >> 11) + 1.0) * (1.0 / 9007199254740992.0);
    double u2 = (double)(d_rng_u64(seed, 2 * ctr + 1) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* ---- block reductions (fixed shape: deterministic) --------------------------- */

/* The two operations the reductions use. */
struct sum_op {
    template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct max_op {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <typename T, typename Op> static __device__ __forceinline__ T warp_reduce(T v, Op op)
{
    for (int o = 16; o > 0; o >>= 1)
        v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* op over the block, returned to every thread; idle: what a missing warp
 * adds (op's identity). sh holds 33 values; blockDim.x is a multiple of 32. */
template <typename T, typename Op>
static __device__ __forceinline__ T block_reduce(T v, T *sh, T idle, Op op)
{
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_reduce(v, op);
    __syncthreads(); /* a previous call's readers are done with sh */
    if (lane == 0)
        sh[w] = v;
    __syncthreads();
    if (w == 0) {
        v = warp_reduce(lane < nw ? sh[lane] : idle, op);
        if (lane == 0)
            sh[32] = v;
    }
    __syncthreads();
    return sh[32];
}

static __device__ __forceinline__ float warp_sum(float v)
{
    return warp_reduce(v, sum_op());
}

/* Sum (or max) over the block, returned to every thread. */
static __device__ __forceinline__ float block_sum(float v, float *sh)
{
    return block_reduce(v, sh, 0.0f, sum_op());
}

static __device__ __forceinline__ float block_max(float v, float *sh)
{
    return block_reduce(v, sh, -INFINITY, max_op());
}

static __device__ __forceinline__ double block_sum_d(double v, double *sh)
{
    return block_reduce(v, sh, 0.0, sum_op());
}

/* Online softmax: x joins a thread's running max m and its sum s of
 * exp(. - m); block_lse combines the block's (m, s) into log sum exp. */
static __device__ __forceinline__ void online_max_sum(float x, float &m, float &s)
{
    if (x > m) {
        s = s * expf(m - x) + 1.0f;
        m = x;
    } else {
        s += expf(x - m);
    }
}

static __device__ __forceinline__ float block_lse(float m, float s, float *sh)
{
    float M = block_max(m, sh);
    return M + logf(block_sum(m == -INFINITY ? 0.0f : s * expf(m - M), sh));
}

#endif
