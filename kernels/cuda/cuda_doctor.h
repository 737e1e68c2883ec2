/* kernels/cuda/cuda_doctor.h — the measurements `spotune doctor` makes on a
 * GPU, in the CUDA module (libspotune_cuda.so) with C entry points that the
 * doctor looks up by name (backend_cuda_symbol): the device's properties, a
 * bf16 GEMM's throughput, a device-memory copy's bandwidth, peer access and
 * copy bandwidth between two devices, and device buffers for the NCCL test.
 * Each returns 0, or -1 with why (n bytes) naming the CUDA call and error,
 * or what came out wrong. */
#ifndef SPOTUNE_CUDA_DOCTOR_H
#define SPOTUNE_CUDA_DOCTOR_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cuda_doctor_dev {
    char name[128];
    size_t mem_total, mem_free;
    int cc_major, cc_minor, sm_count;
    int driver_version, runtime_version; /* 1000 * major + 10 * minor */
    int ecc_enabled;
    char pci[32]; /* bus id */
    unsigned char uuid[16];
} cuda_doctor_dev;

typedef int (*cuda_doctor_info_fn)(int dev, cuda_doctor_dev *out, char *why, size_t n);
/* C[n,n] = A B in bf16 with fp32 accumulation (cuBLAS), timed over iters
 * after 3 untimed; then every element of C checked (each A and B element is
 * the same value, so each of C is n times its square): wrong results are
 * -1 with why naming the first and how many. */
typedef int (*cuda_doctor_gemm_fn)(int dev, int n, int iters, double *tflops, char *why,
                                   size_t wn);
/* cudaMemcpy device to device of bytes, timed over iters: GB/s of read+write.
 * The copy's first and last MiB are checked (as the peer copy's). */
typedef int (*cuda_doctor_copy_fn)(int dev, size_t bytes, int iters, double *gbps, char *why,
                                   size_t wn);
/* Whether a can access b's memory, and a's copy bandwidth to b (peer access
 * enabled when it can), GB/s, over copies of bytes. */
typedef int (*cuda_doctor_p2p_fn)(int a, int b, size_t bytes, int *can, double *gbps, char *why,
                                  size_t wn);
/* Device buffer of bytes on dev (zeroed), and its release. */
typedef int (*cuda_doctor_alloc_fn)(int dev, size_t bytes, void **p, char *why, size_t wn);
typedef void (*cuda_doctor_free_fn)(void *p);
/* Waits for everything queued on dev. */
typedef int (*cuda_doctor_sync_fn)(int dev, char *why, size_t wn);

#ifdef __cplusplus
}
#endif

#endif
