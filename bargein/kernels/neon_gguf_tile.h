/* gguf_matmul.c's many-row path on ARM64 with sdot for the 32 chain's types whose blocks
 * carry one scale (and a min) per 32 quants: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and
 * IQ4_XS. A tile's columns are packed quad by quad into neon_int8_tile.h's layout (the
 * quants decoded by neon_gguf_matmul.h's NEON decoders, the scales by the plain C's), then
 * every row passes over the quad in register tiles. The K chain and the split-scale types
 * (Q2_K, Q3_K) keep neon_gguf_matmul.h's quad row kernels. Included by gguf_matmul.c after
 * neon_gguf_matmul.h. */
#ifndef BARGEIN_NEON_GGUF_TILE_H
#define BARGEIN_NEON_GGUF_TILE_H

#include "neon_int8_tile.h"

#ifdef BARGEIN_DOTPROD

/* Whether seg's columns take the tile on this job (sdot, enough rows, a type it covers). */
static inline int neon_gguf_tiled(const job_t *job, const bargein_qseg_t *seg, const qinfo_t *info) {
    return job->isa == ISA_DOTPROD && job->m >= NEON_TILE_MIN_ROWS && !job->a->exact && !k_chain_type(seg->type) &&
           (info->kind == KIND_PLAIN || info->kind == KIND_MIN);
}

/* The quad of columns col0 .. col0 + 3 of seg (past its rows: the last row again) into
 * tile (128 bytes per 32-block) and p (per 32-block). */
static void neon_gguf_tile_pack(const job_t *job, const bargein_qseg_t *seg, const qinfo_t *info, int64_t col0,
                                int8_t *tile, neon_tile_params_t *p) {
    const int type = (int)seg->type, subs = info->qk / 32;
    int8_t q[4][256];
    const uint8_t *rows[4];
    for (int c = 0; c < 4; c++) rows[c] = column_row(seg, col0 + c < seg->rows ? col0 + c : seg->rows - 1);
    for (int64_t t = 0; t < job->k / info->qk; t++) {
        for (int c = 0; c < 4; c++) {
            const uint8_t *blk = rows[c] + t * info->bytes;
            dblock_t o;
            gguf_params_c(type, blk, &o);
            for (int sb = 0; sb < subs; sb++) {
                p[t * subs + sb].s[c] = o.s[sb];
                p[t * subs + sb].m[c] = info->kind == KIND_MIN ? o.m[sb] : 0.0f;
            }
            if (neon_quants(type, blk, q[c])) continue;
            gguf_quants_c(type, blk, o.u);
            for (int i = 0; i < info->qk; i++) q[c][i] = (int8_t)((int)o.u[i] - info->off);
        }
        for (int sb = 0; sb < subs; sb++) {
            const int8_t *const cols[4] = {q[0] + 32 * sb, q[1] + 32 * sb, q[2] + 32 * sb, q[3] + 32 * sb};
            neon_tile_pack_block(tile + 128 * (t * subs + sb), cols);
        }
    }
}

/* A tile's cols columns from col0 of seg (output columns from j0), every row; scratch:
 * neon_gguf_scratch_bytes(k), of which this takes 5 k bytes. */
static void neon_gguf_tile_columns(const job_t *job, const bargein_qseg_t *seg, const qinfo_t *info, int64_t col0,
                                   int64_t j0, int cols, uint8_t *scratch) {
    const acts_t *a = job->a;
    int8_t *tile = (int8_t *)scratch;
    neon_tile_params_t *p = (neon_tile_params_t *)(scratch + 128 * job->nb);
    const neon_tile_acts_t acts = {a->q, job->k, 32, 16, a->d, a->s, job->nb};
    for (int c0 = 0; c0 < cols; c0 += 4) {
        neon_gguf_tile_pack(job, seg, info, col0 + c0, tile, p);
        neon_tile_rows(&acts, job->m, tile, p, info->kind == KIND_MIN, job->y + j0 + c0, job->n,
                       cols - c0 < 4 ? cols - c0 : 4);
    }
}

#else
static inline int neon_gguf_tiled(const job_t *job, const bargein_qseg_t *seg, const qinfo_t *info) {
    (void)job, (void)seg, (void)info;
    return 0;
}
static inline void neon_gguf_tile_columns(const job_t *job, const bargein_qseg_t *seg, const qinfo_t *info,
                                          int64_t col0, int64_t j0, int cols, uint8_t *scratch) {
    (void)job, (void)seg, (void)info, (void)col0, (void)j0, (void)cols, (void)scratch;
}
#endif /* BARGEIN_DOTPROD */

#endif
