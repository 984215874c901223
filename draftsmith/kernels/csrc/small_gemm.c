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
 * The same kernels read panels of fp16 (small_gemm_f16, a draft's weights): each load widens 8 weights exactly
 * to fp32 (F16C), so the arithmetic is the fp32 kernel's on the rounded weights, and a step reads half the bytes.
 *
 * Only the functions that use AVX2 are compiled for it (target attribute), so the library loads on any x86-64
 * CPU and kernels/native.py checks for AVX2/FMA (csrc/cpu.c) before anything here runs.
 */
#include <immintrin.h>
#include <stdint.h>
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
 * holds columns 8v .. 8v+7 of panel s for row r. A span gives 2-3 rows enough independent FMA chains to hide
 * the FMA latency without changing any output's chain. One row is memory-bound and reads one panel at a time: one
 * sequential stream ran the embedded target's 1-row matmuls ~11% faster than four interleaved panels (2.38-2.54
 * against 2.69-2.83 ms, an AMX Xeon) though its two chains leave the FMA units idle half the time. Each step over k
 * prefetches the same line of the panels the next call reads, so memory streams while the FMAs run. */
#define PANEL_ROWS_OF(ROWS, SPAN, SUFFIX, WTYPE, LOAD, TARGET)                                                 \
    TARGET static void rows_##ROWS##_span_##SPAN##SUFFIX(const float *x, long ldx, const WTYPE *panels, long k, \
                                                         float *y, long ldy, long n_left, const float *bias) { \
        __m256 acc[ROWS][SPAN * VECS];                                                                        \
        UNROLL for (int r = 0; r < ROWS; r++)                                                                        \
            UNROLL for (int v = 0; v < SPAN * VECS; v++) acc[r][v] = _mm256_setzero_ps();                            \
        for (long i = 0; i < k; i++) {                                                                        \
            UNROLL for (int s = 0; s < SPAN; s++)                                                                    \
                _mm_prefetch((const char *)(panels + (SPAN + s) * k * PANEL + i * PANEL), _MM_HINT_T0);        \
            UNROLL for (int r = 0; r < ROWS; r++) {                                                                  \
                __m256 xv = _mm256_broadcast_ss(x + r * ldx + i);                                             \
                UNROLL for (int s = 0; s < SPAN; s++) {                                                              \
                    const WTYPE *w = panels + s * k * PANEL + i * PANEL;                                      \
                    UNROLL for (int v = 0; v < VECS; v++)                                                            \
                        acc[r][s * VECS + v] = _mm256_fmadd_ps(xv, LOAD(w + 8 * v), acc[r][s * VECS + v]); \
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

/* fp32 panels; fp16 panels (a draft's weights: half the bytes a step reads, widened exactly to fp32 on load,
 * so the arithmetic is the fp32 kernel's) */
#define LOAD_F32(w) _mm256_loadu_ps(w)
#define LOAD_F16(w) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w)))
#define AVX2_FMA_F16C __attribute__((target("avx2,fma,f16c")))
#define PANEL_ROWS(ROWS, SPAN)                                                                                \
    PANEL_ROWS_OF(ROWS, SPAN, , float, LOAD_F32, AVX2_FMA)                                                    \
    PANEL_ROWS_OF(ROWS, SPAN, _f16, uint16_t, LOAD_F16, AVX2_FMA_F16C)

PANEL_ROWS(1, 1)
PANEL_ROWS_OF(1, 4, _f16, uint16_t, LOAD_F16, AVX2_FMA_F16C)   /* fp16 panels' one row (see ROW_TABLES) */
PANEL_ROWS(2, 1)
PANEL_ROWS(2, 2)
PANEL_ROWS(3, 1)
PANEL_ROWS(3, 2)
PANEL_ROWS(4, 1)
PANEL_ROWS(5, 1)
PANEL_ROWS(6, 1)

/* by rows: the span (and its function) that runs fastest within the 16 registers, and span 1. One row of fp32
 * panels: 1 (see above); of fp16 panels: 4, as each weight's widening lengthens the chain (the draft's 1-row steps
 * ran 1.22 ms a round at span 4 against 1.39 at span 1). */
#define ROW_TABLES(SUFFIX, WTYPE, ONE_ROW_SPAN)                                                                \
    typedef void (*panel_fn##SUFFIX)(const float *, long, const WTYPE *, long, float *, long, long, const float *); \
    static const int SPAN_OF##SUFFIX[MAX_GROUP + 1] = {0, ONE_ROW_SPAN, 2, 2, 1, 1, 1};                        \
    static const panel_fn##SUFFIX WIDE##SUFFIX[MAX_GROUP + 1] = {                                              \
        0, rows_1_span_##ONE_ROW_SPAN##SUFFIX, rows_2_span_2##SUFFIX, rows_3_span_2##SUFFIX, rows_4_span_1##SUFFIX,        \
        rows_5_span_1##SUFFIX, rows_6_span_1##SUFFIX};                                                        \
    static const panel_fn##SUFFIX NARROW##SUFFIX[MAX_GROUP + 1] = {                                            \
        0, rows_1_span_1##SUFFIX, rows_2_span_1##SUFFIX, rows_3_span_1##SUFFIX, rows_4_span_1##SUFFIX,        \
        rows_5_span_1##SUFFIX, rows_6_span_1##SUFFIX};
ROW_TABLES(, float, 1)
ROW_TABLES(_f16, uint16_t, 4)

/* y[M, N] = x @ W^T (+ bias) over packed panels of WTYPE: one group of rows runs spans of panels, then single
 * panels for the remainder; several groups (as even as possible: 8 = 4 + 4) share each panel while it is in
 * cache. */
#define SMALL_GEMM(NAME, SUFFIX, WTYPE)                                                                        \
    static void NAME(const float *x, long m, long k, long ldx, const WTYPE *packed, long n,             \
                            const float *bias, float *y, long ldy) {                                           \
        long panels = (n + PANEL - 1) / PANEL;                                                                \
        if (m <= MAX_GROUP) {                                                                                 \
            long p = 0, span = SPAN_OF##SUFFIX[m];                                                            \
            for (; p + span <= panels; p += span)                                                             \
                WIDE##SUFFIX[m](x, ldx, packed + p * k * PANEL, k, y + p * PANEL, ldy, n - p * PANEL,          \
                                bias ? bias + p * PANEL : 0);                                                 \
            for (; p < panels; p++)                                                                           \
                NARROW##SUFFIX[m](x, ldx, packed + p * k * PANEL, k, y + p * PANEL, ldy, n - p * PANEL,        \
                                  bias ? bias + p * PANEL : 0);                                               \
            return;                                                                                           \
        }                                                                                                     \
        long groups = (m + MAX_GROUP - 1) / MAX_GROUP;                                                        \
        for (long p = 0; p < panels; p++) {                                                                   \
            const WTYPE *panel = packed + p * k * PANEL;                                                      \
            const float *b = bias ? bias + p * PANEL : 0;                                                     \
            for (long r = 0, g = 0; g < groups; g++) {                                                        \
                long size = (m - r) / (groups - g);                                                           \
                NARROW##SUFFIX[size](x + r * ldx, ldx, panel, k, y + r * ldy + p * PANEL, ldy, n - p * PANEL, b); \
                r += size;                                                                                    \
            }                                                                                                 \
        }                                                                                                     \
    }
SMALL_GEMM(small_gemm_avx2, , float)
SMALL_GEMM(small_gemm_avx2_f16, _f16, uint16_t)

/* The same panels on AVX-512 for more than 6 rows: a 16-column panel is one 512-bit register and the 32 registers
 * hold up to 12 rows x 2 panels of accumulators, so 7-17 rows (a tree's verify, a batch of 8-16 decode rows) take half the instructions
 * of the AVX2 kernel (which is FMA-bound there: a 17-row verify of the embedded target cost ~2x a 5-row one).
 * Every output is still one FMA chain over k from zero, then + bias[n]: bit for bit the AVX2 kernel's result. */
#define AVX512 __attribute__((target("avx512f")))
#define MAX_GROUP_512 12
#define PANEL_ROWS_512_OF(ROWS, SPAN, SUFFIX, WTYPE, LOAD)                                                        \
    AVX512 static void rows512_##ROWS##_span_##SPAN##SUFFIX(const float *x, long ldx, const WTYPE *panels, long k,  \
                                                          float *y, long ldy, long n_left, const float *bias) {  \
        __m512 acc[ROWS][SPAN];                                                                                 \
        UNROLL for (int r = 0; r < ROWS; r++)                                                                   \
            UNROLL for (int s = 0; s < SPAN; s++) acc[r][s] = _mm512_setzero_ps();                               \
        for (long i = 0; i < k; i++) {                                                                          \
            __m512 w[SPAN];                                                                                     \
            UNROLL for (int s = 0; s < SPAN; s++) {                                                             \
                _mm_prefetch((const char *)(panels + (SPAN + s) * k * PANEL + i * PANEL), _MM_HINT_T0);          \
                w[s] = LOAD(panels + s * k * PANEL + i * PANEL);                                                \
            }                                                                                                   \
            UNROLL for (int r = 0; r < ROWS; r++) {                                                             \
                __m512 xv = _mm512_set1_ps(x[r * ldx + i]);                                                     \
                UNROLL for (int s = 0; s < SPAN; s++) acc[r][s] = _mm512_fmadd_ps(xv, w[s], acc[r][s]);         \
            }                                                                                                   \
        }                                                                                                       \
        float out[ROWS][SPAN * PANEL];                                                                          \
        UNROLL for (int r = 0; r < ROWS; r++)                                                                   \
            UNROLL for (int s = 0; s < SPAN; s++) _mm512_storeu_ps(out[r] + s * PANEL, acc[r][s]);             \
        UNROLL for (int r = 0; r < ROWS; r++)                                                                   \
            UNROLL for (int s = 0; s < SPAN; s++) {                                                             \
                long n_valid = n_left - s * PANEL < PANEL ? n_left - s * PANEL : PANEL;                         \
                store_row(y + r * ldy + s * PANEL, n_valid, out[r] + s * PANEL, bias ? bias + s * PANEL : 0);   \
            }                                                                                                   \
    }
#define LOAD512_F32(w) _mm512_loadu_ps(w)
#define LOAD512_F16(w) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w)))
#define PANEL_ROWS_512(ROWS, SPAN)                                                                              \
    PANEL_ROWS_512_OF(ROWS, SPAN, , float, LOAD512_F32)                                                         \
    PANEL_ROWS_512_OF(ROWS, SPAN, _f16, uint16_t, LOAD512_F16)
/* groups of 6 to 12 rows (the AVX-512 form serves 7 rows and more, split as evenly as possible) */
PANEL_ROWS_512(6, 1) PANEL_ROWS_512(6, 2) PANEL_ROWS_512(7, 1) PANEL_ROWS_512(7, 2) PANEL_ROWS_512(8, 1)
PANEL_ROWS_512(8, 2) PANEL_ROWS_512(9, 1) PANEL_ROWS_512(9, 2) PANEL_ROWS_512(10, 1) PANEL_ROWS_512(10, 2)
PANEL_ROWS_512(11, 1) PANEL_ROWS_512(11, 2) PANEL_ROWS_512(12, 1) PANEL_ROWS_512(12, 2)

/* by group size: a pair of panels (a broadcast of x feeds two FMAs), and one panel (an odd last one) */
#define ROW_TABLES_512(SUFFIX)                                                                                  \
    static const panel_fn##SUFFIX PAIR512##SUFFIX[MAX_GROUP_512 + 1] = {                                        \
        0, 0, 0, 0, 0, 0, rows512_6_span_2##SUFFIX, rows512_7_span_2##SUFFIX, rows512_8_span_2##SUFFIX,          \
        rows512_9_span_2##SUFFIX, rows512_10_span_2##SUFFIX, rows512_11_span_2##SUFFIX, rows512_12_span_2##SUFFIX}; \
    static const panel_fn##SUFFIX ONE512##SUFFIX[MAX_GROUP_512 + 1] = {                                         \
        0, 0, 0, 0, 0, 0, rows512_6_span_1##SUFFIX, rows512_7_span_1##SUFFIX, rows512_8_span_1##SUFFIX,          \
        rows512_9_span_1##SUFFIX, rows512_10_span_1##SUFFIX, rows512_11_span_1##SUFFIX, rows512_12_span_1##SUFFIX};
ROW_TABLES_512()
ROW_TABLES_512(_f16)

/* y[M, N] = x @ W^T (+ bias) for M > 6: groups of 6 to 12 rows (as even as possible), pair of panels by pair, every
 * group over the pair while it is in cache (the weights are read from memory once). */
#define SMALL_GEMM_512(SUFFIX, WTYPE)                                                                            \
    static void small_gemm_avx512##SUFFIX(const float *x, long m, long k, long ldx, const WTYPE *packed, long n,  \
                                          const float *bias, float *y, long ldy) {                               \
        long panels = (n + PANEL - 1) / PANEL, groups = (m + MAX_GROUP_512 - 1) / MAX_GROUP_512;                  \
        for (long p = 0; p < panels; p += 2)                                                                     \
            for (long r = 0, g = 0; g < groups; g++) {                                                           \
                long size = (m - r) / (groups - g);                                                              \
                (p + 2 <= panels ? PAIR512##SUFFIX : ONE512##SUFFIX)[size](                                      \
                    x + r * ldx, ldx, packed + p * k * PANEL, k, y + r * ldy + p * PANEL, ldy, n - p * PANEL,     \
                    bias ? bias + p * PANEL : 0);                                                                \
                r += size;                                                                                       \
            }                                                                                                    \
    }
SMALL_GEMM_512(, float)
SMALL_GEMM_512(_f16, uint16_t)

/* Which kernel serves: AVX-512 for more than 6 rows where the CPU has it, unless small_gemm_use_avx512(0) pinned
 * AVX2 (tests compare the two bit for bit). Up to 6 rows a step is memory-bound and the AVX2 form ran it faster
 * (an AMX Xeon, the embedded target's matmuls, 20 layers + head: 1 row 3.72 ms against 4.19, 5 rows 3.21 against
 * 3.68; 9 rows 5.47 against 3.87, 17 rows 8.87 against 6.22, 33 rows 18.1 against 11.1). */
static int use_avx512 = -1;
void small_gemm_use_avx512(int on) {
    __builtin_cpu_init();
    use_avx512 = on && __builtin_cpu_supports("avx512f");
}
int small_gemm_uses_avx512(void) {
    if (use_avx512 < 0) small_gemm_use_avx512(1);
    return use_avx512;
}

/* One thread's GEMM; small_gemm and small_gemm_f16 (parallel.c) split the panels over the cores. */
void small_gemm_serial(const float *x, long m, long k, long ldx, const float *packed, long n, const float *bias,
                       float *y, long ldy) {
    if (m <= 0 || n <= 0) return;
    if (m > MAX_GROUP && small_gemm_uses_avx512()) small_gemm_avx512(x, m, k, ldx, packed, n, bias, y, ldy);
    else small_gemm_avx2(x, m, k, ldx, packed, n, bias, y, ldy);
}

void small_gemm_serial_f16(const float *x, long m, long k, long ldx, const uint16_t *packed, long n,
                           const float *bias, float *y, long ldy) {
    if (m <= 0 || n <= 0) return;
    if (m > MAX_GROUP && small_gemm_uses_avx512()) small_gemm_avx512_f16(x, m, k, ldx, packed, n, bias, y, ldy);
    else small_gemm_avx2_f16(x, m, k, ldx, packed, n, bias, y, ldy);
}
