/* What the kernels in this folder share of the CPU's vector instructions. */
#ifndef BARGEIN_SIMD_H
#define BARGEIN_SIMD_H

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BARGEIN_AVX2 1

/* The sum of the eight lanes of v. */
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#endif
