/* kernels/cuda/cuda_nf4.cu — QLoRA's NF4 on the device (kernels/nf4.h,
 * bitsandbytes' layout with double quantization): dequant_nf4, which every
 * product on an NF4 weight runs first (its 16-byte vector path is in
 * cuda_vec.cu), and quantize_nf4, which quantizes a weight where its values
 * are (at load), bit for bit the host's nf4_quantize_codes. The arguments
 * have been checked (kernels/backend_ops.c). */
#include <math.h>

#include "cuda_internal.h"

#define STREAM(be) (CUDA_IMPL(be)->stream)

/* NF4 with double quantization (kernels/nf4.h); the products and the sum
 * rounded one at a time (no fused multiply-add), as the host code and
 * bitsandbytes do */
__global__ void dequant_nf4_kernel(void *out, int odt, const uint8_t *codes, const uint8_t *absmax,
                                   const float *nested, const float *maps, float offset, size_t n)
{
    GRID_STRIDE(i, n)
    {
        size_t b = i / 64;
        float am = __fadd_rn(__fmul_rn(maps[16 + absmax[b]], nested[i / 16384]),
                             offset);
        uint8_t c = (i % 2) ? (codes[i / 2] & 0x0f) : (uint8_t)(codes[i / 2] >> 4);
        st_f(out, odt, i, __fmul_rn(maps[c], am));
    }
}

/* nf4_quantize_codes (kernels/nf4.c) on the device, bit for bit: a warp per
 * block of 64 values, two values (one code byte) per lane; the block's
 * largest |x| by shuffles (a maximum: any order), each value scaled by a
 * correctly rounded reciprocal (a full block) or quotient (the partial last
 * block), and its code the number of midpoints between neighbouring NF4
 * values below it, as on the host. */
static __device__ __forceinline__ float nf4_clamp1(float x)
{
    return x < -1.0f ? -1.0f : (x > 1.0f ? 1.0f : x);
}

__global__ void quantize_nf4_kernel(uint8_t *codes, float *absmax, const void *x, int xdt,
                                    const float *maps, size_t n)
{
    __shared__ float mid[15];
    if (threadIdx.x < 15)
        mid[threadIdx.x] = __fmul_rn(__fadd_rn(maps[threadIdx.x], maps[threadIdx.x + 1]), 0.5f);
    __syncthreads();
    size_t nb = (n + 63) / 64, warps = (size_t)gridDim.x * (blockDim.x / 32);
    int lane = threadIdx.x & 31;
    for (size_t b = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; b < nb; b += warps) {
        size_t lo = b * 64, len = n - lo < 64 ? n - lo : 64, i = lo + 2 * (size_t)lane;
        float v0 = i < n ? ld_f(x, xdt, i) : 0.0f, v1 = i + 1 < n ? ld_f(x, xdt, i + 1) : 0.0f;
        float am = fmaxf(fmaxf(0.0f, fabsf(v0)), fabsf(v1)); /* a NaN is passed over */
        for (int o = 16; o > 0; o >>= 1)
            am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, o));
        float den = fmaxf(am, 1e-38f), s0, s1;
        if (len == 64) {
            float recip = __fdiv_rn(1.0f, den);
            s0 = nf4_clamp1(__fmul_rn(v0, recip));
            s1 = nf4_clamp1(__fmul_rn(v1, recip));
        } else { /* past n: 0.0's code, as the host pads */
            s0 = i < n ? nf4_clamp1(__fdiv_rn(v0, den)) : 0.0f;
            s1 = i + 1 < n ? nf4_clamp1(__fdiv_rn(v1, den)) : 0.0f;
        }
        if (lane == 0)
            absmax[b] = len == 64 ? am : den;
        if (i < n) {
            int c0 = 0, c1 = 0;
            for (int m = 0; m < 15; m++) {
                c0 += mid[m] < s0;
                c1 += mid[m] < s1;
            }
            codes[i / 2] = (uint8_t)(c0 << 4 | c1);
        }
    }
}

extern "C" void cuda_quantize_nf4(backend_t *be, tensor_t codes, tensor_t absmax, tensor_t x,
                                  tensor_t maps, size_t n)
{
    if (be->err.code || !n)
        return;
    size_t nb = (n + 63) / 64, blocks = (nb + 7) / 8; /* 8 warps a block */
    if (blocks > 65536)
        blocks = 65536;
    LAUNCH(quantize_nf4_kernel, (unsigned)blocks, 256, 0, STREAM(be))(
        (uint8_t *)codes.p, (float *)absmax.p, x.p, x.dt, (const float *)maps.p, n);
    LAUNCHED(be, "quantize_nf4_kernel");
}

extern "C" void cuda_dequant_nf4(backend_t *be, tensor_t out, tensor_t codes, tensor_t absmax,
                                 tensor_t nested, tensor_t maps, float offset, size_t n)
{
    if (be->err.code || !n || cuda_vec_dequant_nf4(be, out, codes, absmax, nested, maps, offset, n))
        return;
    LAUNCH(dequant_nf4_kernel, cuda_blocks(n), CUDA_BLOCK, 0, STREAM(be))(
        out.p, out.dt, (const uint8_t *)codes.p, (const uint8_t *)absmax.p, (const float *)nested.p,
        (const float *)maps.p, offset, n);
    LAUNCHED(be, "dequant_nf4_kernel");
}
