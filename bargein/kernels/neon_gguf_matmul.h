/* gguf_matmul.c's `fast` ARM64 paths: NEON, and NEON with the dot-product extension
 * (sdot), chosen at run time (isa 3 and 4; see neon_q8_matmul.h). Included by
 * gguf_matmul.c after its plain C, where job_t, acts_t and the chains are defined.
 *
 * A tile's columns go four at a time, one to a float lane. Each quad is decoded once per
 * call into scratch (the quants by NEON, every type; the scales by the plain-C decoder):
 * the quants as signed bytes q = u - off (every type's fit in int8), the per-32 (32 chain)
 * or per-superblock (K chain) parameters block-major, four columns to a vector. Then each row passes over the quad: per 32-block
 * (per superblock) the exact int32 dot products (sixteen-byte dot products summed across
 * lanes by pairwise adds; integers, so any order gives the plain C's), and per lane the
 * plain C's float steps in its order (gguf_matmul.c's header): the same bits on every path. */
#ifndef BARGEIN_NEON_GGUF_MATMUL_H
#define BARGEIN_NEON_GGUF_MATMUL_H

#include "arm64_simd.h"

/* A quad's decoded parameters, block-major, one column to a lane. */
typedef struct {
    float s[4], m[4];                  /* per 32-block */
    int32_t sc[2][4], mn[2][4];        /* per half (sc = 1, mn = 0 where the type has none) */
} neon_p32_t;
typedef struct {
    float d[4], neg_dmin[4];           /* per superblock */
    int32_t sc[16][4], mn[8][4];       /* Q6_K: sc per 16; Q4_K, Q5_K: sc and mn per 32 */
} neon_pk_t;

/* Scratch one thread needs for a quad of columns of length k. */
static inline int64_t neon_gguf_scratch_bytes(int64_t k) {
    return 4 * k + (int64_t)sizeof(neon_p32_t) * (k / 32) + (int64_t)sizeof(neon_pk_t) * (k / 256 + 1) + 64;
}

/* Sixteen bytes' low and high nibbles, as signed bytes less off. */
static inline void neon_nibbles(const uint8_t *qs, int8_t off, int8_t *lo, int8_t *hi) {
    const uint8x16_t v = vld1q_u8(qs);
    vst1q_s8(lo, vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))), vdupq_n_s8(off)));
    vst1q_s8(hi, vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), vdupq_n_s8(off)));
}

/* Sixteen bytes' nibbles through the IQ4 value table (the values are q = u - 128). */
static inline void neon_iq4_nibbles(const uint8_t *qs, int8_t *lo, int8_t *hi) {
    const int8x16_t table = vld1q_s8(KVALUES_IQ4NL);
    const uint8x16_t v = vld1q_u8(qs);
    vst1q_s8(lo, vqtbl1q_s8(table, vandq_u8(v, vdupq_n_u8(0x0F))));
    vst1q_s8(hi, vqtbl1q_s8(table, vshrq_n_u8(v, 4)));
}

/* The fifth bit (0x10) of 32 quants from the 32 bits at qh4 (bit i for quant i, as
 * high_bits32), or-ed into lo (quants 0..15) and hi (16..31), then less off. */
static inline void neon_high_bits32(const uint8_t *qh4, int8_t off, int8_t *lo, int8_t *hi) {
    uint32_t qh;
    memcpy(&qh, qh4, 4);
    static const uint8_t lane_bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    static const uint8_t lo_byte[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
    const uint8x16_t bits = vld1q_u8(lane_bit), five = vdupq_n_u8(0x10);
    const uint8x16_t bytes = vcombine_u8(vcreate_u8((uint64_t)qh), vcreate_u8(0));
    const uint8x16_t lo_idx = vld1q_u8(lo_byte), hi_idx = vaddq_u8(lo_idx, vdupq_n_u8(2));
    const uint8x16_t lo_set = vandq_u8(vtstq_u8(vqtbl1q_u8(bytes, lo_idx), bits), five);
    const uint8x16_t hi_set = vandq_u8(vtstq_u8(vqtbl1q_u8(bytes, hi_idx), bits), five);
    vst1q_s8(lo, vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vreinterpretq_u8_s8(vld1q_s8(lo)), lo_set)), vdupq_n_s8(off)));
    vst1q_s8(hi, vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vreinterpretq_u8_s8(vld1q_s8(hi)), hi_set)), vdupq_n_s8(off)));
}

/* Q5_K's 256 quants: Q4_K's nibbles with bit j of qh[l] as the fifth bit of quant 32 j + l. */
static inline void neon_q5_k_quants(const uint8_t *b, int8_t *q) {
    const uint8x16_t five = vdupq_n_u8(0x10);
    for (int g = 0; g < 4; g++)
        for (int h = 0; h < 2; h++) {
            const uint8x16_t v = vld1q_u8(b + 48 + 32 * g + 16 * h), qh = vld1q_u8(b + 16 + 16 * h);
            const uint8x16_t lo = vorrq_u8(vandq_u8(v, vdupq_n_u8(0x0F)),
                                           vandq_u8(vtstq_u8(qh, vdupq_n_u8((uint8_t)(1u << (2 * g)))), five));
            const uint8x16_t hi = vorrq_u8(vshrq_n_u8(v, 4),
                                           vandq_u8(vtstq_u8(qh, vdupq_n_u8((uint8_t)(1u << (2 * g + 1)))), five));
            vst1q_s8(q + 64 * g + 16 * h, vreinterpretq_s8_u8(lo));
            vst1q_s8(q + 64 * g + 32 + 16 * h, vreinterpretq_s8_u8(hi));
        }
}

/* Q2_K's (hmask 0) and Q3_K's (hmask = the block) 256 quants: quant 128 h + 32 s + l is bits
 * 2s of qs[32 h + l], and for Q3_K 4 more where bit 4 h + s of hmask[l] is set, less 4. */
static inline void neon_q23_k_quants(const uint8_t *qs, const uint8_t *hmask, int8_t *q) {
    const uint8x16_t three = vdupq_n_u8(3), four = vdupq_n_u8(4);
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l += 16) {
            uint8x16_t v = vld1q_u8(qs + 32 * h + l);
            for (int s = 0; s < 4; s++, v = vshrq_n_u8(v, 2)) {
                uint8x16_t u = vandq_u8(v, three);
                if (hmask) {
                    const uint8x16_t bit = vdupq_n_u8((uint8_t)(1u << (4 * h + s)));
                    u = vsubq_u8(vorrq_u8(u, vandq_u8(vtstq_u8(vld1q_u8(hmask + l), bit), four)), four);
                }
                vst1q_s8(q + 128 * h + 32 * s + l, vreinterpretq_s8_u8(u));
            }
        }
}

/* A block's quants as signed bytes q = u - off (gguf_quants_c's values, in its order),
 * with NEON for the common types; 0 for the others (the caller decodes them in C). */
static inline int neon_quants(int type, const uint8_t *b, int8_t *q) {
    switch (type) {
    case T_Q4_0: neon_nibbles(b + 2, 8, q, q + 16); return 1;
    case T_Q4_1: neon_nibbles(b + 4, 0, q, q + 16); return 1;
    case T_Q5_0: neon_nibbles(b + 6, 0, q, q + 16), neon_high_bits32(b + 2, 16, q, q + 16); return 1;
    case T_Q5_1: neon_nibbles(b + 8, 0, q, q + 16), neon_high_bits32(b + 4, 0, q, q + 16); return 1;
    case T_Q5_K: neon_q5_k_quants(b, q); return 1;
    case T_Q2_K: neon_q23_k_quants(b + 16, NULL, q); return 1;
    case T_Q3_K: neon_q23_k_quants(b + 32, b, q); return 1;
    case T_Q8_0: memcpy(q, b + 2, 32); return 1;
    case T_IQ4_NL: neon_iq4_nibbles(b + 2, q, q + 16); return 1;
    case T_IQ4_XS:
        for (int i = 0; i < 8; i++) neon_iq4_nibbles(b + 8 + 16 * i, q + 32 * i, q + 32 * i + 16);
        return 1;
    case T_Q4_K:
        for (int g = 0; g < 4; g++)
            for (int h = 0; h < 2; h++) neon_nibbles(b + 16 + 32 * g + 16 * h, 0, q + 64 * g + 16 * h, q + 64 * g + 32 + 16 * h);
        return 1;
    case T_Q6_K: /* value 128 h + 32 s + l from ql's nibbles and qh's bit pairs, less 32 */
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l += 16) {
                const uint8x16_t a = vld1q_u8(b + 64 * h + l), c = vld1q_u8(b + 64 * h + 32 + l);
                const uint8x16_t hb = vld1q_u8(b + 128 + 32 * h + l), low4 = vdupq_n_u8(0x0F), two = vdupq_n_u8(0x30);
                const uint8x16_t u[4] = {vorrq_u8(vandq_u8(a, low4), vandq_u8(vshlq_n_u8(hb, 4), two)),
                                         vorrq_u8(vandq_u8(c, low4), vandq_u8(vshlq_n_u8(hb, 2), two)),
                                         vorrq_u8(vshrq_n_u8(a, 4), vandq_u8(hb, two)),
                                         vorrq_u8(vshrq_n_u8(c, 4), vandq_u8(vshrq_n_u8(hb, 2), two))};
                for (int s = 0; s < 4; s++)
                    vst1q_s8(q + 128 * h + 32 * s + l, vsubq_s8(vreinterpretq_s8_u8(u[s]), vdupq_n_s8(32)));
            }
        return 1;
    }
    return 0;
}

/* The quad of columns col0 .. col0 + 3 of seg (past its rows: the last row again) into
 * scratch: q (4, k) signed quants, then the parameters (p32 or pk by the chain). */
static void neon_gguf_decode_quad(const job_t *job, const bargein_qseg_t *seg, const qinfo_t *info, int64_t col0,
                                  int8_t *q, void *params) {
    const int64_t k = job->k, blocks = k / info->qk;
    const int type = (int)seg->type, subs = info->qk / 32;
    neon_p32_t *p32 = (neon_p32_t *)params;
    neon_pk_t *pk = (neon_pk_t *)params;
    for (int c = 0; c < 4; c++) {
        const uint8_t *row = column_row(seg, col0 + c < seg->rows ? col0 + c : seg->rows - 1);
        for (int64_t t = 0; t < blocks; t++) {
            const uint8_t *blk = row + t * info->bytes;
            dblock_t o;
            if (k_chain_type(type)) {
                int32_t sc[16], mn[8];
                k_chain_params_c(type, blk, &pk[t].d[c], &pk[t].neg_dmin[c], sc, mn);
                for (int i = 0; i < 16; i++) pk[t].sc[i][c] = type == T_Q6_K || i < 8 ? sc[i] : 0;
                for (int i = 0; i < 8; i++) pk[t].mn[i][c] = type == T_Q6_K ? 0 : mn[i];
            } else {
                gguf_params_c(type, blk, &o);
                for (int sb = 0; sb < subs; sb++) {
                    neon_p32_t *p = &p32[t * subs + sb];
                    p->s[c] = o.s[sb], p->m[c] = o.m[sb];
                    for (int h = 0; h < 2; h++) p->sc[h][c] = o.sc[2 * sb + h], p->mn[h][c] = o.mn[2 * sb + h];
                }
            }
            int8_t *qb = q + c * k + t * info->qk;
            if (neon_quants(type, blk, qb)) continue;
            gguf_quants_c(type, blk, o.u);
            for (int i = 0; i < info->qk; i++) qb[i] = (int8_t)((int)o.u[i] - info->off);
        }
    }
}

/* quantize_rows on NEON for `fast` (not exact): the same bytes, scales and sums. */
static void neon_gguf_quantize_rows(void *arg, int index, int count) {
    const acts_t *a = (const acts_t *)arg;
    const int64_t k = a->k, nb = a->nb;
    for (int64_t r = a->m * index / count; r < a->m * (index + 1) / count; r++) {
        for (int64_t t = 0; a->kq && t < k / 256; t++) { /* the K chain: quantize_superblock_c's values */
            const float *x = a->x + r * k + t * 256;
            float amax = 0.0f, amax32[8];
            for (int j = 0; j < 8; j++) amax32[j] = neon_amax(x + 32 * j, 32), amax = fmaxf(amax, amax32[j]);
            for (int j = 0; j < 8; j++) {
                const int m = k_chain_multiple(amax32[j], amax, a->k_flat);
                const float step = k_chain_step(amax, m, a->k_flat), inv = step > 0.0f ? 1.0f / step : 0.0f;
                int32_t s16[2];
                neon_quantize_by(x + 32 * j, 32, inv, a->kq + r * k + t * 256 + 32 * j, s16);
                a->km[r * (k / 32) + t * 8 + j] = (int16_t)m;
                a->ks16[r * (k / 16) + t * 16 + 2 * j] = (int16_t)s16[0];
                a->ks16[r * (k / 16) + t * 16 + 2 * j + 1] = (int16_t)s16[1];
                a->ks32[r * (k / 32) + t * 8 + j] = (int16_t)(s16[0] + s16[1]);
            }
            a->kd[r * (k / 256) + t] = k_chain_unit(amax, a->k_flat);
        }
        for (int64_t b = 0; a->q && b < nb; b++) {
            int32_t s16[2];
            const float d = neon_quantize(a->x + r * k + b * 32, 32, a->q + r * k + b * 32, s16);
            a->d[r * nb + b] = d;
            a->s[r * nb + b] = d * (float)(s16[0] + s16[1]);
            a->s16[r * 2 * nb + 2 * b] = s16[0], a->s16[r * 2 * nb + 2 * b + 1] = s16[1];
        }
    }
}

#define GG_DOT dot16_neon
#define GG_NAME(name) name##_neon
#define GG_TARGET
#include "neon_gguf_body.h"
#undef GG_DOT
#undef GG_NAME
#undef GG_TARGET

#ifdef BARGEIN_DOTPROD
#define GG_DOT vdotq_s32
#define GG_NAME(name) name##_dotprod
#define GG_TARGET TARGET_DOTPROD
#include "neon_gguf_body.h"
#undef GG_DOT
#undef GG_NAME
#undef GG_TARGET
#endif

/* A tile's cols columns from col0 of seg (output columns from j0), every row, on the
 * job's ARM64 path; scratch: neon_gguf_scratch_bytes(k). */
static void neon_gguf_tile(const job_t *job, const bargein_qseg_t *seg, const qinfo_t *info, int64_t col0,
                           int64_t j0, int cols, uint8_t *scratch) {
    int8_t *q = (int8_t *)scratch;
    void *params = scratch + ((4 * job->k + 63) / 64) * 64;
    for (int c0 = 0; c0 < cols; c0 += 4) {
        const int n = cols - c0 < 4 ? cols - c0 : 4;
        neon_gguf_decode_quad(job, seg, info, col0 + c0, q, params);
#ifdef BARGEIN_DOTPROD
        if (job->isa == ISA_DOTPROD) {
            gguf_quad_rows_dotprod(job, seg, info, q, params, j0 + c0, n);
            continue;
        }
#endif
        gguf_quad_rows_neon(job, seg, info, q, params, j0 + c0, n);
    }
}

#endif
