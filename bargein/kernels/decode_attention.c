/*
 * Paged decode attention in float32 for the CPU: one query token per sequence,
 * attending straight from the block-structured KV cache (no gather copy).
 *
 * Contract (checked by the Python caller, bargein/kernels/native.py):
 *   q            (num_seqs, num_heads, head_dim), contiguous
 *   k_cache      (num_blocks, block_size, num_kv_heads, head_dim), contiguous; v_cache alike
 *   block_tables (num_seqs, table_width) int64; row i names sequence i's blocks in order
 *   context_lens (num_seqs,) int64; sequence i attends to its first context_lens[i] positions
 *   out          (num_seqs, num_heads, head_dim), written in full
 * Query head h reads KV head h / (num_heads / num_kv_heads), as grouped-query attention
 * does. Sequences are shared out among num_threads threads (the calling thread is one).
 * Returns 0, or -1 when scratch memory could not be had.
 *
 * Why a kernel of our own: with one query per sequence, PyTorch needs the sequences'
 * blocks gathered into a padded copy and then runs its flash kernel one head at a time,
 * reading each KV head once per query head. Here a sequence's K rows, then its V rows,
 * are streamed once, in order, each row (all KV heads of a token) serving every query
 * head; the rows ahead are prefetched, since block tables scatter them over the pool
 * where the hardware prefetcher cannot follow.
 */
#include "exp.h"
#include "parallel.h"
#include "simd.h"

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>


#define QUERY_GROUP 4    /* query heads scored together against one key */
#define PREFETCH_AHEAD 4 /* tokens */

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *block_tables, *context_lens;
    float *out;
    int64_t num_seqs, table_width, max_context;
    int num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    atomic_llong next_seq; /* the next sequence a thread may take */
} batch_t;


static inline void prefetch_row(const float *row, int64_t bytes) {
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch((const char *)row + c, 0, 3);
}

/* Where token t's row (all KV heads) starts in a cache, for t < ctx, without a division per token. */
static void token_offsets(const batch_t *b, const int64_t *table, int64_t ctx, int64_t *offsets) {
    const int64_t row = (int64_t)b->num_kv_heads * b->head_dim;
    for (int64_t t = 0, i = 0; t < ctx; i++) {
        const int64_t base = table[i] * b->block_size * row;
        for (int o = 0; o < b->block_size && t < ctx; o++, t++) offsets[t] = base + o * row;
    }
}

/* scores[h * ctx + t] = scale * <q_h, k_t> for every head h and token t < ctx. */
static void score_keys(const batch_t *b, const float *qs, const int64_t *offsets, int64_t ctx, float *scores) {
    const int n_heads = b->num_heads, n_kv = b->num_kv_heads, d_len = b->head_dim, group = n_heads / n_kv;
    const int64_t row_bytes = (int64_t)n_kv * d_len * (int64_t)sizeof(float);
    for (int64_t t = 0; t < ctx; t++) {
        if (t + PREFETCH_AHEAD < ctx) prefetch_row(b->k_cache + offsets[t + PREFETCH_AHEAD], row_bytes);
        const float *row = b->k_cache + offsets[t];
        for (int kv = 0; kv < n_kv; kv++) {
            const float *k = row + (int64_t)kv * d_len;
#ifdef BARGEIN_AVX2
            if (d_len % 8 == 0) {
                for (int g0 = 0; g0 < group; g0 += QUERY_GROUP) {
                    const int n = group - g0 < QUERY_GROUP ? group - g0 : QUERY_GROUP;
                    const float *q[QUERY_GROUP];
                    for (int g = 0; g < QUERY_GROUP; g++) /* rows past the group repeat its first; dropped */
                        q[g] = qs + (int64_t)(kv * group + g0 + (g < n ? g : 0)) * d_len;
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                    for (int d = 0; d < d_len; d += 8) {
                        const __m256 kd = _mm256_loadu_ps(k + d);
                        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q[0] + d), kd, a0);
                        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q[1] + d), kd, a1);
                        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q[2] + d), kd, a2);
                        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q[3] + d), kd, a3);
                    }
                    /* Four horizontal sums at once: lane g holds the sum of a_g. */
                    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
                    float lanes[QUERY_GROUP];
                    _mm_storeu_ps(lanes, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
                    for (int g = 0; g < n; g++) scores[(int64_t)(kv * group + g0 + g) * ctx + t] = lanes[g] * b->scale;
                }
                continue;
            }
#elif defined(BARGEIN_NEON)
            if (d_len % 8 == 0) { /* the AVX2 body's arithmetic (arm64_simd.h) */
                for (int g0 = 0; g0 < group; g0 += QUERY_GROUP) {
                    const int n = group - g0 < QUERY_GROUP ? group - g0 : QUERY_GROUP;
                    const float *q[QUERY_GROUP];
                    for (int g = 0; g < QUERY_GROUP; g++) q[g] = qs + (int64_t)(kv * group + g0 + (g < n ? g : 0)) * d_len;
                    float lanes[QUERY_GROUP];
                    vst1q_f32(lanes, neon_dot4(q, k, d_len));
                    for (int g = 0; g < n; g++) scores[(int64_t)(kv * group + g0 + g) * ctx + t] = lanes[g] * b->scale;
                }
                continue;
            }
#endif
            for (int g = 0; g < group; g++) {
                const float *q = qs + (int64_t)(kv * group + g) * d_len;
                float s = 0.0f;
                for (int d = 0; d < d_len; d++) s += q[d] * k[d];
                scores[(int64_t)(kv * group + g) * ctx + t] = s * b->scale;
            }
        }
    }
}

/* Turns a row of scores into exp(s - max) in place; returns 1 / their sum. */
static float softmax_row(float *s, int64_t ctx) {
    float m = s[0];
    for (int64_t t = 1; t < ctx; t++) m = s[t] > m ? s[t] : m;
    float sum = 0.0f;
    int64_t t = 0;
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

/* out_h = inv_h * sum_t p[h * ctx + t] * v_t for every head h; acc is (heads, head_dim) scratch. */
static void weigh_values(const batch_t *b, const int64_t *offsets, int64_t ctx, const float *p,
                         const float *inv, float *acc, float *out) {
    const int n_heads = b->num_heads, n_kv = b->num_kv_heads, d_len = b->head_dim, group = n_heads / n_kv;
    const int64_t row_bytes = (int64_t)n_kv * d_len * (int64_t)sizeof(float);
    for (int64_t i = 0; i < (int64_t)n_heads * d_len; i++) acc[i] = 0.0f;
    for (int64_t t = 0; t < ctx; t++) {
        if (t + PREFETCH_AHEAD < ctx) prefetch_row(b->v_cache + offsets[t + PREFETCH_AHEAD], row_bytes);
        const float *row = b->v_cache + offsets[t];
        for (int h = 0; h < n_heads; h++) {
            const float *v = row + (int64_t)(h / group) * d_len;
            const float w = p[(int64_t)h * ctx + t];
            float *a = acc + (int64_t)h * d_len;
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
    for (int h = 0; h < n_heads; h++)
        for (int d = 0; d < d_len; d++) out[(int64_t)h * d_len + d] = acc[(int64_t)h * d_len + d] * inv[h];
}

/* Takes sequences until none is left; one short of scratch memory takes none. */
static void run_worker(void *arg, int index, int count) {
    (void)index;
    (void)count;
    batch_t *b = (batch_t *)arg;
    const int64_t cap = b->max_context > 0 ? b->max_context : 1;
    float *scores = malloc(sizeof(float) * (size_t)b->num_heads * (size_t)cap);
    float *acc = malloc(sizeof(float) * (size_t)b->num_heads * (size_t)b->head_dim);
    float *inv = malloc(sizeof(float) * (size_t)b->num_heads);
    int64_t *offsets = malloc(sizeof(int64_t) * (size_t)cap);
    if (scores && acc && inv && offsets) {
        const int64_t per_seq = (int64_t)b->num_heads * b->head_dim;
        for (int64_t seq; (seq = atomic_fetch_add(&b->next_seq, 1)) < b->num_seqs;) {
            const int64_t ctx = b->context_lens[seq];
            token_offsets(b, b->block_tables + seq * b->table_width, ctx, offsets);
            score_keys(b, b->q + seq * per_seq, offsets, ctx, scores);
            for (int h = 0; h < b->num_heads; h++) inv[h] = softmax_row(scores + (int64_t)h * ctx, ctx);
            weigh_values(b, offsets, ctx, scores, inv, acc, b->out + seq * per_seq);
        }
    }
    free(scores);
    free(acc);
    free(inv);
    free(offsets);
}

int bargein_paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                                   const int64_t *block_tables, const int64_t *context_lens,
                                   float *out, int64_t num_seqs, int64_t table_width, int num_heads,
                                   int num_kv_heads, int head_dim, int block_size, float scale,
                                   int num_threads) {
    if (num_threads > num_seqs) num_threads = (int)num_seqs;
    batch_t batch = {q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, table_width, 0,
                     num_heads, num_kv_heads, head_dim, block_size, scale, 0};
    for (int64_t i = 0; i < num_seqs; i++)
        batch.max_context = context_lens[i] > batch.max_context ? context_lens[i] : batch.max_context;
    bargein_parallel_run(run_worker, &batch, num_threads);
    /* Sequences are left over only if every worker lacked scratch memory. */
    return atomic_load(&batch.next_seq) < num_seqs ? -1 : 0;
}
