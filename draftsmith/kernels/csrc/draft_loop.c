/* A draft's decode steps in one C call (draft_decode_f32): the embedding or EAGLE input of each step's rows, the
 * layers of decoder_layer.c, the final norm, the head and the pick, for every sequence of a round. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layer_ops.h"

/* What the draft loop needs of a model besides its stack (decoder_layer.c's argument lists grew past what a reader
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
