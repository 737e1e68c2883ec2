/* kernels/cuda/cuda_ops.cu — the CUDA kernels of every op but matmul and
 * attention, each backward beside its forward, with the math of
 * kernels/cpu/cpu_ops.c. Tensors are F32 or BF16 (act_dt) as model_graph.c
 * passes them; every value is loaded into fp32 registers, and norms,
 * softmax, loss and reductions are computed there. The arguments have been
 * checked (kernels/backend_ops.c): sizes, element counts and dtypes are what
 * each op needs; an op here only declines to launch after a failure.
 *
 * Determinism: the column sums (rmsnorm's dw, bias_backward) and sumsq are
 * fixed two-pass reductions (partials in double over fixed row or element
 * blocks, then summed in a fixed order), so they do not change between runs.
 * embedding_backward sums each id's rows in position order, one block per
 * id (no atomics): the CPU's bits.
 * The RNG ops draw exactly the CPU backend's numbers (cuda_internal.h).
 * QLoRA's NF4 dequantization and quantization: cuda_nf4.cu.
 *
 * add, add_bias, SwiGLU, dropout, RMSNorm, RoPE and AdamW first offer the
 * call to their 16-byte vector path (cuda_vec.cu: same results bit for bit,
 * 8 elements a step); the kernels here run what it declines (unaligned
 * views, sizes not a multiple of 8, SPOTUNE_CUDA_ELEMENTWISE=scalar). */
#include <math.h>
#include <string.h>

#include "cuda_internal.h"

#define STREAM(be) (CUDA_IMPL(be)->stream)

/* ---- conversions ------------------------------------------------------------- */

__global__ void convert_kernel(void *dst, int ddt, const void *src, int sdt, size_t n)
{
    GRID_STRIDE(i, n)
    st_f(dst, ddt, i, ld_f(src, sdt, i));
}

extern "C" void cuda_convert(backend_t *be, void *dst, dtype_t ddt, const void *src, dtype_t sdt,
                             size_t n)
{
    if (be->err.code || !n)
        return;
    LAUNCH(convert_kernel, cuda_blocks(n), CUDA_BLOCK, 0, STREAM(be))(dst, ddt, src, sdt, n);
    LAUNCHED(be, "convert_kernel");
}

__global__ void convert2d_kernel(void *dst, int ddt, int dld, const void *src, int sdt, int sld,
                                 int cols, size_t n)
{
    GRID_STRIDE(i, n)
    {
        size_t r = i / (size_t)cols, c = i % (size_t)cols;
        st_f(dst, ddt, r * (size_t)dld + c, ld_f(src, sdt, r * (size_t)sld + c));
    }
}

extern "C" void cuda_convert2d(backend_t *be, void *dst, dtype_t ddt, int dst_ld, const void *src,
                               dtype_t sdt, int src_ld, int rows, int cols)
{
    if (be->err.code || rows <= 0 || cols <= 0)
        return;
    if (dst_ld == cols && src_ld == cols) {
        cuda_convert(be, dst, ddt, src, sdt, (size_t)rows * (size_t)cols);
        return;
    }
    size_t n = (size_t)rows * (size_t)cols;
    LAUNCH(convert2d_kernel, cuda_blocks(n), CUDA_BLOCK, 0, STREAM(be))(dst, ddt, dst_ld, src, sdt,
                                                                        src_ld, cols, n);
    LAUNCHED(be, "convert2d_kernel");
}

/* x *= alpha; alpha == 0 writes zeros (NaN-safe, as beta == 0 in a matmul) */
__global__ void scale_kernel(void *x, int dt, size_t n, float alpha)
{
    GRID_STRIDE(i, n)
    st_f(x, dt, i, alpha == 0.0f ? 0.0f : alpha * ld_f(x, dt, i));
}

extern "C" void cuda_scale(backend_t *be, void *x, dtype_t dt, size_t n, float alpha)
{
    if (be->err.code || !n || alpha == 1.0f)
        return;
    LAUNCH(scale_kernel, cuda_blocks(n), CUDA_BLOCK, 0, STREAM(be))(x, dt, n, alpha);
    LAUNCHED(be, "scale_kernel");
}

/* ---- column sums: fixed two-pass reduction ----------------------------------- */

/* part[chunk][c] = sum over the chunk's rows of a[r,c] (times x[r,c]*rstd[r]
 * when x != NULL), in double. */
__global__ void colsum_partial_kernel(double *part, const void *a, int adt, const void *x,
                                      int xdt, const float *rstd, int rows, int cols,
                                      int rows_per_chunk)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols)
        return;
    int r0 = blockIdx.y * rows_per_chunk;
    int r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
    double acc = 0.0;
    for (int r = r0; r < r1; r++) {
        size_t i = (size_t)r * cols + c;
        float v = ld_f(a, adt, i);
        if (x)
            v = v * (ld_f(x, xdt, i) * rstd[r]);
        acc += (double)v;
    }
    part[(size_t)blockIdx.y * cols + c] = acc;
}

/* out[c] += sum over chunks of part[chunk][c], chunks in order */
__global__ void colsum_finish_kernel(float *out, const double *part, int chunks, int cols)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols)
        return;
    double acc = 0.0;
    for (int k = 0; k < chunks; k++)
        acc += part[(size_t)k * cols + c];
    out[c] += (float)acc;
}

/* A column reduction over rows in two passes: the rows cut into *chunks of
 * *per (at most 128 chunks of at least 32 rows), one double partial sum per
 * (chunk, column) in the scratch (returned; NULL on failure). */
static double *colsum_parts(backend_t *be, int rows, int cols, int *chunks, int *per)
{
    int n = (rows + 31) / 32;
    if (n > 128)
        n = 128;
    *per = (rows + n - 1) / n;
    *chunks = (rows + *per - 1) / *per;
    return (double *)cuda_scratch(be, sizeof(double) * (size_t)*chunks * cols);
}

static void colsum(backend_t *be, tensor_t out, const void *a, int adt, const void *x, int xdt,
                   const float *rstd, int rows, int cols)
{
    if (rows <= 0 || cols <= 0)
        return;
    int chunks, per;
    double *part = colsum_parts(be, rows, cols, &chunks, &per);
    if (!part)
        return;
    dim3 grid((unsigned)((cols + CUDA_BLOCK - 1) / CUDA_BLOCK), (unsigned)chunks);
    LAUNCH(colsum_partial_kernel, grid, CUDA_BLOCK, 0, STREAM(be))(
        part, a, adt, x, xdt, rstd, rows, cols, per);
    if (LAUNCHED(be, "colsum_partial_kernel"))
        return;
    LAUNCH(colsum_finish_kernel, (cols + CUDA_BLOCK - 1) / CUDA_BLOCK, CUDA_BLOCK, 0, STREAM(be))(
        (float *)out.p, part, chunks, cols);
    LAUNCHED(be, "colsum_finish_kernel");
}

/* ---- RMSNorm ------------------------------------------------------------------ */

#define ROW_BLOCK 256

/* one block per row: rstd = 1/sqrt(mean(x^2) + eps), out = w * (x * rstd) */
__global__ void rmsnorm_forward_kernel(void *out, int odt, float *rstd, const void *x, int xdt,
                                       const void *w, int wdt, int cols, float eps)
{
    __shared__ float sh[33];
    size_t base = (size_t)blockIdx.x * cols;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = ld_f(x, xdt, base + c);
        ss = __fadd_rn(ss, __fmul_rn(v, v)); /* no contraction: the vector kernel's bits */
    }
    ss = block_sum(ss, sh);
    float s = 1.0f / sqrtf(ss / (float)cols + eps);
    if (threadIdx.x == 0)
        rstd[blockIdx.x] = s;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        st_f(out, odt, base + c, ld_f(w, wdt, c) * (ld_f(x, xdt, base + c) * s));
}

/* dx += rstd * (g - xhat * mean(g * xhat)),  g = dout * w,  xhat = x * rstd */
__global__ void rmsnorm_backward_kernel(void *dx, int dxdt, const void *dout, int ddt,
                                        const void *x, int xdt, const void *w, int wdt,
                                        const float *rstd, int cols)
{
    __shared__ float sh[33];
    size_t base = (size_t)blockIdx.x * cols;
    float s = rstd[blockIdx.x];
    float dot = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        dot = rms_dot_step(dot, ld_f(dout, ddt, base + c), ld_f(w, wdt, c), ld_f(x, xdt, base + c), s);
    float mean = block_sum(dot, sh) / (float)cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        size_t i = base + c;
        st_f(dx, dxdt, i, rms_dx(ld_f(dx, dxdt, i), ld_f(dout, ddt, i), ld_f(w, wdt, c), ld_f(x, xdt, i), s, mean));
    }
}

extern "C" void cuda_rmsnorm_forward(backend_t *be, tensor_t out, tensor_t rstd, tensor_t x,
                                     tensor_t w, int rows, int cols, float eps)
{
    if (be->err.code || rows <= 0 || cuda_vec_rmsnorm_forward(be, out, rstd, x, w, rows, cols, eps))
        return;
    LAUNCH(rmsnorm_forward_kernel, rows, ROW_BLOCK, 0, STREAM(be))(
        out.p, out.dt, (float *)rstd.p, x.p, x.dt, w.p, w.dt, cols, eps);
    LAUNCHED(be, "rmsnorm_forward_kernel");
}

extern "C" void cuda_rmsnorm_backward(backend_t *be, tensor_t dx, tensor_t dw, tensor_t dout,
                                      tensor_t x, tensor_t w, tensor_t rstd, int rows, int cols)
{
    if (be->err.code || rows <= 0)
        return;
    if (!cuda_vec_rmsnorm_backward(be, dx, dout, x, w, rstd, rows, cols)) {
        LAUNCH(rmsnorm_backward_kernel, rows, ROW_BLOCK, 0, STREAM(be))(
            dx.p, dx.dt, dout.p, dout.dt, x.p, x.dt, w.p, w.dt, (const float *)rstd.p, cols);
        LAUNCHED(be, "rmsnorm_backward_kernel");
    }
    if (be->err.code || !dw.p)
        return;
    colsum(be, dw, dout.p, dout.dt, x.p, x.dt, (const float *)rstd.p, rows, cols);
}

/* ---- RoPE (rotate-half); the inverse is the backward ------------------------------ */

/* idx walks the pairs (i, i + hd/2) of every head of every token; token
 * row r of x starts at r x_ld, of src at r src_ld (src may be x: each pair
 * is read before it is written) */
__global__ void rope_kernel(void *x, int dt, const void *src, int sdt, const float *cosv,
                            const float *sinv, const int *pos, int T, int nh, int hd, size_t n,
                            float sgn, size_t x_ld, size_t src_ld)
{
    GRID_STRIDE(idx, n)
    {
        int hh = hd / 2;
        int i = (int)(idx % hh);
        size_t head = idx / hh; /* (b*T + t)*nh + h */
        size_t row = head / nh, h = head % nh;
        int t = (int)(row % T);
        if (pos) { /* the token's position (packed documents), clamped to the table */
            int p = pos[row];
            t = p < 0 ? 0 : p >= T ? T - 1 : p;
        }
        size_t xb = row * x_ld + h * (size_t)hd, sb = row * src_ld + h * (size_t)hd;
        float c = cosv[(size_t)t * hh + i], sn = sgn * sinv[(size_t)t * hh + i];
        float a = ld_f(src, sdt, sb + i), b = ld_f(src, sdt, sb + i + hh);
        st_f(x, dt, xb + i, a * c - b * sn);
        st_f(x, dt, xb + i + hh, b * c + a * sn);
    }
}

extern "C" void cuda_rope(backend_t *be, tensor_t x, tensor_t src, tensor_t cos, tensor_t sin,
                          tensor_t pos, int B, int T, int nh, int hd, int inverse, int x_ld,
                          int src_ld)
{
    int hh = hd / 2;
    size_t n = (size_t)B * T * nh * hh;
    float sgn = inverse ? -1.0f : 1.0f;
    if (be->err.code || !n ||
        cuda_vec_rope(be, x, src, cos, sin, pos, B, T, nh, hd, sgn, x_ld, src_ld))
        return;
    LAUNCH(rope_kernel, cuda_blocks(n), CUDA_BLOCK, 0, STREAM(be))(
        x.p, x.dt, src.p, src.dt, (const float *)cos.p, (const float *)sin.p, (const int *)pos.p, T,
        nh, hd, n, sgn, (size_t)x_ld, (size_t)src_ld);
    LAUNCHED(be, "rope_kernel");
}

/* ---- SwiGLU --------------------------------------------------------------------- */

/* g, u (dg, du) with row stride ld, out (dout) contiguous [rows, cols]:
 * element i of the walk is out[i] and g[strided_index(i, cols, ld)] */
__global__ void swiglu_forward_kernel(void *out, int odt, const void *g, int gdt, const void *u,
                                      int udt, size_t n, size_t cols, size_t ld)
{
    GRID_STRIDE(i, n)
    {
        size_t j = strided_index(i, cols, ld);
        float gv = ld_f(g, gdt, j);
        float s = 1.0f / (1.0f + expf(-gv));
        st_f(out, odt, i, gv * s * ld_f(u, udt, j));
    }
}

/* silu'(g) = s (1 + g (1 - s)); g and u are read before dg and du are
 * written (they may be the same memory) */
__global__ void swiglu_backward_kernel(void *dg, int dgdt, void *du, int dudt, const void *dout,
                                       int ddt, const void *g, int gdt, const void *u, int udt,
                                       size_t n, size_t cols, size_t ld)
{
    GRID_STRIDE(i, n)
    {
        size_t j = strided_index(i, cols, ld);
        float gv = ld_f(g, gdt, j), uv = ld_f(u, udt, j), d = ld_f(dout, ddt, i);
        float s = 1.0f / (1.0f + expf(-gv));
        st_f(dg, dgdt, j, d * uv * s * (1.0f + gv * (1.0f - s)));
        st_f(du, dudt, j, d * gv * s);
    }
}

extern "C" void cuda_swiglu_forward(backend_t *be, tensor_t out, tensor_t g, tensor_t u, int rows,
                                    int cols, int ld)
{
    size_t n = (size_t)rows * (size_t)cols;
    if (be->err.code || !n || cuda_vec_swiglu_forward(be, out, g, u, rows, cols, ld))
        return;
    LAUNCH(swiglu_forward_kernel, cuda_blocks(n), CUDA_BLOCK, 0, STREAM(be))(
        out.p, out.dt, g.p, g.dt, u.p, u.dt, n, (size_t)cols, (size_t)ld);
    LAUNCHED(be, "swiglu_forward_kernel");
}

extern "C" void cuda_swiglu_backward(backend_t *be, tensor_t dg, tensor_t du, tensor_t dout,
                                     tensor_t g, tensor_t u, int rows, int cols, int ld)
{
    size_t n = (size_t)rows * (size_t)cols;
    if (be->err.code || !n || cuda_vec_swiglu_backward(be, dg, du, dout, g, u, rows, cols, ld))
        return;
    LAUNCH(swiglu_backward_kernel, cuda_blocks(n), CUDA_BLOCK, 0, STREAM(be))(
        dg.p, dg.dt, du.p, du.dt, dout.p, dout.dt, g.p, g.dt, u.p, u.dt, n, (size_t)cols,
        (size_t)ld);
    LAUNCHED(be, "swiglu_backward_kernel");
}

/* ---- embedding ------------------------------------------------------------------- */

/* out[i,:] = table[tokens[i],:]; an id outside the table (the model checks
 * ids first) gives a zero row rather than a fault */
__global__ void embedding_forward_kernel(void *out, int odt, const void *table, int tdt,
                                         const int32_t *tok, size_t vocab, int H, size_t n)
{
    GRID_STRIDE(idx, n)
    {
        size_t i = idx / H;
        int c = (int)(idx % H);
        int32_t t = tok[i];
        float v = t >= 0 && (size_t)t < vocab ? ld_f(table, tdt, (size_t)t * H + c) : 0.0f;
        st_f(out, odt, idx, v);
    }
}

/* dtable[id,:] += the sum of dout's rows of that id, in position order:
 * block j for the j-th distinct id (runs[0] of the n blocks work), so each
 * row of dtable has one writer: no atomics, the CPU's bits */
__global__ void embedding_backward_kernel(float *dtable, const void *dout, int ddt,
                                          const int32_t *tok, const int32_t *ord,
                                          const int32_t *runs, size_t vocab, int H, int n)
{
    int j = (int)blockIdx.x;
    if (j >= runs[0])
        return;
    int lo = runs[1 + j], hi = runs[2 + j];
    if (lo < 0 || hi > n || lo >= hi || ord[lo] < 0 || ord[lo] >= n)
        return;
    int32_t t = tok[ord[lo]];
    if (t < 0 || (size_t)t >= vocab)
        return;
    for (int c = (int)threadIdx.x; c < H; c += (int)blockDim.x) {
        float acc = 0.0f;
        for (int k = lo; k < hi; k++) {
            int p = ord[k];
            if (p >= 0 && p < n)
                acc = __fadd_rn(acc, ld_f(dout, ddt, (size_t)p * H + c));
        }
        dtable[(size_t)t * H + c] = __fadd_rn(dtable[(size_t)t * H + c], acc);
    }
}

extern "C" void cuda_embedding_forward(backend_t *be, tensor_t out, tensor_t table,
                                       tensor_t tokens, int n, int H)
{
    size_t total = (size_t)n * H;
    if (be->err.code || !total)
        return;
    LAUNCH(embedding_forward_kernel, cuda_blocks(total), CUDA_BLOCK, 0, STREAM(be))(
        out.p, out.dt, table.p, table.dt, (const int32_t *)tokens.p, table.n / H, H, total);
    LAUNCHED(be, "embedding_forward_kernel");
}

extern "C" void cuda_embedding_backward(backend_t *be, tensor_t dtable, tensor_t dout,
                                        tensor_t tokens, tensor_t order, tensor_t runs, int n,
                                        int H)
{
    if (be->err.code || n <= 0 || H <= 0)
        return;
    LAUNCH(embedding_backward_kernel, (unsigned)n, CUDA_BLOCK, 0, STREAM(be))(
        (float *)dtable.p, dout.p, dout.dt, (const int32_t *)tokens.p, (const int32_t *)order.p,
        (const int32_t *)runs.p, dtable.n / H, H, n);
    LAUNCHED(be, "embedding_backward_kernel");
}

/* ---- fused softmax cross-entropy ----------------------------------------------- */

#define CE_BLOCK 512

/* One block per row, in place: one pass for the running max and sum of
 * exponentials (fp32), one writing dlogits = (softmax - onehot) * grad_scale
 * back in the logits' dtype. No fp32 copy of the row is ever made. */
__global__ void cross_entropy_kernel(void *logits, int dt, float *loss, const int32_t *targets,
                                     int V, float grad_scale, const float *scale)
{
    __shared__ float sh[33];
    if (scale)
        grad_scale *= *scale;
    size_t base = (size_t)blockIdx.x * V;
    int t = targets[blockIdx.x];
    if (t < 0 || t >= V) { /* ignored row */
        for (int i = threadIdx.x; i < V; i += blockDim.x)
            st_f(logits, dt, base + i, 0.0f);
        if (threadIdx.x == 0)
            loss[blockIdx.x] = 0.0f;
        return;
    }
    float xt = threadIdx.x == 0 ? ld_f(logits, dt, base + t) : 0.0f; /* read before any write */
    float m = -INFINITY, s = 0.0f;
    for (int i = threadIdx.x; i < V; i += blockDim.x)
        online_max_sum(ld_f(logits, dt, base + i), m, s);
    float lse = block_lse(m, s, sh);
    if (threadIdx.x == 0)
        loss[blockIdx.x] = lse - xt;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        float d = expf(ld_f(logits, dt, base + i) - lse) * grad_scale;
        if (i == t)
            d -= grad_scale;
        st_f(logits, dt, base + i, d);
    }
}

extern "C" void cuda_cross_entropy(backend_t *be, tensor_t logits, tensor_t loss,
                                   tensor_t targets, int rows, int V, float grad_scale,
                                   tensor_t scale)
{
    if (be->err.code || rows <= 0)
        return;
    LAUNCH(cross_entropy_kernel, rows, CE_BLOCK, 0, STREAM(be))(
        logits.p, logits.dt, (float *)loss.p, (const int32_t *)targets.p, V, grad_scale,
        (const float *)scale.p);
    LAUNCHED(be, "cross_entropy_kernel");
}

/* ---- elementwise ---------------------------------------------------------------- */

__global__ void add_kernel(void *y, int ydt, const void *x, int xdt, float alpha, size_t n)
{
    GRID_STRIDE(i, n)
    st_f(y, ydt, i, ld_f(y, ydt, i) + alpha * ld_f(x, xdt, i));
}

extern "C" void cuda_add(backend_t *be, tensor_t y, tensor_t x, float alpha, size_t n)
{
    if (be->err.code || !n || cuda_vec_add(be, y, x, alpha, n))
        return;
    LAUNCH(add_kernel, cuda_blocks(n), CUDA_BLOCK, 0, STREAM(be))(y.p, y.dt, x.p, x.dt, alpha, n);
    LAUNCHED(be, "add_kernel");
}

__global__ void add_bias_kernel(void *y, int ydt, const void *b, int bdt, int cols, size_t n)
{
    GRID_STRIDE(i, n)
    st_f(y, ydt, i, ld_f(y, ydt, i) + ld_f(b, bdt, i % cols));
}

extern "C" void cuda_add_bias(backend_t *be, tensor_t y, tensor_t b, int rows, int cols)
{
    size_t n = (size_t)rows * cols;
    if (be->err.code || !n || cuda_vec_add_bias(be, y, b, rows, cols))
        return;
    LAUNCH(add_bias_kernel, cuda_blocks(n), CUDA_BLOCK, 0, STREAM(be))(
        y.p, y.dt, b.p, b.dt, cols, n);
    LAUNCHED(be, "add_bias_kernel");
}

extern "C" void cuda_bias_backward(backend_t *be, tensor_t db, tensor_t dy, int rows, int cols)
{
    if (be->err.code)
        return;
    colsum(be, db, dy.p, dy.dt, NULL, 0, NULL, rows, cols);
}

/* ---- DoRA: row norms of W + s B A, per-column scale and dot ----------------------- */

/* one block per row o: n[o] = || W[o,:] + scale * B[o,:] A ||_2, summed in double */
__global__ void weight_norm_kernel(float *n, const void *W, int wdt, const void *A, int adt,
                                   const void *B, int bdt, float scale, int in, int r)
{
    __shared__ double sh[33];
    size_t o = blockIdx.x;
    double ss = 0.0;
    for (int j = threadIdx.x; j < in; j += blockDim.x) {
        float v = 0.0f;
        for (int k = 0; k < r; k++)
            v += ld_f(B, bdt, o * r + k) * ld_f(A, adt, (size_t)k * in + j);
        double w = (double)ld_f(W, wdt, o * in + j) + (double)scale * (double)v;
        ss += w * w;
    }
    ss = block_sum_d(ss, sh);
    if (threadIdx.x == 0)
        n[o] = (float)sqrt(ss);
}

extern "C" void cuda_weight_norm(backend_t *be, tensor_t n, tensor_t W, tensor_t A, tensor_t B,
                                 float scale, int out, int in, int r)
{
    if (be->err.code || out <= 0)
        return;
    LAUNCH(weight_norm_kernel, out, ROW_BLOCK, 0, STREAM(be))(
        (float *)n.p, W.p, W.dt, r > 0 ? A.p : NULL, A.dt, r > 0 ? B.p : NULL, B.dt, scale, in, r);
    LAUNCHED(be, "weight_norm_kernel");
}

__global__ void col_scale_kernel(void *y, int ydt, const void *num, int ndt, const float *den,
                                 int cols, size_t n)
{
    GRID_STRIDE(i, n)
    st_f(y, ydt, i, ld_f(y, ydt, i) * (ld_f(num, ndt, i % cols) / den[i % cols]));
}

extern "C" void cuda_col_scale(backend_t *be, tensor_t y, tensor_t num, tensor_t den, int rows,
                               int cols)
{
    size_t n = (size_t)rows * cols;
    if (be->err.code || !n)
        return;
    LAUNCH(col_scale_kernel, cuda_blocks(n), CUDA_BLOCK, 0, STREAM(be))(
        y.p, y.dt, num.p, num.dt, (const float *)den.p, cols, n);
    LAUNCHED(be, "col_scale_kernel");
}

/* part[chunk][c] = sum over the chunk's rows of x[r,c] * y[r,c], in double */
__global__ void coldot_partial_kernel(double *part, const void *x, int xdt, const void *y,
                                      int ydt, int rows, int cols, int rows_per_chunk)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols)
        return;
    int r0 = blockIdx.y * rows_per_chunk;
    int r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
    double acc = 0.0;
    for (int r = r0; r < r1; r++) {
        size_t i = (size_t)r * cols + c;
        acc += (double)ld_f(x, xdt, i) * (double)ld_f(y, ydt, i);
    }
    part[(size_t)blockIdx.y * cols + c] = acc;
}

/* out[c] += (sum over chunks of part[chunk][c], chunks in order) / den[c] */
__global__ void coldot_finish_kernel(float *out, const double *part, const float *den,
                                     int chunks, int cols)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols)
        return;
    double acc = 0.0;
    for (int k = 0; k < chunks; k++)
        acc += part[(size_t)k * cols + c];
    out[c] += (float)(acc / (double)den[c]);
}

extern "C" void cuda_col_dot(backend_t *be, tensor_t out, tensor_t x, tensor_t y, tensor_t den,
                             int rows, int cols)
{
    if (be->err.code || rows <= 0 || cols <= 0)
        return;
    int chunks, per;
    double *part = colsum_parts(be, rows, cols, &chunks, &per);
    if (!part)
        return;
    dim3 grid((unsigned)((cols + CUDA_BLOCK - 1) / CUDA_BLOCK), (unsigned)chunks);
    LAUNCH(coldot_partial_kernel, grid, CUDA_BLOCK, 0, STREAM(be))(
        part, x.p, x.dt, y.p, y.dt, rows, cols, per);
    if (LAUNCHED(be, "coldot_partial_kernel"))
        return;
    LAUNCH(coldot_finish_kernel, (cols + CUDA_BLOCK - 1) / CUDA_BLOCK, CUDA_BLOCK, 0, STREAM(be))(
        (float *)out.p, part, (const float *)den.p, chunks, cols);
    LAUNCHED(be, "coldot_finish_kernel");
}

/* ---- dropout: keep = uniform(seed, offset + i) >= p, the CPU's draw ------------ */

__global__ void dropout_kernel(void *out, int odt, const void *in, int idt, size_t n, float p,
                               float keep_scale, uint64_t seed, const uint64_t *seed_dev,
                               uint64_t offset)
{
    if (seed_dev)
        seed += *seed_dev;
    GRID_STRIDE(i, n)
    {
        float v = ld_f(in, idt, i);
        st_f(out, odt, i, d_rng_uniform(seed, offset + i) >= p ? __fmul_rn(v, keep_scale) : 0.0f);
    }
}

extern "C" void cuda_dropout(backend_t *be, tensor_t out, tensor_t in, size_t n, float p,
                             uint64_t seed, tensor_t seed_dev, uint64_t offset)
{
    if (be->err.code || !n)
        return;
    if (p <= 0.0f) {
        if (out.p == in.p && out.dt == in.dt)
            return;
        if (out.dt == in.dt)
            CUDA_OK(be, cudaMemcpyAsync(out.p, in.p, n * dtype_size(in.dt),
                                        cudaMemcpyDeviceToDevice, STREAM(be)));
        else
            cuda_convert(be, out.p, out.dt, in.p, in.dt, n);
        return;
    }
    float keep_scale = 1.0f / (1.0f - p);
    const uint64_t *sd = (const uint64_t *)seed_dev.p;
    if (cuda_vec_dropout(be, out, in, n, p, keep_scale, seed, sd, offset))
        return;
    LAUNCH(dropout_kernel, cuda_blocks(n), CUDA_BLOCK, 0, STREAM(be))(
        out.p, out.dt, in.p, in.dt, n, p, keep_scale, seed, sd, offset);
    LAUNCHED(be, "dropout_kernel");
}

/* ---- sumsq: fixed blocks, then their partials in order, all in double -------------- */

#define SUMSQ_CHUNK 8192
#define SUMSQ_FINISH_BLOCK 1024

__global__ void sumsq_partial_kernel(double *part, const void *x, int dt, size_t n)
{
    __shared__ double sh[33];
    size_t lo = (size_t)blockIdx.x * SUMSQ_CHUNK;
    size_t hi = lo + SUMSQ_CHUNK < n ? lo + SUMSQ_CHUNK : n;
    double acc = 0.0;
    for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        double v = (double)ld_f(x, dt, i);
        acc += v * v;
    }
    acc = block_sum_d(acc, sh);
    if (threadIdx.x == 0)
        part[blockIdx.x] = acc;
}

__global__ void sumsq_finish_kernel(double *out, const double *part, size_t nb)
{
    __shared__ double sh[33];
    double acc = 0.0;
    for (size_t i = threadIdx.x; i < nb; i += blockDim.x)
        acc += part[i];
    acc = block_sum_d(acc, sh);
    if (threadIdx.x == 0)
        *out = acc;
}

static size_t sumsq_blocks(backend_t *be, size_t n)
{
    size_t nb = (n + SUMSQ_CHUNK - 1) / SUMSQ_CHUNK;
    if (nb > 0x7fffffffu) {
        cuda_fail(be, __FILE__, __LINE__, "sumsq of %zu elements: too many blocks", n);
        return SIZE_MAX;
    }
    return nb;
}

/* The sum into out (device memory) through nb partials in part, in stream
 * order: 0, or -1 with the sticky error set. */
static int launch_sumsq(backend_t *be, double *out, double *part, size_t nb, tensor_t x, size_t n)
{
    if (nb) {
        LAUNCH(sumsq_partial_kernel, (unsigned)nb, CUDA_BLOCK, 0, STREAM(be))(part, x.p, x.dt, n);
        if (LAUNCHED(be, "sumsq_partial_kernel"))
            return -1;
    }
    LAUNCH(sumsq_finish_kernel, 1, SUMSQ_FINISH_BLOCK, 0, STREAM(be))(out, part, nb);
    return LAUNCHED(be, "sumsq_finish_kernel") ? -1 : 0;
}

extern "C" double cuda_sumsq(backend_t *be, tensor_t x, size_t n)
{
    cuda_impl *im = CUDA_IMPL(be);
    if (be->err.code || !n)
        return 0.0;
    size_t nb = sumsq_blocks(be, n);
    double *part = nb == SIZE_MAX ? NULL : (double *)cuda_scratch(be, sizeof(double) * (nb + 1));
    if (!part || launch_sumsq(be, part + nb, part, nb, x, n) ||
        CUDA_OK(be, cudaMemcpyAsync(im->host_sum, part + nb, sizeof(double),
                                    cudaMemcpyDeviceToHost, im->stream)) ||
        CUDA_OK(be, CUDA_WAITING(be, "sumsq", cudaStreamSynchronize(im->stream))))
        return 0.0;
    return *im->host_sum;
}

extern "C" void cuda_sumsq_into(backend_t *be, tensor_t out, tensor_t x, size_t n)
{
    if (be->err.code)
        return;
    size_t nb = sumsq_blocks(be, n);
    double *part = nb == SIZE_MAX ? NULL : (double *)cuda_scratch(be, sizeof(double) * (nb + 1));
    if (part)
        launch_sumsq(be, (double *)out.p, part, nb, x, n);
}

/* ---- sum_add: one thread, the host's order (the loss's bits on every backend) ---- */

/* A dependent chain of double adds over a micro-batch's rows: about 50 us
 * for 2048 rows, up to about 1.5 ms for 65536, against a micro-batch of
 * 0.1 s to seconds at those sizes (7B); in exchange the loss has the CPU
 * loop's bits on every backend. */
__global__ void sum_add_kernel(double *acc, const float *x, size_t n)
{
    double sum = 0.0;
    for (size_t i = 0; i < n; i++)
        sum += (double)x[i];
    *acc += sum;
}

extern "C" void cuda_sum_add(backend_t *be, tensor_t acc, tensor_t x, size_t n)
{
    if (be->err.code)
        return;
    LAUNCH(sum_add_kernel, 1, 1, 0, STREAM(be))((double *)acc.p, (const float *)x.p, n);
    LAUNCHED(be, "sum_add_kernel");
}

/* ---- AdamW ------------------------------------------------------------------------ */

__global__ void adamw_kernel(float *P, void *copy, int cdt, const float *G, float *M, float *V,
                             size_t n, adamw_k k)
{
    if (!adamw_k_resolve(&k))
        return;
    GRID_STRIDE(i, n)
    {
        float g = G[i] * k.grad_scale;
        float m = k.beta1 * M[i] + (1.0f - k.beta1) * g;
        float v = k.beta2 * V[i] + (1.0f - k.beta2) * g * g;
        M[i] = m;
        V[i] = v;
        float denom = sqrtf(v) / k.bc2_sqrt + k.eps;
        float p = P[i] * k.decay - k.step_size * m / denom;
        P[i] = p;
        if (copy)
            st_f(copy, cdt, i, p);
    }
}

extern "C" void cuda_adamw(backend_t *be, tensor_t param, tensor_t param_copy, tensor_t grad,
                           tensor_t m, tensor_t v, size_t n, const adamw_args *a)
{
    if (be->err.code || !n)
        return;
    /* the host-side values exactly as the CPU backend derives them; with
     * a->hyper the kernel reads them from device memory instead */
    float h[3];
    adamw_hyper(a, h);
    adamw_k k = {};
    k.beta1 = a->beta1;
    k.beta2 = a->beta2;
    k.eps = a->eps;
    k.wd = a->weight_decay;
    k.grad_scale = a->grad_scale;
    k.step_size = h[1];
    k.bc2_sqrt = h[2];
    k.decay = 1.0f - a->lr * a->weight_decay;
    k.hyper = (const float *)a->hyper.p;
    k.sumsq = (const double *)a->sumsq.p;
    k.max_norm = a->max_norm;
    void *copy = param_copy.p && param_copy.p != param.p ? param_copy.p : NULL;
    if (cuda_vec_adamw(be, param, copy, param_copy.dt, grad, m, v, n, &k))
        return;
    LAUNCH(adamw_kernel, cuda_blocks(n), CUDA_BLOCK, 0, STREAM(be))(
        (float *)param.p, copy, param_copy.dt, (const float *)grad.p, (float *)m.p, (float *)v.p, n,
        k);
    LAUNCHED(be, "adamw_kernel");
}

/* ---- fills: the CPU's numbers (no fused multiply-add, so bit-identical) --------- */

__global__ void fill_uniform_kernel(void *x, int dt, size_t n, float lo, float hi, uint64_t seed,
                                    uint64_t offset)
{
    GRID_STRIDE(i, n)
    st_f(x, dt, i, __fadd_rn(lo, __fmul_rn(hi - lo, d_rng_uniform(seed, offset + i))));
}

__global__ void fill_normal_kernel(void *x, int dt, size_t n, float mean, float std, uint64_t seed,
                                   uint64_t offset)
{
    GRID_STRIDE(i, n)
    st_f(x, dt, i, __fadd_rn(mean, __fmul_rn(std, d_rng_normal(seed, offset + i))));
}

extern "C" void cuda_fill_uniform(backend_t *be, tensor_t x, size_t n, float lo, float hi,
                                  uint64_t seed, uint64_t offset)
{
    if (be->err.code || !n)
        return;
    LAUNCH(fill_uniform_kernel, cuda_blocks(n), CUDA_BLOCK, 0, STREAM(be))(
        x.p, x.dt, n, lo, hi, seed, offset);
    LAUNCHED(be, "fill_uniform_kernel");
}

extern "C" void cuda_fill_normal(backend_t *be, tensor_t x, size_t n, float mean, float std,
                                 uint64_t seed, uint64_t offset)
{
    if (be->err.code || !n)
        return;
    LAUNCH(fill_normal_kernel, cuda_blocks(n), CUDA_BLOCK, 0, STREAM(be))(
        x.p, x.dt, n, mean, std, seed, offset);
    LAUNCHED(be, "fill_normal_kernel");
}
