/* quant_matmul.c's ARM64 paths: NEON, and NEON with the dot-product extension (sdot),
 * chosen at run time (isa 3 and 4). Included by quant_matmul.c after its plain C, where
 * qjob_t and the activations' layout (pairs of blocks, PAIR_BYTES) are defined.
 *
 * The arithmetic is the header's: four output columns go one to a float lane; per block,
 * each column's exact int32 dot product D_b (sixteen-byte dot products, summed across the
 * lanes by pairwise adds: any order gives the same integer), then per lane
 * acc = fma((float)D_b, scale * d, acc) and, 4-bit, acc = fma(min, xs, acc): the plain C
 * steps, in its order, so every path gives the same bits. A group's scales and mins are
 * gathered once into block-major panels; two rows share each unpacked weight block. */
#ifndef BARGEIN_NEON_Q8_MATMUL_H
#define BARGEIN_NEON_Q8_MATMUL_H

#include "arm64_simd.h"

#define ROWS_NEON 2

/* panels[16 b + 8 quad + (0..3 scales, 4..7 mins)] for the eight columns from j0 (columns
 * past n repeat the last; their lanes are never stored). */
static void neon_q8_panels(const qjob_t *job, int64_t j0, float *panels) {
    for (int c = 0; c < GROUP; c++) {
        const int64_t j = j0 + c < job->n ? j0 + c : job->n - 1;
        for (int64_t b = 0; b < job->nb; b++) {
            panels[16 * b + 8 * (c / 4) + c % 4] = job->scales[j * job->nb + b];
            panels[16 * b + 8 * (c / 4) + 4 + c % 4] = job->mins ? job->mins[j * job->nb + b] : 0.0f;
        }
    }
}

/* quantize_rows on NEON: the same bytes, scales and sums (neon_quantize). */
static void neon_q8_quantize_rows(void *arg, int index, int count) {
    const quant_job_t *job = (const quant_job_t *)arg;
    const int64_t nb = job->nb;
    for (int64_t r = job->m * index / count; r < job->m * (index + 1) / count; r++) {
        int8_t *row = job->xq + r * job->pairs * PAIR_BYTES;
        for (int64_t b = 0; b < nb; b++) {
            int8_t q[BLOCK], *lo = row + (b / 2) * PAIR_BYTES + (b % 2) * (BLOCK / 2);
            int32_t sums[2];
            const float d = neon_quantize(job->x + r * job->k + b * BLOCK, BLOCK, q, sums);
            memcpy(lo, q, BLOCK / 2);
            memcpy(lo + BLOCK, q + BLOCK / 2, BLOCK / 2);
            job->xd[r * nb + b] = d;
            job->xs[r * nb + b] = d * (float)(sums[0] + sums[1]);
            job->xc[r * nb + b] = 128 * (sums[0] + sums[1]);
        }
        if (nb % 2) { /* the last pair's missing block: zeros, as quantize_rows writes */
            memset(row + (nb / 2) * PAIR_BYTES + BLOCK / 2, 0, BLOCK / 2);
            memset(row + (nb / 2) * PAIR_BYTES + BLOCK + BLOCK / 2, 0, BLOCK / 2);
        }
    }
}

#define Q8_DOT dot16_neon
#define Q8_NAME(name) name##_neon
#define Q8_TARGET
#include "neon_q8_body.h"
#undef Q8_DOT
#undef Q8_NAME
#undef Q8_TARGET

#ifdef BARGEIN_DOTPROD
#define Q8_DOT vdotq_s32
#define Q8_NAME(name) name##_dotprod
#define Q8_TARGET TARGET_DOTPROD
#include "neon_q8_body.h"
#undef Q8_DOT
#undef Q8_NAME
#undef Q8_TARGET
#endif

#endif
