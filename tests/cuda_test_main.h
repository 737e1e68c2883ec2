/* The main of every CUDA suite (tests/test_cuda_*.c): without a usable CUDA
 * device it prints why, naming the CUDA error (no device, an insufficient
 * driver, ...) or that the build has no CUDA backend, and exits 77, which
 * ctest reports as skipped (never as passed); when SPOTUNE_CUDA_MODULE names
 * the backend's module (the emulated device's, tests/cuda_emu), that is a
 * failure instead. Otherwise Criterion runs the suite. The probe creates no CUDA context, so Criterion's test processes
 * start from a clean state. */
#ifndef SPOTUNE_CUDA_TEST_MAIN_H
#define SPOTUNE_CUDA_TEST_MAIN_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"

#define CUDA_TEST_SKIPPED 77

/* SPOTUNE_TEST_SHAPES=reduced: the real-shape tests skip (for slow runs such
 * as compute-sanitizer's memcheck). */
static inline int cuda_test_reduced_shapes(void)
{
    const char *e = getenv("SPOTUNE_TEST_SHAPES");
    return e && strcmp(e, "reduced") == 0;
}

/* SPOTUNE_TEST_CUDA_STANDIN=cpu-ref (or cpu): the suites' "cuda" side runs on
 * that backend instead, to run a test's own code (indexing, buffers, the
 * comparisons) on a machine without a GPU. Such a run says so on stderr and
 * shows nothing about the CUDA backend; ctest never sets it. Checks of
 * CUDA-only properties (bf16 activations, streams) fail under it. */
static inline const char *cuda_test_standin(void)
{
    const char *e = getenv("SPOTUNE_TEST_CUDA_STANDIN");
    return e && *e ? e : NULL;
}

static inline const char *cuda_test_backend(void)
{
    return cuda_test_standin() ? cuda_test_standin() : "cuda";
}

/* Criterion's run of this program's tests (after a main's own checks). */
static inline int cuda_test_run_criterion(int argc, char *argv[])
{
    struct criterion_test_set *tests = criterion_initialize();
    int result = 0;
    if (criterion_handle_args(argc, argv, true))
        result = !criterion_run_all_tests(tests);
    criterion_finalize(tests);
    return result;
}

static inline int cuda_test_main(int argc, char *argv[])
{
    char why[512];
    if (cuda_test_standin())
        fprintf(stderr, "STAND-IN: the \"cuda\" side of these tests runs on the %s backend "
                        "(SPOTUNE_TEST_CUDA_STANDIN): a check of the tests, not of CUDA\n",
                cuda_test_standin());
    else if (backend_cuda_probe(why, sizeof why) <= 0) {
        /* a module named on purpose (the emulated device's) must be there */
        const char *module = getenv("SPOTUNE_CUDA_MODULE");
        if (module && *module) {
            printf("FAILED: SPOTUNE_CUDA_MODULE=%s gives no usable device: %s\n", module, why);
            fflush(stdout);
            return 1;
        }
        printf("skipped: no usable CUDA device: %s\n", why);
        fflush(stdout);
        return CUDA_TEST_SKIPPED;
    }
    return cuda_test_run_criterion(argc, argv);
}

#endif
