/* tests/cuda_emu/emu_bf16.h — bf16 <-> fp32 for the emulated libraries
 * (emu_cublas.cc, emu_nccl.c): widening exactly, narrowing rounded to
 * nearest even, NaN kept NaN. Their own copy, not the backend's
 * (kernels/cuda/cuda_device.h), so the emulation does not lean on the code
 * it checks. C and C++. */
#ifndef SPOTUNE_EMU_BF16_H
#define SPOTUNE_EMU_BF16_H

#include <stdint.h>
#include <string.h>

static inline float emu_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t emu_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#endif
