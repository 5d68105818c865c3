/* Paged prefill attention.
 * The new tokens of one sequence (a prompt, or a chunk of one after `cached` tokens) attend causally
 * over everything in the pool up to their own position (their own K/V already written), read in
 * place through the block table. Flash-attention tiling with an online softmax: a work item is a
 * block of PREFILL_TOKENS query tokens and one KV head. The portable path converts each K/V block it
 * reads to float32 once, then scores it against TILE_ROWS query rows at a time whose scores and
 * outputs stay in vector registers, updating the softmax every block; the bfloat16 dot-product path
 * repacks up to PREFILL_CHUNK_BLOCKS blocks at a time and updates it once per such chunk (see
 * there). Written for block_size 16 (one key block row = one 16-float vector) and head_dim 64 or 128;
 * other shapes use PyTorch's flash kernel. */
#include "cpu_kernels.h"

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

#if defined(__AVX2__) && !defined(__AVX512F__)
/* AVX2: the same tile in 8-wide halves held in named registers (GCC keeps a 64-byte vector that it has
 * to split in memory, at every step): the scores of two rows at a time, then each row's outputs 64
 * dimensions at a time; the same sums in the same order, so the same bits. */

static inline f32x8 load8(const float *p) {
    f32x8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void prefill_tile_halves(
        int hd, int tile_rows, const float *kf, const float *vf, const float *q, float *acc, float *run_max,
        float *run_sum, const int64_t *lo, const int64_t *hi) {
    float s[4][16], p[4][16], rescale[4];
    for (int r = 0; r < tile_rows; r += 2) {
        f32x8 a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0};
        const float *q0 = q + r * hd, *q1 = q0 + hd;
        for (int d = 0; d < hd; d++) {
            const f32x8 k0 = load8(kf + d * 16), k1 = load8(kf + d * 16 + 8);
            a0 += q0[d] * k0, b0 += q0[d] * k1, a1 += q1[d] * k0, b1 += q1[d] * k1;
        }
        memcpy(s[r], &a0, sizeof a0), memcpy(s[r] + 8, &b0, sizeof b0);
        memcpy(s[r + 1], &a1, sizeof a1), memcpy(s[r + 1] + 8, &b1, sizeof b1);
    }
    for (int r = 0; r < tile_rows; r++) {
        float m = run_max[r];
        for (int64_t t = lo[r]; t < hi[r]; t++) m = s[r][t] > m ? s[r][t] : m;
        rescale[r] = run_max[r] == -INFINITY ? 0.0f : fast_exp(run_max[r] - m);
        float sum = 0.0f;
        for (int t = 0; t < 16; t++) {
            p[r][t] = t >= lo[r] && t < hi[r] ? fast_exp(s[r][t] - m) : 0.0f;
            sum += p[r][t];
        }
        run_max[r] = m;
        run_sum[r] = run_sum[r] * rescale[r] + sum;
    }
    for (int r = 0; r < tile_rows; r++) {
        for (int c = 0; c < hd; c += 64) {
            float *o = acc + r * hd + c;
            const f32x8 scale = {rescale[r], rescale[r], rescale[r], rescale[r], rescale[r], rescale[r], rescale[r],
                                 rescale[r]};
            f32x8 o0 = load8(o) * scale, o1 = load8(o + 8) * scale, o2 = load8(o + 16) * scale;
            f32x8 o3 = load8(o + 24) * scale, o4 = load8(o + 32) * scale, o5 = load8(o + 40) * scale;
            f32x8 o6 = load8(o + 48) * scale, o7 = load8(o + 56) * scale;
            for (int t = 0; t < 16; t++) {
                const float *v = vf + t * hd + c;
                const float w = p[r][t];
                o0 += w * load8(v), o1 += w * load8(v + 8), o2 += w * load8(v + 16), o3 += w * load8(v + 24);
                o4 += w * load8(v + 32), o5 += w * load8(v + 40), o6 += w * load8(v + 48), o7 += w * load8(v + 56);
            }
            const f32x8 rows[8] = {o0, o1, o2, o3, o4, o5, o6, o7};
            memcpy(o, rows, sizeof rows);
        }
    }
}

static void prefill_tile_64(const float *kf, const float *vf, const float *q, float *acc, float *run_max,
                            float *run_sum, const int64_t *lo, const int64_t *hi) {
    prefill_tile_halves(64, 4, kf, vf, q, acc, run_max, run_sum, lo, hi);
}

static void prefill_tile_128(const float *kf, const float *vf, const float *q, float *acc, float *run_max,
                             float *run_sum, const int64_t *lo, const int64_t *hi) {
    prefill_tile_halves(128, 2, kf, vf, q, acc, run_max, run_sum, lo, hi);
}
#else
/* Outputs of 4 rows (64) or 2 rows (128) fill 16 of the 32 vector registers. */
DEFINE_PREFILL_TILE(64, 4)
DEFINE_PREFILL_TILE(128, 2)
#endif

#if PAGELLM_DOT_PRODUCTS /* the dot-product path (to the matching #endif) */
/* The same attention with the bfloat16 dot products (see the decode path), its softmax taken over up to
 * PREFILL_CHUNK_BLOCKS key blocks at once: a tile of TILE_ROWS rows scores all its keys of a chunk
 * (stored, scaled), takes each row's maximum and exponentials over them with one reduction each, and
 * weighs the chunk's values in one pass with its outputs in registers. (Updating the online softmax
 * every 32 keys spent much of the kernel on reductions, rescales and output round trips.) Chunks are
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
    return prefill_block_lanes(b, pos, first, &l, &h) ? (__mmask16)(((1u << h) - 1u) & ~((1u << l) - 1u))
                                                      : (__mmask16)0;
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
#endif /* PAGELLM_DOT_PRODUCTS */

/* q: [q_len, num_heads, head_dim] with q_stride elements between tokens; out: [q_len, num_heads,
 * head_dim] contiguous; table: the sequence's block ids; query i is at position cached + i.
 * Returns 0, or -1 for a shape it was not written for (nothing done). */
int pagellm_paged_prefill_attention(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool,
                                    const int64_t *table, void *out, int64_t q_len, int64_t cached,
                                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                    int64_t block_size, int64_t window, float scale, int dtype, int kv_dtype,
                                    int num_threads, float *scratch) {
    if (block_size != 16 || (head_dim != 64 && head_dim != 128)) return -1;
    const int64_t tile = head_dim == 64 ? 4 : 2;
    const int64_t groups = num_heads / num_kv_heads;
    const int64_t head_elems = head_dim * block_size;
    const int64_t block_elems = num_kv_heads * head_elems;
    const int64_t tokens =
        q_len / PREFILL_TOKENS * num_kv_heads >= 4 * num_threads ? PREFILL_TOKENS : PREFILL_TOKENS_FEW;
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
#if PAGELLM_DOT_PRODUCTS /* the item on the dot products */
            if (dtype == PAGELLM_BF16 && kv_dtype == PAGELLM_BF16 && use_dot_products) {
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
                load_floats(k_pool, base + h * head_elems, head_elems, kv_dtype, keys);
                load_floats(v_pool, base + h * head_elems, head_elems, kv_dtype, values);
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
