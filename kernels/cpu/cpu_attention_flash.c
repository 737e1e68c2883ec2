/* kernels/cpu/cpu_attention_flash.c — the CPU twin of FlashAttention-2: the
 * fast CPU backend's attention (kind "cpu"; backend.h gives the semantics,
 * cpu_ops.c's plain loops are the reference, kind "cpu-ref").
 *
 * Forward, per (batch row, head, tile of FLASH_BR query rows): walk the
 * tiles of FLASH_BC keys from the first one a row of the tile may see (the
 * smallest document start, seg) to the diagonal; S = scale Q_i K_j^T
 * (sgemm), masked (above the diagonal, before the query's document) to
 * -inf; a running max m and sum l per row rescale the output accumulator
 * (online softmax); O_i += P V_j (sgemm). At the end O_i /= l and lse = m +
 * log(l) is saved for the backward. Tiles entirely above the diagonal or
 * before every row's document are never visited.
 *
 * Backward, per (batch row, kv head): that task owns dK, dV of the kv head
 * and dQ of the query heads sharing it (no two tasks write one output, so
 * the result does not depend on the thread count). For each query head and
 * query tile: D = rowsum(dO * O); for each key tile it sees: P = exp(S -
 * lse) recomputed from Q, K and the saved lse, dV_j += P^T dO_i, dP = dO_i
 * V_j^T, dS = P (dP - D) scale, dQ_i += dS K_j, dK_j += dS^T Q_i.
 *
 * GQA by indexing: query head h reads kv head h / (nh / nkv) in place.
 * Memory: a few FLASH_BR x FLASH_BC tiles per thread (nothing T x T); any T
 * (edge tiles are partial) and any head dim. */
#include <cblas.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"

#define F(t) ((float *)(t).p)

/* One (batch row, head) slice: the strided rows of q (ldq), k/v (ldk) and
 * out/dout (ldo), its seg row, and the shape. */
typedef struct flash_head {
    const float *q, *k, *v;
    const int32_t *seg;
    int T, hd, ldq, ldk, ldo;
    float scale;
} flash_head;

/* The smallest first key of the query rows [i0, i1): the first key tile
 * the tile needs. */
static int tile_lo(const int32_t *seg, int i0, int i1)
{
    int lo = i1;
    for (int t = i0; t < i1; t++) {
        int l = cpu_seg_lo(seg, (size_t)t, t);
        lo = l < lo ? l : lo;
    }
    return lo;
}

/* S[r, c] = scale q_{i0+r} . k_{j0+c} for rows [i0,i1), keys [j0,j1)
 * (row stride FLASH_BC), -inf where key j0+c is not visible to query i0+r
 * (above the diagonal or before the query's document). */
static void tile_scores(float *S, const flash_head *f, int i0, int i1, int j0, int j1)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, i1 - i0, j1 - j0, f->hd, f->scale,
                f->q + (size_t)i0 * f->ldq, f->ldq, f->k + (size_t)j0 * f->ldk, f->ldk, 0.0f, S,
                FLASH_BC);
    for (int t = i0; t < i1; t++) {
        float *s = S + (size_t)(t - i0) * FLASH_BC;
        int lo = cpu_seg_lo(f->seg, (size_t)t, t);
        for (int j = j0; j < j1; j++)
            if (j < lo || j > t)
                s[j - j0] = -INFINITY;
    }
}

/* The online-softmax step of one row: s (n scores, -inf where masked)
 * becomes exp(s - m_new) in place; m, l are updated; returns the factor
 * the row's output accumulator must be multiplied by. */
static float online_row(float *s, int n, float *m, float *l)
{
    float mx = *m;
    for (int j = 0; j < n; j++)
        mx = s[j] > mx ? s[j] : mx;
    if (mx == -INFINITY) { /* nothing visible yet in this row */
        for (int j = 0; j < n; j++)
            s[j] = 0.0f;
        return 1.0f;
    }
    float corr = *m == -INFINITY ? 0.0f : expf(*m - mx), sum = 0.0f;
    cpu_vexp(s, s, (size_t)n, 1.0f, -mx); /* mx is finite: exp(-inf - mx) = 0 */
    for (int j = 0; j < n; j++)
        sum += s[j];
    *m = mx;
    *l = *l * corr + sum;
    return corr;
}

/* Query rows [i0, i1) of one head: out rows (stride ldo) and lse. */
static void forward_tile(const flash_head *f, float *out, float *lse, int i0, int i1, float *S,
                         float *m, float *l)
{
    int rows = i1 - i0, hd = f->hd;
    for (int r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(out + (size_t)(i0 + r) * f->ldo, 0, sizeof(float) * hd);
    }
    int jstart = tile_lo(f->seg, i0, i1) / FLASH_BC * FLASH_BC;
    for (int j0 = jstart; j0 < i1; j0 += FLASH_BC) {
        int j1 = j0 + FLASH_BC < i1 ? j0 + FLASH_BC : i1;
        tile_scores(S, f, i0, i1, j0, j1);
        for (int r = 0; r < rows; r++) {
            float corr = online_row(S + (size_t)r * FLASH_BC, j1 - j0, &m[r], &l[r]);
            if (corr != 1.0f) {
                float *o = out + (size_t)(i0 + r) * f->ldo;
                for (int d = 0; d < hd; d++)
                    o[d] *= corr;
            }
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hd, j1 - j0, 1.0f, S,
                    FLASH_BC, f->v + (size_t)j0 * f->ldk, f->ldk, 1.0f,
                    out + (size_t)i0 * f->ldo, f->ldo);
    }
    for (int r = 0; r < rows; r++) {
        float inv = 1.0f / l[r], *o = out + (size_t)(i0 + r) * f->ldo;
        for (int d = 0; d < hd; d++)
            o[d] *= inv;
        lse[i0 + r] = m[r] + logf(l[r]);
    }
}

static flash_head head_of(const float *Q, const float *K, const float *V, const int32_t *SG,
                          int b, int h, int kh, int T, int nh, int hd, int q_ld, int kv_ld)
{
    flash_head f;
    f.ldq = q_ld;
    f.ldk = kv_ld;
    f.ldo = nh * hd;
    f.q = Q + (size_t)b * T * f.ldq + (size_t)h * hd;
    f.k = K + (size_t)b * T * f.ldk + (size_t)kh * hd;
    f.v = V + (size_t)b * T * f.ldk + (size_t)kh * hd;
    f.seg = SG ? SG + (size_t)b * T : NULL;
    f.T = T;
    f.hd = hd;
    f.scale = 1.0f / sqrtf((float)hd);
    return f;
}

void cpu_attention_forward_flash(backend_t *be, tensor_t out, tensor_t lse, tensor_t q,
                                 tensor_t k, tensor_t v, tensor_t seg, int B, int T, int nh,
                                 int nkv, int hd, int q_ld, int kv_ld)
{
    const float *Q = F(q), *K = F(k), *V = F(v);
    float *O = F(out), *L = F(lse);
    int group = nh / nkv, ntiles = (T + FLASH_BR - 1) / FLASH_BR, failed = 0;
#pragma omp parallel
    {
        float *S = malloc(sizeof(float) * FLASH_BR * FLASH_BC);
        float *ml = malloc(sizeof(float) * 2 * FLASH_BR);
        if (!S || !ml) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) collapse(3)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < nh; h++)
                for (int it = 0; it < ntiles; it++) {
                    if (!S || !ml)
                        continue;
                    flash_head f = head_of(Q, K, V, seg.p, b, h, h / group, T, nh, hd, q_ld,
                                           kv_ld);
                    int i0 = it * FLASH_BR, i1 = i0 + FLASH_BR < T ? i0 + FLASH_BR : T;
                    forward_tile(&f, O + (size_t)b * T * f.ldo + (size_t)h * hd,
                                 L + ((size_t)b * nh + h) * T, i0, i1, S, ml, ml + FLASH_BR);
                }
        free(S);
        free(ml);
    }
    if (failed)
        be_fail(be, __FILE__, __LINE__, "out of memory for attention tiles");
}

/* ---- backward ----------------------------------------------------------- */

/* One head's: o, dout (row stride the head's ldo), dq (lddq), dk, dv
 * (lddk) */
typedef struct flash_grads {
    const float *o, *dout, *lse;
    float *dq, *dk, *dv;
    int lddq, lddk;
} flash_grads;

/* Scratch of one thread: two score tiles and D of a query tile. */
typedef struct flash_scratch {
    float *P, *dP, *D;
} flash_scratch;

/* The key tile [j0, j1) against query rows [i0, i1) of one head. */
static void backward_pair(const flash_head *f, const flash_grads *g, int i0, int i1, int j0,
                          int j1, const flash_scratch *w)
{
    int rows = i1 - i0, cols = j1 - j0, hd = f->hd;
    float *P = w->P, *dP = w->dP;
    tile_scores(P, f, i0, i1, j0, j1);
    for (int r = 0; r < rows; r++) {
        float *p = P + (size_t)r * FLASH_BC, lt = g->lse[i0 + r];
        if (isfinite(lt)) {
            cpu_vexp(p, p, (size_t)cols, 1.0f, -lt); /* exp(-inf - lt) = 0 */
            continue;
        }
        for (int c = 0; c < cols; c++)
            p[c] = p[c] == -INFINITY ? 0.0f : expf(p[c] - lt);
    }
    const float *dO = g->dout + (size_t)i0 * f->ldo;
    /* dV_j += P^T dO_i;  dP = dO_i V_j^T */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols, hd, rows, 1.0f, P, FLASH_BC, dO,
                f->ldo, 1.0f, g->dv + (size_t)j0 * g->lddk, g->lddk);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, hd, 1.0f, dO, f->ldo,
                f->v + (size_t)j0 * f->ldk, f->ldk, 0.0f, dP, FLASH_BC);
    for (int r = 0; r < rows; r++) {
        float *p = P + (size_t)r * FLASH_BC, *gp = dP + (size_t)r * FLASH_BC, d = w->D[r];
        for (int c = 0; c < cols; c++)
            p[c] = p[c] * (gp[c] - d) * f->scale;
    }
    /* dQ_i += dS K_j;  dK_j += dS^T Q_i */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hd, cols, 1.0f, P, FLASH_BC,
                f->k + (size_t)j0 * f->ldk, f->ldk, 1.0f, g->dq + (size_t)i0 * g->lddq, g->lddq);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols, hd, rows, 1.0f, P, FLASH_BC,
                f->q + (size_t)i0 * f->ldq, f->ldq, 1.0f, g->dk + (size_t)j0 * g->lddk, g->lddk);
}

/* Query rows [i0, i1) of one head against every key tile they see. */
static void backward_tile(const flash_head *f, const flash_grads *g, int i0, int i1,
                          const flash_scratch *w)
{
    for (int t = i0; t < i1; t++) {
        const float *o = g->o + (size_t)t * f->ldo, *d = g->dout + (size_t)t * f->ldo;
        float acc = 0.0f;
        for (int e = 0; e < f->hd; e++)
            acc += d[e] * o[e];
        w->D[t - i0] = acc;
        memset(g->dq + (size_t)t * g->lddq, 0, sizeof(float) * f->hd);
    }
    int jstart = tile_lo(f->seg, i0, i1) / FLASH_BC * FLASH_BC;
    for (int j0 = jstart; j0 < i1; j0 += FLASH_BC)
        backward_pair(f, g, i0, i1, j0, j0 + FLASH_BC < i1 ? j0 + FLASH_BC : i1, w);
}

/* Everything of kv head kh of batch row b (all: the whole tensors, with
 * their gradients' row strides; q_ld, kv_ld: q's and k/v's). */
static void backward_kv_head(const float *Q, const float *K, const float *V, const int32_t *SG,
                             const flash_grads *all, int b, int kh, int T, int nh, int nkv,
                             int hd, int q_ld, int kv_ld, const flash_scratch *w)
{
    int group = nh / nkv;
    for (int h = kh * group; h < (kh + 1) * group; h++) {
        flash_head f = head_of(Q, K, V, SG, b, h, kh, T, nh, hd, q_ld, kv_ld);
        size_t oo = (size_t)b * T * f.ldo + (size_t)h * hd;
        size_t dqo = (size_t)b * T * all->lddq + (size_t)h * hd;
        size_t dko = (size_t)b * T * all->lddk + (size_t)kh * hd;
        flash_grads g = {all->o + oo, all->dout + oo, all->lse + ((size_t)b * nh + h) * T,
                         all->dq + dqo, all->dk + dko, all->dv + dko, all->lddq, all->lddk};
        if (h == kh * group)
            for (int j = 0; j < T; j++) {
                memset(g.dk + (size_t)j * g.lddk, 0, sizeof(float) * hd);
                memset(g.dv + (size_t)j * g.lddk, 0, sizeof(float) * hd);
            }
        for (int i0 = 0; i0 < T; i0 += FLASH_BR)
            backward_tile(&f, &g, i0, i0 + FLASH_BR < T ? i0 + FLASH_BR : T, w);
    }
}

void cpu_attention_backward_flash(backend_t *be, tensor_t dq, tensor_t dk, tensor_t dv,
                                  tensor_t dout, tensor_t out, tensor_t lse, tensor_t q,
                                  tensor_t k, tensor_t v, tensor_t seg, int B, int T, int nh,
                                  int nkv, int hd, int q_ld, int kv_ld, int dq_ld, int dkv_ld)
{
    flash_grads all = {F(out), F(dout), F(lse), F(dq), F(dk), F(dv), dq_ld, dkv_ld};
    int failed = 0;
#pragma omp parallel
    {
        flash_scratch w = {malloc(sizeof(float) * FLASH_BR * FLASH_BC),
                           malloc(sizeof(float) * FLASH_BR * FLASH_BC),
                           malloc(sizeof(float) * FLASH_BR)};
        if (!w.P || !w.dP || !w.D) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int b = 0; b < B; b++)
            for (int kh = 0; kh < nkv; kh++)
                if (w.P && w.dP && w.D)
                    backward_kv_head(F(q), F(k), F(v), seg.p, &all, b, kh, T, nh, nkv, hd, q_ld,
                                     kv_ld, &w);
        free(w.P);
        free(w.dP);
        free(w.D);
    }
    if (failed)
        be_fail(be, __FILE__, __LINE__, "out of memory for attention tiles");
}
