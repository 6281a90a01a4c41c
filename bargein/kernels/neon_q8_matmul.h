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
