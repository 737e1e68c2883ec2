/* kernels/cuda/dev/bench_util.h — what the workbench programs share (header
 * only, each program one translation unit): the sticky-error check, the
 * random bf16 inputs, the relative error and the CUDA-event timer. */
#ifndef SPOTUNE_BENCH_UTIL_H
#define SPOTUNE_BENCH_UTIL_H

#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels/backend.h"

/* 0 when be holds no sticky error; else prints "PROG: WHAT: message" and
 * returns -1. */
/* The CUDA backend (device 0) and the CPU backend the programs check it
 * against; 0, or 77 (nothing created) with the reason printed. */
static inline int bench_backends(const char *prog, backend_t **gpu, backend_t **cpu)
{
    sp_err err = {0};
    *gpu = *cpu = NULL;
    if (backend_create(gpu, "cuda", 0, 1, &err) == 0 && backend_create(cpu, "cpu", 0, 0, &err) == 0)
        return 0;
    fprintf(stderr, "%s: %s\n", prog, err.msg);
    backend_destroy(*gpu);
    *gpu = NULL;
    return 77;
}

static inline int bench_fail_be(const char *prog, backend_t *be, const char *what)
{
    sp_err err = {0};
    if (be_check(be, &err) == 0)
        return 0;
    fprintf(stderr, "%s: %s: %s\n", prog, what, err.msg);
    return -1;
}

/* n values uniform in [-scale, scale] from seed, rounded to bf16 (malloc'd;
 * NULL when out of memory) */
static inline float *bench_random_bf16(size_t n, float scale, uint64_t seed)
{
    float *x = malloc(sizeof(float) * (n ? n : 1));
    if (!x)
        return NULL;
    for (size_t i = 0; i < n; i++)
        x[i] = sp_bf16_to_f32(sp_f32_to_bf16(scale * (2.0f * sp_rng_uniform(seed, i) - 1.0f)));
    return x;
}

/* max |got - want| / max |want| (a NaN: infinite) */
static inline double bench_rel_err(const float *got, const float *want, size_t n)
{
    double m = 0, e = 0;
    for (size_t i = 0; i < n; i++) {
        double w = fabs((double)want[i]), d = fabs((double)got[i] - (double)want[i]);
        m = w > m ? w : m;
        if (d > e || d != d)
            e = d != d ? INFINITY : d;
    }
    return m > 0 ? e / m : e;
}

/* Milliseconds per call of fn(ctx), over iters calls after one warm-up, by
 * CUDA events on be's stream; -1 on a failure (printed as PROG's). */
static inline double bench_time_ms(const char *prog, backend_t *be, void (*fn)(void *), void *ctx,
                                   int iters)
{
    cudaStream_t st = (cudaStream_t)be->stream;
    cudaEvent_t e0, e1;
    float ms = 0.0f;
    if (cudaEventCreate(&e0) != cudaSuccess)
        return -1;
    if (cudaEventCreate(&e1) != cudaSuccess) {
        cudaEventDestroy(e0);
        return -1;
    }
    fn(ctx); /* warm-up */
    int ok = cudaEventRecord(e0, st) == cudaSuccess;
    for (int i = 0; i < iters && ok; i++)
        fn(ctx);
    ok = ok && cudaEventRecord(e1, st) == cudaSuccess && cudaEventSynchronize(e1) == cudaSuccess &&
         cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess;
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    if (!ok || bench_fail_be(prog, be, "timed run"))
        return -1;
    return (double)ms / iters;
}

#endif
