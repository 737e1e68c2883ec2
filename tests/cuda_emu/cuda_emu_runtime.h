/* tests/cuda_emu/cuda_emu_runtime.h — the host side of the emulated device:
 * the part of the CUDA runtime (and the cuBLAS handles) that the CUDA
 * backend's host code calls (kernels/cuda/cuda_backend.cu and the launchers
 * of the other .cu files), on host memory (emu_runtime.cc). C++ only: the
 * backend's .cu files are compiled as C++ with SPOTUNE_CUDA_EMU
 * (cuda_internal.h includes this instead of the CUDA headers).
 *
 * Work runs at once, in the order it is issued, whatever the stream; a
 * stream being captured (cudaStreamBeginCapture) records it instead, and
 * a graph launch runs the record in order. In the capture mode the backend
 * uses (thread-local) the calls a capture cannot hold fail as the runtime
 * documents and invalidate the capture: cudaMalloc, cudaMemcpy,
 * cudaStreamSynchronize on the captured stream. Events record the host
 * clock. One device, compute capability 9.0, 64 GiB. */
#ifndef SPOTUNE_CUDA_EMU_RUNTIME_H
#define SPOTUNE_CUDA_EMU_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#include <functional>

#include "cuda_emu.h"

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidDevice = 101,
    cudaErrorNotReady = 600,
    cudaErrorLaunchFailure = 719,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorStreamCaptureUnmatched = 904,
    cudaErrorNotSupported = 801,
    cudaErrorPeerAccessAlreadyEnabled = 704,
} cudaError_t;

typedef struct emu_stream *cudaStream_t;
typedef struct emu_event *cudaEvent_t;
typedef struct emu_graph *cudaGraph_t;
typedef struct emu_graph *cudaGraphExec_t;

typedef enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
} cudaMemcpyKind;

typedef enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2,
} cudaStreamCaptureMode;

typedef enum cudaDeviceAttr {
    cudaDevAttrComputeMode = 20,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
} cudaDeviceAttr;

enum { cudaComputeModeDefault = 0, cudaComputeModeProhibited = 2 };
enum { cudaStreamNonBlocking = 1, cudaEventDisableTiming = 2, cudaHostAllocDefault = 0 };

typedef struct cudaUUID_st {
    char bytes[16];
} cudaUUID_t;

typedef struct cudaDeviceProp {
    char name[256];
    cudaUUID_t uuid;
    size_t totalGlobalMem;
    int major, minor, multiProcessorCount;
} cudaDeviceProp;

typedef struct cudaFuncAttributes {
    int ptxVersion, binaryVersion;
} cudaFuncAttributes;

/* the cuBLAS handles the backend creates (the products themselves are
 * emu_matmul.cc's) */
typedef enum cublasStatus_t {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
} cublasStatus_t;
typedef struct emu_blas *cublasHandle_t;
typedef struct emu_blas *cublasLtHandle_t;

const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int d);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d);
cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b);
cudaError_t cudaDeviceSynchronize(void);

cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t bytes);
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemset(void *p, int v, size_t bytes);
cudaError_t cudaMemsetAsync(void *p, int v, size_t bytes, cudaStream_t s);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind k);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind k,
                            cudaStream_t s);
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind k, cudaStream_t s);

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamQuery(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b);

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode m);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *x, cudaGraph_t g, unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t x, cudaStream_t s);
cudaError_t cudaGraphDestroy(cudaGraph_t g);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t x);

cublasStatus_t cublasCreate(cublasHandle_t *h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
cublasStatus_t cublasLtCreate(cublasLtHandle_t *h);
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h);
const char *cublasGetStatusString(cublasStatus_t s);

/* Runs fn on stream s now, or records it while s is being captured. */
void emu_enqueue(cudaStream_t s, std::function<void()> fn);

/* A kernel's attributes: every kernel is "built" for compute capability 9.0. */
template <typename T> static inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *a, T)
{
    a->ptxVersion = a->binaryVersion = 90;
    return cudaSuccess;
}

/* ---- launches ---------------------------------------------------------------------- */

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

/* A launch failed (a deadlock in a block, a bad shape): cudaGetLastError
 * reports it next. */
void emu_launch_failed(void);

/* LAUNCH(kernel, grid, block, smem, stream)(args) (cuda_device.h): the
 * arguments are copied, as a launch does, and the grid runs on the emulated
 * device when the stream's work comes to it. */
template <typename... P> struct emu_call {
    void (*k)(P...);
    dim3 g, b;
    size_t smem;
    cudaStream_t st;
    template <typename... A> void operator()(A... a) const
    {
        void (*kern)(P...) = k;
        emu_dim3 grid = {g.x, g.y, g.z}, block = {b.x, b.y, b.z};
        size_t bytes = smem;
        emu_enqueue(st, [=]() {
            auto run = [&]() { kern(a...); };
            if (emu_launch_smem(grid, block, bytes, &emu_call::template tramp<decltype(run)>,
                                &run))
                emu_launch_failed();
        });
    }
    template <typename F> static void tramp(void *f)
    {
        (*(F *)f)();
    }
};

template <typename... P>
static inline emu_call<P...> emu_launcher(void (*k)(P...), dim3 g, dim3 b, size_t smem = 0,
                                          cudaStream_t st = 0)
{
    emu_call<P...> c = {k, g, b, smem, st};
    return c;
}

#endif
