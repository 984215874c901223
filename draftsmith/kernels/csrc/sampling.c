/* Sampling of fp32 logits rows (at a plain temperature, or through top-k / top-p: see below), and the exact
 * verification of speculative chains at a plain temperature: the rules of kernels/sampling.py (sample: the first v whose float64
 * CDF exceeds u times the row's sum, never a zero-probability entry) and of
 * serve_eval/speculative/verify_fast.py (sampled_chain_accept: accept draft i while u_i * q(x_i) < p(x_i), then
 * one draw from the stop row: the residual max(0, p - q) renormalised after a rejection, the target row after
 * a full accept), with each row's softmax(logits * inv_temperature) computed here.
 *
 * Why: at batch 1 these are a few microseconds of arithmetic inside ~0.3 ms (a sampled decode step) and ~0.8 ms
 * (a K=4 chain's verification) of tensor-op dispatch: checks, softmax, float64 cumsum, gathers, searchsorted.
 * The uniforms come from the caller (each request's generator, drawn in the order the torch path draws them,
 * so requests sharing a generator get the same values either way).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec_exp.h"

/* The first of equal maxima, as torch.argmax. */
long row_argmax_f32(const float *row, long n) {
    long best = 0;
    for (long v = 1; v < n; v++)
        if (row[v] > row[best]) best = v;
    return best;
}

/* probs = softmax(row * inv_temperature) (fp32, as written: the rows returned are the rows drawn from), 8 lanes
 * at a time with the Cephes exp the attention kernel uses (~1 ulp; lanes 87 below the max give 0). */
AVX2_FMA static void row_softmax(const float *row, long n, float inv_temperature, float *probs) {
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    long v = 0;
    for (; v + 8 <= n; v += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(row + v));
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, top8);
    for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    for (long i = v; i < n; i++) top = row[i] > top ? row[i] : top;
    top *= inv_temperature;   /* the max of row * t for t > 0 (rounding is monotone) */
    __m256 t8 = _mm256_set1_ps(inv_temperature), top_v = _mm256_set1_ps(top), sum8 = _mm256_setzero_ps();
    for (v = 0; v + 8 <= n; v += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(row + v), t8), top_v));
        _mm256_storeu_ps(probs + v, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float total = 0.0f;
    _mm256_storeu_ps(lanes, sum8);
    for (int i = 0; i < 8; i++) total += lanes[i];
    for (; v < n; v++) {
        probs[v] = expf(row[v] * inv_temperature - top);
        total += probs[v];
    }
    __m256 scale = _mm256_set1_ps(1.0f / total);
    for (v = 0; v + 8 <= n; v += 8) _mm256_storeu_ps(probs + v, _mm256_mul_ps(_mm256_loadu_ps(probs + v), scale));
    for (; v < n; v++) probs[v] *= 1.0f / total;
}

/* The first v with cdf_v > u * sum (float64 sums of the weights: the fp32 probs, or with probs NULL the float64
 * weights), or the last positive entry before where rounding would land on a zero. Weights >= 0, some positive. */
static long invert_cdf(const float *probs, const double *weights, long n, double u) {
    double sum = 0.0, cdf = 0.0;
    for (long v = 0; v < n; v++) sum += probs ? (double)probs[v] : weights[v];
    double threshold = u * sum;
    long last_positive = 0;
    for (long v = 0; v < n; v++) {
        double w = probs ? (double)probs[v] : weights[v];
        if (w > 0.0) {
            last_positive = v;
            cdf += w;
            if (cdf > threshold) return v;
        }
    }
    return last_positive;
}

/* probs = softmax(row * inv_temperature), then the draw at u from exactly that row. */
long row_sample_f32(const float *row, long n, float inv_temperature, double u, float *probs) {
    row_softmax(row, n, inv_temperature, probs);
    return invert_cdf(probs, 0, n, u);
}

/* ---- top-k / top-p rows: kernels/sampling.py's filters (sample_logits' law) ---------------------------------
 * On scaled = logits / T (fp32 division, as torch divides): top-k keeps the k first entries in rank order
 * (value descending, ties to the lower id); top-p then keeps, in that order, each candidate whose mass before it
 * (softmax over the candidates; float64 running sum read back in fp32, as torch's CPU cumsum) is below top_p,
 * the first always. The kept entries' softmax, in id order, is inverted at u as invert_cdf does. */

typedef struct { float value; int64_t id; } ranked_t;

static inline int ranks_before(ranked_t a, ranked_t b) { return a.value > b.value || (a.value == b.value && a.id < b.id); }

/* heap[0] is the last-ranked entry held: a min-heap by rank */
static void sift_down(ranked_t *heap, long size, long at) {
    for (;;) {
        long left = 2 * at + 1, right = left + 1, last = at;
        if (left < size && ranks_before(heap[last], heap[left])) last = left;
        if (right < size && ranks_before(heap[last], heap[right])) last = right;
        if (last == at) return;
        ranked_t t = heap[at]; heap[at] = heap[last]; heap[last] = t;
        at = last;
    }
}

/* The first `width` entries of scaled[0, n) in rank order, written sorted to out[0, width). Scanning ids upward,
 * an entry equal to the heap's last-ranked value never ranks before it, so only a larger value enters. */
static void select_ranked(const float *scaled, long n, long width, ranked_t *out) {
    for (long v = 0; v < width; v++) out[v] = (ranked_t){scaled[v], v};
    for (long i = width / 2 - 1; i >= 0; i--) sift_down(out, width, i);
    for (long v = width; v < n; v++) {
        if (!(scaled[v] > out[0].value)) continue;
        out[0] = (ranked_t){scaled[v], v};
        sift_down(out, width, 0);
    }
    for (long end = width - 1; end > 0; end--) {  /* heap sort: the last-ranked moves to the back */
        ranked_t t = out[0]; out[0] = out[end]; out[end] = t;
        sift_down(out, end, 0);
    }
}

/* How many of the ranked candidates (ranked[0, held), a prefix of the row's rank order, `total` the softmax
 * normaliser over all of them, top the first's value) stay in the nucleus; -1 if the cut lies past `held`. */
static long nucleus_size(const ranked_t *ranked, long held, long num_candidates, float top, float total,
                         float top_p) {
    double running = 0.0;
    for (long i = 0; i < held; i++) {
        float p = expf(ranked[i].value - top) / total;
        running += p;
        if (i > 0 && (float)running - p >= top_p) return i;
    }
    return held == num_candidates ? held : -1;
}

static int by_rank(const void *a, const void *b) {
    return ranks_before(*(const ranked_t *)a, *(const ranked_t *)b) ? -1 : 1;
}

/* The window that holds the nucleus of a top-p-only row: most rows need a few dozen entries, not a sort of V. */
#define NUCLEUS_WINDOW 64

/* Draws one filtered row: scaled [n] and probs [n] are scratch, ranked [n] too. */
static long row_sample_filtered(const float *row, long n, float temperature, long top_k, float top_p, double u,
                                float *scaled, float *probs, ranked_t *ranked) {
    for (long v = 0; v < n; v++) scaled[v] = row[v] / temperature;
    int use_top_k = top_k > 0 && top_k < n;
    long held = use_top_k ? top_k : (top_p < 1.0f ? (n < NUCLEUS_WINDOW ? n : NUCLEUS_WINDOW) : n);
    long kept = held;
    if (held < n || top_p < 1.0f) select_ranked(scaled, n, held, ranked);
    if (top_p < 1.0f) {
        long num_candidates = use_top_k ? top_k : n;
        float top = ranked[0].value, total = 0.0f;
        if (use_top_k) for (long i = 0; i < held; i++) total += expf(ranked[i].value - top);
        else for (long v = 0; v < n; v++) total += expf(scaled[v] - top);
        kept = nucleus_size(ranked, held, num_candidates, top, total, top_p);
        while (kept < 0) {  /* a flatter row: a window 8x wider, or all of it ranked */
            held = held * 8 < n ? held * 8 : n;
            if (held < n) {
                select_ranked(scaled, n, held, ranked);
            } else {
                for (long v = 0; v < n; v++) ranked[v] = (ranked_t){scaled[v], v};
                qsort(ranked, n, sizeof(ranked_t), by_rank);
            }
            kept = nucleus_size(ranked, held, num_candidates, top, total, top_p);
        }
    }
    if (kept == n) {
        row_softmax(scaled, n, 1.0f, probs);
        return invert_cdf(probs, 0, n, u);
    }
    /* everything outside the kept set gets -inf, then that row's softmax at T = 1 (into scaled, now free) */
    for (long v = 0; v < n; v++) probs[v] = -INFINITY;
    for (long i = 0; i < kept; i++) probs[ranked[i].id] = ranked[i].value;
    row_softmax(probs, n, 1.0f, scaled);
    return invert_cdf(scaled, 0, n, u);
}

/* One token per row of logits [rows, vocab]: a row with top_k in (0, vocab) or top_p < 1 through the filters at
 * temperatures[r], any other through row_sample_f32 at inv_temperatures[r].
 * work [2 * vocab] floats and ranked [vocab] (16 bytes each): scratch. */
void sample_filtered_rows_f32(const float *logits, long rows, long vocab, const float *temperatures,
                              const float *inv_temperatures, const int64_t *top_k, const float *top_p,
                              const double *uniforms, float *work, void *ranked, int64_t *out_tokens) {
    for (long r = 0; r < rows; r++) {
        const float *row = logits + r * vocab;
        if ((top_k[r] > 0 && top_k[r] < vocab) || top_p[r] < 1.0f)
            out_tokens[r] = row_sample_filtered(row, vocab, temperatures[r], top_k[r], top_p[r], uniforms[r], work,
                                                work + vocab, (ranked_t *)ranked);
        else
            out_tokens[r] = row_sample_f32(row, vocab, inv_temperatures[r], uniforms[r], work);
    }
}

static int is_point_mass(const float *draft_probs, const uint8_t *point_mass, long node) {
    return !draft_probs || (point_mass && point_mass[node]);
}

/* Chain b's root row is logits[root_rows[b]], its nodes' rows follow; tokens [B, width], num_nodes[b] <= width;
 * draft_probs [B, width, vocab] (NULL: every draft a point mass) with point_mass [B, width] (NULL: none);
 * uniforms [B, width + 1]: chain b's num_nodes[b] accept tests, then its final draw. Writes out_tokens
 * [B, width + 1] (the accepted drafts, the final token, then -1) and out_num_accepted [B]. work [vocab] and
 * residual [vocab]: scratch. Returns 0, or -2 for a token outside the vocabulary. */
int verify_chains_f32(const float *logits, long vocab, long batch, long width, const int64_t *root_rows,
                      const int64_t *tokens, const int64_t *num_nodes, const float *draft_probs,
                      const uint8_t *point_mass, const float *inv_temperatures, const double *uniforms, float *work,
                      double *residual, int64_t *out_tokens, int64_t *out_num_accepted) {
    for (long b = 0; b < batch; b++) {
        const int64_t *chain = tokens + b * width;
        const double *u = uniforms + b * (width + 1);
        float inv_t = inv_temperatures[b];
        long n = num_nodes[b], accepted = 0;
        for (long i = 0; i < n; i++)
            if (chain[i] < 0 || chain[i] >= vocab) return -2;
        for (; accepted < n; accepted++) {  /* p(x_i) from row i, q(x_i) from the draft's row i */
            long x = chain[accepted];
            row_softmax(logits + (root_rows[b] + accepted) * vocab, vocab, inv_t, work);
            double q_x = is_point_mass(draft_probs, point_mass, b * width + accepted)
                             ? 1.0 : (double)draft_probs[(b * width + accepted) * vocab + x];
            if (!(u[accepted] * q_x < (double)work[x])) break;
        }
        if (accepted == n) row_softmax(logits + (root_rows[b] + n) * vocab, vocab, inv_t, work);
        /* work holds the stop row's p (a rejection left it computed in the loop) */
        for (long v = 0; v < vocab; v++) residual[v] = work[v];
        if (accepted < n) {  /* the rejected draft's row q: its point mass, or its dense row */
            long x = chain[accepted];
            const float *q = is_point_mass(draft_probs, point_mass, b * width + accepted)
                                 ? 0 : draft_probs + (b * width + accepted) * vocab;
            int point = q == 0;
            double mass = 0.0;
            for (long v = 0; v < vocab; v++) {
                double r = residual[v] - (point ? (v == x ? 1.0 : 0.0) : (double)q[v]);
                residual[v] = r > 0.0 ? r : 0.0;
                mass += residual[v];
            }
            /* all zero only where p == q, where rejecting has probability 0: keep p then */
            if (!(mass > 0.0))
                for (long v = 0; v < vocab; v++) residual[v] = work[v];
        }
        int64_t *out = out_tokens + b * (width + 1);
        for (long i = 0; i <= width; i++) out[i] = i < accepted ? chain[i] : -1;
        out[accepted] = invert_cdf(0, residual, vocab, u[n]);
        out_num_accepted[b] = accepted;
    }
    return 0;
}
