/* y[M, N] = x[M, K] @ W^T (+ bias) for the few rows of a decode step or a verify round, fp32, AVX2 + FMA.
 *
 * W is packed once at load into panels of 16 output columns: panel p holds W[16p .. 16p+15, 0..K-1] as
 * [K][16] (columns past N are zero). A panel of a 256-wide layer is 16 KB, so it stays in L1 while a group of
 * up to six rows of x streams over it: W is read from memory once per call whatever M is, where a general
 * GEMM re-packs it on every call (MKL's sgemm ran 5 rows at 2.5-4x the cost of 1 on a 2-core AVX2 EPYC).
 * Six rows x two vectors are 12 accumulators, one broadcast and the loads: the 16 AVX2 registers, with two
 * loads per six broadcasts, so the FMA units, not the loads, set the pace.
 *
 * Each output y[m, n] is one chain of FMAs over k = 0 .. K-1 from zero, then + bias[n]: the same
 * instructions in the same order whatever M is and whichever rows share the call, so a row's result does
 * not depend on the rows beside it in a call.
 *
 * Only the functions that use AVX2 are compiled for it (target attribute), so the library loads on any x86-64
 * CPU and kernels/native.py checks for AVX2/FMA (csrc/cpu.c) before anything here runs.
 */
#include <immintrin.h>
#include <string.h>

#define AVX2_FMA __attribute__((target("avx2,fma")))

#define PANEL 16
#define MAX_GROUP 6

/* Floats the packed copy of an [n, k] weight takes (the caller allocates it). */
long small_gemm_packed_floats(long n, long k) { return (n + PANEL - 1) / PANEL * k * PANEL; }

void small_gemm_pack(const float *w, long n, long k, float *packed) {
    memset(packed, 0, sizeof(float) * small_gemm_packed_floats(n, k));
    for (long col = 0; col < n; col++) {
        float *dst = packed + (col / PANEL) * k * PANEL + col % PANEL;
        const float *src = w + col * k;
        for (long i = 0; i < k; i++) dst[i * PANEL] = src[i];
    }
}

#define VECS (PANEL / 8)
/* unrolled before GCC decides where the accumulators live, so they stay in registers */
#define UNROLL _Pragma("GCC unroll 16")

/* The accumulators are only read out after the k loop, into a separate array: had the loop's array been handed
 * to a store function, its address would escape and GCC keeps every accumulator's stack copy current, storing
 * all of them on every step over k (a 256-bit store is two micro-ops on the one store port of a Zen-1 core, so
 * those stores, not the FMAs, set the pace). */
static inline void store_row(float *y, long n_valid, const float *tmp, const float *bias) {
    for (long c = 0; c < n_valid; c++) y[c] = bias ? tmp[c] + bias[c] : tmp[c];
}

/* ROWS rows of x against SPAN consecutive panels (columns past n_left are not stored); acc[r][s * VECS + v]
 * holds columns 8v .. 8v+7 of panel s for row r. A span gives few rows enough independent FMA chains to hide
 * the FMA latency (1 row x 4 panels = 8 chains) without changing any output's chain. Each step over k
 * prefetches the same line of the panels the next call reads, so memory streams while the FMAs run. */
#define PANEL_ROWS(ROWS, SPAN)                                                                                \
    AVX2_FMA static void rows_##ROWS##_span_##SPAN(const float *x, long ldx, const float *panels, long k,      \
                                                   float *y, long ldy, long n_left, const float *bias) {       \
        __m256 acc[ROWS][SPAN * VECS];                                                                        \
        UNROLL for (int r = 0; r < ROWS; r++)                                                                        \
            UNROLL for (int v = 0; v < SPAN * VECS; v++) acc[r][v] = _mm256_setzero_ps();                            \
        for (long i = 0; i < k; i++) {                                                                        \
            UNROLL for (int s = 0; s < SPAN; s++)                                                                    \
                _mm_prefetch((const char *)(panels + (SPAN + s) * k * PANEL + i * PANEL), _MM_HINT_T0);        \
            UNROLL for (int r = 0; r < ROWS; r++) {                                                                  \
                __m256 xv = _mm256_broadcast_ss(x + r * ldx + i);                                             \
                UNROLL for (int s = 0; s < SPAN; s++) {                                                              \
                    const float *w = panels + s * k * PANEL + i * PANEL;                                      \
                    UNROLL for (int v = 0; v < VECS; v++)                                                            \
                        acc[r][s * VECS + v] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 8 * v), acc[r][s * VECS + v]); \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        float out[ROWS][SPAN * PANEL];                                                                        \
        UNROLL for (int r = 0; r < ROWS; r++)                                                                        \
            UNROLL for (int v = 0; v < SPAN * VECS; v++) _mm256_storeu_ps(out[r] + 8 * v, acc[r][v]);                \
        UNROLL for (int r = 0; r < ROWS; r++)                                                                        \
            UNROLL for (int s = 0; s < SPAN; s++) {                                                                  \
                long n_valid = n_left - s * PANEL < PANEL ? n_left - s * PANEL : PANEL;                       \
                store_row(y + r * ldy + s * PANEL, n_valid, out[r] + s * PANEL, bias ? bias + s * PANEL : 0); \
            }                                                                                                 \
    }

PANEL_ROWS(1, 1)
PANEL_ROWS(1, 4)
PANEL_ROWS(2, 1)
PANEL_ROWS(2, 2)
PANEL_ROWS(3, 1)
PANEL_ROWS(3, 2)
PANEL_ROWS(4, 1)
PANEL_ROWS(5, 1)
PANEL_ROWS(6, 1)

typedef void (*panel_fn)(const float *, long, const float *, long, float *, long, long, const float *);
/* by rows: the widest span (and its function) that keeps the accumulators in the 16 registers, and span 1 */
static const int SPAN_OF[MAX_GROUP + 1] = {0, 4, 2, 2, 1, 1, 1};
static const panel_fn WIDE[MAX_GROUP + 1] = {0, rows_1_span_4, rows_2_span_2, rows_3_span_2, rows_4_span_1,
                                             rows_5_span_1, rows_6_span_1};
static const panel_fn NARROW[MAX_GROUP + 1] = {0, rows_1_span_1, rows_2_span_1, rows_3_span_1, rows_4_span_1,
                                               rows_5_span_1, rows_6_span_1};

AVX2_FMA void small_gemm(const float *x, long m, long k, long ldx, const float *packed, long n, const float *bias,
                         float *y, long ldy) {
    long panels = (n + PANEL - 1) / PANEL;
    if (m <= 0 || n <= 0) return;
    if (m <= MAX_GROUP) {  /* one group: spans of panels, then single panels for the remainder */
        long p = 0, span = SPAN_OF[m];
        for (; p + span <= panels; p += span)
            WIDE[m](x, ldx, packed + p * k * PANEL, k, y + p * PANEL, ldy, n - p * PANEL, bias ? bias + p * PANEL : 0);
        for (; p < panels; p++)
            NARROW[m](x, ldx, packed + p * k * PANEL, k, y + p * PANEL, ldy, n - p * PANEL, bias ? bias + p * PANEL : 0);
        return;
    }
    /* several groups (as even as possible: 8 = 4 + 4) share each panel while it is in cache */
    long groups = (m + MAX_GROUP - 1) / MAX_GROUP;
    for (long p = 0; p < panels; p++) {
        const float *panel = packed + p * k * PANEL, *b = bias ? bias + p * PANEL : 0;
        for (long r = 0, g = 0; g < groups; g++) {
            long size = (m - r) / (groups - g);
            NARROW[size](x + r * ldx, ldx, panel, k, y + r * ldy + p * PANEL, ldy, n - p * PANEL, b);
            r += size;
        }
    }
}
