/* kernels/cuda/cuda_flash_wgmma.cu — the launches of the fused attention's
 * wgmma kernels, the forward, dK/dV and dQ from the stored dS
 * (cuda_flash_wgmma.cuh), and the
 * probe of their descriptors, compiled for sm_90a alone
 * (kernels/cuda/CMakeLists.txt): wgmma exists there only, and sm_90a code
 * runs on compute capability 9.0 alone. cuda_flash.cu decides when. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "cuda_flash_wgmma.cuh"

/* ---- host ------------------------------------------------------------------------- */

/* Whether this build's wgmma kernels run on the backend's GPU: compute
 * capability 9.0 exactly (sm_90a code runs nowhere else), the kernel's
 * image loads, and each kernel's limit on dynamic shared memory could be
 * raised to what it takes. Asked once a process. */
extern "C" int cuda_flash_wgmma_usable(backend_t *be)
{
    static int known = -1;
    if (known >= 0)
        return known;
#if defined(SPOTUNE_CUDA_EMU)
    (void)be;
    known = 1;
#else
    int major = 0, minor = 0;
    cudaFuncAttributes fa;
    memset(&fa, 0, sizeof fa);
    known = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                   CUDA_IMPL(be)->device) == cudaSuccess &&
            cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor,
                                   CUDA_IMPL(be)->device) == cudaSuccess &&
            major == 9 && minor == 0 &&
            cudaFuncGetAttributes(&fa, flash_forward_wgmma_kernel<64>) == cudaSuccess;
    (void)cudaGetLastError(); /* not sticky: the mma.sync forward runs */
#endif
    /* the kernels' limits on dynamic shared memory, raised where they need
     * more than the 48 KiB a launch gets unasked (the forward's and dQ's
     * two buffers at head dim 128); where that fails, the mma.sync ones */
    typedef void (*kernel_fn)(flash_args);
    const struct {
        kernel_fn k;
        size_t smem;
    } lim[6] = {{flash_forward_wgmma_kernel<64>, fa_wgmma_smem(64)},
                {flash_forward_wgmma_kernel<128>, fa_wgmma_smem(128)},
                {flash_dkdv_wgmma_kernel<64>, fa_dkdv_wgmma_smem(64)},
                {flash_dkdv_wgmma_kernel<128>, fa_dkdv_wgmma_smem(128)},
                {flash_dq_stored_wgmma_kernel<64>, fa_dq_wgmma_smem(64)},
                {flash_dq_stored_wgmma_kernel<128>, fa_dq_wgmma_smem(128)}};
    for (int i = 0; i < 6 && known; i++)
        if (cudaFuncSetAttribute(lim[i].k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)lim[i].smem) != cudaSuccess) {
            (void)cudaGetLastError();
            known = 0;
        }
    return known;
}

/* Launches wgmma kernel `which` (FA_WG_FORWARD, FA_WG_DKDV, FA_WG_DQ: the
 * forward, dK/dV, dQ from the stored dS) on grid gx x gy with the
 * arguments a, as cuda_flash.cu launches their mma.sync twins; nonzero on
 * a failed launch. */
extern "C" int cuda_flash_wgmma_launch(backend_t *be, const flash_args *a, int which, unsigned gx,
                                       unsigned gy, int hd)
{
    typedef void (*kernel_fn)(flash_args);
    static const kernel_fn k64[3] = {flash_forward_wgmma_kernel<64>, flash_dkdv_wgmma_kernel<64>,
                                     flash_dq_stored_wgmma_kernel<64>};
    static const kernel_fn k128[3] = {flash_forward_wgmma_kernel<128>,
                                      flash_dkdv_wgmma_kernel<128>,
                                      flash_dq_stored_wgmma_kernel<128>};
    size_t smem = which == FA_WG_FORWARD ? fa_wgmma_smem(hd)
                  : which == FA_WG_DKDV  ? fa_dkdv_wgmma_smem(hd)
                                         : fa_dq_wgmma_smem(hd);
    LAUNCH((hd == 64 ? k64 : k128)[which], dim3(gx, gy), FA_THREADS, smem,
           CUDA_IMPL(be)->stream)(*a);
    return LAUNCHED(be, "a flash_*_wgmma_kernel");
}

/* The probe of the descriptors (wgmma_probe_kernel): ok[v] = 1 when
 * variant v's product is A B exactly. 0, or 1 where the wgmma kernels
 * cannot run (not compute capability 9.0), or -1 on a CUDA error (the
 * backend's sticky error set). For the tests, which name the variants
 * that matched when the kernels' do not. */
extern "C" int cuda_wgmma_probe(backend_t *be, int ok[WG_PROBE_VARIANTS])
{
    if (!cuda_flash_wgmma_usable(be))
        return 1;
    size_t n = (size_t)WG_PROBE_VARIANTS * 64 * 64;
    float *dev = NULL, *host = (float *)malloc(sizeof(float) * n);
    if (!host)
        return -1;
    int rc = -1;
    if (!CUDA_OK(be, cudaMalloc((void **)&dev, sizeof(float) * n))) {
        LAUNCH(wgmma_probe_kernel, 1, FA_THREADS, WG_PROBE_SMEM, 0)(dev);
        if (!LAUNCHED(be, "wgmma_probe_kernel") &&
            !CUDA_OK(be, cudaMemcpy(host, dev, sizeof(float) * n, cudaMemcpyDeviceToHost))) {
            for (int v = 0; v < WG_PROBE_VARIANTS; v++) {
                ok[v] = 1;
                for (int r = 0; r < 64 && ok[v]; r++)
                    for (int c = 0; c < 64; c++) {
                        float want = 0.0f;
                        for (int k = 0; k < 16; k++)
                            want += probe_a(r, k) * probe_b(k, c);
                        if (host[(size_t)v * 4096 + (size_t)r * 64 + c] != want) {
                            ok[v] = 0;
                            break;
                        }
                    }
            }
            rc = 0;
        }
        CUDA_OK(be, cudaFree(dev));
    }
    free(host);
    return rc;
}
