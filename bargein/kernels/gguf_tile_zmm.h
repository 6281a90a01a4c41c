/* gguf_matmul.c's many-row tile pass of the K chain (Q4_K, Q5_K, Q6_K) on AVX-512 VNNI
 * with 512-bit registers: the whole tile of 16 columns in one register (lane c = column
 * c), so one weight load and one vpdpbusd serve 16 columns of a row, up to 8 rows share
 * each load, and the per-block integer scaling (vpmulld by the scales, and for Q6_K by the
 * row's multiple m) runs once per 16 columns instead of once per 8. The steps are the 256-bit
 * pass's, per lane and in the same order, so the bits are the other paths' (and plain
 * C's): the integer sums are exact, and each lane's float steps are the same operations
 * on the same operands. The 32 chain's pass (rows_zmm32, at the end) is the 256-bit pass's
 * (TILE_ROWS_BODY) on 16 lanes the same way: on the 2-core Zen 4 it measured no faster than
 * the 256-bit one (same-run A/B, 2026-12-02: that core splits a 512-bit vpdpbusd in two);
 * on a Zen 5, whose vector units are 512 bits wide, 0.63-0.76x its time at 32 and 512 rows
 * for every 32-chain type (bench/gemm_tile_ab.c, one thread, 2026-12-07).
 *
 * The first pass over a tile also fetches the next tile's blocks into L2 (tile_ahead's
 * plans, a part per superblock): on weights that stream from memory, as in a decode step
 * of a 1B model, the next build_tile otherwise waits on 16 columns of demand misses
 * (bench/gemm_tile_ab.c, 32 rows, Q4_K: 0.76-0.91x the time without it).
 *
 * The tile's layout (tile_t: tile[(b * 8 + g) * 2 + v] 32-byte vectors, v = 0 columns
 * 0-7, v = 1 columns 8-15) puts a group's 16 columns in 64 consecutive bytes, so a
 * 512-bit load reads them in lane order; scratch is 64-byte aligned (aligned_alloc, a
 * per-thread size rounded to 64, the tile first). The panels hold 16 columns per block
 * contiguously (index * TILE + c) and load the same way.
 *
 * Included by gguf_matmul.c inside its GGUF_VNNI section (needs acts_t, job_t, tile_t,
 * ahead_t, qinfo_t, prefetch_step, signed_tile, TILE and TARGET_VNNI). */
#ifndef BARGEIN_GGUF_TILE_ZMM_H
#define BARGEIN_GGUF_TILE_ZMM_H

#define ZMM_ROWS_K 8 /* rows per pass: dk, dlo (Q6_K: and dhi) per row in registers, acc in memory */
/* the 32 chain's rows per pass: acc and dlo (split kinds: and dhi) in registers (Zen 5, one
 * thread, against 8: 12 rows 1.03-1.10x the time, 6 rows 0.97-1.07x) */
#ifndef ZMM_ROWS_32
#define ZMM_ROWS_32 8
#endif

/* acc + the byte dot products of w's 16 lanes with the four signed bytes at x, broadcast
 * as the instruction's own memory operand ({1to16}): GCC otherwise broadcasts them with a
 * vpbroadcastd of its own, one per vpdpbusd. */
static inline TARGET_VNNI __attribute__((always_inline)) __m512i dpbusd_bcst(__m512i acc, __m512i w, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)x));
    return acc;
}

/* acc + the int16 pair products of mn's 16 lanes with the pair at p, broadcast as the
 * instruction's memory operand (as dpbusd_bcst). */
static inline TARGET_VNNI __attribute__((always_inline)) __m512i dpwssd_bcst(__m512i acc, __m512i mn, const int16_t *p) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(mn), "m"(*(const int32_t *)p));
    return acc;
}

/* Writes a row's 16 lanes, the first `cols` of them, to y[row, j0 ..]. */
static inline TARGET_VNNI __attribute__((always_inline)) void zmm_store_row(const job_t *job, int64_t row, int64_t j0,
                                                                             int cols, __m512 v) {
    float *out = job->y + row * job->n + j0;
    if (cols == TILE) _mm512_storeu_ps(out, v);
    else _mm512_mask_storeu_ps(out, (__mmask16)((1u << cols) - 1), v);
}

/* zmm_superblock_floats' steps for row r: acc += dk * (d * xd) (superblock 0: acc = 0 +
 * dk * (d * xd), acc unread), and with mins (MIN) the
 * mins' sum of mn * S32 over the eight 32-blocks (the activations are flat: m_j = 1), as
 * int16 pairs (the 256-bit pass's exact int32 per lane), times nm * xd. mn: the mins'
 * four vectors, or NULL to read them from the panel pmn here. */
static inline TARGET_VNNI __attribute__((always_inline)) void zmm_superblock_row(const acts_t *a, const int32_t *pmn,
                                                                                  int64_t r, int64_t t, const int MIN,
                                                                                  __m512 d, __m512 nm,
                                                                                  const __m512i *mn, __m512i dk,
                                                                                  float *acc) {
    const int64_t k = a->k;
    const __m512 xd = _mm512_set1_ps(a->kd[r * (k / 256) + t]);
    /* the first superblock starts from zero rather than from a zeroed acc: GCC wrote that
     * zeroing as 256-bit stores, and a 512-bit load of two stores cannot take their data by
     * store forwarding (perf put 8% of a VNNI prefill's pass samples just after that load;
     * bench/gemm_tile_ab.c at 512 rows: 0.948-0.956x the VNNI pass's time for Q4_K and
     * Q5_K, 0.981 for Q6_K; AMX unchanged) */
    const __m512 prev = t == 0 ? _mm512_setzero_ps() : _mm512_load_ps(acc);
    __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dk), _mm512_mul_ps(d, xd), prev);
    if (MIN) {
        const int64_t row32 = r * (k / 32) + t * 8;
        __m512i mk = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++)
            mk = dpwssd_bcst(mk, mn ? mn[p] : _mm512_loadu_si512(pmn + (t * 16 + p) * TILE), a->ks32 + row32 + 2 * p);
        sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mk), _mm512_mul_ps(nm, xd), sum);
    }
    _mm512_store_ps(acc, sum);
}

/* A superblock's float steps for rows r0 .. r0 + ROWS_N - 1 (t: the superblock), row by row
 * (zmm_superblock_row). The tile passes of every width share them, so their float steps
 * are the same operations. HOIST (the AMX pass): the mins' four vectors loaded once for
 * all the rows (bench/gemm_tile_ab.c, 512 rows, 0.970-0.983x the AMX pass's time for Q4_K
 * and Q5_K, but 1.034x the VNNI pass's, whose eight rows' registers it crowds). */
static inline TARGET_VNNI __attribute__((always_inline)) void zmm_superblock_floats(const job_t *job, const tile_t *tl,
                                                                                     int64_t r0, int64_t t,
                                                                                     const int ROWS_N, const int MIN,
                                                                                     const __m512i *dk,
                                                                                     float acc[][TILE],
                                                                                     const int HOIST) {
    const acts_t *a = job->a;
    const int64_t at = t * 8 * TILE;
    const __m512 d = _mm512_loadu_ps(tl->ps + at), nm = _mm512_loadu_ps(tl->pm + at);
    __m512i mn[4];
    if (HOIST && MIN)
        for (int p = 0; p < 4; p++) mn[p] = _mm512_loadu_si512(tl->pmn + (t * 16 + p) * TILE);
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++)
        zmm_superblock_row(a, tl->pmn, r0 + r, t, MIN, d, nm, HOIST ? mn : NULL, dk[r], acc[r]);
}

/* The K chain (header of gguf_matmul.c), rows r0 .. r0 + ROWS_N - 1 over the tile: per
 * 32-block, the dot products (Q6_K: per half, with the offset's -32 * S16 as start),
 * times the column's integer scale(s) (Q6_K: then times the row's multiple m; the product
 * of all three is an exact int32 sum in any order), summed over the superblock in int32;
 * then the superblock's one or two float steps. */
static inline TARGET_VNNI __attribute__((always_inline)) void rows_k_zmm_t(const job_t *job, const tile_t *tl,
                                                                            const ahead_t *ahead, int64_t j0, int cols,
                                                                            int64_t r0, const int ROWS_N, const int MIN,
                                                                            const int TABLE) {
    const acts_t *a = job->a;
    const int64_t k = job->k, supers = k / 256;
    const __m512i *tile = (const __m512i *)tl->tile;
    /* updated once per superblock (the first writes it): registers go to dhi */
    float acc[ZMM_ROWS_K][TILE] __attribute__((aligned(64)));
    for (int64_t t = 0; t < supers; t++) {
        if (ahead) prefetch_step(ahead, t), prefetch_step(ahead + 1, t);
        __m512i dk[ZMM_ROWS_K];
        for (int r = 0; r < ROWS_N; r++) dk[r] = _mm512_setzero_si512();
        /* Q6_K: term i of row r's superblock at z[i * 8 + r] (acts_t's kz) */
        const int32_t *z = MIN ? NULL : a->kz + (r0 / 8 * supers + t) * 192;
        for (int j = 0; j < 8; j++) {
            const int64_t b = t * 8 + j;
            __m512i dlo[ZMM_ROWS_K], dhi[ZMM_ROWS_K];
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {
                dlo[r] = MIN ? _mm512_setzero_si512() : _mm512_set1_epi32(z[(8 + 2 * j) * 8 + r]);
                dhi[r] = MIN ? _mm512_setzero_si512() : _mm512_set1_epi32(z[(9 + 2 * j) * 8 + r]);
            }
            const __m512i *wb = tile + b * 8;
            /* row r's 32-block at xb + r * stride (Q6_K: acts_t's kq8, its group's rows side by side) */
            const int8_t *xb = MIN ? a->kq + r0 * k + 32 * b : a->kq8 + (r0 / 8 * (k / 32) + b) * 256;
            const int64_t stride = MIN ? k : 32;
            _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) {
                const __m512i w = _mm512_load_si512(wb + g);
                _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {
                    if (!MIN && g >= 4) dhi[r] = dpbusd_bcst(dhi[r], w, xb + r * stride + 4 * g);
                    else dlo[r] = dpbusd_bcst(dlo[r], w, xb + r * stride + 4 * g);
                }
            }
            const __m512i sc0 = _mm512_loadu_si512(tl->psc + 2 * b * TILE);
            if (MIN) { /* flat activations: sc alone */
                _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++)
                    dk[r] = _mm512_add_epi32(dk[r], _mm512_mullo_epi32(dlo[r], sc0));
                continue;
            }
            if (TABLE) { /* the halves' scales times the row's m, ready in the tile's table */
                const int32_t *by_m = tl->q6k_table + (b * 16 - 1) * 2 * TILE; /* m from 1 */
                _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {
                    const int32_t *scm = by_m + z[j * 8 + r] * 2 * TILE;
                    const __m512i e = _mm512_add_epi32(_mm512_mullo_epi32(dlo[r], _mm512_load_si512(scm)),
                                                       _mm512_mullo_epi32(dhi[r], _mm512_load_si512(scm + TILE)));
                    dk[r] = _mm512_add_epi32(dk[r], e);
                }
                continue;
            }
            const __m512i sc1 = _mm512_loadu_si512(tl->psc + (2 * b + 1) * TILE);
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {
                const __m512i e = _mm512_add_epi32(_mm512_mullo_epi32(dlo[r], sc0), _mm512_mullo_epi32(dhi[r], sc1));
                dk[r] = _mm512_add_epi32(dk[r], _mm512_mullo_epi32(e, _mm512_set1_epi32(z[j * 8 + r])));
            }
        }
        zmm_superblock_floats(job, tl, r0, t, ROWS_N, MIN, dk, acc, 0);
    }
    for (int r = 0; r < ROWS_N; r++) zmm_store_row(job, r0 + r, j0, cols, _mm512_load_ps(acc[r]));
}

/* Q6_K's table for a tile (tile_t's q6k_table): per 32-block b, multiple m (1 .. 16) and
 * half h, the 16 columns' scales times m at ((b * 16 + m - 1) * 2 + h) * TILE, each made
 * by adding the scales m times (exact). With it the pass multiplies a row's two half sums
 * by ready products where it multiplied them by the scales and their sum by m: two
 * vpmulld per row and 32-block instead of three, each taking a vpdpbusd's slot on a Zen 4. */
static TARGET_VNNI void q6k_scale_table(const job_t *job, const tile_t *tl) {
    for (int64_t i = 0; i < 2 * job->nb; i++) {
        const __m512i sc = _mm512_loadu_si512(tl->psc + i * TILE);
        int32_t *out = tl->q6k_table + (i / 2 * 32 + i % 2) * TILE;
        __m512i times = sc;
        for (int m = 0; m < 16; m++, times = _mm512_add_epi32(times, sc)) _mm512_store_si512(out + m * 2 * TILE, times);
    }
}

/* Returns the rows done: ROWS_N (at most ZMM_ROWS_K) from r0, a multiple of 8 (Q6_K's
 * activations come in groups of eight rows: acts_t's kz, kq8). ahead: NULL, or the plans
 * (two, one per eight columns) of the next tile's blocks, fetched a part per superblock. */
static TARGET_VNNI int rows_k_zmm(const job_t *job, const tile_t *tl, const ahead_t *ahead, int64_t type, int64_t j0,
                                  int cols, int64_t r0, int rows) {
#define K_ZMM(N)                                                                                           \
    (type != T_Q6_K      ? rows_k_zmm_t(job, tl, ahead, j0, cols, r0, N, 1, 0)                             \
     : tl->q6k_table ? rows_k_zmm_t(job, tl, ahead, j0, cols, r0, N, 0, 1)                             \
                         : rows_k_zmm_t(job, tl, ahead, j0, cols, r0, N, 0, 0))
    const int n = rows < ZMM_ROWS_K ? rows : ZMM_ROWS_K;
    switch (n) {
    case 8: K_ZMM(8); break;
    case 7: K_ZMM(7); break;
    case 6: K_ZMM(6); break;
    case 5: K_ZMM(5); break;
    case 4: K_ZMM(4); break;
    case 3: K_ZMM(3); break;
    case 2: K_ZMM(2); break;
    default: K_ZMM(1);
    }
#undef K_ZMM
    return n;
}

/* The 32 chain's tile pass (TILE_ROWS_BODY's, gguf_matmul.c) on 512-bit registers: per
 * 32-block, the 16 columns' dot products in one register per row (one weight load and one
 * vpdpbusd serve the tile's 16 columns of a row), then the block's float steps, each lane
 * the same operations on the same operands as the 256-bit pass's (FLOAT_STEPS), so the
 * same bits. SIGNED: the tile's quants signed against the activations plus 128 (sign_tile),
 * the lanes started from the tile's terms; else the per-row offsets' starts. */
static inline TARGET_VNNI __attribute__((always_inline)) void rows_zmm32_t(const job_t *job, const tile_t *tl,
                                                                            const ahead_t *ahead, int64_t j0, int cols,
                                                                            int64_t r0, const int ROWS_N, const int KIND,
                                                                            const int OFF, const int AHEAD,
                                                                            const int SIGNED) {
    const acts_t *a = job->a;
    const int64_t nb = job->nb, k = job->k;
    const __m512i *tile = (const __m512i *)tl->tile;
    __m512 acc[ZMM_ROWS_32];
    for (int r = 0; r < ROWS_N; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (AHEAD) prefetch_step(&ahead[0], b), prefetch_step(&ahead[1], b);
        __m512i dlo[ZMM_ROWS_32], dhi[ZMM_ROWS_32];
        const __m512i start = SIGNED ? _mm512_load_si512(tl->psc + b * TILE) : _mm512_setzero_si512();
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {
            const int64_t cell = (r0 + r) * nb + b;
            if (SIGNED) dlo[r] = start;
            else if (KIND >= KIND_SPLIT) {
                dlo[r] = _mm512_set1_epi32(-OFF * a->s16[2 * cell]);
                dhi[r] = _mm512_set1_epi32(-OFF * a->s16[2 * cell + 1]);
            } else dlo[r] = _mm512_set1_epi32(-OFF * (a->s16[2 * cell] + a->s16[2 * cell + 1]));
        }
        const __m512i *wb = tile + b * 8;
        const uint8_t *xb = (SIGNED ? a->qu : (const uint8_t *)a->q) + r0 * k + 32 * b;
        _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) {
            const __m512i w = _mm512_load_si512(wb + g);
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {
                const uint8_t *x = xb + r * k + 4 * g;
                if (SIGNED) { /* the activations are the unsigned operand: a register of their own */
                    int32_t four;
                    memcpy(&four, x, 4);
                    dlo[r] = _mm512_dpbusd_epi32(dlo[r], _mm512_set1_epi32(four), w);
                } else if (KIND >= KIND_SPLIT && g >= 4) dhi[r] = dpbusd_bcst(dhi[r], w, (const int8_t *)x);
                else dlo[r] = dpbusd_bcst(dlo[r], w, (const int8_t *)x);
            }
        }
        const __m512 ps = _mm512_loadu_ps(tl->ps + b * TILE);
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {
            const int64_t cell = (r0 + r) * nb + b;
            __m512i d = dlo[r];
            if (KIND >= KIND_SPLIT)
                d = _mm512_add_epi32(_mm512_mullo_epi32(dlo[r], _mm512_loadu_si512(tl->psc + 2 * b * TILE)),
                                     _mm512_mullo_epi32(dhi[r], _mm512_loadu_si512(tl->psc + (2 * b + 1) * TILE)));
            const __m512 xd = _mm512_set1_ps(a->d[cell]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ps, xd), acc[r]);
            if (KIND == KIND_MIN) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(tl->pm + b * TILE), _mm512_set1_ps(a->s[cell]), acc[r]);
            if (KIND == KIND_SPLIT_MIN) {
                const __m512i mins = _mm512_add_epi32(
                    _mm512_mullo_epi32(_mm512_loadu_si512(tl->pmn + 2 * b * TILE), _mm512_set1_epi32(a->s16[2 * cell])),
                    _mm512_mullo_epi32(_mm512_loadu_si512(tl->pmn + (2 * b + 1) * TILE), _mm512_set1_epi32(a->s16[2 * cell + 1])));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(_mm512_loadu_ps(tl->pm + b * TILE), xd), acc[r]);
            }
        }
    }
    for (int r = 0; r < ROWS_N; r++) zmm_store_row(job, r0 + r, j0, cols, acc[r]);
}

#define ZMM32_ROWS(KINDV, OFFV, SIGNEDV)                                                                   \
    switch (n) {                                                                                           \
    case 8: rows_zmm32_t(job, tl, ahead, j0, cols, r0, 8, KINDV, OFFV, AHEAD, SIGNEDV); break;             \
    case 7: rows_zmm32_t(job, tl, ahead, j0, cols, r0, 7, KINDV, OFFV, AHEAD, SIGNEDV); break;             \
    case 6: rows_zmm32_t(job, tl, ahead, j0, cols, r0, 6, KINDV, OFFV, AHEAD, SIGNEDV); break;             \
    case 5: rows_zmm32_t(job, tl, ahead, j0, cols, r0, 5, KINDV, OFFV, AHEAD, SIGNEDV); break;             \
    case 4: rows_zmm32_t(job, tl, ahead, j0, cols, r0, 4, KINDV, OFFV, AHEAD, SIGNEDV); break;             \
    case 3: rows_zmm32_t(job, tl, ahead, j0, cols, r0, 3, KINDV, OFFV, AHEAD, SIGNEDV); break;             \
    case 2: rows_zmm32_t(job, tl, ahead, j0, cols, r0, 2, KINDV, OFFV, AHEAD, SIGNEDV); break;             \
    default: rows_zmm32_t(job, tl, ahead, j0, cols, r0, 1, KINDV, OFFV, AHEAD, SIGNEDV);                   \
    }
static inline TARGET_VNNI __attribute__((always_inline)) int rows_zmm32_a(const job_t *job, const tile_t *tl,
                                                                           const ahead_t *ahead, const qinfo_t *info,
                                                                           int64_t j0, int cols, int64_t r0, int rows,
                                                                           const int AHEAD) {
    const int off = info->off, n = rows < ZMM_ROWS_32 ? rows : ZMM_ROWS_32;
    /* the kinds with mins have unsigned quants (offset 0, gguf_types.h): a constant 0 spares
     * each row and block the start's scalar loads, multiply and broadcast */
    switch (info->kind) {
    case KIND_PLAIN:
        if (job->a->qu && signed_tile(ISA_VNNI, info)) { ZMM32_ROWS(KIND_PLAIN, off, 1) } /* the tile made signed (sign_tile) */
        /* below the signed tile's rows: offsets 8 (Q4_0) and 128 (Q8_0, IQ4_NL, IQ4_XS) as constants */
        else if (off == 8) { ZMM32_ROWS(KIND_PLAIN, 8, 0) }
        else if (off == 128) { ZMM32_ROWS(KIND_PLAIN, 128, 0) }
        else { ZMM32_ROWS(KIND_PLAIN, off, 0) }
        break;
    case KIND_MIN: ZMM32_ROWS(KIND_MIN, 0, 0) break;
    case KIND_SPLIT: ZMM32_ROWS(KIND_SPLIT, off, 0) break;
    default: ZMM32_ROWS(KIND_SPLIT_MIN, 0, 0)
    }
    return n;
}
#undef ZMM32_ROWS

/* Returns the rows done. ahead: NULL, or the next tile's plans, fetched a part per 32-block. */
static TARGET_VNNI int rows_zmm32(const job_t *job, const tile_t *tl, const ahead_t *ahead, const qinfo_t *info,
                                  int64_t j0, int cols, int64_t r0, int rows) {
    return ahead ? rows_zmm32_a(job, tl, ahead, info, j0, cols, r0, rows, 1)
                 : rows_zmm32_a(job, tl, NULL, info, j0, cols, r0, rows, 0);
}

#endif
