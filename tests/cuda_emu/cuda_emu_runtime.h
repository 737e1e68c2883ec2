/* tests/cuda_emu/cuda_emu_runtime.h — the host side of the emulated device:
 * the part of the CUDA runtime that the CUDA backend's host code calls
 * (kernels/cuda/cuda_backend.cu, the launchers of the other .cu files and
 * the doctor's measurements, cuda_doctor.cu),
 * on host memory (emu_runtime.cc), and of cuBLAS and cuBLASLt
 * (emu_cublas.cc). C++ only: the
 * backend's .cu files are compiled as C++ with SPOTUNE_CUDA_EMU
 * (cuda_internal.h includes this instead of the CUDA headers).
 *
 * Work runs at once, in the order it is issued, whatever the stream; a
 * stream being captured (cudaStreamBeginCapture) records it instead, and
 * a graph launch runs the record in order. In the capture mode the backend
 * uses (thread-local) the calls a capture cannot hold fail as the runtime
 * documents and invalidate the capture: cudaMalloc, cudaMemcpy,
 * cudaStreamSynchronize on the captured stream. Events record the host
 * clock. One device (SPOTUNE_CUDA_EMU_DEVICES: up to 8, each a peer of the
 * others), compute capability 9.0, 64 GiB; driver and runtime CUDA 13.0
 * (SPOTUNE_CUDA_EMU_DRIVER_VERSION: the driver's, 1000 * major + 10 * minor,
 * to show an old driver). Faults on demand, for the doctor's checks:
 * SPOTUNE_CUDA_EMU_COPY=corrupt (device-to-device copies, emu_runtime.cc)
 * and SPOTUNE_CUDA_EMU_CUBLAS=corrupt (products, emu_cublas.cc). */
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
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrComputeMode = 20,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
    cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81,
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
    int ECCEnabled, pciDomainID, pciBusID, pciDeviceID;
} cudaDeviceProp;

typedef struct cudaFuncAttributes {
    int ptxVersion, binaryVersion;
} cudaFuncAttributes;

/* cuBLAS and cuBLASLt, the part kernels/cuda/cuda_matmul.cu calls
 * (emu_cublas.cc): the names and values of the real headers (cublas_api.h,
 * cublasLt.h, library_types.h), the objects opaque. */
typedef enum cublasStatus_t {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_INTERNAL_ERROR = 14,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
} cublasStatus_t;
typedef struct emu_blas *cublasHandle_t;
typedef struct emu_blas *cublasLtHandle_t;
typedef enum cudaDataType_t { CUDA_R_32F = 0, CUDA_R_16BF = 14 } cudaDataType_t;
typedef enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum cublasComputeType_t { CUBLAS_COMPUTE_32F = 68 } cublasComputeType_t;
typedef enum cublasGemmAlgo_t { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;
typedef enum cublasLtMatmulDescAttributes_t {
    CUBLASLT_MATMUL_DESC_TRANSA = 3, /* int32_t */
    CUBLASLT_MATMUL_DESC_TRANSB = 4, /* int32_t */
} cublasLtMatmulDescAttributes_t;
typedef enum cublasLtMatrixLayoutAttribute_t {
    CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5,          /* int32_t */
    CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6, /* int64_t */
} cublasLtMatrixLayoutAttribute_t;
typedef enum cublasLtMatmulPreferenceAttributes_t {
    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,  /* uint64_t */
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5, /* uint32_t, each */
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8,
} cublasLtMatmulPreferenceAttributes_t;
typedef struct emu_lt_desc *cublasLtMatmulDesc_t;
typedef struct emu_lt_layout *cublasLtMatrixLayout_t;
typedef struct emu_lt_pref *cublasLtMatmulPreference_t;
typedef struct {
    uint64_t data[8];
} cublasLtMatmulAlgo_t;
typedef struct {
    cublasLtMatmulAlgo_t algo;
    size_t workspaceSize;
    cublasStatus_t state;
    float wavesCount;
    int reserved[4];
} cublasLtMatmulHeuristicResult_t;

const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int d);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d);
cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaDriverGetVersion(int *v);
cudaError_t cudaRuntimeGetVersion(int *v);
cudaError_t cudaDeviceCanAccessPeer(int *can, int dev, int peer);
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags);

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
cudaError_t cudaMemcpyPeer(void *dst, int dst_dev, const void *src, int src_dev, size_t bytes);
cudaError_t cudaMemcpyPeerAsync(void *dst, int dst_dev, const void *src, int src_dev,
                                size_t bytes, cudaStream_t s);
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
/* stream 0 by default, as the runtime's */
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = 0);
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
cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void *ws, size_t bytes);
const char *cublasGetStatusString(cublasStatus_t s);
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t transa,
                                          cublasOperation_t transb, int m, int n, int k,
                                          const void *alpha, const void *A, cudaDataType_t Atype,
                                          int lda, long long strideA, const void *B,
                                          cudaDataType_t Btype, int ldb, long long strideB,
                                          const void *beta, void *C, cudaDataType_t Ctype, int ldc,
                                          long long strideC, int batchCount,
                                          cublasComputeType_t computeType, cublasGemmAlgo_t algo);
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t transa, cublasOperation_t transb,
                            int m, int n, int k, const void *alpha, const void *A,
                            cudaDataType_t Atype, int lda, const void *B, cudaDataType_t Btype,
                            int ldb, const void *beta, void *C, cudaDataType_t Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo);
cublasStatus_t cublasLtCreate(cublasLtHandle_t *h);
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h);
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute,
                                        cudaDataType_t scale);
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d);
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t a, const void *buf,
                                              size_t bytes);
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType_t type,
                                          uint64_t rows, uint64_t cols, int64_t ld);
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l);
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l,
                                                cublasLtMatrixLayoutAttribute_t a,
                                                const void *buf, size_t bytes);
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p);
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p);
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t a,
                                                    const void *buf, size_t bytes);
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t op,
                                              cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t B,
                                              cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t *res, int *found);
cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t op, const void *alpha,
                              const void *A, cublasLtMatrixLayout_t Adesc, const void *B,
                              cublasLtMatrixLayout_t Bdesc, const void *beta, const void *C,
                              cublasLtMatrixLayout_t Cdesc, void *D, cublasLtMatrixLayout_t Ddesc,
                              const cublasLtMatmulAlgo_t *algo, void *ws, size_t ws_bytes,
                              cudaStream_t stream);

/* Runs fn on stream s now, or records it while s is being captured. */
void emu_enqueue(cudaStream_t s, std::function<void()> fn);

/* A kernel's attributes: every kernel is "built" for compute capability 9.0. */
template <typename T> static inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *a, T)
{
    a->ptxVersion = a->binaryVersion = 90;
    return cudaSuccess;
}

/* cudaFuncSetAttribute with cudaFuncAttributeMaxDynamicSharedMemorySize,
 * the one attribute the kernels set: recorded per kernel. A launch asking
 * more dynamic shared memory than its kernel's limit (48 KiB unless
 * raised) fails with cudaErrorInvalidValue, as on the device; a limit past
 * the 227 KiB a block of compute capability 9.0 may have is refused. */
typedef enum cudaFuncAttribute {
    cudaFuncAttributeMaxDynamicSharedMemorySize = 8
} cudaFuncAttribute;
cudaError_t emu_func_set_max_smem(const void *kernel, int bytes);
size_t emu_func_max_smem(const void *kernel);
/* A launch the device would refuse (too much shared memory): its error
 * for cudaGetLastError, and the reason on stderr. */
void emu_launch_refused(const char *why, size_t smem, size_t limit);

template <typename T>
static inline cudaError_t cudaFuncSetAttribute(T kernel, cudaFuncAttribute attr, int value)
{
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize)
        return cudaErrorInvalidValue;
    return emu_func_set_max_smem(reinterpret_cast<const void *>(kernel), value);
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
        size_t bytes = smem, limit = emu_func_max_smem(reinterpret_cast<const void *>(k));
        if (bytes > limit) {
            emu_launch_refused("dynamic shared memory past the kernel's limit", bytes, limit);
            return;
        }
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
