/* kernels/nf4.h — NF4 (4-bit NormalFloat) weights with double quantization,
 * in bitsandbytes' layout and with its values (QLoRA).
 *
 * Owns: the NF4 and 8-bit dynamic value tables, quantization of an F32
 * matrix to NF4 on the host, and dequantization on the host (the CPU
 * backend's dequant_nf4 op and the merged export use it). Host memory only;
 * knows nothing of models or files.
 *
 * Layout (bitsandbytes' quantize_4bit with blocksize 64, quant_type nf4,
 * compress_statistics true, as QuantState.as_dict names the parts):
 *  - codes: n elements, row-major, element 2i in the high nibble of byte i,
 *    element 2i+1 in the low nibble; an odd n pads the last low nibble with
 *    the code of 0.0 (7). (n+1)/2 bytes ("weight").
 *  - absmax: the largest |x| of each block of 64 elements (the last block
 *    may be shorter), stored doubly quantized: offset = the mean of the
 *    absmax values ("nested_offset"), then absmax - offset quantized to 8
 *    bits ("absmax", one byte per block) in blocks of 256 with its own F32
 *    absmax per block of 256 ("nested_absmax") on the signed dynamic map
 *    ("nested_quant_map", 256 values).
 *  - element i = quant_map[code_i] * absmax[i / 64] (F32), where
 *    absmax[b] = nested_quant_map[qabsmax_b] * nested_absmax[b / 256] + offset.
 *
 * Rounding as bitsandbytes' CPU path: a full block's values are scaled by
 * the F32 reciprocal of its absmax, a trailing partial block's divided by
 * it; the scaled value takes the nearest NF4 value (ties to the lower one);
 * absmax - offset is divided by its block's nested absmax and takes the
 * nearest dynamic-map value (ties to the lower). Two differences from
 * bitsandbytes, both in the statistics only: the offset is the correctly
 * rounded mean (summed in double), bitsandbytes' float32 mean (torch's
 * vectorised sum) can differ in the last bit; and bitsandbytes' CPU search
 * for the 8-bit code now and then keeps the code below the nearest one.
 * Dequantizing bitsandbytes' stored state is bit-identical
 * (tests/test_nf4.c states the bounds). */
#ifndef SPOTUNE_NF4_H
#define SPOTUNE_NF4_H

#include <stddef.h>
#include <stdint.h>

#define NF4_BLOCK 64
#define NF4_NESTED_BLOCK 256

/* bitsandbytes' NF4 values (quant_map), ascending */
extern const float nf4_quant_map[16];
/* bitsandbytes' create_dynamic_map() (signed, 8 bits): nested_quant_map */
extern const float nf4_dynamic_map[256];

size_t nf4_code_bytes(size_t n);    /* (n + 1) / 2 */
size_t nf4_blocks(size_t n);        /* ceil(n / 64) */
size_t nf4_nested_blocks(size_t n); /* ceil(nf4_blocks(n) / 256) */
/* Bytes of one quantized matrix of n elements: codes, 8-bit absmax, nested
 * absmax (F32) and the offset (F32). */
size_t nf4_bytes(size_t n);

/* First stage: codes [(n+1)/2] and absmax [nf4_blocks(n)] of x [n]. */
void nf4_quantize_codes(const float *x, size_t n, uint8_t *codes, float *absmax);
/* The offset: the mean of absmax [nblocks], summed in double, rounded once. */
float nf4_absmax_offset(const float *absmax, size_t nblocks);
/* Second stage: qabsmax [nblocks] and nested_absmax [ceil(nblocks/256)] of
 * absmax - offset on map (256 values, ascending). */
void nf4_quantize_absmax(const float *absmax, size_t nblocks, float offset, const float *map,
                         uint8_t *qabsmax, float *nested_absmax);
/* absmax [nblocks] = map[qabsmax] * nested_absmax[b / 256] + offset */
void nf4_dequantize_absmax(const uint8_t *qabsmax, const float *nested_absmax, const float *map,
                           float offset, size_t nblocks, float *absmax);
/* out [n] = quant_map[code] * absmax[i / 64] */
void nf4_dequantize_codes(const uint8_t *codes, const float *absmax, const float *quant_map,
                          size_t n, float *out);
/* Elements [lo, hi) of a doubly quantized matrix into out [hi - lo]
 * (maps: quant_map then nested map, 16 + 256 values). */
void nf4_dequantize_range(const uint8_t *codes, const uint8_t *qabsmax,
                          const float *nested_absmax, const float *maps, float offset,
                          size_t lo, size_t hi, float *out);

#endif
