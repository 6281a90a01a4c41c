/*
 * y = x @ W.T with the activations quantized to 8 bits, for the `fast` precision.
 *
 * W (n, k) is held in blocks of 32 along k (see block_matmul.c for the layout):
 *   4-bit: W[j, 32b + i] = scale[j, b] * q + min[j, b], q in 0..15;
 *   8-bit: W[j, 32b + i] = scale[j, b] * q, q in -127..127.
 * Each row of x is quantized block by block as llama.cpp's q8 does: d = max|x| / 127,
 * xq = round(x / d) in -127..127, and for 4-bit weights also xs = d * sum(xq).
 *
 * The arithmetic, which every path follows exactly. For output y[r, j], with
 * D_b = <q_j,b, xq_r,b> the block's exact integer dot product (32 products summed in
 * int32; the order does not matter, no sum can overflow):
 *
 *   acc = 0
 *   for b = 0, 1, ..., k/32 - 1:
 *       acc = fma((float)D_b, scale[j, b] * d[r, b], acc)   (the product rounded first)
 *       4-bit only: acc = fma(min[j, b], xs[r, b], acc)
 *   y[r, j] = acc
 *
 * Batch and thread invariance. That sequence depends on nothing but row r, column j and
 * k: rows are grouped only so that a weight block, once unpacked, serves several rows;
 * columns go eight at a time, one to a float lane; work is split over output columns,
 * never over k. So row r of an m-row call equals a 1-row call of that row, for any
 * thread count, bit for bit, and every path (AVX-512 VNNI on 256-bit registers, its
 * many-row variant, AVX2, plain C) gives the same bits. (D_b is exact in float: |D_b| <=
 * 32 * 127 * 127 < 2^24.) An earlier version summed each block in eight float lanes,
 * even and odd blocks apart, with a tree at the end: results differ from it in the last
 * bits; fast's perplexity stays within 1% of exact's (tests/test_perplexity.py).
 *
 * How the vector paths get there. A row's quantized blocks are stored in pairs, each pair
 * (b, b + 1) as 64 bytes [x_b 0..15 | x_b+1 0..15 | x_b 16..31 | x_b+1 16..31], the two
 * halves of a 256-bit register each, which is exactly where one 32-byte load of the two
 * blocks' 4-bit quants puts low and high nibbles.
 * - Few rows: two byte dot products (vpdpbusd, or maddubs + madd) give per column eight
 *   int32 lanes, four for each block of the pair; unpack-and-add steps over four columns
 *   and a lane shuffle turn eight columns' registers into D_b and D_b+1 with one column
 *   per lane, and the float steps run on eight columns at once, their scales and mins
 *   gathered once per column group into block-major panels. Weights two groups ahead are
 *   prefetched: eight interleaved column streams are more than the hardware prefetcher
 *   follows at one row's speed.
 * - Many rows (VNNI from GEMM_MIN_ROWS_Q4/Q8; AVX2 from GEMM_MIN_ROWS_AVX2, 4-bit weights
 *   only): each tile of sixteen columns is repacked once per call so that a 32-byte
 *   vector holds four consecutive quants of eight columns; a row's four matching
 *   activation bytes, broadcast, meet it in one vpdpbusd (AVX2: maddubs, summed in int16
 *   lanes, then one madd), and eight of them make D_b for eight columns with no
 *   horizontal sums. Six (AVX2: three) rows by sixteen columns of accumulators stay in
 *   registers.
 * 8-bit weights: VNNI multiplies unsigned by signed bytes, so it takes q + 128 and
 * subtracts 128 * sum(xq) (exact, in int32); AVX2 takes |q| and moves q's sign onto x.
 *
 * The instruction set is chosen at run time from the CPU (isa < 0: VNNI where present,
 * else AVX2, else plain C; on ARM64 sdot where present, else NEON), or forced (tests):
 * 0 plain C, 1 AVX2, 2 AVX-512 VNNI, 3 NEON, 4 NEON with sdot (neon_q8_matmul.h).
 * Returns 0, -1 when scratch memory could not be had, -2 when the forced instruction set
 * is not available here.
 */
#include "parallel.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include "x86_simd.h"
#define BARGEIN_X86 1
/* Compilers old enough to lack the AVX-512 VNNI target (GCC < 9) build without that path. */
#if defined(__clang__) ? __clang_major__ >= 7 : __GNUC__ >= 9
#define BARGEIN_VNNI 1
#endif
#endif
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define BARGEIN_ARM64 1 /* NEON and sdot paths: neon_q8_matmul.h */
#endif

#define BLOCK 32
#define PAIR_BYTES 64 /* two blocks of quantized activations, laid out as described above */
#define GROUP 8       /* output columns computed together, one to a float lane */
#define ROWS_VNNI 6   /* rows sharing each unpacked weight pair: VNNI has 32 vector registers */
#define ROWS_AVX2 2   /* AVX2 has 16 */
#define GEMM_ROWS 6   /* rows per pass of the many-row VNNI path */
#define GEMM_ROWS_AVX2 3 /* and of AVX2's (4-bit weights only): sixteen registers */
#define GEMM_MIN_ROWS_Q4 8  /* from here on VNNI repacks each tile of sixteen columns (measured) */
#define GEMM_MIN_ROWS_Q8 16 /* 8-bit tiles cost twice the repacking */
#define GEMM_MIN_ROWS_AVX2 8
#define PREFETCH_GROUPS 2 /* how far ahead a one-row pass fetches weights */

/* ISA_AMX (Python's Q8_ISAS "amx"): the VNNI paths where AMX's tile registers serve too
 * (gguf_matmul.c's K tile pass); the other kernels run it as ISA_VNNI. */
enum { ISA_C = 0, ISA_AVX2 = 1, ISA_VNNI = 2, ISA_AMX = 5 };

typedef struct {
    const int8_t *xq;     /* (m, pairs * PAIR_BYTES) quantized activations, in pairs of blocks */
    const float *xd, *xs; /* (m, nb): block scales d, and d * sum(xq) */
    const int32_t *xc;    /* (m, nb): 128 * sum(xq), what VNNI's 8-bit offset adds */
    const uint8_t *qs;
    const float *scales, *mins;
    float *y;
    float *panels; /* per thread: 4 * nb * GROUP floats (scales, then mins, block-major; twice) */
    void *tiles;   /* per thread: 16 * nb 32-byte vectors, the many-row path's repacked tile */
    int64_t m, k, n, nb, pairs;
    int bits;
} qjob_t;

typedef struct {
    const float *x;
    int8_t *xq;
    float *xd, *xs;
    int32_t *xc;
    int64_t m, k, nb, pairs;
} quant_job_t;

/* Rows [m * index / count, m * (index + 1) / count) of x into int8 blocks, stored in pairs. */
static void quantize_rows(void *arg, int index, int count) {
    const quant_job_t *job = (const quant_job_t *)arg;
    const int64_t nb = job->nb;
    for (int64_t r = job->m * index / count; r < job->m * (index + 1) / count; r++) {
        int8_t *row = job->xq + r * job->pairs * PAIR_BYTES;
        for (int64_t b = 0; b < nb; b++) {
            const float *x = job->x + r * job->k + b * BLOCK;
            int8_t *lo = row + (b / 2) * PAIR_BYTES + (b % 2) * (BLOCK / 2), *hi = lo + BLOCK;
            float amax = 0.0f;
            for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(x[i]));
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int i = 0; i < BLOCK; i++) {
                const int v = (int)rintf(x[i] * inv); /* |v| <= 127: x[i] * inv rounds to at most 127 */
                const int8_t q = (int8_t)(v > 127 ? 127 : (v < -127 ? -127 : v));
                if (i < BLOCK / 2) lo[i] = q;
                else hi[i - BLOCK / 2] = q;
                sum += q;
            }
            job->xd[r * nb + b] = d;
            job->xs[r * nb + b] = d * (float)sum;
            job->xc[r * nb + b] = 128 * sum;
        }
        if (nb % 2) { /* the last pair's missing block: zeros, which add nothing to any lane */
            memset(row + (nb / 2) * PAIR_BYTES + BLOCK / 2, 0, BLOCK / 2);
            memset(row + (nb / 2) * PAIR_BYTES + BLOCK + BLOCK / 2, 0, BLOCK / 2);
        }
    }
}

/* ---- plain C ------------------------------------------------------------------------ */

static int32_t block_dot_c(const qjob_t *job, int64_t r, int64_t j, int64_t b) {
    const int8_t *lo = job->xq + r * job->pairs * PAIR_BYTES + (b / 2) * PAIR_BYTES + (b % 2) * (BLOCK / 2);
    const int8_t *hi = lo + BLOCK;
    int32_t sum = 0;
    if (job->bits == 4) {
        const uint8_t *q = job->qs + (j * job->nb + b) * (BLOCK / 2);
        for (int i = 0; i < BLOCK / 2; i++) sum += (q[i] & 0x0F) * lo[i] + (q[i] >> 4) * hi[i];
    } else {
        const int8_t *q = (const int8_t *)job->qs + (j * job->nb + b) * BLOCK;
        for (int i = 0; i < BLOCK / 2; i++) sum += q[i] * lo[i] + q[i + BLOCK / 2] * hi[i];
    }
    return sum;
}

static float output_c(const qjob_t *job, int64_t r, int64_t j) {
    const int64_t nb = job->nb;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const float d = job->scales[j * nb + b] * job->xd[r * nb + b];
        acc = fmaf((float)block_dot_c(job, r, j, b), d, acc);
        if (job->bits == 4) acc = fmaf(job->mins[j * nb + b], job->xs[r * nb + b], acc);
    }
    return acc;
}

#ifdef BARGEIN_ARM64
#include "neon_q8_matmul.h"
#include "neon_q8_tile.h" /* many rows with sdot */
#endif

/* ---- x86: AVX2, and AVX-512 VNNI on 256-bit registers ------------------------------- */

#ifdef BARGEIN_X86
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#define TARGET_VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

/* quantize_rows with vectors: the same operations, lane by lane (rintf and
 * _MM_FROUND_TO_NEAREST_INT both round half to even), so the same bytes and sums. */
static TARGET_AVX2 void quantize_rows_avx2(void *arg, int index, int count) {
    const quant_job_t *job = (const quant_job_t *)arg;
    const int64_t nb = job->nb;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
    for (int64_t r = job->m * index / count; r < job->m * (index + 1) / count; r++) {
        int8_t *row = job->xq + r * job->pairs * PAIR_BYTES;
        for (int64_t b = 0; b < nb; b++) {
            const float *x = job->x + r * job->k + b * BLOCK;
            int8_t *lo = row + (b / 2) * PAIR_BYTES + (b % 2) * (BLOCK / 2), *hi = lo + BLOCK;
            __m256 v[4];
            for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + 8 * i);
            __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float amax = _mm_cvtss_f32(m4);
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            const __m256 scale = _mm256_set1_ps(inv);
            __m256i q[4], sum = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                const __m256 rounded = _mm256_round_ps(_mm256_mul_ps(v[i], scale),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(rounded), top), bottom);
                sum = _mm256_add_epi32(sum, q[i]);
            }
            for (int half = 0; half < 2; half++) {
                const __m256i a = q[2 * half], c = q[2 * half + 1];
                const __m128i a16 = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
                const __m128i c16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
                _mm_storeu_si128((__m128i *)(half ? hi : lo), _mm_packs_epi16(a16, c16));
            }
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            const int total = _mm_cvtsi128_si32(s4);
            job->xd[r * nb + b] = d;
            job->xs[r * nb + b] = d * (float)total;
            job->xc[r * nb + b] = 128 * total;
        }
        if (nb % 2) {
            memset(row + (nb / 2) * PAIR_BYTES + BLOCK / 2, 0, BLOCK / 2);
            memset(row + (nb / 2) * PAIR_BYTES + BLOCK + BLOCK / 2, 0, BLOCK / 2);
        }
    }
}

/* The group's scales and mins (8-bit: scales only), block-major: panel[b * GROUP + c] is
 * column j0 + c's (the last column's where j0 + c >= n, computed and not stored). */
#define BUILD_PANELS                                                                              \
    const int64_t nb = job->nb;                                                                   \
    const float *srcs[2] = {job->scales, job->mins};                                              \
    for (int which = 0; which < (job->bits == 4 ? 2 : 1); which++) {                              \
        const float *src[GROUP];                                                                  \
        float *panel = panels + which * nb * GROUP;                                               \
        for (int c = 0; c < GROUP; c++) src[c] = srcs[which] + (j0 + c < job->n ? j0 + c : job->n - 1) * nb; \
        const int64_t j_ahead = j0 + PREFETCH_GROUPS * GROUP, ahead_end = job->n * nb;             \
        for (int64_t i = j_ahead * nb; i < (j_ahead + GROUP) * nb && i < ahead_end; i += 16)      \
            _mm_prefetch((const char *)(srcs[which] + i), _MM_HINT_T0);                           \
        int64_t b = 0;                                                                            \
        for (; b + 8 <= nb; b += 8) { /* eight blocks of eight columns: an 8 x 8 transpose */     \
            __m256 r0 = _mm256_loadu_ps(src[0] + b), r1 = _mm256_loadu_ps(src[1] + b);            \
            __m256 r2 = _mm256_loadu_ps(src[2] + b), r3 = _mm256_loadu_ps(src[3] + b);            \
            __m256 r4 = _mm256_loadu_ps(src[4] + b), r5 = _mm256_loadu_ps(src[5] + b);            \
            __m256 r6 = _mm256_loadu_ps(src[6] + b), r7 = _mm256_loadu_ps(src[7] + b);            \
            const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);        \
            const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);        \
            const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);        \
            const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);        \
            const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE); \
            const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE); \
            const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE); \
            const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE); \
            float *out = panel + b * GROUP;                                                       \
            _mm256_storeu_ps(out + 0 * GROUP, _mm256_permute2f128_ps(u0, u4, 0x20));              \
            _mm256_storeu_ps(out + 1 * GROUP, _mm256_permute2f128_ps(u1, u5, 0x20));              \
            _mm256_storeu_ps(out + 2 * GROUP, _mm256_permute2f128_ps(u2, u6, 0x20));              \
            _mm256_storeu_ps(out + 3 * GROUP, _mm256_permute2f128_ps(u3, u7, 0x20));              \
            _mm256_storeu_ps(out + 4 * GROUP, _mm256_permute2f128_ps(u0, u4, 0x31));              \
            _mm256_storeu_ps(out + 5 * GROUP, _mm256_permute2f128_ps(u1, u5, 0x31));              \
            _mm256_storeu_ps(out + 6 * GROUP, _mm256_permute2f128_ps(u2, u6, 0x31));              \
            _mm256_storeu_ps(out + 7 * GROUP, _mm256_permute2f128_ps(u3, u7, 0x31));              \
        }                                                                                         \
        for (; b < nb; b++)                                                                       \
            for (int c = 0; c < GROUP; c++) panel[b * GROUP + c] = src[c][b];                     \
    }

static TARGET_AVX2 void build_panels_avx2(const qjob_t *job, int64_t j0, float *panels) { BUILD_PANELS }

/* Column c's pair pr as two registers A, B of unsigned-or-signed bytes lined up with the
 * activations' pair layout: 4 bits, one load (the nibbles fall into place); 8 bits, the
 * halves of two blocks. TWO = 0: the last, lone block (its partner's half is zero). */
#define LOAD_PAIR(c, TWO)                                                                         \
    __m256i A, B;                                                                                 \
    if (bits == 4) {                                                                              \
        const uint8_t *p = w[c] + pr * BLOCK;                                                     \
        const __m256i q = (TWO) ? _mm256_loadu_si256((const __m256i *)p)                          \
                                : _mm256_set_m128i(_mm_setzero_si128(), _mm_loadu_si128((const __m128i *)p)); \
        A = _mm256_and_si256(q, nibble);                                                          \
        B = _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble);                                    \
    } else {                                                                                      \
        const uint8_t *p = w[c] + pr * 2 * BLOCK;                                                 \
        const __m128i z = _mm_setzero_si128();                                                    \
        A = _mm256_set_m128i((TWO) ? _mm_loadu_si128((const __m128i *)(p + BLOCK)) : z,           \
                             _mm_loadu_si128((const __m128i *)p));                                \
        B = _mm256_set_m128i((TWO) ? _mm_loadu_si128((const __m128i *)(p + BLOCK + 16)) : z,      \
                             _mm_loadu_si128((const __m128i *)(p + 16)));                         \
    }

/* VNNI: per row, t = <A, XA> + <B, XB> in eight lanes; 8-bit weights offset by 128. */
#define PREP_VNNI                                                                                 \
    if (bits == 8) {                                                                              \
        A = _mm256_xor_si256(A, offset);                                                          \
        B = _mm256_xor_si256(B, offset);                                                          \
    }
#define DOT_VNNI(XA, XB) _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), A, XA), B, XB)

/* AVX2: maddubs + madd. 4 bits: the two 16-bit products add without saturating (at most
 * 4 * 15 * 127); 8 bits: |w| against x with w's sign, each maddubs at most 2 * 127 * 127. */
#define PREP_AVX2                                                                                 \
    __m256i Aa = A, Ba = B;                                                                       \
    if (bits == 8) {                                                                              \
        Aa = _mm256_abs_epi8(A);                                                                  \
        Ba = _mm256_abs_epi8(B);                                                                  \
    }
#define DOT_AVX2(XA, XB)                                                                          \
    (bits == 4 ? _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(A, XA), _mm256_maddubs_epi16(B, XB)), ones) \
               : _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(Aa, _mm256_sign_epi8(XA, A)), ones),       \
                                  _mm256_madd_epi16(_mm256_maddubs_epi16(Ba, _mm256_sign_epi8(XB, B)), ones)))

/* Four columns' lanes into one sum per column and block: [a0+a2, b0+b2, a1+a3, b1+b3]
 * per 128-bit half, then [c0, c1, c2, c3] (horizontal adds, but one micro-op apiece). */
#ifndef SUM_HADD
#define SUM_PAIRS32(a, b) _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b))
#define SUM_PAIRS64(a, b) _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b))
#else
#define SUM_PAIRS32(a, b) _mm256_hadd_epi32(a, b)
#define SUM_PAIRS64(a, b) _mm256_hadd_epi32(a, b)
#endif

/* One pair of blocks (b = 2 pr, and b + 1 when TWO) for the group's eight columns and
 * rows r0 .. r0 + ROWS_N - 1: D per column and block, then the float steps, block b first. */
#define PAIR_STEP(TWO)                                                                 \
    {                                                                                             \
        if (r0 == 0) /* the first pass outruns what the prefetcher guesses of 8 streams */          \
            for (int64_t line = pr * ahead_step; line < (pr + 1) * ahead_step && line < ahead_bytes;\
                 line += 64)                                                                       \
                _mm_prefetch((const char *)(ahead + line), _MM_HINT_T1);                           \
        __m256i h[ROWS_MAX][2];                                                                   \
        _Pragma("GCC unroll 2") for (int half = 0; half < 2; half++) {                            \
            __m256i s[ROWS_MAX][2];                                                               \
            _Pragma("GCC unroll 2") for (int cp = 0; cp < 2; cp++) {                              \
                __m256i t[ROWS_MAX][2];                                                           \
                _Pragma("GCC unroll 2") for (int cc = 0; cc < 2; cc++) {                          \
                    LOAD_PAIR(half * 4 + cp * 2 + cc, TWO)                                        \
                    PREP                                                                          \
                    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {                    \
                        const int8_t *xr = x + r * row_bytes + pr * PAIR_BYTES;                   \
                        const __m256i XA = _mm256_loadu_si256((const __m256i *)xr);               \
                        const __m256i XB = _mm256_loadu_si256((const __m256i *)(xr + BLOCK));     \
                        t[r][cc] = DOT(XA, XB);                                                   \
                    }                                                                             \
                }                                                                                 \
                _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++)                          \
                    s[r][cp] = SUM_PAIRS32(t[r][0], t[r][1]);                               \
            }                                                                                     \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++)                              \
                h[r][half] = SUM_PAIRS64(s[r][0], s[r][1]);                                 \
        }                                                                                         \
        const int64_t b = 2 * pr;                                                                 \
        const __m256 sw0 = _mm256_loadu_ps(ts + b * GROUP), mn0 = _mm256_loadu_ps(tm + b * GROUP); \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {                                \
            const int64_t cell = (r0 + r) * nb + b;                                               \
            __m256i d0 = _mm256_permute2x128_si256(h[r][0], h[r][1], 0x20);                       \
            if (bits == 8 && OFFSET) d0 = _mm256_sub_epi32(d0, _mm256_set1_epi32(job->xc[cell])); \
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_mul_ps(sw0, _mm256_set1_ps(job->xd[cell])), acc[r]); \
            if (bits == 4) acc[r] = _mm256_fmadd_ps(mn0, _mm256_set1_ps(job->xs[cell]), acc[r]);  \
        }                                                                                         \
        if (TWO) {                                                                                \
            const __m256 sw1 = _mm256_loadu_ps(ts + (b + 1) * GROUP);                             \
            const __m256 mn1 = _mm256_loadu_ps(tm + (b + 1) * GROUP);                             \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {                            \
                const int64_t cell = (r0 + r) * nb + b + 1;                                       \
                __m256i d1 = _mm256_permute2x128_si256(h[r][0], h[r][1], 0x31);                   \
                if (bits == 8 && OFFSET) d1 = _mm256_sub_epi32(d1, _mm256_set1_epi32(job->xc[cell])); \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_mul_ps(sw1, _mm256_set1_ps(job->xd[cell])), acc[r]); \
                if (bits == 4) acc[r] = _mm256_fmadd_ps(mn1, _mm256_set1_ps(job->xs[cell]), acc[r]); \
            }                                                                                     \
        }                                                                                         \
    }

/* Columns j0 .. j0 + 7 (those below n stored) for rows r0 .. r0 + ROWS_N - 1. */
#define GROUP_BODY                                                                     \
    const int64_t nb = job->nb, n = job->n, row_bytes = job->pairs * PAIR_BYTES;                  \
    const int64_t bytes = (bits == 4 ? BLOCK / 2 : BLOCK) * nb; /* one column's quants */         \
    const uint8_t *w[GROUP];                                                                      \
    for (int c = 0; c < GROUP; c++) w[c] = job->qs + (j0 + c < n ? j0 + c : n - 1) * bytes;       \
    const int8_t *x = job->xq + r0 * row_bytes;                                                   \
    /* the weights PREFETCH_GROUPS groups on, a slice per pair */                                  \
    const int64_t j_ahead = j0 + PREFETCH_GROUPS * GROUP < n ? j0 + PREFETCH_GROUPS * GROUP : n;   \
    const uint8_t *ahead = job->qs + j_ahead * bytes;                                              \
    const int64_t ahead_bytes = (n - j_ahead < GROUP ? n - j_ahead : GROUP) * bytes;               \
    const int64_t ahead_step = ((ahead_bytes / ((nb + 1) / 2) + 63) / 64) * 64;                    \
    const float *ts = panels, *tm = panels + nb * GROUP;                                          \
    const __m256i nibble = _mm256_set1_epi8(0x0F), offset = _mm256_set1_epi8((char)0x80);         \
    const __m256i ones = _mm256_set1_epi16(1);                                                    \
    (void)offset;                                                                                 \
    (void)ones;                                                                                   \
    __m256 acc[ROWS_MAX];                                                                         \
    for (int r = 0; r < ROWS_N; r++) acc[r] = _mm256_setzero_ps();                                \
    int64_t pr = 0;                                                                               \
    for (; pr < nb / 2; pr++) PAIR_STEP(1)                                             \
    if (nb % 2) PAIR_STEP(0)                                                           \
    for (int r = 0; r < ROWS_N; r++) {                                                            \
        float *out = job->y + (r0 + r) * n + j0;                                                  \
        if (j0 + GROUP <= n) {                                                                    \
            _mm256_storeu_ps(out, acc[r]);                                                        \
        } else {                                                                                  \
            float lanes[GROUP];                                                                   \
            _mm256_storeu_ps(lanes, acc[r]);                                                      \
            for (int c = 0; c < n - j0; c++) out[c] = lanes[c];                                   \
        }                                                                                         \
    }

#define ROWS_MAX ROWS_AVX2
#define OFFSET 0
#define PREP PREP_AVX2
#define DOT DOT_AVX2
static inline TARGET_AVX2 __attribute__((always_inline)) void group_avx2_bits(const qjob_t *job, const float *panels,
                                                                               int bits, int64_t j0, int64_t r0,
                                                                               const int ROWS_N) {
    GROUP_BODY
}
#undef ROWS_MAX
#undef OFFSET
#undef PREP
#undef DOT

#ifdef BARGEIN_VNNI
#define ROWS_MAX ROWS_VNNI
#define OFFSET 1
#define PREP PREP_VNNI
#define DOT DOT_VNNI
static inline TARGET_VNNI __attribute__((always_inline)) void group_vnni_bits(const qjob_t *job, const float *panels,
                                                                               int bits, int64_t j0, int64_t r0,
                                                                               const int ROWS_N) {
    GROUP_BODY
}
#undef ROWS_MAX
#undef OFFSET
#undef PREP
#undef DOT
#endif

/* bits and the row count as constants in each copy: no block pays for a branch, and the
 * accumulators stay in registers. */
static TARGET_AVX2 void group_avx2(const qjob_t *job, const float *panels, int64_t j0, int64_t r0, int rows) {
    if (job->bits == 4) {
        if (rows == 2) group_avx2_bits(job, panels, 4, j0, r0, 2);
        else group_avx2_bits(job, panels, 4, j0, r0, 1);
    } else {
        if (rows == 2) group_avx2_bits(job, panels, 8, j0, r0, 2);
        else group_avx2_bits(job, panels, 8, j0, r0, 1);
    }
}

#ifdef BARGEIN_VNNI
#define VNNI_ROWS(BITS)                                                                           \
    switch (rows) {                                                                               \
    case 6: group_vnni_bits(job, panels, BITS, j0, r0, 6); break;                                 \
    case 5: group_vnni_bits(job, panels, BITS, j0, r0, 5); break;                                 \
    case 4: group_vnni_bits(job, panels, BITS, j0, r0, 4); break;                                 \
    case 3: group_vnni_bits(job, panels, BITS, j0, r0, 3); break;                                 \
    case 2: group_vnni_bits(job, panels, BITS, j0, r0, 2); break;                                 \
    default: group_vnni_bits(job, panels, BITS, j0, r0, 1);                                       \
    }
static TARGET_VNNI void group_vnni(const qjob_t *job, const float *panels, int64_t j0, int64_t r0, int rows) {
    if (job->bits == 4) {
        VNNI_ROWS(4)
    } else {
        VNNI_ROWS(8)
    }
}
#endif

/* ---- VNNI for many rows: a column-interleaved tile, no horizontal sums --------------- */

/* Columns j0 .. j0 + 15's quants as unsigned bytes (4 bits: q; 8 bits: q + 128), in
 * 32-byte vectors tile[(b * 8 + g) * 2 + v]: lane c holds elements 4g .. 4g + 3 of block
 * b of column j0 + 8v + c (the last column's where that is n or more). */
static TARGET_AVX2 void repack_tile(const qjob_t *job, int64_t j0, __m256i *tile) {
    const int64_t nb = job->nb, n = job->n, bytes = (job->bits == 4 ? BLOCK / 2 : BLOCK) * nb;
    const __m256i nibble = _mm256_set1_epi8(0x0F), offset = _mm256_set1_epi8((char)0x80);
    for (int v = 0; v < 2; v++) {
        const uint8_t *src[GROUP];
        for (int c = 0; c < GROUP; c++) src[c] = job->qs + (j0 + 8 * v + c < n ? j0 + 8 * v + c : n - 1) * bytes;
        for (int64_t b = 0; b < nb; b++) {
            __m256i *out = tile + b * 16 + v;
            if (job->bits == 4) { /* dwords 0-3 of 16 bytes: low nibbles groups 0-3, high 4-7 */
                __m256 r[8];
                for (int c = 0; c < GROUP; c++)
                    r[c] = _mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadu_si128((const __m128i *)(src[c] + b * 16))));
                transpose8(r);
                for (int g = 0; g < 4; g++) {
                    const __m256i q = _mm256_castps_si256(r[g]);
                    out[2 * g] = _mm256_and_si256(q, nibble);
                    out[2 * (g + 4)] = _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble);
                }
            } else {
                __m256 r[8];
                for (int c = 0; c < GROUP; c++) r[c] = _mm256_loadu_ps((const float *)(src[c] + b * BLOCK));
                transpose8(r);
                for (int g = 0; g < 8; g++) out[2 * g] = _mm256_xor_si256(_mm256_castps_si256(r[g]), offset);
            }
        }
    }
}

/* AVX2, 4-bit weights: gemm_rows with maddubs for vpdpbusd. A column's eight maddubs of
 * a block add up in int16 lanes without overflow (at most 8 * 2 * 15 * 127 = 30480), and
 * one madd against ones makes D. */
static inline TARGET_AVX2 __attribute__((always_inline)) void gemm_rows_avx2(const qjob_t *job, const __m256i *tile,
                                                                             const float *panels, int64_t j0,
                                                                             int64_t r0, const int ROWS_N) {
    const int64_t nb = job->nb, n = job->n, row_bytes = job->pairs * PAIR_BYTES;
    const float *ts[2] = {panels, panels + 2 * nb * GROUP}, *tm[2] = {panels + nb * GROUP, panels + 3 * nb * GROUP};
    const int8_t *x = job->xq + r0 * row_bytes;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[GEMM_ROWS_AVX2][2];
    for (int r = 0; r < ROWS_N; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i dot[GEMM_ROWS_AVX2][2];
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
        const int8_t *xb = x + (b / 2) * PAIR_BYTES + (b % 2) * (BLOCK / 2);
        const __m256i *wb = tile + b * 16;
        _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) {
            const __m256i w0 = _mm256_loadu_si256(wb + 2 * g), w1 = _mm256_loadu_si256(wb + 2 * g + 1);
            const int at = g < 4 ? 4 * g : BLOCK + 4 * (g - 4);
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {
                int32_t four;
                memcpy(&four, xb + r * row_bytes + at, 4);
                const __m256i xv = _mm256_set1_epi32(four);
                dot[r][0] = _mm256_add_epi16(dot[r][0], _mm256_maddubs_epi16(w0, xv));
                dot[r][1] = _mm256_add_epi16(dot[r][1], _mm256_maddubs_epi16(w1, xv));
                in_order(&dot[r][0]), in_order(&dot[r][1]);
            }
        }
        _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++) {
            const __m256 sw = _mm256_loadu_ps(ts[v] + b * GROUP), mn = _mm256_loadu_ps(tm[v] + b * GROUP);
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {
                const int64_t cell = (r0 + r) * nb + b;
                const __m256i d = _mm256_madd_epi16(dot[r][v], ones);
                acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(sw, _mm256_set1_ps(job->xd[cell])),
                                            acc[r][v]);
                acc[r][v] = _mm256_fmadd_ps(mn, _mm256_set1_ps(job->xs[cell]), acc[r][v]);
            }
        }
    }
    for (int r = 0; r < ROWS_N; r++)
        for (int v = 0; v < 2; v++) {
            const int64_t j = j0 + 8 * v;
            if (j >= n) break;
            float *out = job->y + (r0 + r) * n + j;
            if (j + GROUP <= n) {
                _mm256_storeu_ps(out, acc[r][v]);
            } else {
                float lanes[GROUP];
                _mm256_storeu_ps(lanes, acc[r][v]);
                for (int c = 0; c < n - j; c++) out[c] = lanes[c];
            }
        }
}

static TARGET_AVX2 void gemm_avx2(const qjob_t *job, const void *tiles, const float *panels, int64_t j0, int64_t r0,
                                  int rows) {
    const __m256i *tile = (const __m256i *)tiles;
    switch (rows) {
    case 3: gemm_rows_avx2(job, tile, panels, j0, r0, 3); break;
    case 2: gemm_rows_avx2(job, tile, panels, j0, r0, 2); break;
    default: gemm_rows_avx2(job, tile, panels, j0, r0, 1);
    }
}

#ifdef BARGEIN_VNNI
/* Rows r0 .. r0 + ROWS_N - 1 of the tile's sixteen columns: per block, D by eight
 * vpdpbusd of four-byte groups (8 bits: from -128 * sum(xq), undoing the offset), then
 * the float steps of the header, columns in lanes. */
static inline TARGET_VNNI __attribute__((always_inline)) void gemm_rows(const qjob_t *job, const __m256i *tile,
                                                                        const float *panels, int bits, int64_t j0,
                                                                        int64_t r0, const int ROWS_N) {
    const int64_t nb = job->nb, n = job->n, row_bytes = job->pairs * PAIR_BYTES;
    const float *ts[2] = {panels, panels + 2 * nb * GROUP}, *tm[2] = {panels + nb * GROUP, panels + 3 * nb * GROUP};
    const int8_t *x = job->xq + r0 * row_bytes;
    __m256 acc[GEMM_ROWS][2];
    for (int r = 0; r < ROWS_N; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i dot[GEMM_ROWS][2];
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {
            dot[r][0] = bits == 8 ? _mm256_set1_epi32(-job->xc[(r0 + r) * nb + b]) : _mm256_setzero_si256();
            dot[r][1] = dot[r][0];
        }
        const int8_t *xb = x + (b / 2) * PAIR_BYTES + (b % 2) * (BLOCK / 2);
        const __m256i *wb = tile + b * 16;
        _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) {
            const __m256i w0 = _mm256_loadu_si256(wb + 2 * g), w1 = _mm256_loadu_si256(wb + 2 * g + 1);
            const int at = g < 4 ? 4 * g : BLOCK + 4 * (g - 4);
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {
                int32_t four;
                memcpy(&four, xb + r * row_bytes + at, 4);
                const __m256i xv = _mm256_set1_epi32(four);
                dot[r][0] = _mm256_dpbusd_epi32(dot[r][0], w0, xv);
                dot[r][1] = _mm256_dpbusd_epi32(dot[r][1], w1, xv);
            }
        }
        _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++) {
            const __m256 sw = _mm256_loadu_ps(ts[v] + b * GROUP), mn = _mm256_loadu_ps(tm[v] + b * GROUP);
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {
                const int64_t cell = (r0 + r) * nb + b;
                acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][v]), _mm256_mul_ps(sw, _mm256_set1_ps(job->xd[cell])),
                                            acc[r][v]);
                if (bits == 4) acc[r][v] = _mm256_fmadd_ps(mn, _mm256_set1_ps(job->xs[cell]), acc[r][v]);
            }
        }
    }
    for (int r = 0; r < ROWS_N; r++)
        for (int v = 0; v < 2; v++) {
            const int64_t j = j0 + 8 * v;
            if (j >= n) break;
            float *out = job->y + (r0 + r) * n + j;
            if (j + GROUP <= n) {
                _mm256_storeu_ps(out, acc[r][v]);
            } else {
                float lanes[GROUP];
                _mm256_storeu_ps(lanes, acc[r][v]);
                for (int c = 0; c < n - j; c++) out[c] = lanes[c];
            }
        }
}

#define GEMM_ROWS_CASES(BITS)                                                                     \
    switch (rows) {                                                                               \
    case 6: gemm_rows(job, tile, panels, BITS, j0, r0, 6); break;                                 \
    case 5: gemm_rows(job, tile, panels, BITS, j0, r0, 5); break;                                 \
    case 4: gemm_rows(job, tile, panels, BITS, j0, r0, 4); break;                                 \
    case 3: gemm_rows(job, tile, panels, BITS, j0, r0, 3); break;                                 \
    case 2: gemm_rows(job, tile, panels, BITS, j0, r0, 2); break;                                 \
    default: gemm_rows(job, tile, panels, BITS, j0, r0, 1);                                       \
    }
static TARGET_VNNI void gemm_vnni(const qjob_t *job, const void *tiles, const float *panels, int64_t j0, int64_t r0,
                                  int rows) {
    const __m256i *tile = (const __m256i *)tiles;
    if (job->bits == 4) {
        GEMM_ROWS_CASES(4)
    } else {
        GEMM_ROWS_CASES(8)
    }
}
#endif /* BARGEIN_VNNI */
#endif /* BARGEIN_X86 */

#if defined(BARGEIN_VNNI) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
long syscall(long number, ...); /* unistd.h declares it for _DEFAULT_SOURCE only */
#define ARCH_REQ_XCOMP_PERM 0x1023 /* asm/prctl.h: Linux 5.16's permission for AMX's tile data */
#define XFEATURE_XTILEDATA 18

/* Whether the CPU has AMX's tiles and int8 products (CPUID leaf 7: EDX bits 24 and 25) and
 * Linux lets this process use their state: asked once, for the whole process. */
static int amx_usable(void) {
    static _Atomic int known = 0; /* 0: not asked yet; 1: usable; -1: not */
    int state = known;
    if (state) return state > 0;
    unsigned a, b, c, d;
    state = -1;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) &&
        syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0)
        state = 1;
    known = state;
    return state > 0;
}
#endif

/* 1 where this CPU (and its operating system) runs the instruction set, else 0. */
int bargein_q8_isa_available(int isa) {
    if (isa == ISA_C) return 1;
#ifdef BARGEIN_X86
    __builtin_cpu_init();
    if (isa == ISA_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#ifdef BARGEIN_VNNI
#ifdef __linux__
    if (isa == ISA_AMX) return bargein_q8_isa_available(ISA_VNNI) && amx_usable();
#endif
    if (isa == ISA_VNNI)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512vnni");
#endif
#endif
#ifdef BARGEIN_ARM64
    return neon_isa_available(isa);
#endif
    return 0;
}

/* The fastest instruction set this CPU runs (what isa < 0 chooses). */
int bargein_q8_isa_best(void) {
#ifdef BARGEIN_ARM64
    return neon_isa_available(ISA_DOTPROD) ? ISA_DOTPROD : ISA_NEON;
#endif
    if (bargein_q8_isa_available(ISA_AMX)) return ISA_AMX;
    return bargein_q8_isa_available(ISA_VNNI) ? ISA_VNNI : bargein_q8_isa_available(ISA_AVX2) ? ISA_AVX2 : ISA_C;
}


typedef void (*group_fn)(const qjob_t *, const float *, int64_t, int64_t, int);

typedef struct {
    const qjob_t *job;
    group_fn group; /* NULL: plain C */
    int rows;       /* the group function's rows at a time, at most */
    /* many rows: tiles of sixteen columns, repacked, by this function (else NULL) */
    void (*gemm)(const qjob_t *, const void *, const float *, int64_t, int64_t, int);
    int gemm_rows;
    int neon_tile; /* ARM64 sdot, many rows: neon_q8_tile.h's packed quads (tiles: the scratch) */
    bargein_share_t *shares; /* per thread index: its share of the items (parallel.h) */
    int64_t groups;          /* of eight columns (tiles of sixteen on the many-row path) */
    int64_t item_groups;     /* groups per item: several where a group of few rows is a short work */
} run_t;

/* Output columns of group g (eight columns; a tile of sixteen on the many-row path), every
 * row, on thread `index` (its panels and tile); a group's weights stay in the first-level
 * cache while every row passes over them. `next`: the group whose weights the many-row path
 * fetches meanwhile (-1: none). The order of the work changes no value. */
static void run_group(const run_t *run, int index, int64_t g, int64_t next) {
    const qjob_t *job = run->job;
    const int64_t width = run->gemm ? 2 * GROUP : GROUP;
    if (run->group == NULL) {
        for (int64_t j = g * GROUP; j < (g + 1) * GROUP && j < job->n; j++)
            for (int64_t r = 0; r < job->m; r++) job->y[r * job->n + j] = output_c(job, r, j);
        return;
    }
#ifdef BARGEIN_ARM64
    (void)next;
#ifdef BARGEIN_DOTPROD
    if (run->neon_tile) {
        uint8_t *scratch = (uint8_t *)job->tiles + (int64_t)index * neon_q8_tile_bytes(job->nb);
        neon_q8_tile_columns(job, g * GROUP, (g + 1) * GROUP < job->n ? (g + 1) * GROUP : job->n, scratch);
        return;
    }
#endif
    float *panels = job->panels + (int64_t)index * 4 * job->nb * GROUP;
    neon_q8_panels(job, g * GROUP, panels);
    for (int64_t r0 = 0; r0 < job->m; r0 += run->rows)
        run->group(job, panels, g * GROUP, r0, job->m - r0 < run->rows ? (int)(job->m - r0) : run->rows);
#endif
#ifdef BARGEIN_X86
    float *panels = job->panels + (int64_t)index * 4 * job->nb * GROUP;
    if (run->gemm) {
        __m256i *tile = (__m256i *)job->tiles + (int64_t)index * 16 * job->nb;
        const int64_t j0 = g * width;
        build_panels_avx2(job, j0, panels);
        build_panels_avx2(job, j0 + GROUP < job->n ? j0 + GROUP : job->n - 1, panels + 2 * job->nb * GROUP);
        repack_tile(job, j0, tile);
        if (next >= 0) { /* the next tile's weights, fetched while the rows pass over this one */
            const int64_t bytes = (job->bits == 4 ? BLOCK / 2 : BLOCK) * job->nb;
            const int64_t stop = ((next + 1) * width < job->n ? (next + 1) * width : job->n) * bytes;
            for (int64_t at = next * width * bytes; at < stop; at += 64) _mm_prefetch((const char *)(job->qs + at), _MM_HINT_T1);
        }
        for (int64_t r0 = 0; r0 < job->m; r0 += run->gemm_rows)
            run->gemm(job, tile, panels, j0, r0, job->m - r0 < run->gemm_rows ? (int)(job->m - r0) : run->gemm_rows);
        return;
    }
    build_panels_avx2(job, g * GROUP, panels);
    for (int64_t r0 = 0; r0 < job->m; r0 += run->rows)
        run->group(job, panels, g * GROUP, r0, job->m - r0 < run->rows ? (int)(job->m - r0) : run->rows);
#endif
}

/* Items for thread `index` (item_groups groups each): its share, then what is left of the
 * others' (parallel.h's shares: work stealing). */
static void run_groups(void *arg, int index, int count) {
    const run_t *run = (const run_t *)arg;
    int64_t item, next;
    while (bargein_shares_take(run->shares, index, count, &item, &next)) {
        const int64_t g1 = (item + 1) * run->item_groups < run->groups ? (item + 1) * run->item_groups : run->groups;
        for (int64_t g = item * run->item_groups; g < g1; g++)
            run_group(run, index, g, g + 1 < g1 ? g + 1 : next >= 0 ? next * run->item_groups : -1);
    }
}

int bargein_q8_block_matmul(const float *x, int64_t m, int64_t k, const uint8_t *qs, const float *scales,
                            const float *mins, int bits, int64_t n, float *y, int num_threads, int isa) {
    if (isa < 0) isa = bargein_q8_isa_best();
    if (!bargein_q8_isa_available(isa)) return -2;
    if (isa == ISA_AMX) isa = ISA_VNNI;
    const int64_t nb = k / BLOCK, pairs = (nb + 1) / 2, groups = (n + GROUP - 1) / GROUP;
    if (num_threads > groups) num_threads = (int)groups;
    if (num_threads < 1) num_threads = 1;
    const size_t cells = (size_t)(m * nb > 0 ? m * nb : 1), blocks = (size_t)(nb > 0 ? nb : 1);
    /* many rows: VNNI for both widths, AVX2 for 4 bits (8-bit maddubs sums cannot share int16 lanes) */
    const int gemm = (isa == ISA_VNNI && m >= (bits == 4 ? GEMM_MIN_ROWS_Q4 : GEMM_MIN_ROWS_Q8)) ||
                     (isa == ISA_AVX2 && bits == 4 && m >= GEMM_MIN_ROWS_AVX2);
    if (gemm && num_threads > (n + 2 * GROUP - 1) / (2 * GROUP)) num_threads = (int)((n + 2 * GROUP - 1) / (2 * GROUP));
    size_t tile_bytes = 512 * blocks; /* per thread */
    int neon_tile = 0;
#ifdef BARGEIN_DOTPROD
    neon_tile = isa == ISA_DOTPROD && m >= NEON_TILE_MIN_ROWS;
    if (neon_tile) tile_bytes = (size_t)neon_q8_tile_bytes((int64_t)blocks);
#endif
    int8_t *xq = malloc((size_t)(m * pairs > 0 ? m * pairs * PAIR_BYTES : 1));
    float *xd = malloc(sizeof(float) * cells), *xs = malloc(sizeof(float) * cells);
    int32_t *xc = malloc(sizeof(int32_t) * cells);
    float *panels = malloc(sizeof(float) * 4 * GROUP * blocks * (size_t)num_threads);
    void *tiles = gemm || neon_tile ? aligned_alloc(64, (tile_bytes * (size_t)num_threads + 63) / 64 * 64) : NULL;
    bargein_share_t *shares = NULL;
    int status = 0;
    if (!xq || !xd || !xs || !xc || !panels || ((gemm || neon_tile) && !tiles)) {
        status = -1;
        goto done;
    }
    quant_job_t quant = {x, xq, xd, xs, xc, m, k, nb, pairs};
    /* Rows are independent: quantizing them on several threads changes no value. */
    const int64_t quant_threads = m / 16 < num_threads ? m / 16 : num_threads;
    bargein_task_fn quantize = quantize_rows;
#ifdef BARGEIN_X86
    if (isa != ISA_C) quantize = quantize_rows_avx2;
#endif
#ifdef BARGEIN_ARM64
    if (isa != ISA_C) quantize = neon_q8_quantize_rows;
#endif
    bargein_parallel_run(quantize, &quant, quant_threads > 1 ? (int)quant_threads : 1);
    qjob_t job = {xq, xd, xs, xc, qs, scales, mins, y, panels, tiles, m, k, n, nb, pairs, bits};
    run_t run = {&job, NULL, 1, NULL, 0};
#ifdef BARGEIN_X86
    if (isa == ISA_AVX2) run = (run_t){&job, group_avx2, ROWS_AVX2, gemm ? gemm_avx2 : NULL, GEMM_ROWS_AVX2};
#ifdef BARGEIN_VNNI
    if (isa == ISA_VNNI) run = (run_t){&job, group_vnni, ROWS_VNNI, gemm ? gemm_vnni : NULL, GEMM_ROWS};
#endif
#endif
#ifdef BARGEIN_ARM64
    if (isa == ISA_NEON) run = (run_t){&job, q8_group_neon, ROWS_NEON, NULL, 0};
#ifdef BARGEIN_DOTPROD
    if (isa == ISA_DOTPROD) run = (run_t){&job, q8_group_dotprod, ROWS_NEON, NULL, 0, neon_tile};
#endif
#endif
    const int64_t width = run.gemm ? 2 * GROUP : GROUP;
    run.groups = (n + width - 1) / width;
    /* A group of one row is a few hundred nanoseconds of work: eight to an item, so that
     * taking items (an atomic each) stays a small part of it. */
    run.item_groups = m < 4 && !run.gemm ? 8 : 1;
    run.shares = shares = bargein_shares_new(num_threads, (run.groups + run.item_groups - 1) / run.item_groups);
    if (!shares) {
        status = -1;
        goto done;
    }
    bargein_parallel_run(run_groups, &run, num_threads);
done:
    free(xq);
    free(xd);
    free(xs);
    free(xc);
    free(panels);
    free(tiles);
    free(shares);
    return status;
}
