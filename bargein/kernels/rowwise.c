/*
 * Row-wise operations of the `fast` precision whose every row is computed by the same
 * code in the same order, whatever the number of rows or threads (PyTorch's reductions
 * and vectorised transcendental functions may split a row differently with the shape).
 *
 *   rms norm:  y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, x and y (m, n)
 *   silu mul:  y[r, i] = silu(a[r, i]) * b[r, i], a and b the two halves of x[r] (m, 2n),
 *              y (m, n): the gate and up projections fused in one matmul output
 *   gelu mul:  y[r, i] = gelu_tanh(a[r, i]) * b[r, i], likewise (GeGLU, Gemma), with
 *              gelu_tanh(a) = a / 2 * (1 + tanh(sqrt(2 / pi) * (a + 0.044715 a^3)))
 *   soft cap:  y[r, i] = cap * tanh(x[r, i] / cap), x and y (m, n) (Gemma 2's logits)
 * The last two use tanh.h's tanh (not libm's, whose tanhf rounds apart on x86-64 and AArch64):
 * its vector bodies give its scalar bargein_tanhf's bits lane for lane, so an element's bits
 * depend neither on the path that computes it (vector body or tail) nor on the architecture.
 * SiLU's exp is exp.h's, in the vector bodies and the scalar tail alike, so an element's
 * bits do not depend on the path that computes it, nor on the architecture.
 *
 * Rows are shared out among threads whole. Float32, contiguous.
 */
#include "exp.h"
#include "parallel.h"
#include "simd.h"
#include "tanh.h"

#include <math.h>
#include <stdint.h>

typedef struct {
    const float *x, *w;
    float *y;
    int64_t m, n;
    float eps;
} rows_t;

static void rms_norm_rows(void *arg, int index, int count) {
    const rows_t *job = (const rows_t *)arg;
    const int64_t n = job->n;
    for (int64_t r = job->m * index / count; r < job->m * (index + 1) / count; r++) {
        const float *x = job->x + r * n;
        float *y = job->y + r * n;
        int64_t i = 0;
        float sum = 0.0f;
#ifdef BARGEIN_AVX2
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        sum = hsum256(acc);
#elif defined(BARGEIN_NEON)
        sum = neon_sum_squares(x, n, &i);
#endif
        for (; i < n; i++) sum += x[i] * x[i];
        const float inv = 1.0f / sqrtf(sum / (float)n + job->eps);
        for (i = 0; i < n; i++) y[i] = x[i] * inv * job->w[i];
    }
}

/* silu(a) = a / (1 + e^-a) for a >= 0, a e^a / (1 + e^a) below: e^-|a| only, so nothing
 * overflows. The vector bodies' steps, one lane's worth: every element gets the same bits
 * whether a vector body or this tail computes it (bargein_expf is exp256's bits). */
static inline float silu(float a) {
    const float e = bargein_expf(-fabsf(a));
    return (a < 0.0f ? a * e : a) / (1.0f + e);
}

static void silu_mul_rows(void *arg, int index, int count) {
    const rows_t *job = (const rows_t *)arg;
    const int64_t n = job->n;
    for (int64_t r = job->m * index / count; r < job->m * (index + 1) / count; r++) {
        const float *a = job->x + r * 2 * n, *b = a + n;
        float *y = job->y + r * n;
        int64_t i = 0;
#ifdef BARGEIN_AVX2
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= n; i += 8) {
            const __m256 va = _mm256_loadu_ps(a + i);
            const __m256 e = exp256(_mm256_or_ps(va, sign)); /* e^-|a| */
            const __m256 neg = _mm256_cmp_ps(va, _mm256_setzero_ps(), _CMP_LT_OQ);
            const __m256 num = _mm256_blendv_ps(va, _mm256_mul_ps(va, e), neg);
            const __m256 s = _mm256_div_ps(num, _mm256_add_ps(one, e));
            _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_loadu_ps(b + i)));
        }
#elif defined(BARGEIN_NEON)
        neon_silu_mul(a, b, y, n, &i);
#endif
        for (; i < n; i++) y[i] = silu(a[i]) * b[i];
    }
}

static void gelu_tanh_mul_rows(void *arg, int index, int count) {
    const rows_t *job = (const rows_t *)arg;
    const int64_t n = job->n;
    const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
    for (int64_t r = job->m * index / count; r < job->m * (index + 1) / count; r++) {
        const float *a = job->x + r * 2 * n, *b = a + n;
        float *y = job->y + r * n;
        int64_t i = 0;
#ifdef BARGEIN_AVX2
        const __m256 vk = _mm256_set1_ps(k), cube = _mm256_set1_ps(0.044715f), half = _mm256_set1_ps(0.5f);
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= n; i += 8) { /* the scalar steps below, lane by lane */
            const __m256 x = _mm256_loadu_ps(a + i);
            const __m256 c = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(cube, x), x), x);
            const __m256 th = bargein_tanh256(_mm256_mul_ps(vk, _mm256_add_ps(x, c)));
            const __m256 g = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, th));
            _mm256_storeu_ps(y + i, _mm256_mul_ps(g, _mm256_loadu_ps(b + i)));
        }
#elif defined(BARGEIN_NEON)
        const float32x4_t vk = vdupq_n_f32(k), cube = vdupq_n_f32(0.044715f), half = vdupq_n_f32(0.5f);
        const float32x4_t one = vdupq_n_f32(1.0f);
        for (; i + 4 <= n; i += 4) {
            const float32x4_t x = vld1q_f32(a + i);
            const float32x4_t c = vmulq_f32(vmulq_f32(vmulq_f32(cube, x), x), x);
            const float32x4_t th = bargein_tanh4(vmulq_f32(vk, vaddq_f32(x, c)));
            const float32x4_t g = vmulq_f32(vmulq_f32(half, x), vaddq_f32(one, th));
            vst1q_f32(y + i, vmulq_f32(g, vld1q_f32(b + i)));
        }
#endif
        for (; i < n; i++) {
            const float x = a[i], inner = k * (x + 0.044715f * x * x * x);
            y[i] = 0.5f * x * (1.0f + bargein_tanhf(inner)) * b[i];
        }
    }
}

static void softcap_rows(void *arg, int index, int count) {
    const rows_t *job = (const rows_t *)arg;
    const int64_t n = job->n;
    const float cap = job->eps;
    for (int64_t r = job->m * index / count; r < job->m * (index + 1) / count; r++) {
        const float *x = job->x + r * n;
        float *y = job->y + r * n;
        int64_t i = 0;
#ifdef BARGEIN_AVX2
        const __m256 vcap = _mm256_set1_ps(cap);
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(y + i, _mm256_mul_ps(vcap, bargein_tanh256(_mm256_div_ps(_mm256_loadu_ps(x + i), vcap))));
#elif defined(BARGEIN_NEON)
        const float32x4_t vcap = vdupq_n_f32(cap);
        for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vmulq_f32(vcap, bargein_tanh4(vdivq_f32(vld1q_f32(x + i), vcap))));
#endif
        for (; i < n; i++) y[i] = cap * bargein_tanhf(x[i] / cap);
    }
}

static int row_threads(int64_t m, int num_threads) {
    /* A row is a few microseconds of work: waking threads pays only for many rows. */
    const int64_t useful = m / 8;
    return (int)(useful < num_threads ? (useful > 1 ? useful : 1) : num_threads);
}

void bargein_rms_norm(const float *x, const float *w, float *y, int64_t m, int64_t n, float eps, int num_threads) {
    rows_t job = {x, w, y, m, n, eps};
    bargein_parallel_run(rms_norm_rows, &job, row_threads(m, num_threads));
}

void bargein_silu_mul(const float *x, float *y, int64_t m, int64_t n, int num_threads) {
    rows_t job = {x, 0, y, m, n, 0.0f};
    bargein_parallel_run(silu_mul_rows, &job, row_threads(m, num_threads));
}

void bargein_gelu_tanh_mul(const float *x, float *y, int64_t m, int64_t n, int num_threads) {
    rows_t job = {x, 0, y, m, n, 0.0f};
    bargein_parallel_run(gelu_tanh_mul_rows, &job, row_threads(m, num_threads));
}

void bargein_softcap(const float *x, float *y, int64_t m, int64_t n, float cap, int num_threads) {
    rows_t job = {x, 0, y, m, n, cap};
    bargein_parallel_run(softcap_rows, &job, row_threads(m, num_threads));
}
