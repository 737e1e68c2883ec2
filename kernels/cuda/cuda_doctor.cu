/* The GPU measurements of `spotune doctor` (cuda_doctor.h). Each also
 * checks what it computed or copied, so a GPU that runs fast but returns
 * wrong results fails instead of passing. */
#ifdef SPOTUNE_CUDA_EMU /* the emulated device (tests/cuda_emu) */
#include "cuda_emu_runtime.h"
#else
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_doctor.h"

#define TRY(call)                                                                              \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            if (why && wn)                                                                     \
                snprintf(why, wn, "%s: %s (%s)", #call, cudaGetErrorString(e_),                \
                         cudaGetErrorName(e_));                                                \
            cudaGetLastError();                                                                \
            goto out;                                                                          \
        }                                                                                      \
    } while (0)

extern "C" int cuda_doctor_info(int dev, cuda_doctor_dev *out, char *why, size_t wn)
{
    int rc = -1;
    cudaDeviceProp p;
    memset(out, 0, sizeof *out);
    TRY(cudaGetDeviceProperties(&p, dev));
    snprintf(out->name, sizeof out->name, "%.127s", p.name);
    out->mem_total = p.totalGlobalMem;
    out->cc_major = p.major;
    out->cc_minor = p.minor;
    out->sm_count = p.multiProcessorCount;
    out->ecc_enabled = p.ECCEnabled;
    memcpy(out->uuid, p.uuid.bytes, sizeof out->uuid);
    snprintf(out->pci, sizeof out->pci, "%04x:%02x:%02x", p.pciDomainID, p.pciBusID,
             p.pciDeviceID);
    TRY(cudaDriverGetVersion(&out->driver_version));
    TRY(cudaRuntimeGetVersion(&out->runtime_version));
    TRY(cudaSetDevice(dev));
    {
        size_t fr = 0, tot = 0;
        TRY(cudaMemGetInfo(&fr, &tot));
        out->mem_free = fr;
    }
    rc = 0;
out:
    return rc;
}

static float bf16_value(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Whether n x n bf16 results c all equal n v^2 (v: A's and B's every
 * element) within 1% (bf16 keeps 8 bits: 0.4%); else -1 with why naming
 * the first wrong one and how many. */
static int gemm_results_right(const uint16_t *c, int n, uint16_t v_bits, char *why, size_t wn)
{
    double v = bf16_value(v_bits), want = (double)n * v * v;
    size_t total = (size_t)n * n, bad = 0, first = 0;
    for (size_t i = 0; i < total; i++) {
        double got = bf16_value(c[i]);
        if (!(fabs(got - want) <= 0.01 * want) && bad++ == 0)
            first = i;
    }
    if (!bad)
        return 0;
    if (why && wn)
        snprintf(why, wn,
                 "cublasGemmEx (bf16, %d x %d): %zu of %zu results wrong (C[%zu,%zu] = %.6g, "
                 "expected %.6g within 1%%): this GPU computes wrong results; ask for another "
                 "machine",
                 n, n, bad, total, first % (size_t)n, first / (size_t)n,
                 (double)bf16_value(c[first]), want);
    return -1;
}

/* Whether the first and the last MiB (at most) of dev's bytes all are want;
 * else -1 with why naming what (what) and the first wrong byte. */
static int bytes_right(const void *dev, size_t bytes, unsigned char want, const char *what,
                       char *why, size_t wn)
{
    size_t span = bytes < ((size_t)1 << 20) ? bytes : (size_t)1 << 20;
    unsigned char *h = (unsigned char *)malloc(span ? span : 1);
    int rc = -1;
    if (!h) {
        if (why && wn)
            snprintf(why, wn, "%s: no host memory to check the copy", what);
        return -1;
    }
    for (int part = 0; part < 2; part++) {
        size_t off = part ? bytes - span : 0;
        cudaError_t e = cudaMemcpy(h, (const unsigned char *)dev + off, span,
                                   cudaMemcpyDeviceToHost);
        if (e != cudaSuccess) {
            if (why && wn)
                snprintf(why, wn, "%s: reading the copy back: %s (%s)", what,
                         cudaGetErrorString(e), cudaGetErrorName(e));
            cudaGetLastError();
            goto out;
        }
        for (size_t i = 0; i < span; i++)
            if (h[i] != want) {
                if (why && wn)
                    snprintf(why, wn,
                             "%s: byte %zu of the destination is 0x%02x, expected 0x%02x: the "
                             "copy did not arrive intact; ask for another machine",
                             what, off + i, h[i], want);
                goto out;
            }
    }
    rc = 0;
out:
    free(h);
    return rc;
}

extern "C" int cuda_doctor_gemm(int dev, int n, int iters, double *tflops, char *why, size_t wn)
{
    int rc = -1;
    void *a = NULL, *b = NULL, *c = NULL;
    uint16_t *hc = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    cublasHandle_t h = NULL;
    size_t bytes = (size_t)n * n * 2;
    float alpha = 1.0f, beta = 0.0f, ms = 0;
    TRY(cudaSetDevice(dev));
    TRY(cudaMalloc(&a, bytes));
    TRY(cudaMalloc(&b, bytes));
    TRY(cudaMalloc(&c, bytes));
    TRY(cudaMemset(a, 0x3c, bytes)); /* bf16 0x3c3c: about 0.0115, finite */
    TRY(cudaMemset(b, 0x3c, bytes));
    TRY(cudaEventCreate(&e0));
    TRY(cudaEventCreate(&e1));
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
        if (why && wn)
            snprintf(why, wn, "cublasCreate failed");
        goto out;
    }
    for (int i = -3; i < iters; i++) { /* i < 0: the warm-up (clocks ramp up) */
        if (i == 0)
            TRY(cudaEventRecord(e0));
        cublasStatus_t s = cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a,
                                        CUDA_R_16BF, n, b, CUDA_R_16BF, n, &beta, c, CUDA_R_16BF,
                                        n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (s != CUBLAS_STATUS_SUCCESS) {
            if (why && wn)
                snprintf(why, wn, "cublasGemmEx (bf16, %d x %d): status %d", n, n, (int)s);
            goto out;
        }
    }
    TRY(cudaEventRecord(e1));
    TRY(cudaEventSynchronize(e1));
    TRY(cudaEventElapsedTime(&ms, e0, e1));
    *tflops = 2.0 * n * (double)n * n * iters / (ms / 1e3) / 1e12;
    /* every result: n x 0x3c3c^2 */
    if (!(hc = (uint16_t *)malloc(bytes))) {
        if (why && wn)
            snprintf(why, wn, "no host memory to check the GEMM's %zu bytes", bytes);
        goto out;
    }
    TRY(cudaMemcpy(hc, c, bytes, cudaMemcpyDeviceToHost));
    if (gemm_results_right(hc, n, 0x3c3c, why, wn) != 0)
        goto out;
    rc = 0;
out:
    free(hc);
    if (h)
        cublasDestroy(h);
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    return rc;
}

extern "C" int cuda_doctor_copy(int dev, size_t bytes, int iters, double *gbps, char *why,
                                size_t wn)
{
    int rc = -1;
    void *a = NULL, *b = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    float ms = 0;
    TRY(cudaSetDevice(dev));
    TRY(cudaMalloc(&a, bytes));
    TRY(cudaMalloc(&b, bytes));
    TRY(cudaMemset(a, 1, bytes));
    TRY(cudaMemset(b, 0, bytes));
    TRY(cudaEventCreate(&e0));
    TRY(cudaEventCreate(&e1));
    TRY(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice)); /* warm-up */
    TRY(cudaEventRecord(e0));
    for (int i = 0; i < iters; i++)
        TRY(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
    TRY(cudaEventRecord(e1));
    TRY(cudaEventSynchronize(e1));
    TRY(cudaEventElapsedTime(&ms, e0, e1));
    *gbps = 2.0 * (double)bytes * iters / (ms / 1e3) / 1e9; /* read + write */
    if (bytes_right(b, bytes, 1, "cudaMemcpy device to device", why, wn) != 0)
        goto out;
    rc = 0;
out:
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    return rc;
}

extern "C" int cuda_doctor_p2p(int a, int b, size_t bytes, int *can, double *gbps, char *why,
                               size_t wn)
{
    int rc = -1;
    void *pa = NULL, *pb = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    int iters = 10;
    float ms = 0;
    *can = 0;
    *gbps = 0;
    TRY(cudaDeviceCanAccessPeer(can, a, b));
    TRY(cudaSetDevice(b));
    TRY(cudaMalloc(&pb, bytes));
    TRY(cudaMemset(pb, 0, bytes));
    TRY(cudaSetDevice(a));
    TRY(cudaMalloc(&pa, bytes));
    TRY(cudaMemset(pa, 2, bytes));
    if (*can) {
        cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled)
            cudaGetLastError();
        else
            TRY(e);
    }
    TRY(cudaEventCreate(&e0));
    TRY(cudaEventCreate(&e1));
    TRY(cudaMemcpyPeer(pb, b, pa, a, bytes)); /* warm-up */
    TRY(cudaEventRecord(e0));
    for (int i = 0; i < iters; i++)
        TRY(cudaMemcpyPeerAsync(pb, b, pa, a, bytes, 0));
    TRY(cudaEventRecord(e1));
    TRY(cudaEventSynchronize(e1));
    TRY(cudaEventElapsedTime(&ms, e0, e1));
    *gbps = (double)bytes * iters / (ms / 1e3) / 1e9;
    if (bytes_right(pb, bytes, 2, "cudaMemcpyPeer", why, wn) != 0)
        goto out;
    rc = 0;
out:
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    cudaSetDevice(a);
    cudaFree(pa);
    cudaSetDevice(b);
    cudaFree(pb);
    return rc;
}

extern "C" int cuda_doctor_alloc(int dev, size_t bytes, void **p, char *why, size_t wn)
{
    *p = NULL;
    TRY(cudaSetDevice(dev));
    TRY(cudaMalloc(p, bytes));
    TRY(cudaMemset(*p, 0, bytes));
    return 0;
out:
    return -1;
}

extern "C" void cuda_doctor_free(void *p)
{
    cudaFree(p);
}

extern "C" int cuda_doctor_sync(int dev, char *why, size_t wn)
{
    TRY(cudaSetDevice(dev));
    TRY(cudaDeviceSynchronize());
    return 0;
out:
    return -1;
}
