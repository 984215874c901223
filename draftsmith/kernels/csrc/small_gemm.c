/* y[M, N] = x[M, K] @ W^T (+ bias) for the few rows of a decode step or a verify round, fp32, AVX2 + FMA.
 *
 * W is packed once at load into panels of 32 output columns: panel p holds W[32p .. 32p+31, 0..K-1] as
 * [K][32] (columns past N are zero). A panel of a 256-wide layer is 32 KB, so it stays in L1/L2 while every
 * group of up to three rows of x streams over it: W is read from memory once per call whatever M is, where
 * a general GEMM re-packs it on every call (MKL's sgemm ran 5 rows at 2.5-4x the cost of 1 on a 2-core
 * AVX2 EPYC). Three rows x four vectors are 12 independent FMA chains, enough to hide the FMA latency;
 * one row still has four.
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

#define PANEL 32

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

AVX2_FMA static inline void store_row(float *y, long n_valid, const __m256 *acc, const float *bias) {
    float tmp[PANEL];
    for (int v = 0; v < VECS; v++) _mm256_storeu_ps(tmp + 8 * v, acc[v]);
    for (long c = 0; c < n_valid; c++) y[c] = bias ? tmp[c] + bias[c] : tmp[c];
}

/* ROWS rows of x against one panel; acc[r][v] holds columns 8v .. 8v+7 of row r. */
#define PANEL_ROWS(ROWS)                                                                     \
    AVX2_FMA static void panel_rows_##ROWS(const float *x, long ldx, const float *panel, long k,        \
                                  float *y, long ldy, long n_valid, const float *bias) {       \
        __m256 acc[ROWS][VECS];                                                                \
        for (int r = 0; r < ROWS; r++)                                                         \
            for (int v = 0; v < VECS; v++) acc[r][v] = _mm256_setzero_ps();                    \
        for (long i = 0; i < k; i++) {                                                         \
            const float *w = panel + i * PANEL;                                                \
            for (int r = 0; r < ROWS; r++) {                                                   \
                __m256 xv = _mm256_broadcast_ss(x + r * ldx + i);                              \
                for (int v = 0; v < VECS; v++)                                                 \
                    acc[r][v] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 8 * v), acc[r][v]);    \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < ROWS; r++) store_row(y + r * ldy, n_valid, acc[r], bias);          \
    }

PANEL_ROWS(1)
PANEL_ROWS(2)
PANEL_ROWS(3)

AVX2_FMA void small_gemm(const float *x, long m, long k, long ldx, const float *packed, long n, const float *bias,
                float *y, long ldy) {
    long panels = (n + PANEL - 1) / PANEL;
    for (long p = 0; p < panels; p++) {
        const float *panel = packed + p * k * PANEL;
        long col = p * PANEL;
        long n_valid = n - col < PANEL ? n - col : PANEL;
        const float *b = bias ? bias + col : 0;
        long r = 0;
        /* groups of three rows; a remainder of one borrows a row of the last three (4 = 2 + 2) */
        for (; m - r >= 3 && m - r != 4; r += 3)
            panel_rows_3(x + r * ldx, ldx, panel, k, y + r * ldy + col, ldy, n_valid, b);
        for (; m - r >= 2; r += 2)
            panel_rows_2(x + r * ldx, ldx, panel, k, y + r * ldy + col, ldy, n_valid, b);
        if (m - r == 1) panel_rows_1(x + r * ldx, ldx, panel, k, y + r * ldy + col, ldy, n_valid, b);
    }
}
