/* Linear layers on weights kept in llama.cpp's block formats (quant_blocks.h), with the input rows
 * quantized to 8 bits: llama.cpp's and vLLM's way on a CPU, integer dot products instead of widening
 * every weight to a float.
 *
 * Each input row is cut into blocks of 32 and each block stored as int8 values xq = round(x / dx)
 * with dx = max|x| / 127 (Q8_0 of the activations), along with dx * sum(xq). Every weight format is
 * read in chunks of 32 elements: 32 small integers q, a scale per 16 (lanes 0-3 and 4-7 of a vector
 * of 8; the same where the format has one scale per 32) and an offset mn per 32. The integers are
 * signed where the format's offset is a fixed multiple of its scale (Q8_0; Q4_0, Q5_0 and Q6_K less
 * their 8, 16 and 32) and unsigned, 0..31, where it is a stored minimum (Q4_1, Q5_1, Q4_K, Q5_K). A
 * chunk's share of a dot product is then
 *
 *     sum over the 8 lanes of (q . xq over the lane's 4 elements) * scale * dx  +  mn * dx * sum(xq)
 *
 * with the integer sums exact: u8 x i8 products (a signed q as |q| against xq with q's sign) summed
 * in pairs into int16 (AVX2's maddubs; never saturating) and in fours into int32 (or all four at once:
 * VNNI's dpbusd), the same sums on every path (AVX2, VNNI and the portable loop). The error against
 * the float product is the activations' rounding (half a step of dx per element), as llama.cpp's.
 *
 * The weights are read in tiles of 8 rows (tile_product below): a tile's chunks are unpacked and
 * transposed once per call, so that the 8 int32 lanes of a vector are the tile's 8 outputs, and then
 * applied to all the input rows, 4 at a time.
 */
#include "quant_blocks.h"

typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

/* One chunk of 32 weights: the integers (bytes: int8 for Q8_0, Q4_0, Q5_0 and Q6_K, else uint8), the scale of
 * each int32 lane of the dot product (4 elements a lane) and the chunk's offset. */
typedef struct {
    u8x32 q;
    f32x8 scale;
    float mn;
} chunk32;

static inline u8x32 bytes32(const uint8_t *p) {
    u8x32 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* v >> s per byte (x86 has no byte shifts: through 16-bit lanes, with the bits that crossed masked). */
static inline u8x32 shr32(u8x32 v, int s) { return (u8x32)((u16x16)v >> s) & (uint8_t)(0xffu >> s); }

/* The 32-element formats: the low nibbles of the 16 bytes qs are elements 0-15, the high ones 16-31. */
static inline u8x32 nibbles(const uint8_t *qs) {
    u8x32 out;
#if defined(__AVX2__)
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(15);
    const __m256i both = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
    memcpy(&out, &both, sizeof out);
#else
    for (int i = 0; i < 16; i++) out[i] = qs[i] & 15, out[i + 16] = qs[i] >> 4;
#endif
    return out;
}

/* Q5_0/Q5_1's fifth bits: bit i of the little-endian qh as 16 or 0 in byte i. */
static inline u8x32 fifth_bits32(const uint8_t *h) {
    const uint32_t qh = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24;
#if defined(__AVX2__)
    /* byte i gets byte i / 8 of qh, then its bit i % 8 tested against a mask of all the other bits */
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0x0000000000000000));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    u8x32 out;
    memcpy(&out, &set, sizeof out);
    return out & 16;
#else
    u8x32 out;
    for (int i = 0; i < 32; i++) out[i] = (uint8_t)(((qh >> i) & 1u) << 4);
    return out;
#endif
}


/* Chunk v (elements 32v .. 32v + 31) of block b, inlined with a constant type. */
static inline __attribute__((always_inline)) chunk32 chunk_of(int type, const uint8_t *b, int v) {
    chunk32 c;
    switch (type) {
    case GGML_Q4_0: case GGML_Q4_1: {
        const float d = half_to_float(b);
        c.q = nibbles(b + (type == GGML_Q4_0 ? 2 : 4));
        if (type == GGML_Q4_0) c.q -= 8; /* wraps: the bytes read as int8 */
        c.scale = splat(d);
        c.mn = type == GGML_Q4_0 ? 0.0f : half_to_float(b + 2);
        return c;
    }
    case GGML_Q5_0: case GGML_Q5_1: {
        const float d = half_to_float(b);
        const uint8_t *h = b + (type == GGML_Q5_0 ? 2 : 4);
        c.q = nibbles(h + 4) | fifth_bits32(h);
        if (type == GGML_Q5_0) c.q -= 16;
        c.scale = splat(d);
        c.mn = type == GGML_Q5_0 ? 0.0f : half_to_float(b + 2);
        return c;
    }
    case GGML_Q8_0:
        c.q = bytes32(b + 2);
        c.scale = splat(half_to_float(b));
        c.mn = 0.0f;
        return c;
    case GGML_Q4_K: case GGML_Q5_K: { /* chunk v: sub-block v, the low (v even) or high nibbles of 32 bytes */
        const int j = v / 2, high = v % 2;
        int sc, m;
        get_scale_min(v, b + 4, &sc, &m);
        const u8x32 bytes = bytes32(b + (type == GGML_Q4_K ? 16 : 48) + 32 * j);
        c.q = high ? shr32(bytes, 4) : bytes & 15;
        if (type == GGML_Q5_K) /* bit v of qh[l] for the chunk's elements l */
            c.q |= (u8x32)((u16x16)(shr32(bytes32(b + 16), v) & 1) << 4);
        c.scale = splat(half_to_float(b) * (float)sc);
        c.mn = -(half_to_float(b + 2) * (float)m);
        return c;
    }
    default: { /* GGML_Q6_K: chunk v is quarter v % 4 of the 128-element half v / 4, one scale per 16 */
        const int h = v / 4, quarter = v % 4;
        const float d = half_to_float(b + 208);
        const int8_t *scales = (const int8_t *)(b + 192) + 8 * h + 2 * quarter;
        const u8x32 low = bytes32(b + 64 * h + 32 * (quarter & 1));
        const u8x32 high = bytes32(b + 128 + 32 * h);
        c.q = ((quarter < 2 ? low & 15 : shr32(low, 4)) | (u8x32)((u16x16)(shr32(high, 2 * quarter) & 3) << 4)) - 32;
        const float s0 = d * (float)scales[0], s1 = d * (float)scales[1];
        c.scale = (f32x8){s0, s0, s0, s0, s1, s1, s1, s1};
        c.mn = 0.0f;
        return c;
    }
    }
}

/* The input rows, quantized: xq [m, k] int8, dx [m, k / 32] and xs [m, k / 32] (dx * sum(xq) per 32). */
typedef struct {
    int8_t *xq;
    float *dx, *xs;
} quantized_rows;

static void quantize_row(const float *x, int64_t k, int8_t *xq, float *dx, float *xs) {
    for (int64_t c = 0; c < k / 32; c++) {
        const float *xc = x + 32 * c;
        int8_t *qc = xq + 32 * c;
        float amax = 0.0f;
#if defined(__AVX2__)
        { /* the largest |x| (a NaN is dropped, as fmaxf would) */
            const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
            __m256 v = _mm256_and_ps(_mm256_loadu_ps(xc), mask);
            for (int i = 8; i < 32; i += 8) v = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xc + i), mask), v);
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            amax = fmaxf(_mm_cvtss_f32(h), 0.0f);
        }
#else
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xc[i]));
#endif
        /* (a block below 1e-30 counts as zeros: 127 / amax would overflow near the smallest floats) */
        const float inv = amax >= 1e-30f ? 127.0f / amax : 0.0f, d = inv > 0.0f ? amax / 127.0f : 0.0f;
        int32_t sum = 0;
#if defined(__AVX2__)
        /* the conversion rounds as lrintf does (to nearest even, the default rounding mode) */
        const __m256 scale = _mm256_set1_ps(inv);
        for (int h = 0; h < 2; h++) {
            const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xc + 16 * h), scale));
            const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xc + 16 * h + 8), scale));
            const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
            const __m128i words2 = _mm_packs_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
            _mm_storeu_si128((__m128i *)(qc + 16 * h), _mm_packs_epi16(words, words2));
            const __m256i pairs = _mm256_add_epi32(a, b);
            int32_t lanes[8];
            _mm256_storeu_si256((__m256i *)lanes, pairs);
            for (int i = 0; i < 8; i++) sum += lanes[i];
        }
#else
        for (int i = 0; i < 32; i++) {
            qc[i] = (int8_t)lrintf(xc[i] * inv); /* |q| <= 127 */
            sum += qc[i];
        }
#endif
        dx[c] = d;
        xs[c] = d * (float)sum;
    }
}

/* ---- Tiles: 8 weight rows at a time, transposed so that the 8 int32 lanes of a vector are 8 outputs.
 *
 * A tile's chunk is unpacked and transposed once per call and then applied to every input row: the
 * weight blocks are read and widened once per step whatever the number of rows, and each vector of
 * byte products adds four elements to all eight outputs, with no horizontal sums. Every output is
 * computed by one thread, in the same order of operations whatever the number of rows, the other
 * rows and the number of threads: a row's result does not depend on what else is in the batch. */

#define TILE_COLS 8 /* weight rows (outputs) of a tile: the int32 lanes of a 256-bit vector */
#define TILE_ROWS 4 /* input rows that share one pass over a tile's chunks (registers: 4 accumulators) */

/* Chunk v of a tile: w[t]'s lane i holds elements 4t .. 4t + 3 of the tile's weight row i; the scale
 * of each weight row's elements 0-15 and 16-31 (alike except in Q6_K), and its offset. */
typedef struct {
    u8x32 w[8];
    f32x8 scale[2];
    f32x8 mn;
} tile_chunk;

/* Byte-pair sums (maddubs) of one input row that add up in int16 before widening to int32, without
 * overflow: each is at most 2 * |q| * 127 with |q| <= 15 (4-bit), 31 (5-bit), 32 (Q6_K), 127 (Q8_0). */
static inline int int16_group(int type) {
    switch (type) {
    case GGML_Q4_0: case GGML_Q4_1: case GGML_Q4_K: return 8;
    case GGML_Q8_0: return 1;
    default: return 4;
    }
}

static inline int scale_halves(int type) { return type == GGML_Q6_K; }

/* Signed integers in a tile: Q4_0 and Q5_0 keep theirs unsigned, their 8 and 16 moved to the offset. */
static inline int tile_signed(int type) { return type == GGML_Q8_0 || type == GGML_Q6_K; }

/* out[t] dword i = in[i] dword t (an 8 x 8 transpose of 4-byte groups). */
static inline void transpose_dwords(const u8x32 in[8], u8x32 out[8]) {
#if defined(__AVX2__)
    __m256i r[8], a[8], b[8];
    memcpy(r, in, sizeof r);
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]); /* dwords 0, 1 (and 4, 5) of rows i, i + 1 interleaved */
        a[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]); /* dwords 2, 3 (and 6, 7) */
    }
    for (int i = 0; i < 8; i += 4) {
        b[i] = _mm256_unpacklo_epi64(a[i], a[i + 2]);     /* dword 0 (4) of rows i .. i + 3 */
        b[i + 1] = _mm256_unpackhi_epi64(a[i], a[i + 2]); /* dword 1 (5) */
        b[i + 2] = _mm256_unpacklo_epi64(a[i + 1], a[i + 3]); /* dword 2 (6) */
        b[i + 3] = _mm256_unpackhi_epi64(a[i + 1], a[i + 3]); /* dword 3 (7) */
    }
    for (int t = 0; t < 4; t++) {
        r[t] = _mm256_permute2x128_si256(b[t], b[t + 4], 0x20);
        r[t + 4] = _mm256_permute2x128_si256(b[t], b[t + 4], 0x31);
    }
    memcpy(out, r, sizeof r);
#else
    for (int t = 0; t < 8; t++)
        for (int i = 0; i < 8; i++) memcpy((uint8_t *)&out[t] + 4 * i, (const uint8_t *)&in[i] + 4 * t, 4);
#endif
}

/* The tile of weight rows w[0 .. cols - 1] (cols <= 8; the missing ones as zeros), all k / 32 chunks. */
static inline __attribute__((always_inline)) void build_tile(int type, const uint8_t *w, int64_t row_bytes,
                                                             int64_t cols, int64_t k, tile_chunk *tile) {
    const int per_block = block_elements(type) / 32, bytes = block_bytes(type);
    for (int64_t at = 0; at < k / 32; at++) {
        const int64_t b = at / per_block;
        const int v = (int)(at % per_block);
        u8x32 q[TILE_COLS];
        f32x8 s0 = {0}, s1 = {0}, mn = {0};
        for (int i = 0; i < TILE_COLS; i++) {
            if (i >= cols) {
                q[i] = (u8x32){0};
                continue;
            }
            chunk32 c = chunk_of(type, w + i * row_bytes + b * bytes, v);
            if (type == GGML_Q4_0 || type == GGML_Q5_0) { /* back to 0..15 (0..31), the 8 (16) as an offset */
                const int centre = type == GGML_Q4_0 ? 8 : 16;
                c.q += (uint8_t)centre;
                c.mn = -(float)centre * c.scale[0];
            }
            q[i] = c.q;
            s0[i] = c.scale[0], s1[i] = c.scale[4], mn[i] = c.mn;
        }
        transpose_dwords(q, tile[at].w);
        tile[at].scale[0] = s0, tile[at].scale[1] = s1, tile[at].mn = mn;
    }
}

#if defined(__AVX2__)
/* The blocks b of a tile's 8 weight rows for b = 0, 1, ...: p[i] = the block of row i, where rows past
 * the weight's last (cols <= i) read a block of zeros; the next tile's rows are prefetched on the way
 * (weights outgrow the caches). */
typedef struct {
    const uint8_t *row[TILE_COLS];
    int64_t step[TILE_COLS], row_bytes;
} tile_rows_at;

static const uint8_t zero_block[64] = {0};

static inline tile_rows_at tile_rows_of(const uint8_t *w, int64_t row_bytes, int64_t cols, int bytes) {
    tile_rows_at t;
    t.row_bytes = row_bytes;
    for (int i = 0; i < TILE_COLS; i++) t.row[i] = i < cols ? w + i * row_bytes : zero_block, t.step[i] = i < cols ? bytes : 0;
    return t;
}

static inline void tile_blocks(const tile_rows_at *t, int64_t b, const uint8_t *p[TILE_COLS]) {
    for (int i = 0; i < TILE_COLS; i++) {
        p[i] = t->row[i] + b * t->step[i];
        if (b % 2 == 0) __builtin_prefetch(p[i] + TILE_COLS * t->row_bytes);
    }
}

/* build_tile for Q4_0 and Q4_1, whose chunks are whole blocks: each weight row's 16 bytes of nibbles
 * (rows i and i + 4 in the halves of one vector) transposed as 4-byte groups, then split into the low
 * nibbles (elements 4t .. 4t + 3) and the high ones (16 + 4t ..); the 8 scales (and minimums) at once. */
static inline void build_tile_q4(int type, const uint8_t *w, int64_t row_bytes, int64_t cols, int64_t k,
                                 tile_chunk *tile) {
    const int bytes = block_bytes(type), qs = type == GGML_Q4_0 ? 2 : 4;
    const __m256i low = _mm256_set1_epi8(15);
    /* the halves d (and m) of the 8 headers: bytes 0-1 (2-3) of each 4, to qwords 0 and 2 (1 and 3) */
    const __m256i halves = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const tile_rows_at rows = tile_rows_of(w, row_bytes, cols, bytes);
    for (int64_t b = 0; b < k / 32; b++) {
        const uint8_t *p[TILE_COLS];
        tile_blocks(&rows, b, p);
        __m256i r[4], t[4];
        for (int i = 0; i < 4; i++)
            r[i] = _mm256_loadu2_m128i((const __m128i *)(p[i + 4] + qs), (const __m128i *)(p[i] + qs));
        t[0] = _mm256_unpacklo_epi32(r[0], r[1]), t[1] = _mm256_unpackhi_epi32(r[0], r[1]);
        t[2] = _mm256_unpacklo_epi32(r[2], r[3]), t[3] = _mm256_unpackhi_epi32(r[2], r[3]);
        const __m256i g[4] = {_mm256_unpacklo_epi64(t[0], t[2]), _mm256_unpackhi_epi64(t[0], t[2]),
                              _mm256_unpacklo_epi64(t[1], t[3]), _mm256_unpackhi_epi64(t[1], t[3])};
        for (int j = 0; j < 4; j++) {
            const __m256i lo = _mm256_and_si256(g[j], low), hi = _mm256_and_si256(_mm256_srli_epi16(g[j], 4), low);
            memcpy(&tile[b].w[j], &lo, 32);
            memcpy(&tile[b].w[j + 4], &hi, 32);
        }
        uint32_t head[TILE_COLS];
        for (int i = 0; i < TILE_COLS; i++) memcpy(&head[i], p[i], 4);
        __m256i h = _mm256_loadu_si256((const __m256i *)head);
        h = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(h, halves), 0xd8); /* the 8 d, then the 8 m */
        const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        const __m256 mn = type == GGML_Q4_0 ? _mm256_mul_ps(d, _mm256_set1_ps(-8.0f))
                                            : _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
        memcpy(&tile[b].scale[0], &d, 32);
        memcpy(&tile[b].scale[1], &d, 32);
        memcpy(&tile[b].mn, &mn, 32);
    }
}
/* build_tile for Q8_0: each weight row's 32 int8 of a block are already 8 dwords, transposed as they
 * are; the 8 scales at once. */
static inline void build_tile_q8(const uint8_t *w, int64_t row_bytes, int64_t cols, int64_t k, tile_chunk *tile) {
    const int bytes = block_bytes(GGML_Q8_0);
    const tile_rows_at rows = tile_rows_of(w, row_bytes, cols, bytes);
    for (int64_t b = 0; b < k / 32; b++) {
        const uint8_t *p[TILE_COLS];
        u8x32 q[TILE_COLS];
        uint16_t d16[TILE_COLS];
        tile_blocks(&rows, b, p);
        for (int i = 0; i < TILE_COLS; i++) {
            memcpy(&q[i], p[i] + 2, 32);
            memcpy(&d16[i], p[i], 2);
        }
        transpose_dwords(q, tile[b].w);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d16));
        memcpy(&tile[b].scale[0], &d, 32);
        memcpy(&tile[b].scale[1], &d, 32);
        memset(&tile[b].mn, 0, 32);
    }
}
#endif


/* The int32 lanes' sums of byte products, u8 weights against i8 inputs, groups of 4 (exact). */
#if defined(__AVX2__)
static inline __m256i as_m256i(u8x32 v) {
    __m256i out;
    memcpy(&out, &v, sizeof out);
    return out;
}

static inline i32x8 as_i32x8(__m256i v) {
    i32x8 out;
    memcpy(&out, &v, sizeof out);
    return out;
}
#endif

/* Input rows r0 .. r0 + rows - 1 (rows <= TILE_ROWS, a constant in each copy) against a tile: out[r]
 * lane i = row r's product with the tile's weight row i. Each row's operations are the same in every
 * copy, and in the same order. */
static inline __attribute__((always_inline)) void tile_rows(int type, int rows, const tile_chunk *tile, int64_t k,
                                                            const int8_t *xq, const float *dx, const float *xs,
                                                            f32x8 out[TILE_ROWS]) {
    const int group = int16_group(type), halves = scale_halves(type), sign = tile_signed(type);
    const int64_t chunks = k / 32;
    f32x8 acc[TILE_ROWS] = {{0}};
    for (int64_t at = 0; at < chunks; at++) {
        const tile_chunk *c = &tile[at];
        i32x8 lo[TILE_ROWS] = {{0}}, hi[TILE_ROWS] = {{0}};
        for (int g = 0; g < 8; g += group) {
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__)) && !defined(__AVXVNNI__)
            __m256i s[TILE_ROWS];
            for (int r = 0; r < rows; r++) s[r] = _mm256_setzero_si256();
#endif
            for (int t = g; t < g + group; t++) {
                const u8x32 wt = c->w[t];
                for (int r = 0; r < rows; r++) {
                    int32_t x4;
                    memcpy(&x4, xq + r * k + 32 * at + 4 * t, 4);
#if defined(__AVX2__)
                    __m256i w = as_m256i(wt), x = _mm256_set1_epi32(x4);
                    if (sign) { /* the byte products want their first operand unsigned: |w| against x with w's sign */
                        x = _mm256_sign_epi8(x, w);
                        w = _mm256_abs_epi8(w);
                    }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                    if (halves && t >= 4) hi[r] = as_i32x8(_mm256_dpbusd_epi32(as_m256i((u8x32)hi[r]), w, x));
                    else lo[r] = as_i32x8(_mm256_dpbusd_epi32(as_m256i((u8x32)lo[r]), w, x));
#elif defined(__AVXVNNI__)
                    if (halves && t >= 4) hi[r] = as_i32x8(_mm256_dpbusd_avx_epi32(as_m256i((u8x32)hi[r]), w, x));
                    else lo[r] = as_i32x8(_mm256_dpbusd_avx_epi32(as_m256i((u8x32)lo[r]), w, x));
#else
                    s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(w, x));
#endif
#else
                    for (int i = 0; i < 8; i++) {
                        int32_t sum = 0;
                        for (int e = 0; e < 4; e++) {
                            const int q = sign ? (int8_t)wt[4 * i + e] : wt[4 * i + e];
                            sum += q * (int32_t)(int8_t)(x4 >> (8 * e));
                        }
                        if (halves && t >= 4) hi[r][i] += sum;
                        else lo[r][i] += sum;
                    }
#endif
                }
            }
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__)) && !defined(__AVXVNNI__)
            for (int r = 0; r < rows; r++) {
                const i32x8 wide = as_i32x8(_mm256_madd_epi16(s[r], _mm256_set1_epi16(1)));
                if (halves && g >= 4) hi[r] += wide;
                else lo[r] += wide;
            }
#endif
        }
        for (int r = 0; r < rows; r++) {
            const float d = dx[r * chunks + at];
            acc[r] = fma8(__builtin_convertvector(lo[r], f32x8), c->scale[0] * splat(d), acc[r]);
            if (halves) acc[r] = fma8(__builtin_convertvector(hi[r], f32x8), c->scale[1] * splat(d), acc[r]);
            if (!sign) acc[r] = fma8(c->mn, splat(xs[r * chunks + at]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = acc[r];
}

#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__)) && !defined(__AVXVNNI__)
#define TILE_ROWS4_AVX2 1
/* tile_rows for 4 rows with AVX2's maddubs, written out so that the 4 rows' int16 sums stay in
 * registers (the generic loop's arrays of vectors spill). The integer sums are exact and the float
 * operations are tile_rows' own, in its order: the results are the same to the bit. */
static inline __attribute__((always_inline)) void tile_rows4_avx2(int type, const tile_chunk *tile, int64_t k,
                                                                  const int8_t *xq, const float *dx,
                                                                  const float *xs, f32x8 out[TILE_ROWS]) {
    const int group = int16_group(type), halves = scale_halves(type), sign = tile_signed(type);
    const int64_t chunks = k / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t at = 0; at < chunks; at++) {
        const tile_chunk *c = &tile[at];
        const int8_t *x = xq + 32 * at;
        __m256i l0 = _mm256_setzero_si256(), l1 = l0, l2 = l0, l3 = l0, h0 = l0, h1 = l0, h2 = l0, h3 = l0;
        for (int g = 0; g < 8; g += group) {
            __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
            for (int t = g; t < g + group; t++) {
                __m256i w = as_m256i(c->w[t]);
                int32_t x4[4];
                memcpy(&x4[0], x + 4 * t, 4), memcpy(&x4[1], x + k + 4 * t, 4);
                memcpy(&x4[2], x + 2 * k + 4 * t, 4), memcpy(&x4[3], x + 3 * k + 4 * t, 4);
                __m256i b0 = _mm256_set1_epi32(x4[0]), b1 = _mm256_set1_epi32(x4[1]);
                __m256i b2 = _mm256_set1_epi32(x4[2]), b3 = _mm256_set1_epi32(x4[3]);
                if (sign) {
                    b0 = _mm256_sign_epi8(b0, w), b1 = _mm256_sign_epi8(b1, w);
                    b2 = _mm256_sign_epi8(b2, w), b3 = _mm256_sign_epi8(b3, w);
                    w = _mm256_abs_epi8(w);
                }
                s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w, b0));
                s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w, b1));
                s2 = _mm256_add_epi16(s2, _mm256_maddubs_epi16(w, b2));
                s3 = _mm256_add_epi16(s3, _mm256_maddubs_epi16(w, b3));
                /* kept as running sums: reassociated into trees, they would outgrow the registers */
                __asm__("" : "+x"(s0), "+x"(s1), "+x"(s2), "+x"(s3));
            }
            s0 = _mm256_madd_epi16(s0, ones), s1 = _mm256_madd_epi16(s1, ones);
            s2 = _mm256_madd_epi16(s2, ones), s3 = _mm256_madd_epi16(s3, ones);
            if (halves && g >= 4) {
                h0 = _mm256_add_epi32(h0, s0), h1 = _mm256_add_epi32(h1, s1);
                h2 = _mm256_add_epi32(h2, s2), h3 = _mm256_add_epi32(h3, s3);
            } else {
                l0 = _mm256_add_epi32(l0, s0), l1 = _mm256_add_epi32(l1, s1);
                l2 = _mm256_add_epi32(l2, s2), l3 = _mm256_add_epi32(l3, s3);
            }
        }
        __m256 sc, mn;
        memcpy(&sc, &c->scale[0], 32);
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l0), _mm256_mul_ps(sc, _mm256_set1_ps(dx[at])), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l1), _mm256_mul_ps(sc, _mm256_set1_ps(dx[chunks + at])), a1);
        a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l2), _mm256_mul_ps(sc, _mm256_set1_ps(dx[2 * chunks + at])), a2);
        a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l3), _mm256_mul_ps(sc, _mm256_set1_ps(dx[3 * chunks + at])), a3);
        if (halves) {
            memcpy(&sc, &c->scale[1], 32);
            a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h0), _mm256_mul_ps(sc, _mm256_set1_ps(dx[at])), a0);
            a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h1), _mm256_mul_ps(sc, _mm256_set1_ps(dx[chunks + at])), a1);
            a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h2), _mm256_mul_ps(sc, _mm256_set1_ps(dx[2 * chunks + at])), a2);
            a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h3), _mm256_mul_ps(sc, _mm256_set1_ps(dx[3 * chunks + at])), a3);
        }
        if (!sign) {
            memcpy(&mn, &c->mn, 32);
            a0 = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs[at]), a0);
            a1 = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs[chunks + at]), a1);
            a2 = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs[2 * chunks + at]), a2);
            a3 = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs[3 * chunks + at]), a3);
        }
    }
    memcpy(&out[0], &a0, 32), memcpy(&out[1], &a1, 32), memcpy(&out[2], &a2, 32), memcpy(&out[3], &a3, 32);
}
#endif

#if defined(TILE_ROWS4_AVX2)
/* Whether two tiles go through tile_rows4x2_avx2: the 4-bit formats whose chunk sums fit int16 whole. */
static inline int tile_pairs(int type) { return int16_group(type) == 8; }

/* tile_rows4_avx2 for two tiles at once (16 outputs), for tile_pairs' formats: each input vector
 * serves both tiles, halving the reads of the input rows. Each output's operations are still
 * tile_rows' own, in its order. */
static inline __attribute__((always_inline)) void tile_rows4x2_avx2(int type, const tile_chunk *ta,
                                                                    const tile_chunk *tb, int64_t k,
                                                                    const int8_t *xq, const float *dx,
                                                                    const float *xs, f32x8 oa[TILE_ROWS],
                                                                    f32x8 ob[TILE_ROWS]) {
    const int64_t chunks = k / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2][4];
    for (int i = 0; i < 4; i++) acc[0][i] = acc[1][i] = _mm256_setzero_ps();
    for (int64_t at = 0; at < chunks; at++) {
        const tile_chunk *ca = &ta[at], *cb = &tb[at];
        const int8_t *x = xq + 32 * at;
        __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0, u0 = s0, u1 = s0, u2 = s0, u3 = s0;
        for (int t = 0; t < 8; t++) {
            const __m256i wa = as_m256i(ca->w[t]), wb = as_m256i(cb->w[t]);
            int32_t x4[4];
            memcpy(&x4[0], x + 4 * t, 4), memcpy(&x4[1], x + k + 4 * t, 4);
            memcpy(&x4[2], x + 2 * k + 4 * t, 4), memcpy(&x4[3], x + 3 * k + 4 * t, 4);
            __m256i b = _mm256_set1_epi32(x4[0]);
            s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(wa, b)), u0 = _mm256_add_epi16(u0, _mm256_maddubs_epi16(wb, b));
            b = _mm256_set1_epi32(x4[1]);
            s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(wa, b)), u1 = _mm256_add_epi16(u1, _mm256_maddubs_epi16(wb, b));
            b = _mm256_set1_epi32(x4[2]);
            s2 = _mm256_add_epi16(s2, _mm256_maddubs_epi16(wa, b)), u2 = _mm256_add_epi16(u2, _mm256_maddubs_epi16(wb, b));
            b = _mm256_set1_epi32(x4[3]);
            s3 = _mm256_add_epi16(s3, _mm256_maddubs_epi16(wa, b)), u3 = _mm256_add_epi16(u3, _mm256_maddubs_epi16(wb, b));
            __asm__("" : "+x"(s0), "+x"(s1), "+x"(s2), "+x"(s3), "+x"(u0), "+x"(u1), "+x"(u2), "+x"(u3));
        }
        const __m256i sums[2][4] = {{s0, s1, s2, s3}, {u0, u1, u2, u3}};
        const tile_chunk *cs[2] = {ca, cb};
        for (int j = 0; j < 2; j++) {
            __m256 sc, mn;
            memcpy(&sc, &cs[j]->scale[0], 32), memcpy(&mn, &cs[j]->mn, 32);
            for (int r = 0; r < 4; r++) {
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[j][r], ones));
                acc[j][r] = _mm256_fmadd_ps(lo, _mm256_mul_ps(sc, _mm256_set1_ps(dx[r * chunks + at])), acc[j][r]);
                acc[j][r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs[r * chunks + at]), acc[j][r]);
            }
        }
    }
    for (int r = 0; r < 4; r++) memcpy(&oa[r], &acc[0][r], 32), memcpy(&ob[r], &acc[1][r], 32);
}
#endif

static inline __attribute__((always_inline)) void build_any_tile(int type, const uint8_t *w, int64_t row_bytes,
                                                                 int64_t cols, int64_t k, tile_chunk *tile) {
#if defined(__AVX2__)
    if (type == GGML_Q4_0 || type == GGML_Q4_1) build_tile_q4(type, w, row_bytes, cols, k, tile);
    else if (type == GGML_Q8_0) build_tile_q8(w, row_bytes, cols, k, tile);
    else
#endif
        build_tile(type, w, row_bytes, cols, k, tile);
}

#define SPAN_TILES 2 /* tiles that a thread builds at once and applies to the input rows together */

/* Weight rows j0 .. j0 + cols - 1 (cols <= SPAN_TILES * TILE_COLS: one or two tiles, built into
 * tiles[0 ..]) against all m input rows, TILE_ROWS at a time. */
static inline __attribute__((always_inline)) void tile_product(int type, const uint8_t *w, int64_t row_bytes,
                                                               int64_t j0, int64_t cols, int64_t k, int64_t m,
                                                               const quantized_rows *x, tile_chunk *tiles,
                                                               const float *bias, float *y, int64_t y_step) {
    const int64_t chunks = k / 32;
    const int ntiles = cols > TILE_COLS ? 2 : 1;
    for (int i = 0; i < ntiles; i++) {
        const int64_t first = j0 + i * TILE_COLS, n_i = i == 0 && ntiles == 2 ? TILE_COLS : cols - i * TILE_COLS;
        build_any_tile(type, w + first * row_bytes, row_bytes, n_i, k, tiles + i * chunks);
    }
    for (int64_t r0 = 0; r0 < m; r0 += TILE_ROWS) {
        const int rows = m - r0 < TILE_ROWS ? (int)(m - r0) : TILE_ROWS;
        const int8_t *xq = x->xq + r0 * k;
        const float *dx = x->dx + r0 * chunks, *xs = x->xs + r0 * chunks;
        f32x8 out[SPAN_TILES][TILE_ROWS];
#if defined(TILE_ROWS4_AVX2)
        if (rows == 4 && ntiles == 2 && tile_pairs(type)) {
            tile_rows4x2_avx2(type, tiles, tiles + chunks, k, xq, dx, xs, out[0], out[1]);
        } else
#endif
        for (int i = 0; i < ntiles; i++) {
            const tile_chunk *tile = tiles + i * chunks;
#if defined(TILE_ROWS4_AVX2)
            if (rows == 4) tile_rows4_avx2(type, tile, k, xq, dx, xs, out[i]);
#else
            if (rows == 4) tile_rows(type, 4, tile, k, xq, dx, xs, out[i]);
#endif
            else if (rows == 3) tile_rows(type, 3, tile, k, xq, dx, xs, out[i]);
            else if (rows == 2) tile_rows(type, 2, tile, k, xq, dx, xs, out[i]);
            else tile_rows(type, 1, tile, k, xq, dx, xs, out[i]);
        }
        for (int r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++)
                y[(r0 + r) * y_step + j0 + c] = out[c / TILE_COLS][r][c % TILE_COLS] + (bias != NULL ? bias[j0 + c] : 0.0f);
    }
}

/* pagellm_quant_linear's contract (quant_linear.c), with the input rows quantized to 8 bits first. */
int pagellm_quant_linear_int8(const void *x_in, int64_t x_stride, int x_dtype, int64_t m, int64_t k,
                              const uint8_t *w, int type, int64_t n, const float *bias, void *y_out,
                              int64_t y_stride, int y_dtype, int num_threads) {
    const int64_t row_bytes = pagellm_quant_row_bytes(type, k);
    if (row_bytes == 0) return -1;
    const int threads = num_threads < 1 ? 1 : num_threads;
    const int64_t chunks = k / 32, span = SPAN_TILES * TILE_COLS, spans = (n + span - 1) / span;
    /* one allocation: SPAN_TILES tiles per thread (32-byte aligned, first), the float32 input row being quantized,
     * xq, dx, xs, and a float32 output if staged */
    const int staged = y_dtype != PAGELLM_F32;
    const size_t tile_bytes = (size_t)SPAN_TILES * chunks * sizeof(tile_chunk);
    char *work = malloc(threads * tile_bytes + (size_t)(k * 4 + m * k + (m * chunks * 2) * 4 + (staged ? m * n * 4 : 0))
                        + 128);
    if (work == NULL) return -2;
    tile_chunk *tiles_at = (tile_chunk *)(((uintptr_t)work + 31) & ~(uintptr_t)31);
    float *row = (float *)((char *)tiles_at + threads * tile_bytes);
    quantized_rows x = {(int8_t *)(row + k), NULL, NULL};
    x.dx = (float *)((char *)x.xq + ((m * k + 3) / 4) * 4);
    x.xs = x.dx + m * chunks;
    for (int64_t r = 0; r < m; r++) {
        load_floats(x_in, r * x_stride, k, x_dtype, row);
        quantize_row(row, k, x.xq + r * k, x.dx + r * chunks, x.xs + r * chunks);
    }
    float *y = staged ? x.xs + m * chunks : (float *)y_out;
    const int64_t y_step = staged ? n : y_stride;
#pragma omp parallel num_threads(threads)
    {
        tile_chunk *tile = (tile_chunk *)((char *)tiles_at + omp_get_thread_num() * tile_bytes);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < spans; t++) {
            const int64_t j0 = t * span, cols = n - j0 < span ? n - j0 : span;
#define TILE_CASE(TYPE) \
    case TYPE: tile_product(TYPE, w, row_bytes, j0, cols, k, m, &x, tile, bias, y, y_step); break;
            switch (type) {
                TILE_CASE(GGML_Q4_0) TILE_CASE(GGML_Q4_1) TILE_CASE(GGML_Q5_0) TILE_CASE(GGML_Q5_1)
                TILE_CASE(GGML_Q8_0) TILE_CASE(GGML_Q4_K) TILE_CASE(GGML_Q5_K) TILE_CASE(GGML_Q6_K)
            }
#undef TILE_CASE
        }
    }
    if (staged)
        for (int64_t r = 0; r < m; r++) store_floats(y_out, r * y_stride, n, y_dtype, y + r * n);
    free(work);
    return 0;
}
