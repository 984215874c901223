/* Shared AVX2 helpers of the C kernels (included, not compiled on its own). */
#ifndef DRAFTSMITH_VEC_EXP_H
#define DRAFTSMITH_VEC_EXP_H
#include <immintrin.h>

#define AVX2_FMA __attribute__((target("avx2,fma")))

/* exp of 8 lanes (Cephes' single-precision polynomial, ~1 ulp); lanes below -87 (masked positions are -inf, and
 * every score has the row's max subtracted) give exactly 0, as a float exp underflows there anyway. */
AVX2_FMA static inline __m256 exp8(__m256 x) {
    __m256 dead = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(dead, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2)));
}

#endif
