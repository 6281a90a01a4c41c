/*
 * y = x @ W.T for a float32 activation x (m, k) and a weight W (n, k) held in blocks of
 * 32 quantized values along k, as GGUF's Q4_0/Q4_1/Q8_0 hold them:
 *
 *   4-bit: W[j, 32b + i] = scale[j, b] * q + min[j, b], q = nibble i of qs[j, b] (0..15);
 *          byte i of a block holds element i in its low nibble, element i + 16 in its high.
 *   8-bit: W[j, 32b + i] = scale[j, b] * q, q = qs[j, b, i] (int8).
 *
 * For the few rows of decoding the weights dominate the memory traffic, and these are a
 * fifth (4-bit) or a quarter (8-bit) of float32. The arithmetic is float32: each block
 * is widened to floats, scaled, and multiplied into up to eight activation rows at a
 * time (registers hold one accumulator per row), so the result is that of a float32 matmul of
 * the dequantized weight, up to rounding order.
 *
 * Output rows are shared out among num_threads threads (the calling thread is one).
 * k must be a multiple of 32. Returns 0, or -1 when scratch memory could not be had.
 */
#include "parallel.h"
#include "simd.h"
#ifdef BARGEIN_NEON
#include "neon_block_matmul.h"
#endif

#include <stdint.h>
#include <stdlib.h>


#define BLOCK 32
#define ROW_GROUP 8 /* activation rows per pass over a weight row, at most */

typedef struct {
    const float *x, *xsum; /* xsum[r, b]: sum of x's row r over block b (4-bit only) */
    const uint8_t *qs;
    const float *scales, *mins;
    float *y;
    int64_t m, k, n;
    int bits;
} job_t;

/* The 32 values of block b of weight row j, as floats, into w[32] (scaled, min not added). */
static inline void widen_block(const job_t *job, int64_t j, int64_t b, float *w) {
    const int64_t nb = job->k / BLOCK;
    const float s = job->scales[j * nb + b];
    if (job->bits == 4) {
        const uint8_t *q = job->qs + (j * nb + b) * (BLOCK / 2);
        for (int i = 0; i < BLOCK / 2; i++) {
            w[i] = s * (float)(q[i] & 0x0F);
            w[i + BLOCK / 2] = s * (float)(q[i] >> 4);
        }
    } else {
        const int8_t *q = (const int8_t *)job->qs + (j * nb + b) * BLOCK;
        for (int i = 0; i < BLOCK; i++) w[i] = s * (float)q[i];
    }
}

#ifdef BARGEIN_AVX2
/* The q values of block b of weight row j as floats, in four registers (not scaled). */
static inline __attribute__((always_inline)) void widen_block_avx2(const job_t *job, int bits, int64_t j, int64_t b, __m256 w[4]) {
    const int64_t nb = job->k / BLOCK;
    __m128i lo, hi;
    if (bits == 4) {
        const __m128i packed = _mm_loadu_si128((const __m128i *)(job->qs + (j * nb + b) * (BLOCK / 2)));
        const __m128i mask = _mm_set1_epi8(0x0F);
        lo = _mm_and_si128(packed, mask);                     /* elements 0..15 */
        hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);  /* elements 16..31 */
        w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    } else {
        const uint8_t *q = job->qs + (j * nb + b) * BLOCK;
        lo = _mm_loadu_si128((const __m128i *)q);
        hi = _mm_loadu_si128((const __m128i *)(q + 16));
        w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    }
}
#endif

/* y[r, j] for rows r in [r0, r0 + count), count <= ROW_GROUP, without the min term.
 * Each block's q . x is summed unscaled, then scaled into the row's accumulator once:
 * one multiply per block and row instead of one per value. */
static inline __attribute__((always_inline)) void dot_rows_bits(const job_t *job, int bits, int width, int64_t j, int64_t r0, int count,
                                 float *out) {
    const int64_t nb = job->k / BLOCK, k = job->k;
    const float *scales = job->scales + j * nb;
#ifdef BARGEIN_AVX2
    __m256 acc[ROW_GROUP];
    for (int r = 0; r < ROW_GROUP; r++) acc[r] = _mm256_setzero_ps();
#define BARGEIN_ROW(r)                                                                            \
    do {                                                                                          \
        const float *x = job->x + (r0 + (r)) * k + b * BLOCK;                                     \
        const __m256 p0 = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), _mm256_mul_ps(w[0], _mm256_loadu_ps(x))); \
        const __m256 p1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), _mm256_mul_ps(w[2], _mm256_loadu_ps(x + 16))); \
        acc[r] = _mm256_fmadd_ps(s, _mm256_add_ps(p0, p1), acc[r]);                               \
    } while (0)
    for (int64_t b = 0; b < nb; b++) {
        __m256 w[4];
        widen_block_avx2(job, bits, j, b, w);
        const __m256 s = _mm256_broadcast_ss(scales + b);
        /* count is a run-time value; the cases keep the accumulators in registers. The
         * 4-wide copy needs fewer of them, which is faster when 4 rows are all there are. */
        if (width == 4) {
            switch (count) {
            case 4: BARGEIN_ROW(3); /* fall through */
            case 3: BARGEIN_ROW(2); /* fall through */
            case 2: BARGEIN_ROW(1); /* fall through */
            default: BARGEIN_ROW(0);
            }
        } else {
            switch (count) {
            case 8: BARGEIN_ROW(7); /* fall through */
            case 7: BARGEIN_ROW(6); /* fall through */
            case 6: BARGEIN_ROW(5); /* fall through */
            case 5: BARGEIN_ROW(4); /* fall through */
            case 4: BARGEIN_ROW(3); /* fall through */
            case 3: BARGEIN_ROW(2); /* fall through */
            case 2: BARGEIN_ROW(1); /* fall through */
            default: BARGEIN_ROW(0);
            }
        }
    }
#undef BARGEIN_ROW
    for (int r = 0; r < count; r++) out[r] = hsum256(acc[r]);
#elif defined(BARGEIN_NEON)
    (void)width;
    neon_block_dot_rows(job->x + r0 * k, k, job->qs + j * nb * (bits == 4 ? BLOCK / 2 : BLOCK), scales, bits, nb,
                        count, out);
#else
    float w[BLOCK];
    (void)bits;
    (void)width;
    (void)scales;
    for (int r = 0; r < count; r++) out[r] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        widen_block(job, j, b, w);
        for (int r = 0; r < count; r++) {
            const float *x = job->x + (r0 + r) * k + b * BLOCK;
            float s = 0.0f;
            for (int i = 0; i < BLOCK; i++) s += w[i] * x[i];
            out[r] += s;
        }
    }
#endif
}

/* bits as a constant in each copy, so that no block pays for the branch. */
static void dot_rows(const job_t *job, int64_t j, int64_t r0, int count, float *out) {
    if (count <= 4) {
        if (job->bits == 4)
            dot_rows_bits(job, 4, 4, j, r0, count, out);
        else
            dot_rows_bits(job, 8, 4, j, r0, count, out);
    } else if (job->bits == 4) {
        dot_rows_bits(job, 4, 8, j, r0, count, out);
    } else {
        dot_rows_bits(job, 8, 8, j, r0, count, out);
    }
}

/* Output rows [n * index / count, n * (index + 1) / count). */
static void run_job(void *arg, int index, int count) {
    const job_t *job = (const job_t *)arg;
    const int64_t nb = job->k / BLOCK;
    for (int64_t j = job->n * index / count; j < job->n * (index + 1) / count; j++) {
        for (int64_t r0 = 0; r0 < job->m; r0 += ROW_GROUP) {
            const int count = job->m - r0 < ROW_GROUP ? (int)(job->m - r0) : ROW_GROUP;
            float out[ROW_GROUP];
            dot_rows(job, j, r0, count, out);
            for (int r = 0; r < count; r++) {
                float total = out[r];
                if (job->bits == 4) { /* + sum_b min[j, b] * xsum[r, b] */
                    const float *mins = job->mins + j * nb, *xs = job->xsum + (r0 + r) * nb;
                    for (int64_t b = 0; b < nb; b++) total += mins[b] * xs[b];
                }
                job->y[(r0 + r) * job->n + j] = total;
            }
        }
    }
}

int bargein_block_matmul(const float *x, int64_t m, int64_t k, const uint8_t *qs, const float *scales,
                         const float *mins, int bits, int64_t n, float *y, int num_threads) {
    const int64_t nb = k / BLOCK;
    float *xsum = NULL;
    if (bits == 4) {
        xsum = malloc(sizeof(float) * (size_t)(m * nb > 0 ? m * nb : 1));
        if (!xsum) return -1;
        for (int64_t r = 0; r < m; r++)
            for (int64_t b = 0; b < nb; b++) {
                float s = 0.0f;
                for (int i = 0; i < BLOCK; i++) s += x[r * k + b * BLOCK + i];
                xsum[r * nb + b] = s;
            }
    }
    if (num_threads > n) num_threads = (int)n;
    job_t job = {x, xsum, qs, scales, mins, y, m, k, n, bits};
    bargein_parallel_run(run_job, &job, num_threads);
    free(xsum);
    return 0;
}
