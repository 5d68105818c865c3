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
 * in pairs into int16 (AVX2's maddubs; at most 2 * 128 * 127 < 2^15, so it never saturates) and in
 * fours into int32 (or all four at once: VNNI's dpbusd), the same sums on every path (AVX2, VNNI and
 * the portable loop). The error against the float product is the activations' rounding (half a step
 * of dx per element), as llama.cpp's.
 */
#include "quant_blocks.h"

#define QROWS 4 /* input rows that share one pass over the weights */

typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

/* One chunk of 32 weights: the integers (bytes, signed or not by the type: is_signed), the scale of
 * each int32 lane of the dot product (4 elements a lane) and the chunk's offset. */
typedef struct {
    u8x32 q;
    f32x8 scale;
    float mn;
} chunk32;

static inline int is_signed(int type) {
    return type == GGML_Q8_0 || type == GGML_Q4_0 || type == GGML_Q5_0 || type == GGML_Q6_K;
}

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

static inline f32x8 splat(float s) { return (f32x8){s, s, s, s, s, s, s, s}; }

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

/* Lane i: sum over elements 4i .. 4i + 3 of q * xq, q signed or not by the type, exactly. */
static inline __attribute__((always_inline)) i32x8 dot_chunk(int type, u8x32 q, const int8_t *xq) {
#if defined(__AVX2__)
    __m256i w, x;
    memcpy(&w, &q, sizeof w);
    memcpy(&x, xq, sizeof x);
    if (is_signed(type)) { /* the byte products want their first operand unsigned: |w| against x with w's sign */
        x = _mm256_sign_epi8(x, w);
        w = _mm256_abs_epi8(w);
    }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
    const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
    i32x8 out;
    memcpy(&out, &sums, sizeof out);
    return out;
#else
    i32x8 out;
    for (int i = 0; i < 8; i++) {
        int32_t s = 0;
        for (int t = 4 * i; t < 4 * i + 4; t++)
            s += (is_signed(type) ? (int32_t)(int8_t)q[t] : (int32_t)q[t]) * (int32_t)xq[t];
        out[i] = s;
    }
    return out;
#endif
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
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xc[i]));
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

/* One chunk of weights against one quantized input row r: into its accumulators. */
static inline __attribute__((always_inline)) void step(int type, const chunk32 *c, const quantized_rows *x, int64_t k,
                                                       int r, int64_t at, f32x8 *acc, float *offset) {
    const float dx = x->dx[r * (k / 32) + at];
    *acc += __builtin_convertvector(dot_chunk(type, c->q, x->xq + r * k + 32 * at), f32x8) * (c->scale * dx);
    if (!is_signed(type)) /* (the signed types have no offsets) */
        *offset += c->mn * x->xs[r * (k / 32) + at];
}

/* Weight rows j0..j1-1 against 'rows' (<= QROWS, a constant in each copy) quantized input rows. Four
 * (weight row, input row) pairs at a time, each accumulating in its own registers (named, not an
 * array, which GCC kept in memory): one input row against two weight rows, two against two, or
 * three or four against one, so that even a single input row has two independent chains. */
static inline __attribute__((always_inline)) void dot_rows_int8(
        int type, int rows, const quantized_rows *x, int64_t k, const uint8_t *w, int64_t row_bytes, int64_t j0,
        int64_t j1, const float *bias, float *y, int64_t y_stride) {
    const int elements = block_elements(type), bytes = block_bytes(type), chunks = elements / 32;
    const int per_pass = rows <= 2 ? 2 : 1; /* weight rows per pass */
    const int64_t blocks = k / elements;
    for (int64_t j = j0; j < j1; j += per_pass) {
        const int second = per_pass == 2 && j + 1 < j1;
        f32x8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        float o0 = 0.0f, o1 = 0.0f, o2 = 0.0f, o3 = 0.0f;
        const uint8_t *w0 = w + j * row_bytes, *w1 = second ? w0 + row_bytes : w0;
        for (int64_t b = 0; b < blocks; b++) {
            /* the next pass's rows, from memory while this one computes (weights outgrow the caches) */
            __builtin_prefetch(w1 + row_bytes + b * bytes);
            if (per_pass == 2) __builtin_prefetch(w1 + 2 * row_bytes + b * bytes);
            for (int v = 0; v < chunks; v++) {
                const int64_t at = b * chunks + v; /* the chunk's index in the input row */
                const chunk32 c0 = chunk_of(type, w0 + b * bytes, v);
                if (per_pass == 2) {
                    const chunk32 c1 = chunk_of(type, w1 + b * bytes, v);
                    step(type, &c0, x, k, 0, at, &a0, &o0);
                    step(type, &c1, x, k, 0, at, &a1, &o1);
                    if (rows == 2) {
                        step(type, &c0, x, k, 1, at, &a2, &o2);
                        step(type, &c1, x, k, 1, at, &a3, &o3);
                    }
                } else {
                    step(type, &c0, x, k, 0, at, &a0, &o0);
                    step(type, &c0, x, k, 1, at, &a1, &o1);
                    step(type, &c0, x, k, 2, at, &a2, &o2);
                    if (rows == 4) step(type, &c0, x, k, 3, at, &a3, &o3);
                }
            }
        }
        const float b0 = bias != NULL ? bias[j] : 0.0f, b1 = bias != NULL && second ? bias[j + 1] : 0.0f;
        if (per_pass == 2) {
            y[j] = hsum8(a0) + o0 + b0;
            if (second) y[j + 1] = hsum8(a1) + o1 + b1;
            if (rows == 2) {
                y[y_stride + j] = hsum8(a2) + o2 + b0;
                if (second) y[y_stride + j + 1] = hsum8(a3) + o3 + b1;
            }
        } else {
            y[j] = hsum8(a0) + o0 + b0;
            y[y_stride + j] = hsum8(a1) + o1 + b0;
            y[2 * y_stride + j] = hsum8(a2) + o2 + b0;
            if (rows == 4) y[3 * y_stride + j] = hsum8(a3) + o3 + b0;
        }
    }
}

/* pagellm_quant_linear's contract (quant_linear.c), with the input rows quantized to 8 bits first. */
int pagellm_quant_linear_int8(const void *x_in, int64_t x_stride, int x_dtype, int64_t m, int64_t k,
                              const uint8_t *w, int type, int64_t n, const float *bias, void *y_out,
                              int64_t y_stride, int y_dtype, int num_threads) {
    const int64_t row_bytes = pagellm_quant_row_bytes(type, k);
    if (row_bytes == 0) return -1;
    /* one allocation: the float32 input row being quantized, xq, dx, xs, and a float32 output if staged */
    const int staged = y_dtype != PAGELLM_F32;
    char *work = malloc((size_t)(k * 4 + m * k + (m * (k / 32) * 2) * 4 + (staged ? m * n * 4 : 0) + 64));
    if (work == NULL) return -2;
    float *row = (float *)work;
    quantized_rows x = {(int8_t *)(work + k * 4), NULL, NULL};
    x.dx = (float *)(work + k * 4 + ((m * k + 3) / 4) * 4);
    x.xs = x.dx + m * (k / 32);
    for (int64_t r = 0; r < m; r++) {
        load_floats(x_in, r * x_stride, k, x_dtype, row);
        quantize_row(row, k, x.xq + r * k, x.dx + r * (k / 32), x.xs + r * (k / 32));
    }
    float *y = staged ? x.xs + m * (k / 32) : (float *)y_out;
    const int64_t y_step = staged ? n : y_stride;
    const int64_t chunk = 8, chunks = (n + chunk - 1) / chunk, tiles = (m + QROWS - 1) / QROWS;
#pragma omp parallel for num_threads(num_threads) schedule(static) collapse(2)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t r0 = t * QROWS, rows = m - r0 < QROWS ? m - r0 : QROWS;
            const int64_t j0 = c * chunk, j1 = (c + 1) * chunk < n ? (c + 1) * chunk : n;
            const quantized_rows xt = {x.xq + r0 * k, x.dx + r0 * (k / 32), x.xs + r0 * (k / 32)};
            float *yt = y + r0 * y_step;
#define INT8_ROWS(TYPE) \
    case TYPE: \
        if (rows == 4) dot_rows_int8(TYPE, 4, &xt, k, w, row_bytes, j0, j1, bias, yt, y_step); \
        else if (rows == 3) dot_rows_int8(TYPE, 3, &xt, k, w, row_bytes, j0, j1, bias, yt, y_step); \
        else if (rows == 2) dot_rows_int8(TYPE, 2, &xt, k, w, row_bytes, j0, j1, bias, yt, y_step); \
        else dot_rows_int8(TYPE, 1, &xt, k, w, row_bytes, j0, j1, bias, yt, y_step); \
        break;
            switch (type) {
                INT8_ROWS(GGML_Q4_0) INT8_ROWS(GGML_Q4_1) INT8_ROWS(GGML_Q5_0) INT8_ROWS(GGML_Q5_1)
                INT8_ROWS(GGML_Q8_0) INT8_ROWS(GGML_Q4_K) INT8_ROWS(GGML_Q5_K) INT8_ROWS(GGML_Q6_K)
            }
#undef INT8_ROWS
        }
    }
    if (staged)
        for (int64_t r = 0; r < m; r++) store_floats(y_out, r * y_stride, n, y_dtype, y + r * n);
    free(work);
    return 0;
}
