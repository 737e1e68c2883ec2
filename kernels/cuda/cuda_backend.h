/* kernels/cuda/cuda_backend.h — the CUDA backend: bf16 activations and
 * compute weights, fp32 accumulation, cuBLASLt matmuls and one CUDA kernel
 * per op of backend.h, all on one non-default stream of one device.
 * Owns its device memory, stream, cuBLAS/cuBLASLt handles, matmul plan
 * cache and workspaces; nothing else. C interface. */
#ifndef SPOTUNE_CUDA_BACKEND_H
#define SPOTUNE_CUDA_BACKEND_H

#include "../backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Binds to GPU device % (number of visible devices) and creates the backend
 * (act_dt BF16). Fails with a message when no device is visible. */
int cuda_backend_create(backend_t **out, int device, int threads, sp_err *err);

/* Number of visible CUDA devices; 0 (not an error) without a driver or device. */
int cuda_backend_device_count(void);

/* The same count; when it is 0, why (n bytes) receives the CUDA error that
 * says so, e.g. "cudaGetDeviceCount: CUDA driver version is insufficient for
 * CUDA runtime version (cudaErrorInsufficientDriver)". Creates no context. */
int cuda_backend_probe(char *why, size_t n);

#ifdef __cplusplus
}
#endif

#endif
