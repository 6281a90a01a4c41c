/*
 * e^x of a float with the same bits on every architecture, scalar and vector alike.
 *
 * libm's expf is not that: glibc 2.36's x86-64 and AArch64 builds round two inputs apart
 * (expf(32.564632) and expf(-63.099461), tests/kernels/arm64/expf_probe.c), so a softmax,
 * SiLU or MoE router that meets one differs in its last bit between a PC and a Raspberry Pi
 * or a Mac. This one is made of IEEE operations that are each rounded once, whatever the
 * CPU: additions, multiplications, fused multiply-adds written as fmaf (an IEEE 754
 * operation: one rounding; the compiler cannot split or reassociate it, and the kernels
 * are built with -ffp-contract=off, so no other a * b + c is fused behind our back),
 * floorf and exact power-of-two scalings built from bits.
 *
 * Why fmaf and not plain multiplies and adds: the vector bodies (simd.h's exp256 on AVX2,
 * arm64_simd.h's exp4_mirror on NEON) are fused multiply-add chains, and a row of a softmax
 * or SiLU runs its whole eights through them and its tail through this scalar function.
 * Written as the same chain, step for step, the scalar function gives the vector bodies'
 * bits for every input, so which path an element takes never changes its value (checked for
 * every float by bench/bench_exp.py, and on a dense sample in make test). Where a CPU has no
 * fma instruction (x86 before Haswell), fmaf is glibc's exactly rounded software version:
 * the same bits, slower.
 *
 * The method is Cephes' expf: x = n ln 2 + r with n = floor(x log2(e) + 1/2), so |r| <=
 * ln(2) / 2 (ln 2 in two parts, the first with few bits, so n * 0.693359375 is exact and
 * x - n * 0.693359375 loses nothing); e^r by a degree-7 polynomial; then times 2^n. Its
 * error is within 1 ulp of the true e^x over every float (bench/bench_exp.py measures it
 * against libm's double exp for all 2^32 inputs), including the subnormal results.
 *
 *   |x| <= 87.3365...   the chain above; 2^n, n in [-126, 126], is one normal float
 *   n = 127, 128        up to 88.72...: (p * 2^127) * 2^(n - 127), which overflows to +inf
 *                       exactly where the true e^x rounds to it (above 88.7228...)
 *   n in [-150, -127]   down to -104: (p * 2^(n + 126)) * 2^-126, exact until the last
 *                       multiplication rounds once into the subnormals (or to 0)
 *   x > 89              +inf; x < -104: +0 (e^-103.98 rounds to 0 already)
 *   NaN                 NaN (x + x: quiet, its payload kept)
 */
#ifndef BARGEIN_EXP_H
#define BARGEIN_EXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The largest |x| for which the vector bodies scale by one power of two (n >= -126). */
#define BARGEIN_EXP_FAST_LIMIT 87.3365478515625f

/* 2^n as a float, for n in [-126, 127] (a normal float: exponent bits only). */
static inline float bargein_pow2i(int32_t n) {
    const uint32_t bits = (uint32_t)(n + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* e^x for every float x; see above. */
static inline float bargein_expf(float x) {
    if (x != x) return x + x;
    if (x > 89.0f) return INFINITY;
    if (x < -104.0f) return 0.0f;
    const float fx = floorf(fmaf(x, 1.44269504088896341f, 0.5f));
    float r = fmaf(-fx, 0.693359375f, x); /* exact: see above */
    r = fmaf(-fx, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r + 1.0f);
    const int32_t n = (int32_t)fx;
    if (n > 127) return (p * bargein_pow2i(127)) * bargein_pow2i(n - 127);
    if (n < -126) return (p * bargein_pow2i(n + 126)) * bargein_pow2i(-126);
    return p * bargein_pow2i(n);
}

#endif
