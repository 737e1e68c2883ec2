/* The CUDA backend's products and the ops on weights against the CPU twin
 * (the rest of test_cuda_ops, in the same binary and suite: its fixture and
 * main are test_cuda_ops.c's): matmul (every transpose, alpha and beta, F32
 * operands, K = 0, strided column blocks, separate C and D, bit-for-bit
 * repeats; the narrow products of cuda_skinny.cu with every split count,
 * the wide ones of cuda_wide.cu),
 * DoRA's weight norm, column scale and column dot, and
 * dequant_nf4 and quantize_nf4 (the CPU's values, bit for bit).
 *
 * Tolerances: TOL_BF16 and TOL_F32 (cuda_ops_util.h). */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_ops_util.h"
#include "kernels/backend.h"
#include "kernels/nf4.h"

static double tol_for(dtype_t dt)
{
    return dt == DT_BF16 ? TOL_BF16 : TOL_F32;
}

/* ---- matmul -------------------------------------------------------------------------- */

/* pad > 0: A, B and C stored with row strides beyond their widths
 * (be_matmul_ld, the batched LoRA's column blocks), compared whole, the
 * columns outside C's block included */
static void check_matmul_pad(int M, int N, int K, int ta, int tb, float alpha, float beta,
                             dtype_t cdt, dtype_t abdt, int pad)
{
    int lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + 2 * pad, ldc = N + 3 * pad;
    size_t na = (size_t)(ta ? K : M) * lda, nb = (size_t)(tb ? N : K) * ldb, nc = (size_t)M * ldc;
    float *A = rnd(na, 1.0f), *B = rnd(nb, 1.0f), *C = rnd(nc, 1.0f);
    tensor_t gA = up(gpu, abdt, A, na), gB = up(gpu, abdt, B, nb), gC = up(gpu, cdt, C, nc);
    tensor_t cA = up(cpu, DT_F32, A, na), cB = up(cpu, DT_F32, B, nb), cC = up(cpu, DT_F32, C, nc);
    be_matmul_ld(gpu, gC, gA, gB, M, N, K, ta, tb, alpha, beta, lda, ldb, ldc);
    be_matmul_ld(cpu, cC, cA, cB, M, N, K, ta, tb, alpha, beta, lda, ldb, ldc);
    gpu_ok();
    char what[160];
    snprintf(what, sizeof what, "matmul %dx%dx%d ta%d tb%d alpha %g beta %g %s x %s -> %s pad %d",
             M, N, K, ta, tb, alpha, beta, dtype_name(abdt), dtype_name(abdt), dtype_name(cdt),
             pad);
    expect_close(what, gC, cC, nc, tol_for(cdt));
    drop(gpu, &gA), drop(gpu, &gB), drop(gpu, &gC);
    drop(cpu, &cA), drop(cpu, &cB), drop(cpu, &cC);
    free(A), free(B), free(C);
}

static void check_matmul(int M, int N, int K, int ta, int tb, float alpha, float beta,
                         dtype_t cdt, dtype_t abdt)
{
    check_matmul_pad(M, N, K, ta, tb, alpha, beta, cdt, abdt, 0);
}

/* the batched LoRA's products: column blocks of r 16 in [rows, 48] */
Test(cuda_ops, matmul_on_column_blocks_of_wider_matrices)
{
    for (int t = 0; t < 4; t++) {
        check_matmul_pad(257, 16, 96, t & 1, t >> 1, 1.0f, 1.0f, DT_BF16, DT_BF16, 32);
        check_matmul_pad(96, 16, 257, t & 1, t >> 1, 0.5f, 1.0f, DT_F32, DT_BF16, 5);
    }
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

/* count products through be_matmul_batched, one strided batched product on
 * the GPU and one product at a time on the CPU: batched LoRA's B products,
 * whose operands are the column blocks of wider matrices (blocked: A, B and
 * C product b's columns b w .. of matrices count w wide; else one matrix
 * after another), compared whole */
static void check_matmul_batched(int M, int N, int K, int ta, int tb, float beta, dtype_t cdt,
                                 int count, int blocked)
{
    int ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    int lda = blocked ? count * ac : ac, ldb = blocked ? count * bc : bc;
    int ldc = blocked ? count * N : N;
    size_t sa = blocked ? (size_t)ac : (size_t)ar * ac, sb = blocked ? (size_t)bc : (size_t)br * bc;
    size_t sc = blocked ? (size_t)N : (size_t)M * N;
    size_t na = (size_t)ar * lda * (blocked ? 1 : count), nb = (size_t)br * ldb * (blocked ? 1 : count);
    size_t nc = (size_t)M * ldc * (blocked ? 1 : count);
    float *A = rnd(na, 1.0f), *B = rnd(nb, 1.0f), *C = rnd(nc, 1.0f);
    tensor_t gA = up(gpu, DT_BF16, A, na), gB = up(gpu, DT_BF16, B, nb), gC = up(gpu, cdt, C, nc);
    tensor_t cA = up(cpu, DT_F32, A, na), cB = up(cpu, DT_F32, B, nb), cC = up(cpu, DT_F32, C, nc);
    be_matmul_batched(gpu, gC, gA, gB, M, N, K, ta, tb, 0.5f, beta, lda, ldb, ldc, count, sa, sb,
                      sc);
    be_matmul_batched(cpu, cC, cA, cB, M, N, K, ta, tb, 0.5f, beta, lda, ldb, ldc, count, sa, sb,
                      sc);
    gpu_ok();
    char what[160];
    snprintf(what, sizeof what, "batched matmul %d x (%dx%dx%d) ta%d tb%d beta %g -> %s %s", count,
             M, N, K, ta, tb, beta, dtype_name(cdt), blocked ? "column blocks" : "one after another");
    expect_close(what, gC, cC, nc, tol_for(cdt));
    drop(gpu, &gA), drop(gpu, &gB), drop(gpu, &gC);
    drop(cpu, &cA), drop(cpu, &cB), drop(cpu, &cC);
    free(A), free(B), free(C);
}

/* the shapes batched LoRA gives it (rows 37, r 16, outs 40): the forward's
 * B products (xr_i B_i^T into blocks of the group's output), the
 * backward's B gradients (dy_i^T xr_i, accumulated in F32) and d(xr)
 * (dy_i B_i into blocks of [rows, count r]) */
Test(cuda_ops, matmul_batched_strided_and_on_column_blocks)
{
    for (int t = 0; t < 4; t++)
        for (int blocked = 0; blocked < 2; blocked++) {
            check_matmul_batched(37, 40, 16, t & 1, t >> 1, 0.0f, DT_BF16, 3, blocked);
            check_matmul_batched(40, 16, 37, t & 1, t >> 1, 1.0f, DT_F32, 2, blocked);
            check_matmul_batched(37, 16, 40, t & 1, t >> 1, 0.0f, DT_BF16, 3, blocked);
        }
}

/* D = A B^T + C with C and D distinct (be_matmul_into, the residual add:
 * cuBLASLt reads C and writes D) against the CPU; C unchanged (exact) */
Test(cuda_ops, matmul_into_reads_c_and_writes_d)
{
    int M = 130, N = 96, K = 64;
    size_t mn = (size_t)M * N;
    float *A = rnd((size_t)M * K, 1.0f), *B = rnd((size_t)N * K, 1.0f), *C = rnd(mn, 1.0f);
    tensor_t gA = up(gpu, DT_BF16, A, (size_t)M * K), gB = up(gpu, DT_BF16, B, (size_t)N * K);
    tensor_t gC = up(gpu, DT_BF16, C, mn), gD = up(gpu, DT_BF16, NULL, mn);
    tensor_t cA = up(cpu, DT_F32, A, (size_t)M * K), cB = up(cpu, DT_F32, B, (size_t)N * K);
    tensor_t cC = up(cpu, DT_F32, C, mn), cD = up(cpu, DT_F32, NULL, mn);
    float *before = down(gpu, gC);
    be_matmul_into(gpu, gD, gA, gB, gC, M, N, K, 0, 1, 1.0f, 1.0f);
    be_matmul_into(cpu, cD, cA, cB, cC, M, N, K, 0, 1, 1.0f, 1.0f);
    gpu_ok();
    expect_close("matmul into D from C", gD, cD, mn, tol_for(DT_BF16));
    float *after = down(gpu, gC);
    cr_expect(memcmp(before, after, sizeof(float) * mn) == 0, "C changed");
    drop(gpu, &gA), drop(gpu, &gB), drop(gpu, &gC), drop(gpu, &gD);
    drop(cpu, &cA), drop(cpu, &cB), drop(cpu, &cC), drop(cpu, &cD);
    free(A), free(B), free(C), free(before), free(after);
}

/* C = A B^T [M, N] (F32) by `first` calls, then by one more into another
 * C: the same bits */
static void expect_repeats_bit_for_bit(int M, int N, int K, int first)
{
    float *A = rnd((size_t)M * K, 1.0f), *B = rnd((size_t)N * K, 1.0f);
    tensor_t gA = up(gpu, DT_BF16, A, (size_t)M * K), gB = up(gpu, DT_BF16, B, (size_t)N * K);
    tensor_t c1 = up(gpu, DT_F32, NULL, (size_t)M * N), c2 = up(gpu, DT_F32, NULL, (size_t)M * N);
    for (int i = 0; i < first; i++)
        be_matmul(gpu, c1, gA, gB, M, N, K, 0, 1, 1.0f, 0.0f);
    be_matmul(gpu, c2, gA, gB, M, N, K, 0, 1, 1.0f, 0.0f);
    float *h1 = down(gpu, c1), *h2 = down(gpu, c2);
    cr_expect_eq(memcmp(h1, h2, sizeof(float) * M * N), 0, "%dx%dx%d: two calls differ", M, N, K);
    free(h1), free(h2), free(A), free(B);
    drop(gpu, &gA), drop(gpu, &gB), drop(gpu, &c1), drop(gpu, &c2);
}

/* The model's repeated shapes reuse one cached plan: the same call twice
 * gives the same bits. */
Test(cuda_ops, matmul_repeats_bit_for_bit)
{
    expect_repeats_bit_for_bit(96, 160, 200, 3);
}

/* ---- the narrow products (kernels/cuda/cuda_skinny.cu) ---------------------------------- */

/* LoRA's down products and d(xr) (N <= 64 outputs over a long reduction,
 * A not transposed) and its weight gradients (the reduction over rows, A
 * transposed, N or M <= 64), which cuda_skinny.cu's kernels take, with the splits
 * it chooses and with 1, 3 and 7 forced (SPOTUNE_CUDA_SKINNY=splits=N:
 * the partial sums through the workspace and the last block's fixed-order
 * sum), against the CPU: rows past a multiple of 64, a reduction past a
 * multiple of 32 (and of a split), N 8 to 64 (every fragment count), B
 * stored [N,K] (x A^T) and [K,N] (dy B), beta 0 and 1, BF16 and F32 C,
 * padded rows; and rows 2-byte aligned (lda % 8 != 0), which the kernel
 * leaves to cuBLASLt. Tolerances as every matmul's. */
Test(cuda_ops, matmul_narrow_outputs_every_split)
{
    static const char *modes[] = {NULL, "splits=1", "splits=3", "splits=7"};
    for (size_t m = 0; m < sizeof modes / sizeof modes[0]; m++) {
        if (modes[m])
            setenv("SPOTUNE_CUDA_SKINNY", modes[m], 1);
        else
            unsetenv("SPOTUNE_CUDA_SKINNY");
        check_matmul(37, 16, 264, 0, 1, 1.0f, 0.0f, DT_BF16, DT_BF16);
        check_matmul(130, 48, 1000, 0, 1, 0.5f, 1.0f, DT_BF16, DT_BF16);
        check_matmul(257, 64, 520, 0, 0, 2.0f, 0.0f, DT_BF16, DT_BF16);
        check_matmul(64, 8, 256, 0, 0, 1.0f, 1.0f, DT_F32, DT_BF16);
        check_matmul(1, 24, 512, 0, 1, -1.0f, 0.0f, DT_F32, DT_BF16);
        check_matmul(70, 40, 776, 0, 0, 1.0f, 0.0f, DT_BF16, DT_BF16);
        check_matmul_pad(65, 16, 264, 0, 1, 1.0f, 1.0f, DT_BF16, DT_BF16, 8);
        check_matmul_pad(65, 32, 264, 0, 0, 1.0f, 0.0f, DT_F32, DT_BF16, 3);
        /* the reduction over rows, A transposed: dB = dy^T xr (N
         * narrow), dA = d(xr)^T x (M narrow: C^T written), an odd count
         * of 8-column tiles, rows past a chunk, padded rows, and a side
         * not a multiple of 8 (cuBLASLt's) */
        check_matmul(136, 16, 264, 1, 0, 0.5f, 1.0f, DT_F32, DT_BF16);
        check_matmul(48, 520, 300, 1, 0, 1.0f, 1.0f, DT_F32, DT_BF16);
        check_matmul(200, 24, 777, 1, 0, 1.0f, 0.0f, DT_BF16, DT_BF16);
        check_matmul(8, 72, 256, 1, 0, 2.0f, 0.0f, DT_F32, DT_BF16);
        check_matmul_pad(64, 40, 290, 1, 0, 1.0f, 1.0f, DT_F32, DT_BF16, 8);
        check_matmul(37, 16, 264, 1, 0, 1.0f, 0.0f, DT_F32, DT_BF16);
    }
    unsetenv("SPOTUNE_CUDA_SKINNY");
}

/* batched LoRA's d(xr) = dy_i B_i (dy's column blocks, B_i one after
 * another, into blocks of [rows, count r]), its B gradients dy_i^T xr_i,
 * and batches of x A_i^T and of d(xr)_i^T x_i, with the splits chosen and
 * forced */
Test(cuda_ops, matmul_batched_narrow_outputs)
{
    static const char *modes[] = {NULL, "splits=4"};
    for (size_t m = 0; m < 2; m++) {
        if (modes[m])
            setenv("SPOTUNE_CUDA_SKINNY", modes[m], 1);
        else
            unsetenv("SPOTUNE_CUDA_SKINNY");
        check_matmul_batched(37, 16, 264, 0, 0, 0.0f, DT_BF16, 3, 1);
        check_matmul_batched(70, 16, 520, 0, 1, 1.0f, DT_F32, 2, 0);
        check_matmul_batched(136, 16, 264, 1, 0, 1.0f, DT_F32, 3, 1); /* dB_i += dy_i^T xr_i */
        check_matmul_batched(48, 200, 264, 1, 0, 1.0f, DT_F32, 2, 0);
    }
    unsetenv("SPOTUNE_CUDA_SKINNY");
}

/* The last block of a row tile sums the splits in split order, whichever
 * block it is: a split product twice gives the same bits, and the
 * counters are back at zero for the next (a third call, another shape
 * on the same tiles, agrees with the CPU). */
Test(cuda_ops, matmul_narrow_outputs_repeat_bit_for_bit)
{
    setenv("SPOTUNE_CUDA_SKINNY", "splits=5", 1);
    expect_repeats_bit_for_bit(200, 48, 1600, 1);
    check_matmul(200, 16, 1600, 0, 1, 1.0f, 0.0f, DT_F32, DT_BF16);
    unsetenv("SPOTUNE_CUDA_SKINNY");
}

/* ---- the wide products (kernels/cuda/cuda_wide.cu) -------------------------------------- */

/* LoRA's up products xr B^T (B stored [N,K]) and the input gradient's
 * d(xr) A (A stored [K,N]): a reduction of the rank, K <= 64, into at
 * least 128 columns, which cuda_wide.cu's kernel takes, against the CPU:
 * rows past a multiple of 64 (and fewer than 64), columns past a multiple
 * of 128, every k-step count (K 8, 16, 24, 32, 48, 64; K % 16 != 0 staged
 * with zeros), alpha, beta 0 and 1 (C read: the o and down projections),
 * padded rows, the batched column blocks of a fused group's output; and,
 * left to cuBLASLt, rows 2-byte aligned (pad 3) and a reduction past 64.
 * Tolerances as every matmul's. */
Test(cuda_ops, matmul_wide_outputs)
{
    check_matmul(37, 264, 16, 0, 1, 1.0f, 0.0f, DT_BF16, DT_BF16);
    check_matmul(130, 136, 48, 0, 0, 1.0f, 0.0f, DT_BF16, DT_BF16);
    check_matmul(65, 128, 8, 0, 1, 0.5f, 1.0f, DT_BF16, DT_BF16);
    check_matmul(200, 520, 64, 0, 0, 2.0f, 1.0f, DT_BF16, DT_BF16);
    check_matmul(1, 128, 24, 0, 1, -1.0f, 0.0f, DT_BF16, DT_BF16);
    check_matmul(64, 392, 32, 0, 1, 1.0f, 1.0f, DT_BF16, DT_BF16);
    check_matmul_pad(70, 200, 32, 0, 1, 1.0f, 1.0f, DT_BF16, DT_BF16, 8);
    check_matmul_pad(70, 200, 16, 0, 0, 1.0f, 0.0f, DT_BF16, DT_BF16, 8);
    check_matmul_pad(70, 200, 32, 0, 0, 1.0f, 1.0f, DT_BF16, DT_BF16, 3);
    check_matmul(70, 200, 72, 0, 1, 1.0f, 0.0f, DT_BF16, DT_BF16);
    /* the forward's B products into a group's column blocks, and one
     * after another */
    check_matmul_batched(37, 136, 16, 0, 1, 0.0f, DT_BF16, 3, 1);
    check_matmul_batched(70, 264, 16, 0, 1, 1.0f, DT_BF16, 2, 0);
    check_matmul_batched(70, 136, 32, 0, 0, 0.0f, DT_BF16, 2, 1);
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

/* ---- quantize_nf4: the host's codes and maxima, bit for bit ------------------------------ */

/* From F32 and from BF16 values (the activation dtype: what the model
 * quantizes from its workspace), against nf4_quantize_codes and the CPU
 * backend: one partial block (n 37), two nested blocks and a partial block
 * with an odd count, and 64 x 4103 + 8 (many warps a launch); a block of
 * zeros, a NaN and an infinity among the values. */
Test(cuda_ops, quantize_nf4_bit_identical_to_the_host)
{
    static const size_t sizes[] = {37, 16384 + 3 * 64 + 37, 64 * 4103 + 8};
    float maps[272];
    memcpy(maps, nf4_quant_map, sizeof nf4_quant_map);
    memcpy(maps + 16, nf4_dynamic_map, sizeof nf4_dynamic_map);
    for (int s = 0; s < 6; s++) {
        size_t n = sizes[s / 2], nb = nf4_blocks(n), cb = nf4_code_bytes(n);
        dtype_t dt = s % 2 ? gpu->act_dt : DT_F32;
        float *x = rnd(n, 0.1f), *am = malloc(sizeof(float) * nb);
        uint8_t *codes = malloc(cb), *got = malloc(cb);
        cr_assert(am && codes && got);
        if (n > 128)
            memset(x + 64, 0, sizeof(float) * 64);
        x[n / 3] = NAN;
        x[n / 2] = -INFINITY;
        if (dt != DT_F32)
            for (size_t i = 0; i < n; i++)
                x[i] = to_bf16(x[i]);
        nf4_quantize_codes(x, n, codes, am);
        backend_t *bes[2] = {gpu, cpu};
        for (int k = 0; k < 2; k++) {
            tensor_t tx = up(bes[k], k ? DT_F32 : dt, x, n), tm = up(bes[k], DT_F32, maps, 272);
            tensor_t tc = be_alloc(bes[k], DT_U8, cb), ta = up(bes[k], DT_F32, NULL, nb);
            be_quantize_nf4(bes[k], tc, ta, tx, tm, n);
            be_download(bes[k], got, DT_U8, tc);
            float *gam = down(bes[k], ta);
            gpu_ok();
            cr_expect(memcmp(got, codes, cb) == 0, "n %zu, %s values, %s: codes differ", n,
                      dtype_name(dt), bes[k]->name);
            cr_expect(memcmp(gam, am, sizeof(float) * nb) == 0,
                      "n %zu, %s values, %s: block maxima differ", n, dtype_name(dt), bes[k]->name);
            free(gam);
            drop(bes[k], &tx), drop(bes[k], &tm), drop(bes[k], &tc), drop(bes[k], &ta);
        }
        free(x), free(am), free(codes), free(got);
    }
}

/* ---- dequant_nf4: the CPU's values, bit for bit ------------------------------------------ */

/* The F32 output bit-identical to the CPU backend's (every product and the
 * sum rounded once, no fused multiply-add); the BF16 output the F32 value
 * rounded to BF16 (to_bf16); with the scalar kernel and with the vector one
 * (SPOTUNE_CUDA_ELEMENTWISE; cuda_vec.cu takes a multiple of 8 elements).
 * Sizes: one partial block and an odd count, two nested blocks (both the
 * scalar kernel's), and three nested blocks ending in a partial block of 8
 * (the vector kernel's). */
Test(cuda_ops, dequant_nf4_bit_identical_to_the_cpu)
{
    static const size_t sizes[] = {37, 16384 + 3 * 64 + 37, 2 * 16384 + 3 * 64 + 8};
    static const char *versions[] = {"scalar", "vector"};
    for (int s = 0; s < 6; s++) {
        cr_assert_eq(setenv("SPOTUNE_CUDA_ELEMENTWISE", versions[s % 2], 1), 0);
        size_t n = sizes[s / 2], nb = nf4_blocks(n), nn = nf4_nested_blocks(n);
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
        cr_expect(memcmp(g, c, sizeof(float) * n) == 0, "n %zu, %s: F32 not bit-identical", n,
                  versions[s % 2]);
        size_t off = 0;
        for (size_t i = 0; i < n; i++)
            off += gb[i] != to_bf16(c[i]);
        cr_expect_eq(off, 0, "n %zu, %s: %zu bf16 values not the CPU's rounded", n,
                     versions[s % 2], off);
        drop(gpu, &out[0]), drop(cpu, &out[1]), drop(gpu, &out[2]);
        free(x), free(absmax), free(nested), free(codes), free(q), free(g), free(c), free(gb);
    }
    unsetenv("SPOTUNE_CUDA_ELEMENTWISE");
}
