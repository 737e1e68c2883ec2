/* The CUDA backend's products (kernels/cuda/cuda_matmul.cu: its row-major
 * to column-major mapping, its plans by shape, leading dimensions and
 * alignment, and its fallback) on the emulated cuBLAS and cuBLASLt
 * (tests/cuda_emu/emu_cublas.cc, which refuses what the libraries
 * document as refused), through each of the three paths a GPU may take:
 * cuBLASLt; no cuBLASLt algorithm for the problem (the fallback,
 * cublasGemmStridedBatchedEx, from the start); cuBLASLt refusing at run
 * time (the fallback from then on, for that plan only). Each product
 * against the CPU backend's on the same bf16-rounded inputs: max |d| /
 * max |cpu| <= 1e-2 for BF16 results (one rounding is 2^-9), 1e-5 for F32
 * ones (fp32 sums in another order). The emulator's counts tell which path
 * each product took. Emulated device only (SPOTUNE_CUDA_MODULE names the
 * emulated module); the other CUDA suites run the same code on a GPU. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels/backend.h"

static backend_t *gpu, *cpu;
static void (*blas_counts)(long counts[3]);

static void setup(void)
{
    sp_err err = {0};
    const char *mod = getenv("SPOTUNE_CUDA_MODULE");
    cr_assert(mod, "SPOTUNE_CUDA_MODULE names no module");
    cr_assert_eq(backend_create(&gpu, "cuda", 0, 1, &err), 0, "%s", err.msg);
    cr_assert_eq(backend_create(&cpu, "cpu", 0, 1, &err), 0, "%s", err.msg);
    void *h = dlopen(mod, RTLD_NOW | RTLD_NOLOAD);
    cr_assert(h, "the module is not loaded: %s", dlerror());
    *(void **)&blas_counts = dlsym(h, "spotune_emu_blas_counts");
    cr_assert(blas_counts, "not the emulated module: %s", mod);
}

static void teardown(void)
{
    if (gpu)
        backend_destroy(gpu);
    if (cpu)
        backend_destroy(cpu);
    unsetenv("SPOTUNE_CUDA_EMU_CUBLASLT");
}

TestSuite(emu_cublas, .init = setup, .fini = teardown, .timeout = 120);

typedef struct mm_case {
    int M, N, K, transA, transB;
    dtype_t in, out;
    int pad;     /* extra elements in every row (ld = width + pad) */
    int offset;  /* A starts this many elements into its buffer */
    float alpha, beta;
    int into;    /* D = ... + beta C, C another buffer */
} mm_case;

/* Distinct problems (each its own plan): every transpose pair, the three
 * dtype pairs, padded rows (a 2-byte-aligned BF16 row stride), A at an odd
 * element, accumulation into C, and a C read from another buffer. */
static const mm_case cases[] = {
    {37, 29, 19, 0, 0, DT_BF16, DT_BF16, 0, 0, 1.0f, 0.0f, 0},
    {37, 29, 19, 1, 0, DT_BF16, DT_F32, 3, 0, 1.0f, 1.0f, 0},
    {16, 24, 40, 0, 1, DT_F32, DT_F32, 5, 0, 0.5f, 0.5f, 0},
    {33, 17, 8, 1, 1, DT_BF16, DT_BF16, 1, 1, 1.0f, 0.0f, 0},
    {64, 48, 32, 0, 1, DT_BF16, DT_BF16, 0, 0, 2.0f, 0.0f, 0},
    {21, 40, 24, 0, 0, DT_BF16, DT_F32, 0, 0, 1.0f, 1.0f, 1},
    {12, 8, 64, 1, 0, DT_BF16, DT_BF16, 0, 1, 1.0f, 1.0f, 1},
};
#define N_CASES ((int)(sizeof cases / sizeof cases[0]))

static float *random_values(size_t n, unsigned seed)
{
    float *v = malloc(sizeof(float) * n);
    cr_assert(v);
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        v[i] = (float)((seed >> 8) & 0xffff) / 32768.0f - 1.0f;
    }
    return v;
}

/* a tensor of n values on be (dt), and the values it holds (rounded) */
static tensor_t put(backend_t *be, dtype_t dt, const float *v, size_t n)
{
    tensor_t t = be_alloc(be, dt, n);
    cr_assert(t.p, "alloc of %zu failed", n);
    be_upload(be, t, v, DT_F32);
    return t;
}

static float *get(backend_t *be, tensor_t t)
{
    float *h = malloc(sizeof(float) * t.n);
    cr_assert(h);
    be_download(be, h, DT_F32, t);
    sp_err err = {0};
    cr_assert_eq(be_check(be, &err), 0, "%s", err.msg);
    return h;
}

/* The case on the GPU and on the CPU; returns max |d| / max |cpu| over C's
 * M x N elements. */
static double run_case(const mm_case *c, unsigned seed)
{
    int ra = c->transA ? c->K : c->M, wa = c->transA ? c->M : c->K;
    int rb = c->transB ? c->N : c->K, wb = c->transB ? c->K : c->N;
    int lda = wa + c->pad, ldb = wb + c->pad, ldc = c->N + c->pad;
    size_t na = (size_t)c->offset + (size_t)ra * lda, nb = (size_t)rb * ldb;
    size_t nc = (size_t)c->M * ldc;
    float *ha = random_values(na, seed), *hb = random_values(nb, seed + 1);
    float *hc = random_values(nc, seed + 2);
    /* the GPU's operands, and their rounded values for the CPU's */
    tensor_t ga = put(gpu, c->in, ha, na), gb = put(gpu, c->in, hb, nb);
    tensor_t gc = put(gpu, c->out, hc, nc), gd = put(gpu, c->out, hc, nc);
    float *va = get(gpu, ga), *vb = get(gpu, gb), *vc = get(gpu, gc);
    tensor_t ca = put(cpu, DT_F32, va, na), cb = put(cpu, DT_F32, vb, nb);
    tensor_t cc = put(cpu, DT_F32, vc, nc);
    tensor_t a = tensor_view(ga, (size_t)c->offset, na - (size_t)c->offset);
    tensor_t ac = tensor_view(ca, (size_t)c->offset, na - (size_t)c->offset);
    if (c->into) { /* no row padding here: be_matmul_into takes dense matrices */
        cr_assert_eq(c->pad, 0);
        be_matmul_into(gpu, gd, a, gb, gc, c->M, c->N, c->K, c->transA, c->transB, c->alpha,
                       c->beta);
        be_matmul(cpu, cc, ac, cb, c->M, c->N, c->K, c->transA, c->transB, c->alpha, c->beta);
    } else {
        be_matmul_ld(gpu, gc, a, gb, c->M, c->N, c->K, c->transA, c->transB, c->alpha, c->beta,
                     lda, ldb, ldc);
        be_matmul_ld(cpu, cc, ac, cb, c->M, c->N, c->K, c->transA, c->transB, c->alpha, c->beta,
                     lda, ldb, ldc);
    }
    float *got = get(gpu, c->into ? gd : gc), *want = get(cpu, cc);
    double dmax = 0.0, wmax = 0.0;
    for (int r = 0; r < c->M; r++)
        for (int k = 0; k < c->N; k++) {
            size_t i = (size_t)r * ldc + k;
            dmax = fmax(dmax, fabs((double)got[i] - want[i]));
            wmax = fmax(wmax, fabs((double)want[i]));
        }
    /* the padding of C's rows is not touched */
    if (!c->into)
        for (int r = 0; r < c->M; r++)
            for (int k = c->N; k < ldc; k++)
                cr_expect_eq(got[(size_t)r * ldc + k], vc[(size_t)r * ldc + k],
                             "row %d's padding [%d] written", r, k);
    tensor_t gs[] = {ga, gb, gc, gd}, cs[] = {ca, cb, cc};
    for (int i = 0; i < 4; i++)
        be_free(gpu, &gs[i]);
    for (int i = 0; i < 3; i++)
        be_free(cpu, &cs[i]);
    free(ha), free(hb), free(hc), free(va), free(vb), free(vc), free(got), free(want);
    return wmax > 0.0 ? dmax / wmax : dmax;
}

/* Every case twice (the second finds its plan in the cache) under mode;
 * counts[3]: the products cuBLASLt ran, the fallback ran, cuBLASLt refused. */
static void run_all(const char *mode, long counts[3])
{
    if (mode)
        cr_assert_eq(setenv("SPOTUNE_CUDA_EMU_CUBLASLT", mode, 1), 0);
    long before[3], after[3];
    blas_counts(before);
    for (int rep = 0; rep < 2; rep++)
        for (int i = 0; i < N_CASES; i++) {
            const mm_case *c = &cases[i];
            double e = run_case(c, 17u * (unsigned)i + 1u);
            double tol = c->out == DT_BF16 ? 1e-2 : 1e-5;
            cr_expect(e <= tol, "%s: case %d (%dx%dx%d%s%s, %s into %s): %.3g > %g",
                      mode ? mode : "on", i, c->M, c->N, c->K, c->transA ? " A^T" : "",
                      c->transB ? " B^T" : "", dtype_name(c->in), dtype_name(c->out), e, tol);
        }
    blas_counts(after);
    for (int i = 0; i < 3; i++)
        counts[i] = after[i] - before[i];
}

Test(emu_cublas, products_through_cublaslt)
{
    long n[3];
    run_all(NULL, n);
    cr_expect_eq(n[0], 2 * N_CASES, "cuBLASLt products: %ld", n[0]);
    cr_expect_eq(n[1], 0, "fallback products: %ld", n[1]);
    cr_expect_eq(n[2], 0, "refusals: %ld", n[2]);
}

Test(emu_cublas, products_through_the_fallback_when_cublaslt_has_no_algorithm)
{
    long n[3];
    run_all("no-algorithm", n);
    cr_expect_eq(n[0], 0, "cuBLASLt products: %ld", n[0]);
    cr_expect_eq(n[1], 2 * N_CASES, "fallback products: %ld", n[1]);
    cr_expect_eq(n[2], 0, "refusals: %ld", n[2]);
}

/* a plan that cuBLASLt refused once goes to the fallback from then on,
 * without asking again: one refusal a plan */
Test(emu_cublas, a_refused_plan_stays_on_the_fallback)
{
    long n[3];
    run_all("refuses", n);
    cr_expect_eq(n[0], 0, "cuBLASLt products: %ld", n[0]);
    cr_expect_eq(n[1], 2 * N_CASES, "fallback products: %ld", n[1]);
    cr_expect_eq(n[2], N_CASES, "refusals: %ld (one per plan)", n[2]);
}

/* One shape at two alignments of A: two plans, each found for its own
 * alignment (the emulated cuBLASLt refuses a matrix less aligned than its
 * algorithm was found for, so a plan shared between them would fail). */
Test(emu_cublas, a_less_aligned_operand_gets_its_own_plan)
{
    mm_case c = {40, 32, 24, 0, 0, DT_BF16, DT_BF16, 0, 0, 1.0f, 0.0f, 0};
    long before[3], after[3];
    blas_counts(before);
    for (int off = 0; off < 3; off++) { /* A at element 0, 1 (2 bytes), 0 again */
        c.offset = off == 1;
        double e = run_case(&c, 5u + (unsigned)off);
        cr_expect(e <= 1e-2, "A at element %d: %.3g", c.offset, e);
    }
    blas_counts(after);
    cr_expect_eq(after[0] - before[0], 3, "cuBLASLt products: %ld", after[0] - before[0]);
    sp_err err = {0};
    cr_expect_eq(be_check(gpu, &err), 0, "%s", err.msg);
}

/* The products `taken` (nt) run by one of spotune's own kernels: none
 * reaches the emulated cuBLASLt and each is the CPU's; with `var`=0 each
 * reaches it, as right; and `not_taken` (nn), which the kernels leave,
 * reach it either way. Tolerances: 1e-2 for BF16 results, 1e-5 for F32. */
static void expect_own_kernels(const char *var, const mm_case *taken, int nt,
                               const mm_case *not_taken, int nn, unsigned seed)
{
    for (int off = 0; off < 2; off++) {
        if (off)
            cr_assert_eq(setenv(var, "0", 1), 0);
        long before[3], after[3];
        blas_counts(before);
        for (int i = 0; i < nt; i++) {
            double e = run_case(&taken[i], seed + (unsigned)i);
            double tol = taken[i].out == DT_BF16 ? 1e-2 : 1e-5;
            cr_expect(e <= tol, "taken case %d%s: %.3g > %g", i, off ? " (off)" : "", e, tol);
        }
        blas_counts(after);
        cr_expect_eq(after[0] - before[0], off ? nt : 0, "cuBLASLt products%s%s: %ld",
                     off ? " with =0: " : "", off ? var : "", after[0] - before[0]);
    }
    unsetenv(var);
    long before[3], after[3];
    blas_counts(before);
    for (int i = 0; i < nn; i++) {
        double e = run_case(&not_taken[i], seed + 10u + (unsigned)i);
        cr_expect(e <= (not_taken[i].out == DT_BF16 ? 1e-2 : 1e-5), "case %d: %.3g", i, e);
    }
    blas_counts(after);
    cr_expect_eq(after[0] - before[0], nn, "cuBLASLt products: %ld", after[0] - before[0]);
}

/* LoRA's narrow products (N <= 64 over a long reduction, A as it lies;
 * or A transposed with N or M <= 64: its weight gradients) are
 * cuda_skinny.cu's, not cuBLAS's: no product reaches the emulated
 * library, and the result is the CPU's; with SPOTUNE_CUDA_SKINNY=0, or a
 * product the kernels do not take (both transposed; a narrow side not a
 * multiple of 8; a row stride of A not a
 * multiple of 8 elements: its 16-byte loads; N past 64; a short
 * reduction), cuBLASLt runs it, as right. */
Test(emu_cublas, narrow_products_skip_cublas_unless_told_or_not_taken)
{
    static const mm_case taken[] = {
        {37, 16, 264, 0, 1, DT_BF16, DT_BF16, 0, 0, 1.0f, 0.0f, 0},  /* x A^T */
        {70, 48, 520, 0, 0, DT_BF16, DT_F32, 8, 0, 1.0f, 1.0f, 0},   /* dy B, padded */
        {136, 16, 264, 1, 0, DT_BF16, DT_F32, 0, 0, 1.0f, 1.0f, 0},  /* dy^T xr */
        {48, 520, 264, 1, 0, DT_BF16, DT_F32, 8, 0, 1.0f, 1.0f, 0},  /* d(xr)^T x */
    };
    static const mm_case not_taken[] = {
        {37, 16, 264, 1, 1, DT_BF16, DT_BF16, 0, 0, 1.0f, 0.0f, 0},  /* A^T B^T */
        {37, 16, 264, 1, 0, DT_BF16, DT_BF16, 0, 0, 1.0f, 0.0f, 0},  /* A^T, M % 8 */
        {37, 16, 264, 0, 1, DT_BF16, DT_BF16, 3, 0, 1.0f, 0.0f, 0},  /* lda % 8 */
        {37, 72, 264, 0, 1, DT_BF16, DT_BF16, 0, 0, 1.0f, 0.0f, 0},  /* N > 64 */
        {37, 16, 128, 0, 1, DT_BF16, DT_BF16, 0, 0, 1.0f, 0.0f, 0},  /* K < 256 */
        {37, 16, 264, 0, 1, DT_F32, DT_F32, 0, 0, 1.0f, 0.0f, 0},    /* F32 operands */
    };
    expect_own_kernels("SPOTUNE_CUDA_SKINNY", taken, 4, not_taken, 6, 31u);
}

/* LoRA's wide products (a reduction of the rank, K <= 64 and a multiple
 * of 8, into N >= 128 columns, A as it lies: xr B^T and d(xr) A) are
 * cuda_wide.cu's: no product reaches the emulated library, and the result
 * is the CPU's; with SPOTUNE_CUDA_WIDE=0, or a product the kernel does
 * not take (K past 64; K not a multiple of 8; N under 128; an F32 C; a
 * row stride of A not a multiple of 8 elements; A transposed), cuBLASLt
 * runs it, as right. */
Test(emu_cublas, wide_products_skip_cublas_unless_told_or_not_taken)
{
    static const mm_case taken[] = {
        {37, 264, 16, 0, 1, DT_BF16, DT_BF16, 0, 0, 1.0f, 0.0f, 0}, /* xr B^T */
        {70, 136, 48, 0, 0, DT_BF16, DT_BF16, 8, 0, 1.0f, 0.0f, 0}, /* d(xr) A, padded */
        {65, 128, 8, 0, 1, DT_BF16, DT_BF16, 0, 0, 0.5f, 1.0f, 0},  /* beta 1 */
    };
    static const mm_case not_taken[] = {
        {37, 264, 72, 0, 1, DT_BF16, DT_BF16, 0, 0, 1.0f, 0.0f, 0}, /* K > 64 */
        {37, 264, 20, 0, 1, DT_BF16, DT_BF16, 0, 0, 1.0f, 0.0f, 0}, /* K % 8 */
        {37, 120, 16, 0, 1, DT_BF16, DT_BF16, 0, 0, 1.0f, 0.0f, 0}, /* N < 128 */
        {37, 264, 16, 0, 1, DT_BF16, DT_F32, 0, 0, 1.0f, 0.0f, 0},  /* F32 C */
        {37, 264, 16, 0, 1, DT_BF16, DT_BF16, 3, 0, 1.0f, 0.0f, 0}, /* lda % 8 */
        {16, 264, 37, 1, 0, DT_BF16, DT_BF16, 0, 0, 1.0f, 0.0f, 0}, /* A^T */
    };
    expect_own_kernels("SPOTUNE_CUDA_WIDE", taken, 3, not_taken, 6, 51u);
}
