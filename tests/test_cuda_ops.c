/* Every op of the CUDA backend against its CPU twin: both backends get the
 * same inputs (random values rounded to bf16, so the CPU's F32 copy holds
 * exactly what the GPU's BF16 tensor holds), on several shapes including
 * odd ones, forward and backward.
 *
 * Tolerances, as max |gpu - cpu| / max |cpu| over a tensor:
 *   TOL_BF16 1e-2  outputs stored in bf16 (one rounding is 2^-9 = 2e-3
 *                  relative; attention also rounds P and dS to bf16 before
 *                  their products, as flash attention does)
 *   TOL_F32  1e-4  outputs stored in F32 from identical inputs (rstd, lse,
 *                  loss, dw, db, dtable, F32 matmuls): only fp32-vs-double
 *                  summation order differs
 *   sumsq 1e-10 relative (double on both sides, another summation order);
 *   AdamW 1e-6
 *   dropout masks and fill_uniform: bit for bit; fill_normal 1e-6 (the GPU's
 *   double log/cos differ from glibc's in the last ulp)
 * Without a usable CUDA device main prints "skipped: no usable CUDA device: "
 * and the CUDA error (cuda_test_main.h), and exits 77. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_test_main.h"
#include "kernels/backend.h"
#include "kernels/nf4.h"
#include "op_checks.h"

#define TOL_BF16 1e-2
#define TOL_F32 1e-4

static backend_t *gpu, *cpu;
static uint64_t g_seed = 1000;

static void setup(void)
{
    sp_err err = {0};
    /* every core: the real-shape references are the slow part of this suite */
    cr_assert_eq(backend_create(&cpu, "cpu", 0, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(backend_create(&gpu, cuda_test_backend(), 0, 1, &err), 0, "%s", err.msg);
}

static void teardown(void)
{
    sp_err err = {0};
    if (gpu)
        cr_expect_eq(be_check(gpu, &err), 0, "sticky error left: %s", err.msg);
    backend_destroy(gpu);
    backend_destroy(cpu);
}

TestSuite(cuda_ops, .init = setup, .fini = teardown, .timeout = 300);

/* ---- test utilities ------------------------------------------------------------ */

static float to_bf16(float x)
{
    return sp_bf16_to_f32(sp_f32_to_bf16(x));
}

/* n values uniform in [-scale, scale], rounded to bf16 */
static float *rnd(size_t n, float scale)
{
    float *x = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++)
        x[i] = to_bf16(scale * (2.0f * sp_rng_uniform(g_seed, i) - 1.0f));
    g_seed++;
    return x;
}

static tensor_t up(backend_t *be, dtype_t dt, const float *h, size_t n)
{
    tensor_t t = be_alloc(be, dt, n);
    cr_assert(t.p, "alloc of %zu %s failed", n, dtype_name(dt));
    if (h)
        be_upload(be, t, h, DT_F32);
    return t;
}

static float *down(backend_t *be, tensor_t t)
{
    float *h = malloc(sizeof(float) * (t.n ? t.n : 1));
    be_download(be, h, DT_F32, t);
    sp_err err = {0};
    cr_assert_eq(be_check(be, &err), 0, "%s", err.msg);
    return h;
}

static void drop(backend_t *be, tensor_t *t)
{
    be_free(be, t);
}

/* max |got - want| / max |want| */
static double rel_err(const float *got, const float *want, size_t n)
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

/* Downloads both tensors and compares them within tol. */
static void expect_close(const char *what, tensor_t g, tensor_t c, size_t n, double tol)
{
    float *a = down(gpu, g), *b = down(cpu, c);
    double e = rel_err(a, b, n);
    cr_expect(e <= tol, "%s: rel err %.3g > %.3g", what, e, tol);
    free(a);
    free(b);
}

static double tol_for(dtype_t dt)
{
    return dt == DT_BF16 ? TOL_BF16 : TOL_F32;
}

static void gpu_ok(void)
{
    sp_err err = {0};
    be_sync(gpu);
    cr_assert_eq(be_check(gpu, &err), 0, "%s", err.msg);
}

/* ---- the backend itself ------------------------------------------------------------ */

Test(cuda_ops, creation_sets_the_memory_plan_fields)
{
    cr_expect_str_eq(gpu->name, "cuda");
    cr_expect_eq(gpu->act_dt, DT_BF16);
    cr_expect(gpu->stream != NULL, "the compute stream is not the default stream");
    cr_expect_gt(gpu->mem_total, (size_t)0);
    cr_expect(strlen(gpu->device_name) > 0 && strcmp(gpu->device_name, "CPU") != 0,
              "device name '%s'", gpu->device_name);
    cr_expect_geq(gpu->threads, 1);
}

Test(cuda_ops, aux_stream_and_fences)
{
    void *aux = be_aux_stream(gpu);
    cr_assert(aux != NULL);
    cr_expect(aux != gpu->stream, "the aux stream is a second stream");
    cr_expect(be_aux_stream(gpu) == aux, "one aux stream per backend");
    tensor_t t = up(gpu, DT_F32, NULL, 1 << 20);
    be_fill_uniform(gpu, t, t.n, 1.0f, 1.0f, 0, 0);
    be_stream_fence(gpu, aux, gpu->stream);
    be_stream_fence(gpu, gpu->stream, aux);
    be_stream_fence(gpu, gpu->stream, gpu->stream); /* a no-op */
    float *h = down(gpu, t);
    cr_expect_eq(h[t.n - 1], 1.0f);
    free(h);
    drop(gpu, &t);
    gpu_ok();
}

Test(cuda_ops, alloc_is_zeroed_and_counted)
{
    size_t before = gpu->bytes_in_use;
    tensor_t t = be_alloc(gpu, DT_F32, 1000003);
    cr_assert(t.p);
    cr_expect_geq(gpu->bytes_in_use, before + 1000003 * 4);
    cr_expect_geq(gpu->bytes_peak, gpu->bytes_in_use);
    float *h = down(gpu, t);
    size_t nonzero = 0;
    for (size_t i = 0; i < t.n; i++)
        nonzero += h[i] != 0.0f;
    cr_expect_eq(nonzero, 0, "%zu nonzero values in fresh memory", nonzero);
    free(h);
    drop(gpu, &t);
    cr_expect_eq(gpu->bytes_in_use, before);
    cr_expect_null(t.p);
}

Test(cuda_ops, copies_and_conversions_are_exact)
{
    size_t n = 4099;
    float *x = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) /* not bf16-representable: rounding is tested */
        x[i] = (float)(sp_rng_normal(5, i) * 3.0);
    x[0] = NAN;
    x[1] = INFINITY;
    x[2] = -0.0f;
    x[3] = 1.00390625f; /* a tie: rounds to even */
    tensor_t f = up(gpu, DT_F32, x, n), b = up(gpu, DT_BF16, NULL, n), f2 = up(gpu, DT_F32, NULL, n);
    be_copy(gpu, b, f);
    be_copy(gpu, f2, b);
    uint16_t *hb = malloc(2 * n);
    be_d2h(gpu, hb, b.p, 2 * n);
    float *hf = down(gpu, f2);
    for (size_t i = 0; i < n; i++) {
        uint16_t want = sp_f32_to_bf16(x[i]);
        cr_expect_eq(hb[i], want, "bf16 of x[%zu] = %g: %04x vs %04x", i, x[i], hb[i], want);
        uint32_t a, w;
        float wf = sp_bf16_to_f32(want);
        memcpy(&a, &hf[i], 4);
        memcpy(&w, &wf, 4);
        cr_expect_eq(a, w, "f32 of bf16 [%zu]", i);
    }
    be_zero(gpu, f);
    float *z = down(gpu, f);
    cr_expect_eq(z[0], 0.0f);
    cr_expect_eq(z[n - 1], 0.0f);
    free(z);
    free(hb);
    free(hf);
    free(x);
    drop(gpu, &f);
    drop(gpu, &b);
    drop(gpu, &f2);
    gpu_ok();
}

Test(cuda_ops, failures_are_sticky_and_name_the_device_and_line)
{
    sp_err err = {0};
    backend_t *be;
    cr_assert_eq(backend_create(&be, "cuda", 0, 1, &err), 0, "%s", err.msg);
    /* F32 operands into a BF16 product: valid arguments (backend_ops.c lets
     * them through), but no cuBLASLt matmul: the device's own refusal */
    tensor_t a = be_alloc(be, DT_F32, 16), c = be_alloc(be, DT_BF16, 16);
    be_matmul(be, c, a, a, 4, 4, 4, 0, 0, 1.0f, 0.0f);
    be_copy(be, a, tensor_view(c, 0, 8)); /* a second failure must not replace the first */
    cr_expect_neq(be_check(be, &err), 0);
    cr_expect(strstr(err.msg, "device 0") != NULL, "%s", err.msg);
    cr_expect(strstr(err.msg, "cuda_matmul.cu:") != NULL, "%s", err.msg);
    cr_expect(strstr(err.msg, "F32 x F32 into BF16") != NULL, "%s", err.msg);
    tensor_t huge = be_alloc(be, DT_F32, (size_t)1 << 46); /* 256 TiB */
    cr_expect_null(huge.p);
    be_free(be, &a);
    be_free(be, &c);
    backend_destroy(be);
}

/* ---- matmul -------------------------------------------------------------------------- */

static void check_matmul(int M, int N, int K, int ta, int tb, float alpha, float beta,
                         dtype_t cdt, dtype_t abdt)
{
    float *A = rnd((size_t)M * K, 1.0f), *B = rnd((size_t)K * N, 1.0f), *C = rnd((size_t)M * N, 1.0f);
    tensor_t gA = up(gpu, abdt, A, (size_t)M * K), gB = up(gpu, abdt, B, (size_t)K * N);
    tensor_t gC = up(gpu, cdt, C, (size_t)M * N);
    tensor_t cA = up(cpu, DT_F32, A, (size_t)M * K), cB = up(cpu, DT_F32, B, (size_t)K * N);
    tensor_t cC = up(cpu, DT_F32, C, (size_t)M * N);
    be_matmul(gpu, gC, gA, gB, M, N, K, ta, tb, alpha, beta);
    be_matmul(cpu, cC, cA, cB, M, N, K, ta, tb, alpha, beta);
    gpu_ok();
    char what[160];
    snprintf(what, sizeof what, "matmul %dx%dx%d ta%d tb%d alpha %g beta %g %s x %s -> %s", M, N,
             K, ta, tb, alpha, beta, dtype_name(abdt), dtype_name(abdt), dtype_name(cdt));
    expect_close(what, gC, cC, (size_t)M * N, tol_for(cdt));
    drop(gpu, &gA), drop(gpu, &gB), drop(gpu, &gC);
    drop(cpu, &cA), drop(cpu, &cB), drop(cpu, &cC);
    free(A), free(B), free(C);
}

Test(cuda_ops, matmul_bf16_into_bf16_every_transpose)
{
    static const int shapes[][3] = {{1, 1, 1}, {7, 5, 3}, {33, 17, 65}, {128, 96, 64}, {257, 130, 31}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int t = 0; t < 4; t++)
            check_matmul(shapes[s][0], shapes[s][1], shapes[s][2], t & 1, t >> 1, 1.0f, 0.0f,
                         DT_BF16, DT_BF16);
}

Test(cuda_ops, matmul_accumulates_with_alpha_and_beta)
{
    for (int t = 0; t < 4; t++) {
        check_matmul(45, 19, 77, t & 1, t >> 1, 0.5f, 1.0f, DT_BF16, DT_BF16);
        check_matmul(45, 19, 77, t & 1, t >> 1, 2.0f, 1.0f, DT_F32, DT_BF16); /* weight grads */
        check_matmul(6, 300, 11, t & 1, t >> 1, -1.0f, 0.25f, DT_F32, DT_BF16);
    }
}

Test(cuda_ops, matmul_f32_operands_and_empty_k)
{
    check_matmul(31, 29, 37, 0, 1, 1.0f, 0.0f, DT_F32, DT_F32);
    check_matmul(31, 29, 37, 1, 0, 1.0f, 1.0f, DT_F32, DT_F32);
    check_matmul(5, 6, 0, 0, 1, 1.0f, 0.5f, DT_BF16, DT_BF16);
}

/* The model's repeated shapes reuse one cached plan: the same call twice
 * gives the same bits. */
Test(cuda_ops, matmul_repeats_bit_for_bit)
{
    int M = 96, N = 160, K = 200;
    float *A = rnd((size_t)M * K, 1.0f), *B = rnd((size_t)N * K, 1.0f);
    tensor_t gA = up(gpu, DT_BF16, A, (size_t)M * K), gB = up(gpu, DT_BF16, B, (size_t)N * K);
    tensor_t c1 = up(gpu, DT_F32, NULL, (size_t)M * N), c2 = up(gpu, DT_F32, NULL, (size_t)M * N);
    for (int i = 0; i < 3; i++)
        be_matmul(gpu, c1, gA, gB, M, N, K, 0, 1, 1.0f, 0.0f);
    be_matmul(gpu, c2, gA, gB, M, N, K, 0, 1, 1.0f, 0.0f);
    float *h1 = down(gpu, c1), *h2 = down(gpu, c2);
    cr_expect_eq(memcmp(h1, h2, sizeof(float) * M * N), 0);
    free(h1), free(h2), free(A), free(B);
    drop(gpu, &gA), drop(gpu, &gB), drop(gpu, &c1), drop(gpu, &c2);
}

/* ---- RMSNorm ------------------------------------------------------------------------ */

static void check_rmsnorm(int rows, int cols, int with_dw)
{
    size_t n = (size_t)rows * cols;
    float *x = rnd(n, 2.0f), *w = rnd(cols, 1.5f), *dout = rnd(n, 1.0f), *dx0 = rnd(n, 0.5f);
    float *dw0 = rnd(cols, 0.5f);
    dtype_t a = gpu->act_dt;
    tensor_t gx = up(gpu, a, x, n), gw = up(gpu, a, w, cols), go = up(gpu, a, NULL, n);
    tensor_t gr = up(gpu, DT_F32, NULL, rows), gd = up(gpu, a, dout, n), gdx = up(gpu, a, dx0, n);
    tensor_t gdw = up(gpu, DT_F32, dw0, cols);
    tensor_t cx = up(cpu, DT_F32, x, n), cw = up(cpu, DT_F32, w, cols), co = up(cpu, DT_F32, NULL, n);
    tensor_t cr = up(cpu, DT_F32, NULL, rows), cd = up(cpu, DT_F32, dout, n);
    tensor_t cdx = up(cpu, DT_F32, dx0, n), cdw = up(cpu, DT_F32, dw0, cols);
    be_rmsnorm_forward(gpu, go, gr, gx, gw, rows, cols, 1e-5f);
    be_rmsnorm_forward(cpu, co, cr, cx, cw, rows, cols, 1e-5f);
    tensor_t none = {0};
    be_rmsnorm_backward(gpu, gdx, with_dw ? gdw : none, gd, gx, gw, gr, rows, cols);
    be_rmsnorm_backward(cpu, cdx, with_dw ? cdw : none, cd, cx, cw, cr, rows, cols);
    gpu_ok();
    char what[96];
    snprintf(what, sizeof what, "rmsnorm %dx%d out", rows, cols);
    expect_close(what, go, co, n, TOL_BF16);
    snprintf(what, sizeof what, "rmsnorm %dx%d rstd", rows, cols);
    expect_close(what, gr, cr, rows, TOL_F32);
    snprintf(what, sizeof what, "rmsnorm %dx%d dx (+=)", rows, cols);
    expect_close(what, gdx, cdx, n, TOL_BF16);
    snprintf(what, sizeof what, "rmsnorm %dx%d dw (+=)", rows, cols);
    expect_close(what, gdw, cdw, cols, TOL_F32);
    tensor_t gs[] = {gx, gw, go, gr, gd, gdx, gdw}, cs[] = {cx, cw, co, cr, cd, cdx, cdw};
    for (int i = 0; i < 7; i++)
        drop(gpu, &gs[i]), drop(cpu, &cs[i]);
    free(x), free(w), free(dout), free(dx0), free(dw0);
}

Test(cuda_ops, rmsnorm_forward_and_backward)
{
    check_rmsnorm(1, 8, 1);
    check_rmsnorm(5, 48, 1);
    check_rmsnorm(37, 129, 1);
    check_rmsnorm(300, 1000, 1);
    check_rmsnorm(9, 77, 0); /* frozen norm: no dw */
}

/* ---- RoPE ------------------------------------------------------------------------------ */

/* pos: the position of each of the B*T tokens (packed documents), or NULL */
static void check_rope_pos(int B, int T, int nh, int hd, const int32_t *pos)
{
    size_t n = (size_t)B * T * nh * hd, half = (size_t)hd / 2;
    float *x = rnd(n, 1.0f), *c = malloc(sizeof(float) * T * half), *s = malloc(sizeof(float) * T * half);
    for (int t = 0; t < T; t++)
        for (size_t i = 0; i < half; i++) {
            double th = t * pow(10000.0, -2.0 * (double)i / hd);
            c[t * half + i] = (float)cos(th);
            s[t * half + i] = (float)sin(th);
        }
    for (int inverse = 0; inverse < 2; inverse++) {
        tensor_t gx = up(gpu, gpu->act_dt, x, n), gc = up(gpu, DT_F32, c, T * half);
        tensor_t gs = up(gpu, DT_F32, s, T * half);
        tensor_t cx = up(cpu, DT_F32, x, n), cc = up(cpu, DT_F32, c, T * half);
        tensor_t cs = up(cpu, DT_F32, s, T * half);
        tensor_t gp = {0}, cp = {0};
        if (pos) {
            gp = be_alloc(gpu, DT_I32, (size_t)B * T), cp = be_alloc(cpu, DT_I32, (size_t)B * T);
            cr_assert(gp.p && cp.p);
            be_upload(gpu, gp, pos, DT_I32), be_upload(cpu, cp, pos, DT_I32);
        }
        be_rope(gpu, gx, gc, gs, gp, B, T, nh, hd, inverse);
        be_rope(cpu, cx, cc, cs, cp, B, T, nh, hd, inverse);
        gpu_ok();
        char what[96];
        snprintf(what, sizeof what, "rope B%d T%d nh%d hd%d inverse %d%s", B, T, nh, hd, inverse,
                 pos ? " packed" : "");
        expect_close(what, gx, cx, n, TOL_BF16);
        drop(gpu, &gx), drop(gpu, &gc), drop(gpu, &gs), drop(cpu, &cx), drop(cpu, &cc), drop(cpu, &cs);
        if (pos)
            drop(gpu, &gp), drop(cpu, &cp);
    }
    free(x), free(c), free(s);
}

static void check_rope(int B, int T, int nh, int hd)
{
    check_rope_pos(B, T, nh, hd, NULL);
}

/* Rows of packed documents: document lengths drawn from 1..max_len, so
 * starts fall anywhere (inside and across the 512-row blocks); seg[i] the
 * row index of i's document start, pos[i] its position in the document. */
static void packed_rows(int B, int T, int max_len, int32_t *seg, int32_t *pos)
{
    uint64_t draw = 0;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T;) {
            int len = 1 + (int)(sp_rng_u64(0x5e9, draw++) % (uint64_t)max_len);
            for (int i = t; i < t + len && i < T; i++)
                seg[b * T + i] = t, pos[b * T + i] = i - t;
            t += len;
        }
}

Test(cuda_ops, rope_and_its_inverse)
{
    check_rope(2, 5, 3, 8);
    check_rope(1, 17, 2, 64);
    check_rope(3, 33, 4, 128);
}

Test(cuda_ops, rope_positions_of_packed_documents)
{
    int B = 2, T = 300;
    int32_t *seg = malloc(sizeof(int32_t) * B * T), *pos = malloc(sizeof(int32_t) * B * T);
    packed_rows(B, T, 70, seg, pos);
    check_rope_pos(B, T, 4, 64, pos);
    free(seg), free(pos);
}

/* ---- attention ------------------------------------------------------------------------- */

/* Real shapes: the attention tensors [B,T,heads,hd] are also compared chunk
 * by chunk, (batch row, head, 256 query rows) each against its own largest
 * value, so that a wrong head, kv-head chunk or row block cannot hide behind
 * larger values elsewhere, and as a whole by the relative RMS error
 * ||gpu - cpu|| / ||cpu||.
 *
 * Why these tolerances (bf16): the GPU rounds P to bf16 before P V and the
 * output to bf16 (2^-9 = 2e-3 relative each, random); in the backward dS =
 * P (dP - D) / sqrt(hd) is rounded to bf16 before dS K and dS^T Q, and a
 * row of dS sums to zero (D = rowsum(dO * O) is the P-weighted mean of dP):
 * that cancellation leaves dQ = dS K much smaller than the sum of its terms'
 * sizes while the roundings of dS do not cancel, so dQ and dK carry the
 * largest relative error. A float64 emulation of exactly these roundings
 * (P, O, dS and the outputs rounded to bf16, fp32 sums) on uniform inputs
 * like these gives, at T 2048 hd 128 and T 4096 hd 64: out 3.7-4.0e-3
 * chunkwise and 2.3e-3 RMS; dQ 3.9-4.6e-3 and 2.9e-3; dK 4.1-4.8e-3 and
 * 2.9e-3; dV 4.0e-3 and 2.3e-3. TOL_BLOCK and TOL_RMS are twice the worst of
 * these. A masking error of one key at a row-block boundary already moves a
 * chunk by about 2%; a wrong head or chunk mapping by O(1). lse is F32 from
 * fp32 scores on both sides: TOL_F32 (the emulation: 1e-7). */
#define TOL_BLOCK 1e-2
#define TOL_RMS 6e-3

static void expect_close_chunks(const char *what, tensor_t g, tensor_t c, int B, int T, int heads,
                                int hd)
{
    float *a = down(gpu, g), *b = down(cpu, c);
    size_t n = (size_t)B * T * heads * hd;
    double worst = 0, se = 0, sr = 0;
    int worst_b = 0, worst_h = 0, worst_t = 0;
    for (int bb = 0; bb < B; bb++)
        for (int h = 0; h < heads; h++)
            for (int t0 = 0; t0 < T; t0 += 256) {
                double m = 0, e = 0;
                for (int t = t0; t < T && t < t0 + 256; t++) {
                    size_t base = (((size_t)bb * T + t) * heads + h) * hd;
                    for (int d = 0; d < hd; d++) {
                        double want = b[base + d], diff = fabs((double)a[base + d] - want);
                        if (fabs(want) > m)
                            m = fabs(want);
                        if (diff > e || diff != diff)
                            e = diff != diff ? INFINITY : diff;
                    }
                }
                double r = m > 0 ? e / m : e;
                if (r > worst || r != r)
                    worst = r != r ? INFINITY : r, worst_b = bb, worst_h = h, worst_t = t0;
            }
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        se += d * d;
        sr += (double)b[i] * b[i];
    }
    double rms = sr > 0 ? sqrt(se / sr) : sqrt(se);
    if (rms != rms)
        rms = INFINITY;
    cr_expect(worst <= TOL_BLOCK,
              "%s: chunk (batch %d, head %d, rows %d..%d) rel err %.3g > %.3g", what, worst_b,
              worst_h, worst_t, worst_t + 255, worst, TOL_BLOCK);
    cr_expect(rms <= TOL_RMS, "%s: relative RMS error %.3g > %.3g", what, rms, TOL_RMS);
    fprintf(stderr, "%s: worst chunk %.2e (batch %d head %d rows %d..), RMS %.2e\n", what, worst,
            worst_b, worst_h, worst_t, rms);
    free(a);
    free(b);
}

/* max |x| <= tol (absolute): a tensor that is zero but for rounding */
#define TOL_ZERO 1e-4
static void expect_small(const char *what, tensor_t g, size_t n, double tol)
{
    float *a = down(gpu, g);
    double m = 0;
    for (size_t i = 0; i < n; i++)
        if (fabs((double)a[i]) > m || a[i] != a[i])
            m = a[i] != a[i] ? INFINITY : fabs((double)a[i]);
    cr_expect(m <= tol, "%s: max |x| %.3g > %.3g (should be 0 up to rounding)", what, m, tol);
    free(a);
}

/* seg: packed documents ([B*T] first keys, backend.h), or NULL */
static void check_attention_seg(int B, int T, int nh, int nkv, int hd, int chunks,
                                const int32_t *seg)
{
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    float *q = rnd(nq, 1.5f), *k = rnd(nk, 1.5f), *v = rnd(nk, 1.0f), *dout = rnd(nq, 1.0f);
    dtype_t a = gpu->act_dt;
    tensor_t gq = up(gpu, a, q, nq), gk = up(gpu, a, k, nk), gv = up(gpu, a, v, nk);
    tensor_t go = up(gpu, a, NULL, nq), gl = up(gpu, DT_F32, NULL, nl), gdo = up(gpu, a, dout, nq);
    tensor_t gdq = up(gpu, a, NULL, nq), gdk = up(gpu, a, NULL, nk), gdv = up(gpu, a, NULL, nk);
    tensor_t cq = up(cpu, DT_F32, q, nq), ck = up(cpu, DT_F32, k, nk), cv = up(cpu, DT_F32, v, nk);
    tensor_t co = up(cpu, DT_F32, NULL, nq), cl = up(cpu, DT_F32, NULL, nl);
    tensor_t cdo = up(cpu, DT_F32, dout, nq), cdq = up(cpu, DT_F32, NULL, nq);
    tensor_t cdk = up(cpu, DT_F32, NULL, nk), cdv = up(cpu, DT_F32, NULL, nk);
    tensor_t gsg = {0}, csg = {0};
    if (seg) {
        gsg = be_alloc(gpu, DT_I32, (size_t)B * T), csg = be_alloc(cpu, DT_I32, (size_t)B * T);
        cr_assert(gsg.p && csg.p);
        be_upload(gpu, gsg, seg, DT_I32), be_upload(cpu, csg, seg, DT_I32);
    }
    be_attention_forward(gpu, go, gl, gq, gk, gv, gsg, B, T, nh, nkv, hd);
    be_attention_forward(cpu, co, cl, cq, ck, cv, csg, B, T, nh, nkv, hd);
    gpu_ok();
    char what[128];
    snprintf(what, sizeof what, "attention B%d T%d nh%d nkv%d hd%d%s", B, T, nh, nkv, hd,
             seg ? " packed" : "");
    char w2[160];
    snprintf(w2, sizeof w2, "%s out", what);
    expect_close(w2, go, co, nq, TOL_BF16);
    if (chunks)
        expect_close_chunks(w2, go, co, B, T, nh, hd);
    snprintf(w2, sizeof w2, "%s lse", what);
    expect_close(w2, gl, cl, nl, TOL_F32);
    /* the backward from the same forward output on both sides (the GPU's,
     * rounded to bf16, is what the model keeps) */
    float *o = down(gpu, go);
    be_upload(cpu, co, o, DT_F32);
    free(o);
    be_attention_backward(gpu, gdq, gdk, gdv, gdo, go, gl, gq, gk, gv, gsg, B, T, nh, nkv, hd);
    be_attention_backward(cpu, cdq, cdk, cdv, cdo, co, cl, cq, ck, cv, csg, B, T, nh, nkv, hd);
    gpu_ok();
    if (T == 1) {
        /* one key: P = 1 and dS = P (dP - D) = 0, so dq and dk are rounding
         * noise on both sides (no relative comparison); inputs are O(1) */
        expect_small("attention T1 dq", gdq, nq, TOL_ZERO);
        expect_small("attention T1 dk", gdk, nk, TOL_ZERO);
    } else {
        snprintf(w2, sizeof w2, "%s dq", what);
        expect_close(w2, gdq, cdq, nq, TOL_BF16);
        if (chunks)
            expect_close_chunks(w2, gdq, cdq, B, T, nh, hd);
        snprintf(w2, sizeof w2, "%s dk", what);
        expect_close(w2, gdk, cdk, nk, TOL_BF16);
        if (chunks)
            expect_close_chunks(w2, gdk, cdk, B, T, nkv, hd);
    }
    snprintf(w2, sizeof w2, "%s dv", what);
    expect_close(w2, gdv, cdv, nk, TOL_BF16);
    if (chunks)
        expect_close_chunks(w2, gdv, cdv, B, T, nkv, hd);
    tensor_t gs[] = {gq, gk, gv, go, gl, gdo, gdq, gdk, gdv};
    tensor_t cs[] = {cq, ck, cv, co, cl, cdo, cdq, cdk, cdv};
    for (int i = 0; i < 9; i++)
        drop(gpu, &gs[i]), drop(cpu, &cs[i]);
    if (seg)
        drop(gpu, &gsg), drop(cpu, &csg);
    free(q), free(k), free(v), free(dout);
}

static void check_attention_at(int B, int T, int nh, int nkv, int hd, int chunks)
{
    check_attention_seg(B, T, nh, nkv, hd, chunks, NULL);
}

static void check_attention(int B, int T, int nh, int nkv, int hd)
{
    check_attention_at(B, T, nh, nkv, hd, 0);
}

Test(cuda_ops, attention_small_and_odd_shapes)
{
    check_attention(1, 1, 1, 1, 8);
    check_attention(2, 7, 6, 2, 8);   /* grouped: 3 query heads per kv head */
    check_attention(1, 33, 4, 4, 16);
    check_attention(2, 65, 8, 2, 32);
    check_attention(1, 11, 3, 1, 5);  /* odd head_dim, one kv head */
}

/* Packed documents (data.packing): short rows, and rows whose documents
 * cross the 512-row blocks, against the CPU backend's masked attention
 * (itself checked against a per-document reference in tests/test_ops.c). */
Test(cuda_ops, attention_packed_documents)
{
    int32_t *seg = malloc(sizeof(int32_t) * 2 * 1031), *pos = malloc(sizeof(int32_t) * 2 * 1031);
    packed_rows(2, 37, 9, seg, pos);
    check_attention_seg(2, 37, 6, 2, 16, 0, seg);
    packed_rows(2, 1031, 400, seg, pos);
    check_attention_seg(2, 1031, 4, 2, 64, 1, seg);
    free(seg), free(pos);
}

Test(cuda_ops, attention_several_row_blocks)
{
    check_attention(1, 600, 2, 1, 64);  /* T > 512: two query-row blocks */
    check_attention(2, 1031, 4, 2, 64); /* three blocks, odd T */
}

/* The shapes of real models, checked chunk by chunk (expect_close_chunks):
 * four 512-row blocks per head at T 2048, eight at T 4096; the backward's
 * kv heads in chunks (e.g. 21 + 11 heads at 7B), and the batched products
 * whose outputs interleave across heads. */
static void skip_if_reduced(void)
{
    if (cuda_test_reduced_shapes())
        cr_skip_test("real shapes skipped: SPOTUNE_TEST_SHAPES=reduced");
}

Test(cuda_ops, attention_llama2_7b_shape_t2048_32_heads_hd128)
{
    skip_if_reduced();
    check_attention_at(1, 2048, 32, 32, 128, 1);
}

Test(cuda_ops, attention_llama3_8b_gqa_shape_t2048_32_heads_8_kv_hd128)
{
    skip_if_reduced();
    check_attention_at(1, 2048, 32, 8, 128, 1);
}

Test(cuda_ops, attention_t4096_hd64_32_heads_8_kv)
{
    skip_if_reduced();
    check_attention_at(1, 4096, 32, 8, 64, 1);
}

/* ---- the fused kernels (kernels/cuda/cuda_flash.cu) ---------------------------------
 * BF16 with hd 64 or 128 runs the fused FlashAttention-2 kernels (the shapes
 * above with hd 64 and 128 do too). Here the odd shapes: T 1, 7, 37, 130 (the
 * forward's 64-row and 64-key tiles and the dK/dV kernel's 32-row tiles all
 * partial), GQA groups 1, 4, 8, with and without packed documents (up to 50
 * tokens, crossing tiles), against the CPU backend chunk by chunk, with the
 * tolerances of the unfused path (same roundings: P and dS to bf16). */
static void check_flash_shapes(int hd, int packed)
{
    static const int Ts[] = {1, 7, 37, 130};
    static const int heads[][2] = {{2, 2}, {4, 1}, {8, 1}};
    int32_t seg[2 * 130], pos[2 * 130];
    for (int i = 0; i < 4; i++)
        for (int g = 0; g < 3; g++) {
            if (packed)
                packed_rows(2, Ts[i], 50, seg, pos);
            check_attention_seg(2, Ts[i], heads[g][0], heads[g][1], hd, 1, packed ? seg : NULL);
        }
}

Test(cuda_ops, flash_attention_odd_shapes_hd64)
{
    check_flash_shapes(64, 0);
}

Test(cuda_ops, flash_attention_odd_shapes_hd128)
{
    check_flash_shapes(128, 0);
}

Test(cuda_ops, flash_attention_odd_shapes_packed_documents)
{
    check_flash_shapes(64, 1);
    check_flash_shapes(128, 1);
}

/* out, lse, dq, dk, dv of one forward + backward on the GPU (host copies). */
typedef struct gpu_attn {
    float *o[5];
} gpu_attn;

static gpu_attn gpu_attention(const float *q, const float *k, const float *v, const float *dout,
                              const int32_t *seg, int B, int T, int nh, int nkv, int hd)
{
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    dtype_t a = gpu->act_dt;
    tensor_t gq = up(gpu, a, q, nq), gk = up(gpu, a, k, nk), gv = up(gpu, a, v, nk);
    tensor_t go = up(gpu, a, NULL, nq), gl = up(gpu, DT_F32, NULL, nl), gdo = up(gpu, a, dout, nq);
    tensor_t gdq = up(gpu, a, NULL, nq), gdk = up(gpu, a, NULL, nk), gdv = up(gpu, a, NULL, nk);
    tensor_t gsg = {0};
    if (seg) {
        gsg = be_alloc(gpu, DT_I32, (size_t)B * T);
        cr_assert(gsg.p);
        be_upload(gpu, gsg, seg, DT_I32);
    }
    be_attention_forward(gpu, go, gl, gq, gk, gv, gsg, B, T, nh, nkv, hd);
    be_attention_backward(gpu, gdq, gdk, gdv, gdo, go, gl, gq, gk, gv, gsg, B, T, nh, nkv, hd);
    gpu_ok();
    gpu_attn r;
    tensor_t outs[5] = {go, gl, gdq, gdk, gdv};
    for (int i = 0; i < 5; i++)
        r.o[i] = down(gpu, outs[i]);
    tensor_t gs[] = {gq, gk, gv, go, gl, gdo, gdq, gdk, gdv};
    for (int i = 0; i < 9; i++)
        drop(gpu, &gs[i]);
    if (seg)
        drop(gpu, &gsg);
    return r;
}

/* The fused kernels have no atomics: two runs give the same bits. The
 * unfused path (SPOTUNE_CUDA_ATTENTION=unfused) agrees within TOL_BF16
 * (lse TOL_F32) but not bit for bit (other summation orders), which also
 * shows that the fused kernels ran in the first place. */
Test(cuda_ops, flash_attention_is_deterministic_and_agrees_with_unfused)
{
    int B = 2, T = 300, nh = 8, nkv = 2, hd = 128;
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    size_t ns[5] = {nq, nl, nq, nk, nk};
    const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
    float *q = rnd(nq, 1.5f), *k = rnd(nk, 1.5f), *v = rnd(nk, 1.0f), *dout = rnd(nq, 1.0f);
    int32_t seg[2 * 300], pos[2 * 300];
    packed_rows(B, T, 120, seg, pos);
    gpu_attn a = gpu_attention(q, k, v, dout, seg, B, T, nh, nkv, hd);
    gpu_attn b = gpu_attention(q, k, v, dout, seg, B, T, nh, nkv, hd);
    cr_assert_eq(setenv("SPOTUNE_CUDA_ATTENTION", "unfused", 1), 0);
    gpu_attn u = gpu_attention(q, k, v, dout, seg, B, T, nh, nkv, hd);
    unsetenv("SPOTUNE_CUDA_ATTENTION");
    int differs = 0;
    for (int i = 0; i < 5; i++) {
        cr_expect(memcmp(a.o[i], b.o[i], sizeof(float) * ns[i]) == 0, "fused %s: runs differ",
                  names[i]);
        double e = rel_err(a.o[i], u.o[i], ns[i]), tol = i == 1 ? TOL_F32 : TOL_BF16;
        cr_expect(e <= tol, "fused vs unfused %s: rel err %.3g > %.3g", names[i], e, tol);
        differs |= memcmp(a.o[i], u.o[i], sizeof(float) * ns[i]) != 0;
    }
    if (!cuda_test_standin()) /* a stand-in backend has one attention */
        cr_expect(differs,
                  "fused and unfused results are bit-identical: the fused kernels did not run");
    for (int i = 0; i < 5; i++)
        free(a.o[i]), free(b.o[i]), free(u.o[i]);
    free(q), free(k), free(v), free(dout);
}

/* ---- SwiGLU ------------------------------------------------------------------------- */

Test(cuda_ops, swiglu_forward_and_backward)
{
    size_t sizes[] = {1, 1000, 4097};
    for (int s = 0; s < 3; s++) {
        size_t n = sizes[s];
        float *g = rnd(n, 4.0f), *u = rnd(n, 2.0f), *d = rnd(n, 1.0f);
        dtype_t a = gpu->act_dt;
        tensor_t gg = up(gpu, a, g, n), gu = up(gpu, a, u, n), gd = up(gpu, a, d, n);
        tensor_t go = up(gpu, a, NULL, n), gdg = up(gpu, a, NULL, n), gdu = up(gpu, a, NULL, n);
        tensor_t cg = up(cpu, DT_F32, g, n), cu = up(cpu, DT_F32, u, n), cd = up(cpu, DT_F32, d, n);
        tensor_t co = up(cpu, DT_F32, NULL, n), cdg = up(cpu, DT_F32, NULL, n);
        tensor_t cdu = up(cpu, DT_F32, NULL, n);
        be_swiglu_forward(gpu, go, gg, gu, n);
        be_swiglu_forward(cpu, co, cg, cu, n);
        be_swiglu_backward(gpu, gdg, gdu, gd, gg, gu, n);
        be_swiglu_backward(cpu, cdg, cdu, cd, cg, cu, n);
        gpu_ok();
        expect_close("swiglu out", go, co, n, TOL_BF16);
        expect_close("swiglu dg", gdg, cdg, n, TOL_BF16);
        expect_close("swiglu du", gdu, cdu, n, TOL_BF16);
        tensor_t gs[] = {gg, gu, gd, go, gdg, gdu}, cs[] = {cg, cu, cd, co, cdg, cdu};
        for (int i = 0; i < 6; i++)
            drop(gpu, &gs[i]), drop(cpu, &cs[i]);
        free(g), free(u), free(d);
    }
}

/* ---- embedding ---------------------------------------------------------------------- */

Test(cuda_ops, embedding_forward_and_backward)
{
    int vocab = 50, H = 48, n = 37;
    float *table = rnd((size_t)vocab * H, 1.0f), *dout = rnd((size_t)n * H, 1.0f);
    float *dt0 = rnd((size_t)vocab * H, 0.1f);
    int32_t tok[37];
    for (int i = 0; i < n; i++)
        tok[i] = (int32_t)(sp_rng_u64(3, i) % 12); /* repeats: the backward sums them */
    tok[5] = vocab - 1;
    tensor_t gt = up(gpu, gpu->act_dt, table, (size_t)vocab * H);
    tensor_t gi = be_alloc(gpu, DT_I32, n), ci = be_alloc(cpu, DT_I32, n);
    be_upload(gpu, gi, tok, DT_I32);
    be_upload(cpu, ci, tok, DT_I32);
    tensor_t go = up(gpu, gpu->act_dt, NULL, (size_t)n * H), gd = up(gpu, gpu->act_dt, dout, (size_t)n * H);
    tensor_t gdt = up(gpu, DT_F32, dt0, (size_t)vocab * H);
    tensor_t ct = up(cpu, DT_F32, table, (size_t)vocab * H), co = up(cpu, DT_F32, NULL, (size_t)n * H);
    tensor_t cd = up(cpu, DT_F32, dout, (size_t)n * H), cdt = up(cpu, DT_F32, dt0, (size_t)vocab * H);
    be_embedding_forward(gpu, go, gt, gi, n, H);
    be_embedding_forward(cpu, co, ct, ci, n, H);
    be_embedding_backward(gpu, gdt, gd, gi, n, H);
    be_embedding_backward(cpu, cdt, cd, ci, n, H);
    gpu_ok();
    expect_close("embedding out", go, co, (size_t)n * H, 0.0); /* a gather: exact */
    expect_close("embedding dtable (+=)", gdt, cdt, (size_t)vocab * H, TOL_F32);
    tensor_t gs[] = {gt, gi, go, gd, gdt}, cs[] = {ct, ci, co, cd, cdt};
    for (int i = 0; i < 5; i++)
        drop(gpu, &gs[i]), drop(cpu, &cs[i]);
    free(table), free(dout), free(dt0);
}

/* ---- cross-entropy --------------------------------------------------------------------- */

static void check_cross_entropy(int rows, int V, float grad_scale, float spread)
{
    size_t n = (size_t)rows * V;
    float *x = rnd(n, spread);
    int32_t *tg = malloc(sizeof(int32_t) * rows);
    for (int r = 0; r < rows; r++)
        tg[r] = (int32_t)(sp_rng_u64(9, r) % (uint64_t)V);
    if (rows > 2)
        tg[1] = -1; /* ignored */
    if (rows > 3)
        tg[2] = V - 1;
    tensor_t gx = up(gpu, gpu->act_dt, x, n), gl = up(gpu, DT_F32, NULL, rows);
    tensor_t cx = up(cpu, DT_F32, x, n), cl = up(cpu, DT_F32, NULL, rows);
    tensor_t gt = be_alloc(gpu, DT_I32, rows), ct = be_alloc(cpu, DT_I32, rows);
    be_upload(gpu, gt, tg, DT_I32);
    be_upload(cpu, ct, tg, DT_I32);
    be_cross_entropy(gpu, gx, gl, gt, rows, V, grad_scale);
    be_cross_entropy(cpu, cx, cl, ct, rows, V, grad_scale);
    gpu_ok();
    char what[96];
    snprintf(what, sizeof what, "cross_entropy %dx%d scale %g loss", rows, V, grad_scale);
    expect_close(what, gl, cl, rows, TOL_F32);
    snprintf(what, sizeof what, "cross_entropy %dx%d scale %g dlogits", rows, V, grad_scale);
    expect_close(what, gx, cx, n, TOL_BF16);
    if (rows > 2) { /* the ignored row: loss 0, dlogits 0 */
        float *h = down(gpu, gx), *l = down(gpu, gl);
        cr_expect_eq(l[1], 0.0f);
        for (int i = 0; i < V; i++)
            cr_expect_eq(h[(size_t)V + i], 0.0f);
        free(h), free(l);
    }
    drop(gpu, &gx), drop(gpu, &gl), drop(gpu, &gt), drop(cpu, &cx), drop(cpu, &cl), drop(cpu, &ct);
    free(x), free(tg);
}

Test(cuda_ops, cross_entropy_loss_and_dlogits_in_place)
{
    check_cross_entropy(1, 1, 1.0f, 1.0f);
    check_cross_entropy(5, 97, 0.25f, 3.0f);
    check_cross_entropy(3, 32000, 1.0f, 8.0f);
    check_cross_entropy(4, 128256, 0.5f, 4.0f);
    check_cross_entropy(7, 333, 0.0f, 2.0f); /* evaluation: loss only, zero gradient */
}

/* ---- elementwise and bias ------------------------------------------------------------- */

Test(cuda_ops, add_add_bias_and_bias_backward)
{
    size_t n = 1001;
    float *y = rnd(n, 1.0f), *x = rnd(n, 1.0f);
    tensor_t gy = up(gpu, gpu->act_dt, y, n), gx = up(gpu, gpu->act_dt, x, n);
    tensor_t cy = up(cpu, DT_F32, y, n), cx = up(cpu, DT_F32, x, n);
    be_add(gpu, gy, gx, -0.7f, n);
    be_add(cpu, cy, cx, -0.7f, n);
    gpu_ok();
    expect_close("add", gy, cy, n, TOL_BF16);
    drop(gpu, &gy), drop(gpu, &gx), drop(cpu, &cy), drop(cpu, &cx);
    free(y), free(x);

    static const int shapes[][2] = {{7, 33}, {300, 45}, {1, 1}, {129, 1000}};
    for (int s = 0; s < 4; s++) {
        int rows = shapes[s][0], cols = shapes[s][1];
        size_t m = (size_t)rows * cols;
        float *Y = rnd(m, 1.0f), *b = rnd(cols, 1.0f), *db0 = rnd(cols, 0.5f);
        tensor_t gY = up(gpu, gpu->act_dt, Y, m), gb = up(gpu, gpu->act_dt, b, cols);
        tensor_t gdb = up(gpu, DT_F32, db0, cols);
        tensor_t cY = up(cpu, DT_F32, Y, m), cb = up(cpu, DT_F32, b, cols);
        tensor_t cdb = up(cpu, DT_F32, db0, cols);
        be_bias_backward(gpu, gdb, gY, rows, cols);
        be_bias_backward(cpu, cdb, cY, rows, cols);
        be_add_bias(gpu, gY, gb, rows, cols);
        be_add_bias(cpu, cY, cb, rows, cols);
        gpu_ok();
        char what[64];
        snprintf(what, sizeof what, "add_bias %dx%d", rows, cols);
        expect_close(what, gY, cY, m, TOL_BF16);
        snprintf(what, sizeof what, "bias_backward %dx%d (+=)", rows, cols);
        expect_close(what, gdb, cdb, cols, TOL_F32);
        drop(gpu, &gY), drop(gpu, &gb), drop(gpu, &gdb), drop(cpu, &cY), drop(cpu, &cb), drop(cpu, &cdb);
        free(Y), free(b), free(db0);
    }
}

/* ---- DoRA: weight_norm, col_scale, col_dot ----------------------------------------------- */

/* The inputs are bf16 values (rnd), so both sides see the same numbers: the
 * F32 outputs (norms, the column dots) within TOL_F32, col_scale's output
 * stored in act_dt within TOL_BF16. */
Test(cuda_ops, dora_weight_norm_col_scale_and_col_dot)
{
    static const int shapes[][4] = {{7, 9, 3, 5}, {300, 45, 8, 129}, {1, 1, 1, 1}, {64, 1000, 16, 33}};
    for (int s = 0; s < 4; s++) {
        int out = shapes[s][0], in = shapes[s][1], r = shapes[s][2], rows = shapes[s][3];
        size_t nw = (size_t)out * in, na = (size_t)r * in, nb = (size_t)out * r;
        size_t ny = (size_t)rows * out;
        float *W = rnd(nw, 1.0f), *A = rnd(na, 1.0f), *B = rnd(nb, 1.0f), *Y = rnd(ny, 1.0f);
        float *X = rnd(ny, 1.0f), *num = rnd((size_t)out, 1.0f), *den = rnd((size_t)out, 1.0f);
        float *acc = rnd((size_t)out, 1.0f);
        for (int o = 0; o < out; o++)
            den[o] = 0.5f + fabsf(den[o]);
        tensor_t gW = up(gpu, gpu->act_dt, W, nw), gA = up(gpu, gpu->act_dt, A, na);
        tensor_t gB = up(gpu, gpu->act_dt, B, nb), gn = up(gpu, DT_F32, den, (size_t)out);
        tensor_t cW = up(cpu, DT_F32, W, nw), cA = up(cpu, DT_F32, A, na);
        tensor_t cB = up(cpu, DT_F32, B, nb), cn = up(cpu, DT_F32, den, (size_t)out);
        be_weight_norm(gpu, gn, gW, gA, gB, 0.5f, out, in, r);
        be_weight_norm(cpu, cn, cW, cA, cB, 0.5f, out, in, r);
        gpu_ok();
        char what[96];
        snprintf(what, sizeof what, "weight_norm %dx%d r %d", out, in, r);
        expect_close(what, gn, cn, (size_t)out, TOL_F32);
        be_weight_norm(gpu, gn, gW, (tensor_t){0}, (tensor_t){0}, 0.5f, out, in, 0);
        be_weight_norm(cpu, cn, cW, (tensor_t){0}, (tensor_t){0}, 0.5f, out, in, 0);
        gpu_ok();
        snprintf(what, sizeof what, "weight_norm %dx%d r 0", out, in);
        expect_close(what, gn, cn, (size_t)out, TOL_F32);

        tensor_t gY = up(gpu, gpu->act_dt, Y, ny), gX = up(gpu, gpu->act_dt, X, ny);
        tensor_t gnum = up(gpu, gpu->act_dt, num, (size_t)out), gden = up(gpu, DT_F32, den, (size_t)out);
        tensor_t gacc = up(gpu, DT_F32, acc, (size_t)out);
        tensor_t cY = up(cpu, DT_F32, Y, ny), cX = up(cpu, DT_F32, X, ny);
        tensor_t cnum = up(cpu, DT_F32, num, (size_t)out), cden = up(cpu, DT_F32, den, (size_t)out);
        tensor_t cacc = up(cpu, DT_F32, acc, (size_t)out);
        be_col_dot(gpu, gacc, gX, gY, gden, rows, out);
        be_col_dot(cpu, cacc, cX, cY, cden, rows, out);
        be_col_scale(gpu, gY, gnum, gden, rows, out);
        be_col_scale(cpu, cY, cnum, cden, rows, out);
        gpu_ok();
        snprintf(what, sizeof what, "col_dot %dx%d (+=)", rows, out);
        expect_close(what, gacc, cacc, (size_t)out, TOL_F32);
        snprintf(what, sizeof what, "col_scale %dx%d", rows, out);
        expect_close(what, gY, cY, ny, TOL_BF16);
        tensor_t *g[] = {&gW, &gA, &gB, &gn, &gY, &gX, &gnum, &gden, &gacc};
        tensor_t *c[] = {&cW, &cA, &cB, &cn, &cY, &cX, &cnum, &cden, &cacc};
        for (int i = 0; i < 9; i++)
            drop(gpu, g[i]), drop(cpu, c[i]);
        free(W), free(A), free(B), free(Y), free(X), free(num), free(den), free(acc);
    }
}

/* ---- dequant_nf4: the CPU's values, bit for bit ------------------------------------------ */

/* The F32 output bit-identical to the CPU backend's (every product and the
 * sum rounded once, no fused multiply-add); the BF16 output the F32 value
 * rounded to BF16 (to_bf16). Sizes: one partial block and an odd count, two
 * nested blocks. */
Test(cuda_ops, dequant_nf4_bit_identical_to_the_cpu)
{
    static const size_t sizes[] = {37, 16384 + 3 * 64 + 37};
    for (int s = 0; s < 2; s++) {
        size_t n = sizes[s], nb = nf4_blocks(n), nn = nf4_nested_blocks(n);
        float *x = rnd(n, 0.1f), *absmax = malloc(sizeof(float) * nb);
        float *nested = malloc(sizeof(float) * nn), maps[272];
        uint8_t *codes = malloc(nf4_code_bytes(n)), *q = malloc(nb);
        cr_assert(absmax && nested && codes && q);
        nf4_quantize_codes(x, n, codes, absmax);
        float offset = nf4_absmax_offset(absmax, nb);
        nf4_quantize_absmax(absmax, nb, offset, nf4_dynamic_map, q, nested);
        memcpy(maps, nf4_quant_map, sizeof nf4_quant_map);
        memcpy(maps + 16, nf4_dynamic_map, sizeof nf4_dynamic_map);
        backend_t *bes[2] = {gpu, cpu};
        tensor_t out[3];
        for (int k = 0; k < 2; k++) {
            tensor_t tc = be_alloc(bes[k], DT_U8, nf4_code_bytes(n)), tq = be_alloc(bes[k], DT_U8, nb);
            tensor_t tn = up(bes[k], DT_F32, nested, nn), tm = up(bes[k], DT_F32, maps, 272);
            be_upload(bes[k], tc, codes, DT_U8);
            be_upload(bes[k], tq, q, DT_U8);
            out[k] = up(bes[k], DT_F32, NULL, n);
            be_dequant_nf4(bes[k], out[k], tc, tq, tn, tm, offset, n);
            if (k == 0) {
                out[2] = up(gpu, gpu->act_dt, NULL, n);
                be_dequant_nf4(gpu, out[2], tc, tq, tn, tm, offset, n);
            }
            gpu_ok();
            drop(bes[k], &tc), drop(bes[k], &tq), drop(bes[k], &tn), drop(bes[k], &tm);
        }
        float *g = down(gpu, out[0]), *c = down(cpu, out[1]), *gb = down(gpu, out[2]);
        cr_expect(memcmp(g, c, sizeof(float) * n) == 0, "n %zu: F32 not bit-identical", n);
        for (size_t i = 0; i < n; i++)
            cr_expect(gb[i] == to_bf16(c[i]), "n %zu [%zu]: bf16 %g, cpu %g", n, i, gb[i], c[i]);
        drop(gpu, &out[0]), drop(cpu, &out[1]), drop(gpu, &out[2]);
        free(x), free(absmax), free(nested), free(codes), free(q), free(g), free(c), free(gb);
    }
}

/* ---- dropout: the CPU's mask, bit for bit ----------------------------------------------- */

static void check_dropout(size_t n, float p, uint64_t seed, uint64_t offset, dtype_t dt,
                          int in_place)
{
    float *x = rnd(n, 2.0f);
    for (size_t i = 0; i < n; i += 7)
        x[i] = 1.0f; /* no value that is zero by chance */
    tensor_t gi = up(gpu, dt, x, n), go = in_place ? gi : up(gpu, dt, NULL, n);
    tensor_t ci = up(cpu, DT_F32, x, n), co = up(cpu, DT_F32, NULL, n);
    be_dropout(gpu, go, gi, n, p, seed, offset);
    be_dropout(cpu, co, ci, n, p, seed, offset);
    gpu_ok();
    float *g = down(gpu, go), *c = down(cpu, co);
    size_t bad = 0, kept = 0;
    for (size_t i = 0; i < n; i++) {
        float want = dt == DT_BF16 ? to_bf16(c[i]) : c[i];
        bad += memcmp(&g[i], &want, 4) != 0;
        kept += c[i] != 0.0f;
    }
    cr_expect_eq(bad, 0, "dropout n %zu p %g %s: %zu values differ from the CPU's", n, p,
                 dtype_name(dt), bad);
    if (p > 0 && n > 1000)
        cr_expect(fabs((double)kept / n - (1.0 - p)) < 0.05, "kept %zu of %zu at p %g", kept, n, p);
    free(g), free(c), free(x);
    if (!in_place)
        drop(gpu, &go);
    drop(gpu, &gi), drop(cpu, &ci), drop(cpu, &co);
}

Test(cuda_ops, dropout_masks_match_the_cpu_bit_for_bit)
{
    check_dropout(10007, 0.1f, 42, 0, DT_F32, 0);
    check_dropout(10007, 0.5f, sp_rng_stream(7, 0x2001), (uint64_t)3 << 40, DT_F32, 0);
    check_dropout(4099, 0.3f, 99, 12345, DT_BF16, 0);
    check_dropout(4099, 0.3f, 99, 12345, DT_BF16, 1); /* in place: the backward on a gradient */
    check_dropout(513, 0.0f, 1, 0, DT_BF16, 0);       /* p == 0 copies */
}

/* ---- sumsq ------------------------------------------------------------------------------ */

Test(cuda_ops, sumsq_matches_and_is_deterministic)
{
    size_t sizes[] = {1, 8191, 8193, 1000003};
    for (int s = 0; s < 4; s++) {
        size_t n = sizes[s];
        float *x = malloc(sizeof(float) * n);
        for (size_t i = 0; i < n; i++)
            x[i] = (float)sp_rng_normal(11, i) * 1e-3f;
        tensor_t g = up(gpu, DT_F32, x, n), c = up(cpu, DT_F32, x, n);
        double a = be_sumsq(gpu, g, n), b = be_sumsq(cpu, c, n);
        double a2 = be_sumsq(gpu, g, n);
        gpu_ok();
        cr_expect(fabs(a - b) <= 1e-10 * fabs(b), "sumsq n %zu: %.17g vs %.17g", n, a, b);
        cr_expect(memcmp(&a, &a2, sizeof a) == 0, "sumsq n %zu differs between calls", n);
        drop(gpu, &g), drop(cpu, &c);
        free(x);
    }
}

/* ---- AdamW ----------------------------------------------------------------------------- */

static void check_adamw(size_t n, int64_t step, float wd, float grad_scale, int with_copy)
{
    float *p = rnd(n, 1.0f), *g = rnd(n, 0.1f), *m = rnd(n, 0.01f), *v = rnd(n, 0.001f);
    for (size_t i = 0; i < n; i++)
        v[i] = fabsf(v[i]);
    tensor_t gp = up(gpu, DT_F32, p, n), gg = up(gpu, DT_F32, g, n), gm = up(gpu, DT_F32, m, n);
    tensor_t gv = up(gpu, DT_F32, v, n), gc = up(gpu, DT_BF16, NULL, n);
    tensor_t cp = up(cpu, DT_F32, p, n), cg = up(cpu, DT_F32, g, n), cm = up(cpu, DT_F32, m, n);
    tensor_t cv = up(cpu, DT_F32, v, n);
    adamw_args a = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                    .weight_decay = wd, .grad_scale = grad_scale, .step = step};
    tensor_t none = {0};
    be_adamw(gpu, gp, with_copy ? gc : none, gg, gm, gv, n, &a);
    be_adamw(cpu, cp, none, cg, cm, cv, n, &a);
    gpu_ok();
    expect_close("adamw param", gp, cp, n, 1e-6);
    expect_close("adamw m", gm, cm, n, 1e-6);
    expect_close("adamw v", gv, cv, n, 1e-6);
    if (with_copy) { /* the bf16 compute copy is the rounded master */
        float *master = down(gpu, gp);
        uint16_t *copy = malloc(2 * n);
        be_d2h(gpu, copy, gc.p, 2 * n);
        size_t bad = 0;
        for (size_t i = 0; i < n; i++)
            bad += copy[i] != sp_f32_to_bf16(master[i]);
        cr_expect_eq(bad, 0, "%zu copy values are not the rounded master", bad);
        free(master), free(copy);
    }
    tensor_t gs[] = {gp, gg, gm, gv, gc}, cs[] = {cp, cg, cm, cv};
    for (int i = 0; i < 5; i++)
        drop(gpu, &gs[i]);
    for (int i = 0; i < 4; i++)
        drop(cpu, &cs[i]);
    free(p), free(g), free(m), free(v);
}

Test(cuda_ops, adamw_updates_master_moments_and_copy)
{
    check_adamw(1000, 1, 0.0f, 1.0f, 1);
    check_adamw(4097, 10, 0.1f, 0.5f, 1);
    check_adamw(33, 1000, 0.01f, 1.0f, 0);
}

/* ---- fills: the CPU's numbers ---------------------------------------------------------- */

static void check_fill(int normal, size_t n, uint64_t seed, uint64_t offset, float a, float b,
                       dtype_t dt)
{
    tensor_t g = up(gpu, dt, NULL, n), c = up(cpu, DT_F32, NULL, n);
    if (normal) {
        be_fill_normal(gpu, g, n, a, b, seed, offset);
        be_fill_normal(cpu, c, n, a, b, seed, offset);
    } else {
        be_fill_uniform(gpu, g, n, a, b, seed, offset);
        be_fill_uniform(cpu, c, n, a, b, seed, offset);
    }
    gpu_ok();
    float *hg = down(gpu, g), *hc = down(cpu, c);
    size_t bad = 0, first = 0;
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        float want = dt == DT_BF16 ? to_bf16(hc[i]) : hc[i];
        if (normal) {
            double d = fabs((double)hg[i] - want);
            double tol = dt == DT_BF16 ? fabs(want) / 128.0 + 1e-30 : 1e-6 * fmax(1.0, fabs(want));
            if (d > worst)
                worst = d;
            if (d > tol && !bad++)
                first = i;
        } else if (memcmp(&hg[i], &want, 4) != 0 && !bad++) {
            first = i;
        }
    }
    cr_expect_eq(bad, 0, "fill_%s %s n %zu: %zu values differ (first at %zu: %.9g vs %.9g), worst %g",
                 normal ? "normal" : "uniform", dtype_name(dt), n, bad, first, hg[first], hc[first],
                 worst);
    free(hg), free(hc);
    drop(gpu, &g), drop(cpu, &c);
}

Test(cuda_ops, fill_uniform_is_the_cpu_bit_for_bit)
{
    check_fill(0, 100003, 5, 0, -0.25f, 0.25f, DT_F32);
    check_fill(0, 4097, sp_rng_stream(3, 0x1002), 777, -1.0f / 7.0f, 1.0f / 7.0f, DT_F32);
    check_fill(0, 4097, 8, 1, -2.0f, 3.0f, DT_BF16);
    check_fill(0, 100, 0, 0, 1.0f, 1.0f, DT_BF16); /* the model's constant fills */
}

Test(cuda_ops, fill_normal_within_1e_6)
{
    check_fill(1, 100003, 17, 0, 0.0f, 0.02f, DT_F32);
    check_fill(1, 100003, 18, 5, 1.0f, 1.0f, DT_F32);
    check_fill(1, 4097, 19, 0, 0.0f, 0.02f, DT_BF16);
}

/* ---- main: skip (77, with the CUDA error) without a usable device -------------------- */

int main(int argc, char *argv[])
{
    return cuda_test_main(argc, argv);
}

/* ---- argument checks ------------------------------------------------------------------ */

/* The malformed calls of tests/op_checks.c: refused with the messages the
 * CPU backends give (test_ops.c), changing no device memory. */
Test(cuda_ops, malformed_calls_are_refused_as_on_the_cpu)
{
    int on_gpu = op_checks_run(gpu), on_cpu = op_checks_run(cpu);
    cr_expect_gt(on_gpu, 150, "only %d malformed calls checked", on_gpu);
    cr_expect_eq(on_gpu, on_cpu);
}

Test(cuda_ops, ids_and_targets_outside_the_table_as_on_the_cpu)
{
    op_checks_ids_outside(gpu);
    op_checks_ids_outside(cpu);
}

/* What only a backend that computes in BF16 can be asked: operands of two
 * float dtypes, and a float dtype it does not compute in. */
Test(cuda_ops, mixed_and_foreign_float_dtypes_are_refused)
{
    tensor_t f = up(gpu, DT_F32, NULL, 64), b = up(gpu, DT_BF16, NULL, 64);
    tensor_t h = up(gpu, DT_F16, NULL, 64);
    be_matmul(gpu, f, b, f, 4, 4, 4, 0, 1, 1.0f, 0.0f);
    op_checks_expect_refused(gpu, "matmul: A is BF16 and B is F32: the operands share one dtype",
                             __FILE__, "matmul of BF16 by F32");
    be_attention_forward(gpu, f, f, f, b, b, (tensor_t){0}, 1, 4, 2, 2, 4);
    op_checks_expect_refused(gpu,
                             "attention_forward: q is F32 and k is BF16: q, k, v and out share "
                             "one dtype",
                             __FILE__, "attention of F32 q and BF16 k");
    be_add(gpu, f, h, 1.0f, 64);
    op_checks_expect_refused(gpu, "add: x has dtype F16; this backend computes in F32 and BF16",
                             __FILE__, "add of F16");
    drop(gpu, &f), drop(gpu, &b), drop(gpu, &h);
}
