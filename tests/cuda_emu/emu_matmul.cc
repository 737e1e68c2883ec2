/* tests/cuda_emu/emu_matmul.cc — the emulated device's products, in place of
 * kernels/cuda/cuda_matmul.cu (cuBLASLt, which has no emulation): its entry
 * points (cuda_internal.h) with the same contract and checks, each
 * product a plain loop, fp32 accumulation (cuBLASLt's CUBLAS_COMPUTE_32F),
 * C in BF16 (rounded to nearest even) or F32, run in stream order (recorded
 * while the stream is captured). So the emulated backend's matmuls are
 * right by construction: what this tests is everything around them, not
 * cuda_matmul.cu's plans, layouts and fallback. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_internal.h"

extern "C" int cuda_mm_init(backend_t *be)
{
    (void)be;
    return 0;
}

extern "C" void cuda_mm_destroy(backend_t *be)
{
    (void)be;
}

static float ld(const void *p, int dt, size_t i)
{
    return dt == DT_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static void st(void *p, int dt, size_t i, float v)
{
    if (dt == DT_BF16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* C = alpha op(A) op(B) + beta Cin, batch by batch, row-major with leading
 * dimensions (cuda_internal.h's gemm_desc): op(A) and op(B)^T are taken
 * into fp32 rows first, so each element is a dot product over k in order. */
static void gemm_ref(gemm_desc d, const void *A, const void *B, const void *Cin, void *C,
                     float alpha, float beta)
{
    size_t K = d.K > 0 ? (size_t)d.K : 0;
    float *a = (float *)malloc(sizeof(float) * (size_t)d.M * (K ? K : 1));
    float *bt = (float *)malloc(sizeof(float) * (size_t)d.N * (K ? K : 1));
    if (!a || !bt) {
        fprintf(stderr, "emu_matmul: out of memory\n");
        abort();
    }
    for (int b = 0; b < d.batch; b++) {
        size_t oa = (size_t)b * d.sa, ob = (size_t)b * d.sb, oc = (size_t)b * d.sc;
        for (int r = 0; r < d.M; r++)
            for (size_t k = 0; k < K; k++)
                a[r * K + k] = ld(A, d.adt, oa + (d.transA ? k * d.lda + r : r * d.lda + k));
        for (int c = 0; c < d.N; c++)
            for (size_t k = 0; k < K; k++)
                bt[c * K + k] = ld(B, d.bdt, ob + (d.transB ? c * d.ldb + k : k * d.ldb + c));
        for (int r = 0; r < d.M; r++)
            for (int c = 0; c < d.N; c++) {
                const float *x = a + r * K, *y = bt + c * K;
                float acc = 0.0f;
                for (size_t k = 0; k < K; k++)
                    acc += x[k] * y[k];
                size_t ic = oc + (size_t)r * d.ldc + c;
                float v = alpha * acc;
                if (beta != 0.0f)
                    v += beta * ld(Cin, d.cdt, ic);
                st(C, d.cdt, ic, v);
            }
    }
    free(a);
    free(bt);
}

extern "C" void cuda_gemm_cd(backend_t *be, const gemm_desc *d, const void *A, const void *B,
                             const void *Cin, void *C, float alpha, float beta)
{
    if (be->err.code || !GEMM_DTYPES_OK(be, d) || d->M <= 0 || d->N <= 0 || d->batch <= 0)
        return;
    gemm_desc dc = *d;
    emu_enqueue(CUDA_IMPL(be)->stream,
                [=]() { gemm_ref(dc, A, B, beta != 0.0f ? Cin : C, C, alpha, beta); });
}

extern "C" void cuda_gemm(backend_t *be, const gemm_desc *d, const void *A, const void *B,
                          void *C, float alpha, float beta)
{
    cuda_gemm_cd(be, d, A, B, C, C, alpha, beta);
}
