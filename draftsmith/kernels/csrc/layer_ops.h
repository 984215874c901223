/* What decoder_layer.c and draft_loop.c share: the kernels they call (parallel.c's small_gemm over small_gemm.c's
 * panels, sampling.c, paged_attention.c, and the layer and stack of decoder_layer.c for the draft loop) and two
 * helpers of a layer's arithmetic. */
#ifndef DRAFTSMITH_LAYER_OPS_H
#define DRAFTSMITH_LAYER_OPS_H

#include <math.h>
#include <stdint.h>

void small_gemm(const float *x, long m, long k, long ldx, const float *packed, long n, const float *bias, float *y,
                long ldy);
void small_gemm_f16(const float *x, long m, long k, long ldx, const uint16_t *packed, long n, const float *bias,
                    float *y, long ldy);
long row_argmax_f32(const float *row, long n);   /* sampling.c */
long row_sample_f32(const float *row, long n, float inv_temperature, double u, float *probs);
int paged_attention_f32(const float *q, long ldq_t, long ldq_h, long num_tokens, const float *k_cache,
                        const float *v_cache, const int32_t *block_tables, long table_width, const int32_t *seq_lens,
                        const int32_t *cu_seqlens_q, long num_seqs, const uint8_t *tree_mask, long tree_width,
                        long num_heads, long kv_heads, long head_dim, long block_size, long max_q_len, float scale,
                        float *out);
int paged_kv_write_f32(const float *k, long ldk_t, long ldk_h, const float *v, long ldv_t, long ldv_h,
                       const int64_t *slots, long num_tokens, long num_slots, long kv_heads, long head_dim,
                       float *k_cache, float *v_cache);

/* decoder_layer.c */
int decoder_layer_f32(float *hidden, long rows, long d, const float *attn_in, long attn_in_width,
                      const float *in_norm, const float *post_norm, float eps,
                      int weights_f16, const void *qkv_w, const float *qkv_b, const void *o_w, const float *o_b,
                      const void *gate_up_w, const float *gate_up_b, const void *down_w, const float *down_b,
                      long inter, const float *cos, const float *sin, long num_heads, long kv_heads, long head_dim,
                      float *k_cache, float *v_cache, const int64_t *slots, long num_slots,
                      const int32_t *block_tables, long table_width, const int32_t *seq_lens,
                      const int32_t *cu_seqlens_q, long num_seqs, const uint8_t *tree_mask, long tree_width,
                      long block_size, long max_q_len, float scale, const int64_t *keep, long num_keep);
int decoder_stack_f32(float *hidden, long rows, long d, long num_layers, const float *const *in_norm,
                      const float *const *post_norm, float eps, int weights_f16, const void *const *qkv_w,
                      const float *const *qkv_b, const void *const *o_w, const float *const *o_b,
                      const void *const *gate_up_w, const float *const *gate_up_b, const void *const *down_w,
                      const float *const *down_b, long inter, const float *cos, const float *sin, long num_heads,
                      long kv_heads, long head_dim, float *const *k_cache, float *const *v_cache,
                      const int64_t *slots, long num_slots, const int32_t *block_tables, long table_width,
                      const int32_t *seq_lens, const int32_t *cu_seqlens_q, long num_seqs, const uint8_t *tree_mask,
                      long tree_width, long block_size, long max_q_len, float scale, float *const *aux_out,
                      const int64_t *last_rows, long num_last_rows);

/* The layer's four projections, all fp32 panels or all fp16 panels (a draft's, small_gemm.c). */
static inline void project(int f16, const float *x, long m, long k, long ldx, const void *packed, long n,
                           const float *bias, float *y, long ldy) {
    if (f16)
        small_gemm_f16(x, m, k, ldx, packed, n, bias, y, ldy);
    else
        small_gemm(x, m, k, ldx, packed, n, bias, y, ldy);
}

/* HF's RMSNorm in fp32: x * rsqrt(mean(x^2) + eps), then * weight. */
static inline void rms_norm(const float *x, long rows, long d, const float *weight, float eps, float *out) {
    for (long r = 0; r < rows; r++) {
        const float *row = x + r * d;
        float sum = 0.0f;
        for (long i = 0; i < d; i++) sum += row[i] * row[i];
        float inv = 1.0f / sqrtf(sum / (float)d + eps);
        for (long i = 0; i < d; i++) out[r * d + i] = row[i] * inv * weight[i];
    }
}

#endif
