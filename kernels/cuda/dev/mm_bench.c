/* kernels/cuda/dev/mm_bench.c — the rank-r product workbench (not part
 * of the trainer): LoRA's products at the shapes of a Llama-2-7B layer
 * with LoRA r 16 on every projection. Those with a narrow output and a
 * long reduction by cuda_skinny.cu's kernels ("skinny", with the splits
 * they choose, and "splits=N" for each N of --splits), those with a wide
 * output and a reduction of the rank by cuda_wide.cu's ("wide"), and each
 * by cuBLASLt ("cublaslt": SPOTUNE_CUDA_SKINNY=0, SPOTUNE_CUDA_WIDE=0),
 * which the backend reads on every call. Each on the same random bf16
 * inputs, checked against the CPU backend and timed with CUDA events, one
 * table row per (product, version).
 *
 * Products (rows = tokens, 2048 unless --rows):
 *   xA_qkv   x A^T, the q/k/v group's stacked A [48, 4096]
 *   xA_o     att A_o^T [16, 4096]
 *   xA_gu    h2 A^T, gate/up's [32, 4096]
 *   xA_down  a A_down^T [16, 11008]
 *   dyB_qkv  d(xr) = dy B for q, k, v: one batched product over the
 *            column blocks of dy [rows, 12288] into [rows, 48]
 *   dyB_gu   the same for gate, up: dy [rows, 22016], B [11008, 16] each
 *   dyB_o    dy B_o, dy [rows, 4096]
 *   dB_qkv   B's gradients dy^T xr for q, k, v (batched over dy's and
 *            xr's column blocks; F32, as the trainer's)
 *   dB_gu    the same for gate, up
 *   dB_down  dy^T xr for down, dy [rows, 4096]
 *   dA_qkv   the stacked A's gradient d(xr)^T x [48, 4096]
 *   dA_down  d(xr)^T a [16, 11008]
 * and the wide ones:
 *   up_qkv   s xr_i B_i^T for q, k, v: one batched product from xr's
 *            column blocks [rows, 48] into those of [rows, 12288]
 *   up_gu    the same for gate, up into [rows, 22016]
 *   up_o     s xr B_o^T added to the projection's output (beta 1)
 *   up_down  the same for down (out 4096)
 *   dxA_qkv  d(xr) A, the stacked A [48, 4096], into dx [rows, 4096]
 *   dxA_gu   [32, 4096]
 *   dxA_o    [16, 4096]
 *   dxA_down [16, 11008] into [rows, 11008]
 * Columns: microseconds a call (mean of --iters after a warm-up), the
 * operands' bytes over that time (GB/s: what the product must read and
 * write at least; C twice where beta is 1), the relative error against
 * the CPU (max |d| / max |cpu|, of one call from C's first values; bf16
 * outputs: 1e-2, as tests/test_cuda_ops.c), ok or FAIL. Under the table:
 * each product's cuBLASLt time over the skinny kernel's, and their
 * geometric mean; then the same for the wide kernel's products.
 *
 * usage: mm_bench [--rows N] [--iters N] [--splits A,B,...] [--no-check]
 * Exit status: 0 when every row passed, 1 when one failed, 2 on a usage
 * error, 77 without a usable CUDA device. See README.md. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "kernels/backend.h"

#define TOL 1e-2
#define MAX_SPLITS 8

typedef struct product {
    const char *name;
    /* rows == 0 where the token count goes (M for the down products and
     * d(xr), K for the gradients); the batch's products are column blocks
     * of the operands that are (A, C: blocked_a, blocked_c), or lie one
     * after another (B, the weights) */
    int M, N, K, transA, transB, batch;
    int wide;   /* cuda_wide.cu's product (else cuda_skinny.cu's) */
    float beta; /* 1: C read and added to (o, down) */
} product;

/* 0: the rows (--rows) */
static const product products[] = {
    {"xA_qkv", 0, 48, 4096, 0, 1, 1, 0, 0.0f},      {"xA_o", 0, 16, 4096, 0, 1, 1, 0, 0.0f},
    {"xA_gu", 0, 32, 4096, 0, 1, 1, 0, 0.0f},       {"xA_down", 0, 16, 11008, 0, 1, 1, 0, 0.0f},
    {"dyB_qkv", 0, 16, 4096, 0, 0, 3, 0, 0.0f},     {"dyB_gu", 0, 16, 11008, 0, 0, 2, 0, 0.0f},
    {"dyB_o", 0, 16, 4096, 0, 0, 1, 0, 0.0f},       {"dB_qkv", 4096, 16, 0, 1, 0, 3, 0, 0.0f},
    {"dB_gu", 11008, 16, 0, 1, 0, 2, 0, 0.0f},      {"dB_down", 4096, 16, 0, 1, 0, 1, 0, 0.0f},
    {"dA_qkv", 48, 4096, 0, 1, 0, 1, 0, 0.0f},      {"dA_down", 16, 11008, 0, 1, 0, 1, 0, 0.0f},
    {"up_qkv", 0, 4096, 16, 0, 1, 3, 1, 0.0f},      {"up_gu", 0, 11008, 16, 0, 1, 2, 1, 0.0f},
    {"up_o", 0, 4096, 16, 0, 1, 1, 1, 1.0f},        {"up_down", 0, 4096, 16, 0, 1, 1, 1, 1.0f},
    {"dxA_qkv", 0, 4096, 48, 0, 0, 1, 1, 0.0f},     {"dxA_gu", 0, 4096, 32, 0, 0, 1, 1, 0.0f},
    {"dxA_o", 0, 4096, 16, 0, 0, 1, 1, 0.0f},       {"dxA_down", 0, 11008, 16, 0, 0, 1, 1, 0.0f},
};
#define NPROD ((int)(sizeof products / sizeof products[0]))

/* A product's sizes at `rows` tokens, its operands' shapes as stored and
 * their strides, as the trainer's: A the column blocks of one matrix (a
 * fused group's output gradient, or its input); B the LoRA matrices one
 * after another, or xr's column blocks (transA: the gradients); C the
 * column blocks of xr or d(xr), or the gradients one after another
 * (transA) */
typedef struct dims {
    int M, N, K, lda, ldb, ldc;
    unsigned long sa, sb, sc;
    size_t na, nb, nc;
} dims;

static dims dims_of(const product *p, int rows)
{
    dims d;
    d.M = p->M ? p->M : rows, d.N = p->N, d.K = p->K ? p->K : rows;
    int ar = p->transA ? d.K : d.M, ac = p->transA ? d.M : d.K;
    int br = p->transB ? d.N : d.K, bc = p->transB ? d.K : d.N;
    d.lda = ac * p->batch, d.sa = (unsigned long)ac;
    if (p->transA) { /* B is xr's blocks; the gradients lie one after another */
        d.ldb = bc * p->batch, d.sb = (unsigned long)bc;
        d.ldc = d.N, d.sc = (unsigned long)d.M * (unsigned long)d.N;
    } else {
        d.ldb = bc, d.sb = (unsigned long)br * (unsigned long)bc;
        d.ldc = d.N * p->batch, d.sc = (unsigned long)d.N;
    }
    d.na = (size_t)ar * (size_t)d.lda;
    d.nb = p->transA ? (size_t)br * (size_t)d.ldb : (size_t)br * (size_t)bc * (size_t)p->batch;
    d.nc = p->transA ? (size_t)d.M * d.N * p->batch : (size_t)d.M * (size_t)d.ldc;
    return d;
}

typedef struct run {
    backend_t *be;
    tensor_t A, B, C;
    dims d;
    const product *p;
} run;

static void call(void *ctx)
{
    run *r = ctx;
    const product *p = r->p;
    const dims *d = &r->d;
    be_matmul_batched(r->be, r->C, r->A, r->B, d->M, d->N, d->K, p->transA, p->transB, 1.0f,
                      p->beta, d->lda, d->ldb, d->ldc, p->batch, d->sa, d->sb, d->sc);
}

/* C's first values where the product reads C (beta != 0), else nothing */
static int reset_c(run *r, const float *c0)
{
    if (r->p->beta == 0.0f)
        return 0;
    be_upload(r->be, r->C, c0, DT_F32);
    return bench_fail_be("mm_bench", r->be, "upload");
}

static int set_up(run *r, backend_t *be, dtype_t dt, const float *a, const float *b,
                  const float *c0, int rows, const product *p)
{
    r->be = be, r->p = p, r->d = dims_of(p, rows);
    r->A = be_alloc(be, dt, r->d.na);
    r->B = be_alloc(be, dt, r->d.nb);
    r->C = be_alloc(be, p->transA || dt != DT_BF16 ? DT_F32 : DT_BF16, r->d.nc);
    if (!r->A.p || !r->B.p || !r->C.p)
        return -1;
    be_upload(be, r->A, a, DT_F32);
    be_upload(be, r->B, b, DT_F32);
    return bench_fail_be("mm_bench", be, "upload") || reset_c(r, c0);
}

static void tear_down(run *r)
{
    if (r->A.p)
        be_free(r->be, &r->A);
    if (r->B.p)
        be_free(r->be, &r->B);
    if (r->C.p)
        be_free(r->be, &r->C);
}

static int usage(void)
{
    fprintf(stderr, "usage: mm_bench [--rows N] [--iters N] [--splits A,B,...] [--no-check]\n");
    return 2;
}

int main(int argc, char **argv)
{
    int M = 2048, iters = 20, check = 1, splits[MAX_SPLITS], nsplits = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--rows") == 0 && i + 1 < argc) {
            M = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
            iters = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--splits") == 0 && i + 1 < argc) {
            for (char *s = strtok(argv[++i], ","); s && nsplits < MAX_SPLITS; s = strtok(NULL, ","))
                if ((splits[nsplits++] = atoi(s)) < 1)
                    return usage();
        } else if (strcmp(argv[i], "--no-check") == 0) {
            check = 0;
        } else {
            return usage();
        }
    }
    if (M < 1 || iters < 1)
        return usage();
    backend_t *gpu, *cpu;
    int rc = bench_backends("mm_bench", &gpu, &cpu);
    if (rc)
        return rc;
    printf("device: %s; rows %d; %d iterations\n\n", gpu->device_name, M, iters);
    printf("| product | M,N,K x batch | op | version | us | GB/s | rel err | check |\n");
    printf("|---|---|---|---|---|---|---|---|\n");
    int failed = 0, nratio[2] = {0, 0}, rname[2][NPROD];
    double log_sum[2] = {0, 0}, ratio[2][NPROD];
    for (int pi = 0; pi < NPROD && !failed; pi++) {
        const product *p = &products[pi];
        dims d = dims_of(p, M);
        size_t na = d.na, nb = d.nb, nc = d.nc;
        float *a = bench_random_bf16(na, 1.0f, 11 + (uint64_t)pi);
        float *b = bench_random_bf16(nb, 0.05f, 101 + (uint64_t)pi);
        float *c0 = bench_random_bf16(nc, 1.0f, 211 + (uint64_t)pi);
        float *want = malloc(sizeof(float) * nc), *got = malloc(sizeof(float) * nc);
        run g = {0}, c = {0};
        if (!a || !b || !c0 || !want || !got || set_up(&g, gpu, DT_BF16, a, b, c0, M, p)) {
            fprintf(stderr, "mm_bench: %s: out of memory or a failed upload\n", p->name);
            failed = 1;
        }
        if (!failed && check) {
            if (set_up(&c, cpu, DT_F32, a, b, c0, M, p)) {
                fprintf(stderr, "mm_bench: %s: the CPU's operands: out of memory\n", p->name);
                failed = 1;
            } else {
                call(&c);
                be_download(cpu, want, DT_F32, c.C);
            }
        }
        double bytes = 2.0 * ((double)na + (double)nb) +
                       (p->transA ? 4.0 : 2.0) * (double)nc * (p->beta != 0.0f ? 2.0 : 1.0);
        const char *var = p->wide ? "SPOTUNE_CUDA_WIDE" : "SPOTUNE_CUDA_SKINNY";
        double t_own = -1, t_lt = -1;
        for (int v = 0; v < 2 + (p->wide ? 0 : nsplits) && !failed; v++) {
            char version[32];
            if (v == 0) {
                unsetenv(var);
                snprintf(version, sizeof version, "%s", p->wide ? "wide" : "skinny");
            } else if (v == 1) {
                setenv(var, "0", 1);
                snprintf(version, sizeof version, "cublaslt");
            } else {
                snprintf(version, sizeof version, "splits=%d", splits[v - 2]);
                setenv(var, version, 1);
            }
            double ms = bench_time_ms("mm_bench", gpu, call, &g, iters);
            if (ms < 0) {
                fprintf(stderr, "mm_bench: %s %s: the timed run failed (CUDA events)\n", p->name,
                        version);
                failed = 1;
                break;
            }
            if (v == 0)
                t_own = ms;
            if (v == 1)
                t_lt = ms;
            double err = 0;
            int ok = 1;
            if (check) { /* one call from C's first values (the timed ones added to it) */
                if (reset_c(&g, c0)) {
                    failed = 1;
                    break;
                }
                call(&g);
                be_download(gpu, got, DT_F32, g.C);
                if (bench_fail_be("mm_bench", gpu, "download"))
                    failed = 1;
                err = bench_rel_err(got, want, nc);
                ok = err <= TOL;
            }
            failed |= !ok;
            printf("| %s | %d,%d,%d x %d | %s | %s | %.1f | %.0f | %s%.2e | %s |\n", p->name, d.M,
                   d.N, d.K, p->batch, p->transA ? "A^T" : p->transB ? "[N,K]" : "[K,N]", version,
                   1e3 * ms, bytes / (ms * 1e6), check ? "" : "(no check) ", err,
                   check ? (ok ? "ok" : "FAIL") : "-");
        }
        unsetenv(var);
        if (t_own > 0 && t_lt > 0) {
            int w = p->wide;
            rname[w][nratio[w]] = pi;
            ratio[w][nratio[w]++] = t_lt / t_own;
            log_sum[w] += log(t_lt / t_own);
        }
        tear_down(&g);
        tear_down(&c);
        free(a), free(b), free(c0), free(want), free(got);
    }
    for (int w = 0; w < 2; w++) {
        if (!nratio[w])
            continue;
        printf("%scuBLASLt time / %s time:", w && nratio[0] ? "" : "\n", w ? "wide" : "skinny");
        for (int i = 0; i < nratio[w]; i++)
            printf(" %s %.2fx", products[rname[w][i]].name, ratio[w][i]);
        printf("; geometric mean %.2fx over %d products\n", exp(log_sum[w] / nratio[w]),
               nratio[w]);
    }
    backend_destroy(gpu);
    backend_destroy(cpu);
    if (failed) {
        printf("FAIL\n");
        return 1;
    }
    return 0;
}
