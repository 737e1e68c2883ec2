/* Causal grouped-query attention for the fast CPU backend: the score and
 * value products of each head through sgemm (single-threaded inside an
 * OpenMP task), the masked softmax in between. Same semantics as the plain
 * loops of cpu_ops.c (the reference); the T x T scores of one head live only
 * inside the op. The query rows go in blocks of BLAS_RB: a block's products
 * stop at its last row's keys (the causal mask), so for T = 256 they make
 * 62.5% of the T x T products' work (4 blocks), about half for long T. */
#include <cblas.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"

#define F(t) ((float *)(t).p)

#define BLAS_RB 64

/* Rows [r0, r1) of S = scale * Q_h K^T over the keys [0, r1) they can see
 * (row stride T). */
static void scores(float *S, const float *q, const float *k, int T, int r0, int r1, int ldq,
                   int ldk, int hd, float scale)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r1 - r0, r1, hd, scale,
                q + (size_t)r0 * ldq, ldq, k, ldk, 0.0f, S + (size_t)r0 * T, T);
}

/* Rows [r0, r1) of P = softmax over lo(t) <= j <= t, 0 elsewhere in
 * [0, r1) (above the diagonal and before the query's document); their
 * log-sum-exps into lse. */
static void softmax_rows(float *S, float *lse, const int32_t *seg, int T, int r0, int r1)
{
    for (int t = r0; t < r1; t++) {
        float *s = S + (size_t)t * T;
        int lo = cpu_seg_lo(seg, (size_t)t, t);
        float m = -INFINITY;
        for (int j = lo; j <= t; j++)
            m = s[j] > m ? s[j] : m;
        double l = 0.0;
        for (int j = 0; j < lo; j++)
            s[j] = 0.0f;
        cpu_vexp(s + lo, s + lo, (size_t)(t + 1 - lo), 1.0f, -m);
        for (int j = lo; j <= t; j++)
            l += s[j];
        float inv = (float)(1.0 / l);
        for (int j = lo; j <= t; j++)
            s[j] *= inv;
        for (int j = t + 1; j < r1; j++)
            s[j] = 0.0f;
        lse[t] = m + (float)log(l);
    }
}

/* rows x hd (row stride ld) to zero */
static void zero_rows(float *x, int rows, int hd, int ld)
{
    for (int t = 0; t < rows; t++)
        memset(x + (size_t)t * ld, 0, sizeof(float) * (size_t)hd);
}

void cpu_attention_forward_blas(backend_t *be, tensor_t out, tensor_t lse, tensor_t q, tensor_t k,
                                tensor_t v, tensor_t seg, int B, int T, int nh, int nkv, int hd,
                                int q_ld, int kv_ld)
{
    const float *Q = F(q), *K = F(k), *V = F(v);
    const int32_t *SG = seg.p;
    float *O = F(out), *L = F(lse);
    int group = nh / nkv, ldq = q_ld, ldk = kv_ld, ldo = nh * hd;
    float scale = 1.0f / sqrtf((float)hd);
    int failed = 0;
#pragma omp parallel
    {
        float *S = malloc(sizeof(float) * (size_t)T * (size_t)T);
        if (!S) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < nh; h++) {
                if (!S)
                    continue;
                int kh = h / group;
                const float *qh = Q + (size_t)b * T * ldq + (size_t)h * hd;
                const float *kk = K + (size_t)b * T * ldk + (size_t)kh * hd;
                const float *vv = V + (size_t)b * T * ldk + (size_t)kh * hd;
                float *oh = O + (size_t)b * T * ldo + (size_t)h * hd;
                for (int r0 = 0; r0 < T; r0 += BLAS_RB) {
                    int r1 = r0 + BLAS_RB < T ? r0 + BLAS_RB : T;
                    scores(S, qh, kk, T, r0, r1, ldq, ldk, hd, scale);
                    softmax_rows(S, L + ((size_t)b * nh + h) * T, SG ? SG + (size_t)b * T : NULL,
                                 T, r0, r1);
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r1 - r0, hd, r1, 1.0f,
                                S + (size_t)r0 * T, T, vv, ldk, 0.0f, oh + (size_t)r0 * ldo,
                                ldo);
                }
            }
        free(S);
    }
    if (failed)
        be_fail(be, __FILE__, __LINE__, "out of memory for attention scores (T=%d)", T);
}

void cpu_attention_backward_blas(backend_t *be, tensor_t dq, tensor_t dk, tensor_t dv,
                                 tensor_t dout, tensor_t out, tensor_t lse, tensor_t q,
                                 tensor_t k, tensor_t v, tensor_t seg, int B, int T, int nh,
                                 int nkv, int hd, int q_ld, int kv_ld, int dq_ld, int dkv_ld)
{
    const float *Q = F(q), *K = F(k), *V = F(v), *O = F(out), *DO = F(dout), *L = F(lse);
    const int32_t *SG = seg.p;
    float *DQ = F(dq), *DK = F(dk), *DV = F(dv);
    /* row strides: q, k and v; dq, dk and dv; out and dout (contiguous) */
    int group = nh / nkv, ldq = q_ld, ldk = kv_ld, lddq = dq_ld, lddk = dkv_ld, ldo = nh * hd;
    float scale = 1.0f / sqrtf((float)hd);
    int failed = 0;
    /* one task per (batch, kv head): it owns dK, dV of that head */
#pragma omp parallel
    {
        float *P = malloc(sizeof(float) * (size_t)T * (size_t)T);
        float *dP = malloc(sizeof(float) * (size_t)T * (size_t)T);
        float *D = malloc(sizeof(float) * (size_t)T);
        if (!P || !dP || !D) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int b = 0; b < B; b++)
            for (int kh = 0; kh < nkv; kh++) {
                if (!P || !dP || !D)
                    continue;
                const float *kk = K + (size_t)b * T * ldk + (size_t)kh * hd;
                const float *vv = V + (size_t)b * T * ldk + (size_t)kh * hd;
                float *dkk = DK + (size_t)b * T * lddk + (size_t)kh * hd;
                float *dvv = DV + (size_t)b * T * lddk + (size_t)kh * hd;
                zero_rows(dkk, T, hd, lddk);
                zero_rows(dvv, T, hd, lddk);
                for (int h = kh * group; h < (kh + 1) * group; h++) {
                    size_t qo = (size_t)b * T * ldq + (size_t)h * hd;
                    size_t oo = (size_t)b * T * ldo + (size_t)h * hd;
                    size_t dqo = (size_t)b * T * lddq + (size_t)h * hd;
                    const float *lh = L + ((size_t)b * nh + h) * T;
                    for (int r0 = 0; r0 < T; r0 += BLAS_RB) {
                        int r1 = r0 + BLAS_RB < T ? r0 + BLAS_RB : T, rows = r1 - r0;
                        size_t qr = qo + (size_t)r0 * ldq, or_ = oo + (size_t)r0 * ldo;
                        float *pr = P + (size_t)r0 * T, *dpr = dP + (size_t)r0 * T;
                        /* P from the saved log-sum-exps */
                        scores(P, Q + qo, kk, T, r0, r1, ldq, ldk, hd, scale);
                        for (int t = r0; t < r1; t++) {
                            float *p = P + (size_t)t * T;
                            int lo = cpu_seg_lo(SG, (size_t)b * T + t, t);
                            for (int j = 0; j < lo; j++)
                                p[j] = 0.0f; /* dS is 0 there too: p (dP - D) */
                            cpu_vexp(p + lo, p + lo, (size_t)(t + 1 - lo), 1.0f, -lh[t]);
                            for (int j = t + 1; j < r1; j++)
                                p[j] = 0.0f;
                            const float *ot = O + oo + (size_t)t * ldo;
                            const float *dot = DO + oo + (size_t)t * ldo;
                            float acc = 0.0f;
                            for (int d = 0; d < hd; d++)
                                acc += dot[d] * ot[d];
                            D[t] = acc;
                        }
                        /* dV += P^T dO;  dP = dO V^T;  dS = P (dP - D) scale,
                         * over the keys [0, r1) the block sees */
                        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, r1, hd, rows, 1.0f,
                                    pr, T, DO + or_, ldo, 1.0f, dvv, lddk);
                        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, r1, hd, 1.0f,
                                    DO + or_, ldo, vv, ldk, 0.0f, dpr, T);
                        for (int t = r0; t < r1; t++) {
                            float *p = P + (size_t)t * T, *g = dP + (size_t)t * T;
                            for (int j = 0; j <= t; j++)
                                p[j] = p[j] * (g[j] - D[t]) * scale;
                        }
                        /* dQ = dS K;  dK += dS^T Q */
                        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hd, r1, 1.0f,
                                    pr, T, kk, ldk, 0.0f, DQ + dqo + (size_t)r0 * lddq, lddq);
                        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, r1, hd, rows, 1.0f,
                                    pr, T, Q + qr, ldq, 1.0f, dkk, lddk);
                    }
                }
            }
        free(P);
        free(dP);
        free(D);
    }
    if (failed)
        be_fail(be, __FILE__, __LINE__, "out of memory for attention scores (T=%d)", T);
}
