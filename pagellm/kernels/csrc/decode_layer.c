/* Decode steps in one call.
 * A decode-only step of a Llama-family model (pagellm/model/llama.py) runs the same kernels in the
 * same order for every layer; from Python that is nine calls a layer, interpreter time that weighs
 * on every step and most on the small steps at the end of a batch.
 * pagellm_decode_layers makes those calls itself: DecoderLayer.forward's order, written out once
 * more, for bfloat16 models whose linears are all packed for the native kernel. Tests check that it
 * gives the Python path's bits (tests/model/test_native_decode.py). */
#include "cpu_kernels.h"

typedef struct {
    const uint16_t *input_norm, *post_norm;                 /* RMSNorm weights [hidden], bfloat16 */
    const uint32_t *qkv, *o, *gate_up, *down;               /* packed weights (gate_up gated) */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* float32 [out] or NULL */
    void *k_pool, *v_pool;                                  /* this layer's KV pools */
} pagellm_decode_layer;

typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, inter, block_size, max_blocks, window;
    float eps, scale;
    const int64_t *positions, *slots, *tables, *lens; /* per row: position, KV slot, block table, context */
    const int64_t *cascade;                           /* runs sharing their first blocks (attention_decode.c) */
    int64_t num_cascade;
    const float *cos, *sin;                           /* rotary tables [max_position, head_dim] */
    float *attention_scratch;                         /* num_threads * pagellm_scratch_floats(...) */
    uint16_t *normed, *qkv, *attention, *act;         /* work: rows x hidden, x qkv width, x heads * head_dim, */
                                                      /* x inter */
    const uint16_t *final_norm;                       /* the model's last RMSNorm [hidden], or NULL */
    float final_eps;
} pagellm_decode_step;

/* x: [rows, hidden] bfloat16, the embeddings in and the last layer's MLP output out; residual:
 * [rows, hidden], the running sum before that output (what DecoderLayer.forward returns). With
 * final_norm, the model's last norm follows: residual becomes the whole sum and x its normed rows
 * (what the model's forward returns). Returns 0, -1 where the linear kernel is not compiled in, -2
 * without memory. */
int pagellm_decode_layers(const pagellm_decode_layer *layers, int64_t num_layers, const pagellm_decode_step *s,
                          uint16_t *x, uint16_t *residual, int num_threads) {
    const int64_t q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim;
    const int64_t width = q_size + 2 * kv_size, rows = s->rows;
    for (int64_t l = 0; l < num_layers; l++) {
        const pagellm_decode_layer *w = &layers[l];
        if (l == 0) { /* the residual stream starts as the embeddings */
            memcpy(residual, x, (size_t)(rows * s->hidden) * sizeof(uint16_t));
            pagellm_rms_norm(x, NULL, NULL, w->input_norm, s->normed, rows, s->hidden, s->eps, PAGELLM_BF16,
                             num_threads);
        } else {
            pagellm_rms_norm(x, residual, residual, w->input_norm, s->normed, rows, s->hidden, s->eps, PAGELLM_BF16,
                             num_threads);
        }
        int status = pagellm_linear_bf16(s->normed, s->hidden, rows, s->hidden, w->qkv, width, w->qkv_bias, s->qkv,
                                         LINEAR_BF16, num_threads);
        if (status != 0) return status;
        pagellm_rotary(s->qkv, rows, width, s->heads + s->kv_heads, s->head_dim, s->positions, s->cos, s->sin,
                       PAGELLM_BF16, num_threads);
        pagellm_write_kv(s->qkv + q_size, width, s->qkv + q_size + kv_size, width, s->slots, rows, w->k_pool,
                         w->v_pool, s->kv_heads, s->head_dim, s->block_size, 2, num_threads);
        pagellm_paged_decode_attention(s->qkv, width, w->k_pool, w->v_pool, s->tables, s->lens, s->attention, rows,
                                       s->heads, s->kv_heads, s->head_dim, s->block_size, s->max_blocks, s->window,
                                       s->scale, PAGELLM_BF16, PAGELLM_BF16, num_threads, s->attention_scratch, s->cascade,
                                       s->num_cascade);
        status = pagellm_linear_bf16(s->attention, q_size, rows, q_size, w->o, s->hidden, w->o_bias, x, LINEAR_BF16,
                                     num_threads);
        if (status != 0) return status;
        pagellm_rms_norm(x, residual, residual, w->post_norm, s->normed, rows, s->hidden, s->eps, PAGELLM_BF16,
                         num_threads);
        status = pagellm_linear_bf16(s->normed, s->hidden, rows, s->hidden, w->gate_up, 2 * s->inter, w->gate_up_bias,
                                     s->act, LINEAR_SILU_GATED, num_threads);
        if (status != 0) return status;
        status = pagellm_linear_bf16(s->act, s->inter, rows, s->inter, w->down, s->hidden, w->down_bias, x, LINEAR_BF16,
                                     num_threads);
        if (status != 0) return status;
    }
    if (s->final_norm != NULL) /* in place: each row is read before its normed values are stored */
        pagellm_rms_norm(x, residual, residual, s->final_norm, x, rows, s->hidden, s->final_eps, PAGELLM_BF16,
                         num_threads);
    return 0;
}

/* ---- The same step for models whose linears keep quantized blocks (quant_linear.c), in float32 or
 * bfloat16 (dtype: the activations, norms and KV pools). Each linear is up to three row segments,
 * each in its own type (a GGUF file may store q and k in one type and v in another). */

typedef struct {
    const uint8_t *data[3];
    int64_t rows[3];
    int32_t type[3];
    int32_t count;
} pagellm_quant_matrix;

typedef struct {
    const void *input_norm, *post_norm;                       /* RMSNorm weights [hidden], in dtype */
    pagellm_quant_matrix qkv, o, gate_up, down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* float32 [out] or NULL */
    void *k_pool, *v_pool;
} pagellm_decode_quant_layer;

/* y[:, :rows of all segments] = x @ W.T (+ bias), segment by segment into its columns. */
static int quant_matmul(const pagellm_quant_matrix *w, const void *x, int64_t rows, int64_t k, const float *bias,
                        void *y, int64_t y_stride, int dtype, int int8_activations, int num_threads) {
    int (*linear)(const void *, int64_t, int, int64_t, int64_t, const uint8_t *, int, int64_t, const float *, void *,
                  int64_t, int, int) = int8_activations ? pagellm_quant_linear_int8 : pagellm_quant_linear;
    const int64_t elem = dtype == PAGELLM_F32 ? 4 : 2;
    int64_t first = 0;
    for (int i = 0; i < w->count; i++) {
        const int status = linear(x, k, dtype, rows, k, w->data[i], w->type[i], w->rows[i],
                                  bias != NULL ? bias + first : NULL, (char *)y + first * elem, y_stride, dtype,
                                  num_threads);
        if (status != 0) return status;
        first += w->rows[i];
    }
    return 0;
}

/* As pagellm_decode_layers, for quantized linears (with 8-bit input rows, quant_linear_int8.c, where
 * int8_activations is set): s's work buffers (normed, qkv, attention, act) hold
 * dtype elements, and gate_up is rows x 2 * inter of them more. Returns 0, -1 for a weight the
 * quantized kernel does not read, -2 without memory. */
int pagellm_decode_layers_quantized(const pagellm_decode_quant_layer *layers, int64_t num_layers,
                                    const pagellm_decode_step *s, void *x, void *residual, void *gate_up,
                                    int dtype, int int8_activations, int num_threads) {
    const int64_t q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim;
    const int64_t width = q_size + 2 * kv_size, rows = s->rows, elem = dtype == PAGELLM_F32 ? 4 : 2;
    void *normed = s->normed, *qkv = s->qkv, *attention = s->attention, *act = s->act;
    for (int64_t l = 0; l < num_layers; l++) {
        const pagellm_decode_quant_layer *w = &layers[l];
        if (l == 0) {
            memcpy(residual, x, (size_t)(rows * s->hidden * elem));
            pagellm_rms_norm(x, NULL, NULL, w->input_norm, normed, rows, s->hidden, s->eps, dtype, num_threads);
        } else {
            pagellm_rms_norm(x, residual, residual, w->input_norm, normed, rows, s->hidden, s->eps, dtype,
                             num_threads);
        }
        int status = quant_matmul(&w->qkv, normed, rows, s->hidden, w->qkv_bias, qkv, width, dtype, int8_activations,
                              num_threads);
        if (status != 0) return status;
        pagellm_rotary(qkv, rows, width, s->heads + s->kv_heads, s->head_dim, s->positions, s->cos, s->sin, dtype,
                       num_threads);
        pagellm_write_kv((char *)qkv + q_size * elem, width, (char *)qkv + (q_size + kv_size) * elem, width, s->slots,
                         rows, w->k_pool, w->v_pool, s->kv_heads, s->head_dim, s->block_size, elem, num_threads);
        pagellm_paged_decode_attention(qkv, width, w->k_pool, w->v_pool, s->tables, s->lens, attention, rows,
                                       s->heads, s->kv_heads, s->head_dim, s->block_size, s->max_blocks, s->window,
                                       s->scale, dtype, dtype, num_threads, s->attention_scratch, s->cascade,
                                       s->num_cascade);
        status = quant_matmul(&w->o, attention, rows, q_size, w->o_bias, x, s->hidden, dtype, int8_activations,
                              num_threads);
        if (status != 0) return status;
        pagellm_rms_norm(x, residual, residual, w->post_norm, normed, rows, s->hidden, s->eps, dtype, num_threads);
        status = quant_matmul(&w->gate_up, normed, rows, s->hidden, w->gate_up_bias, gate_up, 2 * s->inter, dtype,
                              int8_activations, num_threads);
        if (status != 0) return status;
        pagellm_silu_and_mul(gate_up, act, rows, s->inter, dtype, num_threads);
        status = quant_matmul(&w->down, act, rows, s->inter, w->down_bias, x, s->hidden, dtype, int8_activations,
                              num_threads);
        if (status != 0) return status;
    }
    if (s->final_norm != NULL)
        pagellm_rms_norm(x, residual, residual, s->final_norm, x, rows, s->hidden, s->final_eps, dtype, num_threads);
    return 0;
}
