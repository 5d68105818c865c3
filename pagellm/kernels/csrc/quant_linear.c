/* Linear layers on weights kept in llama.cpp's block formats (quant_blocks.h), with float activations.
 *
 * Every format is read the same way: a run of 16 elements is q * s + mn for small integers q (as
 * floats in a vector), a scale s and an offset mn per run. A row's dot product with an input row x is
 * then the sum over runs of s * (q . x) + mn * sum(x), with sum(x) over each run of 16 taken once per
 * call. The integers are widened to floats in registers (GCC vector extensions: AVX-512, AVX2 or SSE
 * by what -march=native gives) and multiplied with the float32 inputs, so the result is the
 * dequantized weight times x to float32 rounding, whatever the CPU. Decode's few rows read each
 * weight block once for up to QROWS input rows; prompt rows go through pagellm_quant_linear_panel
 * (below), where the multiply outweighs unpacking the weight once.
 */
#include "quant_blocks.h"

#define QROWS 4 /* input rows that share one pass over the weights */

/* Sixteen floats as two 8-wide halves: GCC keeps those in registers on AVX2 (a 64-byte vector there went
 * through the stack at every step) and splits them again where vectors are narrower. */
typedef struct {
    f32x8 lo, hi;
} run16;

/* Bytes to floats. x86 has no byte shifts, and GCC lowers byte-to-float conversions of its generic
 * vectors element by element, so the widening uses the instructions directly where they exist, and
 * the byte shifts go through 16-bit lanes (bits never cross a byte: see the masks). */
#if defined(__AVX2__)
static inline run16 widen_u8(u8x16 q) {
    __m128i v;
    memcpy(&v, &q, sizeof v);
    return (run16){(f32x8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)),
                   (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)))};
}
static inline run16 widen_i8(i8x16 q) {
    __m128i v;
    memcpy(&v, &q, sizeof v);
    return (run16){(f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)),
                   (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))};
}
#else
static inline run16 widen_u8(u8x16 q) {
    run16 out;
    for (int i = 0; i < 8; i++) out.lo[i] = (float)q[i], out.hi[i] = (float)q[i + 8];
    return out;
}
static inline run16 widen_i8(i8x16 q) {
    run16 out;
    for (int i = 0; i < 8; i++) out.lo[i] = (float)q[i], out.hi[i] = (float)q[i + 8];
    return out;
}
#endif

static inline run16 run_add(run16 a, run16 b) { return (run16){a.lo + b.lo, a.hi + b.hi}; }
static inline run16 run_scale(run16 a, float s) { return (run16){a.lo * s, a.hi * s}; }

typedef uint16_t u16x8 __attribute__((vector_size(16)));
/* v >> s per byte; v << 4 per byte for bytes below 16. */
static inline u8x16 shr_bytes(u8x16 v, int s) { return (u8x16)((u16x8)v >> s) & (uint8_t)(0xffu >> s); }
static inline u8x16 shl4_small_bytes(u8x16 v) { return (u8x16)((u16x8)v << 4); }

/* Bits 'first'..'first + 15' of a little-endian uint32 (Q5_0/Q5_1's qh), each as 0 or 16. */
static inline run16 fifth_bits(uint32_t qh, int first) {
    typedef int32_t i32x8 __attribute__((vector_size(32)));
    const i32x8 shift = {0, 1, 2, 3, 4, 5, 6, 7};
    const i32x8 lo = (i32x8){0} + (int32_t)(qh >> first), hi = (i32x8){0} + (int32_t)(qh >> (first + 8));
    return (run16){__builtin_convertvector(((lo >> shift) & 1) << 4, f32x8),
                   __builtin_convertvector(((hi >> shift) & 1) << 4, f32x8)};
}

/* Run u (elements 16u .. 16u + 15) of block b: its integers q as floats, returned, and its scale and
 * offset. Inlined with a constant type, so that each type's loop reads its block directly (holding
 * the runs in memory between a decoder and the dot products measured several times slower). */
static inline __attribute__((always_inline)) run16 run_of(int type, const uint8_t *b, int u, float *s, float *mn) {
    switch (type) {
    case GGML_Q4_0: case GGML_Q4_1: {
        const float d = half_to_float(b);
        *s = d;
        *mn = type == GGML_Q4_0 ? -8.0f * d : half_to_float(b + 2);
        const u8x16 qs = bytes16(b + (type == GGML_Q4_0 ? 2 : 4));
        return widen_u8(u ? shr_bytes(qs, 4) : qs & 15);
    }
    case GGML_Q5_0: case GGML_Q5_1: {
        const float d = half_to_float(b);
        *s = d;
        *mn = type == GGML_Q5_0 ? -16.0f * d : half_to_float(b + 2);
        const uint8_t *h = b + (type == GGML_Q5_0 ? 2 : 4);
        const uint32_t qh = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24;
        const u8x16 qs = bytes16(h + 4);
        return run_add(widen_u8(u ? shr_bytes(qs, 4) : qs & 15), fifth_bits(qh, 16 * u));
    }
    case GGML_Q8_0: {
        *s = half_to_float(b);
        *mn = 0.0f;
        i8x16 q;
        memcpy(&q, b + 2 + 16 * u, sizeof q);
        return widen_i8(q);
    }
    case GGML_Q4_K: case GGML_Q5_K: { /* each 64 elements: 32 low nibbles, then 32 high nibbles */
        const int j = u / 4, half = (u / 2) % 2, part = u % 2;
        int sc, m;
        get_scale_min(2 * j + half, b + 4, &sc, &m);
        *s = half_to_float(b) * (float)sc;
        *mn = -(half_to_float(b + 2) * (float)m);
        const u8x16 bytes = bytes16(b + (type == GGML_Q4_K ? 16 : 48) + 32 * j + 16 * part);
        run16 q = widen_u8(half ? shr_bytes(bytes, 4) : bytes & 15);
        if (type == GGML_Q5_K) /* bit 2j + half of qh[l] for the run's elements l */
            q = run_add(q, widen_u8(shl4_small_bytes(shr_bytes(bytes16(b + 16 + 16 * part), 2 * j + half) & 1)));
        return q;
    }
    default: { /* GGML_Q6_K: each 128 elements are four quarters of 32, each two runs */
        const int h = u / 8, quarter = (u / 2) % 4, part = u % 2;
        *s = half_to_float(b + 208) * (float)((const int8_t *)(b + 192))[8 * h + 2 * quarter + part];
        *mn = 0.0f;
        const u8x16 low = bytes16(b + 64 * h + 32 * (quarter & 1) + 16 * part);
        const u8x16 high = bytes16(b + 128 + 32 * h + 16 * part);
        const u8x16 q6 = (quarter < 2 ? low & 15 : shr_bytes(low, 4)) | shl4_small_bytes(shr_bytes(high, 2 * quarter) & 3);
        const run16 q = widen_u8(q6);
        return (run16){q.lo - 32.0f, q.hi - 32.0f};
    }
    }
}


static inline f32x8 load8(const float *p) {
    f32x8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Weight rows j0..j1-1 against 'rows' (<= QROWS, a constant in each copy) input rows x (with their run sums xsum): y[r, j]. */
static inline __attribute__((always_inline)) void dot_rows(
        int type, int rows, const float *x, int64_t x_stride, const float *xsum, int64_t runs,
        const uint8_t *w, int64_t row_bytes, int64_t blocks, int64_t j0, int64_t j1, const float *bias, float *y,
        int64_t y_stride) {
    const int elements = block_elements(type), bytes = block_bytes(type);
    for (int64_t j = j0; j < j1; j++) {
        f32x8 acc_lo[QROWS] = {{0}}, acc_hi[QROWS] = {{0}}; /* two chains: the adds' latency overlaps */
        float offset[QROWS] = {0};
        const uint8_t *row = w + j * row_bytes;
        for (int64_t b = 0; b < blocks; b++) {
            for (int u = 0; u < elements / 16; u++) {
                float scale = 0.0f, mn = 0.0f;
                const run16 ints = run_of(type, row + b * bytes, u, &scale, &mn);
                const run16 q = run_scale(ints, scale);
                const int64_t run = b * elements / 16 + u;
                for (int r = 0; r < rows; r++) {
                    const float *xr = x + r * x_stride + 16 * run;
                    acc_lo[r] += q.lo * load8(xr);
                    acc_hi[r] += q.hi * load8(xr + 8);
                    offset[r] += mn * xsum[r * runs + run];
                }
            }
        }
        for (int r = 0; r < rows; r++)
            y[r * y_stride + j] = hsum8(acc_lo[r] + acc_hi[r]) + offset[r] + (bias != NULL ? bias[j] : 0.0f);
    }
}

/* Bytes of one row of a weight of this type and k columns; 0 for a type this file does not read or a
 * k that is not whole blocks. */
int64_t pagellm_quant_row_bytes(int type, int64_t k) {
    const int elements = block_elements(type);
    if (elements == 0 || k <= 0 || k % elements) return 0;
    return k / elements * block_bytes(type);
}

/* y[r, j] = sum_i x[r, i] * W[j, i] (+ bias[j]) for rows r < m of x (x_stride elements between rows,
 * x_dtype float32 or bfloat16) and the n rows of the quantized w (row_bytes apart), into y (y_stride
 * elements between rows, y_dtype; a column slice of a wider output when y_stride > n). Returns -1 for
 * an unknown type or a k that is not whole blocks, -2 without memory, else 0. */
int pagellm_quant_linear(const void *x_in, int64_t x_stride, int x_dtype, int64_t m, int64_t k, const uint8_t *w,
                         int type, int64_t n, const float *bias, void *y_out, int64_t y_stride, int y_dtype,
                         int num_threads) {
    const int64_t row_bytes = pagellm_quant_row_bytes(type, k);
    if (row_bytes == 0) return -1;
    const int64_t blocks = k / block_elements(type), runs = k / 16;
    /* The input rows as float32, and sum(x) over each run of 16 of every row: the offsets mn multiply it. */
    float *x = malloc((size_t)(m * (k + runs) + 1) * sizeof(float));
    if (x == NULL) return -2;
    float *xsum = x + m * k;
    for (int64_t r = 0; r < m; r++) {
        load_floats(x_in, r * x_stride, k, x_dtype, x + r * k);
        for (int64_t u = 0; u < runs; u++)
            xsum[r * runs + u] = hsum8(load8(x + r * k + 16 * u) + load8(x + r * k + 16 * u + 8));
    }
    x_stride = k;
    float *y = y_dtype == PAGELLM_F32 ? (float *)y_out : NULL;
    float *y_staged = NULL; /* bfloat16 output: the float32 results first, then rounded once */
    if (y == NULL) {
        y_staged = malloc((size_t)(m * n + 1) * sizeof(float));
        if (y_staged == NULL) {
            free(x);
            return -2;
        }
        y = y_staged;
    }
    const int64_t y_step = y_staged != NULL ? n : y_stride;
    /* Work items are (tile of QROWS input rows, chunk of weight rows); a chunk small enough that a
     * decode's few hundred weight rows spread over the threads. */
    const int64_t chunk = 8, chunks = (n + chunk - 1) / chunk, tiles = (m + QROWS - 1) / QROWS;
#pragma omp parallel for num_threads(num_threads) schedule(static) collapse(2)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t r0 = t * QROWS, rows = m - r0 < QROWS ? m - r0 : QROWS;
            const int64_t j0 = c * chunk, j1 = (c + 1) * chunk < n ? (c + 1) * chunk : n;
            const float *xt = x + r0 * x_stride, *st = xsum + r0 * runs;
            float *yt = y + r0 * y_step;
            /* One copy of the loop per type and tile height, the block decoder inlined and the
             * accumulators in registers. */
#define QUANT_ROWS(TYPE) \
    case TYPE: \
        if (rows == 4) dot_rows(TYPE, 4, xt, x_stride, st, runs, w, row_bytes, blocks, j0, j1, bias, yt, y_step); \
        else if (rows == 3) dot_rows(TYPE, 3, xt, x_stride, st, runs, w, row_bytes, blocks, j0, j1, bias, yt, y_step); \
        else if (rows == 2) dot_rows(TYPE, 2, xt, x_stride, st, runs, w, row_bytes, blocks, j0, j1, bias, yt, y_step); \
        else dot_rows(TYPE, 1, xt, x_stride, st, runs, w, row_bytes, blocks, j0, j1, bias, yt, y_step); \
        break;
            switch (type) {
                QUANT_ROWS(GGML_Q4_0) QUANT_ROWS(GGML_Q4_1) QUANT_ROWS(GGML_Q5_0) QUANT_ROWS(GGML_Q5_1)
                QUANT_ROWS(GGML_Q8_0) QUANT_ROWS(GGML_Q4_K) QUANT_ROWS(GGML_Q5_K) QUANT_ROWS(GGML_Q6_K)
            }
#undef QUANT_ROWS
        }
    }
    if (y_staged != NULL) {
        for (int64_t r = 0; r < m; r++) store_floats(y_out, r * y_stride, n, y_dtype, y_staged + r * n);
        free(y_staged);
    }
    free(x);
    return 0;
}

/* Rows j0..j1-1 of the weight as float32 rows of k (one copy per type, as dot_rows). */
static inline __attribute__((always_inline)) void dequantize_rows(int type, const uint8_t *w, int64_t row_bytes,
                                                                 int64_t k, int64_t j0, int64_t j1, float *out) {
    const int elements = block_elements(type), bytes = block_bytes(type);
    for (int64_t j = j0; j < j1; j++) {
        for (int64_t b = 0; b < k / elements; b++) {
            for (int u = 0; u < elements / 16; u++) {
                float scale = 0.0f, mn = 0.0f;
                const run16 q = run_of(type, w + j * row_bytes + b * bytes, u, &scale, &mn);
                const f32x8 lo = q.lo * scale + mn, hi = q.hi * scale + mn;
                memcpy(out + j * k + b * elements + 16 * u, &lo, sizeof lo);
                memcpy(out + j * k + b * elements + 16 * u + 8, &hi, sizeof hi);
            }
        }
    }
}

/* out[j, i] = W[j, i] as float32 (n rows of k, contiguous). Returns -1 for an unknown type or a k
 * that is not whole blocks, else 0. */
int pagellm_dequantize(const uint8_t *w, int type, int64_t n, int64_t k, float *out, int num_threads) {
    const int64_t row_bytes = pagellm_quant_row_bytes(type, k);
    if (row_bytes == 0) return -1;
    const int64_t chunk = 16, chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t j0 = c * chunk, j1 = j0 + chunk < n ? j0 + chunk : n;
        switch (type) {
#define DEQUANTIZE(TYPE) \
    case TYPE: dequantize_rows(TYPE, w, row_bytes, k, j0, j1, out); break;
            DEQUANTIZE(GGML_Q4_0) DEQUANTIZE(GGML_Q4_1) DEQUANTIZE(GGML_Q5_0) DEQUANTIZE(GGML_Q5_1)
            DEQUANTIZE(GGML_Q8_0) DEQUANTIZE(GGML_Q4_K) DEQUANTIZE(GGML_Q5_K) DEQUANTIZE(GGML_Q6_K)
#undef DEQUANTIZE
        }
    }
    return 0;
}

/* The same product as pagellm_quant_linear, for any number of rows at the speed of a matmul, and with
 * each row's result independent of the others (--batch-invariant's prompt rows): the weight is
 * dequantized 16 rows at a time into a buffer of the thread's own (never the whole weight),
 * transposed so that a vector's 8 lanes are 8 outputs, and every input row is multiplied there, 6
 * input rows by 16 outputs per pass (12 accumulators; each input element broadcast once per pass).
 * Each output is one chain of fused multiply-adds over k in order, the same operations whatever m is
 * and whichever rows share a pass. */
#define PANEL 16
#define PANEL_ROWS 6

static inline __attribute__((always_inline)) void panel_block(int rows, const float *x, int64_t k, const float *wt,
                                                              float *out) {
    f32x8 acc[PANEL_ROWS][2] = {{{0}}};
    for (int64_t i = 0; i < k; i++) {
        const f32x8 w0 = load8(wt + PANEL * i), w1 = load8(wt + PANEL * i + 8);
        for (int r = 0; r < rows; r++) {
            const f32x8 xv = splat(x[r * k + i]);
            acc[r][0] = fma8(xv, w0, acc[r][0]);
            acc[r][1] = fma8(xv, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        memcpy(out + r * PANEL, &acc[r][0], sizeof acc[r][0]);
        memcpy(out + r * PANEL + 8, &acc[r][1], sizeof acc[r][1]);
    }
}

int pagellm_quant_linear_panel(const void *x_in, int64_t x_stride, int x_dtype, int64_t m, int64_t k, const uint8_t *w,
                               int type, int64_t n, const float *bias, void *y_out, int64_t y_stride, int y_dtype,
                               int num_threads) {
    const int64_t row_bytes = pagellm_quant_row_bytes(type, k);
    if (row_bytes == 0) return -1;
    float *x = malloc((size_t)(m * k + 1) * sizeof(float));
    if (x == NULL) return -2;
    for (int64_t r = 0; r < m; r++) load_floats(x_in, r * x_stride, k, x_dtype, x + r * k);
    const int64_t panels = (n + PANEL - 1) / PANEL;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* the panel's rows as dequantized, then transposed (columns past n stay zero) */
        float *rows_buf = malloc((size_t)(2 * PANEL * k) * sizeof(float));
        float *wt = rows_buf + PANEL * k;
        if (rows_buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if (rows_buf == NULL) continue;
            const int64_t j0 = p * PANEL, width = n - j0 < PANEL ? n - j0 : PANEL;
            switch (type) {
#define DEQUANTIZE(TYPE) \
    case TYPE: dequantize_rows(TYPE, w + j0 * row_bytes, row_bytes, k, 0, width, rows_buf); break;
                DEQUANTIZE(GGML_Q4_0) DEQUANTIZE(GGML_Q4_1) DEQUANTIZE(GGML_Q5_0) DEQUANTIZE(GGML_Q5_1)
                DEQUANTIZE(GGML_Q8_0) DEQUANTIZE(GGML_Q4_K) DEQUANTIZE(GGML_Q5_K) DEQUANTIZE(GGML_Q6_K)
#undef DEQUANTIZE
            }
            for (int64_t i = 0; i < k; i++)
                for (int64_t c = 0; c < PANEL; c++) wt[PANEL * i + c] = c < width ? rows_buf[c * k + i] : 0.0f;
            for (int64_t r0 = 0; r0 < m; r0 += PANEL_ROWS) {
                const int rows = m - r0 < PANEL_ROWS ? (int)(m - r0) : PANEL_ROWS;
                float out[PANEL_ROWS * PANEL];
                const float *xr = x + r0 * k;
                /* one copy per block height, its accumulators in registers */
                switch (rows) {
                    case 6: panel_block(6, xr, k, wt, out); break;
                    case 5: panel_block(5, xr, k, wt, out); break;
                    case 4: panel_block(4, xr, k, wt, out); break;
                    case 3: panel_block(3, xr, k, wt, out); break;
                    case 2: panel_block(2, xr, k, wt, out); break;
                    default: panel_block(1, xr, k, wt, out); break;
                }
                for (int r = 0; r < rows; r++) {
                    if (bias != NULL)
                        for (int64_t c = 0; c < width; c++) out[r * PANEL + c] += bias[j0 + c];
                    store_floats(y_out, (r0 + r) * y_stride + j0, width, y_dtype, out + r * PANEL);
                }
            }
        }
        free(rows_buf);
    }
    free(x);
    return failed ? -2 : 0;
}
