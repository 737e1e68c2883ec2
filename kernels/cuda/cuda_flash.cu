/* kernels/cuda/cuda_flash.cu — fused causal grouped-query attention
 * (FlashAttention-2) for BF16 and head dims 64 and 128: when it applies
 * (cuda_flash_handles) and its launches. The kernels and the algorithm:
 * cuda_flash_kernels.cuh (forward) and cuda_flash_backward.cuh. */
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "cuda_flash_backward.cuh" /* and cuda_flash_kernels.cuh */

/* ---- host ------------------------------------------------------------------------- */

static int aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

/* 1 when SPOTUNE_CUDA_ATTENTION asks for the unfused path. */
static int unfused_requested(void)
{
    const char *e = getenv("SPOTUNE_CUDA_ATTENTION");
    return e && strcmp(e, "unfused") == 0;
}

/* How the fused backward makes dQ (SPOTUNE_CUDA_ATTENTION, read on every
 * call): from the dS the dK/dV kernel stores, or recomputing S and dP. */
typedef enum { DQ_AUTO, DQ_STORED, DQ_RECOMPUTE } dq_mode;

static dq_mode dq_requested(void)
{
    const char *e = getenv("SPOTUNE_CUDA_ATTENTION");
    if (e && strcmp(e, "fused-stored") == 0)
        return DQ_STORED;
    if (e && strcmp(e, "fused-recompute") == 0)
        return DQ_RECOMPUTE;
    return DQ_AUTO;
}

/* Whether a multiprocessor of this GPU holds `blocks` blocks of `bytes` of
 * dynamic shared memory each, with the 1 KiB a block the runtime keeps:
 * H100 and H200 have 228 KiB, A100 164, sm_86 and sm_89 100. */
static int smem_holds(backend_t *be, int blocks, size_t bytes)
{
    int per_sm = 0;
    if (cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                               CUDA_IMPL(be)->device) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return (size_t)per_sm >= (size_t)blocks * (bytes + 1024);
}

/* Whether the mma.sync forward (*fwd) and dK/dV (*dkdv) kernels at head
 * dim hd read the operands they reuse (the forward's Q rows, dK/dV's K and
 * V rows) from shared memory as each product needs them: at head dim 128,
 * where held in registers (64 a thread) they left the compiler too few and
 * it spilled inside the loops; where a multiprocessor still holds as many
 * blocks with them (three forward blocks of 52 KiB, two dK/dV blocks of 70:
 * an sm_86 or sm_89 GPU's 100 KiB would hold one, and keeps the
 * registers); unless SPOTUNE_CUDA_ATTENTION=fused-regs asks for the
 * registers, as before 2026-12-06 (for comparison). At head dim 64 they
 * stay in registers (32 a thread, no spill): K and V staged there ran 3%
 * slower on an H200 (docs/perf.md, 2026-12-04). */
extern "C" void cuda_flash_operands_staged(backend_t *be, int hd, int *fwd, int *dkdv)
{
    const char *e = getenv("SPOTUNE_CUDA_ATTENTION");
    int on = hd == 128 && !(e && strcmp(e, "fused-regs") == 0);
    *fwd = on && smem_holds(be, FA_FWD_MIN_BLOCKS, fa_forward_smem(128, 1));
    *dkdv = on && smem_holds(be, 2, fa_dkdv_smem(128, 1));
}

typedef void (*flash_fn)(flash_args);

/* Of a kernel's four variants (head dim 64 or 128, operands in registers
 * or staged: k64_0, k64_1, k128_0, k128_1) the one to launch, each
 * variant's dynamic shared-memory limit raised to what smem(hd, staged)
 * says it takes, once a process (*raised): past the 48 KiB a launch gets
 * unasked. A failure shows at the launch. */
static flash_fn flash_variant(flash_fn k64_0, flash_fn k64_1, flash_fn k128_0, flash_fn k128_1,
                              size_t (*smem)(int, int), int hd, int staged, int *raised)
{
    flash_fn ks[4] = {k64_0, k64_1, k128_0, k128_1};
    if (!*raised) {
        *raised = 1;
        for (int i = 0; i < 4; i++)
            if (cudaFuncSetAttribute(ks[i], cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)smem(i < 2 ? 64 : 128, i & 1)) != cudaSuccess)
                (void)cudaGetLastError();
    }
    return ks[(hd == 64 ? 0 : 2) + (staged ? 1 : 0)];
}

/* flash_dq_stored_kernel's shared memory with two buffers or with one. */
static size_t dq_smem(int hd, int two)
{
    return fa_dq_stored_smem(hd, two ? 2 : 1);
}

/* Whether dQ from the stored dS copies the next tiles while it multiplies
 * these (two buffers): where a multiprocessor holds four blocks of them
 * (H100, H200: 228 KiB). With one (an A100's 164 KiB, or sm_86/89's 100)
 * it holds five or three blocks instead of three or one. */
extern "C" int cuda_flash_dq_double_buffered(backend_t *be, int hd)
{
    return smem_holds(be, 4, fa_dq_stored_smem(hd, 2));
}

/* Whether the forward, dK/dV and dQ from the stored dS run by warpgroup
 * products (cuda_flash_wgmma.cu): asked for (SPOTUNE_CUDA_ATTENTION=
 * fused-wgmma), in the build (the emulation has it too) and able to run
 * on this GPU; otherwise the mma.sync kernels. A dQ that recomputes (the
 * dS not stored) stays mma.sync. */
extern "C" int cuda_flash_wgmma_selected(backend_t *be)
{
    const char *e = getenv("SPOTUNE_CUDA_ATTENTION");
    if (!e || strcmp(e, "fused-wgmma") != 0)
        return 0;
#if defined(SPOTUNE_CUDA_SM90A) || defined(SPOTUNE_CUDA_EMU)
    return cuda_flash_wgmma_usable(be);
#else
    (void)be;
    return 0;
#endif
}

/* Floats of the backward's scratch before the stored dS: D [B, nh, T], then
 * with the split the dK and dV shares (each 256-byte aligned). */
static size_t scratch_floats(int B, int T, int nh, int hd, int split)
{
    size_t nrows = (size_t)B * T * nh;
    return fa_align64(nrows) + (split ? 2 * fa_align64(nrows * hd) : 0);
}

/* The bytes the split shares and one chunk's dS may take: FA_DS_BUDGET, or
 * SPOTUNE_CUDA_FLASH_DS_BUDGET (bytes; for the tests, which make several
 * chunks at small shapes). */
static size_t ds_budget(void)
{
    const char *e = getenv("SPOTUNE_CUDA_FLASH_DS_BUDGET");
    char *end = NULL;
    unsigned long long v = e && *e ? strtoull(e, &end, 10) : 0;
    return e && *e && end && *end == '\0' ? (size_t)v : FA_DS_BUDGET;
}

/* The stored-dS plan of this call, or chunks 0 for the recomputing dQ:
 * stored when it fits the budget beside the split shares and, unless
 * asked for, when it is one chunk or every chunk's dK/dV launch still has
 * four blocks a multiprocessor (chunks are launches one after another:
 * a small one leaves the GPU part idle at its end; seq 8192 at the 7B
 * shape makes eleven chunks of three heads, and recomputes). */
static fa_ds_plan ds_plan(backend_t *be, int B, int T, int nh, int nkv, int hd, int split)
{
    fa_ds_plan p;
    memset(&p, 0, sizeof p);
    dq_mode mode = dq_requested();
    if (mode == DQ_RECOMPUTE)
        return p;
    size_t shares = sizeof(float) * (scratch_floats(B, T, nh, hd, split) -
                                     scratch_floats(B, T, nh, hd, 0));
    size_t budget = ds_budget();
    if (shares >= budget)
        return p;
    p = fa_ds_chunks(B, T, nh, nkv, split, budget - shares);
    if (p.chunks > 1 && mode == DQ_AUTO) {
        int sms = 0;
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, CUDA_IMPL(be)->device) !=
            cudaSuccess) {
            (void)cudaGetLastError();
            sms = 0;
        }
        if (sms > 0 && (double)p.per_chunk * fa_key_blocks(T) < 4.0 * sms)
            p.chunks = 0;
    }
    return p;
}

/* Whether the kernels this process runs were compiled for sm_80 or later
 * (their code, or the PTX the driver compiles): a build for older
 * architectures only (CMAKE_CUDA_ARCHITECTURES=75, say) compiles the MMA
 * to a trap, and the unfused path must run instead. Asked once. */
static int built_with_mma(void)
{
    static int known = -1;
    if (known < 0) {
        cudaFuncAttributes fa;
        memset(&fa, 0, sizeof fa);
        if (cudaFuncGetAttributes(&fa, flash_forward_kernel<64, 1>) != cudaSuccess) {
            (void)cudaGetLastError(); /* not sticky: the unfused path runs */
            known = 0;
        } else {
            known = fa.ptxVersion >= 80; /* the virtual architecture: __CUDA_ARCH__ */
        }
    }
    return known;
}

extern "C" int cuda_flash_handles(backend_t *be, dtype_t dt, int B, int T, int nh, int nkv,
                                  int hd, const void *const *ptrs, int nptrs, const int *lds,
                                  int nlds)
{
    if (unfused_requested() || dt != DT_BF16 || (hd != 64 && hd != 128))
        return 0;
    if (fa_row_blocks(T) > 65535 || (size_t)B * nh > 0x7fffffffu) /* gridDim.y, .x */
        return 0;
    for (int i = 0; i < nptrs; i++)
        if (!aligned16(ptrs[i]))
            return 0;
    for (int i = 0; i < nlds; i++) /* 16-byte rows (the staged copies) */
        if (lds[i] % 8)
            return 0;
    int major = 0;
    if (CUDA_OK(be, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                           CUDA_IMPL(be)->device)))
        return 0;
    (void)nkv; /* any group size */
    return major >= 8 && built_with_mma();
}

/* The arguments of a call with row strides q_ld (q), kv_ld (k, v), dq_ld
 * and dkv_ld (their gradients); out and dout contiguous. */
static flash_args args_of(int B, int T, int nh, int nkv, int hd, tensor_t seg, int q_ld,
                          int kv_ld, int dq_ld, int dkv_ld)
{
    flash_args a;
    memset(&a, 0, sizeof a);
    a.seg = (const int *)seg.p;
    a.B = B;
    a.T = T;
    a.nh = nh;
    a.nkv = nkv;
    a.ldq = q_ld;
    a.ldk = kv_ld;
    a.ldo = nh * hd;
    a.lddq = dq_ld;
    a.lddk = dkv_ld;
    a.scale = 1.0f / sqrtf((float)hd);
    return a;
}

extern "C" void cuda_flash_forward(backend_t *be, tensor_t out, tensor_t lse, tensor_t q,
                                   tensor_t k, tensor_t v, tensor_t seg, int B, int T, int nh,
                                   int nkv, int hd, int q_ld, int kv_ld)
{
    flash_args a = args_of(B, T, nh, nkv, hd, seg, q_ld, kv_ld, nh * hd, nkv * hd);
    a.q = (const uint16_t *)q.p;
    a.k = (const uint16_t *)k.p;
    a.v = (const uint16_t *)v.p;
    a.out = (uint16_t *)out.p;
    a.lse = (float *)lse.p;
#if defined(SPOTUNE_CUDA_SM90A) || defined(SPOTUNE_CUDA_EMU)
    if (cuda_flash_wgmma_selected(be)) {
        cuda_flash_wgmma_launch(be, &a, FA_WG_FORWARD, (unsigned)(B * nh), fa_row_blocks(T), hd);
        return;
    }
#endif
    dim3 grid((unsigned)(B * nh), fa_row_blocks(T));
    cudaStream_t st = CUDA_IMPL(be)->stream;
    static int raised;
    int qs, kvs;
    cuda_flash_operands_staged(be, hd, &qs, &kvs);
    flash_fn fn = flash_variant(flash_forward_kernel<64, 0>, flash_forward_kernel<64, 1>,
                                flash_forward_kernel<128, 0>, flash_forward_kernel<128, 1>,
                                fa_forward_smem, hd, qs, &raised);
    LAUNCH(fn, grid, FA_THREADS, fa_forward_smem(hd, qs), st)(a);
    LAUNCHED(be, "flash_forward_kernel");
}

/* The dK/dV kernel on grid (its blocks from a->pair0); nonzero on a failed launch. */
static int launch_dkdv(backend_t *be, const flash_args *a, dim3 grid, int hd)
{
#if defined(SPOTUNE_CUDA_SM90A) || defined(SPOTUNE_CUDA_EMU)
    if (cuda_flash_wgmma_selected(be))
        return cuda_flash_wgmma_launch(be, a, FA_WG_DKDV, grid.x, grid.y, hd);
#endif
    cudaStream_t st = CUDA_IMPL(be)->stream;
    static int raised;
    int qs, kvs;
    cuda_flash_operands_staged(be, hd, &qs, &kvs);
    flash_fn fn = flash_variant(flash_dkdv_kernel<64, 0>, flash_dkdv_kernel<64, 1>,
                                flash_dkdv_kernel<128, 0>, flash_dkdv_kernel<128, 1>,
                                fa_dkdv_smem, hd, kvs, &raised);
    LAUNCH(fn, grid, FA_THREADS, fa_dkdv_smem(hd, kvs), st)(*a);
    return LAUNCHED(be, "flash_dkdv_kernel");
}

/* The dQ kernel on grid: from the stored dS, or recomputing. */
static int launch_dq(backend_t *be, const flash_args *a, dim3 grid, int hd, int stored)
{
    cudaStream_t st = CUDA_IMPL(be)->stream;
#if defined(SPOTUNE_CUDA_SM90A) || defined(SPOTUNE_CUDA_EMU)
    if (stored && cuda_flash_wgmma_selected(be))
        return cuda_flash_wgmma_launch(be, a, FA_WG_DQ, grid.x, grid.y, hd);
#endif
    if (stored) {
        /* two buffers where a multiprocessor holds four blocks of them */
        static int raised;
        int two = cuda_flash_dq_double_buffered(be, hd);
        flash_fn fn = flash_variant(flash_dq_stored_kernel<64, 1>, flash_dq_stored_kernel<64, 2>,
                                    flash_dq_stored_kernel<128, 1>,
                                    flash_dq_stored_kernel<128, 2>, dq_smem, hd, two, &raised);
        LAUNCH(fn, grid, FA_THREADS, dq_smem(hd, two), st)(*a);
        return LAUNCHED(be, "flash_dq_stored_kernel");
    }
    if (hd == 64)
        LAUNCH(flash_dq_kernel<64>, grid, FA_THREADS, 0, st)(*a);
    else
        LAUNCH(flash_dq_kernel<128>, grid, FA_THREADS, 0, st)(*a);
    return LAUNCHED(be, "flash_dq_kernel");
}

extern "C" void cuda_flash_backward(backend_t *be, tensor_t dq, tensor_t dk, tensor_t dv,
                                    tensor_t dout, tensor_t out, tensor_t lse, tensor_t q,
                                    tensor_t k, tensor_t v, tensor_t seg, int B, int T, int nh,
                                    int nkv, int hd, int q_ld, int kv_ld, int dq_ld, int dkv_ld)
{
    size_t nrows = (size_t)B * T * nh, nshare = nrows * hd;
    int split = fa_dkdv_split(B, T, nh, nkv, hd);
    fa_ds_plan dp = ds_plan(be, B, T, nh, nkv, hd, split);
    size_t nf = scratch_floats(B, T, nh, hd, split);
    float *D = (float *)cuda_scratch(be, sizeof(float) * nf + dp.bytes);
    if (!D)
        return;
    flash_args a = args_of(B, T, nh, nkv, hd, seg, q_ld, kv_ld, dq_ld, dkv_ld);
    a.q = (const uint16_t *)q.p;
    a.k = (const uint16_t *)k.p;
    a.v = (const uint16_t *)v.p;
    a.o = (const uint16_t *)out.p;
    a.dout = (const uint16_t *)dout.p;
    a.dq = (uint16_t *)dq.p;
    a.dk = (uint16_t *)dk.p;
    a.dv = (uint16_t *)dv.p;
    a.lse = (float *)lse.p;
    a.D = D;
    if (split) {
        a.dk_part = D + fa_align64(nrows);
        a.dv_part = a.dk_part + fa_align64(nshare);
    }
    cudaStream_t st = CUDA_IMPL(be)->stream;
    LAUNCH(flash_rowdot_kernel, fa_rowdot_blocks(nrows), FA_ROWDOT_THREADS, 0, st)(a, hd);
    if (LAUNCHED(be, "flash_rowdot_kernel"))
        return;
    /* dK/dV storing dS, then dQ from it, chunk by chunk; or dK/dV in one
     * chunk of every pair and dQ recomputing after it */
    int stored = dp.chunks > 0;
    if (stored) {
        a.ds = (uint16_t *)(D + nf);
    } else {
        dp.unit = split ? 1 : nh / nkv;
        dp.units = B * nh / dp.unit;
        dp.per_chunk = dp.units;
        dp.chunks = 1;
    }
    for (int c = 0; c < dp.chunks; c++) {
        int u0 = c * dp.per_chunk, left = dp.units - u0;
        int nu = left < dp.per_chunk ? left : dp.per_chunk;
        a.pair0 = u0 * dp.unit;
        if (launch_dkdv(be, &a, dim3((unsigned)nu, fa_key_blocks(T)), hd) ||
            (stored && launch_dq(be, &a, dim3((unsigned)(nu * dp.unit), fa_row_blocks(T)), hd, 1)))
            return;
    }
    if (split) {
        LAUNCH(flash_dkdv_reduce_kernel, fa_reduce_blocks((size_t)B * T * nkv * hd),
               FA_REDUCE_THREADS, 0, st)(a, hd);
        if (LAUNCHED(be, "flash_dkdv_reduce_kernel"))
            return;
    }
    if (!stored) {
        a.pair0 = 0;
        launch_dq(be, &a, dim3((unsigned)(B * nh), fa_row_blocks(T)), hd, 0);
    }
}
