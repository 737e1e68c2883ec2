/* The emulated device's guarded memory (SPOTUNE_CUDA_EMU_GUARD=1, set for
 * the emulated suites; tests/cuda_emu/emu_runtime.cc): a device allocation
 * is usable to its size rounded up to 256 bytes, and a read or write one
 * byte past that, or one byte before it, stops the process with SIGSEGV,
 * so an out-of-bounds access of a kernel or a copy fails the suite that
 * makes it. Through the CUDA backend on the emulated module
 * (SPOTUNE_CUDA_MODULE), whose device pointers are host memory. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels/backend.h"

static backend_t *be;

static void setup(void)
{
    sp_err err = {0};
    cr_assert_eq(setenv("SPOTUNE_CUDA_EMU_GUARD", "1", 1), 0);
    cr_assert(getenv("SPOTUNE_CUDA_MODULE"), "SPOTUNE_CUDA_MODULE names no module");
    cr_assert_eq(backend_create(&be, "cuda", 0, 1, &err), 0, "%s", err.msg);
}

static void teardown(void)
{
    if (be)
        backend_destroy(be);
}

TestSuite(emu_guard, .init = setup, .fini = teardown, .timeout = 30);

static volatile uint8_t *alloc(size_t bytes, tensor_t *t)
{
    *t = be_alloc(be, DT_U8, bytes);
    cr_assert(t->p && ((uintptr_t)t->p & 255u) == 0, "not 256-byte aligned: %p", t->p);
    return t->p;
}

/* every byte of the rounded size is there, and freeing gives it back */
Test(emu_guard, the_rounded_size_is_usable)
{
    size_t sizes[] = {1, 256, 4097};
    for (int k = 0; k < 3; k++) {
        tensor_t t;
        volatile uint8_t *p = alloc(sizes[k], &t);
        size_t rounded = (sizes[k] + 255) & ~(size_t)255;
        for (size_t i = 0; i < rounded; i++)
            p[i] = (uint8_t)i;
        for (size_t i = 0; i < rounded; i++)
            cr_assert_eq(p[i], (uint8_t)i);
        be_free(be, &t);
    }
    cr_assert_eq(be->err.code, 0, "%s", be->err.msg);
}

Test(emu_guard, a_write_past_the_end_stops_the_process, .signal = SIGSEGV)
{
    tensor_t t;
    volatile uint8_t *p = alloc(40, &t);
    p[255] = 1;
    p[256] = 1;
}

Test(emu_guard, a_read_past_a_page_sized_buffer_stops_the_process, .signal = SIGSEGV)
{
    tensor_t t;
    volatile uint8_t *p = alloc(4096, &t);
    (void)p[4095];
    (void)p[4096];
}

Test(emu_guard, a_read_before_the_start_stops_the_process, .signal = SIGSEGV)
{
    tensor_t t;
    volatile uint8_t *p = alloc(4096, &t);
    (void)p[-1];
}
