/* The many-row int8 matmul on ARM64 with the dot-product extension: a register tile of up
 * to NEON_TILE_ROWS rows by four columns, the ARM64 counterpart of the x86 paths' repacked
 * tiles (quant_matmul.c's gemm_*, gguf_matmul.c's rows_*). Shared by quant_matmul.c (the
 * bundled 4-bit and 8-bit BlockWeights) and gguf_matmul.c (the 32 chain's types whose
 * blocks carry one scale, and a min, per 32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS);
 * each packs its weights (neon_q8_tile.h, neon_gguf_tile.h), then calls neon_tile_rows.
 *
 * Layout. A quad of four columns is packed once per call as signed bytes, 128 per block of
 * 32: tile[128 b + 16 g + 4 c + i] = q_c[32 b + 4 g + i] (g = 0..7, i = 0..3), so one
 * 16-byte vector holds four consecutive quants of each of the four columns. A row's four
 * matching activation bytes are lane g % 4 of its block's first or second sixteen, and one
 * sdot by element (vdotq_laneq_s32) adds their products into each column's int32 lane:
 * eight of them give the block's exact dot product D_b for four columns, with no sums
 * across lanes. Rows share each load of the tile; their accumulators stay in registers.
 * Per block, the block's scales (and mins) of the four columns: neon_tile_params_t.
 *
 * The arithmetic is the plain C's (quant_matmul.c's and gguf_matmul.c's headers), lane by
 * lane: D_b exact in int32 (any order of the integer sums gives it), then
 *   acc = fma((float)D_b, s * d[r, b], acc)      (the product rounded first)
 *   with mins: acc = fma(m, xs[r, b], acc)
 * so the tile gives the plain C's bits for every row count and thread count.
 *
 * Plain NEON (no dot product) keeps the row kernels (neon_q8_body.h, neon_gguf_body.h):
 * without an sdot by element a lane's four products take a broadcast, two widening
 * multiplies and two pairwise accumulations, more instructions per product than the row
 * kernels' sixteen-byte dot products, so a tile would add work, not remove it.
 */
#ifndef BARGEIN_NEON_INT8_TILE_H
#define BARGEIN_NEON_INT8_TILE_H

#include "arm64_simd.h"

#ifdef BARGEIN_DOTPROD

#define NEON_TILE_ROWS 6     /* rows per pass: 4 registers each (int and float sums, activations) */
/* From this many rows on the paths pack tiles. Unmeasured (no ARM64 machine here): a row over
 * the tile takes fewer instructions than over the row kernels, but packing is one more pass
 * over the weights, which one to three rows (decode) do not pay back; bench/bench_arm64.py
 * measures 1, 8, 32 and 128 rows on a real machine. */
#define NEON_TILE_MIN_ROWS 4

/* One block's parameters for the quad's four columns. */
typedef struct {
    float s[4], m[4]; /* scale and min (0 where the type has none) */
} neon_tile_params_t;

/* Where the activations' quantized rows are (both callers' layouts): row r's block b is the
 * sixteen bytes at q + r * row_bytes + (b / 2) * 64 + (b % 2) * odd_step and the sixteen
 * at hi_step past them; d and s (m, nb) the block's scale and d * sum(q). */
typedef struct {
    const int8_t *q;
    int64_t row_bytes;
    int odd_step, hi_step;
    const float *d, *s;
    int64_t nb;
} neon_tile_acts_t;

/* Block b of the quad from its columns' 32 signed quants each (cols[c], c = 0..3) into
 * tile + 128 b: a 4 x 4 transpose of 32-bit words per half. */
static inline void neon_tile_pack_block(int8_t *tile, const int8_t *const cols[4]) {
    for (int half = 0; half < 2; half++) {
        int32x4_t w[4];
        for (int c = 0; c < 4; c++) w[c] = vreinterpretq_s32_s8(vld1q_s8(cols[c] + 16 * half));
        const int32x4_t t0 = vtrn1q_s32(w[0], w[1]), t1 = vtrn2q_s32(w[0], w[1]);
        const int32x4_t t2 = vtrn1q_s32(w[2], w[3]), t3 = vtrn2q_s32(w[2], w[3]);
        int8_t *out = tile + 64 * half;
        vst1q_s8(out, vreinterpretq_s8_s64(vtrn1q_s64(vreinterpretq_s64_s32(t0), vreinterpretq_s64_s32(t2))));
        vst1q_s8(out + 16, vreinterpretq_s8_s64(vtrn1q_s64(vreinterpretq_s64_s32(t1), vreinterpretq_s64_s32(t3))));
        vst1q_s8(out + 32, vreinterpretq_s8_s64(vtrn2q_s64(vreinterpretq_s64_s32(t0), vreinterpretq_s64_s32(t2))));
        vst1q_s8(out + 48, vreinterpretq_s8_s64(vtrn2q_s64(vreinterpretq_s64_s32(t1), vreinterpretq_s64_s32(t3))));
    }
}

/* Rows r0 .. r0 + ROWS - 1 over the whole packed quad into v[r] (a lane per column). */
static inline TARGET_DOTPROD __attribute__((always_inline)) void neon_tile_pass(const neon_tile_acts_t *a,
                                                                               const int8_t *tile,
                                                                               const neon_tile_params_t *p,
                                                                               int with_min, int64_t r0,
                                                                               const int ROWS, float32x4_t *v) {
    const int64_t nb = a->nb;
    for (int r = 0; r < ROWS; r++) v[r] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *wb = tile + 128 * b;
        int8x16_t xl[NEON_TILE_ROWS], xh[NEON_TILE_ROWS];
        int32x4_t D[NEON_TILE_ROWS];
        for (int r = 0; r < ROWS; r++) {
            const int8_t *x = a->q + (r0 + r) * a->row_bytes + (b / 2) * 64 + (b % 2) * a->odd_step;
            xl[r] = vld1q_s8(x), xh[r] = vld1q_s8(x + a->hi_step), D[r] = vdupq_n_s32(0);
        }
#define NEON_TILE_STEP(G, X, LANE)                                                                   \
    {                                                                                                \
        const int8x16_t w = vld1q_s8(wb + 16 * (G));                                                 \
        for (int r = 0; r < ROWS; r++) D[r] = vdotq_laneq_s32(D[r], w, X[r], LANE);                 \
    }
        NEON_TILE_STEP(0, xl, 0) NEON_TILE_STEP(1, xl, 1) NEON_TILE_STEP(2, xl, 2) NEON_TILE_STEP(3, xl, 3)
        NEON_TILE_STEP(4, xh, 0) NEON_TILE_STEP(5, xh, 1) NEON_TILE_STEP(6, xh, 2) NEON_TILE_STEP(7, xh, 3)
#undef NEON_TILE_STEP
        const float32x4_t s = vld1q_f32(p[b].s), m = vld1q_f32(p[b].m);
        for (int r = 0; r < ROWS; r++) {
            const int64_t cell = (r0 + r) * nb + b;
            v[r] = vfmaq_f32(v[r], vcvtq_f32_s32(D[r]), vmulq_f32(s, vdupq_n_f32(a->d[cell])));
            if (with_min) v[r] = vfmaq_f32(v[r], m, vdupq_n_f32(a->s[cell]));
        }
    }
}

/* Every row of a against a packed quad: y[r * ldy + c] for its n (<= 4) first columns. */
static TARGET_DOTPROD void neon_tile_rows(const neon_tile_acts_t *a, int64_t m, const int8_t *tile,
                                          const neon_tile_params_t *p, int with_min, float *y, int64_t ldy,
                                          int n) {
    for (int64_t r0 = 0; r0 < m; r0 += NEON_TILE_ROWS) {
        const int rows = (int)(m - r0 < NEON_TILE_ROWS ? m - r0 : NEON_TILE_ROWS);
        float32x4_t v[NEON_TILE_ROWS];
        switch (rows) {
        case 6: neon_tile_pass(a, tile, p, with_min, r0, 6, v); break;
        case 5: neon_tile_pass(a, tile, p, with_min, r0, 5, v); break;
        case 4: neon_tile_pass(a, tile, p, with_min, r0, 4, v); break;
        case 3: neon_tile_pass(a, tile, p, with_min, r0, 3, v); break;
        case 2: neon_tile_pass(a, tile, p, with_min, r0, 2, v); break;
        default: neon_tile_pass(a, tile, p, with_min, r0, 1, v);
        }
        for (int r = 0; r < rows; r++) {
            float lanes[4];
            vst1q_f32(lanes, v[r]);
            for (int c = 0; c < n; c++) y[(r0 + r) * ldy + c] = lanes[c];
        }
    }
}

#endif /* BARGEIN_DOTPROD */

#endif
