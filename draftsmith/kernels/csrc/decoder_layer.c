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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_exp.h"

void small_gemm(const float *x, long m, long k, long ldx, const float *packed, long n, const float *bias, float *y,
                long ldy);
void small_gemm_f16(const float *x, long m, long k, long ldx, const uint16_t *packed, long n, const float *bias,
                    float *y, long ldy);
long row_argmax_f32(const float *row, long n);   /* sampling.c */
long row_sample_f32(const float *row, long n, float inv_temperature, double u, float *probs);

/* The layer's four projections, all fp32 panels or all fp16 panels (a draft's, small_gemm.c). */
static void project(int f16, const float *x, long m, long k, long ldx, const void *packed, long n, const float *bias,
                    float *y, long ldy) {
    if (f16)
        small_gemm_f16(x, m, k, ldx, packed, n, bias, y, ldy);
    else
        small_gemm(x, m, k, ldx, packed, n, bias, y, ldy);
}
int paged_attention_f32(const float *q, long ldq_t, long ldq_h, long num_tokens, const float *k_cache,
                        const float *v_cache, const int32_t *block_tables, long table_width, const int32_t *seq_lens,
                        const int32_t *cu_seqlens_q, long num_seqs, const uint8_t *tree_mask, long tree_width,
                        long num_heads, long kv_heads, long head_dim, long block_size, long max_q_len, float scale,
                        float *out);
int paged_kv_write_f32(const float *k, long ldk_t, long ldk_h, const float *v, long ldv_t, long ldv_h,
                       const int64_t *slots, long num_tokens, long num_slots, long kv_heads, long head_dim,
                       float *k_cache, float *v_cache);

/* HF's RMSNorm in fp32: x * rsqrt(mean(x^2) + eps), then * weight. */
static void rms_norm(const float *x, long rows, long d, const float *weight, float eps, float *out) {
    for (long r = 0; r < rows; r++) {
        const float *row = x + r * d;
        float sum = 0.0f;
        for (long i = 0; i < d; i++) sum += row[i] * row[i];
        float inv = 1.0f / sqrtf(sum / (float)d + eps);
        for (long i = 0; i < d; i++) out[r * d + i] = row[i] * inv * weight[i];
    }
}

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

/* What the draft loop needs of a model besides its stack (the argument lists above grew past what a reader
 * can check by eye, so the loop takes two structs; kernels/layers/native_draft_loop.py mirrors them). */
typedef struct {
    long d, num_layers, inter, num_heads, kv_heads, head_dim, num_slots, block_size;
    float eps, scale;
    int weights_f16;
    const float *const *in_norm, *const *post_norm;
    const void *const *qkv_w;
    const float *const *qkv_b;
    const void *const *o_w;
    const float *const *o_b;
    const void *const *gate_up_w;
    const float *const *gate_up_b;
    const void *const *down_w;
    const float *const *down_b;
    float *const *k_cache, *const *v_cache;
} native_stack_t;

typedef struct {
    const float *embed;          /* [vocab, d] */
    const void *fc;              /* EAGLE-1: packed [d, 2d], the step's input fc([embed ; feature]); NULL: embed */
    const float *fc_bias;
    int fc_f16;
    const float *hidden_norm;    /* EAGLE-3: [d], the feature's norm; the attention then reads            */
    const float *embed_norm;     /* [embed_norm(embed) ; hidden_norm(feature)] (2d) and the residual stream */
    int norm_before_residual;    /* starts from the feature (or its normed form); one layer, no fc         */
    float input_eps;
    const float *final_norm;     /* [d], NULL: the head reads the stack's output (EAGLE-1's predicted feature) */
    float final_eps;
    const void *head;            /* packed [vocab, d], fp16 panels when head_f16 */
    const float *head_bias;      /* [vocab] or NULL */
    int head_f16;
    long vocab;                  /* rows of embed: the token ids fed */
    long head_vocab;             /* rows of head: the argmax's range */
    const int64_t *d2t;          /* [head_vocab] or NULL: head row i is token i + d2t[i] (EAGLE-3's reduced vocabulary) */
    const float *cos, *sin;      /* [max_positions, head_dim]: the rope table, signed sin */
    long max_positions;
} draft_ends_t;

/* Up to max_steps decode steps of a draft for num_seqs sequences, all in C: per step, the embedding rows of the
 * previous tokens (through fc with each sequence's feature, EAGLE-1; or EAGLE-3's normed [embed ; feature] as the
 * one layer's attention input, its feature as the residual), the rope rows, the slots from each block table, the
 * whole stack (KV written), the final norm, the head and the step's token (through d2t for a reduced vocabulary):
 * - greedy (inv_temperatures NULL, or 0 for the sequence): the argmax, the first of equal maxima as torch.argmax;
 * - sampled: the row softmax(logits * inv_temperature) is written to out_probs[(j * max_steps + s) * head_vocab]
 *   and the token drawn from exactly that row by inverting its float64 CDF at uniforms[j * max_steps + s]
 *   (sampling.c's row_sample_f32: the rule of kernels/sampling.py's sample). The
 *   verifier's q is the row returned, so the draw follows q whatever the rounding of the exp.
 * Sequence j feeds first_tokens[j] at rope position start_positions[j] and cache entry start_entries[j] (a
 * standalone draft's entries are its positions; EAGLE's cache starts later) and runs num_steps[j] steps; with
 * first_cu (int32 [num_seqs + 1]) its first step feeds the rows first_tokens[first_cu[j] .. first_cu[j + 1]) at
 * consecutive positions and entries from there (the catch-up: the tokens its cache lacks), picks from the last of
 * them, and every later step sits that many rows further on; a draft with features then reads row r's from
 * first_features [first_cu[num_seqs], d] and only writes `features`.
 * Why: the catch-up as a forward of its own cost a Python forward per round, more than two C steps;
 * out_tokens[j * max_steps + s] is its step s's token. features [num_seqs, d] (with fc): each sequence's feature,
 * replaced by the stack's output at every step. Why: a 1-layer draft's step is ~0.4 ms of C inside ~1 ms of
 * per-step Python (metadata, tensors, embedding, rope, norm, sampling). Returns 0, -2 for a token, position or
 * block outside its table (nothing past that step is written), -3 when the workspace could not be allocated,
 * else the stack's status. */
/* The loop's sequences (the caller's arrays) and its workspace: a step's rows for the n sequences still going. */
typedef struct {
    const int32_t *block_tables;
    long table_width, max_steps;
    const int64_t *first_tokens, *start_positions, *start_entries;
    const int32_t *first_cu;         /* [num_seqs + 1] or NULL: one first token per sequence */
    const float *first_features;     /* [first_cu[num_seqs], d]: a catch-up's rows' features (drafts with features) */
    float *features;
    const float *inv_temperatures;   /* [num_seqs] or NULL (all greedy): 0 = greedy */
    const double *uniforms;          /* [num_seqs, max_steps]: a sampled sequence's draws */
    float *out_probs;                /* [num_seqs, max_steps, head_vocab]: a sampled step's row */
    int64_t *out_tokens;
} draft_seqs_t;

typedef struct {
    float *hidden, *x, *cos, *sin, *logits;
    int64_t *slots;
    int32_t *group, *seq_lens, *cu, *tables;
    long rows, max_q_len;            /* the step's rows (a catch-up: more than its sequences), the most per sequence */
} draft_work_t;

/* One input row: token at rope position pos and cache entry entry of sequence j, into workspace row i. */
static int draft_row(const native_stack_t *s, const draft_ends_t *e, const draft_seqs_t *q, draft_work_t *w, long i,
                     long j, int64_t token, int64_t pos, int64_t entry, const float *feature) {
    long d = s->d, hd = s->head_dim, bs = s->block_size, tw = q->table_width;
    if (token < 0 || token >= e->vocab || pos < 0 || pos >= e->max_positions || entry < 0 || entry / bs >= tw
        || q->block_tables[j * tw + entry / bs] < 0)
        return -2;
    const float *embed = e->embed + token * d;
    if (e->hidden_norm) {  /* EAGLE-3: the attention's input and the residual stream */
        float *normed = w->x + i * 2 * d + d;
        rms_norm(embed, 1, d, e->embed_norm, e->input_eps, w->x + i * 2 * d);
        rms_norm(feature, 1, d, e->hidden_norm, e->input_eps, normed);
        memcpy(w->hidden + i * d, e->norm_before_residual ? normed : feature, sizeof(float) * d);
    } else if (e->fc) {  /* [embed ; feature] rows, projected by draft_forward */
        memcpy(w->x + i * 2 * d, embed, sizeof(float) * d);
        memcpy(w->x + i * 2 * d + d, feature, sizeof(float) * d);
    } else {
        memcpy(w->hidden + i * d, embed, sizeof(float) * d);
    }
    memcpy(w->cos + i * hd, e->cos + pos * hd, sizeof(float) * hd);
    memcpy(w->sin + i * hd, e->sin + pos * hd, sizeof(float) * hd);
    w->slots[i] = (int64_t)q->block_tables[j * tw + entry / bs] * bs + entry % bs;
    return 0;
}

/* Rows fed before step `step` picks, for sequence j: its catch-up rows (1 without first_cu), then one per step. */
static long rows_before(const draft_seqs_t *q, long j, long step) {
    return (q->first_cu ? q->first_cu[j + 1] - q->first_cu[j] : 1) - 1 + step;
}

/* Step `step`'s input rows, rope rows, slots and metadata for the n sequences in w->group (step 0 with first_cu:
 * each sequence's catch-up rows); -2 for a token, position or cache entry outside its table. */
static int draft_rows(const native_stack_t *s, const draft_ends_t *e, const draft_seqs_t *q, draft_work_t *w,
                      long step, long n) {
    long tw = q->table_width, row = 0;
    w->max_q_len = 1;
    for (long i = 0; i < n; i++) {
        long j = w->group[i], last = rows_before(q, j, step);   /* the entry offset of the row that picks */
        long first = step == 0 ? 0 : last;
        for (long r = first; r <= last; r++, row++) {
            long fed = (q->first_cu ? q->first_cu[j] : j) + r;   /* the first step's row of first_tokens */
            int64_t token = step ? q->out_tokens[j * q->max_steps + step - 1] : q->first_tokens[fed];
            const float *feature = !q->features ? NULL
                                   : step == 0 && q->first_features ? q->first_features + fed * s->d
                                                                    : q->features + j * s->d;
            int status = draft_row(s, e, q, w, row, j, token, q->start_positions[j] + r, q->start_entries[j] + r,
                                   feature);
            if (status != 0) return status;
        }
        memcpy(w->tables + i * tw, q->block_tables + j * tw, sizeof(int32_t) * tw);
        w->seq_lens[i] = (int32_t)(q->start_entries[j] + last + 1);
        w->cu[i + 1] = (int32_t)row;
        if (last - first + 1 > w->max_q_len) w->max_q_len = last - first + 1;
    }
    w->cu[0] = 0;
    w->rows = row;
    return 0;
}

/* The draft's layers over the step's rows (KV written): EAGLE-3's one layer with its built attention input, else
 * fc (EAGLE-1) and the stack. */
static int draft_forward(const native_stack_t *s, const draft_ends_t *e, draft_work_t *w, long n, long tw) {
    long d = s->d, rows = w->rows;
    if (e->hidden_norm)
        return decoder_layer_f32(w->hidden, rows, d, w->x, 2 * d, NULL, s->post_norm[0], s->eps, s->weights_f16,
                                 s->qkv_w[0], s->qkv_b[0], s->o_w[0], s->o_b[0], s->gate_up_w[0], s->gate_up_b[0],
                                 s->down_w[0], s->down_b[0], s->inter, w->cos, w->sin, s->num_heads, s->kv_heads,
                                 s->head_dim, s->k_cache[0], s->v_cache[0], w->slots, s->num_slots, w->tables, tw,
                                 w->seq_lens, w->cu, n, NULL, 0, s->block_size, w->max_q_len, s->scale, NULL, 0);
    if (e->fc) project(e->fc_f16, w->x, rows, 2 * d, 2 * d, e->fc, d, e->fc_bias, w->hidden, d);
    return decoder_stack_f32(w->hidden, rows, d, s->num_layers, s->in_norm, s->post_norm, s->eps, s->weights_f16,
                             s->qkv_w, s->qkv_b, s->o_w, s->o_b, s->gate_up_w, s->gate_up_b, s->down_w, s->down_b,
                             s->inter, w->cos, w->sin, s->num_heads, s->kv_heads, s->head_dim, s->k_cache, s->v_cache,
                             w->slots, s->num_slots, w->tables, tw, w->seq_lens, w->cu, n, NULL, 0, s->block_size,
                             w->max_q_len, s->scale, NULL, NULL, 0);
}

/* The carried features, then final norm, head and each sequence's step token (argmax or draw, through d2t). */
static void draft_pick(const draft_ends_t *e, const draft_seqs_t *q, draft_work_t *w, long d, long n, long step) {
    if (w->rows > n)   /* a catch-up: each sequence picks from its last row (cu[i + 1] - 1 >= i: read before written) */
        for (long i = 0; i < n; i++) memmove(w->hidden + i * d, w->hidden + (w->cu[i + 1] - 1) * d, sizeof(float) * d);
    if (q->features)
        for (long i = 0; i < n; i++) memcpy(q->features + w->group[i] * d, w->hidden + i * d, sizeof(float) * d);
    if (e->final_norm) rms_norm(w->hidden, n, d, e->final_norm, e->final_eps, w->x);
    project(e->head_f16, e->final_norm ? w->x : w->hidden, n, d, d, e->head, e->head_vocab, e->head_bias, w->logits,
            e->head_vocab);
    for (long i = 0; i < n; i++) {
        long j = w->group[i], at = j * q->max_steps + step;
        const float *row = w->logits + i * e->head_vocab;
        float inv_temperature = q->inv_temperatures ? q->inv_temperatures[j] : 0.0f;
        long head_row = inv_temperature > 0.0f
                            ? row_sample_f32(row, e->head_vocab, inv_temperature, q->uniforms[at],
                                             q->out_probs + at * e->head_vocab)
                            : row_argmax_f32(row, e->head_vocab);
        q->out_tokens[at] = e->d2t ? head_row + e->d2t[head_row] : head_row;
    }
}

int draft_decode_f32(const native_stack_t *s, const draft_ends_t *e, long num_seqs, const int32_t *block_tables,
                     long table_width, const int64_t *first_tokens, const int32_t *first_cu,
                     const float *first_features, const int64_t *start_positions, const int64_t *start_entries,
                     const int32_t *num_steps, long max_steps, float *features, const float *inv_temperatures,
                     const double *uniforms, float *out_probs, int64_t *out_tokens) {
    long n_max = num_seqs, d = s->d, hd = s->head_dim;
    if (n_max <= 0 || max_steps <= 0) return 0;
    if (((e->fc || e->hidden_norm) && !features) || (e->hidden_norm && s->num_layers != 1)
        || (inv_temperatures && (!uniforms || !out_probs)) || (first_cu && first_cu[0] != 0)
        || ((e->fc || e->hidden_norm) && first_cu && !first_features))
        return -2;
    for (long j = 0; first_cu && j < num_seqs; j++)   /* a catch-up feeds a row or more and picks */
        if (first_cu[j + 1] <= first_cu[j] || num_steps[j] < 1) return -2;
    if (first_cu && first_cu[num_seqs] > n_max) n_max = first_cu[num_seqs];
    int carries = e->fc || e->hidden_norm;
    draft_seqs_t q = {block_tables, table_width, max_steps, first_tokens, start_positions, start_entries, first_cu,
                      carries && first_cu ? first_features : NULL, carries ? features : NULL, inv_temperatures,
                      uniforms, out_probs, out_tokens};
    draft_work_t w;
    w.hidden = malloc(sizeof(float) * n_max * (3 * d + 2 * hd + e->head_vocab));
    w.slots = malloc(sizeof(int64_t) * n_max);
    w.group = malloc(sizeof(int32_t) * (n_max * (3 + table_width) + 1));
    if (!w.hidden || !w.slots || !w.group) {
        free(w.hidden); free(w.slots); free(w.group);
        return -3;
    }
    w.x = w.hidden + n_max * d, w.cos = w.x + n_max * 2 * d, w.sin = w.cos + n_max * hd, w.logits = w.sin + n_max * hd;
    w.seq_lens = w.group + n_max, w.cu = w.seq_lens + n_max, w.tables = w.cu + n_max + 1;
    int status = 0;
    for (long step = 0; step < max_steps && status == 0; step++) {
        long n = 0;
        for (long j = 0; j < num_seqs; j++)
            if (num_steps[j] > step) w.group[n++] = (int32_t)j;
        if (n == 0) break;
        status = draft_rows(s, e, &q, &w, step, n);
        if (status == 0) status = draft_forward(s, e, &w, n, table_width);
        if (status == 0) draft_pick(e, &q, &w, d, n, step);
    }
    free(w.hidden); free(w.slots); free(w.group);
    return status;
}
