/* tests/cuda_emu/test_emu_streams.cc — the emulated runtime's lagging
 * streams (SPOTUNE_CUDA_EMU_DEFER, emu_runtime.cc), which the emulated
 * suites run with so that a missing wait between streams shows as a wrong
 * figure: work held until something must see it, a wait between streams
 * that orders them, a read without one that sees the old values, host
 * copies (pageable taken at the call, pinned when run), the implicit
 * synchronization of cudaFree, and cudaEventElapsedTime refusing events
 * whose work has not run. Each test sets the mode before its first call
 * (Criterion runs each in its own process). Every build, the sanitizer
 * build included. C++ only because the emulated runtime is; written in the
 * C style of the rest. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_emu_runtime.h"

#define N 64

static void mode(const char *m)
{
    cr_assert_eq(setenv("SPOTUNE_CUDA_EMU_DEFER", m, 1), 0);
}

static unsigned char *dev(int fill)
{
    void *p = NULL;
    cr_assert_eq(cudaMalloc(&p, N), cudaSuccess);
    memset(p, fill, N); /* the emulated device's memory is the host's */
    return (unsigned char *)p;
}

static void all_equal(const unsigned char *p, int v, const char *what)
{
    for (int i = 0; i < N; i++)
        cr_assert_eq(p[i], v, "%s: [%d] is %d, want %d", what, i, p[i], v);
}

/* work is held until a wait; then it runs, in order */
Test(emu_streams, work_is_held_until_the_host_waits)
{
    mode("all");
    cudaStream_t s;
    cr_assert_eq(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    unsigned char *a = dev(0);
    cr_assert_eq(cudaMemsetAsync(a, 7, N, s), cudaSuccess);
    cr_assert_eq(cudaMemsetAsync(a, 9, N / 2, s), cudaSuccess);
    all_equal(a, 0, "before the wait");
    cr_assert_eq(cudaStreamSynchronize(s), cudaSuccess);
    for (int i = 0; i < N; i++)
        cr_assert_eq(a[i], i < N / 2 ? 9 : 7);
    cr_assert_eq(cudaStreamDestroy(s), cudaSuccess);
    cr_assert_eq(cudaFree(a), cudaSuccess);
}

/* b's copy of a: without a wait it sees what a held before s1's work ran;
 * with s2 waiting on an event recorded after that work, the new values */
Test(emu_streams, a_wait_orders_two_streams_and_its_absence_shows)
{
    mode("all");
    cudaStream_t s1, s2;
    cudaEvent_t e;
    cr_assert_eq(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), cudaSuccess);
    cr_assert_eq(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), cudaSuccess);
    cr_assert_eq(cudaEventCreate(&e), cudaSuccess);
    unsigned char *a = dev(1), *b = dev(0), *c = dev(0);
    cr_assert_eq(cudaMemsetAsync(a, 5, N, s1), cudaSuccess);
    cr_assert_eq(cudaMemcpyAsync(b, a, N, cudaMemcpyDeviceToDevice, s2), cudaSuccess);
    cr_assert_eq(cudaStreamSynchronize(s2), cudaSuccess);
    all_equal(b, 1, "read without a wait");
    cr_assert_eq(cudaEventRecord(e, s1), cudaSuccess);
    cr_assert_eq(cudaStreamWaitEvent(s2, e, 0), cudaSuccess);
    cr_assert_eq(cudaMemcpyAsync(c, a, N, cudaMemcpyDeviceToDevice, s2), cudaSuccess);
    cr_assert_eq(cudaStreamSynchronize(s2), cudaSuccess);
    all_equal(c, 5, "read after the wait");
    cr_assert_eq(cudaEventDestroy(e), cudaSuccess);
    cr_assert_eq(cudaStreamDestroy(s1), cudaSuccess);
    cr_assert_eq(cudaStreamDestroy(s2), cudaSuccess);
    cudaFree(a), cudaFree(b), cudaFree(c);
}

/* "aux": the first stream runs at once, a stream made while it is alive
 * lags; the first waiting on the second's event runs the second's work */
Test(emu_streams, aux_lags_and_a_wait_on_it_runs_it)
{
    mode("aux");
    cudaStream_t compute, aux;
    cudaEvent_t e;
    cr_assert_eq(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), cudaSuccess);
    cr_assert_eq(cudaStreamCreateWithFlags(&aux, cudaStreamNonBlocking), cudaSuccess);
    cr_assert_eq(cudaEventCreate(&e), cudaSuccess);
    unsigned char *a = dev(0);
    cr_assert_eq(cudaMemsetAsync(a, 3, N, compute), cudaSuccess);
    all_equal(a, 3, "the compute stream's work");
    cr_assert_eq(cudaMemsetAsync(a, 4, N, aux), cudaSuccess);
    all_equal(a, 3, "the aux stream's work, held");
    cr_assert_eq(cudaEventRecord(e, aux), cudaSuccess);
    cr_assert_eq(cudaStreamWaitEvent(compute, e, 0), cudaSuccess);
    all_equal(a, 4, "after the compute stream's wait");
    cr_assert_eq(cudaEventDestroy(e), cudaSuccess);
    cr_assert_eq(cudaStreamDestroy(aux), cudaSuccess);
    cr_assert_eq(cudaStreamDestroy(compute), cudaSuccess);
    cudaFree(a);
}

/* pageable host memory is taken at the call; pinned memory when the copy
 * runs; a copy to pageable memory is done when the call returns */
Test(emu_streams, host_copies_pageable_at_the_call_pinned_when_run)
{
    mode("all");
    cudaStream_t s;
    cr_assert_eq(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    unsigned char *a = dev(0), *b = dev(0), page[N], back[N];
    void *pin = NULL;
    cr_assert_eq(cudaHostAlloc(&pin, N, cudaHostAllocDefault), cudaSuccess);
    memset(page, 1, N);
    memset(pin, 1, N);
    cr_assert_eq(cudaMemcpyAsync(a, page, N, cudaMemcpyHostToDevice, s), cudaSuccess);
    cr_assert_eq(cudaMemcpyAsync(b, pin, N, cudaMemcpyHostToDevice, s), cudaSuccess);
    memset(page, 2, N);
    memset(pin, 2, N); /* a pinned buffer reused before its copy ran */
    memset(back, 0, N);
    cr_assert_eq(cudaMemcpyAsync(back, a, N, cudaMemcpyDeviceToHost, s), cudaSuccess);
    all_equal(back, 1, "pageable source, and a pageable destination at return");
    cr_assert_eq(cudaStreamSynchronize(s), cudaSuccess);
    all_equal(b, 2, "pinned source, read when the copy ran");
    cr_assert_eq(cudaFreeHost(pin), cudaSuccess);
    cr_assert_eq(cudaStreamDestroy(s), cudaSuccess);
    cudaFree(a), cudaFree(b);
}

/* cudaFree waits for the device; elapsed time needs both events' work run */
Test(emu_streams, free_synchronizes_and_elapsed_time_waits_for_its_events)
{
    mode("all");
    cudaStream_t s;
    cudaEvent_t e0, e1;
    float ms = -1.0f;
    cr_assert_eq(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    cr_assert_eq(cudaEventCreate(&e0), cudaSuccess);
    cr_assert_eq(cudaEventCreate(&e1), cudaSuccess);
    unsigned char *a = dev(0), *b = dev(0);
    cr_assert_eq(cudaEventRecord(e0, s), cudaSuccess);
    cr_assert_eq(cudaMemsetAsync(a, 6, N, s), cudaSuccess);
    cr_assert_eq(cudaEventRecord(e1, s), cudaSuccess);
    cr_assert_eq(cudaEventElapsedTime(&ms, e0, e1), cudaErrorNotReady);
    cr_assert_eq(cudaGetLastError(), cudaErrorNotReady);
    cr_assert_eq(cudaFree(b), cudaSuccess);
    all_equal(a, 6, "after cudaFree");
    cr_assert_eq(cudaEventElapsedTime(&ms, e0, e1), cudaSuccess);
    cr_assert(ms >= 0.0f, "%g ms", ms);
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    cr_assert_eq(cudaStreamDestroy(s), cudaSuccess);
    cudaFree(a);
}

/* without the mode nothing is held: the emulated suites' default */
Test(emu_streams, without_the_mode_work_runs_when_issued)
{
    mode("0");
    cudaStream_t s;
    cr_assert_eq(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    unsigned char *a = dev(0);
    cr_assert_eq(cudaMemsetAsync(a, 8, N, s), cudaSuccess);
    all_equal(a, 8, "at once");
    cr_assert_eq(cudaStreamDestroy(s), cudaSuccess);
    cudaFree(a);
}

/* A kernel's limit on dynamic shared memory (cudaFuncSetAttribute): a
 * launch asking more than 48 KiB without it is refused as on the device
 * (cudaErrorInvalidValue, the kernel not run), and runs once the limit is
 * raised; a limit past the 227 KiB of compute capability 9.0 is refused. */
static void smem_kernel(int *out)
{
    out[threadIdx.x] = (int)threadIdx.x + 1;
}

Test(emu_streams, dynamic_shared_memory_past_48_kib_needs_the_kernels_limit_raised)
{
    mode("0");
    int *out = NULL;
    cr_assert_eq(cudaMalloc((void **)&out, 32 * sizeof(int)), cudaSuccess);
    memset(out, 0, 32 * sizeof(int));
    (void)cudaGetLastError();
    emu_launcher(smem_kernel, dim3(1), dim3(32), (size_t)48 * 1024, 0)(out); /* at the limit */
    cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
    cr_assert_eq(cudaGetLastError(), cudaSuccess);
    cr_expect_eq(out[31], 32);
    memset(out, 0, 32 * sizeof(int));
    emu_launcher(smem_kernel, dim3(1), dim3(32), (size_t)64 * 1024, 0)(out);
    cr_expect_eq(cudaGetLastError(), cudaErrorInvalidValue, "64 KiB without the limit raised");
    cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
    cr_expect_eq(out[0], 0, "the refused launch ran");
    cr_expect_eq(cudaFuncSetAttribute(smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      228 * 1024),
                 cudaErrorInvalidValue, "a limit past 227 KiB");
    (void)cudaGetLastError();
    cr_assert_eq(cudaFuncSetAttribute(smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      64 * 1024),
                 cudaSuccess);
    emu_launcher(smem_kernel, dim3(1), dim3(32), (size_t)64 * 1024, 0)(out);
    cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
    cr_expect_eq(cudaGetLastError(), cudaSuccess);
    cr_expect_eq(out[0], 1);
    cr_expect_eq(out[31], 32);
    cudaFree(out);
}
