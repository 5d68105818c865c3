/* The vector path of decode attention (attention_decode.c): float32, bfloat16 and fp8 pools of
 * block_size 16 and head_dim 64 or 128. Key rows are widened to float32 in registers as they are used
 * (a bfloat16 is the top half of a float32; fp8 goes through float16); a block's value rows, read by
 * every query head of their KV head, are widened once into a buffer, and each query head's partial
 * outputs stay in vector registers across the block's 16 rows. The sums run in the same order as the
 * generic path (keys: over head_dim; values: over tokens), so both give the same bits. */

#ifndef PAGELLM_ATTENTION_VECTOR_H
#define PAGELLM_ATTENTION_VECTOR_H

#include "cpu_kernels.h"

/* e4m3 key rows come out of the vector loads divided by E4M3_UNIT (their float16 form, one multiply
 * fewer per element); the kernel multiplies the query scale by it instead, which gives the same scores:
 * scaling by a power of two is exact. */
#define E4M3_UNIT 256.0f

#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
/* AVX2: 16 lanes are two registers, and GCC keeps a 64-byte vector that it has to split in memory
 * (through general registers, at every step). So here the same sums, in the same order, run on 8-wide
 * halves held in named registers: the scores of up to 4 query heads (two halves each) over head_dim,
 * and a query head's outputs 64 dimensions at a time over the block's 16 tokens. */
static inline f32x8 f32x8_of(__m256 v) {
    f32x8 out;
    memcpy(&out, &v, sizeof out);
    return out;
}
static inline f32x8 load8_f32(const float *p) { return f32x8_of(_mm256_loadu_ps(p)); }
static inline f32x8 load8_bf16(const uint16_t *p) {
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    return f32x8_of(_mm256_castsi256_ps(w));
}
static inline f32x8 load8_fp8(const uint8_t *p, int dtype) {
    return f32x8_of(_mm256_cvtph_ps(fp8_halves8(p, dtype))); /* (e4m3: the value / E4M3_UNIT) */
}
#define LOAD8_f32(p) load8_f32(p)
#define LOAD8_bf16(p) load8_bf16(p)
#define LOAD8_e4m3(p) load8_fp8((p), PAGELLM_FP8_E4M3)
#define LOAD8_e5m2(p) load8_fp8((p), PAGELLM_FP8_E5M2)

#define DEFINE_VECTOR_SCORES(NAME, TYPE)                                                                 \
    static inline __attribute__((always_inline)) void score16_##NAME(const TYPE *keys, const float *q, int hd, \
                                                                    int ng, float *scores, int64_t stride) { \
        f32x8 a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0}, a2 = {0}, b2 = {0}, a3 = {0}, b3 = {0};             \
        for (int d = 0; d < hd; d++) {                                                                   \
            const f32x8 lo = LOAD8_##NAME(keys + d * 16), hi = LOAD8_##NAME(keys + d * 16 + 8);          \
            a0 += q[d] * lo, b0 += q[d] * hi;                                                            \
            if (ng > 1) a1 += q[hd + d] * lo, b1 += q[hd + d] * hi;                                      \
            if (ng > 2) a2 += q[2 * hd + d] * lo, b2 += q[2 * hd + d] * hi;                              \
            if (ng > 3) a3 += q[3 * hd + d] * lo, b3 += q[3 * hd + d] * hi;                              \
        }                                                                                                \
        const f32x8 rows[8] = {a0, b0, a1, b1, a2, b2, a3, b3};                                          \
        for (int g = 0; g < ng; g++) {                                                                   \
            memcpy(scores + g * stride, &rows[2 * g], sizeof rows[0]);                                   \
            memcpy(scores + g * stride + 8, &rows[2 * g + 1], sizeof rows[0]);                           \
        }                                                                                                \
    }
/* Value rows are float32 here: weigh_block_vector widens other pools' rows first. */
static inline __attribute__((always_inline)) void weigh16_f32(const float *values, int64_t row_stride, const float *p,
                                                              int64_t stride, int hd, int ng, float *acc) {
    for (int g = 0; g < ng; g++) {
        for (int c = 0; c < hd; c += 64) {
            float *o = acc + g * hd + c;
            f32x8 o0 = load8_f32(o), o1 = load8_f32(o + 8), o2 = load8_f32(o + 16), o3 = load8_f32(o + 24);
            f32x8 o4 = load8_f32(o + 32), o5 = load8_f32(o + 40), o6 = load8_f32(o + 48), o7 = load8_f32(o + 56);
            for (int t = 0; t < 16; t++) {
                const float *v = values + t * row_stride + c;
                const float w = p[g * stride + t];
                o0 += w * load8_f32(v), o1 += w * load8_f32(v + 8), o2 += w * load8_f32(v + 16);
                o3 += w * load8_f32(v + 24), o4 += w * load8_f32(v + 32), o5 += w * load8_f32(v + 40);
                o6 += w * load8_f32(v + 48), o7 += w * load8_f32(v + 56);
            }
            const f32x8 rows[8] = {o0, o1, o2, o3, o4, o5, o6, o7};
            memcpy(o, rows, sizeof rows);
        }
    }
}
#else
/* 16 lanes in one vector (AVX-512 registers, or whatever the compiler makes of them elsewhere). */
/* bfloat16 rows as float32 vectors:
 * a bfloat16 is the top half of a float32, so 16 convert in registers as they are used. */
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline f32x16 bf16x16(const uint16_t *p) {
    u16x16 raw;
    memcpy(&raw, p, sizeof raw);
    return (f32x16)(__builtin_convertvector(raw, u32x16) << 16);
}

/* fp8 rows as float32 vectors (the fp8 vector path of decode attention): 16 widened in registers as
 * they are used, through float16 as fp8_to_floats does. */
static inline f32x16 fp8x16(const uint8_t *p, int dtype) {
    f32x16 out;
#if defined(__AVX2__) && defined(__F16C__)
    const __m256 lo = _mm256_cvtph_ps(fp8_halves8(p, dtype)), hi = _mm256_cvtph_ps(fp8_halves8(p + 8, dtype));
    memcpy(&out, &lo, sizeof lo);
    memcpy((char *)&out + sizeof lo, &hi, sizeof hi);
#else
    for (int i = 0; i < 16; i++) out[i] = fp8_to_float(p[i], dtype) / (dtype == PAGELLM_FP8_E4M3 ? E4M3_UNIT : 1.0f);
#endif
    return out;
}

static inline f32x16 f32x16_load(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}
#define LOAD16_f32(p) f32x16_load(p)
#define LOAD16_bf16(p) bf16x16(p)
#define LOAD16_e4m3(p) fp8x16((p), PAGELLM_FP8_E4M3)
#define LOAD16_e5m2(p) fp8x16((p), PAGELLM_FP8_E5M2)

/* Decode attention's vector kernels over one block of 16 tokens.
 *   score16_NAME: scores[g * stride + t] = sum_d q[g][d] * keys[d][t] for NG query heads over one
 *                 block of transposed keys ([HD][16]), their rows widened by LOAD16_NAME;
 *   weigh16_f32:  acc[g][:] += sum_t p[g * stride + t] * values[t * row_stride + :] for NG query heads
 *                 over one block of 16 float32 value rows (HD wide); acc: NG rows of HD floats. */
#define DEFINE_VECTOR_SCORES(NAME, TYPE)                                                                 \
    static inline __attribute__((always_inline)) void score16_##NAME(const TYPE *keys, const float *q, int hd, \
                                                                    int ng, float *scores, int64_t stride) { \
        f32x16 acc[4] = {{0}};                                                                           \
        for (int d = 0; d < hd; d++) {                                                                   \
            const f32x16 row = LOAD16_##NAME(keys + d * 16);                                             \
            for (int g = 0; g < ng; g++) acc[g] += q[g * hd + d] * row;                                  \
        }                                                                                                \
        for (int g = 0; g < ng; g++) memcpy(scores + g * stride, &acc[g], sizeof acc[g]);                \
    }

static inline __attribute__((always_inline)) void weigh16_f32(const float *values, int64_t row_stride, const float *p,
                                                              int64_t stride, int hd, int ng, float *acc) {
    f32x16 o[4][8];
    for (int g = 0; g < ng; g++) memcpy(o[g], acc + g * hd, hd * sizeof(float));
    for (int t = 0; t < 16; t++) {
        for (int c = 0; c < hd / 16; c++) {
            const f32x16 v = f32x16_load(values + t * row_stride + c * 16);
            for (int g = 0; g < ng; g++) o[g][c] += p[g * stride + t] * v;
        }
    }
    for (int g = 0; g < ng; g++) memcpy(acc + g * hd, o[g], hd * sizeof(float));
}

#endif

DEFINE_VECTOR_SCORES(f32, float)
DEFINE_VECTOR_SCORES(bf16, uint16_t)
DEFINE_VECTOR_SCORES(e4m3, uint8_t)
DEFINE_VECTOR_SCORES(e5m2, uint8_t)

/* Chunks of 4 query heads for the scores; for the outputs 4 at head_dim 64 (16 vectors), 2 at 128. */
#define DEFINE_SCORE_BLOCK(NAME, TYPE, HD)                                                               \
    static void score_block_##NAME##_##HD(const TYPE *keys, const float *q, int64_t groups, float *scores, \
                                          int64_t stride) {                                              \
        const int hd = HD;                                                                               \
        FOR_HEAD_CHUNKS(groups, 4, SCORE_##NAME)                                                         \
    }
#define DEFINE_WEIGH_BLOCK(HD, CHUNK)                                                                    \
    static void weigh_block_##HD(const float *values, const float *p, int64_t stride, int64_t groups,    \
                                 float *acc) {                                                           \
        const int hd = HD;                                                                               \
        const int64_t row_stride = HD;                                                                   \
        FOR_HEAD_CHUNKS(groups, CHUNK, WEIGH)                                                            \
    }
#define SCORE_f32(n) score16_f32(keys, q + g * hd, hd, n, scores + g * stride, stride)
#define SCORE_bf16(n) score16_bf16(keys, q + g * hd, hd, n, scores + g * stride, stride)
#define SCORE_e4m3(n) score16_e4m3(keys, q + g * hd, hd, n, scores + g * stride, stride)
#define SCORE_e5m2(n) score16_e5m2(keys, q + g * hd, hd, n, scores + g * stride, stride)
#define WEIGH(n) weigh16_f32(values, row_stride, p + g * stride, stride, hd, n, acc + g * hd)
DEFINE_SCORE_BLOCK(f32, float, 64)
DEFINE_SCORE_BLOCK(f32, float, 128)
DEFINE_SCORE_BLOCK(bf16, uint16_t, 64)
DEFINE_SCORE_BLOCK(bf16, uint16_t, 128)
DEFINE_SCORE_BLOCK(e4m3, uint8_t, 64)
DEFINE_SCORE_BLOCK(e4m3, uint8_t, 128)
DEFINE_SCORE_BLOCK(e5m2, uint8_t, 64)
DEFINE_SCORE_BLOCK(e5m2, uint8_t, 128)
DEFINE_WEIGH_BLOCK(64, 4)
DEFINE_WEIGH_BLOCK(128, 2)

/* One (block, KV head) on the vector path for the pools' type and head_dim (64, 128):
 * its scores from the keys at element offset `at` of the key pool, or its values' weighted sum (acc). */
static void score_block_vector(int kv_dtype, int64_t head_dim, const void *pool, int64_t at, const float *q,
                               int64_t groups, float *scores, int64_t stride) {
    const uint8_t *bytes = (const uint8_t *)pool + at;
    if (kv_dtype == PAGELLM_F32) {
        const float *keys = (const float *)pool + at;
        if (head_dim == 64) score_block_f32_64(keys, q, groups, scores, stride);
        else score_block_f32_128(keys, q, groups, scores, stride);
    } else if (kv_dtype == PAGELLM_BF16) {
        const uint16_t *keys = (const uint16_t *)pool + at;
        if (head_dim == 64) score_block_bf16_64(keys, q, groups, scores, stride);
        else score_block_bf16_128(keys, q, groups, scores, stride);
    } else if (kv_dtype == PAGELLM_FP8_E4M3) {
        if (head_dim == 64) score_block_e4m3_64(bytes, q, groups, scores, stride);
        else score_block_e4m3_128(bytes, q, groups, scores, stride);
    } else {
        if (head_dim == 64) score_block_e5m2_64(bytes, q, groups, scores, stride);
        else score_block_e5m2_128(bytes, q, groups, scores, stride);
    }
}

static void weigh_block_vector(int kv_dtype, int64_t head_dim, const void *pool, int64_t at, const float *p,
                               int64_t stride, int64_t groups, float *acc) {
    float rows[16 * 128]; /* the block's value rows widened, exactly (load_floats), once for all its query heads */
    const float *values = (const float *)pool + at;
    if (kv_dtype != PAGELLM_F32) {
        load_floats(pool, at, 16 * head_dim, kv_dtype, rows);
        values = rows;
    }
    if (head_dim == 64) weigh_block_64(values, p, stride, groups, acc);
    else weigh_block_128(values, p, stride, groups, acc);
}

#endif /* PAGELLM_ATTENTION_VECTOR_H */
