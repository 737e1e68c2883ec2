/* The CPU fast path's exp over arrays (kernels/cpu/cpu_vmath.c), in the
 * ops suite (tests/test_ops.c has the other CPU ops). */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/cpu_backend.h"

/* cpu_vexp, the fast path's exp(a x + b) over arrays, through each routine
 * this CPU has (libmvec's AVX-512 and AVX2 ones, expf): every length 1..67
 * at offsets 0..3 (the vector loop and its tail), a = 1 and -1, against exp
 * in double: within 4 ulp where the result is a normal float (libmvec
 * states 2), within 2^-126 below; exp(-inf) = 0, NaN stays NaN, overflow is
 * +inf. The same input gives the same bits wherever it sits (no element is
 * left to another routine). The kind cpu_vexp names agrees with the CPU's
 * features. */
static double check_vexp(const char *isa)
{
    enum { N = 67, OFF = 4 };
    float src[N + OFF], dst[N + OFF], first[N];
    uint64_t state = 12345;
    for (int i = 0; i < N + OFF; i++) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        src[i] = -100.0f + 190.0f * (float)(state >> 40) / (float)(1u << 24);
    }
    src[5] = -INFINITY, src[6] = NAN, src[7] = 0.0f, src[8] = 89.0f, src[9] = -87.9f;
    double worst = 0.0;
    for (int sign = 1; sign >= -1; sign -= 2) {
        float a = (float)sign, b = sign > 0 ? -0.5f : 0.25f;
        for (int off = 0; off < OFF; off++)
            for (int n = 1; n + off <= N + OFF && n <= N; n++) {
                memset(dst, 0xff, sizeof dst);
                cr_assert_eq(cpu_vexp_with(isa, dst + off, src + off, (size_t)n, a, b), 0);
                for (int i = 0; i < n; i++) {
                    float x = src[off + i], y = dst[off + i];
                    double want = exp((double)(x * a + b));
                    if (isnan(x)) {
                        cr_assert(isnan(y), "%s: exp(nan) = %g", isa, y);
                        continue;
                    }
                    if (want > 3.4e38) {
                        cr_assert(isinf(y) && y > 0, "%s: exp(%g) = %g, not +inf", isa, x * a + b,
                                  y);
                        continue;
                    }
                    if (want < 1.1754944e-38) {
                        cr_assert_leq(fabs(y - want), 1.1754944e-38, "%s: exp(%g) = %g", isa,
                                      x * a + b, y);
                        continue;
                    }
                    double ulp = fabs(y - want) / (want * 1.1920929e-7);
                    worst = ulp > worst ? ulp : worst;
                    cr_assert_leq(ulp, 4.0, "%s: exp(%g): %.9g against %.9g (%.2f ulp), n %d off %d",
                                  isa, x * a + b, y, want, ulp, n, off);
                }
                if (off == 0 && n == N) /* the reference for position independence */
                    memcpy(first, dst, sizeof first);
            }
        for (int off = 1; off < OFF; off++)
            for (int n = 1; n + off <= N; n++) {
                cpu_vexp_with(isa, dst, src + off, (size_t)n, a, b);
                for (int i = 0; i < n; i++)
                    if (!isnan(dst[i]))
                        cr_assert_eq(memcmp(&dst[i], &first[off + i], sizeof(float)), 0,
                                     "%s: element %d: %.9g at position %d, %.9g at %d", isa,
                                     off + i, dst[i], i, first[off + i], off + i);
            }
    }
    return worst;
}

Test(ops, vexp_against_double_exp_any_length)
{
    const char *kind = cpu_vexp_kind();
#if defined(__x86_64__)
    const char *want_kind = __builtin_cpu_supports("avx512f") ? "libmvec avx512"
                            : __builtin_cpu_supports("avx2") ? "libmvec avx2"
                                                              : "expf";
    cr_expect_str_eq(kind, want_kind);
#endif
    const char *isas[] = {"avx512", "avx2", "expf"};
    int ran = 0;
    for (int i = 0; i < 3; i++) {
        float probe;
        if (cpu_vexp_with(isas[i], &probe, &probe, 0, 1.0f, 0.0f) != 0) {
            cr_log_info("cpu_vexp %s: not on this CPU or build", isas[i]);
            continue;
        }
        double worst = check_vexp(isas[i]);
        cr_log_info("cpu_vexp %s: worst %.2f ulp", isas[i], worst);
        ran++;
    }
    cr_expect_geq(ran, 1);
    cr_expect_eq(cpu_vexp_with("sse9", NULL, NULL, 0, 1.0f, 0.0f), -1);
}
