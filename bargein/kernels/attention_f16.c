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
 * Why one kernel for every query: a token's output then depends only on its query, its
 * context length and the cached keys and values, never on how many other queries share
 * the call, how the threads share them out, or whether the token came in a prompt chunk
 * or as a decode. A decode step and a prefill of the same tokens write and read the same
 * K/V and get the same numbers, bit for bit, which the cancellation contract (C4) needs
 * in this mode. Queries are shared out among threads whole.
 *
 * Returns 0, or -1 when scratch memory could not be had.
 */
#include "parallel.h"
#include "simd.h"

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
    float scale;
    atomic_llong next; /* the next query a thread may take */
} f16_batch_t;

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

/* n halves to floats (conversion is exact, so any path gives the same values). */
static inline void widen_row(const uint16_t *src, float *dst, int n) {
    int i = 0;
#if defined(BARGEIN_AVX2) && defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
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
#endif
    for (; i < n; i++) total += a[i] * b[i];
    return total;
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
#endif
    for (; t < ctx; t++) {
        s[t] = expf(s[t] - m);
        sum += s[t];
    }
    return 1.0f / sum;
}

/* One query: scores (heads x ctx), softmax, weighted values into out (heads x head_dim). */
static void attend(const f16_batch_t *b, int64_t query, float *scores, float *row, float *acc) {
    const int n_heads = b->num_heads, n_kv = b->num_kv_heads, d_len = b->head_dim, group = n_heads / n_kv;
    const int64_t ctx = b->query_ctx[query], row_len = (int64_t)n_kv * d_len;
    const int64_t *table = b->block_tables + b->query_seq[query] * b->table_width;
    const float *q = b->q + query * (int64_t)n_heads * d_len;
    for (int64_t t = 0; t < ctx; t++) {
        const int64_t slot = table[t / b->block_size] * b->block_size + t % b->block_size;
        widen_row(b->k_cache + slot * row_len, row, (int)row_len);
        for (int h = 0; h < n_heads; h++)
            scores[(int64_t)h * ctx + t] = dot(q + (int64_t)h * d_len, row + (int64_t)(h / group) * d_len, d_len) * b->scale;
    }
    float inv[n_heads];
    for (int h = 0; h < n_heads; h++) inv[h] = softmax_row(scores + (int64_t)h * ctx, ctx);
    for (int64_t i = 0; i < (int64_t)n_heads * d_len; i++) acc[i] = 0.0f;
    for (int64_t t = 0; t < ctx; t++) {
        const int64_t slot = table[t / b->block_size] * b->block_size + t % b->block_size;
        widen_row(b->v_cache + slot * row_len, row, (int)row_len);
        for (int h = 0; h < n_heads; h++) {
            const float *v = row + (int64_t)(h / group) * d_len, w = scores[(int64_t)h * ctx + t];
            float *a = acc + (int64_t)h * d_len;
            int d = 0;
#ifdef BARGEIN_AVX2
            const __m256 vw = _mm256_set1_ps(w);
            for (; d + 8 <= d_len; d += 8)
                _mm256_storeu_ps(a + d, _mm256_fmadd_ps(vw, _mm256_loadu_ps(v + d), _mm256_loadu_ps(a + d)));
#endif
            for (; d < d_len; d++) a[d] += w * v[d];
        }
    }
    float *out = b->out + query * (int64_t)n_heads * d_len;
    for (int h = 0; h < n_heads; h++)
        for (int d = 0; d < d_len; d++) out[(int64_t)h * d_len + d] = acc[(int64_t)h * d_len + d] * inv[h];
}

/* Takes queries until none is left; one short of scratch memory takes none. */
static void run_worker(void *arg, int index, int count) {
    (void)index;
    (void)count;
    f16_batch_t *b = (f16_batch_t *)arg;
    const int64_t cap = b->max_context > 0 ? b->max_context : 1;
    float *scores = malloc(sizeof(float) * (size_t)b->num_heads * (size_t)cap);
    float *row = malloc(sizeof(float) * (size_t)b->num_kv_heads * (size_t)b->head_dim);
    float *acc = malloc(sizeof(float) * (size_t)b->num_heads * (size_t)b->head_dim);
    if (scores && row && acc)
        for (int64_t query; (query = atomic_fetch_add(&b->next, 1)) < b->num_queries;) attend(b, query, scores, row, acc);
    free(scores);
    free(row);
    free(acc);
}

int bargein_paged_attention_f16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                const int64_t *block_tables, int64_t table_width, const int64_t *query_seq,
                                const int64_t *query_ctx, float *out, int64_t num_queries, int num_heads,
                                int num_kv_heads, int head_dim, int block_size, float scale, int num_threads) {
    if (num_threads > num_queries) num_threads = (int)num_queries;
    f16_batch_t batch = {q, k_cache, v_cache, block_tables, query_seq, query_ctx, out, num_queries, table_width, 0,
                         num_heads, num_kv_heads, head_dim, block_size, scale, 0};
    for (int64_t i = 0; i < num_queries; i++)
        batch.max_context = query_ctx[i] > batch.max_context ? query_ctx[i] : batch.max_context;
    bargein_parallel_run(run_worker, &batch, num_threads);
    return atomic_load(&batch.next) < num_queries ? -1 : 0;
}
