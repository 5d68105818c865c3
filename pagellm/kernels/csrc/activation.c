/* The MLP's activation: silu(gate) * up, with PyTorch's rounding after each of its two operations. */
#include "cpu_kernels.h"

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
