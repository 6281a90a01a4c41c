/*
 * Paged attention over a float16 KV cache, for the `fast` precision: every query token of
 * a forward (prompt chunks and decodes alike) attends on its own, by the same code.
 *
 * Contract (checked by the Python caller, bargein/kernels/native.py):
 *   q            (num_queries, num_heads, head_dim) float32, contiguous
 *   k_cache      (num_blocks, block_size, num_kv_heads, head_dim) float16 bits; v_cache alike
 *   block_tables (num_seqs, table_width) int64; row i names sequence i's blocks in order
 *   query_seq    (num_queries,) int64: the block-table row of each query
 *   query_ctx    (num_queries,) int64: a query at position p attends to positions 0..p, so p + 1
 *   out          (num_queries, num_heads, head_dim) float32, written in full
 * Query head h reads KV head h / (num_heads / num_kv_heads).
 *
 * bargein_paged_attention_f16_ex adds two features of some families' layers:
 *   window   > 0: a query at position p attends to positions max(0, p - window + 1)..p only,
 *            and reads no key or value before them (sliding-window layers); 0: all of 0..p
 *   softcap  > 0: each score s (already scaled) becomes softcap * tanh(s / softcap) (Gemma 2)
 * bargein_paged_attention_f16 is it with neither.
 *
 * Why one kernel for every query: a token's output then depends only on its query, its
 * context length and the cached keys and values, never on how many other queries share
 * the call, how the threads share them out, or whether the token came in a prompt chunk
 * or as a decode. A decode step and a prefill of the same tokens write and read the same
 * K/V and get the same numbers, bit for bit, which the cancellation contract (C4) needs
 * in this mode. Queries are shared out among threads whole, and when there are fewer
 * tiles of queries than threads, so are their heads (each head by the same code).
 *
 * Returns 0, or -1 when scratch memory could not be had.
 *
 * bargein_rope_store_f16 prepares what the attention reads, one token at a time by the
 * same code (so a token's K/V never depends on its neighbours): it rotates the token's
 * query and key by its RoPE angles ("rotate half" layout, cos and sin given per token),
 * writes the query out as float32 and the key and value into the caches as float16,
 * rounded to nearest even (as torch's conversion rounds).
 */
#include "parallel.h"
#include "simd.h"
#include "tanh.h"

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *q;
    const uint16_t *k_cache, *v_cache;
    const int64_t *block_tables, *query_seq, *query_ctx;
    float *out;
    int64_t num_queries, table_width, max_context;
    int num_heads, num_kv_heads, head_dim, block_size;
    float scale, softcap;
    int64_t window;
    const int64_t *tile_starts; /* tile i: queries [tile_starts[i], tile_starts[i + 1]) */
    int64_t num_tiles;
    int head_parts;    /* each tile's query heads are split into this many work items */
    int prompt_path;   /* tiles of several queries take attend_prompt */
    int prompt_tile;   /* the prompt path's queries per tile (prompt_tile_for) */
    atomic_llong next; /* the next work item a thread may take */
} f16_batch_t;

#define QUERY_TILE 8 /* queries of one sequence sharing each widened key and value row */

/* IEEE half to float, exactly, for machines without F16C. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(mant & 0x400)) {
            mant <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Float to IEEE half, rounded to nearest even, for machines without F16C. */
static inline uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t abs = x & 0x7FFFFFFFu;
    if (abs >= 0x7F800000u) return sign | 0x7C00 | (abs > 0x7F800000u ? 0x200 : 0); /* inf, nan */
    if (abs >= 0x477FF000u) return sign | 0x7C00;                                   /* rounds past 65504 */
    if (abs < 0x38800000u) {                                                        /* below 2^-14: subnormal */
        if (abs < 0x33000000u) return sign;                                         /* below half of 2^-24 */
        const uint32_t mant = (abs & 0x7FFFFF) | 0x800000, shift = 126 - (abs >> 23);
        uint32_t h = mant >> shift;
        const uint32_t rest = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (h & 1))) h++;
        return sign | (uint16_t)h;
    }
    uint32_t h = ((abs >> 13) - (112u << 10));
    const uint32_t rest = abs & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return sign | (uint16_t)h;
}

/* n halves to floats (conversion is exact, so any path gives the same values). */
static inline void widen_row(const uint16_t *src, float *dst, int n) {
    int i = 0;
#if defined(BARGEIN_AVX2) && defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#elif defined(BARGEIN_NEON)
    neon_widen_halves(src, dst, n, &i);
#endif
    for (; i < n; i++) dst[i] = half_to_float(src[i]);
}

/* <a, b> over n floats in a fixed order: eight lanes, then the lanes' tree. */
static inline float dot(const float *a, const float *b, int n) {
    int i = 0;
    float total = 0.0f;
#ifdef BARGEIN_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    total = hsum256(acc);
#elif defined(BARGEIN_NEON)
    int64_t at = 0;
    total = neon_dot(a, b, n, &at);
    i = (int)at;
#endif
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* The first position a query with this context attends to. */
static inline int64_t first_position(const f16_batch_t *b, int64_t ctx) {
    return b->window > 0 && ctx > b->window ? ctx - b->window : 0;
}

/* A score as the softmax takes it: the dot product times the scale, soft-capped where asked
 * (one scalar bargein_tanhf, the same in every path and on every architecture). */
static inline float score(const f16_batch_t *b, float dot_product) {
    const float s = dot_product * b->scale;
    return b->softcap > 0.0f ? b->softcap * bargein_tanhf(s / b->softcap) : s;
}

/* Turns a row of scores into exp(s - max) in place; returns 1 / their sum. */
static float softmax_row(float *s, int64_t ctx) {
    float m = s[0];
    int64_t t = 1;
#ifdef BARGEIN_AVX2
    /* max_ps(x, m) is x > m ? x : m, the scalar step's choice lane by lane: the same largest
     * score (NaN only where s[0] is, from which every running maximum starts) in any order;
     * only a zero's sign may differ, which s - m and so the exponentials do not see. Four
     * running maxima, so that the loop waits on max_ps's latency a quarter as often (one
     * chain held about a third of the softmax's samples). */
    __m256 vmax[4];
    for (int a = 0; a < 4; a++) vmax[a] = _mm256_set1_ps(m);
    for (; t + 32 <= ctx; t += 32)
        for (int a = 0; a < 4; a++) vmax[a] = _mm256_max_ps(_mm256_loadu_ps(s + t + 8 * a), vmax[a]);
    for (; t + 8 <= ctx; t += 8) vmax[0] = _mm256_max_ps(_mm256_loadu_ps(s + t), vmax[0]);
    vmax[0] = _mm256_max_ps(_mm256_max_ps(vmax[0], vmax[1]), _mm256_max_ps(vmax[2], vmax[3]));
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax[0]);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
#endif
    for (; t < ctx; t++) m = s[t] > m ? s[t] : m;
    float sum = 0.0f;
    t = 0;
#ifdef BARGEIN_AVX2
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    for (; t + 8 <= ctx; t += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
        _mm256_storeu_ps(s + t, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    sum = hsum256(vsum);
#elif defined(BARGEIN_NEON)
    sum = neon_exp_shift(s, m, ctx, &t);
#endif
    for (; t < ctx; t++) {
        s[t] = bargein_expf(s[t] - m); /* exp256's bits: the same element in either path */
        sum += s[t];
    }
    return 1.0f / sum;
}

/* A tile of up to QUERY_TILE consecutive queries of one sequence, each attended exactly as
 * it would be alone, over query heads [h0, h1): the tile only shares the
 * widening of each key and value row to float32 among the queries that see it, and a head's
 * numbers never depend on which other heads the call covers. scores is (tile, heads,
 * max_context) scratch, acc (tile, heads, head_dim). */
static void attend_tile(const f16_batch_t *b, int64_t first, int n, int h0, int h1, float *scores, float *row,
                        float *acc) {
    const int n_heads = b->num_heads, n_kv = b->num_kv_heads, d_len = b->head_dim, group = n_heads / n_kv;
    const int kv0 = h0 / group, width = ((h1 - 1) / group + 1 - kv0) * d_len; /* the KV heads they read */
    const int64_t row_len = (int64_t)n_kv * d_len, cap = b->max_context, per_q = (int64_t)n_heads * d_len;
    const int64_t *table = b->block_tables + b->query_seq[first] * b->table_width;
    /* Query i sees positions [start, ctx) and keeps its scores at s[h * len + t - start]. */
    int64_t longest = 0, earliest = INT64_MAX;
    for (int i = 0; i < n; i++) {
        const int64_t ctx = b->query_ctx[first + i], start = first_position(b, ctx);
        longest = ctx > longest ? ctx : longest;
        earliest = start < earliest ? start : earliest;
    }
    for (int64_t t = earliest; t < longest; t++) {
        const int64_t slot = table[t / b->block_size] * b->block_size + t % b->block_size;
        widen_row(b->k_cache + slot * row_len + (int64_t)kv0 * d_len, row + (int64_t)kv0 * d_len, width);
        for (int i = 0; i < n; i++) {
            const int64_t ctx = b->query_ctx[first + i], start = first_position(b, ctx), len = ctx - start;
            if (t >= ctx || t < start) continue;
            const float *q = b->q + (first + i) * per_q;
            float *s = scores + (int64_t)i * n_heads * cap;
            for (int h = h0; h < h1; h++)
                s[(int64_t)h * len + t - start] = score(b, dot(q + (int64_t)h * d_len, row + (int64_t)(h / group) * d_len, d_len));
        }
    }
    float inv[QUERY_TILE][n_heads];
    for (int i = 0; i < n; i++) {
        const int64_t ctx = b->query_ctx[first + i], len = ctx - first_position(b, ctx);
        for (int h = h0; h < h1; h++) inv[i][h] = softmax_row(scores + (int64_t)i * n_heads * cap + (int64_t)h * len, len);
    }
    for (int64_t i = 0; i < n * per_q; i++) acc[i] = 0.0f;
    for (int64_t t = earliest; t < longest; t++) {
        const int64_t slot = table[t / b->block_size] * b->block_size + t % b->block_size;
        widen_row(b->v_cache + slot * row_len + (int64_t)kv0 * d_len, row + (int64_t)kv0 * d_len, width);
        for (int i = 0; i < n; i++) {
            const int64_t ctx = b->query_ctx[first + i], start = first_position(b, ctx), len = ctx - start;
            if (t >= ctx || t < start) continue;
            const float *s = scores + (int64_t)i * n_heads * cap;
            for (int h = h0; h < h1; h++) {
                const float *v = row + (int64_t)(h / group) * d_len, w = s[(int64_t)h * len + t - start];
                float *a = acc + i * per_q + (int64_t)h * d_len;
                int d = 0;
#ifdef BARGEIN_AVX2
                const __m256 vw = _mm256_set1_ps(w);
                for (; d + 8 <= d_len; d += 8)
                    _mm256_storeu_ps(a + d, _mm256_fmadd_ps(vw, _mm256_loadu_ps(v + d), _mm256_loadu_ps(a + d)));
#elif defined(BARGEIN_NEON)
                neon_axpy(a, v, w, d_len, &d);
#endif
                for (; d < d_len; d++) a[d] += w * v[d];
            }
        }
    }
    for (int i = 0; i < n; i++) {
        float *out = b->out + (first + i) * per_q;
        for (int h = h0; h < h1; h++)
            for (int d = 0; d < d_len; d++)
                out[(int64_t)h * d_len + d] = acc[i * per_q + (int64_t)h * d_len + d] * inv[i][h];
    }
}

#if defined(BARGEIN_AVX2) && defined(__F16C__)
#define ONE_QUERY_PATH 1
static inline __m256 load_halves(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* hsum256 of four vectors at once: lane i is hsum256 of the i-th, by the same adds of the
 * same pairs (lane j + lane j + 4, then (0 + 2) + (1 + 3)), so the very same float. */
static inline __m128 hsum256_x4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m128 sa = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 sb = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    const __m128 sc = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
    const __m128 sd = _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
    const __m128 ab = _mm_add_ps(_mm_unpacklo_ps(sa, sb), _mm_unpackhi_ps(sa, sb)); /* a02 b02 a13 b13 */
    const __m128 cd = _mm_add_ps(_mm_unpacklo_ps(sc, sd), _mm_unpackhi_ps(sc, sd)); /* c02 d02 c13 d13 */
    return _mm_add_ps(_mm_movelh_ps(ab, cd), _mm_movehl_ps(cd, ab));
}

/* s[h][i] = score of query head q[h] against the keys k + i * stride, i < n (consecutive
 * positions of one block), for HEADS (1 to 3) heads that read the same KV head: four
 * keys' chains per head at once, each the single fused multiply-add chain over the head of
 * the one-key loop below, every key widened once for the heads (two or three heads' eight
 * or twelve chains keep both fused multiply-add pipes busy; one head's four wait on their
 * latency). */
static inline __attribute__((always_inline)) void score_run(const f16_batch_t *b, const float *const *q,
                                                            const int HEADS, const uint16_t *k, int64_t n,
                                                            int64_t stride, float *const *s) {
    const int d_len = b->head_dim;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4, k += 4 * stride) {
        __m256 a[3][4];
        for (int h = 0; h < HEADS; h++)
            for (int j = 0; j < 4; j++) a[h][j] = _mm256_setzero_ps();
        for (int d = 0; d < d_len; d += 8) {
            __m256 qd[3];
            for (int h = 0; h < HEADS; h++) qd[h] = _mm256_loadu_ps(q[h] + d);
            for (int j = 0; j < 4; j++) {
                const __m256 kd = load_halves(k + j * stride + d);
                for (int h = 0; h < HEADS; h++) a[h][j] = _mm256_fmadd_ps(qd[h], kd, a[h][j]);
            }
        }
        for (int h = 0; h < HEADS; h++) {
            const __m128 sums = hsum256_x4(a[h][0], a[h][1], a[h][2], a[h][3]);
            if (b->softcap <= 0.0f) { /* score() without a cap: the product with the scale, four at once */
                _mm_storeu_ps(s[h] + i, _mm_mul_ps(sums, _mm_set1_ps(b->scale)));
                continue;
            }
            float lanes[4];
            _mm_storeu_ps(lanes, sums);
            for (int j = 0; j < 4; j++) s[h][i + j] = score(b, lanes[j]);
        }
    }
    for (; i < n; i++, k += stride) {
        __m256 acc[3];
        for (int h = 0; h < HEADS; h++) acc[h] = _mm256_setzero_ps();
        for (int d = 0; d < d_len; d += 8) {
            const __m256 kd = load_halves(k + d);
            for (int h = 0; h < HEADS; h++) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q[h] + d), kd, acc[h]);
        }
        for (int h = 0; h < HEADS; h++) s[h][i] = score(b, hsum256(acc[h]));
    }
}

/* sum[h][d] += s[h][u] * v_u[d] over positions u of [t, end) in order (v at position t's
 * row, the KV head's columns; s[h] indexed by position), for HEADS (1 to 3) heads that read
 * the same KV head, each value's chain continued from sum (started from zero where first):
 * 64 / HEADS columns at a time (16 for three), every value row widened once for the heads. */
static inline __attribute__((always_inline)) void weigh_run(const float *const *s, const int HEADS,
                                                            const uint16_t *v, int64_t t, int64_t end,
                                                            int64_t row_len, int first, float *const *sum,
                                                            int d_len) {
    const int lanes = HEADS == 3 ? 2 : 8 / HEADS; /* vectors of 8 columns per head and chunk */
    for (int d0 = 0; d0 < d_len; d0 += 8 * lanes) {
        __m256 a[3][8];
        for (int h = 0; h < HEADS; h++)
            for (int j = 0; j < lanes; j++)
                a[h][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sum[h] + d0 + 8 * j);
        const uint16_t *vu = v + d0;
        for (int64_t u = t; u < end; u++, vu += row_len) {
            __m256 w[3];
            for (int h = 0; h < HEADS; h++) w[h] = _mm256_set1_ps(s[h][u]);
            for (int j = 0; j < lanes; j++) {
                const __m256 vd = load_halves(vu + 8 * j);
                for (int h = 0; h < HEADS; h++) a[h][j] = _mm256_fmadd_ps(w[h], vd, a[h][j]);
            }
        }
        for (int h = 0; h < HEADS; h++)
            for (int j = 0; j < lanes; j++) _mm256_storeu_ps(sum[h] + d0 + 8 * j, a[h][j]);
    }
}

/* A decode's reads asked for ahead of attend_one's loops: the rows of K, then of V, at
 * positions [start, ctx) (columns [col, col + width) of each), a cache line at a time in the
 * order the loops read them. The loops keep the requests READ_AHEAD_BLOCKS blocks ahead of
 * what they read, a few lines after each head's pass (never one block's lines at once: a
 * burst of requests fills the miss buffers and stalls the loads behind it), into L2
 * (prefetcht1: two blocks do not fit L1 beside the block being read). The block table
 * scatters blocks over the pool, where the hardware prefetcher cannot follow; on a step
 * that streams the weights between layers, every layer's K and V come from memory. */
#define READ_AHEAD_BLOCKS 2
typedef struct {
    const f16_batch_t *b;
    const int64_t *table;
    const uint16_t *cache; /* K's, then V's; NULL once V's last line was asked for */
    const char *row;       /* position pos's row, from column col */
    int64_t start, ctx, col, lines_per_row, row_bytes;
    int64_t pos, left, line; /* the next line to ask for; left: rows of pos's block from pos on */
    int64_t asked;           /* lines asked for so far */
} read_ahead_t;

/* Position pos's row, at a block's first row read (one table look-up and division a block). */
static inline void read_ahead_row(read_ahead_t *ra) {
    const int64_t bs = ra->b->block_size, row_len = (int64_t)ra->b->num_kv_heads * ra->b->head_dim;
    ra->row = (const char *)(ra->cache + (ra->table[ra->pos / bs] * bs + ra->pos % bs) * row_len + ra->col);
    ra->left = bs - ra->pos % bs;
}

static inline void read_ahead_init(read_ahead_t *ra, const f16_batch_t *b, const int64_t *table, int64_t start,
                                   int64_t ctx, int64_t col, int64_t width) {
    const int64_t row_bytes = (int64_t)b->num_kv_heads * b->head_dim * (int64_t)sizeof(uint16_t);
    *ra = (read_ahead_t){b, table, b->k_cache, NULL, start, ctx, col, (width * 2 + 63) / 64, row_bytes,
                         start, 0, 0, 0};
    read_ahead_row(ra);
}

/* Asks for the stream's lines up to (not including) line number `until` (K's lines are
 * numbered first, V's after them): a row's lines at a time, its bookkeeping once. */
static inline void read_ahead_to(read_ahead_t *ra, int64_t until) {
    while (ra->asked < until && ra->cache) {
        const int64_t n = ra->lines_per_row - ra->line < until - ra->asked ? ra->lines_per_row - ra->line
                                                                           : until - ra->asked;
        for (int64_t i = 0; i < n; i++) __builtin_prefetch(ra->row + (ra->line + i) * 64, 0, 2);
        ra->asked += n;
        if ((ra->line += n) < ra->lines_per_row) return;
        ra->line = 0;
        if (++ra->pos == ra->ctx) { /* K's last row: V's first, or the end */
            ra->cache = ra->cache == ra->b->k_cache ? ra->b->v_cache : NULL;
            ra->pos = ra->start;
            if (ra->cache) read_ahead_row(ra);
        } else if (--ra->left) {
            ra->row += ra->row_bytes;
        } else {
            read_ahead_row(ra);
        }
    }
}

/* How many query heads from h on (1 to 3, all before h1) score_run and weigh_run take at
 * once: the heads of h's KV head three at a time where the group is a multiple of three
 * (SmolLM2's: a pair and a single head left the single head's four chains waiting on their
 * latency and widened the KV head's rows twice), else two at a time. */
static inline int heads_at_once(int h, int h1, int group) {
    const int most = group % 3 == 0 ? 3 : 2, left_in_group = group - h % group, left = h1 - h;
    const int n = left_in_group < left ? left_in_group : left;
    return n < most ? n : most;
}

/* A tile of one query (a decode), for head_dim a multiple of 64: the very arithmetic of
 * attend_tile for it (each score one fused multiply-add chain over the head, summed by
 * hsum256, times the scale; the same softmax; each output value one chain of fused
 * multiply-adds over the positions in order, times 1 / sum), in another loop order: a
 * block of positions at a time (one table look-up per block, not a division per key, and
 * the blocks ahead asked for as it goes: read_ahead_t), every head of [h0, h1) reading the
 * block's rows while they are in L1 (from memory once, not once per query head of a group), four keys'
 * scores at once (their chains overlap instead of waiting on each other), each output
 * value's chain continued from block to block through acc, and the keys and values widened
 * as they are read. So the bits are attend_tile's, at a fraction of its loads and stores.
 * scores is (heads, max_context) scratch, acc (heads, head_dim). */
static void attend_one(const f16_batch_t *b, int64_t qi, int h0, int h1, float *scores, float *acc) {
    const int n_heads = b->num_heads, group = n_heads / b->num_kv_heads, d_len = b->head_dim;
    const int64_t row_len = (int64_t)b->num_kv_heads * d_len, per_q = (int64_t)n_heads * d_len, bs = b->block_size;
    const int64_t *table = b->block_tables + b->query_seq[qi] * b->table_width;
    const int64_t ctx = b->query_ctx[qi], start = first_position(b, ctx), len = ctx - start;
    const int64_t col = (int64_t)(h0 / group) * d_len, width = (int64_t)((h1 - 1) / group + 1) * d_len - col;
    const float *q = b->q + qi * per_q;
    read_ahead_t ra;
    read_ahead_init(&ra, b, table, start, ctx, col, width);
    /* Lines per position, and how far ahead of the reads the requests run. */
    const int64_t lines = ra.lines_per_row, ahead = READ_AHEAD_BLOCKS * bs * lines, heads = h1 - h0;
    for (int64_t t = start, blk = start / bs; t < ctx; blk++) { /* positions [t, end) of block blk */
        const int64_t end = (blk + 1) * bs < ctx ? (blk + 1) * bs : ctx;
        const uint16_t *k = b->k_cache + (table[blk] * bs + t - blk * bs) * row_len;
        for (int h = h0, n; h < h1; h += n) {
            n = heads_at_once(h, h1, group);
            read_ahead_to(&ra, (end - start) * lines + ahead * (h + n - h0) / heads);
            const float *qh[3];
            float *sh[3];
            for (int i = 0; i < n; i++)
                qh[i] = q + (int64_t)(h + i) * d_len, sh[i] = scores + (int64_t)(h + i - h0) * len + t - start;
            const uint16_t *kh = k + (int64_t)(h / group) * d_len;
            if (n == 3) score_run(b, qh, 3, kh, end - t, row_len, sh);
            else if (n == 2) score_run(b, qh, 2, kh, end - t, row_len, sh);
            else score_run(b, qh, 1, kh, end - t, row_len, sh);
        }
        t = end;
    }
    float inv[h1 - h0];
    for (int h = h0; h < h1; h++) inv[h - h0] = softmax_row(scores + (int64_t)(h - h0) * len, len);
    for (int64_t t = start, blk = start / bs; t < ctx; blk++) {
        const int64_t end = (blk + 1) * bs < ctx ? (blk + 1) * bs : ctx;
        const uint16_t *v = b->v_cache + (table[blk] * bs + t - blk * bs) * row_len;
        for (int h = h0, n; h < h1; h += n) {
            n = heads_at_once(h, h1, group);
            read_ahead_to(&ra, (len + end - start) * lines + ahead * (h + n - h0) / heads);
            const float *sh[3];
            float *sum[3];
            for (int i = 0; i < n; i++)
                sh[i] = scores + (int64_t)(h + i - h0) * len - start, sum[i] = acc + (int64_t)(h + i - h0) * d_len;
            const uint16_t *vh = v + (int64_t)(h / group) * d_len;
            if (n == 3) weigh_run(sh, 3, vh, t, end, row_len, t == start, sum, d_len);
            else if (n == 2) weigh_run(sh, 2, vh, t, end, row_len, t == start, sum, d_len);
            else weigh_run(sh, 1, vh, t, end, row_len, t == start, sum, d_len);
        }
        t = end;
    }
    for (int h = h0; h < h1; h++) {
        const __m256 scale = _mm256_set1_ps(inv[h - h0]);
        float *out = b->out + qi * per_q + (int64_t)h * d_len;
        const float *sum = acc + (int64_t)(h - h0) * d_len;
        for (int d = 0; d < d_len; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_loadu_ps(sum + d), scale));
    }
}

#define PROMPT_PATH 1
#include "x86_simd.h" /* in_order_ps */
#include "attention_prompt_x86.h"
/* Whether tiles of several queries take attend_prompt. */
static inline int takes_prompt_path(int head_dim) { return head_dim % 16 == 0; }

#ifdef PROMPT_PATH
/* Queries per prompt tile: PROMPT_QUERY_TILE while a thread's score rows (the tile's queries
 * x group x the longest context, floats) fit PROMPT_SCORES_BYTES, half as many beyond, so that
 * a long context's scratch stays what 32-query tiles took (64 MB a thread at 131,072
 * positions and a group of 4) while every prompt up to 16,384 positions (group 4) gets the
 * larger tile. No query's bits depend on its tile (the top of attention_prompt_x86.h). */
#define PROMPT_SCORES_BYTES ((int64_t)16 << 20)
static int prompt_tile_for(int group, int64_t max_context) {
    const int64_t bytes = (int64_t)PROMPT_QUERY_TILE * group * max_context * (int64_t)sizeof(float);
    return bytes <= PROMPT_SCORES_BYTES ? PROMPT_QUERY_TILE : PROMPT_QUERY_TILE / 2;
}
#endif
#elif defined(BARGEIN_NEON)
#define ONE_QUERY_PATH 1
#include "neon_attention_f16.h"
#endif

/* Takes work items (a tile and a share of its heads) until none is left; one short of
 * scratch memory takes none. */
static void run_worker(void *arg, int index, int count) {
    (void)index;
    (void)count;
    f16_batch_t *b = (f16_batch_t *)arg;
    const int64_t cap = b->max_context > 0 ? b->max_context : 1;
    /* Rows of scores and sums: attend_tile's (tile, heads), or attend_prompt's (tile, group)
     * and attend_one's (heads); row: one widened KV row for attend_tile, or a chunk of
     * widened keys for attend_prompt. */
    size_t rows = QUERY_TILE * (size_t)b->num_heads, row_rows = (size_t)b->num_kv_heads;
#ifdef PROMPT_PATH
    if (b->prompt_path) {
        const size_t group = (size_t)(b->num_heads / b->num_kv_heads);
        const size_t tile_rows = (size_t)b->prompt_tile * group;
        rows = tile_rows > (size_t)b->num_heads ? tile_rows : (size_t)b->num_heads;
        row_rows = 2 * PROMPT_KEY_CHUNK; /* a chunk, and its keys transposed */
    }
#endif
    float *scores = malloc(sizeof(float) * rows * (size_t)cap);
    float *row = malloc(sizeof(float) * row_rows * (size_t)b->head_dim);
    float *acc = malloc(sizeof(float) * rows * (size_t)b->head_dim);
    const int parts = b->head_parts, heads = b->num_heads;
    if (scores && row && acc)
        for (int64_t item; (item = atomic_fetch_add(&b->next, 1)) < b->num_tiles * parts;) {
            const int64_t tile = item / parts, first = b->tile_starts[tile];
            const int part = (int)(item % parts), n = (int)(b->tile_starts[tile + 1] - first);
            const int h0 = heads * part / parts, h1 = heads * (part + 1) / parts;
#ifdef ONE_QUERY_PATH
            if (n == 1 && b->head_dim % 64 == 0) {
                attend_one(b, first, h0, h1, scores, acc);
                continue;
            }
#endif
#ifdef PROMPT_PATH
            if (b->prompt_path) {
                attend_prompt(b, first, n, h0, h1, scores, acc, row);
                continue;
            }
#endif
            attend_tile(b, first, n, h0, h1, scores, row, acc);
        }
    free(scores);
    free(row);
    free(acc);
}

int bargein_paged_attention_f16_ex(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                   const int64_t *block_tables, int64_t table_width, const int64_t *query_seq,
                                   const int64_t *query_ctx, float *out, int64_t num_queries, int num_heads,
                                   int num_kv_heads, int head_dim, int block_size, float scale, int64_t window,
                                   float softcap, int num_threads) {
    int64_t *tile_starts = malloc(sizeof(int64_t) * (size_t)(num_queries + 1));
    if (!tile_starts) return -1;
    int64_t num_tiles = 0, max_context = 0;
    for (int64_t i = 0; i < num_queries; i++)
        max_context = query_ctx[i] > max_context ? query_ctx[i] : max_context;
#ifdef PROMPT_PATH
    const int prompt_path = takes_prompt_path(head_dim);
    const int prompt_tile = prompt_path ? prompt_tile_for(num_heads / num_kv_heads, max_context) : 0;
    const int tile = prompt_path ? prompt_tile : QUERY_TILE;
#else
    const int prompt_path = 0, prompt_tile = 0, tile = QUERY_TILE;
#endif
    for (int64_t i = 0; i < num_queries; i++)
        if (i == 0 || query_seq[i] != query_seq[i - 1] || i - tile_starts[num_tiles - 1] == tile)
            tile_starts[num_tiles++] = i;
    tile_starts[num_tiles] = num_queries;
    /* Fewer tiles than threads (one decoding sequence): the tiles' heads are shared out too. */
    const int head_parts = num_tiles >= num_threads ? 1 : (num_heads < num_threads ? num_heads : num_threads);
    if (num_threads > num_tiles * head_parts) num_threads = (int)(num_tiles * head_parts);
    f16_batch_t batch = {q,         k_cache,      v_cache,   block_tables, query_seq,  query_ctx,  out,
                         num_queries, table_width, max_context, num_heads, num_kv_heads, head_dim, block_size,
                         scale,     softcap,      window,    tile_starts,  num_tiles,  head_parts, prompt_path,
                         prompt_tile, 0};
    bargein_parallel_run(run_worker, &batch, num_threads);
    const int failed = atomic_load(&batch.next) < num_tiles * head_parts;
    free(tile_starts);
    return failed ? -1 : 0;
}

int bargein_paged_attention_f16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                const int64_t *block_tables, int64_t table_width, const int64_t *query_seq,
                                const int64_t *query_ctx, float *out, int64_t num_queries, int num_heads,
                                int num_kv_heads, int head_dim, int block_size, float scale, int num_threads) {
    return bargein_paged_attention_f16_ex(q, k_cache, v_cache, block_tables, table_width, query_seq, query_ctx, out,
                                          num_queries, num_heads, num_kv_heads, head_dim, block_size, scale, 0, 0.0f,
                                          num_threads);
}

typedef struct {
    const float *qkv, *cos, *sin;
    const int64_t *slots;
    uint16_t *k_cache, *v_cache;
    float *q_out;
    int64_t num_tokens;
    int num_heads, num_kv_heads, head_dim;
} rope_job_t;

/* x rotated by the angles: out[i] = x[i] cos[i] - x[i + half] sin[i] (first half),
 * x[i] cos[i] + x[i - half] sin[i] (second half), each a product, a product and a sum. */
static inline void rotate(const float *x, const float *cos, const float *sin, int d, float *out) {
    const int half = d / 2;
    for (int i = 0; i < half; i++) out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
    for (int i = half; i < d; i++) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

static void store_halves(const float *src, uint16_t *dst, int n) {
    int i = 0;
#if defined(BARGEIN_AVX2) && defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#elif defined(BARGEIN_NEON)
    neon_store_halves(src, dst, n, &i);
#endif
    for (; i < n; i++) dst[i] = float_to_half(src[i]);
}

static void rope_store_tokens(void *arg, int index, int count) {
    const rope_job_t *job = (const rope_job_t *)arg;
    const int d = job->head_dim, h = job->num_heads, kvh = job->num_kv_heads;
    const int64_t width = (int64_t)(h + 2 * kvh) * d, kv_row = (int64_t)kvh * d;
    float key[kv_row > 0 ? kv_row : 1];
    for (int64_t t = job->num_tokens * index / count; t < job->num_tokens * (index + 1) / count; t++) {
        const float *row = job->qkv + t * width, *cos = job->cos + t * d, *sin = job->sin + t * d;
        for (int i = 0; i < h; i++) rotate(row + (int64_t)i * d, cos, sin, d, job->q_out + (t * h + i) * d);
        for (int i = 0; i < kvh; i++) rotate(row + (int64_t)(h + i) * d, cos, sin, d, key + (int64_t)i * d);
        store_halves(key, job->k_cache + job->slots[t] * kv_row, (int)kv_row);
        store_halves(row + (int64_t)(h + kvh) * d, job->v_cache + job->slots[t] * kv_row, (int)kv_row);
    }
}

void bargein_rope_store_f16(const float *qkv, const float *cos, const float *sin, const int64_t *slots,
                            uint16_t *k_cache, uint16_t *v_cache, float *q_out, int64_t num_tokens, int num_heads,
                            int num_kv_heads, int head_dim, int num_threads) {
    rope_job_t job = {qkv, cos, sin, slots, k_cache, v_cache, q_out, num_tokens, num_heads, num_kv_heads, head_dim};
    const int64_t useful = num_tokens / 16 > 1 ? num_tokens / 16 : 1;
    bargein_parallel_run(rope_store_tokens, &job, (int)(useful < num_threads ? useful : num_threads));
}
