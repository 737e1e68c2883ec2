/* The CPU ops around a step's randomness and its update, on the fast path
 * and the reference path (the suite "ops" of tests/test_ops.c, its fixture
 * in ops_util.c): dropout (its mask a pure function of the seed, the seed
 * from device memory), sumsq (exact, thread-independent, written to device
 * memory), AdamW (PyTorch's formula; its step values from device memory),
 * and the fills' distributions. Tolerances: ops_util.h, or as stated. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "ops_util.h"

/* The seed from device memory adds to the argument, mod 2^64. */
Test(ops, dropout_seed_from_device_memory)
{
    size_t n = 4097;
    float *x = rnd(n, 2);
    uint64_t seed = 0x9e3779b97f4a7c15ULL;
    tensor_t tx = dev(x, n), want = dev(NULL, n), got = dev(NULL, n);
    tensor_t sd = talloc(DT_I32, 2);
    be_dropout(be, want, tx, n, 0.3f, seed, (tensor_t){0}, 77);
    float *hw = host(want);
    uint64_t parts[][2] = {{0, seed}, {seed - 5, 5}, {seed + 9, (uint64_t)0 - 9}};
    for (int k = 0; k < 3; k++) {
        be_upload(be, sd, &parts[k][1], DT_I32);
        be_dropout(be, got, tx, n, 0.3f, parts[k][0], sd, 77);
        float *hg = host(got);
        cr_expect_eq(memcmp(hg, hw, sizeof(float) * n), 0, "seed split %d draws another mask",
                     k);
        free(hg);
    }
    be_upload(be, sd, &seed, DT_I32);
    be_dropout(be, got, tx, n, 0.3f, 1, sd, 77);
    float *h1 = host(got);
    cr_expect_neq(memcmp(h1, hw, sizeof(float) * n), 0, "seed + 1 drew the same mask");
    free(h1), free(x), free(hw);
}

/* ---- dropout, sumsq, adamw, fills --------------------------------------------- */

Test(ops, dropout_mask_is_a_pure_function)
{
    size_t n = 100000;
    float *x = rnd(n, 1);
    tensor_t tx = dev(x, n), a = dev(NULL, n), b = dev(NULL, n);
    be_dropout(be, a, tx, n, 0.25f, 77, (tensor_t){0}, 1000);
    be_dropout(be, b, tx, n, 0.25f, 77, (tensor_t){0}, 1000);
    float *ha = host(a), *hb = host(b);
    cr_expect_eq(memcmp(ha, hb, sizeof(float) * n), 0, "same stream, same mask");
    size_t dropped = 0;
    for (size_t i = 0; i < n; i++) {
        if (ha[i] == 0.0f)
            dropped++;
        else
            cr_assert_lt(fabsf(ha[i] - x[i] / 0.75f), 1e-6f);
    }
    /* binomial(1e5, 0.25): sd ~ 137; 6 sd */
    cr_expect_lt(fabs((double)dropped - 25000.0), 822.0, "dropped %zu", dropped);
    be_dropout(be, b, tx, n, 0.0f, 77, (tensor_t){0}, 1000);
    float *hc = host(b);
    cr_expect_eq(memcmp(hc, x, sizeof(float) * n), 0, "p = 0 copies");
    free(x), free(ha), free(hb), free(hc);
}

Test(ops, sumsq_is_exact_and_thread_independent)
{
    size_t n = 1000003;
    float *x = rnd(n, 3);
    double want = 0;
    for (size_t i = 0; i < n; i++)
        want += (double)x[i] * x[i];
    tensor_t tx = dev(x, n);
    double got = be_sumsq(be, tx, n);
    cr_expect_lt(fabs(got - want), 1e-9 * want);
    backend_t *one;
    sp_err err = {0};
    backend_create(&one, "cpu", 0, 1, &err);
    double got1 = be_sumsq(one, tx, n);
    cr_expect_eq(got, got1, "1 thread %.17g vs 2 threads %.17g", got1, got);
    backend_destroy(one);
    free(x);
}

Test(ops, adamw_matches_the_pytorch_formula)
{
    size_t n = 257;
    float *p = rnd(n, 1), *g = rnd(n, 1), *m = rnd(n, 0.1f), *v = rnd(n, 0.1f);
    for (size_t i = 0; i < n; i++)
        v[i] = fabsf(v[i]);
    adamw_args a = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f,
                    .grad_scale = 0.5f, .step = 3};
    tensor_t tp = dev(p, n), tg = dev(g, n), tm = dev(m, n), tv = dev(v, n);
    be_adamw(be, tp, (tensor_t){0}, tg, tm, tv, n, &a);
    float *hp = host(tp);
    double *want = malloc(sizeof(double) * n);
    for (size_t i = 0; i < n; i++) {
        double gi = g[i] * 0.5, mi = 0.9 * m[i] + 0.1 * gi, vi = 0.95 * v[i] + 0.05 * gi * gi;
        double pi = p[i] * (1 - 1e-2 * 0.1);
        double bc1 = 1 - pow(0.9, 3), bc2 = 1 - pow(0.95, 3);
        want[i] = pi - 1e-2 / bc1 * mi / (sqrt(vi) / sqrt(bc2) + 1e-8);
    }
    cr_expect_lt(rel_err(hp, want, n), 1e-6);
    free(p), free(g), free(m), free(v), free(hp), free(want);
}

/* The sum of squares written to device memory: be_sumsq's double, bit for
 * bit (n = 0 included: 0). */
Test(ops, sumsq_into_writes_the_sum_in_device_memory)
{
    size_t sizes[] = {0, 1, 8193, 100003};
    tensor_t out = talloc(DT_F32, 2);
    for (int k = 0; k < 4; k++) {
        size_t n = sizes[k];
        float *x = rnd(n ? n : 1, 2.0f);
        tensor_t tx = dev(x, n ? n : 1);
        be_sumsq_into(be, out, tx, n);
        double got, want = be_sumsq(be, tx, n);
        be_d2h(be, &got, out.p, sizeof got);
        cr_expect_eq(memcmp(&got, &want, sizeof got), 0, "n %zu: %.17g in memory, %.17g returned",
                     n, got, want);
        free(x);
    }
}

/* sum_add: acc += the sum of x taken in order from 0.0 in double, the bits
 * of that loop on the host (the trainer's loss sum); twice adds twice, and
 * n = 0 adds nothing. Values of mixed magnitudes and signs, so another
 * order would round differently (checked: reversed differs). */
Test(ops, sum_add_adds_the_host_loops_bits)
{
    size_t sizes[] = {0, 1, 2049, 65536};
    tensor_t acc = talloc(DT_F32, 2);
    for (int k = 0; k < 4; k++) {
        size_t n = sizes[k];
        float *x = rnd(n ? n : 1, 2.0f);
        for (size_t i = 0; i < n; i++)
            x[i] = ldexpf(x[i], (int)(i % 41) - 20);
        tensor_t tx = dev(x, n ? n : 1);
        double start = 3.25 + (double)k, once = 0.0, reversed = 0.0;
        for (size_t i = 0; i < n; i++)
            once += x[i], reversed += x[n - 1 - i];
        be_h2d(be, acc.p, &start, sizeof start);
        be_sum_add(be, acc, tx, n);
        double got, want = start + once;
        be_d2h(be, &got, acc.p, sizeof got);
        cr_expect_eq(memcmp(&got, &want, sizeof got), 0, "n %zu: %.17g, the loop's %.17g", n, got,
                     want);
        be_sum_add(be, acc, tx, n);
        be_d2h(be, &got, acc.p, sizeof got);
        want += once;
        cr_expect_eq(memcmp(&got, &want, sizeof got), 0, "n %zu twice: %.17g, %.17g", n, got,
                     want);
        if (n == 65536)
            cr_expect_neq(once, reversed, "the values do not tell the order apart");
        free(x);
    }
    cr_expect_eq(be->err.code, 0, "%s", be->err.msg);
}

/* Staged uploads (pinned memory on CUDA): the values arrive as be_upload's
 * do, into a view too; after be_staged_wait the host buffer is written
 * again for the next copy; a NULL source is refused by name. */
Test(ops, staged_uploads_arrive_as_uploads)
{
    size_t n = 1001;
    int32_t *h = be_host_alloc(be, sizeof(int32_t) * 2 * n);
    cr_assert(h);
    tensor_t t = talloc(DT_I32, 2 * n);
    for (int round = 0; round < 3; round++) {
        be_staged_wait(be);
        for (size_t i = 0; i < 2 * n; i++)
            h[i] = (int32_t)(i * 7 + (size_t)round * 100003);
        be_upload_staged(be, tensor_view(t, 0, n), h);
        be_upload_staged(be, tensor_view(t, n, n), h + n);
        int32_t *got = malloc(sizeof(int32_t) * 2 * n);
        be_download(be, got, DT_I32, t);
        for (size_t i = 0; i < 2 * n; i++)
            if (got[i] != (int32_t)(i * 7 + (size_t)round * 100003)) {
                cr_expect_fail("round %d: element %zu is %d", round, i, got[i]);
                break;
            }
        free(got);
    }
    be_staged_wait(be);
    be_host_free(be, h);
    cr_expect_eq(be->err.code, 0, "%s", be->err.msg);
    be_upload_staged(be, t, NULL);
    cr_expect(strstr(be->err.msg, "h2d: src is NULL"), "%s", be->err.msg);
}

/* AdamW with its learning rate, bias corrections and the gradient's sum of
 * squares in device memory (a captured step's update) gives the bits of the
 * host's values (adamw_hyper, and grad_scale = adamw_clip_scale of the
 * norm): the clip on, off, and disabled (max_norm 0), the compute copy
 * written; a sum that is not finite updates nothing. */
static void adamw_dev_case(double sumsq, double max_norm, int64_t step, float wd)
{
    size_t n = 301;
    float *p = rnd(n, 1), *g = rnd(n, 1), *m = rnd(n, 0.1f), *v = rnd(n, 0.1f);
    for (size_t i = 0; i < n; i++)
        v[i] = fabsf(v[i]);
    adamw_args a = {.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                    .weight_decay = wd, .step = step};
    float hyper[3];
    adamw_hyper(&a, hyper);
    tensor_t th = dev(hyper, 3), ts = talloc(DT_F32, 2);
    be_h2d(be, ts.p, &sumsq, sizeof sumsq);
    tensor_t tp[2], tg[2], tm[2], tv[2], tc[2];
    for (int k = 0; k < 2; k++) {
        tp[k] = dev(p, n), tg[k] = dev(g, n), tm[k] = dev(m, n), tv[k] = dev(v, n);
        tc[k] = dev(NULL, n);
    }
    adamw_args host_args = a, dev_args = a;
    host_args.grad_scale = (float)adamw_clip_scale(sqrt(sumsq), max_norm);
    dev_args.grad_scale = 123.0f; /* unused: the sum in memory decides */
    dev_args.lr = 9.0f;           /* unused: hyper decides */
    dev_args.step = 77;
    dev_args.hyper = th;
    dev_args.sumsq = ts;
    dev_args.max_norm = max_norm;
    if (isfinite(sumsq))
        be_adamw(be, tp[0], tc[0], tg[0], tm[0], tv[0], n, &host_args);
    be_adamw(be, tp[1], tc[1], tg[1], tm[1], tv[1], n, &dev_args);
    sp_err err = {0};
    cr_assert_eq(be_check(be, &err), 0, "%s", err.msg);
    const char *names[] = {"param", "m", "v", "copy"};
    tensor_t *ts4[] = {tp, tm, tv, tc};
    for (int j = 0; j < 4; j++) {
        float *h0 = host(ts4[j][0]), *h1 = host(ts4[j][1]);
        cr_expect_eq(memcmp(h0, h1, sizeof(float) * n), 0,
                     "sumsq %g max_norm %g step %lld: %s differs from the host values' update",
                     sumsq, max_norm, (long long)step, names[j]);
        free(h0), free(h1);
    }
    if (isfinite(sumsq)) { /* and it did update */
        float *h = host(tp[1]);
        cr_expect_neq(memcmp(h, p, sizeof(float) * n), 0, "nothing was updated");
        free(h);
    }
    free(p), free(g), free(m), free(v);
}

Test(ops, adamw_reads_its_step_values_from_device_memory)
{
    adamw_dev_case(4.0, 1.0, 3, 0.1f);   /* norm 2 clipped to 1 */
    adamw_dev_case(0.25, 1.0, 1, 0.0f);  /* within the bound */
    adamw_dev_case(100.0, 0.0, 500, 0.01f); /* clipping disabled */
    adamw_dev_case(NAN, 1.0, 2, 0.1f);   /* not finite: nothing changes */
    adamw_dev_case(INFINITY, 0.0, 2, 0.1f);
}

Test(ops, fills_have_the_right_distribution)
{
    size_t n = 200000;
    tensor_t t = dev(NULL, n);
    be_fill_uniform(be, t, n, -0.5f, 1.5f, 9, 0);
    float *u = host(t);
    double mean = 0;
    for (size_t i = 0; i < n; i++) {
        cr_assert(u[i] >= -0.5f && u[i] < 1.5f);
        mean += u[i];
    }
    /* sd of the mean: (2/sqrt 12)/sqrt n = 1.3e-3; 6 sd */
    cr_expect_lt(fabs(mean / n - 0.5), 8e-3);
    be_fill_normal(be, t, n, 1.0f, 0.02f, 9, 0);
    float *g = host(t);
    double s = 0, ss = 0;
    for (size_t i = 0; i < n; i++) {
        s += g[i];
        ss += (double)(g[i] - 1.0) * (g[i] - 1.0);
    }
    cr_expect_lt(fabs(s / n - 1.0), 6 * 0.02 / sqrt((double)n));
    cr_expect_lt(fabs(sqrt(ss / n) - 0.02), 0.02 * 0.02);
    free(u), free(g);
}
