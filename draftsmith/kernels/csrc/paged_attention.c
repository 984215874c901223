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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define AVX2_FMA __attribute__((target("avx2,fma")))

AVX2_FMA static inline float dot8(const float *a, const float *b, long d) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    long i = 0;
    for (; i + 16 <= d; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i < d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    __m256 s = _mm256_add_ps(acc0, acc1);
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

AVX2_FMA static inline void axpy8(float *y, float a, const float *x, long d) {
    __m256 av = _mm256_set1_ps(a);
    for (long i = 0; i < d; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
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
    /* scores[r * ctx_len + p], r = j * group + g; -inf where hidden. Walked block by block (no division). */
    for (long start = 0; start < ctx_len; start += block_size) {
        const float *keys = k_cache + ((long)table[start / block_size] * block_size * kv_heads + kvh) * head_dim;
        long end = start + block_size < ctx_len ? start + block_size : ctx_len;
        for (long p = start; p < end; p++) {
            const float *key = keys + (p - start) * kv_heads * head_dim;
            for (long j = 0; j < q_len; j++) {
                const uint8_t *tree_row = tree_mask ? tree_mask + (first_row + j) * tree_width : NULL;
                int seen = visible(p, prefix, j, tree_row);
                for (long g = 0; g < group; g++) {
                    const float *qr = q + (first_row + j) * ldq_t + (kvh * group + g) * ldq_h;
                    scores[(j * group + g) * ctx_len + p] = seen ? scale * dot8(qr, key, head_dim) : -INFINITY;
                }
            }
        }
    }
    for (long r = 0; r < rows; r++) {
        float *s = scores + r * ctx_len, top = -INFINITY, total = 0.0f;
        for (long p = 0; p < ctx_len; p++) top = s[p] > top ? s[p] : top;
        for (long p = 0; p < ctx_len; p++) {
            s[p] = s[p] == -INFINITY ? 0.0f : expf(s[p] - top);
            total += s[p];
        }
        float inv = total > 0.0f ? 1.0f / total : 0.0f;  /* a tree row that sees nothing attends to nothing */
        for (long p = 0; p < ctx_len; p++) s[p] *= inv;
    }
    float *outs[rows];  /* the output row of (new token j, query head g of the group) */
    for (long r = 0; r < rows; r++) {
        long j = r / group, g = r % group;
        outs[r] = out + ((first_row + j) * kv_heads * group + kvh * group + g) * head_dim;
        for (long i = 0; i < head_dim; i++) outs[r][i] = 0.0f;
    }
    for (long start = 0; start < ctx_len; start += block_size) {
        const float *values = v_cache + ((long)table[start / block_size] * block_size * kv_heads + kvh) * head_dim;
        long end = start + block_size < ctx_len ? start + block_size : ctx_len;
        for (long p = start; p < end; p++) {
            const float *value = values + (p - start) * kv_heads * head_dim;
            for (long r = 0; r < rows; r++) {
                float w = scores[r * ctx_len + p];
                if (w == 0.0f) continue;
                axpy8(outs[r], w, value, head_dim);
            }
        }
    }
}

/* Returns how many sequences it left to the caller (more than max_q_len new tokens), -1 when the scratch could
 * not be allocated, -2 when the metadata does not hold together (rows past num_tokens, more new tokens than
 * context, a context longer than its block table, a tree mask narrower than a block): nothing is written then. */
AVX2_FMA int paged_attention_f32(const float *q, long ldq_t, long ldq_h, long num_tokens, const float *k_cache,
                                 const float *v_cache, const int32_t *block_tables, long table_width,
                                 const int32_t *seq_lens, const int32_t *cu_seqlens_q, long num_seqs,
                                 const uint8_t *tree_mask, long tree_width, long num_heads, long kv_heads,
                                 long head_dim, long block_size, long max_q_len, float scale, float *out) {
    long group = num_heads / kv_heads, most = 0, skipped = 0;
    for (long i = 0; i < num_seqs; i++) {
        long q_len = cu_seqlens_q[i + 1] - cu_seqlens_q[i], ctx_len = seq_lens[i];
        if (q_len < 0 || cu_seqlens_q[i] < 0 || cu_seqlens_q[i + 1] > num_tokens || q_len > ctx_len
            || ctx_len > table_width * block_size || (tree_mask && q_len <= max_q_len && q_len > tree_width))
            return -2;
        if (q_len > max_q_len) skipped++;
        else if (q_len * group * ctx_len > most) most = q_len * group * ctx_len;
    }
    float *scores = malloc(sizeof(float) * (most > 0 ? most : 1));
    if (!scores) return -1;
    for (long i = 0; i < num_seqs; i++) {
        long first = cu_seqlens_q[i], q_len = cu_seqlens_q[i + 1] - first;
        if (q_len < 1 || q_len > max_q_len) continue;
        for (long kvh = 0; kvh < kv_heads; kvh++)
            attend_group(q, ldq_t, ldq_h, k_cache, v_cache, block_tables + i * table_width, block_size, kv_heads,
                         kvh, group, head_dim, first, q_len, seq_lens[i], tree_mask, tree_width, scale, out, scores);
    }
    free(scores);
    return (int)skipped;
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
