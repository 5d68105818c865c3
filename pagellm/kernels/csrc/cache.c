/* K/V writes: the new tokens' keys and values into the pools (laid out as cpu_kernels.h says).
 * Each new token's K and V (rows of num_kv_heads * head_dim elements, of `elem` bytes, any stride
 * between rows: they are views of the fused qkv projection) go to its slot: each head's value row as
 * one copy, the key row scattered down its block's transposed columns. One call per layer instead of two
 * indexed PyTorch writes. A key row touches a cache line every 32 bytes of its block (the transposed
 * layout), so even a decode batch is spread over the threads. */
#include "cpu_kernels.h"

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

/* pagellm_write_kv with a conversion: K/V rows in dtype (float32 or bfloat16) into pools of kv_dtype
 * (fp8: rounded to nearest even, saturated; cpu_kernels.h). Returns 0, or -2 without memory (nothing
 * written). */
int pagellm_write_kv_converted(const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                               const int64_t *slots, int64_t tokens, void *k_pool, void *v_pool,
                               int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int dtype, int kv_dtype,
                               int num_threads) {
    const int64_t row = num_kv_heads * head_dim;
    float *rows = malloc((size_t)(num_threads * row) * sizeof(float)); /* each thread's row as float32 */
    if (rows == NULL) return -2;
#pragma omp parallel num_threads(num_threads) if (tokens >= 8)
    {
        float *values = rows + omp_get_thread_num() * row;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < tokens; i++) {
            const int64_t b = slots[i] / block_size, o = slots[i] % block_size;
            load_floats(v, i * v_stride, row, dtype, values);
            for (int64_t h = 0; h < num_kv_heads; h++) /* value row of head h: [b][h][o][:] */
                store_floats(v_pool, ((b * num_kv_heads + h) * block_size + o) * head_dim, head_dim, kv_dtype,
                             values + h * head_dim);
            load_floats(k, i * k_stride, row, dtype, values);
            const int64_t base = b * row * block_size + o; /* key element e: base + e * block_size */
            for (int64_t e = 0; e < row; e++) store_floats(k_pool, base + e * block_size, 1, kv_dtype, values + e);
        }
    }
    free(rows);
    return 0;
}
