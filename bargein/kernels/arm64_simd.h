/* ARM64 (AArch64) vector helpers: NEON, which every AArch64 CPU has, and the dot-product
 * extension (sdot, ARMv8.2-A+dotprod: Raspberry Pi 5, Apple M-series, Graviton 2+), which
 * the int8 matmuls choose at run time.
 *
 * Bit-identity with the x86 paths. The float kernels that simd.h's AVX2 bodies speed up
 * (attention, the row-wise ops, the float block matmul) fix their summation order by the
 * AVX2 body: eight float lanes, fused multiply-adds, hsum256's tree, exp256's chain.
 * f32x8 below is those eight lanes as two NEON registers, and every helper here does, lane
 * for lane, the operation of the AVX2 helper it mirrors (vfmaq_f32 is one rounding like
 * vfmadd; vrndmq_f32 is floor; vcvtq_s32_f32 truncates like cvttps), so an ARM64 node and
 * an x86-64 AVX2 node give the same bits. The int8 matmuls' paths sum exact int32 dot
 * products, whose order cannot matter, and do their float steps in the plain-C order.
 *
 * Include from simd.h (BARGEIN_NEON) or directly, on AArch64 only.
 */
#ifndef BARGEIN_ARM64_SIMD_H
#define BARGEIN_ARM64_SIMD_H

#include <arm_neon.h>
#include <stdint.h>

#include "exp.h"

#define BARGEIN_NEON 1

#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1UL << 20) /* the kernel's bit for the dot-product instructions */
#endif
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#endif

/* Compilers that know the dot-product extension build its path as a function target
 * (GCC 8, clang 6 on): the rest of the library needs no -march for it. Others build the
 * NEON path only. */
#if defined(__clang__) ? __clang_major__ >= 6 : (defined(__GNUC__) && __GNUC__ >= 8)
#define BARGEIN_DOTPROD 1
#ifdef __clang__
#define TARGET_DOTPROD __attribute__((target("dotprod")))
#else
#define TARGET_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#endif
#endif

#if defined(__APPLE__)
/* Whether macOS's integer sysctl name is set (0 where it is missing or not 1). */
static inline int darwin_sysctl_set(const char *name) {
    int value = 0;
    size_t size = sizeof value;
    return sysctlbyname(name, &value, &size, NULL, 0) == 0 && value == 1;
}
#endif

/* Whether this CPU runs sdot (Linux: the kernel's hardware capabilities; macOS: the sysctl
 * hw.optional.arm.FEAT_DotProd, before macOS 12 hw.optional.armv8_2_dotprod, the names
 * build_flags.py reads too; elsewhere only where the whole build targets it). */
static inline int arm64_has_dotprod(void) {
#if defined(__linux__)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__APPLE__)
    return darwin_sysctl_set("hw.optional.arm.FEAT_DotProd") || darwin_sysctl_set("hw.optional.armv8_2_dotprod");
#elif defined(__ARM_FEATURE_DOTPROD)
    return 1;
#else
    return 0;
#endif
}

/* ---- int8: exact int32 dot products ------------------------------------------------- */

/* The int8 matmuls' ARM64 instruction sets, by the numbers quant_matmul.c knows them by
 * (after x86's 0 plain C, 1 AVX2, 2 AVX-512 VNNI). */
enum { ISA_NEON = 3, ISA_DOTPROD = 4 };

/* Whether isa is an ARM64 path this CPU runs (and this build has). */
static inline int neon_isa_available(int isa) {
    if (isa == ISA_NEON) return 1;
#ifdef BARGEIN_DOTPROD
    if (isa == ISA_DOTPROD) return arm64_has_dotprod();
#endif
    return 0;
}

/* The lane sums of four int32 vectors: lane c = the sum of d[c]'s lanes. */
static inline int32x4_t neon_sum_lanes4(const int32x4_t d[4]) {
    return vpaddq_s32(vpaddq_s32(d[0], d[1]), vpaddq_s32(d[2], d[3]));
}

/* acc + the four-lane int32 sums of a * b over 16 signed bytes (plain NEON: widening
 * multiplies, pairwise add-accumulate; |a * b| <= 128 * 127 and a pair fits int16). */
static inline int32x4_t dot16_neon(int32x4_t acc, int8x16_t a, int8x16_t b) {
    const int16x8_t lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    const int16x8_t hi = vmull_high_s8(a, b);
    return vpadalq_s16(vpadalq_s16(acc, lo), hi);
}

/* max|x| over n floats (n a multiple of 4; a NaN skipped, as fmaxf skips it; a max: the
 * order does not matter). */
static inline float neon_amax(const float *x, int n) {
    float32x4_t mx = vdupq_n_f32(0.0f);
    for (int i = 0; i < n; i += 4) mx = vmaxnmq_f32(mx, vabsq_f32(vld1q_f32(x + i)));
    return vmaxnmvq_f32(mx);
}

/* n floats x (a multiple of 16) as rint(x * inv) clamped to -127..127 (round half to
 * even) into q, with the sums of q per 16 into sums16. */
static inline void neon_quantize_by(const float *x, int n, float inv, int8_t *q, int32_t *sums16) {
    const float32x4_t scale = vdupq_n_f32(inv);
    const int32x4_t top = vdupq_n_s32(127), bottom = vdupq_n_s32(-127);
    for (int i = 0; i < n; i += 16) {
        int32x4_t v[4];
        for (int j = 0; j < 4; j++)
            v[j] = vmaxq_s32(vminq_s32(vcvtq_s32_f32(vrndnq_f32(vmulq_f32(vld1q_f32(x + i + 4 * j), scale))), top),
                             bottom);
        const int16x8_t a = vcombine_s16(vmovn_s32(v[0]), vmovn_s32(v[1]));
        const int16x8_t b = vcombine_s16(vmovn_s32(v[2]), vmovn_s32(v[3]));
        vst1q_s8(q + i, vcombine_s8(vmovn_s16(a), vmovn_s16(b)));
        sums16[i / 16] = vaddvq_s32(vaddq_s32(vaddq_s32(v[0], v[1]), vaddq_s32(v[2], v[3])));
    }
}

/* n floats x (a multiple of 16) quantized to int8 as the kernels' plain C does: amax =
 * max |x|, d = amax / 127, q = rint(x / d) clamped to -127..127, into q, with the sums of
 * q per 16 into sums16. Returns d. */
static inline float neon_quantize(const float *x, int n, int8_t *q, int32_t *sums16) {
    const float d = neon_amax(x, n) / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    neon_quantize_by(x, n, inv, q, sums16);
    return d;
}

/* ---- float: eight lanes, as AVX2's __m256 ------------------------------------------- */

typedef struct {
    float32x4_t lo, hi; /* lanes 0..3, 4..7 */
} f32x8;

static inline f32x8 f8_load(const float *p) { return (f32x8){vld1q_f32(p), vld1q_f32(p + 4)}; }
static inline void f8_store(float *p, f32x8 v) { vst1q_f32(p, v.lo), vst1q_f32(p + 4, v.hi); }
static inline f32x8 f8_set1(float v) { return (f32x8){vdupq_n_f32(v), vdupq_n_f32(v)}; }
static inline f32x8 f8_add(f32x8 a, f32x8 b) { return (f32x8){vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; }
static inline f32x8 f8_sub(f32x8 a, f32x8 b) { return (f32x8){vsubq_f32(a.lo, b.lo), vsubq_f32(a.hi, b.hi)}; }
static inline f32x8 f8_mul(f32x8 a, f32x8 b) { return (f32x8){vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; }
/* a * b + c, one rounding (_mm256_fmadd_ps). */
static inline f32x8 f8_fmadd(f32x8 a, f32x8 b, f32x8 c) {
    return (f32x8){vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)};
}
/* Eight halves widened (exact). */
static inline f32x8 f8_load_halves(const uint16_t *p) {
    const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(p));
    return (f32x8){vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
}
/* Eight floats to halves, rounded to nearest even (the default rounding mode, as
 * _mm256_cvtps_ph with _MM_FROUND_TO_NEAREST_INT). */
static inline void f8_store_halves(uint16_t *p, f32x8 v) {
    vst1q_u16(p, vreinterpretq_u16_f16(vcvt_high_f16_f32(vcvt_f16_f32(v.lo), v.hi)));
}

/* The sum of the eight lanes in hsum256's order: ((v0+v4) + (v2+v6)) + ((v1+v5) + (v3+v7)). */
static inline float f8_hsum(f32x8 v) {
    const float32x4_t s = vaddq_f32(v.lo, v.hi);
    const float32x2_t t = vadd_f32(vget_low_f32(s), vget_high_f32(s));
    return vget_lane_f32(t, 0) + vget_lane_f32(t, 1);
}

/* The lanes of x one by one through bargein_expf (exp256_lanes' NEON twin). */
static __attribute__((noinline)) float32x4_t exp4_lanes(float32x4_t x) {
    float v[4];
    vst1q_f32(v, x);
    for (int i = 0; i < 4; i++) v[i] = bargein_expf(v[i]);
    return vld1q_f32(v);
}

/* exp256, lane for lane: bargein_expf's bits for every float (exp.h). */
static inline float32x4_t exp4_mirror(float32x4_t x) {
    if (vminvq_u32(vcaleq_f32(x, vdupq_n_f32(BARGEIN_EXP_FAST_LIMIT))) == 0) return exp4_lanes(x); /* also NaN */
    float32x4_t fx = vfmaq_f32(vdupq_n_f32(0.5f), x, vdupq_n_f32(1.44269504088896341f));
    fx = vrndmq_f32(fx);
    x = vfmsq_f32(x, fx, vdupq_n_f32(0.693359375f));
    x = vfmsq_f32(x, fx, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t y = vdupq_n_f32(1.9875691500e-4f);
    y = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), y, x);
    y = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), y, x);
    y = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), y, x);
    y = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), y, x);
    y = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), y, x);
    y = vfmaq_f32(vaddq_f32(x, vdupq_n_f32(1.0f)), y, vmulq_f32(x, x));
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(fx), vdupq_n_s32(127)), 23);
    return vmulq_f32(y, vreinterpretq_f32_s32(e));
}
static inline f32x8 f8_exp(f32x8 x) { return (f32x8){exp4_mirror(x.lo), exp4_mirror(x.hi)}; }

/* ---- the loops of simd.h's AVX2 bodies, each from *i on in steps of eight ------------ */

/* sum of x[i]^2 over whole eights from *i (rowwise.c's rms norm); *i moves past them. */
static inline float neon_sum_squares(const float *x, int64_t n, int64_t *i) {
    f32x8 acc = f8_set1(0.0f);
    for (; *i + 8 <= n; *i += 8) {
        const f32x8 v = f8_load(x + *i);
        acc = f8_fmadd(v, v, acc);
    }
    return f8_hsum(acc);
}

/* y = silu(a) * b over whole eights (rowwise.c): a e^a / (1 + e^a) below 0, exp of -|a| only. */
static inline void neon_silu_mul(const float *a, const float *b, float *y, int64_t n, int64_t *i) {
    const float32x4_t one = vdupq_n_f32(1.0f);
    for (; *i + 8 <= n; *i += 8) {
        const float *pa = a + *i;
        float32x4_t out[2];
        for (int h = 0; h < 2; h++) {
            const float32x4_t va = vld1q_f32(pa + 4 * h);
            const float32x4_t e = exp4_mirror(vnegq_f32(vabsq_f32(va)));
            const uint32x4_t neg = vcltq_f32(va, vdupq_n_f32(0.0f));
            const float32x4_t num = vbslq_f32(neg, vmulq_f32(va, e), va);
            out[h] = vmulq_f32(vdivq_f32(num, vaddq_f32(one, e)), vld1q_f32(b + *i + 4 * h));
        }
        vst1q_f32(y + *i, out[0]), vst1q_f32(y + *i + 4, out[1]);
    }
}

/* <a, b> over whole eights from *i (eight lanes of fused steps, hsum's tree). */
static inline float neon_dot(const float *a, const float *b, int64_t n, int64_t *i) {
    f32x8 acc = f8_set1(0.0f);
    for (; *i + 8 <= n; *i += 8) acc = f8_fmadd(f8_load(a + *i), f8_load(b + *i), acc);
    return f8_hsum(acc);
}

/* s[t] = exp(s[t] - m) over whole eights from *t; returns their sum (hsum's tree). */
static inline float neon_exp_shift(float *s, float m, int64_t n, int64_t *t) {
    const f32x8 vm = f8_set1(m);
    f32x8 sum = f8_set1(0.0f);
    for (; *t + 8 <= n; *t += 8) {
        const f32x8 e = f8_exp(f8_sub(f8_load(s + *t), vm));
        f8_store(s + *t, e);
        sum = f8_add(sum, e);
    }
    return f8_hsum(sum);
}

/* a[d] = fma(w, v[d], a[d]) over whole eights from *d. */
static inline void neon_axpy(float *a, const float *v, float w, int64_t n, int *d) {
    const f32x8 vw = f8_set1(w);
    for (; *d + 8 <= n; *d += 8) f8_store(a + *d, f8_fmadd(vw, f8_load(v + *d), f8_load(a + *d)));
}

/* Halves to floats over whole eights from *i (exact). */
static inline void neon_widen_halves(const uint16_t *src, float *dst, int n, int *i) {
    for (; *i + 8 <= n; *i += 8) f8_store(dst + *i, f8_load_halves(src + *i));
}

/* Floats to halves over whole eights from *i (nearest even). */
static inline void neon_store_halves(const float *src, uint16_t *dst, int n, int *i) {
    for (; *i + 8 <= n; *i += 8) f8_store_halves(dst + *i, f8_load(src + *i));
}

/* <q_g, k> over n (a multiple of 8) in lane g, as decode_attention.c's AVX2 body: four
 * lanes of fused chains per row, then f8_sum4. */
static inline float32x4_t f8_sum4(f32x8 a0, f32x8 a1, f32x8 a2, f32x8 a3);
static inline float32x4_t neon_dot4(const float *const q[4], const float *k, int n) {
    f32x8 a0 = f8_set1(0.0f), a1 = a0, a2 = a0, a3 = a0;
    for (int d = 0; d < n; d += 8) {
        const f32x8 kd = f8_load(k + d);
        a0 = f8_fmadd(f8_load(q[0] + d), kd, a0);
        a1 = f8_fmadd(f8_load(q[1] + d), kd, a1);
        a2 = f8_fmadd(f8_load(q[2] + d), kd, a2);
        a3 = f8_fmadd(f8_load(q[3] + d), kd, a3);
    }
    return f8_sum4(a0, a1, a2, a3);
}

/* _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3)), its two halves added:
 * lane g the sum of a_g, in that order (decode_attention.c's four query heads). */
static inline float32x4_t f8_sum4(f32x8 a0, f32x8 a1, f32x8 a2, f32x8 a3) {
    const float32x4_t lo = vpaddq_f32(vpaddq_f32(a0.lo, a1.lo), vpaddq_f32(a2.lo, a3.lo));
    const float32x4_t hi = vpaddq_f32(vpaddq_f32(a0.hi, a1.hi), vpaddq_f32(a2.hi, a3.hi));
    return vaddq_f32(lo, hi);
}

#endif
