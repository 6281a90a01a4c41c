/* What the kernels in this folder share of the CPU's vector instructions. */
#ifndef BARGEIN_SIMD_H
#define BARGEIN_SIMD_H

#include "exp.h"

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

/* The lanes of x one by one through bargein_expf: the inputs the chain below does not
 * scale in one step (|x| > BARGEIN_EXP_FAST_LIMIT: overflow, subnormals, 0) and NaN. Rare
 * (a softmax's scores 87 apart), so out of line. */
static __attribute__((noinline)) __m256 exp256_lanes(__m256 x) {
    float v[8];
    _mm256_storeu_ps(v, x);
    for (int i = 0; i < 8; i++) v[i] = bargein_expf(v[i]);
    return _mm256_loadu_ps(v);
}

/* e^x in eight lanes, each lane bargein_expf's bits (exp.h: the same fused chain, Cephes'
 * expf), for every float. */
static inline __m256 exp256(__m256 x) {
    const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    if (_mm256_movemask_ps(_mm256_cmp_ps(magnitude, _mm256_set1_ps(BARGEIN_EXP_FAST_LIMIT), _CMP_LE_OQ)) != 0xFF)
        return exp256_lanes(x);
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#include "arm64_simd.h" /* BARGEIN_NEON: the same arithmetic as the AVX2 bodies */
#endif

#endif
