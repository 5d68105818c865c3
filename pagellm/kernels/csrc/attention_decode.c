/* Paged decode attention: one query token per sequence, K and V read in place from the pools (laid
 * out as cpu_kernels.h says). On CPUs with AVX512-BF16 bfloat16 pools use its bfloat16 dot products; a
 * portable path (GCC vector extensions) serves other CPUs.
 *
 * One work item is one sequence (or, with few sequences, one KV head of one), and it reads exactly its
 * own blocks (the PyTorch fallback pads every sequence of a group to the longest). A block's K (or V)
 * is one contiguous run, each KV head's part of it too (so a head's keys or values are read from start
 * to end). The blocks themselves lie anywhere in the pool, so the hardware cannot guess the next one:
 * while a block is used, the next block of the table is prefetched line by line, unless it is the
 * next one in memory too (see next_block). The scores of one (block, KV head) are block_size-wide FMAs
 * over the head_dim rows of its transposed keys; each value row is read once for every query head that
 * shares it (grouped-query attention).
 */
#include "cpu_kernels.h"

#define LINE 64 /* bytes in a cache line */

/* Prefetch (into L2) the elements [offset, offset + n) of base; no-op for offset < 0. */
static inline void prefetch(const void *base, int64_t offset, int64_t n, int dtype) {
    if (offset < 0) return;
    const int64_t size = element_bytes(dtype);
    const char *p = (const char *)base + offset * size;
    for (int64_t i = 0; i < n * size; i += LINE) __builtin_prefetch(p + i, 0, 1);
}

/* The pool offset of block b + 1 of a table (blocks of block_elems elements), to prefetch while block
 * b is used; -1 past the last block, and where block b + 1 follows block b in memory (a prompt's
 * blocks, allocated together, mostly do): the hardware prefetcher streams such a run by itself, and
 * software prefetches there only compete with it (decode attention measured faster without them). */
static inline int64_t next_block(const int64_t *table, int64_t b, int64_t nb, int64_t block_elems) {
    return b + 1 < nb && table[b + 1] != table[b] + 1 ? table[b + 1] * block_elems : -1;
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

#include "attention_vector.h"

/* ---- The same shapes with the CPU's bfloat16 dot products (AVX512-BF16, where the compiler targets
 * them): each instruction multiplies 16 pairs of bfloat16 and adds both products to 16 float32 sums,
 * so K and V are used as stored, two rows per instruction, with no conversion. Keys pair along
 * head_dim (rows d and d+1 of the transposed block, one permute), values along tokens (rows t and
 * t+1, interleaved by unpacking, which permutes head_dim within 128-bit lanes: undone at the end).
 * The query is used in bfloat16 as the projection stored it (the scale is applied to the scores);
 * the probabilities are rounded to bfloat16 before weighing the values, as transformers' eager
 * attention does. Its kernels (score16_dot, weigh16_dot) are in cpu_kernels.h. */
#if PAGELLM_DOT_PRODUCTS /* the dot-product path and the cascade (to the matching #endif) */
int use_dot_products = 1; /* see pagellm_bf16_dot_products */

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
#endif /* PAGELLM_DOT_PRODUCTS */

/* Whether attention (decode and prefill) on bfloat16 pools uses the bfloat16 dot products where they
 * were compiled in (1, the default) or the portable paths (0; decode then gives the float32 path's
 * bits). Process-wide and read without synchronisation: set it only while no kernel runs (tests
 * compare both; enable < 0 only asks). Returns the previous setting, or -1 where the CPU (or compiler)
 * has no such instructions. */
int pagellm_bf16_dot_products(int enable) {
#if PAGELLM_DOT_PRODUCTS /* the switch exists */
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

/* q, out: [num_seqs, num_heads, head_dim] (q with q_stride elements between sequences); tables:
 * [num_seqs, max_blocks] block ids; lens: [num_seqs] context lengths (>= 1). With window > 0 only the
 * last `window` positions are attended. scratch: num_threads * pagellm_scratch_floats(...) floats.
 * cascade: num_cascade rows (begin, end, shared): sequences begin..end-1 (disjoint runs) whose tables
 * hold the same first `shared` blocks, read once for the run (see the cascade above; the dot-product
 * path without a window, others ignore it). The outputs are the same bits with or without it. */
void pagellm_paged_decode_attention(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool,
                                    const int64_t *tables, const int64_t *lens, void *out, int64_t num_seqs,
                                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                    int64_t max_blocks, int64_t window, float scale, int dtype, int kv_dtype,
                                    int num_threads, float *scratch, const int64_t *cascade, int64_t num_cascade) {
    const int64_t groups = num_heads / num_kv_heads;       /* query heads per KV head */
    const int64_t head_elems = head_dim * block_size;       /* one KV head of a block */
    const int64_t block_elems = num_kv_heads * head_elems;  /* one block, all KV heads */
    const int64_t per_thread = pagellm_scratch_floats(num_heads, head_dim, block_size, max_blocks);
    const int vector_shape = block_size == 16 && (head_dim == 64 || head_dim == 128);
    const int vector_bf16 = dtype == PAGELLM_BF16 && kv_dtype == PAGELLM_BF16 && vector_shape;
    const int vector = vector_shape; /* keys and values widened in registers (attention_vector.h) */
    /* A cascade's members keep their score, probability and output rows between the stages: member[s],
     * each sequence's place among the members (-1: none), its shared block count, their rows, the
     * work items of the shared blocks (a run's CASCADE_TILE sequences and one KV head each: first
     * member, count, shared blocks), and each thread's query buffer. */
    int64_t *member = NULL, *shared = NULL, *tiles = NULL, num_tiles = 0, members = 0;
    float *c_scores = NULL, *c_acc = NULL;
    uint32_t *c_pairs = NULL, *c_q = NULL;
    const int64_t c_stride = max_blocks * 16;
#if PAGELLM_DOT_PRODUCTS /* plan the cascade (the dot-product path's) */
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
        if (member == NULL || shared == NULL || tiles == NULL || c_scores == NULL || c_pairs == NULL ||
            c_acc == NULL || c_q == NULL) {
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
#if PAGELLM_DOT_PRODUCTS /* cascade: the shared blocks' keys first */
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
#if PAGELLM_DOT_PRODUCTS /* the item on the dot products */
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
            /* (the vector path's e4m3 key rows are the values / E4M3_UNIT: attention_vector.h) */
            const float unit = vector && kv_dtype == PAGELLM_FP8_E4M3 ? E4M3_UNIT : 1.0f;
            for (int64_t i = q_lo * head_dim; i < q_hi * head_dim; i++) qf[i] *= scale * unit;

            for (int64_t b = b0; b < nb; b++) {
                const int64_t next = next_block(table, b, nb, block_elems);
                for (int64_t h = h_lo; h < h_hi; h++) {
                    prefetch(k_pool, next < 0 ? -1 : next + h * head_elems, head_elems, kv_dtype);
                    float *dst = scores + h * groups * span + (b - b0) * block_size;
                    const float *qh = qf + h * groups * head_dim;
                    if (vector) {
                        score_block_vector(kv_dtype, head_dim, k_pool, table[b] * block_elems + h * head_elems, qh,
                                           groups, dst, span);
                        continue;
                    }
                    load_floats(k_pool, table[b] * block_elems + h * head_elems, head_elems, kv_dtype, keys);
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
            for (int64_t b = b0; b < nb && vector; b++) {
                const int64_t next = next_block(table, b, nb, block_elems);
                for (int64_t h = h_lo; h < h_hi; h++) {
                    prefetch(v_pool, next < 0 ? -1 : next + h * head_elems, head_elems, kv_dtype);
                    weigh_block_vector(kv_dtype, head_dim, v_pool, table[b] * block_elems + h * head_elems,
                                       scores + h * groups * span + (b - b0) * 16, span, groups,
                                       acc + h * groups * head_dim);
                }
            }
            for (int64_t b = b0; b < nb && !vector; b++) {
                const int64_t next = next_block(table, b, nb, block_elems);
                for (int64_t h = h_lo; h < h_hi; h++) { /* a head's value rows one after the other */
                    for (int64_t t = 0; t < block_size; t++) {
                        const float *p = scores + (b - b0) * block_size + t; /* head hq's weight: p[hq * span] */
                        const int64_t row = h * head_elems + t * head_dim;
                        prefetch(v_pool, next < 0 ? -1 : next + row, head_dim, kv_dtype);
                        load_floats(v_pool, table[b] * block_elems + row, head_dim, kv_dtype, vrow);
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
#if PAGELLM_DOT_PRODUCTS /* cascade: then the shared blocks' values */
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

