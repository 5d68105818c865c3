/* pagellm's native CPU kernels: paged decode attention, the sampler's argmax + logsumexp, the
 * element-wise layers RMSNorm and rotary embedding in one pass each, and bfloat16 linear layers (at
 * the end of the file).
 *
 * Paged decode attention: one query token per sequence, K and V read in place from the pools; paged
 * prefill attention (flash-style tiles); the writes of new tokens' K/V into the pools. On CPUs with
 * AVX512-BF16 both attention kernels use its bfloat16 dot products; a portable path (GCC vector
 * extensions) serves other CPUs.
 *
 * Pools (one layer), as laid out by pagellm/worker/cache_engine.py:
 *   keys   [num_blocks, num_kv_heads, head_dim, block_size]  (transposed per block)
 *   values [num_blocks, num_kv_heads, block_size, head_dim]
 * Elements are float32 or bfloat16 (raw uint16 bits); all arithmetic is float32.
 *
 * One work item is one sequence (or, with few sequences, one KV head of one), and it reads exactly its
 * own blocks (the PyTorch fallback pads every sequence of a group to the longest). A block's K (or V)
 * is one contiguous run, each KV head's part of it too (so a head's keys or values are read from start
 * to end). The blocks themselves lie anywhere in the pool, so the hardware cannot guess the next one:
 * while a block is used, the next block of the table is prefetched line by line, unless it is the
 * next one in memory too (see next_block). The scores of one (block,
 * KV head) are block_size-wide FMAs over the head_dim rows of its transposed keys; each value row is
 * read once for every query head that shares it (grouped-query attention).
 *
 * Built at run time by pagellm/kernels/native.py (cc -O3 -march=native -fopenmp); the OpenMP runtime
 * is the one PyTorch already loaded (same soname), so both share one thread pool.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { PAGELLM_F32 = 0, PAGELLM_BF16 = 1 }; /* element type of q, out and the pools */

#define LINE 64 /* bytes in a cache line */

/* dst[0:n] = float32 of base[offset : offset + n] (element offsets). bfloat16 is the top half of a
 * float32, so it converts by shifting its bits up (the file is built with -fno-strict-aliasing). */
static inline void load_floats(const void *base, int64_t offset, int64_t n, int dtype, float *dst) {
    if (dtype == PAGELLM_F32) {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
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

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

/* Prefetch (into L2) the elements [offset, offset + n) of base; no-op for offset < 0. */
static inline void prefetch(const void *base, int64_t offset, int64_t n, int dtype) {
    if (offset < 0) return;
    const int64_t size = dtype == PAGELLM_F32 ? 4 : 2;
    const char *p = (const char *)base + offset * size;
    for (int64_t i = 0; i < n * size; i += LINE) __builtin_prefetch(p + i, 0, 1);
}

/* The pool offset of block b + 1 of a table (blocks of block_elems elements), to prefetch while block
 * b is used; -1 past the last block, and where block b + 1 follows block b in memory (a prompt's
 * blocks, allocated together, mostly do): the hardware prefetcher streams such a run by itself, and
 * software prefetches there only compete with it (W1's decode attention 4-7% faster without them). */
static inline int64_t next_block(const int64_t *table, int64_t b, int64_t nb, int64_t block_elems) {
    return b + 1 < nb && table[b + 1] != table[b] + 1 ? table[b + 1] * block_elems : -1;
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

/* In place: x[lo:hi] = softmax(x[lo:hi]); the rest of x[0:n] = 0. Partial maxima and sums in 16
 * lanes so that the compiler vectorises them (a single accumulator would be a serial chain). */
static void softmax(float *x, int64_t lo, int64_t hi, int64_t n) {
    float lane[16];
    for (int j = 0; j < 16; j++) lane[j] = x[lo];
    int64_t t = lo;
    for (; t + 16 <= hi; t += 16)
        for (int j = 0; j < 16; j++) lane[j] = x[t + j] > lane[j] ? x[t + j] : lane[j];
    float m = x[lo];
    for (int j = 0; j < 16; j++) m = lane[j] > m ? lane[j] : m;
    for (; t < hi; t++) m = x[t] > m ? x[t] : m;

    for (t = lo; t < hi; t++) x[t] = fast_exp(x[t] - m);
    for (int j = 0; j < 16; j++) lane[j] = 0.0f;
    for (t = lo; t + 16 <= hi; t += 16)
        for (int j = 0; j < 16; j++) lane[j] += x[t + j];
    float sum = 0.0f;
    for (int j = 0; j < 16; j++) sum += lane[j];
    for (; t < hi; t++) sum += x[t];

    const float inv = 1.0f / sum;
    for (t = 0; t < n; t++) x[t] = t >= lo && t < hi ? x[t] * inv : 0.0f;
}

/* scores[g * stride + t] = sum_d q[g][d] * keys[d][t] over one (block, KV head): keys is its
 * head_dim x bs matrix (float32). Written for a constant bs (16) and a general one. */

static void score_block16(const float *keys, const float *q, int64_t groups, int64_t head_dim, float *scores,
                          int64_t stride) {
    for (int64_t g = 0; g < groups; g++) {
        const float *qg = q + g * head_dim;
        f32x16 acc = {0};
        for (int64_t d = 0; d < head_dim; d++) {
            f32x16 row;
            memcpy(&row, keys + d * 16, sizeof row);
            acc += qg[d] * row;
        }
        memcpy(scores + g * stride, &acc, sizeof acc);
    }
}

static void score_block(const float *keys, const float *q, int64_t groups, int64_t head_dim, int64_t bs,
                        float *scores, int64_t stride) {
    for (int64_t g = 0; g < groups; g++) {
        const float *qg = q + g * head_dim;
        float *dst = scores + g * stride;
        for (int64_t t = 0; t < bs; t++) dst[t] = 0.0f;
        for (int64_t d = 0; d < head_dim; d++)
            for (int64_t t = 0; t < bs; t++) dst[t] += qg[d] * keys[d * bs + t];
    }
}

/* ---- bfloat16 pools, block_size 16, head_dim 64 or 128: the vector path of decode attention.
 * Rows are converted in registers as they are used (a bfloat16 is the top half of a float32), with
 * each query head's partial outputs held in vector registers across a block's 16 value rows. The
 * sums run in the same order as the generic path (keys: over head_dim; values: over tokens), so both
 * give the same bits; this one skips the round trip of every converted row through memory. */
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline f32x16 bf16x16(const uint16_t *p) {
    u16x16 raw;
    memcpy(&raw, p, sizeof raw);
    return (f32x16)(__builtin_convertvector(raw, u32x16) << 16);
}

/* scores[g * stride + t] = sum_d q[g][d] * keys[d][t] for NG query heads over one block of
 * transposed keys ([HD][16], bfloat16). */
static inline __attribute__((always_inline)) void score16_bf16(const uint16_t *keys, const float *q, int hd,
                                                               int ng, float *scores, int64_t stride) {
    f32x16 acc[4] = {{0}};
    for (int d = 0; d < hd; d++) {
        const f32x16 row = bf16x16(keys + d * 16);
        for (int g = 0; g < ng; g++) acc[g] += q[g * hd + d] * row;
    }
    for (int g = 0; g < ng; g++) memcpy(scores + g * stride, &acc[g], sizeof acc[g]);
}

/* acc[g][:] += sum_t p[g * stride + t] * values[t * row_stride + :] for NG query heads over one block
 * of 16 value rows (bfloat16, HD wide); acc: NG rows of HD floats. */
static inline __attribute__((always_inline)) void weigh16_bf16(const uint16_t *values, int64_t row_stride,
                                                               const float *p, int64_t stride, int hd, int ng,
                                                               float *acc) {
    f32x16 o[4][8];
    for (int g = 0; g < ng; g++) memcpy(o[g], acc + g * hd, hd * sizeof(float));
    for (int t = 0; t < 16; t++) {
        for (int c = 0; c < hd / 16; c++) {
            const f32x16 v = bf16x16(values + t * row_stride + c * 16);
            for (int g = 0; g < ng; g++) o[g][c] += p[g * stride + t] * v;
        }
    }
    for (int g = 0; g < ng; g++) memcpy(acc + g * hd, o[g], hd * sizeof(float));
}

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

/* Chunks of 4 query heads for the scores; for the outputs 4 at head_dim 64 (16 vectors), 2 at 128. */
#define SCORE_BF16(n) score16_bf16(keys, q + g * hd, hd, n, scores + g * stride, stride)
#define WEIGH_BF16(n) weigh16_bf16(values, row_stride, p + g * stride, stride, hd, n, acc + g * hd)
#define DEFINE_DECODE_BLOCK_BF16(HD, CHUNK)                                                              \
    static void score_block_bf16_##HD(const uint16_t *keys, const float *q, int64_t groups, float *scores,  \
                                      int64_t stride) {                                                  \
        const int hd = HD;                                                                               \
        FOR_HEAD_CHUNKS(groups, 4, SCORE_BF16)                                                           \
    }                                                                                                    \
    static void weigh_block_bf16_##HD(const uint16_t *values, int64_t row_stride, const float *p,         \
                                      int64_t stride, int64_t groups, float *acc) {                      \
        const int hd = HD;                                                                               \
        FOR_HEAD_CHUNKS(groups, CHUNK, WEIGH_BF16)                                                       \
    }

DEFINE_DECODE_BLOCK_BF16(64, 4)
DEFINE_DECODE_BLOCK_BF16(128, 2)

/* ---- The same shapes with the CPU's bfloat16 dot products (AVX512-BF16, where the compiler targets
 * them): each instruction multiplies 16 pairs of bfloat16 and adds both products to 16 float32 sums,
 * so K and V are used as stored, two rows per instruction, with no conversion. Keys pair along
 * head_dim (rows d and d+1 of the transposed block, one permute), values along tokens (rows t and
 * t+1, interleaved by unpacking, which permutes head_dim within 128-bit lanes: undone at the end).
 * The query is used in bfloat16 as the projection stored it (the scale is applied to the scores);
 * the probabilities are rounded to bfloat16 before weighing the values, as transformers' eager
 * attention does. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
static int use_dot_products = 1;

/* fast_exp on 16 lanes (the same steps). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), _mm512_min_ps(x, _mm512_set1_ps(88.0f)));
    const __m512 shift = _mm512_set1_ps(12582912.0f);
    const __m512 k = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), shift), shift);
    const __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x));
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

/* Each lane rounded to the nearest even bfloat16, as store_floats rounds (a NaN stays a NaN). The CPU's
 * conversion (vcvtneps2bf16) flushes subnormals to zero, where PyTorch rounds them. */
static inline __m512 round_bf16x16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x400000)); /* keeps a NaN a NaN once cut */
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_mask_mov_epi32(rounded, nan, quiet), _mm512_set1_epi32((int)0xffff0000u)));
}

/* 16 pairs (K[d][t], K[d + 1][t]) from the 32 words of rows d and d + 1. */
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

#define SCORE_DOT(n) score16_dot(keys, q + g * hd / 2, hd, n, scale, scores + g * stride, stride)
#define WEIGH_DOT(n) weigh16_dot(values, row_stride, p + g * p_stride, p_stride, hd, n, acc + g * hd, hd)
#define DEFINE_DECODE_BLOCK_DOT(HD, CHUNK)                                                               \
    static void score_block_dot_##HD(const uint16_t *keys, const uint32_t *q, int64_t groups, float scale, \
                                     float *scores, int64_t stride) {                                    \
        const int hd = HD;                                                                               \
        FOR_HEAD_CHUNKS(groups, 4, SCORE_DOT)                                                            \
    }                                                                                                    \
    static void weigh_block_dot_##HD(const uint16_t *values, int64_t row_stride, const uint32_t *p,      \
                                     int64_t p_stride, int64_t groups, float *acc) {                     \
        const int hd = HD;                                                                               \
        FOR_HEAD_CHUNKS(groups, CHUNK, WEIGH_DOT)                                                        \
    }

DEFINE_DECODE_BLOCK_DOT(64, 4)
DEFINE_DECODE_BLOCK_DOT(128, 2)

/* The same two steps for one query head of up to 4 sequences at a time (a cascade's shared blocks,
 * below): n query rows (contiguous pairs), their score rows `stride` floats apart, their probability
 * rows p_stride pairs apart, their outputs acc_stride floats apart. Each row's sums run in the order
 * they run in alone, so every row gets the bits it gets from the per-sequence kernels. */
#define SCORE_ROWS(n) score16_dot(keys, q, hd, n, scale, scores, stride)
#define WEIGH_ROWS(n) weigh16_dot(values, row_stride, p, p_stride, hd, n, acc, acc_stride)
#define DEFINE_CASCADE_BLOCK_DOT(HD)                                                                     \
    static void score_rows_dot_##HD(const uint16_t *keys, const uint32_t *q, int64_t n, float scale,      \
                                    float *scores, int64_t stride) {                                     \
        const int hd = HD;                                                                               \
        WITH_CONSTANT_ROWS(n, 4, SCORE_ROWS)                                                             \
    }                                                                                                    \
    static void weigh_rows_dot_##HD(const uint16_t *values, int64_t row_stride, const uint32_t *p,        \
                                    int64_t p_stride, int64_t n, float *acc, int64_t acc_stride) {       \
        const int hd = HD;                                                                               \
        WITH_CONSTANT_ROWS(n, 4, WEIGH_ROWS)                                                             \
    }

DEFINE_CASCADE_BLOCK_DOT(64)
DEFINE_CASCADE_BLOCK_DOT(128)

/* One work item (sequence s, KV heads h_lo..h_hi) of decode attention on bfloat16 pools with the dot
 * products, in two stages: DECODE_SCORES scores the keys of blocks from..nb-1 and takes the softmax
 * over all of b0..nb-1 (zeroing the outputs), DECODE_VALUES weighs the values of blocks from..nb-1 and
 * stores the outputs. A sequence alone runs both from b0; one in a cascade run runs each from its
 * first own block, the group's shared blocks done between the two stages (below). scores: num_heads
 * rows `stride` floats apart; pairs: num_heads rows stride / 2 pairs apart; acc: num_heads rows of
 * head_dim. */
#define DECODE_SCORES 1
#define DECODE_VALUES 2
static void decode_item_dot(const uint16_t *q, const uint16_t *k_pool, const uint16_t *v_pool,
                            const int64_t *table, uint16_t *out, int64_t h_lo, int64_t h_hi, int64_t groups,
                            int64_t num_kv_heads, int64_t head_dim, int64_t b0, int64_t nb, int64_t lo,
                            int64_t hi, float scale, float *scores, uint32_t *pairs, float *acc, int64_t stride,
                            int64_t from, int stages) {
    const int64_t head_elems = head_dim * 16, block_elems = num_kv_heads * head_elems;
    const int64_t span = (nb - b0) * 16;
    const uint32_t *q32 = (const uint32_t *)q;
    if (stages & DECODE_SCORES) {
        for (int64_t b = from; b < nb; b++) {
            const int64_t next = next_block(table, b, nb, block_elems);
            for (int64_t h = h_lo; h < h_hi; h++) {
                prefetch(k_pool, next < 0 ? -1 : next + h * head_elems, head_elems, PAGELLM_BF16);
                const uint16_t *kb = k_pool + table[b] * block_elems + h * head_elems;
                float *dst = scores + h * groups * stride + (b - b0) * 16;
                const uint32_t *qh = q32 + h * groups * head_dim / 2;
                if (head_dim == 64) {
                    score_block_dot_64(kb, qh, groups, scale, dst, stride);
                } else {
                    score_block_dot_128(kb, qh, groups, scale, dst, stride);
                }
            }
        }
        for (int64_t hq = h_lo * groups; hq < h_hi * groups; hq++) {
            softmax(scores + hq * stride, lo, hi, span);
            for (int64_t t = 0; t < span; t += 16) /* 16 probabilities -> 8 pairs of bfloat16 */
                _mm256_storeu_si256((__m256i *)(pairs + hq * (stride / 2) + t / 2),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scores + hq * stride + t)));
            for (int64_t d = 0; d < head_dim; d++) acc[hq * head_dim + d] = 0.0f;
        }
    }
    if (!(stages & DECODE_VALUES)) return;
    for (int64_t b = from; b < nb; b++) {
        const int64_t next = next_block(table, b, nb, block_elems);
        for (int64_t h = h_lo; h < h_hi; h++) {
            prefetch(v_pool, next < 0 ? -1 : next + h * head_elems, head_elems, PAGELLM_BF16);
            const uint16_t *vb = v_pool + table[b] * block_elems + h * head_elems;
            const uint32_t *p = pairs + h * groups * (stride / 2) + (b - b0) * 8;
            float *o = acc + h * groups * head_dim;
            if (head_dim == 64) {
                weigh_block_dot_64(vb, head_dim, p, stride / 2, groups, o);
            } else {
                weigh_block_dot_128(vb, head_dim, p, stride / 2, groups, o);
            }
        }
    }
    /* Undo the unpack order: in each 32-wide chunk, lane 4 * L + j of `lo` is element 8 * L + j and
     * of `hi` element 8 * L + 4 + j (L: the 128-bit lane, j < 4). */
    float row[128];
    for (int64_t hq = h_lo * groups; hq < h_hi * groups; hq++) {
        const float *a = acc + hq * head_dim;
        for (int64_t c = 0; c < head_dim; c += 32)
            for (int L = 0; L < 4; L++)
                for (int j = 0; j < 4; j++) {
                    row[c + 8 * L + j] = a[c + 4 * L + j];
                    row[c + 8 * L + 4 + j] = a[c + 16 + 4 * L + j];
                }
        store_floats(out, hq * head_dim, head_dim, PAGELLM_BF16, row);
    }
}

/* ---- Cascade: decodes that share their first blocks (a cached prompt prefix, forked samples) would
 * each read those blocks again at every step, one query at a time. A run of such decodes reads its
 * shared blocks once instead (FlashInfer's shared-prefix batch decoding): their keys scored and their
 * values weighed for up to 4 of the run's queries per pass (score_rows_dot, weigh_rows_dot), between the
 * two stages of each sequence's own item. Every row's sums run in the order decode_item_dot runs them: the
 * outputs are the bits each sequence gets alone. */

/* The shared blocks 0..shared-1 of n <= CASCADE_TILE sequences of a run, KV head h: their keys scored
 * into the sequences' score rows (values == 0), or their values weighed into the outputs (values == 1),
 * each block used for 4 sequences per pass (2 for the values at head_dim 128, whose 4 rows would not fit
 * in the vector registers) while the n sequences' rows stay in L1. scores, pairs, acc: the first
 * sequence's rows (stride, stride / 2 and head_dim apart; each next sequence num_heads rows on); qbuf:
 * n * head_dim / 2 words. */
#define CASCADE_TILE 16
static void cascade_shared_dot(const uint16_t *q, int64_t q_stride, const uint16_t *k_pool, const uint16_t *v_pool,
                               const int64_t *table, int64_t n, int64_t shared, int64_t h, int64_t groups,
                               int64_t num_kv_heads, int64_t head_dim, float scale, float *scores, uint32_t *pairs,
                               float *acc, int64_t stride, uint32_t *qbuf, int values) {
    const int64_t head_elems = head_dim * 16, block_elems = num_kv_heads * head_elems;
    const int64_t num_heads = groups * num_kv_heads, half = head_dim / 2;
    const int64_t per_pass = values && head_dim == 128 ? 2 : 4;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t hq = h * groups + g;
        if (!values) /* this query head of each sequence, as contiguous pairs */
            for (int64_t i = 0; i < n; i++)
                memcpy(qbuf + i * half, q + i * q_stride + hq * head_dim, (size_t)head_dim * sizeof(uint16_t));
        for (int64_t b = 0; b < shared; b++) {
            const int64_t next = g == 0 ? next_block(table, b, shared, block_elems) : -1;
            if (!values) {
                if (next >= 0) prefetch(k_pool, next + h * head_elems, head_elems, PAGELLM_BF16);
                const uint16_t *kb = k_pool + table[b] * block_elems + h * head_elems;
                for (int64_t i = 0; i < n; i += per_pass) {
                    const int64_t rows = n - i < per_pass ? n - i : per_pass;
                    float *dst = scores + (i * num_heads + hq) * stride + b * 16;
                    if (head_dim == 64) {
                        score_rows_dot_64(kb, qbuf + i * half, rows, scale, dst, num_heads * stride);
                    } else {
                        score_rows_dot_128(kb, qbuf + i * half, rows, scale, dst, num_heads * stride);
                    }
                }
            } else {
                if (next >= 0) prefetch(v_pool, next + h * head_elems, head_elems, PAGELLM_BF16);
                const uint16_t *vb = v_pool + table[b] * block_elems + h * head_elems;
                for (int64_t i = 0; i < n; i += per_pass) {
                    const int64_t rows = n - i < per_pass ? n - i : per_pass;
                    const uint32_t *p = pairs + (i * num_heads + hq) * (stride / 2) + b * 8;
                    float *o = acc + (i * num_heads + hq) * head_dim;
                    if (head_dim == 64) {
                        weigh_rows_dot_64(vb, head_dim, p, num_heads * stride / 2, rows, o,
                                          num_heads * head_dim);
                    } else {
                        weigh_rows_dot_128(vb, head_dim, p, num_heads * stride / 2, rows, o,
                                           num_heads * head_dim);
                    }
                }
            }
        }
    }
}
#endif

/* Whether attention (decode and prefill) on bfloat16 pools uses the bfloat16 dot products where they
 * were compiled in (1, the default) or the portable paths (0; decode then gives the float32 path's
 * bits). Process-wide and read without synchronisation: set it only while no kernel runs (tests
 * compare both; enable < 0 only asks). Returns the previous setting, or -1 where the CPU (or compiler)
 * has no such instructions. */
int pagellm_bf16_dot_products(int enable) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    const int before = use_dot_products;
    if (enable >= 0) use_dot_products = enable != 0;
    return before;
#else
    (void)enable;
    return -1;
#endif
}

/* Floats of scratch each thread needs. */
int64_t pagellm_scratch_floats(int64_t num_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks) {
    /* queries + outputs (all heads), scores (all heads x context), one KV head's key block, one value
     * row, the probabilities as bfloat16 pairs (all heads x context / 2) */
    return 2 * num_heads * head_dim + num_heads * max_blocks * block_size + head_dim * block_size + head_dim +
           num_heads * max_blocks * block_size / 2 + 1;
}

/* q, out: [num_seqs, num_heads, head_dim] (q with q_stride elements between sequences); tables: [num_seqs, max_blocks] block ids; lens: [num_seqs]
 * context lengths (>= 1). With window > 0 only the last `window` positions are attended.
 * scratch: num_threads * pagellm_scratch_floats(...) floats. cascade: num_cascade rows (begin, end,
 * shared): sequences begin..end-1 (disjoint runs) whose tables hold the same first `shared` blocks,
 * read once for the run (see the cascade above; the dot-product path without a window, others ignore
 * it). The outputs are the same bits with or without it. */
void pagellm_paged_decode_attention(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool, const int64_t *tables,
                                    const int64_t *lens, void *out, int64_t num_seqs, int64_t num_heads,
                                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                    int64_t max_blocks, int64_t window, float scale, int dtype, int num_threads,
                                    float *scratch, const int64_t *cascade, int64_t num_cascade) {
    const int64_t groups = num_heads / num_kv_heads;       /* query heads per KV head */
    const int64_t head_elems = head_dim * block_size;       /* one KV head of a block */
    const int64_t block_elems = num_kv_heads * head_elems;  /* one block, all KV heads */
    const int64_t per_thread = pagellm_scratch_floats(num_heads, head_dim, block_size, max_blocks);
    const int vector_bf16 = dtype == PAGELLM_BF16 && block_size == 16 && (head_dim == 64 || head_dim == 128);
    /* A cascade's members keep their score, probability and output rows between the stages: member[s],
     * each sequence's place among the members (-1: none), its shared block count, their rows, the
     * work items of the shared blocks (a run's CASCADE_TILE sequences and one KV head each: first
     * member, count, shared blocks), and each thread's query buffer. */
    int64_t *member = NULL, *shared = NULL, *tiles = NULL, num_tiles = 0, members = 0;
    float *c_scores = NULL, *c_acc = NULL;
    uint32_t *c_pairs = NULL, *c_q = NULL;
    const int64_t c_stride = max_blocks * 16;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (num_cascade > 0 && vector_bf16 && use_dot_products && window <= 0) {
        for (int64_t c = 0; c < num_cascade; c++) {
            members += cascade[3 * c + 1] - cascade[3 * c];
            num_tiles += (cascade[3 * c + 1] - cascade[3 * c] + CASCADE_TILE - 1) / CASCADE_TILE;
        }
        member = malloc((size_t)num_seqs * sizeof(int64_t));
        shared = malloc((size_t)num_seqs * sizeof(int64_t));
        tiles = malloc((size_t)(3 * num_tiles) * sizeof(int64_t));
        c_scores = malloc((size_t)(members * num_heads * c_stride) * sizeof(float));
        c_pairs = malloc((size_t)(members * num_heads * c_stride / 2) * sizeof(uint32_t));
        c_acc = malloc((size_t)(members * num_heads * head_dim) * sizeof(float));
        c_q = malloc((size_t)(num_threads * CASCADE_TILE * head_dim / 2) * sizeof(uint32_t));
        if (member == NULL || shared == NULL || tiles == NULL || c_scores == NULL || c_pairs == NULL || c_acc == NULL ||
            c_q == NULL) {
            free(member); /* without the memory every sequence reads its own blocks: the same result */
            member = NULL;
        } else {
            for (int64_t s = 0; s < num_seqs; s++) member[s] = -1, shared[s] = 0;
            int64_t m = 0, t = 0;
            for (int64_t c = 0; c < num_cascade; c++) {
                const int64_t begin = cascade[3 * c], end = cascade[3 * c + 1];
                for (int64_t s = begin; s < end; s++) member[s] = m + s - begin, shared[s] = cascade[3 * c + 2];
                for (int64_t i = begin; i < end; i += CASCADE_TILE, t++) {
                    tiles[3 * t] = i;
                    tiles[3 * t + 1] = end - i < CASCADE_TILE ? end - i : CASCADE_TILE;
                    tiles[3 * t + 2] = cascade[3 * c + 2];
                }
                m += end - begin;
            }
        }
    }
#else
    (void)cascade;
    (void)num_cascade;
#endif
#define MEMBER_SCORES(s) (c_scores + member[s] * num_heads * c_stride)
#define MEMBER_PAIRS(s) (c_pairs + member[s] * num_heads * c_stride / 2)
#define MEMBER_ACC(s) (c_acc + member[s] * num_heads * head_dim)
/* The shared blocks of one item (a tile of a run, one KV head; a head's tiles one after the other, so
 * that its blocks are still in cache for the next): keys (qbuf given) or values (qbuf NULL). */
#define SHARED_ITEM(item, qbuf)                                                                          \
    do {                                                                                                 \
        const int64_t *tile = tiles + 3 * ((item) % num_tiles), first = tile[0];                         \
        cascade_shared_dot((const uint16_t *)q + first * q_stride, q_stride, k_pool, v_pool,             \
                           tables + first * max_blocks, tile[1], tile[2], (item) / num_tiles, groups,    \
                           num_kv_heads, head_dim, scale, MEMBER_SCORES(first), MEMBER_PAIRS(first),     \
                           MEMBER_ACC(first), c_stride, (qbuf), (qbuf) == NULL);                         \
    } while (0)
/* A member's own blocks, KV heads h_lo..h_hi: one stage of decode_item_dot (see there). */
#define MEMBER_ITEM(s, h_lo, h_hi, stage)                                                                \
    decode_item_dot((const uint16_t *)q + (s) * q_stride, k_pool, v_pool, tables + (s) * max_blocks,     \
                    (uint16_t *)out + (s) * num_heads * head_dim, (h_lo), (h_hi), groups, num_kv_heads,   \
                    head_dim, 0, (lens[s] + 15) / 16, 0, lens[s], scale, MEMBER_SCORES(s), MEMBER_PAIRS(s), \
                    MEMBER_ACC(s), c_stride, shared[s], (stage))
#pragma omp parallel num_threads(num_threads)
    {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        if (member != NULL) { /* the shared blocks' keys */
            uint32_t *qbuf = c_q + omp_get_thread_num() * CASCADE_TILE * head_dim / 2;
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < num_tiles * num_kv_heads; item++) SHARED_ITEM(item, qbuf);
        }
#endif
        float *qf = scratch + omp_get_thread_num() * per_thread; /* scaled queries, all heads */
        float *acc = qf + num_heads * head_dim;                  /* outputs, all heads */
        float *scores = acc + num_heads * head_dim;              /* num_heads rows of `span` */
        float *keys = scores + num_heads * max_blocks * block_size;
        float *vrow = keys + head_elems;
        uint32_t *pairs = (uint32_t *)(vrow + head_dim); /* the dot-product path's bfloat16 probabilities */
        (void)pairs;                                      /* (unused where that path is not compiled in) */
        /* A work item is a sequence and a range of its KV heads: all heads when there is a sequence
         * for every thread (whole blocks are read in one run), one head each otherwise (a lone
         * sequence still uses every thread). */
        const int64_t head_chunks = num_seqs >= num_threads ? 1 : num_kv_heads;
        const int64_t chunk = num_kv_heads / head_chunks;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * head_chunks; item++) {
            const int64_t s = item / head_chunks;
            const int64_t h_lo = item % head_chunks * chunk, h_hi = h_lo + chunk;  /* KV heads */
            const int64_t q_lo = h_lo * groups, q_hi = h_hi * groups;                /* query heads */
            const int64_t len = lens[s];
            const int64_t first = window > 0 && len > window ? len - window : 0;
            const int64_t b0 = first / block_size, nb = (len + block_size - 1) / block_size;
            const int64_t span = (nb - b0) * block_size; /* scores cover whole blocks b0 .. nb-1 */
            const int64_t *table = tables + s * max_blocks;
            const int64_t q_offset = s * q_stride + q_lo * head_dim, q_elems = (q_hi - q_lo) * head_dim;
            const int64_t out_offset = (s * num_heads + q_lo) * head_dim;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
            if (vector_bf16 && use_dot_products) {
                if (member != NULL && member[s] >= 0) { /* its own keys, then the softmax over all */
                    MEMBER_ITEM(s, h_lo, h_hi, DECODE_SCORES);
                } else {
                    decode_item_dot((const uint16_t *)q + s * q_stride, k_pool, v_pool, table,
                                    (uint16_t *)out + s * num_heads * head_dim, h_lo, h_hi, groups, num_kv_heads,
                                    head_dim, b0, nb, first - b0 * block_size, len - b0 * block_size, scale, scores,
                                    pairs, acc, span, b0, DECODE_SCORES | DECODE_VALUES);
                }
                continue;
            }
#endif
            load_floats(q, q_offset, q_elems, dtype, qf + q_lo * head_dim);
            for (int64_t i = q_lo * head_dim; i < q_hi * head_dim; i++) qf[i] *= scale;

            for (int64_t b = b0; b < nb; b++) {
                const int64_t next = next_block(table, b, nb, block_elems);
                for (int64_t h = h_lo; h < h_hi; h++) {
                    prefetch(k_pool, next < 0 ? -1 : next + h * head_elems, head_elems, dtype);
                    float *dst = scores + h * groups * span + (b - b0) * block_size;
                    const float *qh = qf + h * groups * head_dim;
                    if (vector_bf16) {
                        const uint16_t *kb = (const uint16_t *)k_pool + table[b] * block_elems + h * head_elems;
                        if (head_dim == 64) {
                            score_block_bf16_64(kb, qh, groups, dst, span);
                        } else {
                            score_block_bf16_128(kb, qh, groups, dst, span);
                        }
                        continue;
                    }
                    load_floats(k_pool, table[b] * block_elems + h * head_elems, head_elems, dtype, keys);
                    if (block_size == 16) {
                        score_block16(keys, qh, groups, head_dim, dst, span);
                    } else {
                        score_block(keys, qh, groups, head_dim, block_size, dst, span);
                    }
                }
            }
            const int64_t lo = first - b0 * block_size, hi = len - b0 * block_size;
            for (int64_t hq = q_lo; hq < q_hi; hq++) softmax(scores + hq * span, lo, hi, span);

            for (int64_t i = q_lo * head_dim; i < q_hi * head_dim; i++) acc[i] = 0.0f;
            for (int64_t b = b0; b < nb && vector_bf16; b++) {
                const int64_t next = next_block(table, b, nb, block_elems);
                for (int64_t h = h_lo; h < h_hi; h++) {
                    prefetch(v_pool, next < 0 ? -1 : next + h * head_elems, head_elems, dtype);
                    const uint16_t *vb = (const uint16_t *)v_pool + table[b] * block_elems + h * head_elems;
                    const float *p = scores + h * groups * span + (b - b0) * 16;
                    float *o = acc + h * groups * head_dim;
                    if (head_dim == 64) {
                        weigh_block_bf16_64(vb, head_dim, p, span, groups, o);
                    } else {
                        weigh_block_bf16_128(vb, head_dim, p, span, groups, o);
                    }
                }
            }
            for (int64_t b = b0; b < nb && !vector_bf16; b++) {
                const int64_t next = next_block(table, b, nb, block_elems);
                for (int64_t h = h_lo; h < h_hi; h++) { /* a head's value rows one after the other */
                    for (int64_t t = 0; t < block_size; t++) {
                        const float *p = scores + (b - b0) * block_size + t; /* head hq's weight: p[hq * span] */
                        const int64_t row = h * head_elems + t * head_dim;
                        prefetch(v_pool, next < 0 ? -1 : next + row, head_dim, dtype);
                        load_floats(v_pool, table[b] * block_elems + row, head_dim, dtype, vrow);
                        for (int64_t g = h * groups; g < (h + 1) * groups; g++) {
                            const float w = p[g * span];
                            float *o = acc + g * head_dim;
                            for (int64_t d = 0; d < head_dim; d++) o[d] += w * vrow[d];
                        }
                    }
                }
            }
            store_floats(out, out_offset, q_elems, dtype, acc + q_lo * head_dim);
        }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        if (member != NULL) { /* the shared blocks' values, then each member's own and its outputs */
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < num_tiles * num_kv_heads; item++) SHARED_ITEM(item, NULL);
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < num_seqs * head_chunks; item++) {
                const int64_t s = item / head_chunks, h_lo = item % head_chunks * chunk;
                if (member[s] >= 0) MEMBER_ITEM(s, h_lo, h_lo + chunk, DECODE_VALUES);
            }
        }
#endif
    }
#undef MEMBER_SCORES
#undef MEMBER_PAIRS
#undef MEMBER_ACC
#undef SHARED_ITEM
#undef MEMBER_ITEM
    free(member);
    free(shared);
    free(tiles);
    free(c_scores);
    free(c_pairs);
    free(c_acc);
    free(c_q);
}

/* ---------------------------------------------------------------- paged prefill attention
 * The new tokens of one sequence (a prompt, or a chunk of one after `cached` tokens) attend causally
 * over everything in the pool up to their own position (their own K/V already written), read in
 * place through the block table. Flash-attention tiling with an online softmax: a work item is a
 * block of PREFILL_TOKENS query tokens and one KV head. The portable path converts each K/V block it
 * reads to float32 once, then scores it against TILE_ROWS query rows at a time whose scores and
 * outputs stay in vector registers, updating the softmax every block; the bfloat16 dot-product path
 * repacks up to PREFILL_CHUNK_BLOCKS blocks at a time and updates it once per such chunk (see
 * there). Written for block_size 16 (one key block row = one 16-float vector) and head_dim 64 or 128;
 * other shapes use PyTorch's flash kernel. */
#define PREFILL_TOKENS 64     /* query tokens per work item: the K/V blocks it repacks serve 64 tokens' rows */
#define PREFILL_TOKENS_FEW 16 /* ... or 16 where 64 would leave threads without items (short prompts, many threads) */

/* Query rows (token, query head) of one work item, padded to a multiple of the tile height. */
static inline int64_t prefill_rows(int64_t tokens, int64_t groups) { return (tokens * groups + 3) / 4 * 4; }

/* First key position a query at `pos` attends (causal, within the window if any). */
static inline int64_t prefill_first_key(int64_t pos, int64_t window) {
    return window > 0 && pos + 1 > window ? pos + 1 - window : 0;
}

/* Each of the `padded` rows of a work item (row r: query token first_query + r / groups; rows past
 * `rows` are padding): its position, and the first key position it attends (-1 and 0 for padding). */
static inline void prefill_row_spans(int64_t rows, int64_t padded, int64_t groups, int64_t first_query,
                                     int64_t window, int64_t *pos, int64_t *first) {
    for (int64_t r = 0; r < padded; r++) {
        pos[r] = r < rows ? first_query + r / groups : -1;
        first[r] = r < rows ? prefill_first_key(pos[r], window) : 0;
    }
}

/* The lanes [*lo, *hi) of key block b that a row at `pos` attending from key `first` reads (empty, lo
 * == hi, for padding rows at pos -1); returns whether there are any. */
static inline int prefill_block_lanes(int64_t b, int64_t pos, int64_t first, int64_t *lo, int64_t *hi) {
    const int64_t l = first > b * 16 ? first - b * 16 : 0;
    const int64_t h = pos - b * 16 + 1 < 16 ? pos - b * 16 + 1 : 16;
    *lo = l;
    *hi = h > l ? h : l;
    return h > l;
}

/* For key block b and a tile of rows with positions pos[0 .. tile - 1] and first keys first[...], the
 * lanes [lo[j], hi[j]) that row j attends; returns whether any row attends any lane of the block. */
static inline int prefill_tile_lanes(int64_t b, int64_t tile, const int64_t *pos, const int64_t *first, int64_t *lo,
                                     int64_t *hi) {
    int any = 0;
    for (int64_t j = 0; j < tile; j++) any |= prefill_block_lanes(b, pos[j], first[j], &lo[j], &hi[j]);
    return any;
}

#define PREFILL_CHUNK_BLOCKS 16 /* key blocks per softmax update of the dot-product path */

/* Floats of a thread's scratch for the chunk buffers of prefill_item_dot: the chunk's repacked keys
 * and values, a tile's scores and probabilities, and room to align the vectors to 64 bytes. */
static inline int64_t prefill_chunk_floats(int64_t head_dim) {
    return PREFILL_CHUNK_BLOCKS * head_dim * 16 + 4 * PREFILL_CHUNK_BLOCKS * 16 + 4 * PREFILL_CHUNK_BLOCKS * 8 + 16;
}

int64_t pagellm_prefill_scratch_floats(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
    const int64_t rows = prefill_rows(PREFILL_TOKENS, num_heads / num_kv_heads);
    /* queries + outputs, running max and sum, one key block [head_dim][16], one value block [16][head_dim]
     * (the portable path), the dot-product path's chunk */
    return 2 * rows * head_dim + 2 * rows + 2 * 16 * head_dim + prefill_chunk_floats(head_dim);
}

/* TILE_ROWS query rows against one block of 16 keys: scores, online-softmax update, weighted values.
 * kf: [HD][16] keys; vf: [16][HD] values; q, acc: [TILE_ROWS][HD]; lanes [lo[r], hi[r]) are the
 * keys row r may attend (empty for padding rows, which stay zero). */
#define DEFINE_PREFILL_TILE(HD, TILE_ROWS)                                                                  \
    static void prefill_tile_##HD(const float *kf, const float *vf, const float *q, float *acc,          \
                                  float *run_max, float *run_sum, const int64_t *lo, const int64_t *hi) { \
        f32x16 s[TILE_ROWS];                                                                             \
        for (int r = 0; r < TILE_ROWS; r++) s[r] = (f32x16){0};                                          \
        for (int d = 0; d < HD; d++) {                                                                   \
            f32x16 k;                                                                                    \
            memcpy(&k, kf + d * 16, sizeof k);                                                           \
            for (int r = 0; r < TILE_ROWS; r++) s[r] += q[r * HD + d] * k;                               \
        }                                                                                                \
        float p[TILE_ROWS][16], rescale[TILE_ROWS];                                                      \
        for (int r = 0; r < TILE_ROWS; r++) {                                                            \
            float m = run_max[r];                                                                        \
            for (int64_t t = lo[r]; t < hi[r]; t++) m = s[r][t] > m ? s[r][t] : m;                       \
            rescale[r] = run_max[r] == -INFINITY ? 0.0f : fast_exp(run_max[r] - m);                      \
            float sum = 0.0f;                                                                            \
            for (int t = 0; t < 16; t++) {                                                               \
                p[r][t] = t >= lo[r] && t < hi[r] ? fast_exp(s[r][t] - m) : 0.0f;                        \
                sum += p[r][t];                                                                          \
            }                                                                                            \
            run_max[r] = m;                                                                              \
            run_sum[r] = run_sum[r] * rescale[r] + sum;                                                  \
        }                                                                                                \
        f32x16 o[TILE_ROWS][HD / 16];                                                                    \
        for (int r = 0; r < TILE_ROWS; r++)                                                              \
            for (int j = 0; j < HD / 16; j++) {                                                          \
                memcpy(&o[r][j], acc + r * HD + j * 16, sizeof o[r][j]);                                 \
                o[r][j] *= rescale[r];                                                                   \
            }                                                                                            \
        for (int t = 0; t < 16; t++) {                                                                   \
            f32x16 v[HD / 16];                                                                           \
            memcpy(v, vf + t * HD, sizeof v);                                                            \
            for (int r = 0; r < TILE_ROWS; r++)                                                          \
                for (int j = 0; j < HD / 16; j++) o[r][j] += p[r][t] * v[j];                             \
        }                                                                                                \
        for (int r = 0; r < TILE_ROWS; r++)                                                              \
            for (int j = 0; j < HD / 16; j++) memcpy(acc + r * HD + j * 16, &o[r][j], sizeof o[r][j]);   \
    }

/* Outputs of 4 rows (64) or 2 rows (128) fill 16 of the 32 vector registers. */
DEFINE_PREFILL_TILE(64, 4)
DEFINE_PREFILL_TILE(128, 2)

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* The same attention with the bfloat16 dot products (see the decode path), its softmax taken over up to
 * PREFILL_CHUNK_BLOCKS key blocks at once: a tile of TILE_ROWS rows scores all its keys of a chunk
 * (stored, scaled), takes each row's maximum and exponentials over them with one reduction each, and
 * weighs the chunk's values in one pass with its outputs in registers. (Updating the online softmax
 * every 32 keys cost ~22% of the kernel in reductions, rescales and output round trips.) Chunks are
 * aligned to absolute block indices and a row's masked lanes add exact zeros, so a row's result does
 * not depend on which other rows share its tile or work item. kp: the chunk's blocks, each head_dim / 2
 * pair-permuted key rows; vp: each block's values as 8 token pairs x head_dim / 16 unpacked halves;
 * q: TILE_ROWS rows of HD / 2 bfloat16 pairs; acc: TILE_ROWS rows in unpack order; pos/first: each row's
 * position and first attended key (padding rows: -1 and 0); blocks tb0..tb1-1 (absolute; the chunk
 * starts at block cb); scores: TILE_ROWS rows of PREFILL_CHUNK_BLOCKS * 16 floats; probs: TILE_ROWS rows
 * of PREFILL_CHUNK_BLOCKS * 8 pairs. */

/* Lanes of key block b that a row at `pos` attending from key `first` reads, as a mask. */
static inline __mmask16 prefill_live(int64_t b, int64_t pos, int64_t first) {
    int64_t l, h;
    return prefill_block_lanes(b, pos, first, &l, &h) ? (__mmask16)(((1u << h) - 1u) & ~((1u << l) - 1u)) : (__mmask16)0;
}

#define DEFINE_PREFILL_TILE_DOT(HD, TILE_ROWS)                                                              \
    static void prefill_tile_dot_##HD(const __m512i *kp, const __m512i *vp, int64_t cb, int64_t tb0,       \
                                       int64_t tb1, const uint32_t *q, float scale, float *acc,             \
                                       float *run_max, float *run_sum, const int64_t *pos,                  \
                                       const int64_t *first, float *scores, uint32_t *probs) {              \
        const int64_t sw = PREFILL_CHUNK_BLOCKS * 16, pw = PREFILL_CHUNK_BLOCKS * 8;                        \
        int64_t b = tb0;                                                                                 \
        for (; b + 1 < tb1; b += 2) { /* two blocks at a time: 2 x TILE_ROWS independent sums */         \
            const __m512i *k0 = kp + (b - cb) * (HD / 2), *k1 = k0 + HD / 2;                             \
            __m512 s[2][TILE_ROWS];                                                                      \
            for (int r = 0; r < TILE_ROWS; r++) s[0][r] = s[1][r] = _mm512_setzero_ps();                 \
            for (int i = 0; i < HD / 2; i++)                                                             \
                for (int r = 0; r < TILE_ROWS; r++) {                                                    \
                    const __m512bh qi = (__m512bh)_mm512_set1_epi32((int)q[r * HD / 2 + i]);             \
                    s[0][r] = _mm512_dpbf16_ps(s[0][r], (__m512bh)k0[i], qi);                            \
                    s[1][r] = _mm512_dpbf16_ps(s[1][r], (__m512bh)k1[i], qi);                            \
                }                                                                                        \
            for (int r = 0; r < TILE_ROWS; r++)                                                          \
                for (int k = 0; k < 2; k++)                                                              \
                    _mm512_storeu_ps(scores + r * sw + (b + k - tb0) * 16,                               \
                                     _mm512_mul_ps(s[k][r], _mm512_set1_ps(scale)));                     \
        }                                                                                                \
        if (b < tb1) { /* an odd last block */                                                           \
            const __m512i *k0 = kp + (b - cb) * (HD / 2);                                                \
            __m512 s[TILE_ROWS];                                                                         \
            for (int r = 0; r < TILE_ROWS; r++) s[r] = _mm512_setzero_ps();                              \
            for (int i = 0; i < HD / 2; i++)                                                             \
                for (int r = 0; r < TILE_ROWS; r++)                                                      \
                    s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)k0[i],                                       \
                                            (__m512bh)_mm512_set1_epi32((int)q[r * HD / 2 + i]));        \
            for (int r = 0; r < TILE_ROWS; r++)                                                          \
                _mm512_storeu_ps(scores + r * sw + (b - tb0) * 16, _mm512_mul_ps(s[r], _mm512_set1_ps(scale))); \
        }                                                                                                \
        float rescale[TILE_ROWS];                                                                        \
        for (int r = 0; r < TILE_ROWS; r++) {                                                            \
            const float *sr = scores + r * sw;                                                           \
            uint32_t *pr = probs + r * pw;                                                               \
            __mmask16 live[PREFILL_CHUNK_BLOCKS];                                                        \
            __m512 top = _mm512_set1_ps(-INFINITY);                                                      \
            for (int64_t k = tb0; k < tb1; k++) {                                                        \
                live[k - tb0] = prefill_live(k, pos[r], first[r]);                                       \
                top = _mm512_mask_max_ps(top, live[k - tb0], top, _mm512_loadu_ps(sr + (k - tb0) * 16)); \
            }                                                                                            \
            const float chunk_max = _mm512_reduce_max_ps(top);                                           \
            if (chunk_max == -INFINITY) { /* nothing of this row here: zero probabilities, no update */  \
                rescale[r] = 1.0f;                                                                       \
                for (int64_t k = tb0; k < tb1; k++)                                                      \
                    _mm256_storeu_si256((__m256i *)(pr + (k - tb0) * 8), _mm256_setzero_si256());        \
                continue;                                                                                \
            }                                                                                            \
            const float m = chunk_max > run_max[r] ? chunk_max : run_max[r];                             \
            rescale[r] = run_max[r] == -INFINITY ? 0.0f : fast_exp(run_max[r] - m);                      \
            __m512 total = _mm512_setzero_ps();                                                          \
            for (int64_t k = tb0; k < tb1; k++) {                                                        \
                const __m512 p = _mm512_maskz_mov_ps(live[k - tb0],                                      \
                    exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + (k - tb0) * 16), _mm512_set1_ps(m))));      \
                total = _mm512_add_ps(total, p);                                                         \
                _mm256_storeu_si256((__m256i *)(pr + (k - tb0) * 8), (__m256i)_mm512_cvtneps_pbh(p));    \
            }                                                                                            \
            run_max[r] = m;                                                                              \
            run_sum[r] = run_sum[r] * rescale[r] + _mm512_reduce_add_ps(total);                          \
        }                                                                                                \
        __m512 o[TILE_ROWS][HD / 16];                                                                    \
        for (int r = 0; r < TILE_ROWS; r++)                                                              \
            for (int c = 0; c < HD / 16; c++)                                                            \
                o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * HD + c * 16), _mm512_set1_ps(rescale[r])); \
        for (int64_t k = tb0; k < tb1; k++) {                                                            \
            const __m512i *v = vp + (k - cb) * 8 * (HD / 16);                                            \
            for (int m = 0; m < 8; m++)                                                                  \
                for (int r = 0; r < TILE_ROWS; r++) {                                                    \
                    const __m512bh w = (__m512bh)_mm512_set1_epi32((int)probs[r * pw + (k - tb0) * 8 + m]); \
                    for (int c = 0; c < HD / 16; c++)                                                    \
                        o[r][c] = _mm512_dpbf16_ps(o[r][c], (__m512bh)v[m * (HD / 16) + c], w);           \
                }                                                                                        \
        }                                                                                                \
        for (int r = 0; r < TILE_ROWS; r++)                                                              \
            for (int c = 0; c < HD / 16; c++) _mm512_storeu_ps(acc + r * HD + c * 16, o[r][c]);          \
    }

DEFINE_PREFILL_TILE_DOT(64, 4)
DEFINE_PREFILL_TILE_DOT(128, 2)

/* One work item (query tokens i0..i1 of KV head h) of prefill attention on bfloat16 pools with the dot
 * products; qp, acc: `padded` rows (token * groups + g) of head_dim / 2 pairs and head_dim floats;
 * chunk: prefill_chunk_floats(head_dim) floats. */
static void prefill_item_dot(const uint16_t *q, int64_t q_stride, const uint16_t *k_pool, const uint16_t *v_pool,
                             const int64_t *table, uint16_t *out, int64_t i0, int64_t i1, int64_t h, int64_t cached,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t window,
                             float scale, int64_t padded, uint32_t *qp, float *acc, float *run_max,
                             float *run_sum, float *chunk) {
    const int64_t groups = num_heads / num_kv_heads, tile = head_dim == 64 ? 4 : 2;
    const int64_t head_elems = head_dim * 16, block_elems = num_kv_heads * head_elems;
    const int64_t rows = (i1 - i0) * groups, half = head_dim / 2;
    for (int64_t e = 0; e < padded * half; e++) qp[e] = 0;
    for (int64_t e = 0; e < padded * head_dim; e++) acc[e] = 0.0f;
    for (int64_t r = 0; r < padded; r++) {
        run_max[r] = -INFINITY;
        run_sum[r] = 0.0f;
    }
    for (int64_t i = i0; i < i1; i++) /* the rows of a token: its query heads of KV head h, as pairs */
        memcpy(qp + (i - i0) * groups * half, q + i * q_stride + h * groups * head_dim,
               (size_t)(groups * head_dim) * sizeof(uint16_t));
    int64_t pos[padded], first[padded];
    prefill_row_spans(rows, padded, groups, cached + i0, window, pos, first);
    /* The chunk's blocks: head_dim / 2 key row pairs, then 8 token pairs x head_dim / 16 value halves. */
    __m512i *kp = (__m512i *)(((uintptr_t)chunk + 63) & ~(uintptr_t)63);
    __m512i *vp = kp + PREFILL_CHUNK_BLOCKS * half;
    float *scores = (float *)(vp + PREFILL_CHUNK_BLOCKS * half);
    uint32_t *probs = (uint32_t *)(scores + 4 * PREFILL_CHUNK_BLOCKS * 16);
    const int64_t b_first = prefill_first_key(cached + i0, window) / 16, b_last = (cached + i1 - 1) / 16;
    for (int64_t cb = b_first / PREFILL_CHUNK_BLOCKS * PREFILL_CHUNK_BLOCKS; cb <= b_last; cb += PREFILL_CHUNK_BLOCKS) {
        const int64_t c0 = cb > b_first ? cb : b_first;
        const int64_t c1 = cb + PREFILL_CHUNK_BLOCKS <= b_last + 1 ? cb + PREFILL_CHUNK_BLOCKS : b_last + 1;
        for (int64_t b = c0; b < c1; b++) {
            const uint16_t *kb = k_pool + table[b] * block_elems + h * head_elems;
            const uint16_t *vb = v_pool + table[b] * block_elems + h * head_elems;
            __m512i *kd = kp + (b - cb) * half, *vd = vp + (b - cb) * 8 * (head_dim / 16);
            for (int64_t i = 0; i < half; i++) kd[i] = pair_key_rows(_mm512_loadu_si512(kb + 32 * i));
            for (int64_t m = 0; m < 8; m++)
                for (int64_t c = 0; c < head_dim / 32; c++) {
                    const __m512i a = _mm512_loadu_si512(vb + 2 * m * head_dim + 32 * c);
                    const __m512i bb = _mm512_loadu_si512(vb + (2 * m + 1) * head_dim + 32 * c);
                    vd[m * (head_dim / 16) + 2 * c] = _mm512_unpacklo_epi16(a, bb);
                    vd[m * (head_dim / 16) + 2 * c + 1] = _mm512_unpackhi_epi16(a, bb);
                }
        }
        for (int64_t r0 = 0; r0 < rows; r0 += tile) {
            /* the blocks of this chunk that the tile's rows attend */
            int64_t lo = INT64_MAX, hi = -1;
            for (int64_t r = r0; r < r0 + tile && r < rows; r++) {
                lo = first[r] / 16 < lo ? first[r] / 16 : lo;
                hi = pos[r] / 16 > hi ? pos[r] / 16 : hi;
            }
            const int64_t tb0 = lo > c0 ? lo : c0, tb1 = hi + 1 < c1 ? hi + 1 : c1;
            if (tb0 >= tb1) continue;
            if (head_dim == 64) {
                prefill_tile_dot_64(kp, vp, cb, tb0, tb1, qp + r0 * half, scale, acc + r0 * head_dim, run_max + r0,
                                    run_sum + r0, pos + r0, first + r0, scores, probs);
            } else {
                prefill_tile_dot_128(kp, vp, cb, tb0, tb1, qp + r0 * half, scale, acc + r0 * head_dim, run_max + r0,
                                     run_sum + r0, pos + r0, first + r0, scores, probs);
            }
        }
    }
    float row[128];
    for (int64_t r = 0; r < rows; r++) { /* normalise, undo the unpack order (see decode_item_dot) */
        const float inv = 1.0f / run_sum[r], *a = acc + r * head_dim;
        for (int64_t c = 0; c < head_dim; c += 32)
            for (int L = 0; L < 4; L++)
                for (int j = 0; j < 4; j++) {
                    row[c + 8 * L + j] = a[c + 4 * L + j] * inv;
                    row[c + 8 * L + 4 + j] = a[c + 16 + 4 * L + j] * inv;
                }
        const int64_t i = i0 + r / groups, g = r % groups;
        store_floats(out, (i * num_heads + h * groups + g) * head_dim, head_dim, PAGELLM_BF16, row);
    }
}
#endif

/* q: [q_len, num_heads, head_dim] with q_stride elements between tokens; out: [q_len, num_heads,
 * head_dim] contiguous; table: the sequence's block ids; query i is at position cached + i.
 * Returns 0, or -1 for a shape it was not written for (nothing done). */
int pagellm_paged_prefill_attention(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool,
                                    const int64_t *table, void *out, int64_t q_len, int64_t cached,
                                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                    int64_t block_size, int64_t window, float scale, int dtype, int num_threads,
                                    float *scratch) {
    if (block_size != 16 || (head_dim != 64 && head_dim != 128)) return -1;
    const int64_t tile = head_dim == 64 ? 4 : 2;
    const int64_t groups = num_heads / num_kv_heads;
    const int64_t head_elems = head_dim * block_size;
    const int64_t block_elems = num_kv_heads * head_elems;
    const int64_t tokens = q_len / PREFILL_TOKENS * num_kv_heads >= 4 * num_threads ? PREFILL_TOKENS : PREFILL_TOKENS_FEW;
    const int64_t q_blocks = (q_len + tokens - 1) / tokens;
    const int64_t per_thread = pagellm_prefill_scratch_floats(num_heads, num_kv_heads, head_dim);
    const int64_t padded = prefill_rows(tokens, groups);
#pragma omp parallel num_threads(num_threads)
    {
        float *qf = scratch + omp_get_thread_num() * per_thread; /* [padded][head_dim]: row = token * groups + g */
        float *acc = qf + padded * head_dim;
        float *run_max = acc + padded * head_dim;
        float *run_sum = run_max + padded;
        float *keys = run_sum + padded;    /* [head_dim][16] */
        float *values = keys + head_elems; /* [16][head_dim] */
        float *chunk = values + head_elems;  /* prefill_item_dot's chunk buffers */
        (void)chunk;                         /* (unused where that path is not compiled in) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < q_blocks * num_kv_heads; item++) {
            const int64_t h = item % num_kv_heads;
            const int64_t i0 = item / num_kv_heads * tokens;
            const int64_t i1 = i0 + tokens < q_len ? i0 + tokens : q_len;
            const int64_t rows = (i1 - i0) * groups;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
            if (dtype == PAGELLM_BF16 && use_dot_products) {
                prefill_item_dot(q, q_stride, k_pool, v_pool, table, out, i0, i1, h, cached, num_heads,
                                 num_kv_heads, head_dim, window, scale, padded, (uint32_t *)qf, acc, run_max,
                                 run_sum, chunk);
                continue;
            }
#endif
            for (int64_t e = 0; e < padded * head_dim; e++) qf[e] = acc[e] = 0.0f;
            for (int64_t r = 0; r < padded; r++) {
                run_max[r] = -INFINITY;
                run_sum[r] = 0.0f;
            }
            for (int64_t i = i0; i < i1; i++) {
                float *qi = qf + (i - i0) * groups * head_dim;
                load_floats(q, i * q_stride + h * groups * head_dim, groups * head_dim, dtype, qi);
                for (int64_t e = 0; e < groups * head_dim; e++) qi[e] *= scale;
            }
            int64_t pos[padded], first[padded];
            prefill_row_spans(rows, padded, groups, cached + i0, window, pos, first);
            for (int64_t b = prefill_first_key(cached + i0, window) / 16; b <= (cached + i1 - 1) / 16; b++) {
                const int64_t base = table[b] * block_elems;
                load_floats(k_pool, base + h * head_elems, head_elems, dtype, keys);
                load_floats(v_pool, base + h * head_elems, head_elems, dtype, values);
                for (int64_t r0 = 0; r0 < rows; r0 += tile) {
                    int64_t lo[4], hi[4]; /* attended lanes of this block, per tile row */
                    if (!prefill_tile_lanes(b, tile, pos + r0, first + r0, lo, hi)) continue;
                    const int64_t at = r0 * head_dim;
                    if (head_dim == 64) {
                        prefill_tile_64(keys, values, qf + at, acc + at, run_max + r0, run_sum + r0, lo, hi);
                    } else {
                        prefill_tile_128(keys, values, qf + at, acc + at, run_max + r0, run_sum + r0, lo, hi);
                    }
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                const float inv = 1.0f / run_sum[r];
                for (int64_t d = 0; d < head_dim; d++) acc[r * head_dim + d] *= inv;
            }
            for (int64_t i = i0; i < i1; i++)
                store_floats(out, (i * num_heads + h * groups) * head_dim, groups * head_dim, dtype,
                             acc + (i - i0) * groups * head_dim);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- K/V writes
 * Each new token's K and V (rows of num_kv_heads * head_dim elements, of `elem` bytes, any stride
 * between rows: they are views of the fused qkv projection) go to its slot: each head's value row as
 * one copy, the key row scattered down its block's transposed columns. One call per layer instead of two
 * indexed PyTorch writes. A key row touches a cache line every 32 bytes of its block (the transposed
 * layout), so even a decode batch is spread over the threads. */
void pagellm_write_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, const int64_t *slots,
                      int64_t tokens, void *k_pool, void *v_pool, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t elem, int num_threads) {
    const int64_t row = num_kv_heads * head_dim;
#pragma omp parallel for schedule(static) if (tokens >= 8) num_threads(num_threads)
    for (int64_t i = 0; i < tokens; i++) {
        const int64_t b = slots[i] / block_size, o = slots[i] % block_size;
        for (int64_t h = 0; h < num_kv_heads; h++) /* value row of head h: [b][h][o][:] */
            memcpy((char *)v_pool + ((b * num_kv_heads + h) * block_size + o) * head_dim * elem,
                   (const char *)v + (i * v_stride + h * head_dim) * elem, (size_t)(head_dim * elem));
        const int64_t base = b * row * block_size + o; /* key element e of the token: base + e * block_size */
        if (elem == 2) {
            const uint16_t *src = (const uint16_t *)k + i * k_stride;
            uint16_t *dst = (uint16_t *)k_pool + base;
            for (int64_t e = 0; e < row; e++) dst[e * block_size] = src[e];
        } else {
            const uint32_t *src = (const uint32_t *)k + i * k_stride;
            uint32_t *dst = (uint32_t *)k_pool + base;
            for (int64_t e = 0; e < row; e++) dst[e * block_size] = src[e];
        }
    }
}

/* Whether value v at index i replaces the maximum m found at index idx (the first maximum wins;
 * NaN is greater than everything, as in torch.argmax). */
static inline int takes_over(float v, int64_t i, float m, int64_t idx) {
    if (isnan(v)) return !isnan(m) || i < idx;
    return !isnan(m) && (v > m || (v == m && i < idx));
}

/* For each row of float32 logits [rows, vocab]: the index of its first maximum (as torch.argmax) and
 * log(sum(exp(row))), in one pass each over the row; rows are spread over the threads. A NaN counts as
 * the maximum (as in torch.argmax); -inf entries add exp(-87), nothing next to the maximum's 1. lse NULL:
 * the argmax only. The sampler needs both where a request asks for logprobs (greedy token, and its logprob =
 * logit - logsumexp), and PyTorch's argmax and log_softmax each take about a millisecond per 40 x 32000
 * logits on this kind of CPU. */
void pagellm_argmax_logsumexp(const float *logits, int64_t rows, int64_t vocab, /* vocab < 2^31 */ int64_t *argmax, float *lse,
                              int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * vocab;
        /* 16 lanes, each keeping the first maximum of its positions (strictly greater replaces). */
        f32x16 lane_max, v;
        i32x16 lane_idx = {0}, position = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        for (int j = 0; j < 16; j++) lane_max[j] = x[0];
        int64_t t = 0;
        for (; t + 16 <= vocab; t += 16, position += 16) {
            memcpy(&v, x + t, sizeof v);
            const i32x16 greater = (v > lane_max) | (v != v); /* all ones where true; NaN counts as greatest */
            lane_max = (f32x16)(((i32x16)v & greater) | ((i32x16)lane_max & ~greater));
            lane_idx = (position & greater) | (lane_idx & ~greater);
        }
        float m = x[0];
        int64_t idx = 0;
        for (int j = 0; j < 16; j++)
            if (takes_over(lane_max[j], lane_idx[j], m, idx)) {
                m = lane_max[j];
                idx = lane_idx[j];
            }
        for (; t < vocab; t++)
            if (takes_over(x[t], t, m, idx)) {
                m = x[t];
                idx = t;
            }
        argmax[r] = idx;
        if (lse == NULL) continue; /* the argmax alone */
        if (!isfinite(m)) { /* as torch: NaN, +inf, or -inf for a row of -inf */
            lse[r] = m;
            continue;
        }
        float lane_sum[16] = {0};
        for (t = 0; t + 16 <= vocab; t += 16)
            for (int j = 0; j < 16; j++) lane_sum[j] += fast_exp(x[t + j] - m);
        float sum = 0.0f;
        for (int j = 0; j < 16; j++) sum += lane_sum[j];
        for (; t < vocab; t++) sum += fast_exp(x[t] - m);
        lse[r] = m + logf(sum);
    }
}

/* ---------------------------------------------------------------- element-wise layers
 * Each follows PyTorch's own sequence of operations, including bfloat16's rounding after every
 * operation that PyTorch stores in bfloat16: the rotary embedding gives the PyTorch path's values
 * exactly, RMSNorm to rounding (its sum of squares adds in another order). */

/* Round a float32 to the nearest bfloat16, returned as float32. */
static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) <= 0x7f800000u) u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float as_stored(float f, int dtype) { return dtype == PAGELLM_BF16 ? round_bf16(f) : f; }

/* out = weight * (x * rsqrt(mean(x^2) + eps)) per row, the norm in float32 (as transformers' RMSNorm).
 * With `add` (the residual stream), x + add is normed instead and stored to `sum` first (rounded to
 * the dtype, as PyTorch's addition): the residual addition and the next norm in one pass. */
void pagellm_rms_norm(const void *x, const void *add, void *sum, const void *weight, void *out, int64_t rows,
                      int64_t hidden, float eps, int dtype, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        float row[hidden], other[hidden], w[hidden];
        load_floats(weight, 0, hidden, dtype, w);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            load_floats(x, r * hidden, hidden, dtype, row);
            if (add != NULL) {
                load_floats(add, r * hidden, hidden, dtype, other);
                for (int64_t i = 0; i < hidden; i++) row[i] = as_stored(row[i] + other[i], dtype);
                store_floats(sum, r * hidden, hidden, dtype, row);
            }
            float lane[16] = {0};
            int64_t i = 0;
            for (; i + 16 <= hidden; i += 16)
                for (int j = 0; j < 16; j++) lane[j] += row[i + j] * row[i + j];
            float total = 0.0f;
            for (int j = 0; j < 16; j++) total += lane[j];
            for (; i < hidden; i++) total += row[i] * row[i];
            const float inv = 1.0f / sqrtf(total / (float)hidden + eps);
            for (i = 0; i < hidden; i++) row[i] = as_stored(w[i] * as_stored(row[i] * inv, dtype), dtype);
            store_floats(out, r * hidden, hidden, dtype, row);
        }
    }
}

/* out[r] = silu(gate) * up for each row [gate | up] of gate_up (2 * inter wide), rounded after each
 * operation as PyTorch's two ops round (silu(g) = g / (1 + exp(-g)); exp to about 1 ulp). */
void pagellm_silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int dtype,
                          int num_threads) {
    const int64_t chunk = 256; /* columns per work item: large rows split across threads too */
    const int64_t pieces = (inter + chunk - 1) / chunk;
#pragma omp parallel num_threads(num_threads)
    {
        float g[chunk], u[chunk];
#pragma omp for schedule(static)
        for (int64_t item = 0; item < rows * pieces; item++) {
            const int64_t r = item / pieces, c0 = item % pieces * chunk;
            const int64_t n = inter - c0 < chunk ? inter - c0 : chunk;
            load_floats(gate_up, r * 2 * inter + c0, n, dtype, g);
            load_floats(gate_up, r * 2 * inter + inter + c0, n, dtype, u);
            for (int64_t i = 0; i < n; i++) {
                const float e = g[i] < -88.0f ? INFINITY : fast_exp(-g[i]); /* exp overflows there: silu is -0 */
                g[i] = as_stored(as_stored(g[i] / (1.0f + e), dtype) * u[i], dtype);
            }
            store_floats(out, r * inter + c0, n, dtype, g);
        }
    }
}

/* In place on the first `heads` heads of each token's row (q then k heads of a fused qkv output):
 * x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) (neox style). cos, sin: float32 tables
 * [max_position, head_dim], rounded to the activations' dtype first (as the PyTorch path does). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off"))) /* PyTorch rounds the products before adding */
#endif
void pagellm_rotary(void *qk, int64_t tokens, int64_t row_stride, int64_t heads, int64_t head_dim,
                    const int64_t *positions, const float *cos_table, const float *sin_table, int dtype,
                    int num_threads) {
#pragma STDC FP_CONTRACT OFF /* clang's spelling of the same */
    const int64_t half = head_dim / 2;
#pragma omp parallel num_threads(num_threads)
    {
        float c[head_dim], s[head_dim], x[head_dim], y[head_dim];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) {
            for (int64_t i = 0; i < head_dim; i++) {
                c[i] = as_stored(cos_table[positions[t] * head_dim + i], dtype);
                s[i] = as_stored(sin_table[positions[t] * head_dim + i], dtype);
            }
            for (int64_t h = 0; h < heads; h++) {
                const int64_t offset = t * row_stride + h * head_dim;
                load_floats(qk, offset, head_dim, dtype, x);
                for (int64_t i = 0; i < half; i++) {
                    y[i] = as_stored(as_stored(x[i] * c[i], dtype) + as_stored(-x[i + half] * s[i], dtype), dtype);
                    y[i + half] = as_stored(as_stored(x[i + half] * c[i + half], dtype)
                                            + as_stored(x[i] * s[i + half], dtype), dtype);
                }
                store_floats(qk, offset, head_dim, dtype, y);
            }
        }
    }
}

/* ---------------------------------------------------------------- bfloat16 linear layers
 * y[M, N] = x[M, K] @ w[N, K]^T (+ bias), bfloat16 in, bfloat16 out (or those values as float32),
 * float32 sums, on the AVX512-BF16 dot products. oneDNN reaches the same rate at prefill's large M, but at decode's M (a few to a few
 * dozen rows) it leaves 15-50% of the multiply rate unused; this kernel keeps a register tile of up
 * to LINEAR_ROWS rows x 32 columns busy whatever M is. Not used where the CPU has AMX (oneDNN's tile
 * instructions are far faster there) nor where the dot products are missing.
 *
 * The weight is packed once into panels of 32 output columns: panel p holds, for each pair of input
 * columns (k, k + 1), the 32 pairs (w[n, k], w[n, k + 1]) as 32-bit words, so one dot-product
 * instruction multiplies a broadcast pair of x by 16 columns' pairs. Every output element adds its
 * pairs in the same order whatever M or its row is: a row's result does not depend on the batch. */

#define LINEAR_COLS 32 /* output columns per weight panel: two vectors of 16 float32 sums */
#define LINEAR_ROWS 12 /* most rows per register tile: 24 accumulators of the 32 vector registers */
#define LINEAR_CHUNK_BYTES (512 << 10) /* inputs a panel passes over before the next panel: in L2 with the panel (half of a 1 MiB L2: with 1 MiB, K = 1,408 ran 11% slower) */
#define LINEAR_PREFETCH_BYTES (512 << 10) /* larger panels (K > 8192) are not prefetched: they would evict the inputs */

int pagellm_linear_bf16_supported(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(__AMX_BF16__)
    return 1;
#else
    return 0;
#endif
}

/* Output modes of pagellm_linear_bf16. */
enum { LINEAR_BF16 = 0, LINEAR_F32 = 1, LINEAR_SILU_GATED = 2 };

/* Panels of a weight of n rows (output columns): 32 rows each or, gated, 16 gate and 16 up rows. */
static inline int64_t linear_panels(int64_t n, int gated) {
    return gated ? (n / 2 + LINEAR_COLS / 2 - 1) / (LINEAR_COLS / 2) : (n + LINEAR_COLS - 1) / LINEAR_COLS;
}

/* 32-bit words of a weight of N x K packed by pagellm_pack_linear_weight. */
int64_t pagellm_linear_packed_words(int64_t n, int64_t k, int gated) {
    return linear_panels(n, gated) * LINEAR_COLS * ((k + 1) / 2);
}

/* One pair (x[2j], x[2j + 1]) of a row as a 32-bit word; an odd K's last pair gets a zero. */
static inline uint32_t bf16_pair(const uint16_t *row, int64_t j, int64_t k) {
    const uint32_t hi = 2 * j + 1 < k ? row[2 * j + 1] : 0;
    return (uint32_t)row[2 * j] | hi << 16;
}

/* The weight row (output column) behind column c of panel p, or -1 past the weight's edge. Gated
 * (w = [gate; up], n / 2 rows each): panel p holds gate rows 16p.. then the up rows at the same
 * offsets, so that one register tile holds both halves of 16 outputs. */
static inline int64_t panel_column(int64_t p, int64_t c, int64_t n, int gated) {
    if (!gated) return p * LINEAR_COLS + c < n ? p * LINEAR_COLS + c : -1;
    const int64_t half = LINEAR_COLS / 2, col = p * half + c % half;
    return col < n / 2 ? col + (c < half ? 0 : n / 2) : -1;
}

/* w: [n, k] bfloat16, row-major; out: pagellm_linear_packed_words(n, k, gated) words, columns past
 * the edges zero. gated: w is [gate; up] (n even), for the LINEAR_SILU_GATED mode. */
void pagellm_pack_linear_weight(const uint16_t *w, int64_t n, int64_t k, int gated, uint32_t *out, int num_threads) {
    const int64_t pairs = (k + 1) / 2, panels = linear_panels(n, gated);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t j = 0; j < pairs; j++)
            for (int64_t c = 0; c < LINEAR_COLS; c++) {
                const int64_t col = panel_column(p, c, n, gated);
                out[(p * pairs + j) * LINEAR_COLS + c] = col >= 0 ? bf16_pair(w + col * k, j, k) : 0;
            }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* Rows [r0, r0 + rows) of y (row stride n) for one panel. x_pairs: those rows' pairs, pair-major
 * ([pairs][rows]), so that each broadcast reads the next word. bias0/bias1: the bias of the panel's
 * two halves (or NULL); mask0/mask1: their columns that exist. y, by mode: bfloat16; float32 (the
 * bfloat16 value widened); or, gated, 16 bfloat16 silu(gate) * up from the halves, each half rounded
 * to bfloat16 first and every step rounded as PyTorch's silu then multiply (as pagellm_silu_and_mul
 * on the bfloat16 output). */
static inline __attribute__((always_inline)) void linear_tile(const uint32_t *x_pairs, const int rows,
                                                              int64_t pairs, const uint32_t *panel,
                                                              const float *bias0, const float *bias1, void *y,
                                                              int64_t n, __mmask16 mask0, __mmask16 mask1,
                                                              const uint32_t *next_panel, int mode) {
    __m512 acc[LINEAR_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; j++) {
        if (next_panel != NULL) {
            _mm_prefetch((const char *)(next_panel + j * LINEAR_COLS), _MM_HINT_T1);
            _mm_prefetch((const char *)(next_panel + j * LINEAR_COLS + 16), _MM_HINT_T1);
        }
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + j * LINEAR_COLS);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + j * LINEAR_COLS + 16);
        for (int r = 0; r < rows; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)x_pairs[j * rows + r]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
        }
    }
    for (int r = 0; r < rows; r++) {
        __m512 v0 = acc[r][0], v1 = acc[r][1];
        if (bias0 != NULL) {
            v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(mask0, bias0));
            v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(mask1, bias1));
        }
        const __m256bh y0 = _mm512_cvtneps_pbh(v0), y1 = _mm512_cvtneps_pbh(v1); /* nearest even */
        if (mode == LINEAR_SILU_GATED) {
            const __m512 gate = _mm512_cvtpbh_ps(y0), up = _mm512_cvtpbh_ps(y1);
            /* silu(g) = g / (1 + exp(-g)); exp overflows below -88, where silu is -0 */
            const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gate), _mm512_set1_epi32((int)0x80000000u)));
            const __mmask16 huge = _mm512_cmp_ps_mask(gate, _mm512_set1_ps(-88.0f), _CMP_LT_OQ);
            const __m512 e = _mm512_mask_blend_ps(huge, exp16(neg), _mm512_set1_ps(INFINITY));
            const __m512 silu = round_bf16x16(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            const __m512 out = round_bf16x16(_mm512_mul_ps(silu, up));
            _mm256_mask_storeu_epi16((uint16_t *)y + r * n, mask0, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(out), 16)));
        } else if (mode == LINEAR_F32) {
            _mm512_mask_storeu_ps((float *)y + r * n, mask0, _mm512_cvtpbh_ps(y0));
            _mm512_mask_storeu_ps((float *)y + r * n + 16, mask1, _mm512_cvtpbh_ps(y1));
        } else {
            _mm256_mask_storeu_epi16((uint16_t *)y + r * n, mask0, (__m256i)y0);
            _mm256_mask_storeu_epi16((uint16_t *)y + r * n + 16, mask1, (__m256i)y1);
        }
    }
}

static inline __mmask16 lanes_below(int64_t count) {
    return count >= 16 ? (__mmask16)0xffff : count <= 0 ? (__mmask16)0 : (__mmask16)((1u << count) - 1);
}

/* A tile's inputs as pairs, pair-major: out[j * rows + r] = pair j of row r (rows <= 16). Each 16 pairs
 * of the rows are loaded as one vector per row (an odd K's last pair gets a zero: the load stops at K)
 * and transposed in registers, instead of one word at a time (which cost ~7% of a prefill step). */
static void pack_tile_pairs(const uint16_t *x, int64_t x_stride, int rows, int64_t k, uint32_t *out) {
    const int64_t pairs = (k + 1) / 2;
    const __mmask16 row_lanes = (__mmask16)((1u << rows) - 1u);
    for (int64_t j0 = 0; j0 < pairs; j0 += 16) {
        const int64_t elems = k - 2 * j0; /* elements of each row from pair j0 on */
        const __mmask32 load = elems >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << elems) - 1u);
        if (rows == 1) { /* nothing to transpose */
            _mm512_mask_storeu_epi32(out + j0, lanes_below((elems + 1) / 2), _mm512_maskz_loadu_epi16(load, x + 2 * j0));
            continue;
        }
        __m512i a[16], b[16];
        for (int r = 0; r < 16; r++)
            a[r] = r < rows ? _mm512_maskz_loadu_epi16(load, x + r * x_stride + 2 * j0) : _mm512_setzero_si512();
        for (int i = 0; i < 8; i++) { /* within each 128-bit lane: 32-bit words of rows 2i, 2i + 1 interleaved */
            b[2 * i] = _mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]);
            b[2 * i + 1] = _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]);
        }
        for (int i = 0; i < 4; i++) { /* a[4i + m], lane L: rows 4i..4i+3 of pair 4L + m */
            a[4 * i] = _mm512_unpacklo_epi64(b[4 * i], b[4 * i + 2]);
            a[4 * i + 1] = _mm512_unpackhi_epi64(b[4 * i], b[4 * i + 2]);
            a[4 * i + 2] = _mm512_unpacklo_epi64(b[4 * i + 1], b[4 * i + 3]);
            a[4 * i + 3] = _mm512_unpackhi_epi64(b[4 * i + 1], b[4 * i + 3]);
        }
        for (int m = 0; m < 4; m++) { /* b[4L + m]: pair 4L + m of rows 0..15 */
            const __m512i d0 = _mm512_shuffle_i32x4(a[m], a[4 + m], 0x88), d1 = _mm512_shuffle_i32x4(a[m], a[4 + m], 0xdd);
            const __m512i e0 = _mm512_shuffle_i32x4(a[8 + m], a[12 + m], 0x88), e1 = _mm512_shuffle_i32x4(a[8 + m], a[12 + m], 0xdd);
            b[m] = _mm512_shuffle_i32x4(d0, e0, 0x88);
            b[8 + m] = _mm512_shuffle_i32x4(d0, e0, 0xdd);
            b[4 + m] = _mm512_shuffle_i32x4(d1, e1, 0x88);
            b[12 + m] = _mm512_shuffle_i32x4(d1, e1, 0xdd);
        }
        const int64_t n = pairs - j0 < 16 ? pairs - j0 : 16;
        for (int64_t i = 0; i < n; i++) _mm512_mask_storeu_epi32(out + (j0 + i) * rows, row_lanes, b[i]);
    }
}

/* The mode is a constant in each copy, so that each compiles as the tile did without the option (with
 * the flag as a variable, alternating A/B runs measured up to 4% slower on a noisy machine). */
#define LINEAR_TILE_OUT(ROWS, MODE) \
    linear_tile(x_pairs + r0 * pairs, ROWS, pairs, panel, b0, b1, \
                MODE == LINEAR_F32 ? (void *)((float *)y + r0 * y_cols + col0) : (void *)((uint16_t *)y + r0 * y_cols + col0), \
                y_cols, mask0, mask1, t == t0 && p + 1 < p_end && prefetch ? panel + pairs * LINEAR_COLS : NULL, MODE)
#define LINEAR_TILE(ROWS) \
    case ROWS: \
        if (mode == LINEAR_F32) LINEAR_TILE_OUT(ROWS, LINEAR_F32); \
        else if (mode == LINEAR_SILU_GATED) LINEAR_TILE_OUT(ROWS, LINEAR_SILU_GATED); \
        else LINEAR_TILE_OUT(ROWS, LINEAR_BF16); \
        break;
#endif

/* x: [m, k] bfloat16 with x_stride elements between rows; w: an n x k weight packed by
 * pagellm_pack_linear_weight (gated for LINEAR_SILU_GATED); bias: n float32 or NULL. y by mode:
 * LINEAR_BF16, [m, n] bfloat16; LINEAR_F32, [m, n] float32 holding the same bfloat16 values (what a
 * float() after the layer gives, without that pass); LINEAR_SILU_GATED, [m, n / 2] bfloat16
 * silu(gate) * up of the two halves of the bfloat16 result (the MLP's activation without storing
 * and reading back the gate and up projections). Contiguous. Returns -1 where the kernel is not
 * compiled in (check pagellm_linear_bf16_supported first), -2 without memory, -3 for an unknown mode,
 * else 0. */
int pagellm_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint32_t *w, int64_t n,
                        const float *bias, void *y, int mode, int num_threads) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (mode != LINEAR_BF16 && mode != LINEAR_F32 && mode != LINEAR_SILU_GATED) return -3;
    const int gated = mode == LINEAR_SILU_GATED;
    const int64_t pairs = (k + 1) / 2, panels = linear_panels(n, gated), y_cols = gated ? n / 2 : n;
    /* Rows go in tiles of equal size (41 rows: 11 + 10 + 10 + 10, not 12 + 12 + 12 + 5). */
    const int64_t tiles = (m + LINEAR_ROWS - 1) / LINEAR_ROWS, small = m / (tiles ? tiles : 1), big = m % (tiles ? tiles : 1);
    const int64_t chunk_tiles = pairs ? LINEAR_CHUNK_BYTES / (LINEAR_ROWS * pairs * 4) + 1 : tiles + 1;
    const int prefetch = pairs * LINEAR_COLS * 4 <= LINEAR_PREFETCH_BYTES;
    uint32_t *x_pairs = malloc((size_t)(m * pairs + 1) * sizeof(uint32_t));
    if (x_pairs == NULL) return -2;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t r0 = t * small + (t < big ? t : big), rows = small + (t < big);
            pack_tile_pairs(x + r0 * x_stride, x_stride, (int)rows, k, x_pairs + r0 * pairs);
        }
        /* Every panel streams the inputs of all its rows: at prefill's M those are taken a chunk of
         * about LINEAR_CHUNK_BYTES at a time (they stay in cache while each panel passes over them). */
        for (int64_t t0 = 0; t0 < tiles; t0 += chunk_tiles) {
            const int64_t t1 = t0 + chunk_tiles < tiles ? t0 + chunk_tiles : tiles;
            /* Each thread takes a contiguous run of panels (what `schedule(static)` would give), so
             * that its last panel does not prefetch the next thread's first. */
            const int nt = omp_get_num_threads(), id = omp_get_thread_num();
            const int64_t p_begin = panels * id / nt, p_end = panels * (id + 1) / nt;
            for (int64_t p = p_begin; p < p_end; p++) {
                const uint32_t *panel = w + p * pairs * LINEAR_COLS;
                /* the panel's first output column and the weight rows of its two halves */
                const int64_t col0 = gated ? p * LINEAR_COLS / 2 : p * LINEAR_COLS;
                const int64_t row0 = panel_column(p, 0, n, gated), row1 = panel_column(p, LINEAR_COLS / 2, n, gated);
                const __mmask16 mask0 = lanes_below(gated ? y_cols - col0 : n - col0);
                const __mmask16 mask1 = gated ? mask0 : lanes_below(n - col0 - 16);
                const float *b0 = bias != NULL ? bias + row0 : NULL;
                const float *b1 = bias != NULL ? bias + (row1 >= 0 ? row1 : row0) : NULL; /* (masked off) */
                for (int64_t t = t0; t < t1; t++) {
                    const int64_t r0 = t * small + (t < big ? t : big);
                    switch (small + (t < big)) {
                        LINEAR_TILE(1) LINEAR_TILE(2) LINEAR_TILE(3) LINEAR_TILE(4) LINEAR_TILE(5) LINEAR_TILE(6)
                        LINEAR_TILE(7) LINEAR_TILE(8) LINEAR_TILE(9) LINEAR_TILE(10) LINEAR_TILE(11) LINEAR_TILE(12)
                    }
                }
            }
        }
    }
    free(x_pairs);
    return 0;
#else
    (void)x; (void)x_stride; (void)m; (void)k; (void)w; (void)n; (void)bias; (void)y; (void)mode;
    (void)num_threads;
    return -1;
#endif
}

/* ---------------------------------------------------------------- decode steps in one call
 * A decode-only step of a Llama-family model (pagellm/model/llama.py) runs the same kernels in the
 * same order for every layer; from Python that is nine calls a layer, ~1 ms of interpreter time
 * a step (4% of a 41-sequence step of W1's model, 15-25% of the small steps at the end of a batch).
 * pagellm_decode_layers makes those calls itself: DecoderLayer.forward's order, written out once
 * more, for bfloat16 models whose linears are all packed for the native kernel. Tests check that it
 * gives the Python path's bits (tests/model/test_native_decode.py). */

typedef struct {
    const uint16_t *input_norm, *post_norm;                 /* RMSNorm weights [hidden], bfloat16 */
    const uint32_t *qkv, *o, *gate_up, *down;               /* packed weights (gate_up gated) */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* float32 [out] or NULL */
    void *k_pool, *v_pool;                                  /* this layer's KV pools */
} pagellm_decode_layer;

typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, inter, block_size, max_blocks, window;
    float eps, scale;
    const int64_t *positions, *slots, *tables, *lens; /* per row: position, KV slot, block table, context */
    const int64_t *cascade;                           /* runs sharing their first blocks (see above) */
    int64_t num_cascade;
    const float *cos, *sin;                           /* rotary tables [max_position, head_dim] */
    float *attention_scratch;                         /* num_threads * pagellm_scratch_floats(...) */
    uint16_t *normed, *qkv, *attention, *act;         /* work: rows x hidden, x qkv width, x heads * head_dim, x inter */
    const uint16_t *final_norm;                       /* the model's last RMSNorm [hidden], or NULL */
    float final_eps;
} pagellm_decode_step;

/* x: [rows, hidden] bfloat16, the embeddings in and the last layer's MLP output out; residual:
 * [rows, hidden], the running sum before that output (what DecoderLayer.forward returns). With
 * final_norm, the model's last norm follows: residual becomes the whole sum and x its normed rows
 * (what the model's forward returns). Returns 0, -1 where the linear kernel is not compiled in, -2
 * without memory. */
int pagellm_decode_layers(const pagellm_decode_layer *layers, int64_t num_layers, const pagellm_decode_step *s,
                          uint16_t *x, uint16_t *residual, int num_threads) {
    const int64_t q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim;
    const int64_t width = q_size + 2 * kv_size, rows = s->rows;
    for (int64_t l = 0; l < num_layers; l++) {
        const pagellm_decode_layer *w = &layers[l];
        if (l == 0) { /* the residual stream starts as the embeddings */
            memcpy(residual, x, (size_t)(rows * s->hidden) * sizeof(uint16_t));
            pagellm_rms_norm(x, NULL, NULL, w->input_norm, s->normed, rows, s->hidden, s->eps, PAGELLM_BF16,
                             num_threads);
        } else {
            pagellm_rms_norm(x, residual, residual, w->input_norm, s->normed, rows, s->hidden, s->eps, PAGELLM_BF16,
                             num_threads);
        }
        int status = pagellm_linear_bf16(s->normed, s->hidden, rows, s->hidden, w->qkv, width, w->qkv_bias, s->qkv,
                                         LINEAR_BF16, num_threads);
        if (status != 0) return status;
        pagellm_rotary(s->qkv, rows, width, s->heads + s->kv_heads, s->head_dim, s->positions, s->cos, s->sin,
                       PAGELLM_BF16, num_threads);
        pagellm_write_kv(s->qkv + q_size, width, s->qkv + q_size + kv_size, width, s->slots, rows, w->k_pool,
                         w->v_pool, s->kv_heads, s->head_dim, s->block_size, 2, num_threads);
        pagellm_paged_decode_attention(s->qkv, width, w->k_pool, w->v_pool, s->tables, s->lens, s->attention, rows,
                                       s->heads, s->kv_heads, s->head_dim, s->block_size, s->max_blocks, s->window,
                                       s->scale, PAGELLM_BF16, num_threads, s->attention_scratch, s->cascade,
                                       s->num_cascade);
        status = pagellm_linear_bf16(s->attention, q_size, rows, q_size, w->o, s->hidden, w->o_bias, x, LINEAR_BF16,
                                     num_threads);
        if (status != 0) return status;
        pagellm_rms_norm(x, residual, residual, w->post_norm, s->normed, rows, s->hidden, s->eps, PAGELLM_BF16,
                         num_threads);
        status = pagellm_linear_bf16(s->normed, s->hidden, rows, s->hidden, w->gate_up, 2 * s->inter, w->gate_up_bias,
                                     s->act, LINEAR_SILU_GATED, num_threads);
        if (status != 0) return status;
        status = pagellm_linear_bf16(s->act, s->inter, rows, s->inter, w->down, s->hidden, w->down_bias, x, LINEAR_BF16,
                                     num_threads);
        if (status != 0) return status;
    }
    if (s->final_norm != NULL) /* in place: each row is read before its normed values are stored */
        pagellm_rms_norm(x, residual, residual, s->final_norm, x, rows, s->hidden, s->final_eps, PAGELLM_BF16,
                         num_threads);
    return 0;
}
