/*
 * y = x @ W.T with the activations quantized to 8 bits, for the `fast` precision.
 *
 * W (n, k) is held in blocks of 32 along k (see block_matmul.c for the layout):
 *   4-bit: W[j, 32b + i] = scale[j, b] * q + min[j, b], q in 0..15;
 *   8-bit: W[j, 32b + i] = scale[j, b] * q, q in -127..127.
 * Each row of x is quantized block by block as llama.cpp's q8 does: d = max|x| / 127,
 * xq = round(x / d) in -127..127, and for 4-bit weights also xs = d * sum(xq). Then
 *
 *   y[r, j] = sum_b scale[j, b] d[r, b] <q_j,b, xq_r,b> + sum_b min[j, b] xs[r, b],
 *
 * where <., .> is an exact integer dot product over the block's 32 values.
 *
 * Batch and thread invariance. Every output element is computed by one thread, in one
 * fixed order that depends on nothing but k: the integer dot of a block is formed in
 * eight 32-bit lanes (lane l holds elements 4l..4l+3, exactly what vpdpbusd and
 * maddubs + madd produce), each lane is scaled into its own float accumulator with one
 * fused multiply-add per block (by d = scale * d_x, one rounded product), even blocks
 * into one set of eight accumulators and odd blocks into another (a 512-bit register
 * holds both), the min term min * xs of block b goes (a product, then a sum) to lane
 * b % 8 of a third set, and at the end the even and odd sets are added lane by lane and
 * summed in a fixed tree, plus the min set's tree. Rows are grouped only to reuse a weight block across
 * them, and work is split over output columns, never over k; so row r of an m-row call
 * equals a 1-row call of that row, for any thread count, bit for bit. The instruction
 * sets (AVX-512 VNNI, AVX2, plain C) compute the very same lanes
 * and the same float operations, so they agree bit for bit too.
 *
 * The instruction set is chosen at run time from the CPU (isa < 0: AVX2 where present, it
 * measured faster than the 512-bit VNNI path on Zen 4; else plain C), or forced (tests):
 * 0 plain C, 1 AVX2, 2 AVX-512 VNNI. Returns 0, -1 when scratch memory could not be had,
 * -2 when the forced instruction set is not available here.
 */
#include "parallel.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define BARGEIN_X86 1
/* Compilers old enough to lack the AVX-512 VNNI target (GCC < 9) build without that path. */
#if defined(__clang__) ? __clang_major__ >= 7 : __GNUC__ >= 9
#define BARGEIN_VNNI 1
#endif
#endif

#define BLOCK 32
#define LANES 8
#define CHUNK 8        /* blocks whose scales are formed in one vector */
#define COLUMN_TILE 16 /* output columns whose weight rows are reused by every row group */
#define ROWS 8         /* activation rows per pass over a weight block, at most */
#define ROWS_AVX2 4    /* two accumulators a row: eight fill AVX2's sixteen registers with the rest */

enum { ISA_C = 0, ISA_AVX2 = 1, ISA_VNNI = 2 };

typedef struct {
    const int8_t *xq;     /* (m, k) quantized activations */
    const float *xd, *xs; /* (m, nb): block scales d_x, and d_x * sum(xq) */
    const uint8_t *qs;
    const float *scales, *mins;
    float *y;
    int64_t m, k, n;
    int bits;
} qjob_t;

typedef struct {
    const float *x;
    int8_t *xq;
    float *xd, *xs;
    int64_t m, k;
} quant_job_t;

/* The eight lanes into one number, in the order hsum256 (simd.h) adds them. */
static inline float sum_lanes(const float a[LANES]) {
    const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
    return (s0 + s2) + (s1 + s3);
}

/* Rows [m * index / count, m * (index + 1) / count) of x into blocks of int8. */
static void quantize_rows(void *arg, int index, int count) {
    const quant_job_t *job = (const quant_job_t *)arg;
    const int64_t nb = job->k / BLOCK;
    for (int64_t r = job->m * index / count; r < job->m * (index + 1) / count; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *x = job->x + r * job->k + b * BLOCK;
            int8_t *q = job->xq + r * job->k + b * BLOCK;
            float amax = 0.0f;
            for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(x[i]));
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int i = 0; i < BLOCK; i++) {
                const int v = (int)rintf(x[i] * inv); /* |v| <= 127: x[i] * inv rounds to at most 127 */
                q[i] = (int8_t)(v > 127 ? 127 : (v < -127 ? -127 : v));
                sum += q[i];
            }
            job->xd[r * nb + b] = d;
            job->xs[r * nb + b] = d * (float)sum;
        }
    }
}

/* ---- plain C ------------------------------------------------------------------------ */

static void block_values(const qjob_t *job, int64_t j, int64_t b, int w[BLOCK]) {
    const int64_t nb = job->k / BLOCK;
    if (job->bits == 4) {
        const uint8_t *q = job->qs + (j * nb + b) * (BLOCK / 2);
        for (int i = 0; i < BLOCK / 2; i++) {
            w[i] = q[i] & 0x0F;
            w[i + BLOCK / 2] = q[i] >> 4;
        }
    } else {
        const int8_t *q = (const int8_t *)job->qs + (j * nb + b) * BLOCK;
        for (int i = 0; i < BLOCK; i++) w[i] = q[i];
    }
}

static void column_c(const qjob_t *job, int64_t j, int64_t r0, int count) {
    const int64_t nb = job->k / BLOCK, k = job->k;
    float acc[ROWS][2][LANES] = {{{0}}}, mins[ROWS][LANES] = {{0}};
    int w[BLOCK];
    for (int64_t b = 0; b < nb; b++) {
        block_values(job, j, b, w);
        const float dw = job->scales[j * nb + b];
        for (int r = 0; r < count; r++) {
            const int64_t row = r0 + r;
            const int8_t *x = job->xq + row * k + b * BLOCK;
            const float d = dw * job->xd[row * nb + b];
            for (int l = 0; l < LANES; l++) {
                int lane = 0;
                for (int i = 4 * l; i < 4 * l + 4; i++) lane += w[i] * x[i];
                acc[r][b & 1][l] = fmaf(d, (float)lane, acc[r][b & 1][l]);
            }
            if (job->bits == 4) {
                const float term = job->mins[j * nb + b] * job->xs[row * nb + b];
                mins[r][b % LANES] += term;
            }
        }
    }
    for (int r = 0; r < count; r++) {
        float both[LANES];
        for (int l = 0; l < LANES; l++) both[l] = acc[r][0][l] + acc[r][1][l];
        job->y[(r0 + r) * job->n + j] = sum_lanes(both) + (job->bits == 4 ? sum_lanes(mins[r]) : 0.0f);
    }
}

/* ---- x86: AVX2, and AVX-512 VNNI on 256-bit registers ------------------------------- */

#ifdef BARGEIN_X86
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#define TARGET_VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

/* One column for rows [r0, r0 + count): the same arithmetic as column_c. DOT(w, x)
 * yields the eight int32 lanes of an unsigned-by-signed byte dot product. Blocks go in
 * chunks of eight, whose eight scales d (per row) and min terms are formed in vectors,
 * each lane exactly as column_c forms it. */
/* The eight scales d (per row) and min terms of blocks [b0, b0 + n_blocks), each lane as
 * column_c forms it: in one vector for a full chunk, one by one for the last. */
#define CHUNK_SETUP                                                                               \
    const int n_blocks = nb - b0 < CHUNK ? (int)(nb - b0) : CHUNK;                                \
    for (int r = 0; r < count; r++) {                                                             \
        const float *xd = job->xd + (r0 + r) * nb + b0, *xs = job->xs + (r0 + r) * nb + b0;       \
        if (n_blocks == CHUNK) {                                                                  \
            _mm256_store_ps(d[r], _mm256_mul_ps(_mm256_loadu_ps(scales + b0), _mm256_loadu_ps(xd))); \
            if (bits == 4)                                                                        \
                _mm256_store_ps(mins[r], _mm256_add_ps(_mm256_load_ps(mins[r]),                   \
                                _mm256_mul_ps(_mm256_loadu_ps(wmins + b0), _mm256_loadu_ps(xs)))); \
        } else {                                                                                  \
            for (int i = 0; i < n_blocks; i++) {                                                  \
                d[r][i] = scales[b0 + i] * xd[i];                                                 \
                if (bits == 4) {                                                                  \
                    const float term = wmins[b0 + i] * xs[i];                                     \
                    mins[r][i] += term;                                                           \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }

/* Block b's 32 weights as unsigned bytes into w (for 8 bits: |q|, with q's sign in sign). */
#define LOAD_BLOCK256(b)                                                                          \
    if (bits == 4) {                                                                              \
        const __m128i packed = _mm_loadu_si128((const __m128i *)(job->qs + (j * nb + (b)) * (BLOCK / 2))); \
        const __m128i mask = _mm_set1_epi8(0x0F);                                                 \
        w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), _mm_and_si128(packed, mask)); \
    } else {                                                                                      \
        sign = _mm256_loadu_si256((const __m256i *)(job->qs + (j * nb + (b)) * BLOCK));           \
        w = _mm256_sign_epi8(sign, sign);                                                         \
    }

/* One column for rows [r0, r0 + count), count <= ROWS_AVX2: the arithmetic of column_c. */
#define COLUMN_BODY_AVX2                                                                          \
    const int64_t nb = job->k / BLOCK, k = job->k;                                                \
    /* Named accumulators, not an array: the compiler keeps them in registers. */                 \
    __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0; \
    float d[ROWS][CHUNK] __attribute__((aligned(32)));                                            \
    float mins[ROWS][LANES] __attribute__((aligned(32))) = {{0}};                                 \
    const float *scales = job->scales + j * nb, *wmins = bits == 4 ? job->mins + j * nb : 0;      \
    for (int64_t b0 = 0; b0 < nb; b0 += CHUNK) {                                                  \
        CHUNK_SETUP                                                                               \
        for (int i = 0; i < n_blocks; i++) {                                                      \
            const int64_t b = b0 + i;                                                             \
            __m256i w, sign = _mm256_setzero_si256();                                             \
            LOAD_BLOCK256(b)                                                                      \
            const int8_t *xb = job->xq + r0 * k + b * BLOCK;                                      \
            if (b & 1) {                                                                          \
                switch (count) {                                                                  \
                case 4: ROW256(o3, 3); /* fall through */                                         \
                case 3: ROW256(o2, 2); /* fall through */                                         \
                case 2: ROW256(o1, 1); /* fall through */                                         \
                default: ROW256(o0, 0);                                                           \
                }                                                                                 \
            } else {                                                                              \
                switch (count) {                                                                  \
                case 4: ROW256(e3, 3); /* fall through */                                         \
                case 3: ROW256(e2, 2); /* fall through */                                         \
                case 2: ROW256(e1, 1); /* fall through */                                         \
                default: ROW256(e0, 0);                                                           \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    float lanes[ROWS_AVX2][LANES];                                                                \
    _mm256_storeu_ps(lanes[0], _mm256_add_ps(e0, o0));                                            \
    _mm256_storeu_ps(lanes[1], _mm256_add_ps(e1, o1));                                            \
    _mm256_storeu_ps(lanes[2], _mm256_add_ps(e2, o2));                                            \
    _mm256_storeu_ps(lanes[3], _mm256_add_ps(e3, o3));                                            \
    for (int r = 0; r < count; r++)                                                               \
        job->y[(r0 + r) * job->n + j] = sum_lanes(lanes[r]) + (bits == 4 ? sum_lanes(mins[r]) : 0.0f);

/* Row r: acc += d_r * <w, x_r>, lane by lane (maddubs + madd: the lanes vpdpbusd forms). */
#define ROW256(acc, r)                                                                            \
    do {                                                                                          \
        __m256i x = _mm256_loadu_si256((const __m256i *)(xb + (r) * k));                          \
        if (bits == 8) x = _mm256_sign_epi8(x, sign);                                             \
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));  \
        acc = _mm256_fmadd_ps(_mm256_broadcast_ss(&d[r][i]), _mm256_cvtepi32_ps(dot), acc);       \
    } while (0)

/* One column for rows [r0, r0 + count), count <= ROWS, two blocks at a time in 512-bit
 * registers: lanes 0-7 hold the even block's accumulators, 8-15 the odd one's. dd holds
 * each pair's scales spread as [d_b x 8, d_b+1 x 8], formed once per chunk of blocks. */
#define COLUMN_BODY_VNNI                                                                          \
    const int64_t nb = job->k / BLOCK, k = job->k;                                                \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
    float d[ROWS][CHUNK] __attribute__((aligned(32)));                                            \
    float dd[ROWS][CHUNK / 2][16] __attribute__((aligned(64)));                                   \
    float mins[ROWS][LANES] __attribute__((aligned(32))) = {{0}};                                 \
    const float *scales = job->scales + j * nb, *wmins = bits == 4 ? job->mins + j * nb : 0;      \
    const __m512i spread[CHUNK / 2] = {                                                           \
        _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),                         \
        _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2),                         \
        _mm512_set_epi32(5, 5, 5, 5, 5, 5, 5, 5, 4, 4, 4, 4, 4, 4, 4, 4),                         \
        _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 6, 6, 6, 6, 6, 6, 6, 6)};                        \
    for (int64_t b0 = 0; b0 < nb; b0 += CHUNK) {                                                  \
        CHUNK_SETUP                                                                               \
        for (int r = 0; r < count; r++) {                                                         \
            const __m512 dv = _mm512_castps256_ps512(_mm256_load_ps(d[r]));                       \
            for (int p = 0; p < n_blocks / 2; p++)                                                \
                _mm512_store_ps(dd[r][p], _mm512_permutexvar_ps(spread[p], dv));                  \
        }                                                                                         \
        int i = 0;                                                                                \
        for (; i + 2 <= n_blocks; i += 2) {                                                       \
            const int64_t b = b0 + i;                                                             \
            __m512i w;                                                                            \
            __mmask64 flip = 0;                                                                   \
            if (bits == 4) {                                                                      \
                const __m256i packed = _mm256_loadu_si256((const __m256i *)(job->qs + (j * nb + b) * (BLOCK / 2))); \
                const __m256i mask = _mm256_set1_epi8(0x0F);                                      \
                const __m512i both = _mm512_inserti64x4(                                          \
                    _mm512_castsi256_si512(_mm256_and_si256(packed, mask)),                       \
                    _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask), 1); /* lo b, lo b+1, hi b, hi b+1 */ \
                w = _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));                    \
            } else {                                                                              \
                const __m512i q = _mm512_loadu_si512((const void *)(job->qs + (j * nb + b) * BLOCK)); \
                w = _mm512_abs_epi8(q);                                                           \
                flip = _mm512_movepi8_mask(q);                                                    \
            }                                                                                     \
            const int8_t *xb = job->xq + r0 * k + b * BLOCK;                                      \
            const int p = i / 2;                                                                  \
            switch (count) {                                                                      \
            case 8: ROW512(a7, 7); /* fall through */                                             \
            case 7: ROW512(a6, 6); /* fall through */                                             \
            case 6: ROW512(a5, 5); /* fall through */                                             \
            case 5: ROW512(a4, 4); /* fall through */                                             \
            case 4: ROW512(a3, 3); /* fall through */                                             \
            case 3: ROW512(a2, 2); /* fall through */                                             \
            case 2: ROW512(a1, 1); /* fall through */                                             \
            default: ROW512(a0, 0);                                                               \
            }                                                                                     \
        }                                                                                         \
        if (i < n_blocks) { /* a last, even block alone: into the even half */                   \
            const int64_t b = b0 + i;                                                             \
            __m256i w, sign = _mm256_setzero_si256();                                             \
            LOAD_BLOCK256(b)                                                                      \
            const int8_t *xb = job->xq + r0 * k + b * BLOCK;                                      \
            switch (count) {                                                                      \
            case 8: LONE256(a7, 7); /* fall through */                                            \
            case 7: LONE256(a6, 6); /* fall through */                                            \
            case 6: LONE256(a5, 5); /* fall through */                                            \
            case 5: LONE256(a4, 4); /* fall through */                                            \
            case 4: LONE256(a3, 3); /* fall through */                                            \
            case 3: LONE256(a2, 2); /* fall through */                                            \
            case 2: LONE256(a1, 1); /* fall through */                                            \
            default: LONE256(a0, 0);                                                              \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    float lanes[ROWS][LANES];                                                                     \
    const __m512 acc_all[ROWS] = {a0, a1, a2, a3, a4, a5, a6, a7};                                \
    for (int r = 0; r < count; r++) {                                                             \
        _mm256_storeu_ps(lanes[r], _mm256_add_ps(_mm512_castps512_ps256(acc_all[r]),              \
                                                 _mm512_extractf32x8_ps(acc_all[r], 1)));         \
        job->y[(r0 + r) * job->n + j] = sum_lanes(lanes[r]) + (bits == 4 ? sum_lanes(mins[r]) : 0.0f); \
    }

/* Row r, a last block alone: its even half gets d_b * <w, x_r>, the odd half stays. */
#define LONE256(acc, r)                                                                           \
    do {                                                                                          \
        __m256i x = _mm256_loadu_si256((const __m256i *)(xb + (r) * k));                          \
        if (bits == 8) x = _mm256_sign_epi8(x, sign);                                             \
        const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);                    \
        const __m256 even = _mm256_fmadd_ps(_mm256_broadcast_ss(&d[r][i]), _mm256_cvtepi32_ps(dot), \
                                            _mm512_castps512_ps256(acc));                         \
        acc = _mm512_insertf32x8(acc, even, 0);                                                   \
    } while (0)

/* Row r, a pair of blocks: acc += [d_b | d_b+1] * <w, x_r> lane by lane; for 8 bits, x
 * takes w's sign (negated where w < 0) and w is |w|. */
#define ROW512(acc, r)                                                                            \
    do {                                                                                          \
        __m512i x = _mm512_loadu_si512((const void *)(xb + (r) * k));                            \
        if (bits == 8) x = _mm512_mask_sub_epi8(x, flip, _mm512_setzero_si512(), x);              \
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);                    \
        acc = _mm512_fmadd_ps(_mm512_load_ps(dd[r][p]), _mm512_cvtepi32_ps(dot), acc);            \
    } while (0)

static inline TARGET_AVX2 __attribute__((always_inline)) void column_avx2_bits(const qjob_t *job, int bits,
                                                                                int64_t j, int64_t r0, int count) {
    COLUMN_BODY_AVX2
}

#ifdef BARGEIN_VNNI
static inline TARGET_VNNI __attribute__((always_inline)) void column_vnni_bits(const qjob_t *job, int bits,
                                                                                int64_t j, int64_t r0, int count) {
    COLUMN_BODY_VNNI
}
#endif

/* bits, and a full group's row count, as constants in each copy: no block pays for a
 * branch, and a full group's accumulators stay in registers. */
#define DISPATCH(FN, FULL)                                   \
    if (job->bits == 4) {                                    \
        if (count == FULL) FN(job, 4, j, r0, FULL);          \
        else FN(job, 4, j, r0, count);                       \
    } else {                                                 \
        if (count == FULL) FN(job, 8, j, r0, FULL);          \
        else FN(job, 8, j, r0, count);                       \
    }

static TARGET_AVX2 void column_avx2(const qjob_t *job, int64_t j, int64_t r0, int count) {
    DISPATCH(column_avx2_bits, ROWS_AVX2)
}

#ifdef BARGEIN_VNNI
static TARGET_VNNI void column_vnni(const qjob_t *job, int64_t j, int64_t r0, int count) {
    DISPATCH(column_vnni_bits, ROWS)
}
#endif
#endif /* BARGEIN_X86 */

/* 1 where this CPU (and its operating system) runs the instruction set, else 0. */
int bargein_q8_isa_available(int isa) {
    if (isa == ISA_C) return 1;
#ifdef BARGEIN_X86
    __builtin_cpu_init();
    if (isa == ISA_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#ifdef BARGEIN_VNNI
    if (isa == ISA_VNNI)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512vnni");
#endif
#endif
    return 0;
}

typedef void (*column_fn)(const qjob_t *, int64_t, int64_t, int);

typedef struct {
    const qjob_t *job;
    column_fn column;
    int rows; /* the column function's row group, at most */
} run_t;

/* Output columns [n * index / count, n * (index + 1) / count), every row. Columns go in
 * tiles whose weights stay in the first-level cache while every row group passes over
 * them, so that the activations are read from further out once per tile, not per column.
 * The order of the work changes no value. */
static void run_columns(void *arg, int index, int count) {
    const run_t *run = (const run_t *)arg;
    const qjob_t *job = run->job;
    const int64_t end = job->n * (index + 1) / count;
    for (int64_t j0 = job->n * index / count; j0 < end; j0 += COLUMN_TILE) {
        const int64_t j1 = j0 + COLUMN_TILE < end ? j0 + COLUMN_TILE : end;
        for (int64_t r0 = 0; r0 < job->m; r0 += run->rows)
            for (int64_t j = j0; j < j1; j++)
                run->column(job, j, r0, job->m - r0 < run->rows ? (int)(job->m - r0) : run->rows);
    }
}

int bargein_q8_block_matmul(const float *x, int64_t m, int64_t k, const uint8_t *qs, const float *scales,
                            const float *mins, int bits, int64_t n, float *y, int num_threads, int isa) {
    /* AVX2 first: on Zen 4 (2-core EPYC, 1 thread) it measured 0.15 ms against VNNI's 0.17
     * for one row x 576 -> 3072, and 30 ms against 34 for 512 rows; VNNI stays a forced choice. */
    if (isa < 0) isa = bargein_q8_isa_available(ISA_AVX2) ? ISA_AVX2 : ISA_C;
    if (!bargein_q8_isa_available(isa)) return -2;
    const int64_t nb = k / BLOCK;
    const size_t cells = (size_t)(m * nb > 0 ? m * nb : 1);
    int8_t *xq = malloc((size_t)(m * k > 0 ? m * k : 1));
    float *xd = malloc(sizeof(float) * cells), *xs = malloc(sizeof(float) * cells);
    if (!xq || !xd || !xs) {
        free(xq);
        free(xd);
        free(xs);
        return -1;
    }
    quant_job_t quant = {x, xq, xd, xs, m, k};
    /* Rows are independent: quantizing them on several threads changes no value. */
    const int64_t quant_threads = m / 16 < num_threads ? m / 16 : num_threads;
    bargein_parallel_run(quantize_rows, &quant, quant_threads > 1 ? (int)quant_threads : 1);
    qjob_t job = {xq, xd, xs, qs, scales, mins, y, m, k, n, bits};
    run_t run = {&job, column_c, ROWS};
#ifdef BARGEIN_X86
    if (isa == ISA_AVX2) run = (run_t){&job, column_avx2, ROWS_AVX2};
#ifdef BARGEIN_VNNI
    if (isa == ISA_VNNI) run = (run_t){&job, column_vnni, ROWS};
#endif
#endif
    if (num_threads > n) num_threads = (int)n;
    bargein_parallel_run(run_columns, &run, num_threads);
    free(xq);
    free(xd);
    free(xs);
    return 0;
}
