/* kernels/cuda/cuda_vec.cu — 16-byte vector paths of the hot elementwise
 * ops of cuda_ops.cu: add, add_bias, SwiGLU (forward and backward), dropout,
 * RMSNorm (forward and backward), RoPE, AdamW's compute copy and QLoRA's
 * NF4 dequantization. Each thread moves 8 consecutive elements per step: one
 * uint4 of 8 bf16, or two float4 of 4 fp32 each, per tensor (dequant_nf4:
 * the 8 elements' 4 code bytes as one word).
 *
 * The vector path changes memory access only: every element gets the fp32
 * arithmetic of the scalar kernel in cuda_ops.cu (the same expression, so
 * the same roundings and fused multiply-adds) and the same rounding to
 * bf16, so its results are those of the scalar kernel bit for bit
 * (tests/test_cuda_elementwise.c checks it). RMSNorm keeps the scalar
 * kernel's reduction order too: the row is staged in shared memory with
 * vector loads, and its sums are taken from there over the same threads,
 * in the same order, as the scalar kernel's (fp32 per thread, then
 * block_sum).
 *
 * Each cuda_vec_* entry returns 1 when it launched (or tried to launch:
 * a failure is the sticky error as usual) and 0 when the scalar kernel must
 * run: SPOTUNE_CUDA_ELEMENTWISE=scalar (read on every call), a tensor not
 * 16-byte aligned (a view at an odd offset; dequant_nf4's codes: 4-byte),
 * a dtype other than F32 or BF16, or a size that is not a multiple of 8
 * (elements; columns for add_bias and RMSNorm, half the head dim for
 * RoPE). */
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

#define STREAM(be) (CUDA_IMPL(be)->stream)

/* The rows of RMSNorm; the scalar kernels' ROW_BLOCK (cuda_ops.cu): the
 * same block shape gives the same reduction tree. */
#define VEC_ROW_BLOCK 256
/* Shared memory RMSNorm's staged row(s) may take: 48 KiB (no opt-in) less
 * 1 KiB for the static shared memory of the block sum. */
#define VEC_ROW_SMEM 47104

/* ---- 8-element loads and stores ------------------------------------------------- */

/* Elements 8v..8v+7 of an F32 or BF16 buffer (16-byte aligned), as floats.
 * bf16 pairs are little-endian: element 2j is the low half of word j. */
static __device__ __forceinline__ void ld8(const void *p, int dt, size_t v, float f[8])
{
    if (dt == DT_BF16) {
        uint4 q = ((const uint4 *)p)[v];
        uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            f[2 * j] = bf16_to_f32((uint16_t)(w[j] & 0xffffu));
            f[2 * j + 1] = bf16_to_f32((uint16_t)(w[j] >> 16));
        }
    } else {
        float4 a = ((const float4 *)p)[2 * v], b = ((const float4 *)p)[2 * v + 1];
        f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
        f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
    }
}

static __device__ __forceinline__ void st8(void *p, int dt, size_t v, const float f[8])
{
    if (dt == DT_BF16) {
        uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            w[j] = (uint32_t)f32_to_bf16(f[2 * j]) | ((uint32_t)f32_to_bf16(f[2 * j + 1]) << 16);
        ((uint4 *)p)[v] = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
        ((float4 *)p)[2 * v] = make_float4(f[0], f[1], f[2], f[3]);
        ((float4 *)p)[2 * v + 1] = make_float4(f[4], f[5], f[6], f[7]);
    }
}

/* ---- kernels: the scalar kernels' arithmetic, 8 elements a step ------------------- */

__global__ void add_vec_kernel(void *y, int ydt, const void *x, int xdt, float alpha, size_t nv)
{
    GRID_STRIDE(v, nv)
    {
        float a[8], b[8];
        ld8(y, ydt, v, a);
        ld8(x, xdt, v, b);
#pragma unroll
        for (int j = 0; j < 8; j++)
            a[j] = a[j] + alpha * b[j];
        st8(y, ydt, v, a);
    }
}

/* cols % 8 == 0: the 8 elements of a step share a row and take b[c..c+7] */
__global__ void add_bias_vec_kernel(void *y, int ydt, const void *b, int bdt, int cols, size_t nv)
{
    size_t cv = (size_t)cols / 8;
    GRID_STRIDE(v, nv)
    {
        float a[8], c[8];
        ld8(y, ydt, v, a);
        ld8(b, bdt, v % cv, c);
#pragma unroll
        for (int j = 0; j < 8; j++)
            a[j] = a[j] + c[j];
        st8(y, ydt, v, a);
    }
}

/* nv vectors of out (dout) contiguous; g, u (dg, du) with row stride ldv
 * vectors, cv vectors a row */
__global__ void swiglu_forward_vec_kernel(void *out, int odt, const void *g, int gdt,
                                          const void *u, int udt, size_t nv, size_t cv,
                                          size_t ldv)
{
    GRID_STRIDE(v, nv)
    {
        size_t w = strided_index(v, cv, ldv);
        float gg[8], uu[8], o[8];
        ld8(g, gdt, w, gg);
        ld8(u, udt, w, uu);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float gv = gg[j];
            float s = 1.0f / (1.0f + expf(-gv));
            o[j] = gv * s * uu[j];
        }
        st8(out, odt, v, o);
    }
}

__global__ void swiglu_backward_vec_kernel(void *dg, int dgdt, void *du, int dudt,
                                           const void *dout, int ddt, const void *g, int gdt,
                                           const void *u, int udt, size_t nv, size_t cv,
                                           size_t ldv)
{
    GRID_STRIDE(v, nv)
    {
        size_t w = strided_index(v, cv, ldv);
        float gg[8], uu[8], dd[8], og[8], ou[8];
        ld8(g, gdt, w, gg);
        ld8(u, udt, w, uu);
        ld8(dout, ddt, v, dd);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float gv = gg[j], uv = uu[j], d = dd[j];
            float s = 1.0f / (1.0f + expf(-gv));
            og[j] = d * uv * s * (1.0f + gv * (1.0f - s));
            ou[j] = d * gv * s;
        }
        st8(dg, dgdt, w, og);
        st8(du, dudt, w, ou);
    }
}

__global__ void dropout_vec_kernel(void *out, int odt, const void *in, int idt, size_t nv, float p,
                                   float keep_scale, uint64_t seed, const uint64_t *seed_dev,
                                   uint64_t offset)
{
    if (seed_dev)
        seed += *seed_dev;
    GRID_STRIDE(v, nv)
    {
        float a[8];
        ld8(in, idt, v, a);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            uint64_t i = (uint64_t)v * 8 + (uint64_t)j;
            a[j] = d_rng_uniform(seed, offset + i) >= p ? __fmul_rn(a[j], keep_scale) : 0.0f;
        }
        st8(out, odt, v, a);
    }
}

/* hh % 8 == 0: the 8 elements of a step are i..i+7 of one head's first half,
 * each paired with i + hh as in the scalar kernel */
__global__ void rope_vec_kernel(void *x, int dt, const void *src, int sdt, const float *cosv,
                                const float *sinv, const int *pos, int T, int nh, int hd,
                                size_t nv, float sgn, size_t x_ld, size_t src_ld)
{
    GRID_STRIDE(v, nv)
    {
        int hh = hd / 2;
        size_t idx = v * 8;
        int i = (int)(idx % hh);
        size_t head = idx / hh; /* (b*T + t)*nh + h */
        size_t row = head / nh, h = head % nh;
        int t = (int)(row % T);
        if (pos) {
            int p = pos[row];
            t = p < 0 ? 0 : p >= T ? T - 1 : p;
        }
        size_t base = row * x_ld + h * (size_t)hd, sbase = row * src_ld + h * (size_t)hd;
        size_t tab = (size_t)t * hh + i;
        float c[8], sn[8], a[8], b[8];
        float4 c0 = *(const float4 *)(cosv + tab), c1 = *(const float4 *)(cosv + tab + 4);
        float4 s0 = *(const float4 *)(sinv + tab), s1 = *(const float4 *)(sinv + tab + 4);
        c[0] = c0.x, c[1] = c0.y, c[2] = c0.z, c[3] = c0.w;
        c[4] = c1.x, c[5] = c1.y, c[6] = c1.z, c[7] = c1.w;
        sn[0] = s0.x, sn[1] = s0.y, sn[2] = s0.z, sn[3] = s0.w;
        sn[4] = s1.x, sn[5] = s1.y, sn[6] = s1.z, sn[7] = s1.w;
        ld8(src, sdt, (sbase + i) / 8, a);
        ld8(src, sdt, (sbase + i + hh) / 8, b);
        float oa[8], ob[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float cj = c[j], sj = sgn * sn[j];
            oa[j] = a[j] * cj - b[j] * sj;
            ob[j] = b[j] * cj + a[j] * sj;
        }
        st8(x, dt, (base + i) / 8, oa);
        st8(x, dt, (base + i + hh) / 8, ob);
    }
}

/* Copies nq uint4 from src to dst, over the block. */
static __device__ __forceinline__ void stage_row(uint4 *dst, const void *src, int nq)
{
    for (int q = threadIdx.x; q < nq; q += blockDim.x)
        dst[q] = ((const uint4 *)src)[q];
}

/* The scalar rmsnorm_forward_kernel with x's row staged in shared memory
 * (raw, its own dtype): the sum of squares is read from there by the same
 * threads in the same order, the output pass 8 columns a step. */
__global__ void rmsnorm_forward_vec_kernel(void *out, int odt, float *rstd, const void *x, int xdt,
                                           const void *w, int wdt, int cols, float eps)
{
    DYNAMIC_SHARED(uint4, stage);
    __shared__ float sh[33];
    size_t base = (size_t)blockIdx.x * cols;
    size_t xs = xdt == DT_BF16 ? 2 : 4;
    stage_row(stage, (const char *)x + base * xs, (int)(cols * xs / 16));
    __syncthreads();
    float ss = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = ld_f(stage, xdt, c);
        ss = __fadd_rn(ss, __fmul_rn(v, v));
    }
    ss = block_sum(ss, sh);
    float s = 1.0f / sqrtf(ss / (float)cols + eps);
    if (threadIdx.x == 0)
        rstd[blockIdx.x] = s;
    int nv = cols / 8;
    for (int v = threadIdx.x; v < nv; v += blockDim.x) {
        float xv[8], wv[8], o[8];
        ld8(stage, xdt, v, xv);
        ld8(w, wdt, v, wv);
#pragma unroll
        for (int j = 0; j < 8; j++)
            o[j] = wv[j] * (xv[j] * s);
        st8(out, odt, base / 8 + v, o);
    }
}

/* The scalar rmsnorm_backward_kernel with the rows of dout and x staged in
 * shared memory (dout's, then x's): the dot product is read from there by
 * the same threads in the same order, the update of dx 8 columns a step. */
__global__ void rmsnorm_backward_vec_kernel(void *dx, int dxdt, const void *dout, int ddt,
                                            const void *x, int xdt, const void *w, int wdt,
                                            const float *rstd, int cols)
{
    DYNAMIC_SHARED(uint4, stage);
    __shared__ float sh[33];
    size_t base = (size_t)blockIdx.x * cols;
    size_t ds = ddt == DT_BF16 ? 2 : 4, xs = xdt == DT_BF16 ? 2 : 4;
    int nd = (int)(cols * ds / 16);
    uint4 *sd = stage, *sx = stage + nd;
    stage_row(sd, (const char *)dout + base * ds, nd);
    stage_row(sx, (const char *)x + base * xs, (int)(cols * xs / 16));
    __syncthreads();
    float s = rstd[blockIdx.x];
    float dot = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        dot = rms_dot_step(dot, ld_f(sd, ddt, c), ld_f(w, wdt, c), ld_f(sx, xdt, c), s);
    float mean = block_sum(dot, sh) / (float)cols;
    int nv = cols / 8;
    for (int v = threadIdx.x; v < nv; v += blockDim.x) {
        float a[8], dd[8], wv[8], xv[8];
        ld8(dx, dxdt, base / 8 + v, a);
        ld8(sd, ddt, v, dd);
        ld8(w, wdt, v, wv);
        ld8(sx, xdt, v, xv);
#pragma unroll
        for (int j = 0; j < 8; j++)
            a[j] = rms_dx(a[j], dd[j], wv[j], xv[j], s, mean);
        st8(dx, dxdt, base / 8 + v, a);
    }
}

/* AdamW with its compute copy (F32 or BF16, or none) 8 elements a step */
__global__ void adamw_vec_kernel(float *P, void *copy, int cdt, const float *G, float *M, float *V,
                                 size_t nv, adamw_k k)
{
    if (!adamw_k_resolve(&k))
        return;
    GRID_STRIDE(v, nv)
    {
        float pp[8], gg[8], mm[8], vv[8];
        ld8(P, DT_F32, v, pp);
        ld8(G, DT_F32, v, gg);
        ld8(M, DT_F32, v, mm);
        ld8(V, DT_F32, v, vv);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float g = gg[j] * k.grad_scale;
            float m = k.beta1 * mm[j] + (1.0f - k.beta1) * g;
            float vj = k.beta2 * vv[j] + (1.0f - k.beta2) * g * g;
            mm[j] = m;
            vv[j] = vj;
            float denom = sqrtf(vj) / k.bc2_sqrt + k.eps;
            pp[j] = pp[j] * k.decay - k.step_size * m / denom;
        }
        st8(M, DT_F32, v, mm);
        st8(V, DT_F32, v, vv);
        st8(P, DT_F32, v, pp);
        if (copy)
            st8(copy, cdt, v, pp);
    }
}

/* NF4 with double quantization, 8 elements a step: they share one block of
 * 64 (and of 16384 for the nested absmax), so one absmax; their 4 code bytes
 * are one word (byte j: element 2j in the high nibble, 2j+1 in the low).
 * The tables (the 16 NF4 values, then the 256 of the dynamic map) are staged
 * in shared memory. The products and the sum rounded one at a time, as
 * dequant_nf4_kernel (cuda_ops.cu) computes them. */
__global__ void dequant_nf4_vec_kernel(void *out, int odt, const uint32_t *codes,
                                       const uint8_t *absmax, const float *nested,
                                       const float *maps, float offset, size_t nv)
{
    __shared__ float map[16 + 256];
    for (int k = (int)threadIdx.x; k < 16 + 256; k += (int)blockDim.x)
        map[k] = maps[k];
    __syncthreads();
    GRID_STRIDE(v, nv)
    {
        float am = __fadd_rn(__fmul_rn(map[16 + absmax[v / 8]], nested[v / 2048]), offset);
        uint32_t w = codes[v];
        float f[8];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            uint32_t byte = (w >> (8 * j)) & 0xffu;
            f[2 * j] = __fmul_rn(map[byte >> 4], am);
            f[2 * j + 1] = __fmul_rn(map[byte & 0x0fu], am);
        }
        st8(out, odt, v, f);
    }
}

/* ---- host: when the vector path takes a call ---------------------------------------- */

extern "C" int cuda_elementwise_vector(void)
{
    const char *e = getenv("SPOTUNE_CUDA_ELEMENTWISE");
    return !(e && strcmp(e, "scalar") == 0);
}

/* 1 when the selector allows the vector path, n is a multiple of 8, and
 * every tensor is F32 or BF16 with a 16-byte aligned address */
static int vec_takes(size_t n, int count, const tensor_t *t)
{
    if (!cuda_elementwise_vector() || n % 8)
        return 0;
    for (int i = 0; i < count; i++)
        if ((t[i].dt != DT_F32 && t[i].dt != DT_BF16) || ((uintptr_t)t[i].p & 15u))
            return 0;
    return 1;
}

static size_t dt_bytes(dtype_t dt)
{
    return dt == DT_BF16 ? 2 : 4;
}

extern "C" int cuda_vec_add(backend_t *be, tensor_t y, tensor_t x, float alpha, size_t n)
{
    tensor_t t[] = {y, x};
    if (!vec_takes(n, 2, t))
        return 0;
    LAUNCH(add_vec_kernel, cuda_blocks(n / 8), CUDA_BLOCK, 0, STREAM(be))(
        y.p, y.dt, x.p, x.dt, alpha, n / 8);
    LAUNCHED(be, "add_vec_kernel");
    return 1;
}

extern "C" int cuda_vec_add_bias(backend_t *be, tensor_t y, tensor_t b, int rows, int cols)
{
    tensor_t t[] = {y, b};
    size_t n = (size_t)rows * cols;
    if (cols % 8 || !vec_takes(n, 2, t))
        return 0;
    LAUNCH(add_bias_vec_kernel, cuda_blocks(n / 8), CUDA_BLOCK, 0, STREAM(be))(
        y.p, y.dt, b.p, b.dt, cols, n / 8);
    LAUNCHED(be, "add_bias_vec_kernel");
    return 1;
}

extern "C" int cuda_vec_swiglu_forward(backend_t *be, tensor_t out, tensor_t g, tensor_t u,
                                       int rows, int cols, int ld)
{
    tensor_t t[] = {out, g, u};
    size_t n = (size_t)rows * (size_t)cols;
    if (cols % 8 || ld % 8 || !vec_takes(n, 3, t))
        return 0;
    LAUNCH(swiglu_forward_vec_kernel, cuda_blocks(n / 8), CUDA_BLOCK, 0, STREAM(be))(
        out.p, out.dt, g.p, g.dt, u.p, u.dt, n / 8, (size_t)cols / 8, (size_t)ld / 8);
    LAUNCHED(be, "swiglu_forward_vec_kernel");
    return 1;
}

extern "C" int cuda_vec_swiglu_backward(backend_t *be, tensor_t dg, tensor_t du, tensor_t dout,
                                        tensor_t g, tensor_t u, int rows, int cols, int ld)
{
    tensor_t t[] = {dg, du, dout, g, u};
    size_t n = (size_t)rows * (size_t)cols;
    if (cols % 8 || ld % 8 || !vec_takes(n, 5, t))
        return 0;
    LAUNCH(swiglu_backward_vec_kernel, cuda_blocks(n / 8), CUDA_BLOCK, 0, STREAM(be))(
        dg.p, dg.dt, du.p, du.dt, dout.p, dout.dt, g.p, g.dt, u.p, u.dt, n / 8, (size_t)cols / 8,
        (size_t)ld / 8);
    LAUNCHED(be, "swiglu_backward_vec_kernel");
    return 1;
}

extern "C" int cuda_vec_dropout(backend_t *be, tensor_t out, tensor_t in, size_t n, float p,
                                float keep_scale, uint64_t seed, const uint64_t *seed_dev,
                                uint64_t offset)
{
    tensor_t t[] = {out, in};
    if (!vec_takes(n, 2, t))
        return 0;
    LAUNCH(dropout_vec_kernel, cuda_blocks(n / 8), CUDA_BLOCK, 0, STREAM(be))(
        out.p, out.dt, in.p, in.dt, n / 8, p, keep_scale, seed, seed_dev, offset);
    LAUNCHED(be, "dropout_vec_kernel");
    return 1;
}

extern "C" int cuda_vec_rope(backend_t *be, tensor_t x, tensor_t src, tensor_t cos, tensor_t sin,
                             tensor_t pos, int B, int T, int nh, int hd, float sgn, int x_ld,
                             int src_ld)
{
    int hh = hd / 2;
    size_t n = (size_t)B * T * nh * hh;
    tensor_t t[] = {x, src, cos, sin};
    if (hh % 8 || x_ld % 8 || src_ld % 8 || !vec_takes(n, 4, t))
        return 0;
    LAUNCH(rope_vec_kernel, cuda_blocks(n / 8), CUDA_BLOCK, 0, STREAM(be))(
        x.p, x.dt, src.p, src.dt, (const float *)cos.p, (const float *)sin.p, (const int *)pos.p, T,
        nh, hd, n / 8, sgn, (size_t)x_ld, (size_t)src_ld);
    LAUNCHED(be, "rope_vec_kernel");
    return 1;
}

extern "C" int cuda_vec_rmsnorm_forward(backend_t *be, tensor_t out, tensor_t rstd, tensor_t x,
                                        tensor_t w, int rows, int cols, float eps)
{
    tensor_t t[] = {out, x, w};
    size_t smem = (size_t)cols * dt_bytes(x.dt);
    if (cols % 8 || !vec_takes((size_t)cols, 3, t) || smem > VEC_ROW_SMEM)
        return 0;
    LAUNCH(rmsnorm_forward_vec_kernel, rows, VEC_ROW_BLOCK, smem, STREAM(be))(
        out.p, out.dt, (float *)rstd.p, x.p, x.dt, w.p, w.dt, cols, eps);
    LAUNCHED(be, "rmsnorm_forward_vec_kernel");
    return 1;
}

/* dx only: dw is the scalar path's column sum (cuda_ops.cu) */
extern "C" int cuda_vec_rmsnorm_backward(backend_t *be, tensor_t dx, tensor_t dout, tensor_t x,
                                         tensor_t w, tensor_t rstd, int rows, int cols)
{
    tensor_t t[] = {dx, dout, x, w};
    size_t smem = (size_t)cols * (dt_bytes(dout.dt) + dt_bytes(x.dt));
    if (cols % 8 || !vec_takes((size_t)cols, 4, t) || smem > VEC_ROW_SMEM)
        return 0;
    LAUNCH(rmsnorm_backward_vec_kernel, rows, VEC_ROW_BLOCK, smem, STREAM(be))(
        dx.p, dx.dt, dout.p, dout.dt, x.p, x.dt, w.p, w.dt, (const float *)rstd.p, cols);
    LAUNCHED(be, "rmsnorm_backward_vec_kernel");
    return 1;
}

extern "C" int cuda_vec_dequant_nf4(backend_t *be, tensor_t out, tensor_t codes, tensor_t absmax,
                                    tensor_t nested, tensor_t maps, float offset, size_t n)
{
    tensor_t t[] = {out};
    if (!vec_takes(n, 1, t) || ((uintptr_t)codes.p & 3u))
        return 0;
    LAUNCH(dequant_nf4_vec_kernel, cuda_blocks(n / 8), CUDA_BLOCK, 0, STREAM(be))(
        out.p, out.dt, (const uint32_t *)codes.p, (const uint8_t *)absmax.p,
        (const float *)nested.p, (const float *)maps.p, offset, n / 8);
    LAUNCHED(be, "dequant_nf4_vec_kernel");
    return 1;
}

extern "C" int cuda_vec_adamw(backend_t *be, tensor_t param, void *copy, dtype_t cdt,
                              tensor_t grad, tensor_t m, tensor_t v, size_t n, const adamw_k *k)
{
    tensor_t c = {};
    c.p = copy ? copy : param.p;
    c.dt = copy ? cdt : DT_F32;
    tensor_t t[] = {param, grad, m, v, c};
    if (!vec_takes(n, 5, t) || param.dt != DT_F32 || grad.dt != DT_F32 || m.dt != DT_F32 ||
        v.dt != DT_F32)
        return 0;
    LAUNCH(adamw_vec_kernel, cuda_blocks(n / 8), CUDA_BLOCK, 0, STREAM(be))(
        (float *)param.p, copy, cdt, (const float *)grad.p, (float *)m.p, (float *)v.p, n / 8, *k);
    LAUNCHED(be, "adamw_vec_kernel");
    return 1;
}
