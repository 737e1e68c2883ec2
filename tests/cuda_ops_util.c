/* The shared fixture and helpers of the CUDA op suites (cuda_ops_util.h). */
#include "cuda_ops_util.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>

#include "cuda_test_main.h"

backend_t *gpu, *cpu;
static uint64_t g_seed = 1000;

void cuda_ops_setup(void)
{
    sp_err err = {0};
    /* every core: the real-shape references are the slow part of this suite */
    cr_assert_eq(backend_create(&cpu, "cpu", 0, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(backend_create(&gpu, cuda_test_backend(), 0, 1, &err), 0, "%s", err.msg);
}

void cuda_ops_teardown(void)
{
    sp_err err = {0};
    if (gpu)
        cr_expect_eq(be_check(gpu, &err), 0, "sticky error left: %s", err.msg);
    backend_destroy(gpu);
    backend_destroy(cpu);
}

float to_bf16(float x)
{
    return sp_bf16_to_f32(sp_f32_to_bf16(x));
}

float *rnd(size_t n, float scale)
{
    float *x = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++)
        x[i] = to_bf16(scale * (2.0f * sp_rng_uniform(g_seed, i) - 1.0f));
    g_seed++;
    return x;
}

tensor_t up(backend_t *be, dtype_t dt, const float *h, size_t n)
{
    tensor_t t = be_alloc(be, dt, n);
    cr_assert(t.p, "alloc of %zu %s failed", n, dtype_name(dt));
    if (h)
        be_upload(be, t, h, DT_F32);
    return t;
}

float *down(backend_t *be, tensor_t t)
{
    float *h = malloc(sizeof(float) * (t.n ? t.n : 1));
    be_download(be, h, DT_F32, t);
    sp_err err = {0};
    cr_assert_eq(be_check(be, &err), 0, "%s", err.msg);
    return h;
}

void drop(backend_t *be, tensor_t *t)
{
    be_free(be, t);
}

double rel_err(const float *got, const float *want, size_t n)
{
    double m = 0, e = 0;
    for (size_t i = 0; i < n; i++) {
        if (fabs((double)want[i]) > m)
            m = fabs((double)want[i]);
        double d = fabs((double)got[i] - (double)want[i]);
        if (d > e || d != d)
            e = d != d ? INFINITY : d;
    }
    return m > 0 ? e / m : e;
}

void expect_close(const char *what, tensor_t g, tensor_t c, size_t n, double tol)
{
    float *a = down(gpu, g), *b = down(cpu, c);
    double e = rel_err(a, b, n);
    cr_expect(e <= tol, "%s: rel err %.3g > %.3g", what, e, tol);
    free(a);
    free(b);
}

void gpu_ok(void)
{
    sp_err err = {0};
    be_sync(gpu);
    cr_assert_eq(be_check(gpu, &err), 0, "%s", err.msg);
}
