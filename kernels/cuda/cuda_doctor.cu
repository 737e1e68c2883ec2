/* The GPU measurements of `spotune doctor` (cuda_doctor.h). */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>
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

extern "C" int cuda_doctor_gemm(int dev, int n, int iters, double *tflops, char *why, size_t wn)
{
    int rc = -1;
    void *a = NULL, *b = NULL, *c = NULL;
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
    rc = 0;
out:
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

extern "C" int cuda_doctor_p2p(int a, int b, int *can, double *gbps, char *why, size_t wn)
{
    int rc = -1;
    void *pa = NULL, *pb = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    size_t bytes = (size_t)256 << 20;
    int iters = 10;
    float ms = 0;
    *can = 0;
    *gbps = 0;
    TRY(cudaDeviceCanAccessPeer(can, a, b));
    TRY(cudaSetDevice(b));
    TRY(cudaMalloc(&pb, bytes));
    TRY(cudaSetDevice(a));
    TRY(cudaMalloc(&pa, bytes));
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
