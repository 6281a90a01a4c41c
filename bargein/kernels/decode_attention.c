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
 * does. Work is split over (sequence, KV head) pairs across num_threads threads; the
 * calling thread takes a share. Returns 0, or -1 when scratch memory could not be had.
 *
 * Why a kernel of our own: with one query per sequence, PyTorch needs the sequences'
 * blocks gathered into a padded copy and then runs its flash kernel one head at a time,
 * reading each KV head once per query head; here every key and value is read once from
 * where it lies, for all the query heads that share it.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BARGEIN_AVX2 1
#endif

#define QUERY_GROUP 4 /* query heads scored together per pass over the keys */

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *block_tables, *context_lens;
    float *out;
    int64_t table_width;
    int num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int64_t unit_begin, unit_end; /* units are (sequence, KV head) pairs */
    int64_t max_context;
    int status;
} job_t;

#ifdef BARGEIN_AVX2
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for x <= 0 (softmax after subtracting the maximum): Cephes' expf, ~1 ulp. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365478515625f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* scores[g * ctx + t] = scale * <q_g, k_t> for the group's queries q[0..n). */
static void score_keys(const job_t *j, const int64_t *table, int64_t ctx, int kv_head,
                       const float *const *q, int n, float *scores) {
    const int d_len = j->head_dim, bs = j->block_size;
    const int64_t row = (int64_t)j->num_kv_heads * d_len;
    for (int64_t t = 0; t < ctx; t++) {
        const float *k = j->k_cache + (table[t / bs] * bs + t % bs) * row + (int64_t)kv_head * d_len;
#ifdef BARGEIN_AVX2
        if (d_len % 8 == 0) {
            __m256 acc[QUERY_GROUP];
            for (int g = 0; g < QUERY_GROUP; g++) acc[g] = _mm256_setzero_ps();
            for (int d = 0; d < d_len; d += 8) {
                __m256 kv = _mm256_loadu_ps(k + d);
                for (int g = 0; g < QUERY_GROUP; g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d), kv, acc[g]);
            }
            for (int g = 0; g < n; g++) scores[g * ctx + t] = hsum256(acc[g]) * j->scale;
            continue;
        }
#endif
        for (int g = 0; g < n; g++) {
            float s = 0.0f;
            for (int d = 0; d < d_len; d++) s += q[g][d] * k[d];
            scores[g * ctx + t] = s * j->scale;
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
    __m256 vm = _mm256_set1_ps(m), vsum = _mm256_setzero_ps();
    for (; t + 8 <= ctx; t += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
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

/* out_g = inv_g * sum_t p[g * ctx + t] * v_t for the group's queries. */
static void weigh_values(const job_t *j, const int64_t *table, int64_t ctx, int kv_head,
                         const float *p, const float *inv, float *const *out, int n) {
    const int d_len = j->head_dim, bs = j->block_size;
    const int64_t row = (int64_t)j->num_kv_heads * d_len;
    const float *v0 = j->v_cache + (int64_t)kv_head * d_len;
#ifdef BARGEIN_AVX2
    if (d_len % 8 == 0) {
        for (int d = 0; d < d_len; d += 8) {
            __m256 acc[QUERY_GROUP];
            for (int g = 0; g < QUERY_GROUP; g++) acc[g] = _mm256_setzero_ps();
            for (int64_t t = 0; t < ctx; t++) {
                __m256 vv = _mm256_loadu_ps(v0 + (table[t / bs] * bs + t % bs) * row + d);
                for (int g = 0; g < n; g++) acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * ctx + t]), vv, acc[g]);
            }
            for (int g = 0; g < n; g++) _mm256_storeu_ps(out[g] + d, _mm256_mul_ps(acc[g], _mm256_set1_ps(inv[g])));
        }
        return;
    }
#endif
    for (int g = 0; g < n; g++)
        for (int d = 0; d < d_len; d++) out[g][d] = 0.0f;
    for (int64_t t = 0; t < ctx; t++) {
        const float *v = v0 + (table[t / bs] * bs + t % bs) * row;
        for (int g = 0; g < n; g++)
            for (int d = 0; d < d_len; d++) out[g][d] += p[g * ctx + t] * v[d];
    }
    for (int g = 0; g < n; g++)
        for (int d = 0; d < d_len; d++) out[g][d] *= inv[g];
}

static void *run_job(void *arg) {
    job_t *j = (job_t *)arg;
    float *scores = malloc(sizeof(float) * QUERY_GROUP * (size_t)(j->max_context > 0 ? j->max_context : 1));
    if (!scores) {
        j->status = -1;
        return NULL;
    }
    const int group = j->num_heads / j->num_kv_heads, d_len = j->head_dim;
    for (int64_t unit = j->unit_begin; unit < j->unit_end; unit++) {
        const int64_t seq = unit / j->num_kv_heads;
        const int kv_head = (int)(unit % j->num_kv_heads);
        const int64_t ctx = j->context_lens[seq];
        const int64_t *table = j->block_tables + seq * j->table_width;
        for (int g0 = 0; g0 < group; g0 += QUERY_GROUP) {
            const int n = group - g0 < QUERY_GROUP ? group - g0 : QUERY_GROUP;
            const float *q[QUERY_GROUP];
            float *out[QUERY_GROUP];
            float inv[QUERY_GROUP];
            for (int g = 0; g < QUERY_GROUP; g++) {
                /* Rows past the group repeat its first query; their results are dropped. */
                const int64_t head = (int64_t)kv_head * group + g0 + (g < n ? g : 0);
                q[g] = j->q + (seq * j->num_heads + head) * d_len;
                out[g] = j->out + (seq * j->num_heads + head) * d_len;
            }
            score_keys(j, table, ctx, kv_head, q, n, scores);
            for (int g = 0; g < n; g++) inv[g] = softmax_row(scores + g * ctx, ctx);
            weigh_values(j, table, ctx, kv_head, scores, inv, out, n);
        }
    }
    free(scores);
    return NULL;
}

int bargein_paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                                   const int64_t *block_tables, const int64_t *context_lens,
                                   float *out, int64_t num_seqs, int64_t table_width, int num_heads,
                                   int num_kv_heads, int head_dim, int block_size, float scale,
                                   int num_threads) {
    enum { MAX_THREADS = 256 };
    job_t jobs[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    const int64_t units = num_seqs * num_kv_heads;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    if (num_threads > units) num_threads = units > 0 ? (int)units : 1;
    int64_t max_context = 0;
    for (int64_t i = 0; i < num_seqs; i++) max_context = context_lens[i] > max_context ? context_lens[i] : max_context;
    for (int i = 0; i < num_threads; i++) {
        jobs[i] = (job_t){q, k_cache, v_cache, block_tables, context_lens, out, table_width,
                          num_heads, num_kv_heads, head_dim, block_size, scale,
                          units * i / num_threads, units * (i + 1) / num_threads, max_context, 0};
    }
    for (int i = 1; i < num_threads; i++) started[i] = pthread_create(&threads[i], NULL, run_job, &jobs[i]) == 0;
    for (int i = 1; i < num_threads; i++)
        if (!started[i]) run_job(&jobs[i]); /* no thread to be had: do its share here */
    run_job(&jobs[0]);
    int status = 0;
    for (int i = 1; i < num_threads; i++) {
        if (started[i]) pthread_join(threads[i], NULL);
        status |= jobs[i].status;
    }
    return status | jobs[0].status;
}
