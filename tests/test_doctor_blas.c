/* spotune doctor's host.blas line, run as a program: OpenBLAS's generic
 * kernels, or its AVX2 ones on an AVX-512 CPU, WARN naming the
 * OPENBLAS_CORETYPE to set; kernels for the CPU's vector units PASS naming
 * them; spotune sets the variable itself where OpenBLAS fell back; the line
 * names what LoRA's small products run on, and FAILs on a
 * SPOTUNE_CPU_SKINNY that names no choice. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "doctor_report.h"
#include "test_util.h"

TestSuite(doctor_blas, .timeout = 300);

/* OpenBLAS's generic kernels (what its dispatch falls back to for a CPU
 * model it does not know) on a CPU with AVX2 and FMA or AVX-512, or its AVX2
 * ones on an AVX-512 CPU: a WARN naming OPENBLAS_CORETYPE and the value to
 * set; kernels for the CPU's vector units: PASS naming them.
 * OPENBLAS_CORETYPE forces each here. */
Test(doctor_blas, openblas_generic_kernels_warn_naming_the_core_type)
{
    int avx2, avx512 = tu_cpu_vector_units(&avx2);
    char *out = NULL;
    int rc = tu_sh(&out, "OPENBLAS_CORETYPE=Prescott %s/spotune doctor --cloud none --io-mib 1",
                   tu_binary_dir());
    cr_expect(rc == 0 || rc == 1, "exit %d\n%s", rc, out);
    if (avx2) {
        EXPECT_STATUS(out, "host.blas", "WARN");
        const char *want = avx512 ? "OPENBLAS_CORETYPE=SkylakeX" : "OPENBLAS_CORETYPE=Haswell";
        cr_expect(tu_contains(line_of(out, "host.blas"), "generic Prescott kernels") &&
                      tu_contains(line_of(out, "host.blas"), want),
                  "%s", out);
    } else { /* nothing better to use */
        EXPECT_STATUS(out, "host.blas", "PASS");
    }
    free(out);
    if (!avx2)
        return;
    /* AVX2 kernels: fine on an AVX2 CPU; on an AVX-512 one about half the
     * speed (docs/perf.md), a WARN naming SkylakeX */
    rc = tu_sh(&out, "OPENBLAS_CORETYPE=Haswell %s/spotune doctor --cloud none --io-mib 1",
               tu_binary_dir());
    if (avx512) {
        EXPECT_STATUS(out, "host.blas", "WARN");
        cr_expect(tu_contains(line_of(out, "host.blas"), "runs its AVX2 Haswell kernels") &&
                      tu_contains(line_of(out, "host.blas"), "OPENBLAS_CORETYPE=SkylakeX"),
                  "%s", out);
    } else {
        EXPECT_STATUS(out, "host.blas", "PASS");
        cr_expect(tu_contains(line_of(out, "host.blas"), "OpenBLAS Haswell kernels"), "%s", out);
    }
    free(out);
    if (!avx512)
        return;
    rc = tu_sh(&out, "OPENBLAS_CORETYPE=SkylakeX %s/spotune doctor --cloud none --io-mib 1",
               tu_binary_dir());
    EXPECT_STATUS(out, "host.blas", "PASS");
    cr_expect(tu_contains(line_of(out, "host.blas"), "OpenBLAS SkylakeX kernels"), "%s", out);
    free(out);
}

/* Without OPENBLAS_CORETYPE spotune never runs on OpenBLAS's generic
 * kernels when the CPU has better ones: where OpenBLAS falls back (a CPU
 * model it does not know, as on some new Xeons) spotune sets the variable
 * and runs itself again, and the line says so, naming OpenBLAS's choice. */
/* host.blas names what LoRA's small products run on: spotune's tiles of the
 * CPU's widest vector unit (AVX-512, else AVX2 with FMA), AVX2's under
 * SPOTUNE_CPU_SKINNY=avx2, OpenBLAS under 0; a value that names no choice
 * is a FAIL naming it (the CPU backend refuses it) and the exit code 1. */
Test(doctor_blas, host_blas_names_what_the_small_products_run_on)
{
    int avx2, avx512 = tu_cpu_vector_units(&avx2);
    const char *none = avx2 ? "OpenBLAS (SPOTUNE_CPU_SKINNY=0)" : "OpenBLAS (no AVX2 with FMA)";
    const struct {
        const char *env, *want, *status;
    } cases[] = {
        {"", avx512 ? "spotune's AVX-512 tiles" : avx2 ? "spotune's AVX2 tiles" : none, "PASS"},
        {"SPOTUNE_CPU_SKINNY=avx2", avx2 ? "spotune's AVX2 tiles" : "", avx2 ? "PASS" : "FAIL"},
        {"SPOTUNE_CPU_SKINNY=0", none, "PASS"},
        {"SPOTUNE_CPU_SKINNY=nope",
         "SPOTUNE_CPU_SKINNY=nope: expected 0, 1, avx2 or avx512: the CPU backend refuses to start",
         "FAIL"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *out = NULL;
        int rc = tu_sh(&out,
                       "env -u OPENBLAS_CORETYPE -u SPOTUNE_BLAS_FALLBACK %s %s/spotune doctor "
                       "--cloud none --io-mib 1",
                       cases[i].env, tu_binary_dir());
        EXPECT_STATUS(out, "host.blas", cases[i].status);
        cr_expect(tu_contains(line_of(out, "host.blas"), cases[i].want), "%s: %s", cases[i].env,
                  out);
        if (!strcmp(cases[i].status, "FAIL"))
            cr_expect_eq(rc, 1, "%s: exit %d", cases[i].env, rc);
        free(out);
    }
}

Test(doctor_blas, spotune_chooses_the_kernels_openblas_did_not_know)
{
    int avx2, avx512 = tu_cpu_vector_units(&avx2);
    char *out = NULL;
    int rc = tu_sh(&out,
                   "env -u OPENBLAS_CORETYPE -u SPOTUNE_BLAS_FALLBACK %s/spotune doctor --cloud none "
                   "--io-mib 1",
                   tu_binary_dir());
    cr_expect(rc == 0 || rc == 1, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "host.blas", "PASS");
    const char *line = line_of(out, "host.blas");
    if (avx2)
        cr_expect(!tu_contains(line, "OpenBLAS Prescott kernels") &&
                      !tu_contains(line, "OpenBLAS Core2 kernels") &&
                      !tu_contains(line, "OpenBLAS Nehalem kernels"),
                  "generic kernels on a CPU with AVX2 and FMA:\n%s", out);
    if (tu_contains(line, "set by spotune"))
        cr_expect(tu_contains(line, avx512 ? "OpenBLAS SkylakeX kernels" : "OpenBLAS Haswell kernels") &&
                      (tu_contains(line, "chose its generic") || tu_contains(line, "chose its AVX2")),
                  "%s", out);
    free(out);
}
