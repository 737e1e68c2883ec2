/* kernels/cpu/dev/skinny_bench.c — the CPU workbench of the products with a
 * side of at most 64 (kernels/cpu/cpu_skinny.c): the shapes one LoRA step of
 * the small preset calls (1024 rows, hidden 768, q/k/v 1280 wide,
 * intermediate 1536, r 16; batched A's 3r and 2r), each through OpenBLAS's
 * sgemm and through cpu_skinny_matmul on the same inputs, timed over --iters
 * calls after one, and checked against each other (relative to the largest
 * value, 1e-5); a product the path declines is sgemm on both sides, as
 * in the backend. Prints one Markdown table and the ratio over all shapes.
 * --isa avx2 runs AVX2's tiles on a CPU with AVX-512 (with
 * OPENBLAS_CORETYPE=Haswell in the environment, both sides as on a CPU
 * without AVX-512). Not part of the trainer; a benchmark, not a test.
 * usage: skinny_bench [--iters N] [--threads N] [--isa avx2|avx512] */
#define _POSIX_C_SOURCE 200809L
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/cpu/cpu_backend.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

typedef struct {
    int M, N, K, ta, tb;
    float beta;
    const char *what;
} shape;

static const shape shapes[] = {
    {1024, 48, 768, 0, 1, 0, "x [A_q;A_k;A_v]^T"},
    {1024, 768, 16, 0, 1, 0, "xr_q B_q^T"},
    {1024, 256, 16, 0, 1, 0, "xr_k B_k^T"},
    {1024, 1536, 16, 0, 1, 0, "xr_gate B_gate^T"},
    {1024, 16, 1536, 0, 1, 0, "x_down A_down^T"},
    {1024, 16, 768, 0, 0, 0, "dy_q B_q (dxr)"},
    {1024, 16, 1536, 0, 0, 0, "dy_gate B_gate (dxr)"},
    {768, 16, 1024, 1, 0, 1, "dy_q^T xr_q (dB)"},
    {256, 16, 1024, 1, 0, 1, "dy_k^T xr_k (dB)"},
    {1536, 16, 1024, 1, 0, 1, "dy_gate^T xr_gate (dB)"},
    {48, 768, 1024, 1, 0, 1, "dxr_qkv^T x (dA)"},
    {32, 768, 1024, 1, 0, 1, "dxr_gu^T x (dA)"},
    {16, 1536, 1024, 1, 0, 1, "dxr_down^T x_down (dA)"},
    {1024, 768, 48, 0, 0, 0, "dxr_qkv A (dx)"},
    {1024, 1536, 16, 0, 0, 0, "dxr_down A_down (dx)"},
};

static float *rnd(size_t n, unsigned *seed)
{
    float *p = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) {
        *seed = *seed * 1664525u + 1013904223u;
        p[i] = (float)(*seed >> 8) / 8388608.0f - 1.0f;
    }
    return p;
}

int main(int argc, char **argv)
{
    int iters = 50, threads = 0, isa = cpu_skinny_isa();
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--iters") && i + 1 < argc)
            iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--isa") && i + 1 < argc) {
            const char *v = argv[++i];
            isa = !strcmp(v, "avx2")     ? CPU_SKINNY_AVX2
                  : !strcmp(v, "avx512") ? CPU_SKINNY_AVX512
                                         : -1;
            if (isa < 0) {
                fprintf(stderr, "skinny_bench: --isa %s: expected avx2 or avx512\n", v);
                return 2;
            }
        } else {
            fprintf(stderr, "usage: skinny_bench [--iters N] [--threads N] [--isa avx2|avx512]\n");
            return 2;
        }
    }
    if (iters < 1) {
        fprintf(stderr, "skinny_bench: --iters wants a whole number from 1\n");
        return 2;
    }
    if (threads > 0)
        omp_set_num_threads(threads);
    if (isa > cpu_skinny_isa() || isa == CPU_SKINNY_NONE) {
        fprintf(stderr, "skinny_bench: this CPU has not got %s; the path declines every product\n",
                isa == CPU_SKINNY_AVX512 ? "AVX-512" : "AVX2 with FMA");
        return 1;
    }
    const char *core = getenv("OPENBLAS_CORETYPE");
    printf("%d thread(s), %d calls a shape after one; tiles: %s; OpenBLAS: %s\n\n",
           omp_get_max_threads(), iters, isa == CPU_SKINNY_AVX512 ? "AVX-512" : "AVX2",
           core ? core : "its choice for this CPU");
    printf("| M x N x K | op | product | sgemm GFLOP/s | skinny GFLOP/s | speedup | rel diff |\n");
    printf("| --- | --- | --- | ---: | ---: | ---: | ---: |\n");
    double tb_all = 0, ts_all = 0;
    int bad = 0;
    unsigned seed = 1;
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        shape h = shapes[s];
        int lda = h.ta ? h.M : h.K, ldb = h.tb ? h.K : h.N, ldc = h.N;
        size_t nc = (size_t)h.M * h.N;
        float *A = rnd((size_t)h.M * h.K, &seed), *B = rnd((size_t)h.K * h.N, &seed);
        float *C0 = rnd(nc, &seed), *C1 = malloc(sizeof(float) * nc),
              *C2 = malloc(sizeof(float) * nc);
        double t[2];
        int declined = 0;
        for (int v = 0; v < 2; v++) {
            float *C = v ? C2 : C1;
            double t0 = 0;
            for (int it = 0; it <= iters; it++) {
                memcpy(C, C0, sizeof(float) * nc); /* the same product each call */
                if (it == 1)
                    t0 = now();
                if (v && !declined)
                    declined = !cpu_skinny_matmul(isa, C, A, B, h.M, h.N, h.K, h.ta, h.tb, 1.0f,
                                                  h.beta, lda, ldb, ldc);
                if (!v || declined) /* the backend then runs sgemm */
                    cblas_sgemm(CblasRowMajor, h.ta ? CblasTrans : CblasNoTrans,
                                h.tb ? CblasTrans : CblasNoTrans, h.M, h.N, h.K, 1.0f, A, lda, B,
                                ldb, h.beta, C, ldc);
            }
            t[v] = now() - t0;
        }
        double big = 0, diff = 0;
        for (size_t i = 0; i < nc; i++) {
            big = fmax(big, fabs(C1[i]));
            diff = fmax(diff, fabs((double)C1[i] - C2[i]));
        }
        double rel = big > 0 ? diff / big : diff, fl = 2.0 * h.M * h.N * h.K * iters;
        bad += !(rel <= 1e-5);
        tb_all += t[0], ts_all += t[1];
        printf("| %d x %d x %d | %s%s | %s | %.0f | %.0f%s | %.2fx | %.1e%s |\n", h.M, h.N, h.K,
               h.ta ? "T" : "N", h.tb ? "T" : "N", h.what, fl / t[0] / 1e9, fl / t[1] / 1e9,
               declined ? " (declined: sgemm)" : "", t[0] / t[1], rel, rel <= 1e-5 ? "" : " FAIL");
        free(A), free(B), free(C0), free(C1), free(C2);
    }
    printf("\nall shapes: sgemm %.3f s, skinny %.3f s: %.2fx (the memcpy of C in both)\n", tb_all,
           ts_all, tb_all / ts_all);
    return bad ? 1 : 0;
}
