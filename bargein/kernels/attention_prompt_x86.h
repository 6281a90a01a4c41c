/*
 * attention_f16.c's prompt path on x86 (AVX2 + F16C): a tile of up to PROMPT_QUERY_TILE
 * queries of one sequence over query heads [h0, h1), head_dim a multiple of 16,
 * register-tiled. (A tile of one query, a decode, takes attend_one where head_dim is a
 * multiple of 64.)
 *
 * Same bits as attend_tile (and so as attend_one, a decode): each score is one fused
 * multiply-add chain over the head in eight lanes, hsum256's tree, times the scale (soft
 * capped where asked); the same softmax_row; each output value one chain of fused
 * multiply-adds over the row's positions in order, times 1 / sum. Only the loop order
 * differs, and no value's chain is split or reordered by it:
 *
 * - The tile is done one KV head at a time. Its rows are the (query, head) pairs that read
 *   that KV head: PROMPT_QUERY_TILE queries times the heads of a group (192 to 256 rows in
 *   GQA models), so that each key and value row is fetched once for that many (the caches
 *   of a long context do not fit in L2: fetched once per 8 queries, the wait for them was a
 *   third of the time at 4,096 positions; 64 queries against 32: 1.06-1.11x at 4,096
 *   positions, 128 no better, docs/benchmarks.md).
 * - Keys come PROMPT_KEY_CHUNK at a time, widened to float32 once into an L1 scratch that
 *   every row then reads (before, every row widened every key and value itself).
 * - Scores: on the chunk's keys transposed (transpose_chunk), each score's eight lanes
 *   computed lane by lane across the keys, so that hsum256's tree is vertical adds: 3 rows x
 *   24 keys per step on AVX2 (score_keys: each broadcast of a query element feeds three
 *   fused multiply-adds; a soft cap eight scores at a time), 4 rows x 16 keys with AVX-512
 *   (no soft cap: capped scores take score_step there). The 256-bit step before, 3 rows x
 *   4 keys against the keys as stored with a horizontal sum per score (score_step), spent
 *   about 40% of its time in the horizontal sums and their scalar stores; the transposed
 *   step takes 0.93-0.98x the prompt attention's time (bench/attention_ab.c, Llama-1B's and
 *   SmolLM2's shapes, 4,096 positions, Zen 3; with Gemma 2's soft cap 0.78x). Every row of
 *   a step gets a score for every key up to the step's longest context, those past its own
 *   too: they are never read (the softmax and the values take the row's own positions
 *   only).
 * - Values: 6 rows x 16 values of the head per step (x 64 in 512-bit registers where
 *   AVX-512 has them: a quarter of the weight broadcasts), the sums in registers across a
 *   chunk's keys; a row's chain goes on in memory (acc) from chunk to chunk and, where the
 *   six rows' positions differ inside a chunk (the causal edge, a window's start), the
 *   positions only some rows see are added row by row before and after the shared ones,
 *   keeping each row's order.
 *
 * Included by attention_f16.c after score(), softmax_row(), load_halves() and tanh.h.
 */
#ifndef BARGEIN_ATTENTION_PROMPT_X86_H
#define BARGEIN_ATTENTION_PROMPT_X86_H

/* Queries of one sequence per tile at most (attention_f16.c shares tiles out). Each thread's
 * scores scratch is the tile's queries x group x the longest context floats (4 MB for
 * Llama-1B at 4,096 positions): attention_f16.c's prompt_tile_for halves the tile where that
 * passes its bound. */
#define PROMPT_QUERY_TILE 64
#define PROMPT_KEY_CHUNK 48 /* keys widened per step: 48 x head_dim floats stay in L1 (12 KB at 64) */
#define VALUE_ROWS 6 /* rows x 16 values of a value step: 12 accumulators + 2 values + 1 weight */

/* One (query, head) pair of the tile: its query head, its scores (at position - earliest),
 * its output sums (head_dim floats) and the positions it attends to, [lo, hi). */
typedef struct {
    const float *q;
    float *s, *acc;
    int64_t lo, hi;
} prompt_row_t;

/* Positions [c0, c1) of one KV head's cache (keys or values), widened into dst (rows of
 * head_dim floats): the conversion is exact, so every reader sees the cached values. The
 * rows of [c1, next) are asked for meanwhile: the block table scatters them over the pool,
 * where the hardware prefetcher cannot follow, and the chunk's arithmetic hides their wait.
 * Positions are walked block by block (one table look-up per block, no division per row). */
static inline void widen_chunk(const f16_batch_t *b, const uint16_t *cache, const int64_t *table, int kv,
                               int64_t c0, int64_t c1, int64_t next, float *dst) {
    const int d_len = b->head_dim;
    const int64_t bs = b->block_size, row_len = (int64_t)b->num_kv_heads * d_len;
    int64_t blk = c0 / bs, off = c0 % bs;
    for (int64_t t = c0; t < next; t++) {
        const uint16_t *src = cache + (table[blk] * bs + off) * row_len + (int64_t)kv * d_len;
        if (t < c1) {
            for (int d = 0; d < d_len; d += 8) _mm256_storeu_ps(dst + d, load_halves(src + d));
            dst += d_len;
        } else {
            for (int64_t c = 0; c < d_len * (int64_t)sizeof(uint16_t); c += 64) _mm_prefetch((const char *)src + c, _MM_HINT_T0);
        }
        if (++off == bs) blk++, off = 0;
    }
}

/* The keys of a chunk (starting at position pos, n_keys of them) before the longest context
 * of rows[0 .. n): the ones any of these rows scores. */
static inline int64_t keys_seen(const prompt_row_t *rows, int n, int64_t pos, int64_t n_keys) {
    int64_t keys = 0;
    for (int i = 0; i < n; i++) keys = rows[i].hi - pos > keys ? rows[i].hi - pos : keys;
    return keys < n_keys ? keys : n_keys;
}

#ifdef __AVX512F__
/* Rows x keys of score_step (AVX-512's soft-capped scores: the 512-bit transposed step has
 * no cap): 12 accumulators, 3 queries and a key in 16 registers (2 rows x 4 keys: 0.93x the
 * time of the 4 x 3 step before, against 3 rows' 0.88). */
#define STEP_ROWS 3
#define STEP_KEYS 4

/* Scores of rows[0, R) against keys k (C rows of d_len floats, positions at, at + 1, ...
 * of the rows' scores): R x C chains at once, each over the head in order, each summed by
 * hsum256 and soft-capped by score(). R, C and (where the caller makes it so) d_len are
 * constants after inlining. (Scores without a soft cap take score_chunk_t.) */
static inline __attribute__((always_inline)) void score_step(const f16_batch_t *b, const prompt_row_t *rows, int R,
                                                             const float *k, int C, int64_t at, int d_len) {
    __m256 acc[STEP_ROWS][STEP_KEYS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int d = 0; d < d_len; d += 8) {
        __m256 qd[STEP_ROWS];
        /* The queries and the key held in registers (in_order_ps): left to itself GCC, with
         * all 16 ymm registers taken, loaded a query again for every fused multiply-add and
         * took the key from memory in each, two loads per multiply-add where a Zen 3 does
         * two loads a cycle (the prompt attention 0.70x the time at 512 and 4,096 positions,
         * bench/attention_ab.c, Llama-1B's shape, Zen 3) */
        for (int r = 0; r < R; r++) qd[r] = _mm256_loadu_ps(rows[r].q + d), in_order_ps(&qd[r]);
        for (int c = 0; c < C; c++) { /* a key at a time: 12 chains, 3 queries and 1 key in registers */
            __m256 kd = _mm256_loadu_ps(k + (int64_t)c * d_len + d);
            in_order_ps(&kd);
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(qd[r], kd, acc[r][c]);
        }
    }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) rows[r].s[at + c] = score(b, hsum256(acc[r][c]));
}

/* score_chunk's body for one head size (d_len a constant where inlined with one). */
static inline __attribute__((always_inline)) void score_chunk_body(const f16_batch_t *b, const prompt_row_t *rows,
                                                                   int n_rows, const float *k, int64_t n_keys,
                                                                   int64_t at, int64_t pos, int d_len) {
    for (int r = 0; r < n_rows;) {
        const int R = n_rows - r < STEP_ROWS ? 1 : STEP_ROWS;
        const int64_t keys = keys_seen(rows + r, R, pos, n_keys);
        int64_t t = 0;
        if (R == STEP_ROWS) {
            for (; t + STEP_KEYS <= keys; t += STEP_KEYS)
                score_step(b, rows + r, STEP_ROWS, k + t * d_len, STEP_KEYS, at + t, d_len);
            for (; t < keys; t++) score_step(b, rows + r, STEP_ROWS, k + t * d_len, 1, at + t, d_len);
        } else {
            for (; t + STEP_KEYS <= keys; t += STEP_KEYS)
                score_step(b, rows + r, 1, k + t * d_len, STEP_KEYS, at + t, d_len);
            for (; t < keys; t++) score_step(b, rows + r, 1, k + t * d_len, 1, at + t, d_len);
        }
        r += R;
    }
}
#endif

/* The chunk's widened keys k (n_keys rows of d_len floats) transposed into kt: kt[d *
 * PROMPT_KEY_CHUNK + t] is key t's element d; keys past n_keys are zeros (scored, never
 * stored). Eight keys by eight elements at a time (transpose8). */
static void transpose_chunk(const float *k, int64_t n_keys, int d_len, float *kt) {
    for (int64_t t0 = 0; t0 < PROMPT_KEY_CHUNK; t0 += 8)
        for (int d0 = 0; d0 < d_len; d0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = t0 + i < n_keys ? _mm256_loadu_ps(k + (t0 + i) * d_len + d0) : _mm256_setzero_ps();
            transpose8(r);
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(kt + (int64_t)(d0 + j) * PROMPT_KEY_CHUNK + t0, r[j]);
        }
}

#ifdef __AVX512F__
#define KEY_LANES 16 /* keys of one transposed score vector */
#define SCORE_ROWS 4 /* rows of an AVX-512 score step */

/* Lanes l and l + 4 of the eight-lane chains of rows[0, R) against 16 transposed keys
 * (kt at the first of them), added: lane l of a chain holds sum over j of q[l + 8j] k[l + 8j],
 * fused multiply-adds in j's order from zero, as attend_one's lane l does. */
static inline __attribute__((always_inline)) void lane_pair(const prompt_row_t *rows, int R, const float *kt,
                                                            int l, int d_len, __m512 *pair) {
    __m512 a[SCORE_ROWS], c[SCORE_ROWS];
    for (int r = 0; r < R; r++) a[r] = c[r] = _mm512_setzero_ps();
    for (int d = 0; d < d_len; d += 8) {
        const __m512 ka = _mm512_loadu_ps(kt + (d + l) * PROMPT_KEY_CHUNK);
        const __m512 kc = _mm512_loadu_ps(kt + (d + l + 4) * PROMPT_KEY_CHUNK);
        for (int r = 0; r < R; r++) {
            a[r] = _mm512_fmadd_ps(_mm512_set1_ps(rows[r].q[d + l]), ka, a[r]);
            c[r] = _mm512_fmadd_ps(_mm512_set1_ps(rows[r].q[d + l + 4]), kc, c[r]);
        }
    }
    for (int r = 0; r < R; r++) pair[r] = _mm512_add_ps(a[r], c[r]);
}

/* Scores of rows[0, R) against the 16 keys at kt (positions at, at + 1, ... of the rows'
 * scores), the first `valid` stored. Each is hsum256 of attend_one's chain, its tree
 * ((L0 + L4) + (L2 + L6)) + ((L1 + L5) + (L3 + L7)) done lane-wise across the keys instead
 * of across a register, so no horizontal sum; then times the scale, as score() does
 * without a soft cap (the only case this path takes). */
static inline __attribute__((always_inline)) void score_keys(const f16_batch_t *b, const prompt_row_t *rows, int R,
                                                             const float *kt, int64_t at, int valid, int d_len) {
    __m512 even[SCORE_ROWS], odd[SCORE_ROWS], pair[SCORE_ROWS];
    lane_pair(rows, R, kt, 0, d_len, even);
    lane_pair(rows, R, kt, 2, d_len, pair);
    for (int r = 0; r < R; r++) even[r] = _mm512_add_ps(even[r], pair[r]);
    lane_pair(rows, R, kt, 1, d_len, odd);
    lane_pair(rows, R, kt, 3, d_len, pair);
    const __mmask16 keep = (__mmask16)((1u << valid) - 1);
    for (int r = 0; r < R; r++) {
        const __m512 s = _mm512_mul_ps(_mm512_add_ps(even[r], _mm512_add_ps(odd[r], pair[r])), _mm512_set1_ps(b->scale));
        _mm512_mask_storeu_ps(rows[r].s + at, keep, s);
    }
}

#else
#define KEY_VECS 3 /* 256-bit vectors of keys a transposed score step scores */
#define KEY_LANES (8 * KEY_VECS)
/* Rows of a 256-bit transposed score step: 9 accumulators, the 3 key vectors and a
 * broadcast in registers. (4 rows x 24 keys or 3 x 32 spill; 6 x 16 read 1.03x the time of
 * the step before, 4 x 16 1.27x: each broadcast fed two fused multiply-adds there.) */
#define SCORE_ROWS 3
_Static_assert(PROMPT_KEY_CHUNK % KEY_LANES == 0, "a chunk is whole score steps");

/* Lane l of the eight-lane chains of rows[0, R) against the KEY_LANES transposed keys at
 * kt: lane l of a chain holds sum over j of q[l + 8j] k[l + 8j], fused multiply-adds in j's
 * order from zero, as attend_one's lane l does. */
static inline __attribute__((always_inline)) void score_lane(const prompt_row_t *rows, int R, const float *kt, int l,
                                                             int d_len, __m256 out[SCORE_ROWS][KEY_VECS]) {
    __m256 a[SCORE_ROWS][KEY_VECS];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < KEY_VECS; v++) a[r][v] = _mm256_setzero_ps();
    for (int d = 0; d < d_len; d += 8) {
        __m256 k[KEY_VECS];
        for (int v = 0; v < KEY_VECS; v++) k[v] = _mm256_loadu_ps(kt + (d + l) * PROMPT_KEY_CHUNK + 8 * v), in_order_ps(&k[v]);
        for (int r = 0; r < R; r++) {
            const __m256 qd = _mm256_broadcast_ss(rows[r].q + d + l);
            for (int v = 0; v < KEY_VECS; v++) a[r][v] = _mm256_fmadd_ps(qd, k[v], a[r][v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < KEY_VECS; v++) out[r][v] = a[r][v];
}

/* The AVX-512 step's scores in 256-bit registers: rows[0, R) against the 24 transposed keys
 * at kt, hsum256's tree ((L0 + L4) + (L2 + L6)) + ((L1 + L5) + (L3 + L7)) done lane-wise
 * across the keys after all eight lanes' chains (a lane's at a time: 9 chains, each
 * broadcast of a query element feeding three fused multiply-adds), then score()'s steps
 * eight at a time (times the scale; the soft cap through bargein_tanh256, which gives
 * bargein_tanhf's bits); the first `valid` stored. */
static inline __attribute__((always_inline)) void score_keys(const f16_batch_t *b, const prompt_row_t *rows, int R,
                                                             const float *kt, int64_t at, int valid, int d_len) {
    __m256 lane[8][SCORE_ROWS][KEY_VECS];
    for (int l = 0; l < 8; l++) score_lane(rows, R, kt, l, d_len, lane[l]);
    const __m256 scale = _mm256_set1_ps(b->scale), cap = _mm256_set1_ps(b->softcap);
    for (int r = 0; r < R; r++)
        for (int v = 0; v < KEY_VECS; v++) {
            const __m256 even = _mm256_add_ps(_mm256_add_ps(lane[0][r][v], lane[4][r][v]),
                                              _mm256_add_ps(lane[2][r][v], lane[6][r][v]));
            const __m256 odd = _mm256_add_ps(_mm256_add_ps(lane[1][r][v], lane[5][r][v]),
                                             _mm256_add_ps(lane[3][r][v], lane[7][r][v]));
            __m256 s = _mm256_mul_ps(_mm256_add_ps(even, odd), scale);
            if (b->softcap > 0.0f) /* score()'s cap, its operations in its order: the same bits */
                s = _mm256_mul_ps(cap, bargein_tanh256(_mm256_div_ps(s, cap)));
            const int n = valid - 8 * v;
            if (n >= 8) _mm256_storeu_ps(rows[r].s + at + 8 * v, s);
            else if (n > 0)
                _mm256_maskstore_ps(rows[r].s + at + 8 * v,
                                    _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), s);
        }
}

#endif

/* score_chunk's body on transposed keys, KEY_LANES keys a step (d_len a constant where
 * inlined with one). */
static inline __attribute__((always_inline)) void score_chunk_t(const f16_batch_t *b, const prompt_row_t *rows,
                                                                int n_rows, const float *kt, int64_t n_keys,
                                                                int64_t at, int64_t pos, int d_len) {
    for (int r = 0; r < n_rows;) {
        const int R = n_rows - r < SCORE_ROWS ? 1 : SCORE_ROWS;
        const int64_t keys = keys_seen(rows + r, R, pos, n_keys);
        for (int64_t t = 0; t < keys; t += KEY_LANES) {
            const int valid = keys - t < KEY_LANES ? (int)(keys - t) : KEY_LANES;
            if (R == SCORE_ROWS)
                score_keys(b, rows + r, SCORE_ROWS, kt + t, at + t, valid, d_len);
            else
                score_keys(b, rows + r, 1, kt + t, at + t, valid, d_len);
        }
        r += R;
    }
}

/* Scores of rows[0, n_rows) against n_keys widened keys k of positions pos, pos + 1, ...,
 * written at index at onwards of each row's scores (keys past all of a step's rows'
 * contexts are skipped). The common head size 64 gets its own fully unrolled copy. On
 * AVX2, and with AVX-512 where there is no soft cap, the keys are transposed into kt
 * (PROMPT_KEY_CHUNK x head_dim floats of scratch) and scored 24 (AVX2) or 16 (AVX-512) at a
 * time by score_chunk_t: the same bits as score_step's. */
static __attribute__((noinline)) void score_chunk(const f16_batch_t *b, const prompt_row_t *rows, int n_rows,
                                                  const float *k, int64_t n_keys, int64_t at, int64_t pos,
                                                  float *kt) {
#ifdef __AVX512F__
    if (b->softcap > 0.0f) { /* the 512-bit step has no soft cap */
        if (b->head_dim == 64)
            score_chunk_body(b, rows, n_rows, k, n_keys, at, pos, 64);
        else
            score_chunk_body(b, rows, n_rows, k, n_keys, at, pos, b->head_dim);
        return;
    }
#endif
    transpose_chunk(k, n_keys, b->head_dim, kt);
    if (b->head_dim == 64)
        score_chunk_t(b, rows, n_rows, kt, n_keys, at, pos, 64);
    else
        score_chunk_t(b, rows, n_rows, kt, n_keys, at, pos, b->head_dim);
}

/* Values [d, d + 16) of rows[0, R)'s sums, continued over positions [t0, t1) of the chunk
 * whose widened values v (rows of d_len floats) start at position c0; a row's weight of
 * position t is at its s[t - earliest]. */
static inline __attribute__((always_inline)) void value_step(const prompt_row_t *rows, int R, const float *v,
                                                             int d_len, int64_t c0, int64_t t0, int64_t t1,
                                                             int64_t earliest, int d) {
    __m256 a[VALUE_ROWS][2];
    const float *w[VALUE_ROWS];
    for (int r = 0; r < R; r++) {
        a[r][0] = _mm256_loadu_ps(rows[r].acc + d);
        a[r][1] = _mm256_loadu_ps(rows[r].acc + d + 8);
        w[r] = rows[r].s + t0 - earliest;
    }
    const float *vt = v + (t0 - c0) * d_len + d;
    for (int64_t i = 0; i < t1 - t0; i++, vt += d_len) {
        const __m256 v0 = _mm256_loadu_ps(vt), v1 = _mm256_loadu_ps(vt + 8);
        for (int r = 0; r < R; r++) {
            const __m256 wr = _mm256_broadcast_ss(w[r] + i);
            a[r][0] = _mm256_fmadd_ps(wr, v0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(wr, v1, a[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(rows[r].acc + d, a[r][0]);
        _mm256_storeu_ps(rows[r].acc + d + 8, a[r][1]);
    }
}

#ifdef __AVX512F__
#define VALUE_WIDE 64 /* values a row per 512-bit value step: 6 rows x 4 accumulators + 4 values + 1 weight */

/* value_step for values [d, d + 64) in four 512-bit registers a row: the very chains (one
 * fused multiply-add per position, in position order, per value), with a quarter of the
 * weight broadcasts, value loads and accumulator round trips of four 16-value steps. */
static inline __attribute__((always_inline)) void value_step_wide(const prompt_row_t *rows, int R, const float *v,
                                                                  int d_len, int64_t c0, int64_t t0, int64_t t1,
                                                                  int64_t earliest, int d) {
    __m512 a[VALUE_ROWS][4];
    const float *w[VALUE_ROWS];
    for (int r = 0; r < R; r++) {
        for (int j = 0; j < 4; j++) a[r][j] = _mm512_loadu_ps(rows[r].acc + d + 16 * j);
        w[r] = rows[r].s + t0 - earliest;
    }
    const float *vt = v + (t0 - c0) * d_len + d;
    for (int64_t i = 0; i < t1 - t0; i++, vt += d_len) {
        __m512 vj[4];
        for (int j = 0; j < 4; j++) vj[j] = _mm512_loadu_ps(vt + 16 * j);
        for (int r = 0; r < R; r++) {
            const __m512 wr = _mm512_set1_ps(w[r][i]);
            for (int j = 0; j < 4; j++) a[r][j] = _mm512_fmadd_ps(wr, vj[j], a[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(rows[r].acc + d + 16 * j, a[r][j]);
}
#endif

/* Rows[0, R)'s values [d, d + width) continued over positions [t0, t1): width 16 by
 * value_step, 64 (AVX-512 only) by value_step_wide. */
static inline __attribute__((always_inline)) void value_run(const prompt_row_t *rows, int R, const float *v,
                                                            int d_len, int64_t c0, int64_t t0, int64_t t1,
                                                            int64_t earliest, int d, int width) {
#ifdef __AVX512F__
    if (width == VALUE_WIDE) {
        value_step_wide(rows, R, v, d_len, c0, t0, t1, earliest, d);
        return;
    }
#endif
    value_step(rows, R, v, d_len, c0, t0, t1, earliest, d);
}

/* One group's (R <= VALUE_ROWS rows) values [d, d + width) over their positions within
 * [c0, c1): those all of them see, [shared_lo, shared_hi), in one register-tiled pass,
 * those only some see row by row before and after it, so each row's chain stays in
 * position order. */
static inline __attribute__((always_inline)) void value_group(const prompt_row_t *group, int R, const float *v,
                                                              int d_len, int64_t c0, int64_t c1, int64_t shared_lo,
                                                              int64_t shared_hi, int64_t earliest, int d, int width) {
    /* shared_lo passes c1 when a row's window starts beyond this chunk: the part before
     * the shared positions still ends with the chunk, whose values are all v holds. */
    const int64_t before_end = shared_lo < c1 ? shared_lo : c1;
    for (int r = 0; r < R; r++) { /* before the shared positions */
        const int64_t lo = group[r].lo > c0 ? group[r].lo : c0;
        const int64_t hi = group[r].hi < before_end ? group[r].hi : before_end;
        if (lo < hi) value_run(group + r, 1, v, d_len, c0, lo, hi, earliest, d, width);
    }
    if (shared_lo < shared_hi) {
        if (R == VALUE_ROWS)
            value_run(group, VALUE_ROWS, v, d_len, c0, shared_lo, shared_hi, earliest, d, width);
        else
            for (int r = 0; r < R; r++) value_run(group + r, 1, v, d_len, c0, shared_lo, shared_hi, earliest, d, width);
    }
    for (int r = 0; r < R; r++) { /* after them */
        const int64_t lo = group[r].lo > shared_hi ? group[r].lo : shared_hi;
        const int64_t hi = group[r].hi < c1 ? group[r].hi : c1;
        if (lo < hi) value_run(group + r, 1, v, d_len, c0, lo, hi, earliest, d, width);
    }
}

/* Every row's sums continued over its positions within [c0, c1), VALUE_ROWS rows at a
 * time (value_group), 64 values of the head a pass where AVX-512 has them, else 16. */
static __attribute__((noinline)) void value_chunk(const f16_batch_t *b, const prompt_row_t *rows, int n_rows,
                                                  const float *v, int64_t c0, int64_t c1, int64_t earliest) {
    const int d_len = b->head_dim;
    for (int r0 = 0; r0 < n_rows; r0 += VALUE_ROWS) {
        const int R = n_rows - r0 < VALUE_ROWS ? n_rows - r0 : VALUE_ROWS;
        const prompt_row_t *group = rows + r0;
        int64_t shared_lo = c0, shared_hi = c1;
        for (int r = 0; r < R; r++) {
            shared_lo = group[r].lo > shared_lo ? group[r].lo : shared_lo;
            shared_hi = group[r].hi < shared_hi ? group[r].hi : shared_hi;
        }
        if (shared_hi < shared_lo) shared_hi = shared_lo; /* no position seen by all: row by row */
        int d = 0;
#ifdef __AVX512F__
        for (; d + VALUE_WIDE <= d_len; d += VALUE_WIDE)
            value_group(group, R, v, d_len, c0, c1, shared_lo, shared_hi, earliest, d, VALUE_WIDE);
#endif
        for (; d < d_len; d += 16) value_group(group, R, v, d_len, c0, c1, shared_lo, shared_hi, earliest, d, 16);
    }
}

/* The tile of queries [first, first + n) over query heads [h0, h1) (see the top of this file).
 * n <= b->prompt_tile <= PROMPT_QUERY_TILE; scores: (n x group, max_context) floats at least;
 * acc: (n x group, head_dim);
 * kv_rows: 2 x PROMPT_KEY_CHUNK x head_dim (a chunk's keys or values, and the keys transposed). */
static void attend_prompt(const f16_batch_t *b, int64_t first, int n, int h0, int h1, float *scores, float *acc,
                          float *kv_rows) {
    const int n_heads = b->num_heads, group = n_heads / b->num_kv_heads, d_len = b->head_dim;
    const int64_t per_q = (int64_t)n_heads * d_len;
    const int64_t *table = b->block_tables + b->query_seq[first] * b->table_width;
    int64_t ctx[PROMPT_QUERY_TILE], start[PROMPT_QUERY_TILE], earliest = INT64_MAX, longest = 0;
    for (int i = 0; i < n; i++) {
        ctx[i] = b->query_ctx[first + i], start[i] = first_position(b, ctx[i]);
        longest = ctx[i] > longest ? ctx[i] : longest;
        earliest = start[i] < earliest ? start[i] : earliest;
    }
    const int64_t span = longest - earliest;
    for (int kv = h0 / group; kv <= (h1 - 1) / group; kv++) {
        const int ha = kv * group > h0 ? kv * group : h0, hb = (kv + 1) * group < h1 ? (kv + 1) * group : h1;
        prompt_row_t rows[PROMPT_QUERY_TILE * group];
        int n_rows = 0;
        for (int i = 0; i < n; i++)
            for (int h = ha; h < hb; h++, n_rows++)
                rows[n_rows] = (prompt_row_t){b->q + (first + i) * per_q + (int64_t)h * d_len, scores + n_rows * span,
                                              acc + (int64_t)n_rows * d_len, start[i], ctx[i]};
        for (int c0 = 0; c0 < span; c0 += PROMPT_KEY_CHUNK) {
            const int64_t c1 = c0 + PROMPT_KEY_CHUNK < span ? c0 + PROMPT_KEY_CHUNK : span;
            const int64_t next = c1 + PROMPT_KEY_CHUNK < span ? c1 + PROMPT_KEY_CHUNK : span;
            widen_chunk(b, b->k_cache, table, kv, earliest + c0, earliest + c1, earliest + next, kv_rows);
            score_chunk(b, rows, n_rows, kv_rows, c1 - c0, c0, earliest + c0,
                        kv_rows + PROMPT_KEY_CHUNK * d_len);
        }
        float inv[PROMPT_QUERY_TILE * group];
        for (int r = 0; r < n_rows; r++) {
            inv[r] = softmax_row(rows[r].s + rows[r].lo - earliest, rows[r].hi - rows[r].lo);
            memset(rows[r].acc, 0, sizeof(float) * (size_t)d_len);
        }
        for (int64_t c0 = earliest; c0 < longest; c0 += PROMPT_KEY_CHUNK) {
            const int64_t c1 = c0 + PROMPT_KEY_CHUNK < longest ? c0 + PROMPT_KEY_CHUNK : longest;
            const int64_t next = c1 + PROMPT_KEY_CHUNK < longest ? c1 + PROMPT_KEY_CHUNK : longest;
            widen_chunk(b, b->v_cache, table, kv, c0, c1, next, kv_rows);
            value_chunk(b, rows, n_rows, kv_rows, c0, c1, earliest);
        }
        for (int r = 0; r < n_rows; r++) {
            const __m256 scale = _mm256_set1_ps(inv[r]);
            float *out = b->out + (first + r / (hb - ha)) * per_q + (int64_t)(ha + r % (hb - ha)) * d_len;
            for (int d = 0; d < d_len; d += 8)
                _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_loadu_ps(rows[r].acc + d), scale));
        }
    }
}

#endif
