/* pagellm's native CPU kernels: what every file here shares (includes, element types, the bfloat16 and
 * vector helpers, grouped per instruction set, and the exported functions' prototypes). One file per
 * op, as vLLM's csrc/cpu/:
 *
 *   attention_decode.c   paged decode attention (its portable, vector (attention_vector.h) and
 *                        dot-product paths, and the cascade over blocks shared by several decodes)
 *   attention_prefill.c  paged prefill attention (flash-style tiles)
 *   cache.c              the writes of new tokens' K/V into the pools
 *   layernorm.c          RMSNorm (with the residual addition)
 *   activation.c         silu(gate) * up
 *   pos_encoding.c       the rotary embedding
 *   sampler.c            the sampler's argmax + logsumexp
 *   gemm.c               the bfloat16 linear layers (AVX512-BF16)
 *   quant_linear.c       linear layers on GGUF's quantized block formats (Q4_0 ... Q6_K), and their
 *                        dequantizer (the formats: quant_blocks.h)
 *   quant_linear_int8.c  the same with the input rows quantized to 8 bits (integer dot products)
 *   decode_layer.c       a decode step's decoder layers in one call
 *
 * Pools (one layer), as laid out by pagellm/worker/cache_engine.py:
 *   keys   [num_blocks, num_kv_heads, head_dim, block_size]  (transposed per block)
 *   values [num_blocks, num_kv_heads, block_size, head_dim]
 * Elements are float32, bfloat16 (raw uint16 bits) or fp8 (raw bytes, the pools only); all arithmetic is
 * float32.
 *
 * Built at run time by pagellm/kernels/build.py, every .c file here into one library (cc -O3
 * -march=native -fopenmp); the OpenMP runtime is the one PyTorch already loaded (same soname), so both
 * share one thread pool. Helpers used by several files are static inline here, so that each file's
 * code is what it was when all of them were one file (cpu_kernels.c).
 */
#ifndef PAGELLM_CPU_KERNELS_H
#define PAGELLM_CPU_KERNELS_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* The instruction-set paths: which ones a build holds is what the compiler targets (-march=native).
 * PAGELLM_DOT_PRODUCTS: AVX512-BF16's bfloat16 dot products (with AVX512BW), used by both attention
 * kernels and the linear kernel; without them the portable paths (GCC vector extensions) serve. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGELLM_DOT_PRODUCTS 1
#include <immintrin.h>
#else
#define PAGELLM_DOT_PRODUCTS 0
#endif

/* ---- Element types and scalar helpers (every instruction set). */

/* Element types: of q, out and the pools; the fp8 ones only of the pools (--kv-cache-dtype fp8,
 * fp8_e5m2), whose kernels take the pools' type beside the queries'. */
enum { PAGELLM_F32 = 0, PAGELLM_BF16 = 1, PAGELLM_FP8_E4M3 = 2, PAGELLM_FP8_E5M2 = 3 };

static inline int64_t element_bytes(int dtype) { return dtype == PAGELLM_F32 ? 4 : dtype == PAGELLM_BF16 ? 2 : 1; }

/* ---- fp8 (the OCP formats PyTorch calls float8_e4m3fn and float8_e5m2). Reading widens through
 * float16, which holds both exactly: e5m2 is float16's top byte, and e4m3's 4 + 3 bits placed in
 * float16's exponent and mantissa give the value / 256 (subnormals included). Writing rounds to
 * nearest even and saturates at the format's largest finite value (448, 57344), as PyTorch's
 * conversion after a clamp; NaN stays NaN. */

static inline uint16_t fp8_as_half_bits(uint8_t x, int dtype) {
    if (dtype == PAGELLM_FP8_E5M2) return (uint16_t)(x << 8);
    if ((x & 0x7fu) == 0x7fu) return (uint16_t)((x & 0x80u) << 8 | 0x7e00u); /* e4m3's only NaN: NaN */
    return (uint16_t)((x & 0x80u) << 8 | (x & 0x7fu) << 7);
}

#if defined(__AVX2__) && defined(__F16C__)
/* 8 fp8 values as float16 bits in registers, as fp8_as_half_bits (e4m3: the value / 256). */
static inline __m128i fp8_halves8(const uint8_t *p, int dtype) {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    if (dtype == PAGELLM_FP8_E5M2) return _mm_slli_epi16(x, 8);
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8);
    const __m128i magnitude = _mm_and_si128(x, _mm_set1_epi16(0x7f));
    const __m128i nan = _mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7f));
    return _mm_or_si128(sign, _mm_blendv_epi8(_mm_slli_epi16(magnitude, 7), _mm_set1_epi16(0x7e00), nan));
}
#endif

static inline float fp8_to_float(uint8_t x, int dtype) {
    const uint16_t h = fp8_as_half_bits(x, dtype);
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    float f;
    if (exponent == 0) {
        f = ldexpf((float)mantissa, -24);
    } else {
        const uint32_t bits = exponent == 31 ? 0x7f800000u | mantissa << 13 : (exponent + 112) << 23 | mantissa << 13;
        memcpy(&f, &bits, sizeof f);
    }
    f = sign ? -f : f;
    return dtype == PAGELLM_FP8_E5M2 ? f : f * 256.0f;
}

static inline uint8_t float_to_fp8(float f, int dtype) {
    const int man = dtype == PAGELLM_FP8_E5M2 ? 2 : 3, bias = dtype == PAGELLM_FP8_E5M2 ? 15 : 7;
    const float largest = dtype == PAGELLM_FP8_E5M2 ? 57344.0f : 448.0f;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint8_t sign = (uint8_t)(bits >> 24 & 0x80u);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return sign | 0x7f; /* NaN (in both formats) */
    float a = fabsf(f);
    if (a > largest) a = largest;
    const float min_normal = ldexpf(1.0f, 1 - bias);
    if (a < min_normal) { /* subnormal steps of 2^(1 - bias - man): the count is the code (8 or 4 = min_normal) */
        return sign | (uint8_t)lrintf(ldexpf(a, bias - 1 + man));
    }
    memcpy(&bits, &a, sizeof bits);
    const int drop = 23 - man; /* mantissa bits rounded away, to nearest even */
    bits += (1u << (drop - 1)) - 1u + ((bits >> drop) & 1u);
    const int exponent = (int)(bits >> 23) - 127 + bias;
    return sign | (uint8_t)(exponent << man | (int)((bits >> drop) & ((1u << man) - 1u)));
}

/* n fp8 values from src as float32: 16 at a time through F16C's conversion where the CPU has it. */
static inline void fp8_to_floats(const uint8_t *src, int64_t n, int dtype, float *dst) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    const __m256 unit = _mm256_set1_ps(dtype == PAGELLM_FP8_E5M2 ? 1.0f : 256.0f);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(fp8_halves8(src + i, dtype)), unit));
#endif
    for (; i < n; i++) dst[i] = fp8_to_float(src[i], dtype);
}

/* Output modes of pagellm_linear_bf16. */
enum { LINEAR_BF16 = 0, LINEAR_F32 = 1, LINEAR_SILU_GATED = 2 };

/* dst[0:n] = float32 of base[offset : offset + n] (element offsets). bfloat16 is the top half of a
 * float32, so it converts by shifting its bits up (the files are built with -fno-strict-aliasing). */
static inline void load_floats(const void *base, int64_t offset, int64_t n, int dtype, float *dst) {
    if (dtype == PAGELLM_F32) {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    } else if (dtype != PAGELLM_BF16) {
        fp8_to_floats((const uint8_t *)base + offset, n, dtype, dst);
    } else {
        const uint16_t *src = (const uint16_t *)base + offset;
        uint32_t *bits = (uint32_t *)dst;
        for (int64_t i = 0; i < n; i++) bits[i] = (uint32_t)src[i] << 16;
    }
}

static inline void store_floats(void *base, int64_t offset, int64_t n, int dtype, const float *src) {
    if (dtype == PAGELLM_F32) {
        memcpy((float *)base + offset, src, (size_t)n * sizeof(float));
        return;
    }
    if (dtype != PAGELLM_BF16) {
        for (int64_t i = 0; i < n; i++) ((uint8_t *)base)[offset + i] = float_to_fp8(src[i], dtype);
        return;
    }
    uint16_t *dst = (uint16_t *)base + offset;
    const uint32_t *bits = (const uint32_t *)src;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t u = bits[i];
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            dst[i] = (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
        } else {
            dst[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); /* round to nearest even */
        }
    }
}

/* exp(x) to about 1 ulp, with x clamped to [-87, 88] (2^k stays a normal float; exp(-87) is 0 next
 * to any value that matters here), in plain arithmetic so that the loops calling it vectorise (libm's
 * expf is one call per element). 2^k * exp(r), |r| <= ln(2) / 2. */
static inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float k = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round(x / ln 2): 1.5 * 2^23 trick */
    const float r = (x - k * 0.693359375f) + k * 2.12194440e-4f;   /* x - k ln 2 in two parts */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* The element-wise layers (layernorm.c, activation.c, pos_encoding.c) follow PyTorch's own sequence
 * of operations, including bfloat16's rounding after every operation that PyTorch stores in bfloat16. */

/* Round a float32 to the nearest bfloat16, returned as float32. */
static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) <= 0x7f800000u) u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float as_stored(float f, int dtype) { return dtype == PAGELLM_BF16 ? round_bf16(f) : f; }

/* ---- Portable vectors (GCC vector extensions: whatever -march gives, AVX2 or AVX-512 registers). */

typedef float f32x8 __attribute__((vector_size(32)));

/* The sum of 8 lanes, in a fixed order. */
static inline float hsum8(f32x8 v) {
    typedef float f32x4 __attribute__((vector_size(16)));
    f32x4 a, b;
    memcpy(&a, &v, sizeof a);
    memcpy(&b, (const char *)&v + sizeof a, sizeof b);
    a += b;
    return (a[0] + a[2]) + (a[1] + a[3]);
}

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

/* CALL(n) for n (1 to MAX, MAX 2 or 4) with n a constant in each call: the inlined kernel then keeps
 * its n rows' sums in vector registers. */
#define WITH_CONSTANT_ROWS(n, MAX, CALL)                                                                 \
    switch (n) {                                                                                         \
    case 1: CALL(1); break;                                                                              \
    case 2: CALL(2); break;                                                                              \
    case 3: CALL(3); break;                                                                              \
    default: CALL(MAX); break;                                                                           \
    }

/* Runs CALL(n) for each chunk of n <= CHUNK query heads of a KV head, starting at head g (in scope
 * in CALL). */
#define FOR_HEAD_CHUNKS(groups, CHUNK, CALL)                                                             \
    for (int64_t g = 0; g < (groups); g += (CHUNK)) {                                                    \
        WITH_CONSTANT_ROWS((groups) - g < (CHUNK) ? (groups) - g : (CHUNK), CHUNK, CALL)                  \
    }

/* ---- AVX512-BF16: the dot-product paths' helpers (attention_decode.c, attention_prefill.c, gemm.c). */
#if PAGELLM_DOT_PRODUCTS /* (to the matching #endif) */
/* Whether attention uses the dot products: defined in attention_decode.c, set by
 * pagellm_bf16_dot_products (hidden: not part of the library's interface). */
extern int use_dot_products __attribute__((visibility("hidden")));

/* fast_exp on 16 lanes (the same steps). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), _mm512_min_ps(x, _mm512_set1_ps(88.0f)));
    const __m512 shift = _mm512_set1_ps(12582912.0f);
    const __m512 k = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), shift), shift);
    const __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* 16 pairs (K[d][t], K[d + 1][t]) from the 32 words of rows d and d + 1 of a transposed key block. */
static inline __m512i pair_key_rows(__m512i rows) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, rows);
}

/* scores[g * stride + t] = scale * sum_d q[g][d] keys[d][t]; q: NG rows of HD bfloat16, read as pairs. */
static inline __attribute__((always_inline)) void score16_dot(const uint16_t *keys, const uint32_t *q, int hd,
                                                              int ng, float scale, float *scores, int64_t stride) {
    __m512 acc[4];
    for (int g = 0; g < ng; g++) acc[g] = _mm512_setzero_ps();
    for (int i = 0; i < hd / 2; i++) {
        const __m512bh k = (__m512bh)pair_key_rows(_mm512_loadu_si512(keys + 32 * i));
        for (int g = 0; g < ng; g++)
            acc[g] = _mm512_dpbf16_ps(acc[g], k, (__m512bh)_mm512_set1_epi32((int)q[g * hd / 2 + i]));
    }
    for (int g = 0; g < ng; g++) _mm512_storeu_ps(scores + g * stride, _mm512_mul_ps(acc[g], _mm512_set1_ps(scale)));
}

/* acc[g] += sum_t p[g][t] values[t] over one block of 16 value rows; p: per query head, 8 pairs of
 * bfloat16 probabilities (p_stride pairs apart); acc: per query head (acc_stride floats apart), HD / 32
 * chunks of [lo 16 | hi 16] in unpack order. */
static inline __attribute__((always_inline)) void weigh16_dot(const uint16_t *values, int64_t row_stride,
                                                              const uint32_t *p, int64_t p_stride, int hd, int ng,
                                                              float *acc, int64_t acc_stride) {
    __m512 lo[4][4], hi[4][4];
    for (int g = 0; g < ng; g++)
        for (int c = 0; c < hd / 32; c++) {
            lo[g][c] = _mm512_loadu_ps(acc + g * acc_stride + c * 32);
            hi[g][c] = _mm512_loadu_ps(acc + g * acc_stride + c * 32 + 16);
        }
    for (int m = 0; m < 8; m++) {
        for (int c = 0; c < hd / 32; c++) {
            const __m512i a = _mm512_loadu_si512(values + 2 * m * row_stride + 32 * c);
            const __m512i b = _mm512_loadu_si512(values + (2 * m + 1) * row_stride + 32 * c);
            const __m512bh pairs_lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
            const __m512bh pairs_hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int g = 0; g < ng; g++) {
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)p[g * p_stride + m]);
                lo[g][c] = _mm512_dpbf16_ps(lo[g][c], pairs_lo, w);
                hi[g][c] = _mm512_dpbf16_ps(hi[g][c], pairs_hi, w);
            }
        }
    }
    for (int g = 0; g < ng; g++)
        for (int c = 0; c < hd / 32; c++) {
            _mm512_storeu_ps(acc + g * acc_stride + c * 32, lo[g][c]);
            _mm512_storeu_ps(acc + g * acc_stride + c * 32 + 16, hi[g][c]);
        }
}
#endif /* PAGELLM_DOT_PRODUCTS */

/* ---- The library's functions (called through ctypes by pagellm/kernels/native.py). */

/* attention_decode.c */
int pagellm_bf16_dot_products(int enable);
int64_t pagellm_scratch_floats(int64_t num_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks);
void pagellm_paged_decode_attention(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool,
                                    const int64_t *tables, const int64_t *lens, void *out, int64_t num_seqs,
                                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                    int64_t max_blocks, int64_t window, float scale, int dtype, int kv_dtype,
                                    int num_threads,
                                    float *scratch, const int64_t *cascade, int64_t num_cascade);
/* attention_prefill.c */
int64_t pagellm_prefill_scratch_floats(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);
int pagellm_paged_prefill_attention(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool,
                                    const int64_t *table, void *out, int64_t q_len, int64_t cached,
                                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                    int64_t block_size, int64_t window, float scale, int dtype, int kv_dtype,
                                    int num_threads,
                                    float *scratch);
/* cache.c */
void pagellm_write_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, const int64_t *slots,
                      int64_t tokens, void *k_pool, void *v_pool, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t elem, int num_threads);
int pagellm_write_kv_converted(const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                               const int64_t *slots, int64_t tokens, void *k_pool, void *v_pool,
                               int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int dtype, int kv_dtype,
                               int num_threads);
/* sampler.c */
void pagellm_argmax_logsumexp(const float *logits, int64_t rows, int64_t vocab, int64_t *argmax, float *lse,
                              int num_threads);
/* layernorm.c, activation.c, pos_encoding.c */
void pagellm_rms_norm(const void *x, const void *add, void *sum, const void *weight, void *out, int64_t rows,
                      int64_t hidden, float eps, int dtype, int num_threads);
void pagellm_silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int dtype, int num_threads);
void pagellm_rotary(void *qk, int64_t tokens, int64_t row_stride, int64_t heads, int64_t head_dim,
                    const int64_t *positions, const float *cos_table, const float *sin_table, int dtype,
                    int num_threads);
/* gemm.c */
int pagellm_linear_bf16_supported(void);
int64_t pagellm_linear_packed_words(int64_t n, int64_t k, int gated);
void pagellm_pack_linear_weight(const uint16_t *w, int64_t n, int64_t k, int gated, uint32_t *out,
                                int num_threads);
int pagellm_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint32_t *w, int64_t n,
                        const float *bias, void *y, int mode, int num_threads);
/* quant_linear.c */
int64_t pagellm_quant_row_bytes(int type, int64_t k);
int pagellm_quant_linear(const void *x, int64_t x_stride, int x_dtype, int64_t m, int64_t k, const uint8_t *w,
                         int type, int64_t n, const float *bias, void *y, int64_t y_stride, int y_dtype,
                         int num_threads);
int pagellm_dequantize(const uint8_t *w, int type, int64_t n, int64_t k, float *out, int num_threads);
/* quant_linear_int8.c */
int pagellm_quant_linear_int8(const void *x, int64_t x_stride, int x_dtype, int64_t m, int64_t k, const uint8_t *w,
                              int type, int64_t n, const float *bias, void *y, int64_t y_stride, int y_dtype,
                              int num_threads);

#endif /* PAGELLM_CPU_KERNELS_H */
