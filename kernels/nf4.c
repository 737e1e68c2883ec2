/* kernels/nf4.c — NF4 with double quantization (nf4.h). */
#include "nf4.h"

#include <math.h>

const float nf4_quant_map[16] = {
    -0x1p+0f, -0x1.647362p-1f, -0x1.0cd66p-1f, -0x1.94654p-2f,
    -0x1.23449ap-2f, -0x1.7a6a7ep-3f, -0x1.74f0e2p-4f, 0.0f,
    0x1.45f5fep-4f, 0x1.4995c6p-3f, 0x1.f809bap-3f, 0x1.5a0674p-2f,
    0x1.c3497p-2f, 0x1.200f56p-1f, 0x1.722766p-1f, 0x1p+0f,
};

const float nf4_dynamic_map[256] = {
    -0x1.fc6666p-1f, -0x1.f53334p-1f, -0x1.eep-1f, -0x1.e6ccccp-1f,
    -0x1.df999ap-1f, -0x1.d86666p-1f, -0x1.d13334p-1f, -0x1.cap-1f,
    -0x1.c2ccccp-1f, -0x1.bb999ap-1f, -0x1.b46666p-1f, -0x1.ad3334p-1f,
    -0x1.a6p-1f, -0x1.9eccccp-1f, -0x1.97999ap-1f, -0x1.906666p-1f,
    -0x1.893334p-1f, -0x1.82p-1f, -0x1.7accccp-1f, -0x1.73999ap-1f,
    -0x1.6c6668p-1f, -0x1.653334p-1f, -0x1.5ep-1f, -0x1.56ccccp-1f,
    -0x1.4f999ap-1f, -0x1.486668p-1f, -0x1.413334p-1f, -0x1.3ap-1f,
    -0x1.32ccccp-1f, -0x1.2b999ap-1f, -0x1.246668p-1f, -0x1.1d3334p-1f,
    -0x1.16p-1f, -0x1.0eccccp-1f, -0x1.079998p-1f, -0x1.006666p-1f,
    -0x1.f26664p-2f, -0x1.e4p-2f, -0x1.d59998p-2f, -0x1.c73334p-2f,
    -0x1.b8ccccp-2f, -0x1.aa6666p-2f, -0x1.9cp-2f, -0x1.8d9998p-2f,
    -0x1.7f3334p-2f, -0x1.70ccccp-2f, -0x1.626666p-2f, -0x1.54p-2f,
    -0x1.459998p-2f, -0x1.373334p-2f, -0x1.28ccccp-2f, -0x1.1a6668p-2f,
    -0x1.0cp-2f, -0x1.fb3332p-3f, -0x1.de6666p-3f, -0x1.c1999ap-3f,
    -0x1.a4ccccp-3f, -0x1.88p-3f, -0x1.6b3334p-3f, -0x1.4e6666p-3f,
    -0x1.31999ap-3f, -0x1.14ccccp-3f, -0x1.fp-4f, -0x1.b66668p-4f,
    -0x1.93d70ap-4f, -0x1.8851eep-4f, -0x1.7ccccep-4f, -0x1.7147aep-4f,
    -0x1.65c29p-4f, -0x1.5a3d7p-4f, -0x1.4eb854p-4f, -0x1.433334p-4f,
    -0x1.37ae14p-4f, -0x1.2c28f6p-4f, -0x1.20a3d6p-4f, -0x1.151ebap-4f,
    -0x1.09999ap-4f, -0x1.fc28f6p-5f, -0x1.e51ebap-5f, -0x1.ce147ap-5f,
    -0x1.b70a3ep-5f, -0x1.ap-5f, -0x1.88f5c2p-5f, -0x1.71eb86p-5f,
    -0x1.5ae146p-5f, -0x1.43d70ap-5f, -0x1.2ccccep-5f, -0x1.15c29p-5f,
    -0x1.fd70a4p-6f, -0x1.cf5c2ap-6f, -0x1.a147aep-6f, -0x1.733334p-6f,
    -0x1.451ebap-6f, -0x1.170a3ep-6f, -0x1.d1eb86p-7f, -0x1.75c29p-7f,
    -0x1.3e76c8p-7f, -0x1.2c083p-7f, -0x1.19999ap-7f, -0x1.072b02p-7f,
    -0x1.e978d4p-8f, -0x1.c49ba6p-8f, -0x1.9fbe76p-8f, -0x1.7ae148p-8f,
    -0x1.56041ap-8f, -0x1.3126e8p-8f, -0x1.0c49bap-8f, -0x1.ced914p-9f,
    -0x1.851eb8p-9f, -0x1.3b645ap-9f, -0x1.e353f8p-10f, -0x1.4fdf3ap-10f,
    -0x1.eecbfep-11f, -0x1.b3d07cp-11f, -0x1.78d5p-11f, -0x1.3dd982p-11f,
    -0x1.02de02p-11f, -0x1.8fc506p-12f, -0x1.19ce0ap-12f, -0x1.47ae16p-13f,
    -0x1.743e96p-14f, -0x1.15df66p-14f, -0x1.6f0068p-15f, -0x1.64840cp-16f,
    -0x1.040bfep-17f, -0x1.b43528p-19f, -0x1.27476ep-21f, 0.0f,
    0x1.27476ep-21f, 0x1.b43528p-19f, 0x1.040bfep-17f, 0x1.64840cp-16f,
    0x1.6f0068p-15f, 0x1.15df66p-14f, 0x1.743e96p-14f, 0x1.47ae16p-13f,
    0x1.19ce0ap-12f, 0x1.8fc506p-12f, 0x1.02de02p-11f, 0x1.3dd982p-11f,
    0x1.78d5p-11f, 0x1.b3d07cp-11f, 0x1.eecbfep-11f, 0x1.4fdf3ap-10f,
    0x1.e353f8p-10f, 0x1.3b645ap-9f, 0x1.851eb8p-9f, 0x1.ced914p-9f,
    0x1.0c49bap-8f, 0x1.3126e8p-8f, 0x1.56041ap-8f, 0x1.7ae148p-8f,
    0x1.9fbe76p-8f, 0x1.c49ba6p-8f, 0x1.e978d4p-8f, 0x1.072b02p-7f,
    0x1.19999ap-7f, 0x1.2c083p-7f, 0x1.3e76c8p-7f, 0x1.75c29p-7f,
    0x1.d1eb86p-7f, 0x1.170a3ep-6f, 0x1.451ebap-6f, 0x1.733334p-6f,
    0x1.a147aep-6f, 0x1.cf5c2ap-6f, 0x1.fd70a4p-6f, 0x1.15c29p-5f,
    0x1.2ccccep-5f, 0x1.43d70ap-5f, 0x1.5ae146p-5f, 0x1.71eb86p-5f,
    0x1.88f5c2p-5f, 0x1.ap-5f, 0x1.b70a3ep-5f, 0x1.ce147ap-5f,
    0x1.e51ebap-5f, 0x1.fc28f6p-5f, 0x1.09999ap-4f, 0x1.151ebap-4f,
    0x1.20a3d6p-4f, 0x1.2c28f6p-4f, 0x1.37ae14p-4f, 0x1.433334p-4f,
    0x1.4eb854p-4f, 0x1.5a3d7p-4f, 0x1.65c29p-4f, 0x1.7147aep-4f,
    0x1.7ccccep-4f, 0x1.8851eep-4f, 0x1.93d70ap-4f, 0x1.b66668p-4f,
    0x1.fp-4f, 0x1.14ccccp-3f, 0x1.31999ap-3f, 0x1.4e6666p-3f,
    0x1.6b3334p-3f, 0x1.88p-3f, 0x1.a4ccccp-3f, 0x1.c1999ap-3f,
    0x1.de6666p-3f, 0x1.fb3332p-3f, 0x1.0cp-2f, 0x1.1a6668p-2f,
    0x1.28ccccp-2f, 0x1.373334p-2f, 0x1.459998p-2f, 0x1.54p-2f,
    0x1.626666p-2f, 0x1.70ccccp-2f, 0x1.7f3334p-2f, 0x1.8d9998p-2f,
    0x1.9cp-2f, 0x1.aa6666p-2f, 0x1.b8ccccp-2f, 0x1.c73334p-2f,
    0x1.d59998p-2f, 0x1.e4p-2f, 0x1.f26664p-2f, 0x1.006666p-1f,
    0x1.079998p-1f, 0x1.0eccccp-1f, 0x1.16p-1f, 0x1.1d3334p-1f,
    0x1.246668p-1f, 0x1.2b999ap-1f, 0x1.32ccccp-1f, 0x1.3ap-1f,
    0x1.413334p-1f, 0x1.486668p-1f, 0x1.4f999ap-1f, 0x1.56ccccp-1f,
    0x1.5ep-1f, 0x1.653334p-1f, 0x1.6c6668p-1f, 0x1.73999ap-1f,
    0x1.7accccp-1f, 0x1.82p-1f, 0x1.893334p-1f, 0x1.906666p-1f,
    0x1.97999ap-1f, 0x1.9eccccp-1f, 0x1.a6p-1f, 0x1.ad3334p-1f,
    0x1.b46666p-1f, 0x1.bb999ap-1f, 0x1.c2ccccp-1f, 0x1.cap-1f,
    0x1.d13334p-1f, 0x1.d86666p-1f, 0x1.df999ap-1f, 0x1.e6ccccp-1f,
    0x1.eep-1f, 0x1.f53334p-1f, 0x1.fc6666p-1f, 0x1p+0f,
};

size_t nf4_code_bytes(size_t n) { return (n + 1) / 2; }
size_t nf4_blocks(size_t n) { return (n + NF4_BLOCK - 1) / NF4_BLOCK; }
size_t nf4_nested_blocks(size_t n) { return (nf4_blocks(n) + NF4_NESTED_BLOCK - 1) / NF4_NESTED_BLOCK; }

size_t nf4_bytes(size_t n)
{
    return nf4_code_bytes(n) + nf4_blocks(n) + sizeof(float) * (nf4_nested_blocks(n) + 1);
}

static float clamp1(float x) { return x < -1.0f ? -1.0f : (x > 1.0f ? 1.0f : x); }

/* The blocks are independent (a block of 64 fills 32 bytes of its own), so
 * they are shared among the OpenMP threads: a 13B model's projections are
 * 12.7e9 values. A scaled value's code is the number of the 15 midpoints
 * between neighbouring NF4 values that are below it (so a tie takes the
 * lower value, a NaN 0), counted over the block at once. */
void nf4_quantize_codes(const float *x, size_t n, uint8_t *codes, float *absmax)
{
    float mid[15];
    for (int i = 0; i < 15; i++) mid[i] = (nf4_quant_map[i] + nf4_quant_map[i + 1]) / 2.0f;
    long nb = (long)nf4_blocks(n);
#pragma omp parallel for schedule(static) if (nb > 4096)
    for (long b = 0; b < nb; b++) {
        size_t lo = (size_t)b * NF4_BLOCK, hi = lo + NF4_BLOCK < n ? lo + NF4_BLOCK : n;
        size_t len = hi - lo;
        float am = 0.0f, s[NF4_BLOCK];
        for (size_t i = lo; i < hi; i++) am = fmaxf(am, fabsf(x[i]));
        float den = fmaxf(am, 1e-38f);
        /* a full block is scaled by the reciprocal, the partial last block
         * divided, and only the latter's stored absmax is clamped */
        if (len == NF4_BLOCK) {
            float recip = 1.0f / den;
            absmax[b] = am;
            for (size_t i = 0; i < NF4_BLOCK; i++) s[i] = clamp1(x[lo + i] * recip);
        } else {
            absmax[b] = den;
            for (size_t i = 0; i < NF4_BLOCK; i++)
                s[i] = i < len ? clamp1(x[lo + i] / den) : 0.0f; /* an odd n pads with 0.0's code */
        }
        int32_t c[NF4_BLOCK] = {0};
        for (int m = 0; m < 15; m++)
            for (size_t i = 0; i < NF4_BLOCK; i++) c[i] += mid[m] < s[i];
        for (size_t i = 0; i < len; i += 2)
            codes[(lo + i) / 2] = (uint8_t)(c[i] << 4 | c[i + 1]);
    }
}

float nf4_absmax_offset(const float *absmax, size_t nblocks)
{
    double s = 0.0;
    for (size_t b = 0; b < nblocks; b++) s += absmax[b];
    return nblocks ? (float)(s / (double)nblocks) : 0.0f;
}

/* index of the map value nearest to x (map ascending; ties to the lower) */
static uint8_t nearest(const float *map, float x)
{
    int lo = 0, hi = 255;
    if (x <= map[0]) return 0;
    if (x >= map[255]) return 255;
    while (hi - lo > 1) { /* map[lo] <= x < map[hi] */
        int mid = (lo + hi) / 2;
        if (map[mid] <= x) lo = mid;
        else hi = mid;
    }
    return fabsf(x - map[hi]) < fabsf(x - map[lo]) ? (uint8_t)hi : (uint8_t)lo;
}

/* The nested blocks are independent: shared among the OpenMP threads (13B:
 * 2e8 block maxima, 5 s on one core). */
void nf4_quantize_absmax(const float *absmax, size_t nblocks, float offset, const float *map,
                         uint8_t *qabsmax, float *nested_absmax)
{
    long nn = (long)((nblocks + NF4_NESTED_BLOCK - 1) / NF4_NESTED_BLOCK);
#pragma omp parallel for schedule(static) if (nn > 64)
    for (long k = 0; k < nn; k++) {
        size_t lo = (size_t)k * NF4_NESTED_BLOCK;
        size_t hi = lo + NF4_NESTED_BLOCK < nblocks ? lo + NF4_NESTED_BLOCK : nblocks;
        float am = 0.0f;
        for (size_t i = lo; i < hi; i++) am = fmaxf(am, fabsf(absmax[i] - offset));
        nested_absmax[lo / NF4_NESTED_BLOCK] = am;
        for (size_t i = lo; i < hi; i++)
            qabsmax[i] = am > 0.0f ? nearest(map, (absmax[i] - offset) / am) : nearest(map, 0.0f);
    }
}

void nf4_dequantize_absmax(const uint8_t *qabsmax, const float *nested_absmax, const float *map,
                           float offset, size_t nblocks, float *absmax)
{
    for (size_t b = 0; b < nblocks; b++)
        absmax[b] = map[qabsmax[b]] * nested_absmax[b / NF4_NESTED_BLOCK] + offset;
}

void nf4_dequantize_codes(const uint8_t *codes, const float *absmax, const float *quant_map,
                          size_t n, float *out)
{
    for (size_t i = 0; i < n; i++) {
        uint8_t c = (i % 2) ? (codes[i / 2] & 0x0f) : (uint8_t)(codes[i / 2] >> 4);
        out[i] = quant_map[c] * absmax[i / NF4_BLOCK];
    }
}

void nf4_dequantize_range(const uint8_t *codes, const uint8_t *qabsmax,
                          const float *nested_absmax, const float *maps, float offset,
                          size_t lo, size_t hi, float *out)
{
    for (size_t i = lo; i < hi; i++) {
        size_t b = i / NF4_BLOCK;
        float am = maps[16 + qabsmax[b]] * nested_absmax[b / NF4_NESTED_BLOCK] + offset;
        uint8_t c = (i % 2) ? (codes[i / 2] & 0x0f) : (uint8_t)(codes[i / 2] >> 4);
        out[i - lo] = maps[c] * am;
    }
}
