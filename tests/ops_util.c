/* The shared fixture and helpers of the CPU op suites (ops_util.h). */
#include "ops_util.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>

backend_t *be;
static tensor_t owned[256]; /* every tensor a test allocates, freed by teardown */
static int nowned;

void ops_setup(void)
{
    sp_err err = {0};
    cr_assert_eq(backend_create(&be, "cpu", 2, 2, &err), 0, "%s", err.msg);
}

void ops_teardown(void)
{
    for (int i = 0; i < nowned; i++)
        be_free(be, &owned[i]);
    backend_destroy(be);
}

tensor_t talloc(dtype_t dt, size_t n)
{
    tensor_t t = be_alloc(be, dt, n);
    cr_assert(t.p && nowned < 256);
    owned[nowned++] = t;
    return t;
}

tensor_t no_tensor(void)
{
    tensor_t t = {0};
    return t;
}

uint64_t g_seed = 42;

float *rnd(size_t n, float scale)
{
    float *x = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++)
        x[i] = scale * (2.0f * sp_rng_uniform(g_seed, i) - 1.0f);
    g_seed++;
    return x;
}

tensor_t dev(const float *host, size_t n)
{
    tensor_t t = talloc(DT_F32, n);
    if (host)
        be_upload(be, t, host, DT_F32);
    return t;
}

float *host(tensor_t t)
{
    float *h = malloc(sizeof(float) * t.n);
    be_download(be, h, DT_F32, t);
    return h;
}

static double max_abs_d(const double *x, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++)
        if (fabs(x[i]) > m)
            m = fabs(x[i]);
    return m;
}

double rel_err(const float *got, const double *want, size_t n)
{
    double m = max_abs_d(want, n), e = 0;
    for (size_t i = 0; i < n; i++)
        if (fabs(got[i] - want[i]) > e)
            e = fabs(got[i] - want[i]);
    return m > 0 ? e / m : e;
}

double *to_d(const float *f, size_t n)
{
    double *d = malloc(sizeof(double) * n);
    for (size_t i = 0; i < n; i++)
        d[i] = f[i];
    return d;
}

double dot_d(const double *a, const float *R, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += a[i] * R[i];
    return s;
}
