/* tests/cuda_emu/cuda_emu.h — a CPU emulation of the CUDA device, so that
 * kernel source (the .cuh files of kernels/cuda) runs and is tested on a machine
 * without a GPU: compiled as C++ with SPOTUNE_CUDA_EMU, kernels/cuda/
 * cuda_device.h includes this header instead of the CUDA runtime.
 *
 * A launch (emu_launch) runs the grid's blocks one after another; a block's
 * threads are fibers (ucontext) on the calling thread, switched only at the
 * points where threads meet: __syncthreads (every live thread of the
 * block), and the warp-wide operations, shuffles and the tensor-core MMA
 * (every live lane of the warp). So __shared__ is a static variable (one
 * block at a time), atomics are plain operations, and a barrier some
 * thread never reaches (a divergent __syncthreads, a warp operation with
 * lanes gone) is a deadlock the emulator reports by name instead of hanging.
 *
 * mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 takes its operands from the
 * lanes' registers as the PTX ISA lays them out (lane = 4 g + t: A rows g,
 * g+8 x columns 2t, 2t+1, 2t+8, 2t+9; B rows 2t, 2t+1, 2t+8, 2t+9 of column
 * g; C/D rows g, g+8 x columns 2t, 2t+1), an independent transcription of
 * the ISA's figures: a kernel that packs its fragments differently computes
 * wrong products here. The products are exact (bf16 x bf16 fits fp32) and
 * accumulate in fp32, k in order; the hardware's order within one MMA is
 * not specified, a difference of an fp32 rounding or so. */
#ifndef SPOTUNE_CUDA_EMU_H
#define SPOTUNE_CUDA_EMU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct emu_dim3 {
    unsigned x, y, z;
} emu_dim3;

typedef struct emu_thread_id {
    emu_dim3 tid;
} emu_thread_id;

extern emu_dim3 emu_block_idx, emu_block_dim, emu_grid_dim;
extern emu_thread_id *emu_cur; /* the running fiber */

/* Runs fn (the kernel with its arguments bound) over grid x block threads
 * (block.x at most 1024, the last warp may be partial; block.y = block.z =
 * 1). 0 when
 * every block ran to its end; -1 after a deadlock, printed with the block,
 * and the launch abandoned. */
int emu_launch(emu_dim3 grid, emu_dim3 block, void (*fn)(void *), void *arg);
/* The same with smem bytes of dynamic shared memory, which the kernel
 * reaches through emu_dynamic_shared() (DYNAMIC_SHARED, cuda_device.h). */
int emu_launch_smem(emu_dim3 grid, emu_dim3 block, size_t smem, void (*fn)(void *), void *arg);
void *emu_dynamic_shared(void);

/* The warp-wide operations: every live lane of the calling lane's warp
 * arrives before any leaves. */
void emu_syncthreads(void);
uint64_t emu_shfl_xor(unsigned mask, uint64_t v, int lane_mask);
void emu_mma_m16n8k16_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1);
/* ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l gives the
 * address of row l%8 of matrix l/8 (16 bytes, 16-byte aligned: checked);
 * r[i] gets matrix i's row lane/4, columns 2(lane%4) and +1 (trans: rows
 * 2(lane%4) and +1 of column lane/4). */
void emu_ldmatrix_x4(uint32_t r[4], const void *row, int trans);
/* wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16 with A from
 * registers (cuda_wgmma.cuh): d (N/2 floats: N/8 C fragments of this
 * warp's rows) = (scale_d ? d : 0) + A B, A this warp's m16n8k16 A
 * fragment, B 16 x N read from dynamic shared memory through the
 * descriptor (no swizzling; trans_b: MN-major). Emulated a warp at a time
 * (each warp's rows need only its own fragment and B), and asynchronous
 * as on the device: issued here, it joins the open group
 * (emu_wgmma_commit closes it) and runs when emu_wgmma_wait(N) completes
 * its group (all but the newest N), reading B and writing d then. The
 * block must be whole warpgroups, and a block that ends with products in
 * flight stops the process. */
void emu_wgmma_bf16(float *d, int n, const uint32_t a[4], uint64_t desc, int trans_b, int scale_d);
void emu_wgmma_commit(void);
void emu_wgmma_wait(int pending);
/* cp.async.shared.global of size bytes (16 or 4; zeros where !valid),
 * asynchronous as on the device: emu_cp_async reads the source and queues
 * the copy in the open group of the calling thread, emu_cp_async_commit
 * closes the group, emu_cp_async_wait(N) writes every committed group but
 * the newest N to shared memory. A block that ends with copies in flight
 * stops the process. */
void emu_cp_async(void *dst, const void *src, int size, int valid);
void emu_cp_async_commit(void);
void emu_cp_async_wait(int pending);
/* The shared-memory address of p for descriptors: its offset in the
 * launch's dynamic shared memory (anything else aborts). */
uint32_t emu_smem_addr(const void *p);
/* A device-side __trap: the launch reports it and aborts the process. */
void emu_trap(void);

#ifdef __cplusplus
}
#endif

/* ---- the CUDA names the kernels use ------------------------------------------------ */

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static

#define threadIdx (emu_cur->tid)
#define blockIdx emu_block_idx
#define blockDim emu_block_dim
#define gridDim emu_grid_dim

#define __syncthreads() emu_syncthreads()
#define __trap() emu_trap()

typedef struct uint4 {
    unsigned x, y, z, w;
} uint4;

static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w)
{
    uint4 r = {x, y, z, w};
    return r;
}

static inline float __uint_as_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t __float_as_uint(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float __fmul_rn(float a, float b)
{
    return a * b;
}

static inline float __fadd_rn(float a, float b)
{
    return a + b;
}

static inline float __fsub_rn(float a, float b)
{
    return a - b;
}

static inline float __fdiv_rn(float a, float b)
{
    return a / b;
}

typedef struct uint2 {
    unsigned x, y;
} uint2;

static inline uint2 make_uint2(unsigned x, unsigned y)
{
    uint2 r = {x, y};
    return r;
}

typedef struct float2 {
    float x, y;
} float2;

static inline float2 make_float2(float x, float y)
{
    float2 r = {x, y};
    return r;
}

typedef struct float4 {
    float x, y, z, w;
} float4;

static inline float4 make_float4(float x, float y, float z, float w)
{
    float4 r = {x, y, z, w};
    return r;
}

#ifdef __cplusplus
static inline int min(int a, int b)
{
    return a < b ? a : b;
}

static inline int max(int a, int b)
{
    return a > b ? a : b;
}

/* One thread at a time: the read-modify-write needs no atomicity. */
static inline int atomicMin(int *p, int v)
{
    int old = *p;
    if (v < old)
        *p = v;
    return old;
}

static inline unsigned atomicAdd(unsigned *p, unsigned v)
{
    unsigned old = *p;
    *p = old + v;
    return old;
}

/* Blocks run one after another: every write of an earlier block is seen. */
static inline void __threadfence(void)
{
}

static inline float __ldcg(const float *p)
{
    return *p;
}

template <typename T> static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask)
{
    static_assert(sizeof(T) <= sizeof(uint64_t), "a shuffle moves at most 8 bytes");
    uint64_t w = 0;
    memcpy(&w, &v, sizeof v);
    w = emu_shfl_xor(mask, w, lane_mask);
    T r;
    memcpy(&r, &w, sizeof r);
    return r;
}
#endif

#endif
