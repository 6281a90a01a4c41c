/* One ARM64 body of gguf_matmul.c's `fast` matmul, included by neon_gguf_matmul.h once
 * per instruction set: GG_DOT(acc, a, b) adds the four-lane int32 dot products of sixteen
 * signed bytes, GG_NAME names this copy's functions, GG_TARGET is their target. */

/* Row r against a decoded quad on the 32 chain: the plain C's steps, a lane per column. */
static inline GG_TARGET __attribute__((always_inline)) float32x4_t GG_NAME(row_32)(const job_t *job, int kind,
                                                                                   const int8_t *q,
                                                                                   const neon_p32_t *p, int64_t r) {
    const acts_t *a = job->a;
    const int64_t k = job->k, nb = job->nb;
    float32x4_t v = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        const int8x16_t xl = vld1q_s8(a->q + r * k + 32 * b), xh = vld1q_s8(a->q + r * k + 32 * b + 16);
        int32x4_t dl[4], dh[4];
        for (int c = 0; c < 4; c++) {
            dl[c] = GG_DOT(vdupq_n_s32(0), vld1q_s8(q + c * k + 32 * b), xl);
            dh[c] = GG_DOT(vdupq_n_s32(0), vld1q_s8(q + c * k + 32 * b + 16), xh);
        }
        int32x4_t D;
        if (kind >= KIND_SPLIT) {
            D = vmulq_s32(vld1q_s32(p[b].sc[0]), neon_sum_lanes4(dl));
            D = vmlaq_s32(D, vld1q_s32(p[b].sc[1]), neon_sum_lanes4(dh));
        } else {
            for (int c = 0; c < 4; c++) dl[c] = vaddq_s32(dl[c], dh[c]);
            D = neon_sum_lanes4(dl);
        }
        const float32x4_t xd = vdupq_n_f32(a->d[r * nb + b]);
        v = vfmaq_f32(v, vcvtq_f32_s32(D), vmulq_f32(vld1q_f32(p[b].s), xd));
        if (kind == KIND_MIN) v = vfmaq_f32(v, vld1q_f32(p[b].m), vdupq_n_f32(a->s[r * nb + b]));
        if (kind == KIND_SPLIT_MIN) {
            int32x4_t M = vmulq_s32(vld1q_s32(p[b].mn[0]), vdupq_n_s32(a->s16[r * 2 * nb + 2 * b]));
            M = vmlaq_s32(M, vld1q_s32(p[b].mn[1]), vdupq_n_s32(a->s16[r * 2 * nb + 2 * b + 1]));
            v = vfmaq_f32(v, vcvtq_f32_s32(M), vmulq_f32(vld1q_f32(p[b].m), xd));
        }
    }
    return v;
}

/* Row r against a decoded quad on the K chain: per superblock, D (and M) in int32, then
 * the plain C's one (two) fused steps, a lane per column. */
static inline GG_TARGET __attribute__((always_inline)) float32x4_t GG_NAME(row_k)(const job_t *job, int q6,
                                                                                  const int8_t *q,
                                                                                  const neon_pk_t *p, int64_t r) {
    const acts_t *a = job->a;
    const int64_t k = job->k, supers = k / 256;
    float32x4_t v = vdupq_n_f32(0.0f);
    for (int64_t t = 0; t < supers; t++) {
        const int8_t *x = a->kq + r * k + t * 256;
        int32x4_t D = vdupq_n_s32(0), M = vdupq_n_s32(0), d[4];
        if (q6) {
            for (int h = 0; h < 16; h++) {
                const int8x16_t xv = vld1q_s8(x + 16 * h);
                for (int c = 0; c < 4; c++) d[c] = GG_DOT(vdupq_n_s32(0), vld1q_s8(q + c * k + t * 256 + 16 * h), xv);
                D = vmlaq_s32(D, vld1q_s32(p[t].sc[h]), neon_sum_lanes4(d));
            }
        } else {
            for (int s = 0; s < 8; s++) {
                const int8x16_t xl = vld1q_s8(x + 32 * s), xh = vld1q_s8(x + 32 * s + 16);
                for (int c = 0; c < 4; c++) {
                    const int8_t *w = q + c * k + t * 256 + 32 * s;
                    d[c] = GG_DOT(GG_DOT(vdupq_n_s32(0), vld1q_s8(w), xl), vld1q_s8(w + 16), xh);
                }
                D = vmlaq_s32(D, vld1q_s32(p[t].sc[s]), neon_sum_lanes4(d));
                M = vmlaq_s32(M, vld1q_s32(p[t].mn[s]), vdupq_n_s32(a->ks32[r * (k / 32) + t * 8 + s]));
            }
        }
        const float32x4_t xd = vdupq_n_f32(a->kd[r * supers + t]);
        v = vfmaq_f32(v, vcvtq_f32_s32(D), vmulq_f32(vld1q_f32(p[t].d), xd));
        if (!q6) v = vfmaq_f32(v, vcvtq_f32_s32(M), vmulq_f32(vld1q_f32(p[t].neg_dmin), xd));
    }
    return v;
}

/* Every row against a decoded quad; the n (<= 4) first lanes stored from column j0. */
static GG_TARGET void GG_NAME(gguf_quad_rows)(const job_t *job, const bargein_qseg_t *seg, const qinfo_t *info,
                                              const int8_t *q, const void *params, int64_t j0, int n) {
    const int k_chain = k_chain_type(seg->type), q6 = seg->type == T_Q6_K;
    for (int64_t r = 0; r < job->m; r++) {
        float lanes[4];
        if (k_chain) vst1q_f32(lanes, GG_NAME(row_k)(job, q6, q, (const neon_pk_t *)params, r));
        else vst1q_f32(lanes, GG_NAME(row_32)(job, info->kind, q, (const neon_p32_t *)params, r));
        for (int c = 0; c < n; c++) job->y[r * job->n + j0 + c] = lanes[c];
    }
}
