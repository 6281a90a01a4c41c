/* quant_matmul.c's many-row path on ARM64 with sdot: the bundled 4-bit (scale and min)
 * and 8-bit (scale) BlockWeights packed quad by quad into neon_int8_tile.h's tile. Included
 * by quant_matmul.c after neon_q8_matmul.h, where qjob_t and the activations' layout are
 * defined; used from NEON_TILE_MIN_ROWS rows on (run_t's neon_tile). */
#ifndef BARGEIN_NEON_Q8_TILE_H
#define BARGEIN_NEON_Q8_TILE_H

#include "neon_int8_tile.h"

#ifdef BARGEIN_DOTPROD

/* Scratch one thread needs (bytes): a packed quad and its parameters. */
static inline int64_t neon_q8_tile_bytes(int64_t nb) { return 128 * nb + (int64_t)sizeof(neon_tile_params_t) * nb; }

/* The quad of columns j0 .. j0 + 3 (past n: the last column again) into tile and p. */
static void neon_q8_tile_pack(const qjob_t *job, int64_t j0, int8_t *tile, neon_tile_params_t *p) {
    const int64_t nb = job->nb;
    int8_t q[4][BLOCK];
    const int8_t *const cols[4] = {q[0], q[1], q[2], q[3]};
    for (int64_t b = 0; b < nb; b++) {
        for (int c = 0; c < 4; c++) {
            const int64_t j = j0 + c < job->n ? j0 + c : job->n - 1;
            if (job->bits == 4) { /* byte i: quant i in its low nibble, quant i + 16 in its high */
                const uint8x16_t packed = vld1q_u8(job->qs + (j * nb + b) * (BLOCK / 2));
                vst1q_s8(q[c], vreinterpretq_s8_u8(vandq_u8(packed, vdupq_n_u8(0x0F))));
                vst1q_s8(q[c] + 16, vreinterpretq_s8_u8(vshrq_n_u8(packed, 4)));
            } else {
                memcpy(q[c], job->qs + (j * nb + b) * BLOCK, BLOCK);
            }
            p[b].s[c] = job->scales[j * nb + b];
            p[b].m[c] = job->mins ? job->mins[j * nb + b] : 0.0f;
        }
        neon_tile_pack_block(tile + 128 * b, cols);
    }
}

/* Output columns [j_begin, j_end), every row, quad by quad; scratch: neon_q8_tile_bytes. */
static void neon_q8_tile_columns(const qjob_t *job, int64_t j_begin, int64_t j_end, uint8_t *scratch) {
    int8_t *tile = (int8_t *)scratch;
    neon_tile_params_t *p = (neon_tile_params_t *)(scratch + 128 * job->nb);
    const neon_tile_acts_t acts = {job->xq, job->pairs * PAIR_BYTES, BLOCK / 2, BLOCK, job->xd, job->xs, job->nb};
    for (int64_t j0 = j_begin; j0 < j_end; j0 += 4) {
        neon_q8_tile_pack(job, j0, tile, p);
        neon_tile_rows(&acts, job->m, tile, p, job->bits == 4, job->y + j0, job->n, (int)(j_end - j0 < 4 ? j_end - j0 : 4));
    }
}

#endif /* BARGEIN_DOTPROD */

#endif
