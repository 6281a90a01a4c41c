/* block_matmul.c's AVX2 body on ARM64 NEON, lane for lane (see arm64_simd.h): a weight
 * block's 32 quants widened to four f32x8 (unscaled), each row's block sum as
 * fma(w1, x8, w0 * x0) + fma(w3, x24, w2 * x16), into the row's eight lanes by one fused
 * step with the block's scale, hsum256's tree at the end. Include after arm64_simd.h. */
#ifndef BARGEIN_NEON_BLOCK_MATMUL_H
#define BARGEIN_NEON_BLOCK_MATMUL_H

/* The 32 quants of a block as floats: 4-bit (16 bytes, low nibbles first) or 8-bit. */
static inline void neon_widen_block(const uint8_t *q, int bits, f32x8 w[4]) {
    int8x16_t lo, hi;
    if (bits == 4) {
        const uint8x16_t packed = vld1q_u8(q);
        lo = vreinterpretq_s8_u8(vandq_u8(packed, vdupq_n_u8(0x0F)));
        hi = vreinterpretq_s8_u8(vshrq_n_u8(packed, 4));
    } else {
        lo = vld1q_s8((const int8_t *)q), hi = vld1q_s8((const int8_t *)q + 16);
    }
    const int8x16_t parts[2] = {lo, hi};
    for (int p = 0; p < 2; p++) {
        const int16x8_t a = vmovl_s8(vget_low_s8(parts[p])), b = vmovl_s8(vget_high_s8(parts[p]));
        w[2 * p] = (f32x8){vcvtq_f32_s32(vmovl_s16(vget_low_s16(a))), vcvtq_f32_s32(vmovl_high_s16(a))};
        w[2 * p + 1] = (f32x8){vcvtq_f32_s32(vmovl_s16(vget_low_s16(b))), vcvtq_f32_s32(vmovl_high_s16(b))};
    }
}

/* out[r] = sum over blocks b of scale[b] * <q_b, x_r,b> for count rows of x (k apart), in
 * the AVX2 body's order; qs: the weight row's nb blocks, scales its nb scales. */
static inline void neon_block_dot_rows(const float *x, int64_t k, const uint8_t *qs, const float *scales,
                                       int bits, int64_t nb, int count, float *out) {
    f32x8 acc[8];
    const int64_t bytes = bits == 4 ? 16 : 32;
    for (int r = 0; r < count; r++) acc[r] = f8_set1(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        f32x8 w[4];
        neon_widen_block(qs + b * bytes, bits, w);
        const f32x8 s = f8_set1(scales[b]);
        for (int r = 0; r < count; r++) {
            const float *xb = x + r * k + b * 32;
            const f32x8 p0 = f8_fmadd(w[1], f8_load(xb + 8), f8_mul(w[0], f8_load(xb)));
            const f32x8 p1 = f8_fmadd(w[3], f8_load(xb + 24), f8_mul(w[2], f8_load(xb + 16)));
            acc[r] = f8_fmadd(s, f8_add(p0, p1), acc[r]);
        }
    }
    for (int r = 0; r < count; r++) out[r] = f8_hsum(acc[r]);
}

#endif
