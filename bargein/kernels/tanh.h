/*
 * tanh of a float with the same bits on every architecture.
 *
 * libm's tanhf is not that: glibc's x86-64 and AArch64 builds round 1,956 of the 2^24
 * inputs tried differently (AArch64's libm is compiled with fused multiply-adds), so GeGLU
 * and soft caps computed with it differ between a Mac or a Raspberry Pi and a PC. This one
 * uses only IEEE additions, multiplications, fused multiply-adds (fmaf), one division and
 * exact bit operations, each rounded once (the kernels are built with -ffp-contract=off),
 * so it is the same function wherever it is compiled. Its error is within 2 ulp of the
 * true tanh over all floats (tests/kernels/test_family_ops.py checks every float in
 * [0.5, 16) and a fine grid elsewhere).
 *
 *   |x| < 0.625      an odd polynomial in x (Cephes' tanhf coefficients; the
 *                    cancellation of 1 - 2 / (e^2x + 1) would lose bits here)
 *   0.625 <= |x| < 9.1   (1 - t) / (1 + t), t = e^(-2|x|) (exp.h's bargein_expf)
 *   |x| >= 9.1       +-1 (the true tanh rounds to it); NaN stays NaN
 */
#ifndef BARGEIN_TANH_H
#define BARGEIN_TANH_H

#include <math.h>

#include "exp.h"
#include "simd.h" /* BARGEIN_AVX2, BARGEIN_NEON and their exp bodies */

/* The constants the scalar and the vector bodies share (one definition, so that the
 * bodies cannot drift apart): the polynomial's coefficients in Horner order (the signs
 * are the additions and subtractions below) and the branch bounds. */
#define TANH_P0 (-5.70498872745e-3f)
#define TANH_P1 2.06390887954e-2f
#define TANH_P2 5.37397155531e-2f
#define TANH_P3 1.33314422036e-1f
#define TANH_P4 3.33332819422e-1f
#define TANH_SMALL 0.625f
#define TANH_LIMIT 9.1f

static inline float bargein_tanhf(float x) {
    const float a = fabsf(x);
    if (!(a < TANH_LIMIT)) /* also NaN, which fails every comparison */
        return a != a ? x : copysignf(1.0f, x);
    if (a < TANH_SMALL) {
        const float z = x * x;
        float p = TANH_P0;
        p = p * z + TANH_P1;
        p = p * z - TANH_P2;
        p = p * z + TANH_P3;
        p = p * z - TANH_P4;
        return copysignf((p * z) * x + x, x); /* -0 stays -0 */
    }
    const float t = bargein_expf(-2.0f * a);
    return copysignf((1.0f - t) / (1.0f + t), x);
}

/* The vector bodies below give bargein_tanhf's bits lane for lane: the same operations on
 * every lane, each branch computed whole and the lane's branch chosen by a blend, the
 * polynomial in separate multiplications and additions (as the scalar's, built with
 * -ffp-contract=off), e^(-2|x|) by the exp bodies that give bargein_expf's bits. The middle
 * branch takes min(|x|, 9.1) so that no lane (a large or NaN one, blended away after) sends
 * the exp to its lane-by-lane path. */
#if defined(BARGEIN_AVX2)
static inline __m256 bargein_tanh256(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f), limit = _mm256_set1_ps(TANH_LIMIT);
    const __m256 a = _mm256_andnot_ps(sign, x), x_sign = _mm256_and_ps(sign, x);
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(TANH_P0);
    p = _mm256_add_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(TANH_P1));
    p = _mm256_sub_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(TANH_P2));
    p = _mm256_add_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(TANH_P3));
    p = _mm256_sub_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(TANH_P4));
    const __m256 small = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, z), x), x);
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 t = exp256(_mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_min_ps(a, limit)));
    const __m256 middle = _mm256_div_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t));
    /* the lane's branch, its sign from x (copysignf); a NaN lane gives x itself */
    __m256 y = _mm256_blendv_ps(middle, small, _mm256_cmp_ps(a, _mm256_set1_ps(TANH_SMALL), _CMP_LT_OQ));
    y = _mm256_blendv_ps(one, y, _mm256_cmp_ps(a, limit, _CMP_LT_OQ));
    y = _mm256_or_ps(_mm256_andnot_ps(sign, y), x_sign);
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#elif defined(BARGEIN_NEON)
static inline float32x4_t bargein_tanh4(float32x4_t x) {
    const float32x4_t a = vabsq_f32(x), limit = vdupq_n_f32(TANH_LIMIT), one = vdupq_n_f32(1.0f);
    const float32x4_t z = vmulq_f32(x, x);
    float32x4_t p = vdupq_n_f32(TANH_P0);
    p = vaddq_f32(vmulq_f32(p, z), vdupq_n_f32(TANH_P1));
    p = vsubq_f32(vmulq_f32(p, z), vdupq_n_f32(TANH_P2));
    p = vaddq_f32(vmulq_f32(p, z), vdupq_n_f32(TANH_P3));
    p = vsubq_f32(vmulq_f32(p, z), vdupq_n_f32(TANH_P4));
    const float32x4_t small = vaddq_f32(vmulq_f32(vmulq_f32(p, z), x), x);
    /* vminq_f32 would pass a NaN on: take 9.1 where |x| is not below it (NaN included) */
    const uint32x4_t below = vcltq_f32(a, limit);
    const float32x4_t t = exp4_mirror(vmulq_f32(vdupq_n_f32(-2.0f), vbslq_f32(below, a, limit)));
    const float32x4_t middle = vdivq_f32(vsubq_f32(one, t), vaddq_f32(one, t));
    float32x4_t y = vbslq_f32(vcltq_f32(a, vdupq_n_f32(TANH_SMALL)), small, middle);
    y = vbslq_f32(below, y, one);
    const uint32x4_t sign = vdupq_n_u32(0x80000000u);
    y = vbslq_f32(sign, x, y); /* copysignf: the sign bit from x, the rest from y */
    return vbslq_f32(vceqq_f32(x, x), y, x);
}
#endif

#endif
