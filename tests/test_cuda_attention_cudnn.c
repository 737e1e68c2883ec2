/* tests/test_cuda_attention_cudnn.c — the attention by cuDNN's fused
 * attention (SPOTUNE_CUDA_ATTENTION=cudnn, kernels/cuda/cuda_cudnn.cu): its
 * fallback to the fused kernels, and where cuDNN runs, its results against
 * the CPU. Part of test_cuda_attention (the same binary and suite: its
 * fixture, main and shared checks are test_cuda_attention.c's and
 * cuda_attention_util.h's). Tolerances: TOL_BF16 and TOL_F32
 * (cuda_ops_util.h). */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_attention_util.h"
#include "cuda_ops_util.h"
#include "cuda_test_main.h"
#include "kernels/backend.h"

/* Whether cuDNN runs attention on this backend (cuda_cudnn_status; why
 * says its version or why not) and how many calls it has run so far. */
static int cudnn_usable(char *why, size_t n, long *calls)
{
    char err[256];
    void *st = backend_cuda_symbol("cuda_cudnn_status", err, sizeof err);
    void *ca = backend_cuda_symbol("cuda_cudnn_calls", err, sizeof err);
    if (!st || !ca) {
        snprintf(why, n, "the backend has no cuDNN path: %s", err);
        *calls = 0;
        return 0;
    }
    int (*status)(backend_t *, char *, size_t);
    long (*ran)(backend_t *);
    memcpy(&status, &st, sizeof status);
    memcpy(&ran, &ca, sizeof ran);
    *calls = ran(gpu);
    return status(gpu, why, n);
}

/* Asked for and not run (packed documents, which no cuDNN graph here
 * takes; on a device without cuDNN, every call): the fused kernels run
 * the call instead, the same bits as without the request, and cuDNN's
 * count does not move. */
Test(cuda_ops, attention_by_cudnn_falls_back_to_the_fused_kernels)
{
    if (cuda_test_standin())
        cr_skip_test("a stand-in backend has one attention");
    int B = 2, T = 150, nh = 8, nkv = 2, hd = 128;
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    size_t ns[5] = {nq, nl, nq, nk, nk};
    const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
    char why[320];
    long before, after;
    int usable = cudnn_usable(why, sizeof why, &before);
    if (strstr(gpu->device_name, "emulated"))
        cr_expect(!usable && strstr(why, "emulated device has no cuDNN"),
                  "the emulated device reports cuDNN %s: %s", usable ? "usable" : "unusable", why);
    for (int packed = 0; packed < 2; packed++) {
        if (!packed && usable)
            continue; /* cuDNN runs these: attention_by_cudnn_matches_the_cpu */
        attn_in in = attn_inputs(B, T, nh, nkv, hd, packed ? 60 : 0);
        gpu_attn d = gpu_attention(in.q, in.k, in.v, in.dout, in.seg, B, T, nh, nkv, hd);
        cr_assert_eq(setenv("SPOTUNE_CUDA_ATTENTION", "cudnn", 1), 0);
        gpu_attn c = gpu_attention(in.q, in.k, in.v, in.dout, in.seg, B, T, nh, nkv, hd);
        unsetenv("SPOTUNE_CUDA_ATTENTION");
        for (int i = 0; i < 5; i++)
            cr_expect(memcmp(d.o[i], c.o[i], sizeof(float) * ns[i]) == 0,
                      "%s: %s with cuDNN asked for differs from the fused kernels' (rel err "
                      "%.3g)", packed ? "packed" : "dense", names[i], rel_err(c.o[i], d.o[i], ns[i]));
        for (int i = 0; i < 5; i++)
            free(d.o[i]), free(c.o[i]);
        attn_inputs_free(&in);
    }
    cudnn_usable(why, sizeof why, &after);
    cr_expect_eq(after, before, "cuDNN ran %ld call(s) it should have left", after - before);
}

/* Where cuDNN runs (a GPU with libcudnn.so.9; skipped, with the reason,
 * elsewhere): its forward and backward against the CPU backend at the
 * tolerances of the fused kernels' tests (out, dq, dk, dv TOL_BF16 of the
 * largest value, lse TOL_F32), two calls counted for each shape (so no
 * fallback passes for it): odd T, head dims 64 and 128, query groups 1, 4
 * and 8, and the 7B shape with full shapes; q, k, v as the column blocks
 * of the fused product's output (and dq, dk, dv of its gradient; query
 * groups of 4) within TOL_BF16 of the contiguous call, counted too; the
 * same step twice the same bits (the deterministic backward). */
Test(cuda_ops, attention_by_cudnn_matches_the_cpu)
{
    char why[320];
    long c0, c1;
    if (!cudnn_usable(why, sizeof why, &c0))
        cr_skip_test("cuDNN does not run attention here: %s", why);
    cr_log_info("attention by %s", why);
    /* (a graph each, built on first use: kept few, as cuDNN may compile
     * kernels for them; the column blocks below are query groups of 4) */
    static const int shapes[][5] = {{2, 37, 4, 1, 64}, {1, 130, 8, 1, 128}, {1, 257, 4, 4, 128}};
    cr_assert_eq(setenv("SPOTUNE_CUDA_ATTENTION", "cudnn", 1), 0);
    for (int i = 0; i < 3; i++) {
        check_attention(shapes[i][0], shapes[i][1], shapes[i][2], shapes[i][3], shapes[i][4]);
        cudnn_usable(why, sizeof why, &c1);
        cr_expect_eq(c1 - c0, 2, "shape %d: cuDNN ran %ld of its 2 calls (%s)", i, c1 - c0, why);
        c0 = c1;
    }
    if (!cuda_test_reduced_shapes()) {
        check_attention_at(1, 2048, 32, 32, 128, 1);
        cudnn_usable(why, sizeof why, &c1);
        cr_expect_eq(c1 - c0, 2, "7B shape: cuDNN ran %ld of its 2 calls", c1 - c0);
    }
    int B = 2, T = 150, nh = 8, nkv = 2, hd = 128, ok = 0;
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    size_t ns[5] = {nq, nl, nq, nk, nk};
    const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
    attn_in in = attn_inputs(B, T, nh, nkv, hd, 0);
    gpu_attn a = gpu_attention(in.q, in.k, in.v, in.dout, NULL, B, T, nh, nkv, hd);
    gpu_attn b = gpu_attention(in.q, in.k, in.v, in.dout, NULL, B, T, nh, nkv, hd);
    cudnn_usable(why, sizeof why, &c0);
    gpu_attn st = gpu_attention_strided(in.q, in.k, in.v, in.dout, NULL, B, T, nh, nkv, hd, 8, &ok);
    cudnn_usable(why, sizeof why, &c1);
    unsetenv("SPOTUNE_CUDA_ATTENTION");
    cr_expect_eq(c1 - c0, 2, "column blocks (the trainer's layout): cuDNN ran %ld of its 2 calls",
                 c1 - c0);
    cr_expect(ok, "cuDNN on column blocks: a padding column or q/k/v changed");
    for (int i = 0; i < 5; i++) {
        double e = rel_err(st.o[i], a.o[i], ns[i]), tol = i == 1 ? TOL_F32 : TOL_BF16;
        cr_expect(e <= tol, "cuDNN strided %s: rel err %.3g > %.3g", names[i], e, tol);
        cr_expect(memcmp(a.o[i], b.o[i], sizeof(float) * ns[i]) == 0,
                  "cuDNN %s: two runs differ", names[i]);
    }
    for (int i = 0; i < 5; i++)
        free(a.o[i]), free(b.o[i]), free(st.o[i]);
    attn_inputs_free(&in);
}
