/* GGUF's quantized block formats as llama.cpp writes them (ggml's block structs), read by
 * quant_linear.c (float activations, and the dequantizer) and quant_linear_int8.c (8-bit activations).
 *
 * A weight of n rows (output features) by k columns (input features) is n rows of bytes, each row
 * k / B blocks of the format's B elements, laid out as ggml's block structs (little-endian, no
 * padding; "half" is an IEEE float16):
 *
 *   type (ggml id)  B    bytes  block                                       element i
 *   Q4_0  (2)       32   18     half d; u8 qs[16]                           d * (nib(i) - 8)
 *   Q4_1  (3)       32   20     half d, m; u8 qs[16]                        d * nib(i) + m
 *   Q5_0  (6)       32   22     half d; u8 qh[4]; u8 qs[16]                 d * (nib(i) | hb(i) << 4) - 16 d
 *   Q5_1  (7)       32   24     half d, m; u8 qh[4]; u8 qs[16]              d * (nib(i) | hb(i) << 4) + m
 *   Q8_0  (8)       32   34     half d; i8 qs[32]                           d * qs[i]
 *   Q4_K  (12)      256  144    half d, dmin; u8 scales[12]; u8 qs[128]     per 32: d*sc * q - dmin*mn
 *   Q5_K  (13)      256  176    half d, dmin; u8 scales[12]; u8 qh[32];     per 32: d*sc * (q | hb << 4)
 *                                u8 qs[128]                                      - dmin*mn
 *   Q6_K  (14)      256  210    u8 ql[128]; u8 qh[64]; i8 scales[16]; half d  per 16: d*sc * (q6 - 32)
 *
 * In the 32-element formats nib(i) is the low nibble of qs[i] for i < 16 and the high nibble of
 * qs[i - 16] above; hb(i) is bit i of qh read as a little-endian uint32. In Q4_K and Q5_K each 64
 * elements read 32 bytes of qs (low nibbles the first 32 elements, high nibbles the next) and two of
 * the eight 6-bit (sc, mn) pairs packed in scales (get_scale_min below); Q5_K's fifth bits come from
 * qh, two bit positions per 64 elements. Q6_K's 128-element halves read 64 bytes of ql (low nibbles
 * elements 0-63, high nibbles 64-127) and 32 of qh (two bits per element, shifted 0, 2, 4, 6 for the
 * four quarters), with one int8 scale per 16 elements.
 */
#ifndef PAGELLM_QUANT_BLOCKS_H
#define PAGELLM_QUANT_BLOCKS_H

#include "cpu_kernels.h"

static inline f32x8 splat(float s) { return (f32x8){s, s, s, s, s, s, s, s}; }

static inline f32x8 fma8(f32x8 a, f32x8 b, f32x8 c) { /* a * b + c, rounded once, on every path */
#if defined(__FMA__)
    __m256 r;
    __m256 va, vb, vc;
    memcpy(&va, &a, 32), memcpy(&vb, &b, 32), memcpy(&vc, &c, 32);
    r = _mm256_fmadd_ps(va, vb, vc);
    f32x8 out;
    memcpy(&out, &r, 32);
    return out;
#else
    f32x8 out;
    for (int i = 0; i < 8; i++) out[i] = fmaf(a[i], b[i], c[i]);
    return out;
#endif
}

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
       GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };

static inline float half_to_float(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | p[1] << 8);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24 is exact in float32 */
        const float f = ldexpf((float)mantissa, -24);
        return sign ? -f : f;
    }
    bits = exponent == 31 ? sign | 0x7f800000u | mantissa << 13 : sign | (exponent + 112) << 23 | mantissa << 13;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline u8x16 bytes16(const uint8_t *p) {
    u8x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Q4_K/Q5_K's j-th (scale, min) pair of 6 bits each from the 12 packed bytes. */
static inline void get_scale_min(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static inline int block_elements(int type) {
    switch (type) {
    case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: case GGML_Q8_0: return 32;
    case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K: return 256;
    default: return 0;
    }
}

static inline int block_bytes(int type) {
    switch (type) {
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q5_0: return 22;
    case GGML_Q5_1: return 24;
    case GGML_Q8_0: return 34;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    default: return 0;
    }
}

#endif
