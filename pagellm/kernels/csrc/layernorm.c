/* RMSNorm, with the residual addition before it, in one pass per row: PyTorch's sequence of operations,
 * bfloat16's rounding included (see as_stored), to rounding (its sum of squares adds in another order). */
#include "cpu_kernels.h"

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
