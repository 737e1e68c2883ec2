/* Every op of the CUDA backend but RoPE and attention
 * (tests/test_cuda_attention.c) against its CPU twin, on several shapes
 * including odd ones, forward and backward: the backend itself (memory
 * plan, streams, allocation, copies, sticky errors), RMSNorm, SwiGLU,
 * embedding, cross-entropy, add and bias, dropout, sumsq, AdamW and the
 * fills; and the malformed calls of tests/op_checks.c, refused as on the
 * CPU. matmul, DoRA's norms and scales and dequant_nf4 are in
 * test_cuda_ops_weights.c, built into this binary (this file's suite,
 * fixture and main).
 *
 * Tolerances: TOL_BF16 and TOL_F32 (cuda_ops_util.h);
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

#include "cuda_ops_util.h"
#include "cuda_test_main.h"
#include "kernels/backend.h"
#include "op_checks.h"
#include "op_specs.h"

TestSuite(cuda_ops, .init = cuda_ops_setup, .fini = cuda_ops_teardown, .timeout = 300);

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

/* Made with the attention by cuDNN asked for, the backend's workspace for
 * the memory plan holds cuDNN's workspace budget where the fused kernels'
 * 256 MiB would not (SPOTUNE_CUDNN_WORKSPACE_BUDGET, 512 MiB unless set). */
Test(cuda_ops, the_workspace_planned_holds_cudnn_s_budget)
{
    if (cuda_test_standin())
        cr_skip_test("a stand-in backend has no cuDNN path");
    const size_t mib = (size_t)1 << 20;
    size_t fused = gpu->workspace_bytes;
    static const char *const budgets[] = {NULL, "1073741824", "1048576"};
    const size_t want[] = {fused + 256 * mib, fused + 768 * mib, fused};
    for (int i = 0; i < 3; i++) {
        backend_t *be = NULL;
        sp_err err = {0};
        setenv("SPOTUNE_CUDA_ATTENTION", "cudnn", 1);
        if (budgets[i])
            setenv("SPOTUNE_CUDNN_WORKSPACE_BUDGET", budgets[i], 1);
        else
            unsetenv("SPOTUNE_CUDNN_WORKSPACE_BUDGET");
        cr_assert_eq(backend_create(&be, "cuda", 0, 1, &err), 0, "%s", err.msg);
        unsetenv("SPOTUNE_CUDA_ATTENTION");
        cr_expect_eq(be->workspace_bytes, want[i], "budget %s: workspace %zu MiB, not %zu",
                     budgets[i] ? budgets[i] : "unset", be->workspace_bytes / mib,
                     want[i] / mib);
        backend_destroy(be);
    }
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

/* The host's waits for the device, as a wait hook records them (backend.h
 * wait_hook: the trainer's watchdog watches them when gradients cross
 * GPUs): each wait is announced with its name before it and closed after
 * it; work the host does not wait for (a launch, an async copy) is not. */
static char hook_log[512];

static void record_wait(void *ctx, const char *what)
{
    size_t n = strlen(hook_log);
    snprintf(hook_log + n, sizeof hook_log - n, "%s%s", n ? " " : "", what ? what : "/");
    (void)ctx;
}

Test(cuda_ops, host_waits_are_announced_to_the_wait_hook)
{
    if (cuda_test_standin())
        cr_skip_test("a stand-in backend never waits for a device");
    tensor_t t = be_alloc(gpu, DT_F32, 4096);
    cr_assert(t.p);
    float *h = be_host_alloc(gpu, sizeof(float) * 4096);
    cr_assert(h);
    for (int i = 0; i < 4096; i++)
        h[i] = 0.5f;
    hook_log[0] = 0;
    gpu->wait_hook = record_wait;
    be_zero(gpu, t);
    be_upload_staged(gpu, t, h);
    cr_expect_str_empty(hook_log, "a launch or an async copy waited: %s", hook_log);
    be_staged_wait(gpu);
    be_sync(gpu);
    double ss = be_sumsq(gpu, t, t.n);
    be_d2h(gpu, h, t.p, sizeof(float) * 16);
    be_h2d(gpu, t.p, h, sizeof(float) * 16);
    be_free(gpu, &t);
    gpu->wait_hook = NULL;
    cr_expect_str_eq(hook_log, "h2d_wait / sync / sumsq / d2h / h2d / cudaFree /",
                     "the waits announced");
    cr_expect_float_eq(ss, 4096 * 0.25, 1e-9, "sumsq %g", ss);
    be_host_free(gpu, h);
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
        be_swiglu_forward(gpu, go, gg, gu, 1, (int)n, (int)n);
        be_swiglu_forward(cpu, co, cg, cu, 1, (int)n, (int)n);
        be_swiglu_backward(gpu, gdg, gdu, gd, gg, gu, 1, (int)n, (int)n);
        be_swiglu_backward(cpu, cdg, cdu, cd, cg, cu, 1, (int)n, (int)n);
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
    tensor_t go32 = up(gpu, DT_F32, dout, (size_t)n * H), gdt2 = up(gpu, DT_F32, dt0, (size_t)vocab * H);
    tensor_t gord, gruns, cord, cruns;
    op_embedding_order(gpu, tok, n, &gord, &gruns);
    op_embedding_order(cpu, tok, n, &cord, &cruns);
    be_embedding_forward(gpu, go, gt, gi, n, H);
    be_embedding_forward(cpu, co, ct, ci, n, H);
    be_embedding_backward(gpu, gdt, gd, gi, gord, gruns, n, H);
    be_embedding_backward(cpu, cdt, cd, ci, cord, cruns, n, H);
    gpu_ok();
    expect_close("embedding out", go, co, (size_t)n * H, 0.0); /* a gather: exact */
    expect_close("embedding dtable (+=)", gdt, cdt, (size_t)vocab * H, TOL_F32);
    /* no atomics: from F32 gradients, the CPU's bits (each id's rows summed
     * in position order, then added) */
    be_embedding_backward(gpu, gdt2, go32, gi, gord, gruns, n, H);
    gpu_ok();
    expect_close("embedding dtable from F32 (bit for bit)", gdt2, cdt, (size_t)vocab * H, 0.0);
    tensor_t gs[] = {gt, gi, go, gd, gdt, go32, gdt2, gord, gruns},
             cs[] = {ct, ci, co, cd, cdt, cord, cruns};
    for (int i = 0; i < 9; i++)
        drop(gpu, &gs[i]);
    for (int i = 0; i < 7; i++)
        drop(cpu, &cs[i]);
    free(table), free(dout), free(dt0);
}

/* ---- cross-entropy --------------------------------------------------------------------- */

/* dev: the GPU side takes half of grad_scale as its argument and the factor
 * 2 from device memory (the scale a captured step reads), the CPU the whole */
static void check_cross_entropy_dev(int rows, int V, float grad_scale, float spread, int dev)
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
    tensor_t two = {0};
    if (dev) {
        float f = 2.0f;
        two = up(gpu, DT_F32, &f, 1);
    }
    be_cross_entropy(gpu, gx, gl, gt, rows, V, dev ? grad_scale / 2 : grad_scale, two);
    be_cross_entropy(cpu, cx, cl, ct, rows, V, grad_scale, (tensor_t){0});
    if (dev)
        drop(gpu, &two);
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

static void check_cross_entropy(int rows, int V, float grad_scale, float spread)
{
    check_cross_entropy_dev(rows, V, grad_scale, spread, 0);
}

Test(cuda_ops, cross_entropy_scale_from_device_memory)
{
    check_cross_entropy_dev(5, 97, 0.25f, 3.0f, 1);
    check_cross_entropy_dev(4, 32000, 1.0f / 8192, 4.0f, 1);
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

/* ---- dropout: the CPU's mask, bit for bit ----------------------------------------------- */

/* split != 0: the GPU side's seed is seed - split plus split read from
 * device memory (the seed a captured step reads), the CPU's seed whole */
static void check_dropout_dev(size_t n, float p, uint64_t seed, uint64_t offset, dtype_t dt,
                              int in_place, uint64_t split)
{
    float *x = rnd(n, 2.0f);
    for (size_t i = 0; i < n; i += 7)
        x[i] = 1.0f; /* no value that is zero by chance */
    tensor_t gi = up(gpu, dt, x, n), go = in_place ? gi : up(gpu, dt, NULL, n);
    tensor_t ci = up(cpu, DT_F32, x, n), co = up(cpu, DT_F32, NULL, n);
    tensor_t sd = {0};
    if (split) {
        sd = be_alloc(gpu, DT_I32, 2);
        be_upload(gpu, sd, &split, DT_I32);
    }
    be_dropout(gpu, go, gi, n, p, seed - split, sd, offset);
    be_dropout(cpu, co, ci, n, p, seed, (tensor_t){0}, offset);
    if (split)
        drop(gpu, &sd);
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

static void check_dropout(size_t n, float p, uint64_t seed, uint64_t offset, dtype_t dt,
                          int in_place)
{
    check_dropout_dev(n, p, seed, offset, dt, in_place, 0);
}

Test(cuda_ops, dropout_seed_from_device_memory)
{
    check_dropout_dev(10007, 0.1f, 42, 0, DT_F32, 0, 40);
    /* the whole seed on the device, wrapping mod 2^64; the vector kernel */
    check_dropout_dev(4096, 0.3f, sp_rng_stream(7, 0x2001), (uint64_t)5 << 40, DT_BF16, 0,
                      sp_rng_stream(7, 0x2001) + 17);
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

/* The update with its values in device memory (adamw_args.hyper, sumsq;
 * a captured step's) gives the bits of the same update with the host's
 * values, on the scalar and the vector kernel (n 33 and 4096), with the
 * bf16 copy; a sum that is not finite updates nothing. And sumsq_into
 * writes be_sumsq's double. */
static void check_adamw_dev(size_t n, double sumsq, double max_norm, int64_t step)
{
    float *p = rnd(n, 1.0f), *g = rnd(n, 0.1f), *m = rnd(n, 0.01f), *v = rnd(n, 0.001f);
    for (size_t i = 0; i < n; i++)
        v[i] = fabsf(v[i]);
    adamw_args a = {.lr = 2e-4f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                    .weight_decay = 0.1f, .step = step};
    float hyper[3];
    adamw_hyper(&a, hyper);
    tensor_t th = up(gpu, DT_F32, hyper, 3), ts = up(gpu, DT_F32, NULL, 2);
    be_h2d(gpu, ts.p, &sumsq, sizeof sumsq);
    tensor_t gp[2], gg[2], gm[2], gv[2], gc[2];
    for (int k = 0; k < 2; k++) {
        gp[k] = up(gpu, DT_F32, p, n), gg[k] = up(gpu, DT_F32, g, n);
        gm[k] = up(gpu, DT_F32, m, n), gv[k] = up(gpu, DT_F32, v, n);
        gc[k] = up(gpu, gpu->act_dt, NULL, n); /* the compute copy: bf16 */
    }
    adamw_args ha = a, da = a;
    ha.grad_scale = (float)adamw_clip_scale(sqrt(sumsq), max_norm);
    da.lr = 1.0f, da.step = 9, da.grad_scale = 7.0f; /* unused */
    da.hyper = th, da.sumsq = ts, da.max_norm = max_norm;
    if (isfinite(sumsq))
        be_adamw(gpu, gp[0], gc[0], gg[0], gm[0], gv[0], n, &ha);
    be_adamw(gpu, gp[1], gc[1], gg[1], gm[1], gv[1], n, &da);
    gpu_ok();
    tensor_t *all[] = {gp, gm, gv};
    const char *names[] = {"param", "m", "v"};
    for (int j = 0; j < 3; j++) {
        float *h0 = down(gpu, all[j][0]), *h1 = down(gpu, all[j][1]);
        cr_expect_eq(memcmp(h0, h1, sizeof(float) * n), 0,
                     "adamw n %zu sumsq %g: %s from device memory differs from the host's", n,
                     sumsq, names[j]);
        free(h0), free(h1);
    }
    size_t cb = n * dtype_size(gpu->act_dt);
    unsigned char *c0 = malloc(cb), *c1 = malloc(cb);
    be_d2h(gpu, c0, gc[0].p, cb);
    be_d2h(gpu, c1, gc[1].p, cb);
    cr_expect_eq(memcmp(c0, c1, cb), 0, "adamw n %zu: the compute copies differ", n);
    free(c0), free(c1);
    for (int k = 0; k < 2; k++)
        drop(gpu, &gp[k]), drop(gpu, &gg[k]), drop(gpu, &gm[k]), drop(gpu, &gv[k]),
            drop(gpu, &gc[k]);
    drop(gpu, &th), drop(gpu, &ts);
    free(p), free(g), free(m), free(v);
}

Test(cuda_ops, adamw_reads_its_step_values_from_device_memory)
{
    check_adamw_dev(33, 4.0, 1.0, 3);
    check_adamw_dev(4096, 4.0, 1.0, 3);
    check_adamw_dev(4096, 0.25, 1.0, 1);
    check_adamw_dev(4096, 9.0, 0.0, 100);
    check_adamw_dev(4096, NAN, 1.0, 2);
    check_adamw_dev(33, INFINITY, 1.0, 2);
    /* sumsq_into: be_sumsq's double in device memory */
    size_t n = 100003;
    float *x = rnd(n, 1.0f);
    tensor_t tx = up(gpu, DT_F32, x, n), out = up(gpu, DT_F32, NULL, 2);
    be_sumsq_into(gpu, out, tx, n);
    double got, want = be_sumsq(gpu, tx, n);
    be_d2h(gpu, &got, out.p, sizeof got);
    gpu_ok();
    cr_expect_eq(memcmp(&got, &want, sizeof got), 0, "sumsq_into %.17g, sumsq %.17g", got, want);
    drop(gpu, &tx), drop(gpu, &out);
    free(x);
}

/* sum_add (the step's loss sum in device memory): one thread in the host's
 * order, so the CPU's bits, twice accumulating; and staged uploads
 * (pinned memory, the copy enqueued without waiting, after the work before
 * it): written again only after be_staged_wait, each round's values
 * arrive, enqueued behind a reduction of 16M elements. */
Test(cuda_ops, sum_add_and_staged_uploads)
{
    size_t n = 65537;
    float *x = rnd(n, 1.0f);
    for (size_t i = 0; i < n; i++)
        x[i] = ldexpf(x[i], (int)(i % 41) - 20);
    tensor_t gx = up(gpu, DT_F32, x, n), cx = up(cpu, DT_F32, x, n);
    tensor_t ga = up(gpu, DT_F32, NULL, 2), ca = up(cpu, DT_F32, NULL, 2);
    for (int k = 0; k < 2; k++) {
        be_sum_add(gpu, ga, gx, n);
        be_sum_add(cpu, ca, cx, n);
    }
    double got, want;
    be_d2h(gpu, &got, ga.p, sizeof got);
    be_d2h(cpu, &want, ca.p, sizeof want);
    gpu_ok();
    cr_expect_eq(memcmp(&got, &want, sizeof got), 0, "sum_add %.17g, the CPU's %.17g", got, want);

    size_t m = 4099;
    int32_t *h = be_host_alloc(gpu, sizeof(int32_t) * m);
    cr_assert(h, "no pinned memory");
    tensor_t t = up(gpu, DT_I32, NULL, m), big = up(gpu, DT_F32, NULL, (size_t)1 << 24);
    for (int round = 0; round < 4; round++) {
        be_staged_wait(gpu);
        for (size_t i = 0; i < m; i++)
            h[i] = (int32_t)(i * 3 + (size_t)round * 7919);
        be_sumsq_into(gpu, ga, big, (size_t)1 << 24); /* work ahead of the copy */
        be_upload_staged(gpu, t, h);
        int32_t *back = malloc(sizeof(int32_t) * m);
        be_download(gpu, back, DT_I32, t);
        size_t bad = 0;
        for (size_t i = 0; i < m; i++)
            bad += back[i] != (int32_t)(i * 3 + (size_t)round * 7919);
        cr_expect_eq(bad, 0, "round %d: %zu staged values differ", round, bad);
        free(back);
    }
    be_staged_wait(gpu);
    be_host_free(gpu, h);
    gpu_ok();
    drop(gpu, &gx), drop(gpu, &ga), drop(gpu, &t), drop(gpu, &big);
    drop(cpu, &cx), drop(cpu, &ca);
    free(x);
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

/* Every op's valid call captured as a CUDA graph and launched gives what
 * it gives eagerly (tests/op_checks.c, op_checks_replay): bit for bit. */
Test(cuda_ops, every_op_replays_as_a_cuda_graph)
{
    int n = op_checks_replay(gpu);
    cr_expect_eq(n, 34, "%d ops checked", n);
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
