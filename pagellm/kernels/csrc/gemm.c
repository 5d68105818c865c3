/* bfloat16 linear layers.
 * y[M, N] = x[M, K] @ w[N, K]^T (+ bias), bfloat16 in, bfloat16 out (or those values as float32),
 * float32 sums, on the AVX512-BF16 dot products. oneDNN reaches the same rate at prefill's large M,
 * but at decode's M (a few to a few dozen rows) it leaves much of the multiply rate unused; this
 * kernel keeps a register tile of up to LINEAR_ROWS rows x 32 columns busy whatever M is. Not used
 * where the CPU has AMX (oneDNN's tile instructions are far faster there) nor where the dot products
 * are missing.
 *
 * The weight is packed once into panels of 32 output columns: panel p holds, for each pair of input
 * columns (k, k + 1), the 32 pairs (w[n, k], w[n, k + 1]) as 32-bit words, so one dot-product
 * instruction multiplies a broadcast pair of x by 16 columns' pairs. Every output element adds its
 * pairs in the same order whatever M or its row is: a row's result does not depend on the batch. */
#include "cpu_kernels.h"

#define LINEAR_COLS 32 /* output columns per weight panel: two vectors of 16 float32 sums */
#define LINEAR_ROWS 12 /* most rows per register tile: 24 accumulators of the 32 vector registers */
/* Inputs a panel passes over before the next panel: in L2 with the panel (half of a 1 MiB L2; the
 * whole L2 evicts the panel itself). */
#define LINEAR_CHUNK_BYTES (512 << 10)
#define LINEAR_PREFETCH_BYTES (512 << 10) /* larger panels (K > 8192) are not prefetched: they'd evict the inputs */

/* Whether pagellm_linear_bf16 runs: on the dot products, but not where the compiler targets AMX. */
int pagellm_linear_bf16_supported(void) {
#if PAGELLM_DOT_PRODUCTS && !defined(__AMX_BF16__)
    return 1;
#else
    return 0;
#endif
}

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
void pagellm_pack_linear_weight(const uint16_t *w, int64_t n, int64_t k, int gated, uint32_t *out,
                                int num_threads) {
    const int64_t pairs = (k + 1) / 2, panels = linear_panels(n, gated);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t j = 0; j < pairs; j++)
            for (int64_t c = 0; c < LINEAR_COLS; c++) {
                const int64_t col = panel_column(p, c, n, gated);
                out[(p * pairs + j) * LINEAR_COLS + c] = col >= 0 ? bf16_pair(w + col * k, j, k) : 0;
            }
}

#if PAGELLM_DOT_PRODUCTS /* the kernel's tiles (to the matching #endif) */
/* Each lane rounded to the nearest even bfloat16, as store_floats rounds (a NaN stays a NaN). The CPU's
 * conversion (vcvtneps2bf16) flushes subnormals to zero, where PyTorch rounds them. */
static inline __m512 round_bf16x16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x400000)); /* keeps a NaN a NaN once cut */
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_mask_mov_epi32(rounded, nan, quiet), _mm512_set1_epi32((int)0xffff0000u)));
}

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
            const __m512 neg =
                _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gate), _mm512_set1_epi32((int)0x80000000u)));
            const __mmask16 huge = _mm512_cmp_ps_mask(gate, _mm512_set1_ps(-88.0f), _CMP_LT_OQ);
            const __m512 e = _mm512_mask_blend_ps(huge, exp16(neg), _mm512_set1_ps(INFINITY));
            const __m512 silu = round_bf16x16(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            const __m512 out = round_bf16x16(_mm512_mul_ps(silu, up));
            _mm256_mask_storeu_epi16((uint16_t *)y + r * n, mask0,
                                     _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(out), 16)));
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
 * and transposed in registers, instead of one word at a time (a visible share of a prefill step). */
static void pack_tile_pairs(const uint16_t *x, int64_t x_stride, int rows, int64_t k, uint32_t *out) {
    const int64_t pairs = (k + 1) / 2;
    const __mmask16 row_lanes = (__mmask16)((1u << rows) - 1u);
    for (int64_t j0 = 0; j0 < pairs; j0 += 16) {
        const int64_t elems = k - 2 * j0; /* elements of each row from pair j0 on */
        const __mmask32 load = elems >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << elems) - 1u);
        if (rows == 1) { /* nothing to transpose */
            _mm512_mask_storeu_epi32(out + j0, lanes_below((elems + 1) / 2),
                                     _mm512_maskz_loadu_epi16(load, x + 2 * j0));
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
            const __m512i d0 = _mm512_shuffle_i32x4(a[m], a[4 + m], 0x88),
                          d1 = _mm512_shuffle_i32x4(a[m], a[4 + m], 0xdd);
            const __m512i e0 = _mm512_shuffle_i32x4(a[8 + m], a[12 + m], 0x88),
                          e1 = _mm512_shuffle_i32x4(a[8 + m], a[12 + m], 0xdd);
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
 * the flag as a variable, the tile's inner loop carries a branch and measured slower). */
#define LINEAR_TILE_OUT(ROWS, MODE) \
    linear_tile(x_pairs + r0 * pairs, ROWS, pairs, panel, b0, b1, \
                MODE == LINEAR_F32 ? (void *)((float *)y + r0 * y_cols + col0) \
                                   : (void *)((uint16_t *)y + r0 * y_cols + col0), \
                y_cols, mask0, mask1, t == t0 && p + 1 < p_end && prefetch ? panel + pairs * LINEAR_COLS : NULL, MODE)
#define LINEAR_TILE(ROWS) \
    case ROWS: \
        if (mode == LINEAR_F32) LINEAR_TILE_OUT(ROWS, LINEAR_F32); \
        else if (mode == LINEAR_SILU_GATED) LINEAR_TILE_OUT(ROWS, LINEAR_SILU_GATED); \
        else LINEAR_TILE_OUT(ROWS, LINEAR_BF16); \
        break;
#endif /* PAGELLM_DOT_PRODUCTS */

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
#if PAGELLM_DOT_PRODUCTS /* the kernel; elsewhere -1 */
    if (mode != LINEAR_BF16 && mode != LINEAR_F32 && mode != LINEAR_SILU_GATED) return -3;
    const int gated = mode == LINEAR_SILU_GATED;
    const int64_t pairs = (k + 1) / 2, panels = linear_panels(n, gated), y_cols = gated ? n / 2 : n;
    /* Rows go in tiles of equal size (41 rows: 11 + 10 + 10 + 10, not 12 + 12 + 12 + 5). */
    const int64_t tiles = (m + LINEAR_ROWS - 1) / LINEAR_ROWS, small = m / (tiles ? tiles : 1),
                  big = m % (tiles ? tiles : 1);
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
