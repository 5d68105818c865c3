/* The sampler's argmax and logsumexp over each row of the logits. */
#include "cpu_kernels.h"

/* Whether value v at index i replaces the maximum m found at index idx (the first maximum wins;
 * NaN is greater than everything, as in torch.argmax). */
static inline int takes_over(float v, int64_t i, float m, int64_t idx) {
    if (isnan(v)) return !isnan(m) || i < idx;
    return !isnan(m) && (v > m || (v == m && i < idx));
}

/* For each row of float32 logits [rows, vocab]: the index of its first maximum (as torch.argmax) and
 * log(sum(exp(row))), in one pass each over the row; rows are spread over the threads. A NaN counts as
 * the maximum (as in torch.argmax); -inf entries add exp(-87), nothing next to the maximum's 1. lse NULL:
 * the argmax only. The sampler needs both where a request asks for logprobs (greedy token, and its logprob =
 * logit - logsumexp), and PyTorch's argmax and log_softmax each make several passes over the logits. */
void pagellm_argmax_logsumexp(const float *logits, int64_t rows, int64_t vocab, /* vocab < 2^31 */ int64_t *argmax,
                              float *lse, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * vocab;
        /* 16 lanes, each keeping the first maximum of its positions (strictly greater replaces). */
        f32x16 lane_max, v;
        i32x16 lane_idx = {0}, position = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        for (int j = 0; j < 16; j++) lane_max[j] = x[0];
        int64_t t = 0;
        for (; t + 16 <= vocab; t += 16, position += 16) {
            memcpy(&v, x + t, sizeof v);
            const i32x16 greater = (v > lane_max) | (v != v); /* all ones where true; NaN counts as greatest */
            lane_max = (f32x16)(((i32x16)v & greater) | ((i32x16)lane_max & ~greater));
            lane_idx = (position & greater) | (lane_idx & ~greater);
        }
        float m = x[0];
        int64_t idx = 0;
        for (int j = 0; j < 16; j++)
            if (takes_over(lane_max[j], lane_idx[j], m, idx)) {
                m = lane_max[j];
                idx = lane_idx[j];
            }
        for (; t < vocab; t++)
            if (takes_over(x[t], t, m, idx)) {
                m = x[t];
                idx = t;
            }
        argmax[r] = idx;
        if (lse == NULL) continue; /* the argmax alone */
        if (!isfinite(m)) { /* as torch: NaN, +inf, or -inf for a row of -inf */
            lse[r] = m;
            continue;
        }
        float lane_sum[16] = {0};
        for (t = 0; t + 16 <= vocab; t += 16)
            for (int j = 0; j < 16; j++) lane_sum[j] += fast_exp(x[t + j] - m);
        float sum = 0.0f;
        for (int j = 0; j < 16; j++) sum += lane_sum[j];
        for (; t < vocab; t++) sum += fast_exp(x[t] - m);
        lse[r] = m + logf(sum);
    }
}
