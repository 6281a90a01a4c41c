/* One ARM64 body of quant_matmul.c's int8 matmul, included by neon_q8_matmul.h once per
 * instruction set: Q8_DOT(acc, a, b) adds the four-lane int32 dot products of sixteen
 * signed bytes, Q8_NAME names this copy's functions, Q8_TARGET is their target. */

/* Rows r0 .. r0 + ROWS - 1 by the four columns j0 .. j0 + cols - 1 (cols <= 4). */
static inline Q8_TARGET __attribute__((always_inline)) void Q8_NAME(q8_quad)(const qjob_t *job, const float *panel,
                                                                             int64_t j0, int cols, int64_t r0,
                                                                             const int ROWS, const int BITS) {
    const int64_t nb = job->nb, bytes = BITS == 4 ? BLOCK / 2 : BLOCK, row_bytes = job->pairs * PAIR_BYTES;
    const uint8_t *w[4];
    for (int c = 0; c < 4; c++) w[c] = job->qs + (j0 + (c < cols ? c : 0)) * nb * bytes;
    float32x4_t acc[ROWS_NEON];
    for (int r = 0; r < ROWS; r++) acc[r] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        int8x16_t wl[4], wh[4];
        for (int c = 0; c < 4; c++) {
            if (BITS == 4) {
                const uint8x16_t packed = vld1q_u8(w[c] + b * bytes);
                wl[c] = vreinterpretq_s8_u8(vandq_u8(packed, vdupq_n_u8(0x0F)));
                wh[c] = vreinterpretq_s8_u8(vshrq_n_u8(packed, 4));
            } else {
                wl[c] = vld1q_s8((const int8_t *)w[c] + b * bytes);
                wh[c] = vld1q_s8((const int8_t *)w[c] + b * bytes + 16);
            }
        }
        const float32x4_t scale = vld1q_f32(panel + 16 * b), min = vld1q_f32(panel + 16 * b + 4);
        for (int r = 0; r < ROWS; r++) {
            const int8_t *lo = job->xq + (r0 + r) * row_bytes + (b / 2) * PAIR_BYTES + (b % 2) * (BLOCK / 2);
            const int8x16_t xl = vld1q_s8(lo), xh = vld1q_s8(lo + BLOCK);
            int32x4_t d[4];
            for (int c = 0; c < 4; c++) d[c] = Q8_DOT(Q8_DOT(vdupq_n_s32(0), wl[c], xl), wh[c], xh);
            const float32x4_t xd = vdupq_n_f32(job->xd[(r0 + r) * nb + b]);
            acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(neon_sum_lanes4(d)), vmulq_f32(scale, xd));
            if (BITS == 4) acc[r] = vfmaq_f32(acc[r], min, vdupq_n_f32(job->xs[(r0 + r) * nb + b]));
        }
    }
    for (int r = 0; r < ROWS; r++) {
        float lanes[4];
        vst1q_f32(lanes, acc[r]);
        for (int c = 0; c < cols; c++) job->y[(r0 + r) * job->n + j0 + c] = lanes[c];
    }
}

/* A group_fn: the eight columns from j0 for rows r0 .. r0 + rows - 1 (rows <= ROWS_NEON);
 * panels from neon_q8_panels. */
static Q8_TARGET void Q8_NAME(q8_group)(const qjob_t *job, const float *panels, int64_t j0, int64_t r0, int rows) {
    for (int quad = 0; quad < 2 && j0 + 4 * quad < job->n; quad++) {
        const int64_t jq = j0 + 4 * quad;
        const int cols = (int)(job->n - jq < 4 ? job->n - jq : 4);
        const float *panel = panels + 8 * quad;
        if (job->bits == 4) {
            if (rows == 2) Q8_NAME(q8_quad)(job, panel, jq, cols, r0, 2, 4);
            else Q8_NAME(q8_quad)(job, panel, jq, cols, r0, 1, 4);
        } else {
            if (rows == 2) Q8_NAME(q8_quad)(job, panel, jq, cols, r0, 2, 8);
            else Q8_NAME(q8_quad)(job, panel, jq, cols, r0, 1, 8);
        }
    }
}
