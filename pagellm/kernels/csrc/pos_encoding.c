/* The rotary embedding (neox style), in place on a fused qkv output: PyTorch's values exactly (its
 * products rounded before they are added, bfloat16's rounding after every operation). */
#include "cpu_kernels.h"

/* In place on the first `heads` heads of each token's row (q then k heads of a fused qkv output):
 * x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) (neox style). cos, sin: float32 tables
 * [max_position, head_dim], rounded to the activations' dtype first (as the PyTorch path does). */
#if defined(__GNUC__) && !defined(__clang__) /* GCC's spelling; clang's is the pragma below */
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
