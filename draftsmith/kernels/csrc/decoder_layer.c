/* One pre-norm Llama decoder layer over a step's few rows (a decode step, a verify chain, a draft step), fp32:
 * norm -> q/k/v -> rope -> KV write -> paged attention -> o -> residual -> norm -> gate/up -> SwiGLU -> down ->
 * residual, in one call.
 *
 * Why: with the projections and the attention already in C (small_gemm.c, paged_attention.c), what is left of
 * a layer in torch is ~40 small ops (norms, rope, slicing, SiLU, residual adds) at 3-10 us of dispatch each on
 * a small CPU: more than the layer's arithmetic at batch 1. The projections here are the same small_gemm calls
 * the serving Linear makes, so a row's result still does not depend on the rows beside it.
 *
 * in_norm NULL: a layer without an input norm (EAGLE-1's). attn_in non-NULL: the attention's input, [rows,
 * attn_in_width], built by the caller (EAGLE-3's layer reads [norm(embeds) ; norm(hidden)]); hidden is then the
 * residual stream only. Layouts: hidden [rows, d] (the residual stream, updated in place); cos / signed sin [rows, head_dim] (the
 * rope table's rows for this step's positions, sin = (-sin | sin)); packed weights as small_gemm_pack makes
 * them (weights_f16: the fp16 panels of a draft's weights); the KV cache, slots and attention metadata as paged_attention.c documents.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layer_ops.h"
#include "vec_exp.h"

/* x * cos + rotate_half(x) * sin on every q and k head of each row (rotate_half(x)[i] = x[(i + D/2) mod D], the
 * sign folded into sin). Eight lanes at a time where D/2 is a multiple of 8 (every shape we serve); a lane's value
 * depends only on its own element, so a row's result does not depend on the rows beside it. */
AVX2_FMA static void rope(float *qkv, long rows, long ld, long heads, long head_dim, const float *cos,
                          const float *sin) {
    long half = head_dim / 2;
    float tmp[head_dim];
    for (long r = 0; r < rows; r++)
        for (long h = 0; h < heads; h++) {
            float *x = qkv + r * ld + h * head_dim;
            const float *c = cos + r * head_dim, *s = sin + r * head_dim;
            if (half % 8 == 0) {
                for (long i = 0; i < half; i += 8) {
                    __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + half + i);
                    __m256 new_lo = _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(c + i)),
                                                  _mm256_mul_ps(hi, _mm256_loadu_ps(s + i)));
                    __m256 new_hi = _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(c + half + i)),
                                                  _mm256_mul_ps(lo, _mm256_loadu_ps(s + half + i)));
                    _mm256_storeu_ps(x + i, new_lo);
                    _mm256_storeu_ps(x + half + i, new_hi);
                }
                continue;
            }
            for (long i = 0; i < head_dim; i++) tmp[i] = x[i] * c[i] + x[i < half ? i + half : i - half] * s[i];
            for (long i = 0; i < head_dim; i++) x[i] = tmp[i];
        }
}

/* g[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u over one row, eight lanes at a time (exp8; the tail as one more
 * vector padded with zeros), so each element's value depends on that element alone. */
AVX2_FMA static void silu_mul(float *g, const float *u, long n) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 act = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, sign))));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(act, _mm256_loadu_ps(u + i)));
    }
    if (i < n) {
        float gt[8] = {0}, ut[8] = {0};
        for (long j = i; j < n; j++) gt[j - i] = g[j], ut[j - i] = u[j];
        __m256 gv = _mm256_loadu_ps(gt);
        __m256 act = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, sign))));
        _mm256_storeu_ps(gt, _mm256_mul_ps(act, _mm256_loadu_ps(ut)));
        for (long j = i; j < n; j++) g[j] = gt[j - i];
    }
}

/* Rows keep[0..n) of x [rows, width] moved to rows 0..n (keep strictly ascending, so keep[i] >= i: a forward copy
 * never overwrites a row still to be moved). */
static void compact_rows(float *x, long width, const int64_t *keep, long n) {
    for (long i = 0; i < n; i++)
        if (keep[i] != i) memmove(x + i * width, x + keep[i] * width, sizeof(float) * width);
}

static int keep_is_valid(const int64_t *keep, long n, long rows) {
    for (long i = 0; i < n; i++)
        if (keep[i] < (i ? keep[i - 1] + 1 : 0) || keep[i] >= rows) return 0;
    return n > 0;
}

/* Returns 0; else paged_attention_f32's status (> 0: a sequence with more than max_q_len rows, -1: no memory,
 * -2: bad metadata), -3 when the workspace could not be allocated, -4 for a slot outside the cache.
 * keep non-NULL: only rows keep[0..num_keep) leave the layer (strictly ascending, checked by the caller), written
 * to hidden's first num_keep rows. Every row's K and V are still written and every row attends (the kept rows read
 * the others' keys); the o projection, the norm and the MLP run on the kept rows alone. */
int decoder_layer_f32(float *hidden, long rows, long d, const float *attn_in, long attn_in_width,
                      const float *in_norm, const float *post_norm, float eps,
                      int weights_f16, const void *qkv_w, const float *qkv_b, const void *o_w, const float *o_b,
                      const void *gate_up_w, const float *gate_up_b, const void *down_w, const float *down_b,
                      long inter, const float *cos, const float *sin, long num_heads, long kv_heads, long head_dim,
                      float *k_cache, float *v_cache, const int64_t *slots, long num_slots,
                      const int32_t *block_tables, long table_width, const int32_t *seq_lens,
                      const int32_t *cu_seqlens_q, long num_seqs, const uint8_t *tree_mask, long tree_width,
                      long block_size, long max_q_len, float scale, const int64_t *keep, long num_keep) {
    long q_width = num_heads * head_dim, kv_width = kv_heads * head_dim, qkv_width = q_width + 2 * kv_width;
    float *x = malloc(sizeof(float) * rows * (d + qkv_width + q_width + 2 * inter + d));
    if (!x) return -3;
    float *qkv = x + rows * d, *attn = qkv + rows * qkv_width, *gate_up = attn + rows * q_width;
    float *proj = gate_up + rows * 2 * inter;
    if (attn_in)  /* EAGLE-3's layer: the caller built the attention input ([norm(embeds) ; norm(hidden)]) */
        project(weights_f16, attn_in, rows, attn_in_width, attn_in_width, qkv_w, qkv_width, qkv_b, qkv, qkv_width);
    else {
        if (in_norm)
            rms_norm(hidden, rows, d, in_norm, eps, x);
        else  /* EAGLE-1's layer: its input (the fc output) enters attention as it is */
            memcpy(x, hidden, sizeof(float) * rows * d);
        project(weights_f16, x, rows, d, d, qkv_w, qkv_width, qkv_b, qkv, qkv_width);
    }
    rope(qkv, rows, qkv_width, num_heads + kv_heads, head_dim, cos, sin);
    if (paged_kv_write_f32(qkv + q_width, qkv_width, head_dim, qkv + q_width + kv_width, qkv_width, head_dim, slots,
                           rows, num_slots, kv_heads, head_dim, k_cache, v_cache) != 0) {
        free(x);
        return -4;
    }
    int status = paged_attention_f32(qkv, qkv_width, head_dim, rows, k_cache, v_cache, block_tables, table_width,
                                     seq_lens, cu_seqlens_q, num_seqs, tree_mask, tree_width, num_heads, kv_heads,
                                     head_dim, block_size, max_q_len, scale, attn);
    if (status != 0) {
        free(x);
        return status;
    }
    if (keep) {   /* only the kept rows go on: their attention output and residual stream, moved to the front */
        compact_rows(attn, q_width, keep, num_keep);
        compact_rows(hidden, d, keep, num_keep);
        rows = num_keep;
    }
    project(weights_f16, attn, rows, q_width, q_width, o_w, d, o_b, proj, d);
    for (long i = 0; i < rows * d; i++) hidden[i] += proj[i];
    rms_norm(hidden, rows, d, post_norm, eps, x);
    project(weights_f16, x, rows, d, d, gate_up_w, 2 * inter, gate_up_b, gate_up, 2 * inter);
    for (long r = 0; r < rows; r++)  /* silu(gate) * up, into the gate half */
        silu_mul(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, inter);
    project(weights_f16, gate_up, rows, inter, 2 * inter, down_w, d, down_b, proj, d);
    for (long i = 0; i < rows * d; i++) hidden[i] += proj[i];
    free(x);
    return 0;
}

/* A model's whole stack of such layers in one call (layer l's tensors at index l of each pointer array), so a
 * forward pays the call's marshalling once instead of once per layer (~30 us each on a small CPU, ~10% of a
 * 20-layer decode step). aux_out[l] non-NULL receives the residual stream after layer l. Every layer shares the
 * shapes, eps, weight format and attention metadata; the caches and weights are each layer's own. last_rows
 * non-NULL: only those rows (strictly ascending) leave the last layer, in hidden's first num_last_rows rows (a
 * block draft reads offsets 1..K of its 1 + K_max rows); -5 when they are not strictly ascending rows of the step. */
int decoder_stack_f32(float *hidden, long rows, long d, long num_layers, const float *const *in_norm,
                      const float *const *post_norm, float eps, int weights_f16, const void *const *qkv_w,
                      const float *const *qkv_b, const void *const *o_w, const float *const *o_b,
                      const void *const *gate_up_w, const float *const *gate_up_b, const void *const *down_w,
                      const float *const *down_b, long inter, const float *cos, const float *sin, long num_heads,
                      long kv_heads, long head_dim, float *const *k_cache, float *const *v_cache,
                      const int64_t *slots, long num_slots, const int32_t *block_tables, long table_width,
                      const int32_t *seq_lens, const int32_t *cu_seqlens_q, long num_seqs, const uint8_t *tree_mask,
                      long tree_width, long block_size, long max_q_len, float scale, float *const *aux_out,
                      const int64_t *last_rows, long num_last_rows) {
    if (last_rows && !keep_is_valid(last_rows, num_last_rows, rows)) return -5;
    for (long l = 0; l < num_layers; l++) {
        int last = l == num_layers - 1 && last_rows;
        int status = decoder_layer_f32(hidden, rows, d, NULL, 0, in_norm[l], post_norm[l], eps, weights_f16, qkv_w[l],
                                       qkv_b[l], o_w[l], o_b[l], gate_up_w[l], gate_up_b[l], down_w[l], down_b[l],
                                       inter, cos, sin, num_heads, kv_heads, head_dim, k_cache[l], v_cache[l], slots,
                                       num_slots, block_tables, table_width, seq_lens, cu_seqlens_q, num_seqs,
                                       tree_mask, tree_width, block_size, max_q_len, scale, last ? last_rows : NULL,
                                       last ? num_last_rows : 0);
        if (status != 0) return status;
        if (aux_out && aux_out[l]) memcpy(aux_out[l], hidden, sizeof(float) * (last ? num_last_rows : rows) * d);
    }
    return 0;
}

/* A block draft's context rows into every layer's KV cache, in one call: ctx = rms_norm(fc(aux)) [rows, d], then
 * kv = ctx @ W_kv^T [rows, 2 L KVH D] (every layer's k heads, then every layer's v heads: one matrix for all layers),
 * rope on the k heads (cos / signed sin [rows, head_dim]), and layer l's k and v written to its caches at slots.
 * Why: in torch this is ~15 small ops (two projections, a norm, the rope's slicing, a write per layer) at 3-10 us of
 * dispatch each, a quarter of a block round at batch 1 for the one or two rows a round injects. fc_f16 / kv_f16:
 * fp16 panels (small_gemm.c). Returns 0, -3 when the workspace could not be allocated, -4 for a slot outside the
 * caches. */
int context_kv_f32(const float *aux, long rows, long aux_width, int fc_f16, const void *fc_w, const float *fc_b,
                   long d, const float *norm_w, float eps, int kv_f16, const void *kv_w, const float *kv_b,
                   long num_layers, long kv_heads, long head_dim, const float *cos, const float *sin,
                   float *const *k_cache, float *const *v_cache, const int64_t *slots, long num_slots) {
    long layer_width = kv_heads * head_dim, width = 2 * num_layers * layer_width;
    float *fused = malloc(sizeof(float) * rows * (2 * d + width));
    if (!fused) return -3;
    float *ctx = fused + rows * d, *kv = ctx + rows * d;
    project(fc_f16, aux, rows, aux_width, aux_width, fc_w, d, fc_b, fused, d);
    rms_norm(fused, rows, d, norm_w, eps, ctx);
    project(kv_f16, ctx, rows, d, d, kv_w, width, kv_b, kv, width);
    rope(kv, rows, width, num_layers * kv_heads, head_dim, cos, sin);
    int status = 0;
    for (long l = 0; l < num_layers && status == 0; l++)
        status = paged_kv_write_f32(kv + l * layer_width, width, head_dim, kv + (num_layers + l) * layer_width, width,
                                    head_dim, slots, rows, num_slots, kv_heads, head_dim, k_cache[l], v_cache[l]);
    free(fused);
    return status == 0 ? 0 : -4;
}
