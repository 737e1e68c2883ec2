/* tests/cuda_ops_util.h — what test_cuda_ops.c and test_cuda_attention.c
 * share (tests/cuda_ops_util.c): the suite's two backends (gpu: "cuda", or
 * the stand-in of SPOTUNE_TEST_CUDA_STANDIN, cuda_test_main.h; cpu: "cpu" on
 * every core, the twin each op is compared against), the inputs (random
 * values rounded to bf16, so the CPU's F32 copy holds exactly what the
 * GPU's BF16 tensor holds) and the comparisons.
 *
 * Tolerances, as max |gpu - cpu| / max |cpu| over a tensor:
 *   TOL_BF16 1e-2  outputs stored in bf16 (one rounding is 2^-9 = 2e-3
 *                  relative; attention also rounds P and dS to bf16 before
 *                  their products, as flash attention does)
 *   TOL_F32  1e-4  outputs stored in F32 from identical inputs (rstd, lse,
 *                  loss, dw, db, dtable, F32 matmuls): only fp32-vs-double
 *                  summation order differs */
#ifndef SPOTUNE_TEST_CUDA_OPS_UTIL_H
#define SPOTUNE_TEST_CUDA_OPS_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

#define TOL_BF16 1e-2
#define TOL_F32 1e-4

extern backend_t *gpu, *cpu;

/* The suite's init (both backends) and fini (no sticky error left on gpu). */
void cuda_ops_setup(void);
void cuda_ops_teardown(void);
/* x rounded to bf16 (as a float). */
float to_bf16(float x);
/* n values uniform in [-scale, scale], rounded to bf16 (malloc'd), the next
 * seed each call (each test process starts from seed 1000). */
float *rnd(size_t n, float scale);
/* A tensor of dtype dt on be holding h (NULL: zeros); a tensor's values
 * (malloc'd, be's sticky error checked); be_free. */
tensor_t up(backend_t *be, dtype_t dt, const float *h, size_t n);
float *down(backend_t *be, tensor_t t);
void drop(backend_t *be, tensor_t *t);
/* max |got - want| / max |want| (a NaN: infinite) */
double rel_err(const float *got, const float *want, size_t n);
/* Downloads g (gpu) and c (cpu) and compares them within tol. */
void expect_close(const char *what, tensor_t g, tensor_t c, size_t n, double tol);
/* Synchronizes gpu and asserts that it holds no sticky error. */
void gpu_ok(void);

#endif
