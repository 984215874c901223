/* Paged attention of a few new tokens per sequence (decode rows, verify chains, trees, a draft's catch-up)
 * over the paged KV cache, fp32, AVX2 + FMA: one call per layer for the whole batch.
 *
 * Why C: on a CPU the torch path spends its time between ops, not in them. Gathering a sequence's keys, a
 * batched GEMV, softmax and a weighted bag of values is ~25 aten ops per layer plus a per-forward plan of
 * ~25 more (a 1-token decode over 300 positions took ~220 us there, its arithmetic ~10 us). Here the block
 * table is followed in place: no gather, no padding, no mask tensors.
 *
 * Layouts (all contiguous unless a stride is passed):
 *   q            [T, H, D] with row stride ldq_t and head stride ldq_h (q is a view of the qkv projection)
 *   k/v cache    [num_slots, KVH, D], slot = block * block_size + offset
 *   block_tables int32 [B, table_width]; seq_lens int32 [B] (context INCLUDING new tokens);
 *   cu_seqlens_q int32 [B + 1]; new token j of sequence i is row cu[i] + j at position seq_lens[i] - L_i + j
 *   tree_mask    uint8 [T, tree_width] (NULL = causal among the new tokens): row t may see new token l
 *   out          [T, H, D]
 * Sequences with more than max_q_len new tokens are skipped (the caller serves long prefill chunks).
 *
 * Query heads h * group .. (h + 1) * group - 1 share kv head h (HF's repeat_kv order). Scores and softmax are
 * fp32 with the max subtracted, as torch's softmax; masked positions get weight exactly 0.
 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "vec_exp.h"

/* The dot products of q with 8 keys, one lane each: 8 FMA chains over the head, each reduced by the same tree
 * ((0+1)+(2+3))+((4+5)+(6+7)) whatever its lane, so a score does not depend on its neighbours. */
AVX2_FMA static inline __m256 dot_8_keys(const float *q, const float *const *keys, long d) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (long i = 0; i < d; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[j] + i), a[j]);
    }
    __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* Row s[0..n): s = softmax(s) in place (fp32, the max subtracted); a row that sees nothing becomes zeros. */
AVX2_FMA static void softmax_row(float *s, long n) {
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    long p = 0;
    for (; p + 8 <= n; p += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + p));
    float lanes[8], top = -INFINITY, total = 0.0f;
    _mm256_storeu_ps(lanes, top8);
    for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    for (long i = p; i < n; i++) top = s[i] > top ? s[i] : top;
    if (top == -INFINITY) {  /* a tree row that sees nothing attends to nothing */
        for (long i = 0; i < n; i++) s[i] = 0.0f;
        return;
    }
    __m256 sum8 = _mm256_setzero_ps(), top_v = _mm256_set1_ps(top);
    for (p = 0; p + 8 <= n; p += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + p), top_v));
        _mm256_storeu_ps(s + p, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    if (p < n) {  /* the tail as one more vector, padded with exp(-inf) = 0 */
        float tail[8];
        for (int i = 0; i < 8; i++) tail[i] = p + i < n ? s[p + i] - top : -INFINITY;
        __m256 e = exp8(_mm256_loadu_ps(tail));
        _mm256_storeu_ps(tail, e);
        for (long i = p; i < n; i++) s[i] = tail[i - p];
        sum8 = _mm256_add_ps(sum8, e);
    }
    /* Lane i sums positions i, i + 8, ... in order: a row of a verify block (later positions masked, exp 0) sums
     * exactly what the same token's decode step sums, so the two agree bit for bit. */
    _mm256_storeu_ps(lanes, sum8);
    for (int i = 0; i < 8; i++) total += lanes[i];
    __m256 inv = _mm256_set1_ps(1.0f / total);
    for (p = 0; p + 8 <= n; p += 8) _mm256_storeu_ps(s + p, _mm256_mul_ps(_mm256_loadu_ps(s + p), inv));
    for (; p < n; p++) s[p] *= 1.0f / total;
}

/* out[0..8*NV) (+)= sum_p w[p] * V[p][0..8*NV) over positions [start, end) of one cache block (values: the block's
 * row of position start), from zero when `first`, else from what out holds: a row's sum over its context, block by
 * block, is one FMA chain per lane in position order (the running sums pass through memory unchanged), so it does
 * not depend on the rows beside it; NV is a compile-time count so the accumulators stay in registers. */
#define VALUE_SPAN(NV)                                                                                          \
    AVX2_FMA static void value_span_##NV(const float *w, long start, long end, const float *values,            \
                                         long row_stride, float *out, int first) {                             \
        __m256 acc[NV];                                                                                         \
        _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++)                                                    \
            acc[v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + 8 * v);                                \
        for (long p = start; p < end; p++) {                                                                    \
            if (w[p] == 0.0f) continue;                                                                         \
            __m256 wv = _mm256_set1_ps(w[p]);                                                                   \
            const float *value = values + (p - start) * row_stride;                                             \
            _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++)                                                \
                acc[v] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(value + 8 * v), acc[v]);                           \
        }                                                                                                       \
        _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) _mm256_storeu_ps(out + 8 * v, acc[v]);            \
    }
VALUE_SPAN(1)
VALUE_SPAN(2)
VALUE_SPAN(3)
VALUE_SPAN(4)
VALUE_SPAN(5)
VALUE_SPAN(6)
VALUE_SPAN(7)
VALUE_SPAN(8)
typedef void (*value_span_fn)(const float *, long, long, const float *, long, float *, int);
static const value_span_fn VALUE_SPANS[9] = {0, value_span_1, value_span_2, value_span_3, value_span_4,
                                             value_span_5, value_span_6, value_span_7, value_span_8};

/* out_r[0..d) = sum_p w_r[p] * V[p] for each row r of one kv head, cache block by cache block, 64 values of the
 * output rows at a time: each block's values are read for every row while they sit in L1 (a row at a time re-read
 * the whole context's values from L2 once per row: a 5-row verify over 430 positions, 2 kv heads on 2 threads,
 * took 54 us a layer that way, 35 us this way). weights: row r's at weights + r * ctx_len; outs[r]: its output. */
static void weighted_values(const float *weights, long rows, float *const *outs, long ctx_len, const float *v_cache,
                            const int32_t *table, long block_size, long kv_heads, long kvh, long head_dim) {
    long row_stride = kv_heads * head_dim;
    for (long chunk = 0; chunk < head_dim; chunk += 64) {
        long vecs = (head_dim - chunk < 64 ? head_dim - chunk : 64) / 8;
        for (long start = 0; start < ctx_len; start += block_size) {
            const float *values = v_cache + (long)table[start / block_size] * block_size * row_stride
                                  + kvh * head_dim + chunk;
            long end = start + block_size < ctx_len ? start + block_size : ctx_len;
            for (long r = 0; r < rows; r++)
                VALUE_SPANS[vecs](weights + r * ctx_len, start, end, values, row_stride, outs[r] + chunk, start == 0);
        }
    }
}

/* Does new token `row` (local index j of a block of q_len) see context position p? */
static inline int visible(long p, long prefix, long j, const uint8_t *tree_row) {
    if (p < prefix) return 1;
    long l = p - prefix;
    return tree_row ? tree_row[l] != 0 : l <= j;
}

/* One (sequence, kv head): its rows = (new token j, query head in group), scores into `scores`. */
AVX2_FMA static void attend_group(const float *q, long ldq_t, long ldq_h, const float *k_cache, const float *v_cache,
                                  const int32_t *table, long block_size, long kv_heads, long kvh, long group,
                                  long head_dim, long first_row, long q_len, long ctx_len, const uint8_t *tree_mask,
                                  long tree_width, float scale, float *out, float *scores) {
    long prefix = ctx_len - q_len, rows = q_len * group;
    /* scores[r * ctx_len + p], r = j * group + g; -inf where hidden. Walked block by block (no division), eight
     * positions at a time (a short group repeats its last key and drops the extra lanes). */
    for (long start = 0; start < ctx_len; start += block_size) {
        const float *keys = k_cache + ((long)table[start / block_size] * block_size * kv_heads + kvh) * head_dim;
        long end = start + block_size < ctx_len ? start + block_size : ctx_len;
        for (long p0 = start; p0 < end; p0 += 8) {
            long count = end - p0 < 8 ? end - p0 : 8;
            const float *key8[8];
            for (long i = 0; i < 8; i++) key8[i] = keys + (p0 + (i < count ? i : count - 1) - start) * kv_heads * head_dim;
            for (long j = 0; j < q_len; j++) {
                const uint8_t *tree_row = tree_mask ? tree_mask + (first_row + j) * tree_width : NULL;
                for (long g = 0; g < group; g++) {
                    const float *qr = q + (first_row + j) * ldq_t + (kvh * group + g) * ldq_h;
                    float dots[8], *row = scores + (j * group + g) * ctx_len;
                    _mm256_storeu_ps(dots, dot_8_keys(qr, key8, head_dim));
                    for (long i = 0; i < count; i++)
                        row[p0 + i] = visible(p0 + i, prefix, j, tree_row) ? scale * dots[i] : -INFINITY;
                }
            }
        }
    }
    float *outs[rows];
    for (long r = 0; r < rows; r++) {
        long j = r / group, g = r % group;
        softmax_row(scores + r * ctx_len, ctx_len);
        outs[r] = out + ((first_row + j) * kv_heads * group + kvh * group + g) * head_dim;
    }
    weighted_values(scores, rows, outs, ctx_len, v_cache, table, block_size, kv_heads, kvh, head_dim);
}

typedef struct {
    const float *q;
    long ldq_t, ldq_h;
    const float *k_cache, *v_cache;
    const int32_t *block_tables;
    long table_width;
    const int32_t *seq_lens, *cu_seqlens_q;
    long num_seqs;
    const uint8_t *tree_mask;
    long tree_width, kv_heads, group, head_dim, block_size, max_q_len;
    float scale;
    float *out;
    long most;          /* the largest unit's scores */
    atomic_int status;  /* -1 when a share could not allocate its scores (any share may store it) */
} attention_call;

/* Share `part` of `parts`: the (sequence, kv head) units numbered [parts' share), each whole, in the one-thread
 * order, with this share's own scores. */
AVX2_FMA static void attention_part(const void *arg, int part, int parts) {
    attention_call *a = (attention_call *)arg;
    long units = a->num_seqs * a->kv_heads, first = units * part / parts, last = units * (part + 1) / parts;
    float *scores = malloc(sizeof(float) * (a->most > 0 ? a->most : 1));
    if (!scores) {
        atomic_store_explicit(&a->status, -1, memory_order_relaxed);
        return;
    }
    for (long unit = first; unit < last; unit++) {
        long i = unit / a->kv_heads, kvh = unit % a->kv_heads;
        long row = a->cu_seqlens_q[i], q_len = a->cu_seqlens_q[i + 1] - row;
        if (q_len < 1 || q_len > a->max_q_len) continue;
        attend_group(a->q, a->ldq_t, a->ldq_h, a->k_cache, a->v_cache, a->block_tables + i * a->table_width,
                     a->block_size, a->kv_heads, kvh, a->group, a->head_dim, row, q_len, a->seq_lens[i], a->tree_mask,
                     a->tree_width, a->scale, a->out, scores);
    }
    free(scores);
}

/* Returns how many sequences it left to the caller (more than max_q_len new tokens), -1 when a share's scratch
 * could not be allocated (rows may be half written then), -2 when the metadata does not hold together (rows past
 * num_tokens, more new tokens than context, a context longer than its block table, a tree mask narrower than a
 * block): nothing is written then.
 * The (sequence, kv head) units are split over the threads parallel.c has (each unit whole: the same bits). */
AVX2_FMA int paged_attention_f32(const float *q, long ldq_t, long ldq_h, long num_tokens, const float *k_cache,
                                 const float *v_cache, const int32_t *block_tables, long table_width,
                                 const int32_t *seq_lens, const int32_t *cu_seqlens_q, long num_seqs,
                                 const uint8_t *tree_mask, long tree_width, long num_heads, long kv_heads,
                                 long head_dim, long block_size, long max_q_len, float scale, float *out) {
    long group = num_heads / kv_heads, most = 0, skipped = 0, work = 0;
    if (head_dim <= 0 || head_dim % 8) return -2;  /* the value sums run whole vectors of 8 */
    for (long i = 0; i < num_seqs; i++) {
        long q_len = cu_seqlens_q[i + 1] - cu_seqlens_q[i], ctx_len = seq_lens[i];
        if (q_len < 0 || cu_seqlens_q[i] < 0 || cu_seqlens_q[i + 1] > num_tokens || q_len > ctx_len
            || ctx_len > table_width * block_size || (tree_mask && q_len <= max_q_len && q_len > tree_width))
            return -2;
        if (q_len > max_q_len) skipped++;
        else if (q_len * group * ctx_len > most) most = q_len * group * ctx_len;
        if (q_len <= max_q_len) work += 2 * q_len * num_heads * ctx_len * head_dim;   /* scores and values */
    }
    attention_call call = {q, ldq_t, ldq_h, k_cache, v_cache, block_tables, table_width, seq_lens, cu_seqlens_q,
                           num_seqs, tree_mask, tree_width, kv_heads, group, head_dim, block_size, max_q_len, scale,
                           out, most, 0};
    native_parallel(attention_part, &call, native_shares(work, num_seqs * kv_heads));
    int status = atomic_load_explicit(&call.status, memory_order_relaxed);
    return status < 0 ? status : (int)skipped;
}

/* The new tokens' K and V rows into their cache slots (k/v [T, KVH, D] with row and head strides; slots int64 [T]):
 * what write_kv's two index_copy_ calls do, without their per-call dispatch. Returns -1, writing nothing, when a
 * slot is outside [0, num_slots). */
int paged_kv_write_f32(const float *k, long ldk_t, long ldk_h, const float *v, long ldv_t, long ldv_h,
                       const int64_t *slots, long num_tokens, long num_slots, long kv_heads, long head_dim,
                       float *k_cache, float *v_cache) {
    for (long t = 0; t < num_tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    for (long t = 0; t < num_tokens; t++) {
        float *k_dst = k_cache + slots[t] * kv_heads * head_dim, *v_dst = v_cache + slots[t] * kv_heads * head_dim;
        for (long h = 0; h < kv_heads; h++) {
            memcpy(k_dst + h * head_dim, k + t * ldk_t + h * ldk_h, sizeof(float) * head_dim);
            memcpy(v_dst + h * head_dim, v + t * ldv_t + h * ldv_h, sizeof(float) * head_dim);
        }
    }
    return 0;
}
