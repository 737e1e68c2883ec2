/* kernels/cuda/dev/mm_bench.c — the narrow-product workbench (not part of
 * the trainer): LoRA's products with a narrow output and a long reduction,
 * at the shapes of a Llama-2-7B layer with LoRA r 16 on every projection,
 * by cuda_skinny.cu's kernel ("skinny", with the splits it chooses, and
 * "splits=N" for each N of --splits) and by cuBLASLt ("cublaslt":
 * SPOTUNE_CUDA_SKINNY=0), which the backend reads on every call. Each on
 * the same random bf16 inputs, checked against the CPU backend and timed
 * with CUDA events, one table row per (product, version).
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
 * Columns: microseconds a call (mean of --iters after a warm-up), the
 * operands' bytes over that time (GB/s: what the product must read and
 * write at least), the relative error against the CPU (max |d| / max
 * |cpu|; bf16 outputs: 1e-2, as tests/test_cuda_ops.c), ok or FAIL. Under
 * the table: each product's cuBLASLt time over the skinny kernel's, and
 * their geometric mean.
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
    int N, K, transB, batch; /* batch > 1: column blocks of A (width K) and of C (width N) */
} product;

static const product products[] = {
    {"xA_qkv", 48, 4096, 1, 1},  {"xA_o", 16, 4096, 1, 1},   {"xA_gu", 32, 4096, 1, 1},
    {"xA_down", 16, 11008, 1, 1}, {"dyB_qkv", 16, 4096, 0, 3}, {"dyB_gu", 16, 11008, 0, 2},
    {"dyB_o", 16, 4096, 0, 1},
};
#define NPROD ((int)(sizeof products / sizeof products[0]))

typedef struct run {
    backend_t *be;
    tensor_t A, B, C;
    int M;
    const product *p;
} run;

static void call(void *ctx)
{
    run *r = ctx;
    const product *p = r->p;
    int lda = p->K * p->batch, ldc = p->N * p->batch, ldb = p->transB ? p->K : p->N;
    be_matmul_batched(r->be, r->C, r->A, r->B, r->M, p->N, p->K, 0, p->transB, 1.0f, 0.0f, lda,
                      ldb, ldc, p->batch, (unsigned long)p->K, (unsigned long)p->N * p->K,
                      (unsigned long)p->N);
}

static int set_up(run *r, backend_t *be, dtype_t dt, const float *a, const float *b, int M,
                  const product *p)
{
    size_t na = (size_t)M * p->K * p->batch, nb = (size_t)p->N * p->K * p->batch;
    r->be = be, r->M = M, r->p = p;
    r->A = be_alloc(be, dt, na);
    r->B = be_alloc(be, dt, nb);
    r->C = be_alloc(be, dt == DT_BF16 ? DT_BF16 : DT_F32, (size_t)M * p->N * p->batch);
    if (!r->A.p || !r->B.p || !r->C.p)
        return -1;
    be_upload(be, r->A, a, DT_F32);
    be_upload(be, r->B, b, DT_F32);
    return bench_fail_be("mm_bench", be, "upload");
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
    printf("| product | M,N,K x batch | B stored | version | us | GB/s | rel err | check |\n");
    printf("|---|---|---|---|---|---|---|---|\n");
    int failed = 0, nratio = 0;
    double log_sum = 0, ratio[NPROD];
    for (int pi = 0; pi < NPROD && !failed; pi++) {
        const product *p = &products[pi];
        size_t na = (size_t)M * p->K * p->batch, nb = (size_t)p->N * p->K * p->batch;
        size_t nc = (size_t)M * p->N * p->batch;
        float *a = bench_random_bf16(na, 1.0f, 11 + (uint64_t)pi);
        float *b = bench_random_bf16(nb, 0.05f, 101 + (uint64_t)pi);
        float *want = malloc(sizeof(float) * nc), *got = malloc(sizeof(float) * nc);
        run g = {0}, c = {0};
        if (!a || !b || !want || !got || set_up(&g, gpu, DT_BF16, a, b, M, p)) {
            fprintf(stderr, "mm_bench: %s: out of memory or a failed upload\n", p->name);
            failed = 1;
        }
        if (!failed && check) {
            if (set_up(&c, cpu, DT_F32, a, b, M, p)) {
                fprintf(stderr, "mm_bench: %s: the CPU's operands: out of memory\n", p->name);
                failed = 1;
            }
            else {
                call(&c);
                be_download(cpu, want, DT_F32, c.C);
            }
        }
        double bytes = 2.0 * ((double)na + (double)nb + (double)nc);
        double t_skinny = -1, t_lt = -1;
        for (int v = 0; v < 2 + nsplits && !failed; v++) {
            char version[32];
            if (v == 0) {
                unsetenv("SPOTUNE_CUDA_SKINNY");
                snprintf(version, sizeof version, "skinny");
            } else if (v == 1) {
                setenv("SPOTUNE_CUDA_SKINNY", "0", 1);
                snprintf(version, sizeof version, "cublaslt");
            } else {
                snprintf(version, sizeof version, "splits=%d", splits[v - 2]);
                setenv("SPOTUNE_CUDA_SKINNY", version, 1);
            }
            double ms = bench_time_ms("mm_bench", gpu, call, &g, iters);
            if (ms < 0) {
                fprintf(stderr, "mm_bench: %s %s: the timed run failed (CUDA events)\n", p->name,
                        version);
                failed = 1;
                break;
            }
            if (v == 0)
                t_skinny = ms;
            if (v == 1)
                t_lt = ms;
            double err = 0;
            int ok = 1;
            if (check) {
                be_download(gpu, got, DT_F32, g.C);
                if (bench_fail_be("mm_bench", gpu, "download"))
                    failed = 1;
                err = bench_rel_err(got, want, nc);
                ok = err <= TOL;
            }
            failed |= !ok;
            printf("| %s | %d,%d,%d x %d | %s | %s | %.1f | %.0f | %s%.2e | %s |\n", p->name, M,
                   p->N, p->K, p->batch, p->transB ? "[N,K]" : "[K,N]", version, 1e3 * ms,
                   bytes / (ms * 1e6), check ? "" : "(no check) ", err,
                   check ? (ok ? "ok" : "FAIL") : "-");
        }
        unsetenv("SPOTUNE_CUDA_SKINNY");
        if (t_skinny > 0 && t_lt > 0) {
            ratio[nratio++] = t_lt / t_skinny;
            log_sum += log(t_lt / t_skinny);
        }
        tear_down(&g);
        tear_down(&c);
        free(a), free(b), free(want), free(got);
    }
    if (nratio) {
        printf("\ncuBLASLt time / skinny time:");
        for (int i = 0; i < nratio; i++)
            printf(" %s %.2fx", products[i].name, ratio[i]);
        printf("; geometric mean %.2fx over %d products\n", exp(log_sum / nratio), nratio);
    }
    backend_destroy(gpu);
    backend_destroy(cpu);
    if (failed) {
        printf("FAIL\n");
        return 1;
    }
    return 0;
}
