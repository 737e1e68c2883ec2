/* The ops as callers run them: every argument checked here, once for every
 * backend (the rules are in backend.h), then the backend's op. A refused
 * call is recorded with be_fail as "OP: WHAT" at the caller's file:line and
 * goes no further. */
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend_check.h"

/* ---- memory ------------------------------------------------------------------ */

tensor_t be_alloc_at(const char *file, int line, backend_t *be, dtype_t dt, size_t n)
{
    call c = begin(be, "alloc", file, line);
    if (dtype_size(dt) == 0)
        refuse(&c, "dtype %d is not a dtype", (int)dt);
    else if (mul(n, dtype_size(dt)) == SIZE_MAX)
        refuse(&c, "%zu elements of %s overflow a size", n, dtype_name(dt));
    if (c.bad) {
        tensor_t none = {NULL, 0, dt};
        return none;
    }
    (void)be_trace_barrier(be, "alloc", file, line); /* runs in a dry trace too */
    return be->ops->alloc(be, dt, n);
}

void be_free_at(const char *file, int line, backend_t *be, tensor_t *t)
{
    (void)be_trace_barrier(be, "free", file, line); /* runs in a dry trace too */
    if (t)
        be->ops->free(be, t);
}

static void copy_args(call *c, void *dst, const void *src, size_t bytes)
{
    if (bytes && !dst)
        refuse(c, "dst is NULL (%zu bytes)", bytes);
    else if (bytes && !src)
        refuse(c, "src is NULL (%zu bytes)", bytes);
}

void be_h2d_at(const char *file, int line, backend_t *be, void *dst, const void *src, size_t bytes)
{
    call c = begin(be, "h2d", file, line);
    copy_args(&c, dst, src, bytes);
    if (be_trace_barrier(be, "h2d", file, line) && !c.bad)
        be->ops->h2d(be, dst, src, bytes);
}

void be_d2h_at(const char *file, int line, backend_t *be, void *dst, const void *src, size_t bytes)
{
    call c = begin(be, "d2h", file, line);
    copy_args(&c, dst, src, bytes);
    if (be_trace_barrier(be, "d2h", file, line) && !c.bad)
        be->ops->d2h(be, dst, src, bytes);
}

void *be_host_alloc(backend_t *be, size_t bytes)
{
    if (be->ops->host_alloc)
        return be->ops->host_alloc(be, bytes);
    return malloc(bytes ? bytes : 1);
}

void be_host_free(backend_t *be, void *p)
{
    if (!p)
        return;
    if (be->ops->host_free)
        be->ops->host_free(be, p);
    else
        free(p);
}

void be_upload_staged_at(const char *file, int line, backend_t *be, tensor_t t, const void *src)
{
    call c = begin(be, "h2d", file, line);
    size_t bytes = t.n * dtype_size(t.dt);
    copy_args(&c, t.p, src, bytes);
    if (!be_trace_barrier(be, "upload_staged", file, line) || c.bad)
        return;
    if (be->ops->h2d_async)
        be->ops->h2d_async(be, t.p, src, bytes);
    else
        be->ops->h2d(be, t.p, src, bytes);
}

void be_staged_wait_at(const char *file, int line, backend_t *be)
{
    if (be_trace_barrier(be, "staged_wait", file, line) && be->ops->h2d_wait)
        be->ops->h2d_wait(be);
}

void be_zero_at(const char *file, int line, backend_t *be, tensor_t t)
{
    call c = begin(be, "zero", file, line);
    if (!t.p && t.n)
        refuse(&c, "t is not allocated");
    BE_DISPATCH(c.bad, be, zero, t);
}

void be_copy_at(const char *file, int line, backend_t *be, tensor_t dst, tensor_t src)
{
    call c = begin(be, "copy", file, line);
    if (dst.n != src.n)
        refuse(&c, "dst has %zu elements, src has %zu", dst.n, src.n);
    else if (!dst.p && dst.n)
        refuse(&c, "dst is not allocated");
    else if (!src.p && src.n)
        refuse(&c, "src is not allocated");
    else if (dst.dt != src.dt && (!float_dtype(dst.dt) || !float_dtype(src.dt)))
        refuse(&c, "from %s to %s: only F32, BF16 and F16 convert", dtype_name(src.dt),
               dtype_name(dst.dt));
    BE_DISPATCH(c.bad, be, copy, dst, src);
}

void be_copy2d_at(const char *file, int line, backend_t *be, tensor_t dst, tensor_t src, int rows,
                  int cols, int dst_ld, int src_ld)
{
    call c = begin(be, "copy2d", file, line);
    size_arg(&c, "rows", rows);
    size_arg(&c, "cols", cols);
    if (!c.bad && (dst_ld < cols || src_ld < cols))
        refuse(&c, "dst_ld = %d and src_ld = %d must be at least cols = %d", dst_ld, src_ld,
               cols);
    if (c.bad)
        return;
    tensor_arg(&c, "dst", dst, span2d(rows, cols, dst_ld), "(rows-1) x dst_ld + cols",
               TAKES_FLOAT);
    tensor_arg(&c, "src", src, span2d(rows, cols, src_ld), "(rows-1) x src_ld + cols",
               TAKES_FLOAT);
    const char *names[] = {"dst", "src"};
    tensor_t ts[] = {dst, src};
    same_dtype(&c, names, ts, 2, "the matrices");
    BE_DISPATCH(c.bad || !(rows && cols), be, copy2d, dst, src, rows, cols, dst_ld, src_ld);
}

void be_sync_at(const char *file, int line, backend_t *be)
{
    if (be_trace_barrier(be, "sync", file, line))
        be->ops->sync(be);
}

/* ---- math (the products: backend_matmul.c) ---------------------------------- */

void be_rmsnorm_forward_at(const char *file, int line, backend_t *be, tensor_t out, tensor_t rstd,
                           tensor_t x, tensor_t w, int rows, int cols, float eps)
{
    call c = begin(be, "rmsnorm_forward", file, line);
    size_arg(&c, "rows", rows);
    size_arg(&c, "cols", cols);
    if (c.bad)
        return;
    size_t n = mul((size_t)rows, (size_t)cols);
    tensor_arg(&c, "out", out, n, "rows x cols", TAKES_FLOAT);
    tensor_arg(&c, "rstd", rstd, (size_t)rows, "rows", TAKES_F32);
    tensor_arg(&c, "x", x, n, "rows x cols", TAKES_FLOAT);
    tensor_arg(&c, "w", w, (size_t)cols, "cols", TAKES_FLOAT);
    BE_DISPATCH(c.bad, be, rmsnorm_forward, out, rstd, x, w, rows, cols, eps);
}

void be_rmsnorm_backward_at(const char *file, int line, backend_t *be, tensor_t dx, tensor_t dw,
                            tensor_t dout, tensor_t x, tensor_t w, tensor_t rstd, int rows,
                            int cols)
{
    call c = begin(be, "rmsnorm_backward", file, line);
    size_arg(&c, "rows", rows);
    size_arg(&c, "cols", cols);
    if (c.bad)
        return;
    size_t n = mul((size_t)rows, (size_t)cols);
    tensor_arg(&c, "dx", dx, n, "rows x cols", TAKES_FLOAT);
    optional_arg(&c, "dw", dw, (size_t)cols, "cols", TAKES_F32);
    tensor_arg(&c, "dout", dout, n, "rows x cols", TAKES_FLOAT);
    tensor_arg(&c, "x", x, n, "rows x cols", TAKES_FLOAT);
    tensor_arg(&c, "w", w, (size_t)cols, "cols", TAKES_FLOAT);
    tensor_arg(&c, "rstd", rstd, (size_t)rows, "rows", TAKES_F32);
    BE_DISPATCH(c.bad, be, rmsnorm_backward, dx, dw, dout, x, w, rstd, rows, cols);
}

void be_rope_ld_at(const char *file, int line, backend_t *be, tensor_t x, tensor_t src,
                   tensor_t cos, tensor_t sin, tensor_t pos, int B, int T, int nh, int hd,
                   int inverse, int x_ld, int src_ld)
{
    call c = begin(be, "rope", file, line);
    size_arg(&c, "B", B);
    size_arg(&c, "T", T);
    size_arg(&c, "nh", nh);
    size_arg(&c, "hd", hd);
    if (!c.bad && hd % 2)
        refuse(&c, "hd = %d is odd (rotate-half pairs element i with i + hd/2)", hd);
    size_t w = mul((size_t)nh, (size_t)hd), rows = mul((size_t)B, (size_t)T);
    if (!c.bad && ((size_t)x_ld < w || (size_t)src_ld < w))
        refuse(&c, "x_ld = %d and src_ld = %d must be at least nh x hd = %zu", x_ld, src_ld, w);
    if (c.bad)
        return;
    int natural = (size_t)x_ld == w && (size_t)src_ld == w;
    size_t nx = span2d(rows, w, (size_t)x_ld), ns = span2d(rows, w, (size_t)src_ld);
    const char *shape = natural ? "B x T x nh x hd" : "(B x T - 1) x ld + nh x hd";
    tensor_arg(&c, "x", x, nx, shape, TAKES_FLOAT);
    if (src.p != x.p || src.dt != x.dt || src_ld != x_ld) {
        tensor_arg(&c, "src", src, ns, shape, TAKES_FLOAT);
        size_t es = dtype_size(x.dt), ss = dtype_size(src.dt);
        const char *xb = x.p, *sb = src.p;
        if (!c.bad && xb < sb + ns * ss && sb < xb + nx * es)
            refuse(&c, "x and src overlap without being the same tensor at the same stride");
    }
    size_t nc = mul((size_t)T, (size_t)(hd / 2));
    tensor_arg(&c, "cos", cos, nc, "T x hd/2", TAKES_F32);
    tensor_arg(&c, "sin", sin, nc, "T x hd/2", TAKES_F32);
    optional_arg(&c, "pos", pos, rows, "B x T", TAKES_I32);
    BE_DISPATCH(c.bad || !(rows && w), be, rope, x, src, cos, sin, pos, B, T, nh, hd, inverse, x_ld, src_ld);
}

void be_rope_at(const char *file, int line, backend_t *be, tensor_t x, tensor_t cos, tensor_t sin,
                tensor_t pos, int B, int T, int nh, int hd, int inverse)
{
    int w = nh > 0 && hd > 0 && (size_t)nh * (size_t)hd <= INT_MAX ? nh * hd : 0;
    be_rope_ld_at(file, line, be, x, x, cos, sin, pos, B, T, nh, hd, inverse, w, w);
}

/* heads x hd as a row stride, or 0 when it does not fit an int (the
 * shape's checks refuse such a call first) */
static int attention_width(int heads, int hd)
{
    return heads > 0 && hd > 0 && (size_t)heads * (size_t)hd <= INT_MAX ? heads * hd : 0;
}

/* The shape of an attention call: positive, nh a multiple of nkv. */
static void attention_shape(call *c, int B, int T, int nh, int nkv, int hd)
{
    const char *names[] = {"B", "T", "nh", "nkv", "hd"};
    int v[] = {B, T, nh, nkv, hd};
    for (int i = 0; i < 5; i++)
        size_arg(c, names[i], v[i]);
    for (int i = 0; i < 5 && !c->bad; i++)
        if (v[i] == 0)
            refuse(c, "%s = 0, must be positive", names[i]);
    if (!c->bad && nh % nkv)
        refuse(c, "nh = %d is not a multiple of nkv = %d", nh, nkv);
}

/* The elements a [B x T, width] operand with row stride ld spans, and the
 * shape the error names; refused when ld < width. */
static size_t attention_span(call *c, const char *name, int ld, size_t rows, size_t width,
                             const char **shape)
{
    size_arg(c, name, ld);
    if (!c->bad && (size_t)ld < width)
        refuse(c, "%s = %d must be at least %zu (the row's heads)", name, ld, width);
    *shape = (size_t)ld == width ? NULL : "(B x T - 1) x ld + heads x hd";
    return c->bad ? 0 : span2d(rows, width, (size_t)ld);
}

void be_attention_forward_ld_at(const char *file, int line, backend_t *be, tensor_t out,
                                tensor_t lse, tensor_t q, tensor_t k, tensor_t v, tensor_t seg,
                                int B, int T, int nh, int nkv, int hd, int q_ld, int kv_ld)
{
    call c = begin(be, "attention_forward", file, line);
    attention_shape(&c, B, T, nh, nkv, hd);
    if (c.bad)
        return;
    size_t rows = mul((size_t)B, (size_t)T), wq = mul((size_t)nh, (size_t)hd);
    size_t wk = mul((size_t)nkv, (size_t)hd), nq = mul(rows, wq);
    const char *sq, *sk;
    size_t spq = attention_span(&c, "q_ld", q_ld, rows, wq, &sq);
    size_t spk = attention_span(&c, "kv_ld", kv_ld, rows, wk, &sk);
    if (c.bad)
        return;
    tensor_arg(&c, "out", out, nq, "B x T x nh x hd", TAKES_FLOAT);
    tensor_arg(&c, "lse", lse, mul3((size_t)B, (size_t)nh, (size_t)T), "B x nh x T", TAKES_F32);
    tensor_arg(&c, "q", q, spq, sq ? sq : "B x T x nh x hd", TAKES_FLOAT);
    tensor_arg(&c, "k", k, spk, sk ? sk : "B x T x nkv x hd", TAKES_FLOAT);
    tensor_arg(&c, "v", v, spk, sk ? sk : "B x T x nkv x hd", TAKES_FLOAT);
    optional_arg(&c, "seg", seg, rows, "B x T", TAKES_I32);
    const char *names[] = {"q", "k", "v", "out"};
    tensor_t ts[] = {q, k, v, out};
    same_dtype(&c, names, ts, 4, "q, k, v and out");
    BE_DISPATCH(c.bad, be, attention_forward, out, lse, q, k, v, seg, B, T, nh, nkv, hd, q_ld,
                kv_ld);
}

void be_attention_forward_at(const char *file, int line, backend_t *be, tensor_t out,
                             tensor_t lse, tensor_t q, tensor_t k, tensor_t v, tensor_t seg, int B,
                             int T, int nh, int nkv, int hd)
{
    be_attention_forward_ld_at(file, line, be, out, lse, q, k, v, seg, B, T, nh, nkv, hd,
                               attention_width(nh, hd), attention_width(nkv, hd));
}

void be_attention_backward_ld_at(const char *file, int line, backend_t *be, tensor_t dq,
                                 tensor_t dk, tensor_t dv, tensor_t dout, tensor_t out,
                                 tensor_t lse, tensor_t q, tensor_t k, tensor_t v, tensor_t seg,
                                 int B, int T, int nh, int nkv, int hd, int q_ld, int kv_ld,
                                 int dq_ld, int dkv_ld)
{
    call c = begin(be, "attention_backward", file, line);
    attention_shape(&c, B, T, nh, nkv, hd);
    if (c.bad)
        return;
    size_t rows = mul((size_t)B, (size_t)T), wq = mul((size_t)nh, (size_t)hd);
    size_t wk = mul((size_t)nkv, (size_t)hd), nq = mul(rows, wq);
    const char *sq, *sk, *sdq, *sdk;
    size_t spq = attention_span(&c, "q_ld", q_ld, rows, wq, &sq);
    size_t spk = attention_span(&c, "kv_ld", kv_ld, rows, wk, &sk);
    size_t spdq = attention_span(&c, "dq_ld", dq_ld, rows, wq, &sdq);
    size_t spdk = attention_span(&c, "dkv_ld", dkv_ld, rows, wk, &sdk);
    if (c.bad)
        return;
    tensor_arg(&c, "dq", dq, spdq, sdq ? sdq : "B x T x nh x hd", TAKES_FLOAT);
    tensor_arg(&c, "dk", dk, spdk, sdk ? sdk : "B x T x nkv x hd", TAKES_FLOAT);
    tensor_arg(&c, "dv", dv, spdk, sdk ? sdk : "B x T x nkv x hd", TAKES_FLOAT);
    tensor_arg(&c, "dout", dout, nq, "B x T x nh x hd", TAKES_FLOAT);
    tensor_arg(&c, "out", out, nq, "B x T x nh x hd", TAKES_FLOAT);
    tensor_arg(&c, "lse", lse, mul3((size_t)B, (size_t)nh, (size_t)T), "B x nh x T", TAKES_F32);
    tensor_arg(&c, "q", q, spq, sq ? sq : "B x T x nh x hd", TAKES_FLOAT);
    tensor_arg(&c, "k", k, spk, sk ? sk : "B x T x nkv x hd", TAKES_FLOAT);
    tensor_arg(&c, "v", v, spk, sk ? sk : "B x T x nkv x hd", TAKES_FLOAT);
    optional_arg(&c, "seg", seg, rows, "B x T", TAKES_I32);
    const char *names[] = {"q", "k", "v", "out", "dout", "dq", "dk", "dv"};
    tensor_t ts[] = {q, k, v, out, dout, dq, dk, dv};
    same_dtype(&c, names, ts, 8, "q, k, v, out and their gradients");
    BE_DISPATCH(c.bad, be, attention_backward, dq, dk, dv, dout, out, lse, q, k, v, seg, B, T, nh,
                nkv, hd, q_ld, kv_ld, dq_ld, dkv_ld);
}

void be_attention_backward_at(const char *file, int line, backend_t *be, tensor_t dq,
                              tensor_t dk, tensor_t dv, tensor_t dout, tensor_t out, tensor_t lse,
                              tensor_t q, tensor_t k, tensor_t v, tensor_t seg, int B, int T,
                              int nh, int nkv, int hd)
{
    int wq = attention_width(nh, hd), wk = attention_width(nkv, hd);
    be_attention_backward_ld_at(file, line, be, dq, dk, dv, dout, out, lse, q, k, v, seg, B, T,
                                nh, nkv, hd, wq, wk, wq, wk);
}

/* The shape checks of the SwiGLU pair: rows, cols, ld at least cols; the
 * strided operands (names[0..nld-1]) span (rows-1) ld + cols elements, the
 * contiguous ones rows x cols (dtypes may differ: each converts as read). */
static call swiglu_checks(backend_t *be, const char *op, const char *file, int line, int rows,
                          int cols, int ld, const char *const *names, const tensor_t *ts, int nld,
                          int count)
{
    call c = begin(be, op, file, line);
    size_arg(&c, "rows", rows);
    size_arg(&c, "cols", cols);
    size_arg(&c, "ld", ld);
    if (!c.bad && ld < cols)
        refuse(&c, "ld = %d must be at least cols = %d", ld, cols);
    if (c.bad)
        return c;
    for (int i = 0; i < count; i++) {
        if (i < nld)
            tensor_arg(&c, names[i], ts[i], span2d(rows, cols, ld), "(rows-1) x ld + cols",
                       TAKES_FLOAT);
        else
            tensor_arg(&c, names[i], ts[i], mul((size_t)rows, (size_t)cols), "rows x cols",
                       TAKES_FLOAT);
    }
    return c;
}

void be_swiglu_forward_at(const char *file, int line, backend_t *be, tensor_t out, tensor_t g,
                          tensor_t u, int rows, int cols, int ld)
{
    const char *names[] = {"g", "u", "out"};
    tensor_t ts[] = {g, u, out};
    call c = swiglu_checks(be, "swiglu_forward", file, line, rows, cols, ld, names, ts, 2, 3);
    BE_DISPATCH(c.bad || !(rows && cols), be, swiglu_forward, out, g, u, rows, cols, ld);
}

void be_swiglu_backward_at(const char *file, int line, backend_t *be, tensor_t dg, tensor_t du,
                           tensor_t dout, tensor_t g, tensor_t u, int rows, int cols, int ld)
{
    const char *names[] = {"dg", "du", "g", "u", "dout"};
    tensor_t ts[] = {dg, du, g, u, dout};
    call c = swiglu_checks(be, "swiglu_backward", file, line, rows, cols, ld, names, ts, 4, 5);
    BE_DISPATCH(c.bad || !(rows && cols), be, swiglu_backward, dg, du, dout, g, u, rows, cols, ld);
}

void be_embedding_forward_at(const char *file, int line, backend_t *be, tensor_t out,
                             tensor_t table, tensor_t tokens, int n, int H)
{
    call c = begin(be, "embedding_forward", file, line);
    size_arg(&c, "n", n);
    size_arg(&c, "H", H);
    if (c.bad)
        return;
    tensor_arg(&c, "out", out, mul((size_t)n, (size_t)H), "n x H", TAKES_FLOAT);
    tensor_arg(&c, "table", table, (size_t)H, "H", TAKES_FLOAT);
    tensor_arg(&c, "tokens", tokens, (size_t)n, "n", TAKES_I32);
    BE_DISPATCH(c.bad, be, embedding_forward, out, table, tokens, n, H);
}

void be_embedding_backward_at(const char *file, int line, backend_t *be, tensor_t dtable,
                              tensor_t dout, tensor_t tokens, tensor_t order, tensor_t runs,
                              int n, int H)
{
    call c = begin(be, "embedding_backward", file, line);
    size_arg(&c, "n", n);
    size_arg(&c, "H", H);
    if (c.bad)
        return;
    tensor_arg(&c, "dtable", dtable, (size_t)H, "H", TAKES_F32);
    tensor_arg(&c, "dout", dout, mul((size_t)n, (size_t)H), "n x H", TAKES_FLOAT);
    tensor_arg(&c, "tokens", tokens, (size_t)n, "n", TAKES_I32);
    tensor_arg(&c, "order", order, (size_t)n, "n", TAKES_I32);
    tensor_arg(&c, "runs", runs, (size_t)n + 2, "n + 2", TAKES_I32);
    BE_DISPATCH(c.bad, be, embedding_backward, dtable, dout, tokens, order, runs, n, H);
}

void be_cross_entropy_at(const char *file, int line, backend_t *be, tensor_t logits,
                         tensor_t loss, tensor_t targets, int rows, int V, float grad_scale,
                         tensor_t scale)
{
    call c = begin(be, "cross_entropy", file, line);
    size_arg(&c, "rows", rows);
    size_arg(&c, "V", V);
    if (c.bad)
        return;
    tensor_arg(&c, "logits", logits, mul((size_t)rows, (size_t)V), "rows x V", TAKES_FLOAT);
    tensor_arg(&c, "loss", loss, (size_t)rows, "rows", TAKES_F32);
    tensor_arg(&c, "targets", targets, (size_t)rows, "rows", TAKES_I32);
    optional_arg(&c, "scale", scale, 1, "1", TAKES_F32);
    BE_DISPATCH(c.bad, be, cross_entropy, logits, loss, targets, rows, V, grad_scale, scale);
}

void be_add_at(const char *file, int line, backend_t *be, tensor_t y, tensor_t x, float alpha,
               size_t n)
{
    call c = begin(be, "add", file, line);
    tensor_arg(&c, "y", y, n, "n", TAKES_FLOAT);
    tensor_arg(&c, "x", x, n, "n", TAKES_FLOAT);
    BE_DISPATCH(c.bad, be, add, y, x, alpha, n);
}

void be_add_bias_at(const char *file, int line, backend_t *be, tensor_t y, tensor_t b, int rows,
                    int cols)
{
    call c = begin(be, "add_bias", file, line);
    size_arg(&c, "rows", rows);
    size_arg(&c, "cols", cols);
    if (c.bad)
        return;
    tensor_arg(&c, "y", y, mul((size_t)rows, (size_t)cols), "rows x cols", TAKES_FLOAT);
    tensor_arg(&c, "b", b, (size_t)cols, "cols", TAKES_FLOAT);
    BE_DISPATCH(c.bad, be, add_bias, y, b, rows, cols);
}

void be_bias_backward_at(const char *file, int line, backend_t *be, tensor_t db, tensor_t dy,
                         int rows, int cols)
{
    call c = begin(be, "bias_backward", file, line);
    size_arg(&c, "rows", rows);
    size_arg(&c, "cols", cols);
    if (c.bad)
        return;
    tensor_arg(&c, "db", db, (size_t)cols, "cols", TAKES_F32);
    tensor_arg(&c, "dy", dy, mul((size_t)rows, (size_t)cols), "rows x cols", TAKES_FLOAT);
    BE_DISPATCH(c.bad, be, bias_backward, db, dy, rows, cols);
}

void be_weight_norm_at(const char *file, int line, backend_t *be, tensor_t n, tensor_t W,
                       tensor_t A, tensor_t B, float scale, int out, int in, int r)
{
    call c = begin(be, "weight_norm", file, line);
    size_arg(&c, "out", out);
    size_arg(&c, "in", in);
    size_arg(&c, "r", r);
    if (c.bad)
        return;
    tensor_arg(&c, "n", n, (size_t)out, "out", TAKES_F32);
    tensor_arg(&c, "W", W, mul((size_t)out, (size_t)in), "out x in", TAKES_FLOAT);
    if (r > 0) {
        tensor_arg(&c, "A", A, mul((size_t)r, (size_t)in), "r x in", TAKES_FLOAT);
        tensor_arg(&c, "B", B, mul((size_t)out, (size_t)r), "out x r", TAKES_FLOAT);
    }
    BE_DISPATCH(c.bad, be, weight_norm, n, W, A, B, scale, out, in, r);
}

void be_col_scale_at(const char *file, int line, backend_t *be, tensor_t y, tensor_t num,
                     tensor_t den, int rows, int cols)
{
    call c = begin(be, "col_scale", file, line);
    size_arg(&c, "rows", rows);
    size_arg(&c, "cols", cols);
    if (c.bad)
        return;
    tensor_arg(&c, "y", y, mul((size_t)rows, (size_t)cols), "rows x cols", TAKES_FLOAT);
    tensor_arg(&c, "num", num, (size_t)cols, "cols", TAKES_FLOAT);
    tensor_arg(&c, "den", den, (size_t)cols, "cols", TAKES_F32);
    BE_DISPATCH(c.bad, be, col_scale, y, num, den, rows, cols);
}

void be_col_dot_at(const char *file, int line, backend_t *be, tensor_t out, tensor_t x,
                   tensor_t y, tensor_t den, int rows, int cols)
{
    call c = begin(be, "col_dot", file, line);
    size_arg(&c, "rows", rows);
    size_arg(&c, "cols", cols);
    if (c.bad)
        return;
    tensor_arg(&c, "out", out, (size_t)cols, "cols", TAKES_F32);
    tensor_arg(&c, "x", x, mul((size_t)rows, (size_t)cols), "rows x cols", TAKES_FLOAT);
    tensor_arg(&c, "y", y, mul((size_t)rows, (size_t)cols), "rows x cols", TAKES_FLOAT);
    tensor_arg(&c, "den", den, (size_t)cols, "cols", TAKES_F32);
    BE_DISPATCH(c.bad, be, col_dot, out, x, y, den, rows, cols);
}

void be_dequant_nf4_at(const char *file, int line, backend_t *be, tensor_t out, tensor_t codes,
                       tensor_t absmax, tensor_t nested, tensor_t maps, float offset, size_t n)
{
    call c = begin(be, "dequant_nf4", file, line);
    tensor_arg(&c, "out", out, n, "n", TAKES_FLOAT);
    tensor_arg(&c, "codes", codes, n / 2 + n % 2, "(n+1)/2", TAKES_U8);
    tensor_arg(&c, "absmax", absmax, n / 64 + (n % 64 != 0), "ceil(n/64)", TAKES_U8);
    tensor_arg(&c, "nested", nested, n / 16384 + (n % 16384 != 0), "ceil(n/16384)", TAKES_F32);
    tensor_arg(&c, "maps", maps, n ? 16 + 256 : 0, "16 + 256", TAKES_F32);
    BE_DISPATCH(c.bad, be, dequant_nf4, out, codes, absmax, nested, maps, offset, n);
}

void be_quantize_nf4_at(const char *file, int line, backend_t *be, tensor_t codes, tensor_t absmax,
                        tensor_t x, tensor_t maps, size_t n)
{
    call c = begin(be, "quantize_nf4", file, line);
    tensor_arg(&c, "codes", codes, n / 2 + n % 2, "(n+1)/2", TAKES_U8);
    tensor_arg(&c, "absmax", absmax, n / 64 + (n % 64 != 0), "ceil(n/64)", TAKES_F32);
    tensor_arg(&c, "x", x, n, "n", TAKES_FLOAT);
    tensor_arg(&c, "maps", maps, n ? 16 + 256 : 0, "16 + 256", TAKES_F32);
    BE_DISPATCH(c.bad, be, quantize_nf4, codes, absmax, x, maps, n);
}

void be_dropout_at(const char *file, int line, backend_t *be, tensor_t out, tensor_t in, size_t n,
                   float p, uint64_t seed, tensor_t seed_dev, uint64_t offset)
{
    call c = begin(be, "dropout", file, line);
    if (!(p < 1.0f))
        refuse(&c, "p = %g, must be below 1", (double)p);
    tensor_arg(&c, "out", out, n, "n", TAKES_FLOAT);
    tensor_arg(&c, "in", in, n, "n", TAKES_FLOAT);
    optional_arg(&c, "seed_dev", seed_dev, 2, "2 (a 64-bit seed)", TAKES_I32);
    if (!c.bad && seed_dev.p && (uintptr_t)seed_dev.p % 8)
        refuse(&c, "seed_dev is not 8-byte aligned");
    BE_DISPATCH(c.bad, be, dropout, out, in, n, p, seed, seed_dev, offset);
}

double be_sumsq_at(const char *file, int line, backend_t *be, tensor_t x, size_t n)
{
    call c = begin(be, "sumsq", file, line);
    int runs = be_trace_barrier(be, "sumsq (the host reads its result)", file, line);
    tensor_arg(&c, "x", x, n, "n", TAKES_FLOAT);
    return c.bad || !runs ? 0.0 : be->ops->sumsq(be, x, n);
}

void be_sumsq_into_at(const char *file, int line, backend_t *be, tensor_t out, tensor_t x,
                      size_t n)
{
    call c = begin(be, "sumsq_into", file, line);
    sum_arg(&c, "out", out);
    tensor_arg(&c, "x", x, n, "n", TAKES_FLOAT);
    BE_DISPATCH(c.bad, be, sumsq_into, out, x, n);
}

void be_sum_add_at(const char *file, int line, backend_t *be, tensor_t acc, tensor_t x, size_t n)
{
    call c = begin(be, "sum_add", file, line);
    sum_arg(&c, "acc", acc);
    tensor_arg(&c, "x", x, n, "n", TAKES_F32);
    BE_DISPATCH(c.bad, be, sum_add, acc, x, n);
}

void be_adamw_at(const char *file, int line, backend_t *be, tensor_t param, tensor_t param_copy,
                 tensor_t grad, tensor_t m, tensor_t v, size_t n, const adamw_args *a)
{
    call c = begin(be, "adamw", file, line);
    tensor_arg(&c, "param", param, n, "n", TAKES_F32);
    optional_arg(&c, "param_copy", param_copy, n, "n", TAKES_FLOAT);
    tensor_arg(&c, "grad", grad, n, "n", TAKES_F32);
    tensor_arg(&c, "m", m, n, "n", TAKES_F32);
    tensor_arg(&c, "v", v, n, "n", TAKES_F32);
    if (!c.bad && !a)
        refuse(&c, "a (the hyperparameters) is NULL");
    if (!c.bad && (a->hyper.p || a->sumsq.p)) { /* both or neither */
        tensor_arg(&c, "a->hyper", a->hyper, 3, "3 (lr and the bias corrections)", TAKES_F32);
        sum_arg(&c, "a->sumsq", a->sumsq);
    }
    BE_DISPATCH(c.bad, be, adamw, param, param_copy, grad, m, v, n, a);
}

void be_fill_uniform_at(const char *file, int line, backend_t *be, tensor_t x, size_t n, float lo,
                        float hi, uint64_t seed, uint64_t offset)
{
    call c = begin(be, "fill_uniform", file, line);
    tensor_arg(&c, "x", x, n, "n", TAKES_FLOAT);
    BE_DISPATCH(c.bad, be, fill_uniform, x, n, lo, hi, seed, offset);
}

void be_fill_normal_at(const char *file, int line, backend_t *be, tensor_t x, size_t n,
                       float mean, float std, uint64_t seed, uint64_t offset)
{
    call c = begin(be, "fill_normal", file, line);
    tensor_arg(&c, "x", x, n, "n", TAKES_FLOAT);
    BE_DISPATCH(c.bad, be, fill_normal, x, n, mean, std, seed, offset);
}

/* ---- streams ------------------------------------------------------------------- */

int be_has_streams(backend_t *be)
{
    return be->ops->aux_stream && be->ops->stream_fence;
}

void *be_aux_stream_at(const char *file, int line, backend_t *be)
{
    (void)file, (void)line;
    return be->ops->aux_stream ? be->ops->aux_stream(be) : NULL;
}

void be_stream_fence_at(const char *file, int line, backend_t *be, void *waiter, void *waitee)
{
    if (be_trace_barrier(be, "stream_fence", file, line) && be->ops->stream_fence)
        be->ops->stream_fence(be, waiter, waitee);
}
