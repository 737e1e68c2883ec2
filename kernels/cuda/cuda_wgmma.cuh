/* kernels/cuda/cuda_wgmma.cuh — the Hopper warpgroup products (wgmma, sm_90a)
 * of the fused attention's wgmma kernels (cuda_flash_wgmma.cu): their
 * operand layout in shared memory, its descriptors, and the fences and
 * waits around them. Device code only, self-contained (cuda_device.h), so
 * the CPU emulation of the device (tests/cuda_emu) runs it too: there the
 * product is the emulator's, asynchronous as on the device (it runs at the
 * wait that completes its group).
 *
 * A warpgroup is four consecutive warps (128 threads) and issues every
 * wgmma together (.sync.aligned: no warp may branch around one). The
 * shapes used: D[64 x N] (+)= A[64 x 16] B[16 x N], bf16 in, fp32
 * accumulators, A from registers: warp w of the group supplies rows 16w..
 * 16w+15 as the A fragment of mma.sync m16n8k16 (cuda_mma.cuh), and holds
 * the same rows of D as N/8 C fragments of it (d[nt]: columns 8nt..8nt+7).
 * So a forward written for mma.sync keeps its fragments, masks and
 * softmax, and only its products change.
 *
 * B comes from shared memory through a descriptor (PTX ISA, "Matrix
 * Descriptor Format"): start address, leading-dimension byte offset (LBO)
 * and stride-dimension byte offset (SBO), each >> 4, no swizzling. The
 * staged tiles (stage_core_async, cuda_mma.cuh) are rows of HD bf16 cut into 8 x 8 core
 * matrices of 128 contiguous bytes: row r, column c at ((r/8) (HD/8) +
 * c/8) 64 + (r%8) 8 + c%8 elements. That one layout serves both uses:
 *  - K as B of S = Q K^T (B is N x K = keys x hd, "K-major", trans-b 0):
 *    B(n, k) at start + (n%8) 16 + (n/8) SBO + (k%8) 2 + (k/8) LBO bytes,
 *    so LBO = 128 (the next 8 columns of hd), SBO = HD/8 x 128 (the next 8
 *    keys), and k-step ks starts 2 ks x 128 bytes in;
 *  - V as B of O += P V (B is K x N = keys x hd, "MN-major", trans-b 1):
 *    B(n, k) at start + (n%8) 2 + (n/8) SBO + (k%8) 16 + (k/8) LBO, so
 *    SBO = 128 (the next 8 columns of hd), LBO = HD/8 x 128 (the next 8
 *    keys), and k-step kk starts 2 kk x HD/8 x 128 bytes in.
 * (The canonical layouts of the ISA's "Shared Memory Matrix Layout":
 * K-major ((8,m),(T,2k)):((1T,SBO),(1,LBO)), MN-major ((T,1,m),(8,k)):
 * ((1,T,SBO),(1T,LBO)), T = 8 bf16.) The emulator reads B through the same
 * formulas from the descriptor alone, so a kernel whose descriptors or
 * staging disagree with them computes wrong products there; whether the
 * formulas are the hardware's is what the workbench's first run on an
 * sm_90 GPU shows (kernels/cuda/dev/README.md). */
#ifndef SPOTUNE_CUDA_WGMMA_CUH
#define SPOTUNE_CUDA_WGMMA_CUH

#include <stdint.h>

#include "cuda_device.h"
#include "cuda_mma.cuh"

/* wgmma is an sm_90a instruction: the device code below is real only in
 * the sm_90a build of cuda_flash_wgmma.cu (and in the emulation). */
#if !defined(SPOTUNE_CUDA_EMU) && defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_DEVICE 1
#else
#define WG_DEVICE 0
#endif

/* The shared-memory address of p (what descriptors and cp.async take). */
static __device__ __forceinline__ uint32_t smem_addr(const void *p)
{
#if defined(SPOTUNE_CUDA_EMU)
    return emu_smem_addr(p);
#elif defined(__CUDA_ARCH__)
    return (uint32_t)__cvta_generic_to_shared(p);
#else
    (void)p;
    return 0;
#endif
}

/* A matrix descriptor without swizzling (base offset 0, mode 0). */
static __device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo)
{
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | (uint64_t)((lbo & 0x3FFFFu) >> 4) << 16 |
           (uint64_t)((sbo & 0x3FFFFu) >> 4) << 32;
}

/* Orders this thread's earlier register and shared-memory accesses before
 * the warpgroup's next products (before the first, and after writing an
 * accumulator or A fragment they read). */
static __device__ __forceinline__ void wg_fence(void)
{
#if WG_DEVICE
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

static __device__ __forceinline__ void wg_commit(void)
{
#if defined(SPOTUNE_CUDA_EMU)
    emu_wgmma_commit();
#elif WG_DEVICE
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

/* Waits until at most N committed groups of products are in flight; then
 * their accumulators may be read. */
template <int N> static __device__ __forceinline__ void wg_wait(void)
{
#if defined(SPOTUNE_CUDA_EMU)
    emu_wgmma_wait(N);
#elif WG_DEVICE
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

/* Makes this thread's writes to shared memory (cp.async's included)
 * visible to the products, which read through the async proxy: after the
 * copy is complete, before the barrier that publishes it. */
static __device__ __forceinline__ void fence_proxy_async(void)
{
#if WG_DEVICE
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

/* Keeps the compiler from moving reads of accumulators d above the wait
 * that completes them (it does not know the products write them late). */
template <int NT> static __device__ __forceinline__ void wg_hold(float d[NT][4])
{
#if WG_DEVICE
    FA_UNROLL
    for (int nt = 0; nt < NT; nt++)
        asm volatile("" : "+f"(d[nt][0]), "+f"(d[nt][1]), "+f"(d[nt][2]), "+f"(d[nt][3])::"memory");
#else
    (void)d;
#endif
}

/* d[64 x 32] = (scale_d ? d : 0) + A B (the backward's S^T and dP^T against
 * a tile of 32 queries); otherwise as wg_m64n64k16. */
template <int TRANS>
static __device__ __forceinline__ void wg_m64n32k16(float d[4][4], const uint32_t a[4],
                                                    uint64_t desc, int scale_d)
{
#if defined(SPOTUNE_CUDA_EMU)
    emu_wgmma_bf16(&d[0][0], 32, a, desc, TRANS, scale_d);
#elif WG_DEVICE
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, "
        "%8, %9, %10, %11, %12, %13, %14, %15"
        "}, {%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TRANS));
#else
    (void)d, (void)a, (void)desc, (void)scale_d;
    __trap();
#endif
}

/* d[64 x 64] = (scale_d ? d : 0) + A B, A this warp's fragment (rows 16w..),
 * B 16 x 64 at desc (TRANS: MN-major). Issued, not complete: wg_commit,
 * wg_wait, wg_hold before d is read. */
template <int TRANS>
static __device__ __forceinline__ void wg_m64n64k16(float d[8][4], const uint32_t a[4],
                                                    uint64_t desc, int scale_d)
{
#if defined(SPOTUNE_CUDA_EMU)
    emu_wgmma_bf16(&d[0][0], 64, a, desc, TRANS, scale_d);
#elif WG_DEVICE
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, "
        "%8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, "
        "%24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TRANS));
#else
    (void)d, (void)a, (void)desc, (void)scale_d;
    __trap(); /* never launched: the host checks for the sm_90a build and an sm_90 GPU */
#endif
}

/* The same for N = 128 (O += P V at head dim 128). */
template <int TRANS>
static __device__ __forceinline__ void wg_m64n128k16(float d[16][4], const uint32_t a[4],
                                                     uint64_t desc, int scale_d)
{
#if defined(SPOTUNE_CUDA_EMU)
    emu_wgmma_bf16(&d[0][0], 128, a, desc, TRANS, scale_d);
#elif WG_DEVICE
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, "
        "%8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, "
        "%24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, "
        "%56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
          "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
          "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
          "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TRANS));
#else
    (void)d, (void)a, (void)desc, (void)scale_d;
    __trap();
#endif
}

#endif
