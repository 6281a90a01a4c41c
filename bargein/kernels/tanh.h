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
    const float t = bargein_expf(-2.0f * a);
    return copysignf((1.0f - t) / (1.0f + t), x);
}

#endif
