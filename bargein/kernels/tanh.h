/*
 * tanh of a float with the same bits on every architecture.
 *
 * libm's tanhf is not that: glibc's x86-64 and AArch64 builds round 1,956 of the 2^24
 * inputs tried differently (AArch64's libm is compiled with fused multiply-adds), so GeGLU
 * and soft caps computed with it differ between a Mac or a Raspberry Pi and a PC. This one
 * uses only IEEE additions, multiplications, one division and exact bit operations, each
 * rounded once (the kernels are built with -ffp-contract=off), so it is the same function
 * wherever it is compiled. Its error is within 2 ulp of the true tanh over all floats
 * (tests/kernels/test_tanh.py checks every float in [-10, 10] on a fine grid).
 *
 *   |x| < 0.625      an odd polynomial in x (Cephes' tanhf coefficients; the
 *                    cancellation of 1 - 2 / (e^2x + 1) would lose bits here)
 *   0.625 <= |x| < 9.1   (1 - t) / (1 + t), t = e^(-2|x|) (Cephes' expf reduction)
 *   |x| >= 9.1       +-1 (the true tanh rounds to it); NaN stays NaN
 */
#ifndef BARGEIN_TANH_H
#define BARGEIN_TANH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^x for -18.2 <= x <= 0: x = n ln 2 + r, |r| <= ln 2 / 2, e^r by a degree-6 polynomial. */
static inline float bargein_exp_negative(float x) {
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f; /* ln 2 in two parts: n * 0.693359375 is exact */
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23; /* 2^n, n >= -27: a normal float */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float bargein_tanhf(float x) {
    const float a = fabsf(x);
    if (!(a < 9.1f)) /* also NaN, which fails every comparison */
        return a != a ? x : copysignf(1.0f, x);
    if (a < 0.625f) {
        const float z = x * x;
        float p = -5.70498872745e-3f;
        p = p * z + 2.06390887954e-2f;
        p = p * z - 5.37397155531e-2f;
        p = p * z + 1.33314422036e-1f;
        p = p * z - 3.33332819422e-1f;
        return copysignf((p * z) * x + x, x); /* -0 stays -0 */
    }
    const float t = bargein_exp_negative(-2.0f * a);
    return copysignf((1.0f - t) / (1.0f + t), x);
}

#endif
