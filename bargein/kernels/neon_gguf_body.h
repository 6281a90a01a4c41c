/* One ARM64 body of gguf_matmul.c's `fast` matmul, included by neon_gguf_matmul.h once
 * per instruction set: GG_DOT(acc, a, b) adds the four-lane int32 dot products of sixteen
 * signed bytes, GG_NAME names this copy's functions, GG_TARGET is their target. ROWS
 * (1 or 2) rows share each load of the quad's weights. */

/* Rows r0 .. r0 + ROWS - 1 against a decoded quad on the 32 chain into v: the plain C's
 * steps, a lane per column. */
static inline GG_TARGET __attribute__((always_inline)) void GG_NAME(rows_32)(const job_t *job, int kind,
                                                                             const int8_t *q, const neon_p32_t *p,
                                                                             int64_t r0, const int ROWS,
                                                                             float32x4_t *v) {
    const acts_t *a = job->a;
    const int64_t k = job->k, nb = job->nb;
    for (int r = 0; r < ROWS; r++) v[r] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        int8x16_t wl[4], wh[4];
        for (int c = 0; c < 4; c++) wl[c] = vld1q_s8(q + c * k + 32 * b), wh[c] = vld1q_s8(q + c * k + 32 * b + 16);
        const float32x4_t s = vld1q_f32(p[b].s);
        for (int r = 0; r < ROWS; r++) {
            const int64_t row = r0 + r;
            const int8x16_t xl = vld1q_s8(a->q + row * k + 32 * b), xh = vld1q_s8(a->q + row * k + 32 * b + 16);
            int32x4_t dl[4], dh[4], D;
            for (int c = 0; c < 4; c++) dl[c] = GG_DOT(vdupq_n_s32(0), wl[c], xl), dh[c] = GG_DOT(vdupq_n_s32(0), wh[c], xh);
            if (kind >= KIND_SPLIT) {
                D = vmulq_s32(vld1q_s32(p[b].sc[0]), neon_sum_lanes4(dl));
                D = vmlaq_s32(D, vld1q_s32(p[b].sc[1]), neon_sum_lanes4(dh));
            } else {
                for (int c = 0; c < 4; c++) dl[c] = vaddq_s32(dl[c], dh[c]);
                D = neon_sum_lanes4(dl);
            }
            const float32x4_t xd = vdupq_n_f32(a->d[row * nb + b]);
            v[r] = vfmaq_f32(v[r], vcvtq_f32_s32(D), vmulq_f32(s, xd));
            if (kind == KIND_MIN) v[r] = vfmaq_f32(v[r], vld1q_f32(p[b].m), vdupq_n_f32(a->s[row * nb + b]));
            if (kind == KIND_SPLIT_MIN) {
                int32x4_t M = vmulq_s32(vld1q_s32(p[b].mn[0]), vdupq_n_s32(a->s16[row * 2 * nb + 2 * b]));
                M = vmlaq_s32(M, vld1q_s32(p[b].mn[1]), vdupq_n_s32(a->s16[row * 2 * nb + 2 * b + 1]));
                v[r] = vfmaq_f32(v[r], vcvtq_f32_s32(M), vmulq_f32(vld1q_f32(p[b].m), xd));
            }
        }
    }
}

/* Rows r0 .. r0 + ROWS - 1 against a decoded quad on the K chain into v: per superblock,
 * D (and M) in int32, each 32-block's (half's) dot products times the row's multiple m
 * of the block and the scales, then the plain C's one (two) fused steps, a lane per column. */
static inline GG_TARGET __attribute__((always_inline)) void GG_NAME(rows_k)(const job_t *job, int q6,
                                                                            const int8_t *q, const neon_pk_t *p,
                                                                            int64_t r0, const int ROWS,
                                                                            float32x4_t *v) {
    const acts_t *a = job->a;
    const int64_t k = job->k, supers = k / 256;
    for (int r = 0; r < ROWS; r++) v[r] = vdupq_n_f32(0.0f);
    for (int64_t t = 0; t < supers; t++) {
        int32x4_t D[2] = {vdupq_n_s32(0), vdupq_n_s32(0)}, M[2] = {vdupq_n_s32(0), vdupq_n_s32(0)}, d[4];
        if (q6) {
            for (int h = 0; h < 16; h++) {
                int8x16_t w[4];
                for (int c = 0; c < 4; c++) w[c] = vld1q_s8(q + c * k + t * 256 + 16 * h);
                const int32x4_t sc = vld1q_s32(p[t].sc[h]);
                for (int r = 0; r < ROWS; r++) {
                    const int8x16_t xv = vld1q_s8(a->kq + (r0 + r) * k + t * 256 + 16 * h);
                    const int32_t m = a->km[(r0 + r) * (k / 32) + t * 8 + h / 2];
                    for (int c = 0; c < 4; c++) d[c] = GG_DOT(vdupq_n_s32(0), w[c], xv);
                    D[r] = vmlaq_s32(D[r], sc, vmulq_n_s32(neon_sum_lanes4(d), m));
                }
            }
        } else {
            for (int s = 0; s < 8; s++) {
                int8x16_t wl[4], wh[4];
                for (int c = 0; c < 4; c++) {
                    wl[c] = vld1q_s8(q + c * k + t * 256 + 32 * s);
                    wh[c] = vld1q_s8(q + c * k + t * 256 + 32 * s + 16);
                }
                const int32x4_t sc = vld1q_s32(p[t].sc[s]), mn = vld1q_s32(p[t].mn[s]);
                for (int r = 0; r < ROWS; r++) {
                    const int8_t *x = a->kq + (r0 + r) * k + t * 256 + 32 * s;
                    const int8x16_t xl = vld1q_s8(x), xh = vld1q_s8(x + 16);
                    const int32_t m = a->km[(r0 + r) * (k / 32) + t * 8 + s];
                    for (int c = 0; c < 4; c++) d[c] = GG_DOT(GG_DOT(vdupq_n_s32(0), wl[c], xl), wh[c], xh);
                    D[r] = vmlaq_s32(D[r], sc, vmulq_n_s32(neon_sum_lanes4(d), m));
                    M[r] = vmlaq_s32(M[r], mn, vdupq_n_s32(m * a->ks32[(r0 + r) * (k / 32) + t * 8 + s]));
                }
            }
        }
        for (int r = 0; r < ROWS; r++) {
            const float32x4_t xd = vdupq_n_f32(a->kd[(r0 + r) * supers + t]);
            v[r] = vfmaq_f32(v[r], vcvtq_f32_s32(D[r]), vmulq_f32(vld1q_f32(p[t].d), xd));
            if (!q6) v[r] = vfmaq_f32(v[r], vcvtq_f32_s32(M[r]), vmulq_f32(vld1q_f32(p[t].neg_dmin), xd));
        }
    }
}

/* Every row against a decoded quad, two at a time; the n (<= 4) first lanes stored from
 * column j0. */
static GG_TARGET void GG_NAME(gguf_quad_rows)(const job_t *job, const bargein_qseg_t *seg, const qinfo_t *info,
                                              const int8_t *q, const void *params, int64_t j0, int n) {
    const int k_chain = k_chain_type(seg->type), q6 = seg->type == T_Q6_K;
    const neon_pk_t *pk = (const neon_pk_t *)params;
    const neon_p32_t *p32 = (const neon_p32_t *)params;
    for (int64_t r0 = 0; r0 < job->m; r0 += 2) {
        const int rows = job->m - r0 < 2 ? 1 : 2;
        float32x4_t v[2];
        if (k_chain && rows == 2) GG_NAME(rows_k)(job, q6, q, pk, r0, 2, v);
        else if (k_chain) GG_NAME(rows_k)(job, q6, q, pk, r0, 1, v);
        else if (rows == 2) GG_NAME(rows_32)(job, info->kind, q, p32, r0, 2, v);
        else GG_NAME(rows_32)(job, info->kind, q, p32, r0, 1, v);
        for (int r = 0; r < rows; r++) {
            float lanes[4];
            vst1q_f32(lanes, v[r]);
            for (int c = 0; c < n; c++) job->y[(r0 + r) * job->n + j0 + c] = lanes[c];
        }
    }
}
