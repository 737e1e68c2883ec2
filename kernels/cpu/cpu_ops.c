/* CPU math ops: the specification of each op's math but the matrix
 * product, forward and backward side by side. The product is in
 * cpu_backend.c (matmul_plain is its specification, OpenBLAS its fast path);
 * the backward of a linear layer is no op of its own: trainer/model_graph.c
 * builds it from two products with transposes (dX = dY W, dW += dY^T X). Float32 storage; sums that decide results (norms, softmax,
 * losses, reductions) accumulate in double. Every loop is parallel over
 * independent outputs only, so results never depend on the thread count.
 * The arguments have been checked (kernels/backend_ops.c): every tensor is
 * F32 (I32 for ids) and holds what the sizes need. Ids are data: the ops
 * handle those outside the table themselves, as the CUDA kernels do. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../nf4.h"
#include "cpu_backend.h"

#define F(t) ((float *)(t).p)
#define I(t) ((int32_t *)(t).p)

/* ---- RMSNorm ------------------------------------------------------------ */

void cpu_rmsnorm_forward(backend_t *be, tensor_t out, tensor_t rstd, tensor_t x, tensor_t w,
                         int rows, int cols, float eps)
{
    (void)be;
    const float *X = F(x), *W = F(w);
    float *O = F(out), *R = F(rstd);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *xr = X + (size_t)r * cols;
        double ss = 0.0;
        for (int c = 0; c < cols; c++)
            ss += (double)xr[c] * xr[c];
        float s = (float)(1.0 / sqrt(ss / cols + (double)eps));
        R[r] = s;
        float *o = O + (size_t)r * cols;
        for (int c = 0; c < cols; c++)
            o[c] = W[c] * (xr[c] * s);
    }
}

void cpu_rmsnorm_backward(backend_t *be, tensor_t dx, tensor_t dw, tensor_t dout, tensor_t x,
                          tensor_t w, tensor_t rstd, int rows, int cols)
{
    (void)be;
    const float *X = F(x), *W = F(w), *DO = F(dout), *R = F(rstd);
    float *DX = F(dx);
    /* dx = rstd * (g - xhat * mean(g * xhat)),  g = dout * w,  xhat = x * rstd */
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *xr = X + (size_t)r * cols, *dor = DO + (size_t)r * cols;
        float s = R[r];
        double dot = 0.0;
        for (int c = 0; c < cols; c++)
            dot += (double)dor[c] * W[c] * (xr[c] * s);
        float mean = (float)(dot / cols);
        float *dxr = DX + (size_t)r * cols;
        for (int c = 0; c < cols; c++)
            dxr[c] += s * (dor[c] * W[c] - (xr[c] * s) * mean);
    }
    if (!dw.p)
        return;
    float *DW = F(dw);
#pragma omp parallel for schedule(static)
    for (int c = 0; c < cols; c++) {
        double acc = 0.0;
        for (int r = 0; r < rows; r++)
            acc += (double)DO[(size_t)r * cols + c] * (X[(size_t)r * cols + c] * R[r]);
        DW[c] += (float)acc;
    }
}

/* ---- RoPE (rotate-half) --------------------------------------------------- */

void cpu_rope(backend_t *be, tensor_t x, tensor_t src, tensor_t cos, tensor_t sin, tensor_t pos,
              int B, int T, int nh, int hd, int inverse, int x_ld, int src_ld)
{
    (void)be;
    float *X = F(x);
    const float *SRC = F(src), *C = F(cos), *S = F(sin);
    const int32_t *P = pos.p;
    int half = hd / 2;
    float sgn = inverse ? -1.0f : 1.0f;
    /* out[i] = x[i] cos - x[i+half] sin;  out[i+half] = x[i+half] cos + x[i] sin */
#pragma omp parallel for schedule(static)
    for (int bt = 0; bt < B * T; bt++) {
        int t = bt % T;
        if (P) /* the token's position, clamped to the table */
            t = P[bt] < 0 ? 0 : P[bt] >= T ? T - 1 : P[bt];
        const float *c = C + (size_t)t * half, *s = S + (size_t)t * half;
        for (int h = 0; h < nh; h++) {
            const float *u = SRC + (size_t)bt * (size_t)src_ld + (size_t)h * hd;
            float *v = X + (size_t)bt * (size_t)x_ld + (size_t)h * hd;
            for (int i = 0; i < half; i++) {
                float a = u[i], b = u[i + half], sn = sgn * s[i];
                v[i] = a * c[i] - b * sn;
                v[i + half] = b * c[i] + a * sn;
            }
        }
    }
}

/* ---- causal grouped-query attention ------------------------------------- */

static float dotf(const float *a, const float *b, int n)
{
    float acc = 0.0f;
    for (int i = 0; i < n; i++)
        acc += a[i] * b[i];
    return acc;
}

void cpu_attention_forward(backend_t *be, tensor_t out, tensor_t lse, tensor_t q, tensor_t k,
                           tensor_t v, tensor_t seg, int B, int T, int nh, int nkv, int hd,
                           int q_ld, int kv_ld)
{
    const float *Q = F(q), *K = F(k), *V = F(v);
    const int32_t *SG = seg.p;
    float *O = F(out), *L = F(lse);
    int group = nh / nkv, failed = 0;
    float scale = 1.0f / sqrtf((float)hd);
#pragma omp parallel
    {
        float *p = malloc(sizeof(float) * (size_t)T);
        double *acc = malloc(sizeof(double) * (size_t)hd);
        if (!p || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < nh; h++) {
                int kh = h / group;
                for (int t = 0; t < T && p && acc; t++) {
                    const float *qt = Q + ((size_t)b * T + t) * q_ld + (size_t)h * hd;
                    int lo = cpu_seg_lo(SG, (size_t)b * T + t, t);
                    float m = -INFINITY;
                    for (int j = lo; j <= t; j++) {
                        const float *kj = K + ((size_t)b * T + j) * kv_ld + (size_t)kh * hd;
                        p[j] = dotf(qt, kj, hd) * scale;
                        if (p[j] > m)
                            m = p[j];
                    }
                    double l = 0.0;
                    for (int d = 0; d < hd; d++)
                        acc[d] = 0.0;
                    for (int j = lo; j <= t; j++) {
                        float e = expf(p[j] - m);
                        l += e;
                        const float *vj = V + ((size_t)b * T + j) * kv_ld + (size_t)kh * hd;
                        for (int d = 0; d < hd; d++)
                            acc[d] += (double)e * vj[d];
                    }
                    float *ot = O + (((size_t)b * T + t) * nh + h) * hd;
                    for (int d = 0; d < hd; d++)
                        ot[d] = (float)(acc[d] / l);
                    L[((size_t)b * nh + h) * T + t] = m + (float)log(l);
                }
            }
        free(p);
        free(acc);
    }
    if (failed)
        be_fail(be, __FILE__, __LINE__, "out of memory for attention scores (T=%d)", T);
}

void cpu_attention_backward(backend_t *be, tensor_t dq, tensor_t dk, tensor_t dv, tensor_t dout,
                            tensor_t out, tensor_t lse, tensor_t q, tensor_t k, tensor_t v,
                            tensor_t seg, int B, int T, int nh, int nkv, int hd, int q_ld,
                            int kv_ld, int dq_ld, int dkv_ld)
{
    const float *Q = F(q), *K = F(k), *V = F(v), *O = F(out), *DO = F(dout), *L = F(lse);
    const int32_t *SG = seg.p;
    float *DQ = F(dq), *DK = F(dk), *DV = F(dv);
    int group = nh / nkv, failed = 0;
    float scale = 1.0f / sqrtf((float)hd);
    /* One task per (batch, kv head): it owns dk, dv of that head, and dq of
     * the query heads that share it, so no two tasks write the same output. */
#pragma omp parallel
    {
        float *ds = malloc(sizeof(float) * (size_t)T);
        if (!ds) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int b = 0; b < B; b++)
            for (int kh = 0; kh < nkv; kh++) {
                for (int t = 0; t < T; t++) {
                    size_t dkvo = ((size_t)b * T + t) * dkv_ld + (size_t)kh * hd;
                    memset(DK + dkvo, 0, sizeof(float) * hd);
                    memset(DV + dkvo, 0, sizeof(float) * hd);
                }
                for (int h = kh * group; h < (kh + 1) * group && ds; h++) {
                    for (int t = 0; t < T; t++) {
                        size_t qo = (((size_t)b * T + t) * nh + h) * hd; /* out, dout */
                        const float *qt = Q + ((size_t)b * T + t) * q_ld + (size_t)h * hd;
                        const float *dot_ = DO + qo;
                        float lt = L[((size_t)b * nh + h) * T + t];
                        float D = dotf(dot_, O + qo, hd);
                        float *dqt = DQ + ((size_t)b * T + t) * dq_ld + (size_t)h * hd;
                        int lo = cpu_seg_lo(SG, (size_t)b * T + t, t);
                        for (int d = 0; d < hd; d++)
                            dqt[d] = 0.0f;
                        for (int j = lo; j <= t; j++) {
                            size_t kvo = ((size_t)b * T + j) * kv_ld + (size_t)kh * hd;
                            float pj = expf(dotf(qt, K + kvo, hd) * scale - lt);
                            float dp = dotf(dot_, V + kvo, hd);
                            ds[j] = pj * (dp - D) * scale;
                            float *dvj = DV + ((size_t)b * T + j) * dkv_ld + (size_t)kh * hd;
                            for (int d = 0; d < hd; d++)
                                dvj[d] += pj * dot_[d];
                        }
                        for (int j = lo; j <= t; j++) {
                            const float *kj = K + ((size_t)b * T + j) * kv_ld + (size_t)kh * hd;
                            float *dkj = DK + ((size_t)b * T + j) * dkv_ld + (size_t)kh * hd;
                            for (int d = 0; d < hd; d++) {
                                dqt[d] += ds[j] * kj[d];
                                dkj[d] += ds[j] * qt[d];
                            }
                        }
                    }
                }
            }
        free(ds);
    }
    if (failed)
        be_fail(be, __FILE__, __LINE__, "out of memory for attention scores (T=%d)", T);
}

/* ---- SwiGLU ------------------------------------------------------------- */

/* SwiGLU's rows are taken in chunks of SILU_CHUNK columns: e = exp(-g) for
 * a chunk at once (cpu_vexp on the fast path, expf on the reference), then
 * s = 1 / (1 + e). */
#define SILU_CHUNK 256

static void neg_exp(float *e, const float *g, int n, int fast)
{
    if (fast) {
        cpu_vexp(e, g, (size_t)n, -1.0f, 0.0f);
        return;
    }
    for (int k = 0; k < n; k++)
        e[k] = expf(-g[k]);
}

void cpu_swiglu_forward(backend_t *be, tensor_t out, tensor_t g, tensor_t u, int rows, int cols,
                        int ld)
{
    int fast = !cpu_is_reference(be);
    const float *G = F(g), *U = F(u);
    float *O = F(out);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++)
        for (int c0 = 0; c0 < cols; c0 += SILU_CHUNK) {
            int n = cols - c0 < SILU_CHUNK ? cols - c0 : SILU_CHUNK;
            size_t i0 = (size_t)r * (size_t)ld + (size_t)c0;
            float e[SILU_CHUNK];
            neg_exp(e, G + i0, n, fast);
            float *o = O + (size_t)r * (size_t)cols + (size_t)c0;
            for (int k = 0; k < n; k++) {
                float gv = G[i0 + k], s = 1.0f / (1.0f + e[k]);
                o[k] = gv * s * U[i0 + k];
            }
        }
}

void cpu_swiglu_backward(backend_t *be, tensor_t dg, tensor_t du, tensor_t dout, tensor_t g,
                         tensor_t u, int rows, int cols, int ld)
{
    int fast = !cpu_is_reference(be);
    const float *G = F(g), *U = F(u), *DO = F(dout);
    float *DG = F(dg), *DU = F(du);
    /* silu'(g) = s (1 + g (1 - s)); each element's g and u read before its
     * dg and du are written: they may be the same memory */
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++)
        for (int c0 = 0; c0 < cols; c0 += SILU_CHUNK) {
            int n = cols - c0 < SILU_CHUNK ? cols - c0 : SILU_CHUNK;
            size_t i0 = (size_t)r * (size_t)ld + (size_t)c0;
            float e[SILU_CHUNK];
            neg_exp(e, G + i0, n, fast);
            const float *d0 = DO + (size_t)r * (size_t)cols + (size_t)c0;
            for (int k = 0; k < n; k++) {
                size_t i = i0 + (size_t)k;
                float gv = G[i], uv = U[i], d = d0[k];
                float s = 1.0f / (1.0f + e[k]);
                DG[i] = d * uv * s * (1.0f + gv * (1.0f - s));
                DU[i] = d * gv * s;
            }
        }
}

/* ---- embedding ---------------------------------------------------------- */

/* Token id t names a row of a table of `rows` rows (H columns of table.n
 * values); one outside it gives a zero row and gets no gradient, as on CUDA
 * (the model checks ids first). */
static size_t table_rows(tensor_t table, int H)
{
    return H > 0 ? table.n / (size_t)H : 0;
}

static int in_table(int32_t t, size_t rows)
{
    return t >= 0 && (size_t)t < rows;
}

void cpu_embedding_forward(backend_t *be, tensor_t out, tensor_t table, tensor_t tokens, int n,
                           int H)
{
    (void)be;
    if (H <= 0)
        return;
    size_t vocab = table_rows(table, H);
    const float *W = F(table);
    const int32_t *tok = I(tokens);
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++) {
        float *o = F(out) + (size_t)i * H;
        if (in_table(tok[i], vocab))
            memcpy(o, W + (size_t)tok[i] * H, sizeof(float) * H);
        else
            memset(o, 0, sizeof(float) * H);
    }
}

void cpu_embedding_backward(backend_t *be, tensor_t dtable, tensor_t dout, tensor_t tokens,
                            tensor_t order, tensor_t runs, int n, int H)
{
    size_t vocab = table_rows(dtable, H);
    const int32_t *tok = I(tokens), *ord = I(order), *run = I(runs);
    int u = run[0] < 0 ? 0 : run[0] > n ? n : run[0], failed = 0;
    /* an id's rows summed in position order, then added: as the CUDA kernel */
#pragma omp parallel
    {
        float *acc = malloc(sizeof(float) * (size_t)H);
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 16)
        for (int j = 0; j < u; j++) {
            int lo = run[1 + j], hi = run[2 + j];
            if (!acc || lo < 0 || hi > n || lo >= hi || ord[lo] < 0 || ord[lo] >= n ||
                !in_table(tok[ord[lo]], vocab))
                continue;
            memset(acc, 0, sizeof(float) * (size_t)H);
            for (int k = lo; k < hi; k++) {
                if (ord[k] < 0 || ord[k] >= n)
                    continue;
                const float *x = F(dout) + (size_t)ord[k] * H;
                for (int c = 0; c < H; c++)
                    acc[c] += x[c];
            }
            float *d = F(dtable) + (size_t)tok[ord[lo]] * H;
            for (int c = 0; c < H; c++)
                d[c] += acc[c];
        }
        free(acc);
    }
    if (failed)
        be_fail(be, __FILE__, __LINE__, "out of memory in embedding_backward");
}

/* ---- fused softmax cross-entropy ---------------------------------------- */

void cpu_cross_entropy(backend_t *be, tensor_t logits, tensor_t loss, tensor_t targets, int rows,
                       int V, float grad_scale, tensor_t scale)
{
    int fast = !cpu_is_reference(be);
    if (scale.p)
        grad_scale *= *(const float *)scale.p;
    float *X = F(logits), *Lo = F(loss);
    const int32_t *tg = I(targets);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        float *x = X + (size_t)r * V;
        int t = tg[r];
        if (t < 0 || t >= V) { /* ignored row (a target outside [0, V) too, as on CUDA) */
            memset(x, 0, sizeof(float) * V);
            Lo[r] = 0.0f;
            continue;
        }
        float m = -INFINITY, xt = x[t];
        double s = 0.0;
        if (fast) { /* one exp per logit, kept for the gradient; the max and
                     * the sum over vector lanes (another order, the same
                     * every run) */
#pragma omp simd reduction(max : m)
            for (int i = 0; i < V; i++)
                m = x[i] > m ? x[i] : m;
            cpu_vexp(x, x, (size_t)V, 1.0f, -m);
#pragma omp simd reduction(+ : s)
            for (int i = 0; i < V; i++)
                s += x[i];
        } else {
            for (int i = 0; i < V; i++)
                if (x[i] > m)
                    m = x[i];
            for (int i = 0; i < V; i++) {
                float e = expf(x[i] - m);
                x[i] = e;
                s += e;
            }
        }
        Lo[r] = (float)(m + log(s) - xt);
        float g = (float)(grad_scale / s);
        for (int i = 0; i < V; i++)
            x[i] *= g;
        x[t] -= grad_scale;
    }
}

/* ---- elementwise and reductions ----------------------------------------- */

void cpu_add(backend_t *be, tensor_t y, tensor_t x, float alpha, size_t n)
{
    (void)be;
    float *Y = F(y);
    const float *X = F(x);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        Y[i] += alpha * X[i];
}

void cpu_add_bias(backend_t *be, tensor_t y, tensor_t b, int rows, int cols)
{
    (void)be;
    float *Y = F(y);
    const float *Bv = F(b);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            Y[(size_t)r * cols + c] += Bv[c];
}

void cpu_bias_backward(backend_t *be, tensor_t db, tensor_t dy, int rows, int cols)
{
    (void)be;
    float *DB = F(db);
    const float *DY = F(dy);
#pragma omp parallel for schedule(static)
    for (int c = 0; c < cols; c++) {
        double acc = 0.0;
        for (int r = 0; r < rows; r++)
            acc += DY[(size_t)r * cols + c];
        DB[c] += (float)acc;
    }
}

void cpu_weight_norm(backend_t *be, tensor_t n, tensor_t W, tensor_t A, tensor_t B, float scale,
                     int out, int in, int r)
{
    (void)be;
    float *N = F(n);
    const float *Wv = F(W), *Av = r > 0 ? F(A) : NULL, *Bv = r > 0 ? F(B) : NULL;
#pragma omp parallel for schedule(static)
    for (int o = 0; o < out; o++) {
        double acc = 0.0;
        for (int j = 0; j < in; j++) {
            double v = 0.0;
            for (int k = 0; k < r; k++)
                v += (double)Bv[(size_t)o * r + k] * Av[(size_t)k * in + j];
            v = Wv[(size_t)o * in + j] + (double)scale * v;
            acc += v * v;
        }
        N[o] = (float)sqrt(acc);
    }
}

void cpu_dequant_nf4(backend_t *be, tensor_t out, tensor_t codes, tensor_t absmax, tensor_t nested,
                     tensor_t maps, float offset, size_t n)
{
    (void)be;
    size_t chunks = (n + NF4_BLOCK - 1) / NF4_BLOCK;
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < chunks; b++) {
        size_t lo = b * NF4_BLOCK, hi = lo + NF4_BLOCK < n ? lo + NF4_BLOCK : n;
        nf4_dequantize_range(codes.p, absmax.p, F(nested), F(maps), offset, lo, hi, F(out) + lo);
    }
}

/* nf4_quantize_codes itself, on the values as F32 (maps: its own table,
 * the same values) */
void cpu_quantize_nf4(backend_t *be, tensor_t codes, tensor_t absmax, tensor_t x, tensor_t maps,
                      size_t n)
{
    (void)maps;
    if (x.dt == DT_F32) {
        nf4_quantize_codes(F(x), n, codes.p, F(absmax));
        return;
    }
    float *v = malloc(sizeof(float) * (n ? n : 1));
    if (!v || dtype_convert(v, DT_F32, x.p, x.dt, n)) {
        be_fail(be, __FILE__, __LINE__, "quantize_nf4: out of memory for %zu values", n);
    } else {
        nf4_quantize_codes(v, n, codes.p, F(absmax));
    }
    free(v);
}

void cpu_col_scale(backend_t *be, tensor_t y, tensor_t num, tensor_t den, int rows, int cols)
{
    (void)be;
    float *Y = F(y);
    const float *Nu = F(num), *De = F(den);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            Y[(size_t)r * cols + c] *= Nu[c] / De[c];
}

void cpu_col_dot(backend_t *be, tensor_t out, tensor_t x, tensor_t y, tensor_t den, int rows,
                 int cols)
{
    (void)be;
    float *O = F(out);
    const float *X = F(x), *Y = F(y), *De = F(den);
#pragma omp parallel for schedule(static)
    for (int c = 0; c < cols; c++) {
        double acc = 0.0;
        for (int r = 0; r < rows; r++)
            acc += (double)X[(size_t)r * cols + c] * Y[(size_t)r * cols + c];
        O[c] += (float)(acc / De[c]);
    }
}

void cpu_dropout(backend_t *be, tensor_t out, tensor_t in, size_t n, float p, uint64_t seed,
                 tensor_t seed_dev, uint64_t offset)
{
    (void)be;
    if (seed_dev.p)
        seed += *(const uint64_t *)seed_dev.p;
    float *O = F(out);
    const float *X = F(in);
    if (p <= 0.0f) {
        if (O != X)
            memcpy(O, X, sizeof(float) * n);
        return;
    }
    float keep_scale = 1.0f / (1.0f - p);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        O[i] = sp_rng_uniform(seed, offset + i) >= p ? X[i] * keep_scale : 0.0f;
}

/* Fixed blocks summed in order: the result is the same on any thread count. */
#define SUMSQ_BLOCK 8192
double cpu_sumsq(backend_t *be, tensor_t x, size_t n)
{
    (void)be;
    const float *X = F(x);
    size_t nb = (n + SUMSQ_BLOCK - 1) / SUMSQ_BLOCK;
    if (nb == 0)
        return 0.0;
    double *part = malloc(sizeof(double) * nb);
    if (!part) {
        be_fail(be, __FILE__, __LINE__, "out of memory in sumsq");
        return 0.0;
    }
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nb; b++) {
        size_t lo = b * SUMSQ_BLOCK, hi = lo + SUMSQ_BLOCK < n ? lo + SUMSQ_BLOCK : n;
        double acc = 0.0;
        for (size_t i = lo; i < hi; i++)
            acc += (double)X[i] * X[i];
        part[b] = acc;
    }
    double total = 0.0;
    for (size_t b = 0; b < nb; b++)
        total += part[b];
    free(part);
    return total;
}

void cpu_sumsq_into(backend_t *be, tensor_t out, tensor_t x, size_t n)
{
    double sum = cpu_sumsq(be, x, n);
    memcpy(out.p, &sum, sizeof sum);
}

void cpu_sum_add(backend_t *be, tensor_t acc, tensor_t x, size_t n)
{
    (void)be;
    const float *X = F(x);
    double sum = 0.0, total;
    for (size_t i = 0; i < n; i++)
        sum += X[i];
    memcpy(&total, acc.p, sizeof total);
    total += sum;
    memcpy(acc.p, &total, sizeof total);
}

void cpu_adamw(backend_t *be, tensor_t param, tensor_t param_copy, tensor_t grad, tensor_t m,
               tensor_t v, size_t n, const adamw_args *a)
{
    float *P = F(param), *M = F(m), *Vv = F(v);
    const float *G = F(grad);
    float h[3], grad_scale = a->grad_scale;
    if (a->hyper.p) { /* the values the step left in device memory */
        double sumsq;
        memcpy(h, a->hyper.p, sizeof h);
        memcpy(&sumsq, a->sumsq.p, sizeof sumsq);
        if (!isfinite(sumsq))
            return;
        grad_scale = (float)adamw_clip_scale(sqrt(sumsq), a->max_norm);
    } else {
        adamw_hyper(a, h);
    }
    float step_size = h[1], bc2_sqrt = h[2];
    float decay = 1.0f - h[0] * a->weight_decay;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float g = G[i] * grad_scale;
        M[i] = a->beta1 * M[i] + (1.0f - a->beta1) * g;
        Vv[i] = a->beta2 * Vv[i] + (1.0f - a->beta2) * g * g;
        float denom = sqrtf(Vv[i]) / bc2_sqrt + a->eps;
        P[i] = P[i] * decay - step_size * M[i] / denom;
    }
    if (param_copy.p && param_copy.p != param.p)
        be->ops->copy(be, param_copy, tensor_view(param, 0, n));
}

void cpu_fill_uniform(backend_t *be, tensor_t x, size_t n, float lo, float hi, uint64_t seed,
                      uint64_t offset)
{
    (void)be;
    float *X = F(x);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        X[i] = lo + (hi - lo) * sp_rng_uniform(seed, offset + i);
}

void cpu_fill_normal(backend_t *be, tensor_t x, size_t n, float mean, float std, uint64_t seed,
                     uint64_t offset)
{
    (void)be;
    float *X = F(x);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        X[i] = mean + std * sp_rng_normal(seed, offset + i);
}
