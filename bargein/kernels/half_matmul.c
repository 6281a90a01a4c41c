/*
 * y = x @ W.T for W's F16 and BF16 segments (GGUF's 16-bit float weights), read in place
 * from the file's rows, never widened to a float32 copy; and their rows widened (embedding
 * lookups, the exact precision's many-row chunks). See half_matmul.h for the interface.
 *
 * Values. An F16 weight is widened exactly (F16C's vcvtph2ps, or the plain C decoder in
 * gguf_types.h); a BF16 one is its 16 bits moved to the top of a float32 (exact, one
 * shift). AVX-512 BF16's vdpbf16ps is not used: it multiplies bf16 by bf16, so the
 * activations would be rounded to 8 bits of mantissa, which neither precision allows.
 *
 * The summation order, one for both precisions and every path. For output y[r, j] with
 * w = W[j] and x = x[r], both padded with zeros to a multiple of 8 values:
 *
 *   lane[l] = 0 for l = 0..7
 *   for t = 0, 1, ..., ceil(k / 8) - 1:  lane[l] = fma(w[8t + l], x[8t + l], lane[l])
 *   y[r, j] = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]))
 *
 * It depends on nothing but row r, column j and k, so every row count, thread count and
 * instruction-set path gives the same bits: plain C (eight lanes written out), AVX2 (a
 * register of eight lanes per output; a few rows and columns at a time share each load and
 * widening), AVX-512 (a 512-bit register holds two columns' eight lanes, so half the
 * instructions for the same lanes; one row takes eight columns at a time, as AVX2 does, see
 * ONE_ROW_COLS). Work is split over units of 48 output columns.
 * The padded steps matter only for the sign of a zero and are done alike everywhere.
 */
#include "half_matmul.h"
#include "gguf_types.h"
#include "parallel.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HALF_X86 1
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")))
#define ALWAYS __attribute__((always_inline))
#endif

#define MAX_ROWS 6  /* rows at a time, at most (AVX-512) */
#define MAX_COLS 16 /* columns at a time, at most (AVX-512, one row) */
/* Columns at a time for one row, on both paths: eight streams of rows keep the reads at
 * memory speed; sixteen (AVX-512's register count allows them) read slower, 0.6-0.7x
 * ggml's one-row F16 speed against 0.85-1.3x with eight (bench/half_matmul_ab.c, Zen 4,
 * one thread, interleaved). -D to try others. */
#ifndef ONE_ROW_COLS
#define ONE_ROW_COLS 8
#endif
#define UNIT 48 /* output columns per unit of work: a multiple of every path's columns at a time */

enum { ISA_C = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_INT8_AMX = 5 /* the int8 kernels' AMX: AVX-512 here */ };

int bargein_q8_isa_available(int isa); /* quant_matmul.c: isa 2 there is AVX-512 with VNNI */

static inline const uint8_t *half_row(const bargein_qseg_t *seg, int64_t i) {
    return seg->data + (seg->order ? seg->order[i] : i) * seg->row_bytes;
}

static inline float widen_c(int64_t type, const uint8_t *p) {
    if (type == T_F16) return gguf_f16(p);
    const uint32_t bits = ((uint32_t)p[0] | ((uint32_t)p[1] << 8)) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float sum_lanes_c(const float l[8]) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* ---- plain C: one output at a time ------------------------------------------------------- */

static float dot_c(int64_t type, const float *x, const uint8_t *w, int64_t k) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= k; i += 8)
        for (int l = 0; l < 8; l++) lane[l] = fmaf(widen_c(type, w + 2 * (i + l)), x[i + l], lane[l]);
    if (i < k)
        for (int l = 0; l < 8; l++) {
            const int in = i + l < k;
            lane[l] = fmaf(in ? widen_c(type, w + 2 * (i + l)) : 0.0f, in ? x[i + l] : 0.0f, lane[l]);
        }
    return sum_lanes_c(lane);
}

/* ---- x86 --------------------------------------------------------------------------------- */

#ifdef HALF_X86
static inline TARGET_AVX2 ALWAYS __m256 widen8(const int TYPE, const uint8_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (TYPE == T_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The header's lane sum of eight lanes (a, b: the low and high four). */
static inline TARGET_AVX2 ALWAYS float sum_lanes(__m128 a, __m128 b) {
    const __m128 s4 = _mm_add_ps(a, b);                    /* l0+l4, l1+l5, l2+l6, l3+l7 */
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4)); /* (l0+l4)+(l2+l6), (l1+l5)+(l3+l7) */
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

/* One row reads the weights at memory speed, so each column's row is fetched PREFETCH bytes
 * ahead of the reads, and past the row's end the same column of the next group: without
 * that, the first PREFETCH bytes of every group's rows were demand misses (rows of k = 2048
 * are 4 KB: a quarter of the weights at the former 1024 bytes ahead, 0.56x ggml's one-row
 * speed). 256 bytes ahead of eight streams read fastest of 0-2048 (bench/half_matmul_ab.c,
 * Zen 4: 1024 gave 0.73x ggml, 256 0.80-0.88x at k = 2048). -D to try others. */
#ifndef PREFETCH
#define PREFETCH 256
#endif
static inline ALWAYS void fetch_ahead(const uint8_t *w, const uint8_t *next, int64_t at, int64_t row_bytes) {
    _mm_prefetch((const char *)(at < row_bytes ? w + at : next + (at - row_bytes)), _MM_HINT_T0);
}

/* The last k % 8 values of ROWS_N rows and COLS_N columns, zero-padded to eight. */
#define PAD_TAIL(ROWS_N, COLS_N)                                                                   \
    uint16_t wt[MAX_COLS][8];                                                                      \
    float xt[MAX_ROWS][8];                                                                         \
    const uint8_t *wp[MAX_COLS];                                                                   \
    const float *xp[MAX_ROWS];                                                                     \
    _Pragma("GCC unroll 16") for (int c = 0; c < COLS_N; c++) {                                                             \
        memset(wt[c], 0, sizeof wt[c]);                                                            \
        memcpy(wt[c], wc[c] + 2 * i, (size_t)(2 * (k - i)));                                       \
        wp[c] = (const uint8_t *)wt[c];                                                            \
    }                                                                                              \
    _Pragma("GCC unroll 16") for (int r = 0; r < ROWS_N; r++) {                                                             \
        memset(xt[r], 0, sizeof xt[r]);                                                            \
        memcpy(xt[r], xr[r] + i, sizeof(float) * (size_t)(k - i));                                 \
        xp[r] = xt[r];                                                                             \
    }

/* Outputs of ROWS_N rows xr and COLS_N columns wc (the caller repeats the last row or column
 * to fill a short group), stored for the first rows x cols at out[r * ldo + c]; wn: the next
 * group's columns (fetched ahead by one row). */
static inline TARGET_AVX2 ALWAYS void micro_avx2(const int TYPE, const int ROWS_N, const int COLS_N,
                                                 const float *const *xr, const uint8_t *const *wc,
                                                 const uint8_t *const *wn, int64_t k,
                                                 int rows, int cols, float *out, int64_t ldo) {
    __m256 acc[4][8]; /* fixed sizes (not ROWS_N, COLS_N: arrays of variable size live in memory) */
    _Pragma("GCC unroll 16") for (int r = 0; r < ROWS_N; r++)
        _Pragma("GCC unroll 16") for (int c = 0; c < COLS_N; c++) acc[r][c] = _mm256_setzero_ps();
#define STEP_AVX2(WP, XP, AT)                                                                      \
    {                                                                                              \
        __m256 wv[8];                                                                              \
        _Pragma("GCC unroll 16") for (int c = 0; c < COLS_N; c++) wv[c] = widen8(TYPE, (WP)[c] + 2 * (AT));                 \
        _Pragma("GCC unroll 16") for (int r = 0; r < ROWS_N; r++) {                                                         \
            const __m256 xv = _mm256_loadu_ps((XP)[r] + (AT));                                     \
            _Pragma("GCC unroll 16") for (int c = 0; c < COLS_N; c++) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);    \
        }                                                                                          \
    }
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        if (ROWS_N == 1 && i % 32 == 0)  /* one row reads the weights at memory speed: fetch ahead */
            _Pragma("GCC unroll 16") for (int c = 0; c < COLS_N; c++) fetch_ahead(wc[c], wn[c], 2 * i + PREFETCH, 2 * k);
        STEP_AVX2(wc, xr, i)
    }
    if (i < k) {
        PAD_TAIL(ROWS_N, COLS_N)
        STEP_AVX2(wp, xp, 0)
    }
#undef STEP_AVX2
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            out[r * ldo + c] = sum_lanes(_mm256_castps256_ps128(acc[r][c]), _mm256_extractf128_ps(acc[r][c], 1));
}

/* Two columns' eight values at p0, p1, widened into one register (p0's in the low half). */
static inline TARGET_AVX512 ALWAYS __m512 widen16(const int TYPE, const uint8_t *p0, const uint8_t *p1) {
    const __m256i h = _mm256_loadu2_m128i((const __m128i *)p1, (const __m128i *)p0);
    if (TYPE == T_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* micro_avx2 on AVX-512: COLS_N (even) columns as COLS_N / 2 registers of two columns' lanes,
 * each row's eight values broadcast to both halves. */
static inline TARGET_AVX512 ALWAYS void micro_avx512(const int TYPE, const int ROWS_N, const int COLS_N,
                                                     const float *const *xr, const uint8_t *const *wc,
                                                     const uint8_t *const *wn, int64_t k,
                                                     int rows, int cols, float *out, int64_t ldo) {
    __m512 acc[6][8]; /* at most 6 rows, 8 pairs */
    _Pragma("GCC unroll 16") for (int r = 0; r < ROWS_N; r++)
        _Pragma("GCC unroll 16") for (int p = 0; p < COLS_N / 2; p++) acc[r][p] = _mm512_setzero_ps();
#define STEP_AVX512(WP, XP, AT)                                                                    \
    {                                                                                              \
        __m512 wv[8];                                                                              \
        _Pragma("GCC unroll 16") for (int p = 0; p < COLS_N / 2; p++) wv[p] = widen16(TYPE, (WP)[2 * p] + 2 * (AT), (WP)[2 * p + 1] + 2 * (AT)); \
        _Pragma("GCC unroll 16") for (int r = 0; r < ROWS_N; r++) {                                                         \
            const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps((XP)[r] + (AT)));             \
            _Pragma("GCC unroll 16") for (int p = 0; p < COLS_N / 2; p++) acc[r][p] = _mm512_fmadd_ps(wv[p], xv, acc[r][p]); \
        }                                                                                          \
    }
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        if (ROWS_N == 1 && i % 32 == 0)
            _Pragma("GCC unroll 16") for (int c = 0; c < COLS_N; c++) fetch_ahead(wc[c], wn[c], 2 * i + PREFETCH, 2 * k);
        STEP_AVX512(wc, xr, i)
    }
    if (i < k) {
        PAD_TAIL(ROWS_N, COLS_N)
        STEP_AVX512(wp, xp, 0)
    }
#undef STEP_AVX512
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            const __m256 lanes = c % 2 ? _mm512_extractf32x8_ps(acc[r][c / 2], 1) : _mm512_castps512_ps256(acc[r][c / 2]);
            out[r * ldo + c] = sum_lanes(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
        }
}
#endif /* HALF_X86 */

/* ---- the work: units of UNIT columns of one segment -------------------------------------- */

typedef struct {
    const float *x;
    const bargein_qmat_t *w;
    float *y;
    int64_t m, num_units;
    int isa;
    bargein_share_t *shares; /* per thread index: its share of the units (parallel.h) */
} half_job_t;

static int64_t segment_units(const bargein_qseg_t *seg) {
    return half_type(seg->type) ? (seg->rows + UNIT - 1) / UNIT : 0;
}

/* Rows r0 .. r0 + rows - 1 against columns col0 .. col0 + cols - 1 of seg (output columns
 * from j0), by the path's micro kernel for that many rows. Returns the rows done. */
typedef int (*rows_fn)(const half_job_t *, const bargein_qseg_t *, int64_t, int64_t, int, int64_t, int);

/* The row and column pointers of a group (short groups repeat their last row or column). */
#define GROUP_POINTERS(ROWS_N, COLS_N)                                                             \
    const float *xr[MAX_ROWS];                                                                     \
    const uint8_t *wc[MAX_COLS];                                                                   \
    _Pragma("GCC unroll 16") for (int r = 0; r < ROWS_N; r++) xr[r] = job->x + (r0 + (r < rows ? r : rows - 1)) * k;        \
    const uint8_t *wn[MAX_COLS];                                                                   \
    _Pragma("GCC unroll 16") for (int c = 0; c < COLS_N; c++) wc[c] = half_row(seg, col0 + c0 + (c < n ? c : n - 1)); \
    _Pragma("GCC unroll 16") for (int c = 0; c < COLS_N; c++)                                      \
        wn[c] = half_row(seg, col0 + c0 + COLS_N + c < seg->rows ? col0 + c0 + COLS_N + c : seg->rows - 1);

static int rows_c(const half_job_t *job, const bargein_qseg_t *seg, int64_t col0, int64_t j0, int cols, int64_t r0,
                  int left) {
    const int64_t k = job->w->k;
    for (int c = 0; c < cols; c++) {
        const uint8_t *w = half_row(seg, col0 + c);
        for (int r = 0; r < left; r++) job->y[(r0 + r) * job->w->n + j0 + c] = dot_c(seg->type, job->x + (r0 + r) * k, w, k);
    }
    return left;
}

#ifdef HALF_X86
#define ROWS_BODY(MICRO, TYPE, ROWS_N, COLS_N)                                                     \
    for (int c0 = 0; c0 < cols; c0 += COLS_N) {                                                    \
        const int n = cols - c0 < COLS_N ? cols - c0 : COLS_N;                                     \
        GROUP_POINTERS(ROWS_N, COLS_N)                                                             \
        MICRO(TYPE, ROWS_N, COLS_N, xr, wc, wn, k, rows, n, job->y + r0 * job->w->n + j0 + c0, job->w->n); \
    }

/* Per row count, the columns at a time that fill the registers (16 on AVX2, 32 on AVX-512). */
#define ROWS_SWITCH(MICRO, TYPE, GROUPS)                                                           \
    switch (rows) { GROUPS(MICRO, TYPE) }

#define AVX2_GROUPS(MICRO, TYPE)                                                                   \
    case 1: ROWS_BODY(MICRO, TYPE, 1, ONE_ROW_COLS) break;                                         \
    case 2: ROWS_BODY(MICRO, TYPE, 2, 6) break;                                                    \
    case 3: ROWS_BODY(MICRO, TYPE, 3, 4) break;                                                    \
    default: ROWS_BODY(MICRO, TYPE, 4, 3) break;

#define AVX512_GROUPS(MICRO, TYPE)                                                                 \
    case 1: ROWS_BODY(MICRO, TYPE, 1, ONE_ROW_COLS) break;                                         \
    case 2: ROWS_BODY(MICRO, TYPE, 2, 12) break;                                                   \
    case 3: ROWS_BODY(MICRO, TYPE, 3, 8) break;                                                    \
    case 4: ROWS_BODY(MICRO, TYPE, 4, 8) break;                                                    \
    case 5: ROWS_BODY(MICRO, TYPE, 5, 8) break;                                                    \
    default: ROWS_BODY(MICRO, TYPE, 6, 8) break;

static TARGET_AVX2 int rows_avx2(const half_job_t *job, const bargein_qseg_t *seg, int64_t col0, int64_t j0, int cols,
                                 int64_t r0, int left) {
    const int64_t k = job->w->k;
    const int rows = left < 4 ? left : 4;
    if (seg->type == T_F16) ROWS_SWITCH(micro_avx2, T_F16, AVX2_GROUPS)
    else ROWS_SWITCH(micro_avx2, T_BF16, AVX2_GROUPS)
    return rows;
}

static TARGET_AVX512 int rows_avx512(const half_job_t *job, const bargein_qseg_t *seg, int64_t col0, int64_t j0,
                                     int cols, int64_t r0, int left) {
    const int64_t k = job->w->k;
    const int rows = left < 6 ? left : 6;
    if (seg->type == T_F16) ROWS_SWITCH(micro_avx512, T_F16, AVX512_GROUPS)
    else ROWS_SWITCH(micro_avx512, T_BF16, AVX512_GROUPS)
    return rows;
}
#endif

/* Units for thread `index` (UNIT output columns of one segment, every row): its share,
 * then what is left of the others' (parallel.h's shares: work stealing). Which thread
 * computes a unit changes no bit of it. */
static void run_units(void *arg, int index, int count) {
    const half_job_t *job = (const half_job_t *)arg;
    const bargein_qmat_t *w = job->w;
    rows_fn rows_by = rows_c;
#ifdef HALF_X86
    if (job->isa == ISA_AVX2) rows_by = rows_avx2;
    if (job->isa == ISA_AVX512) rows_by = rows_avx512;
#endif
    int64_t unit, next;
    while (bargein_shares_take(job->shares, index, count, &unit, &next)) {
        int64_t s = 0, start = 0; /* the unit's segment, its first output column */
        for (int64_t units; unit >= (units = segment_units(&w->segs[s])); s++) unit -= units, start += w->segs[s].rows;
        const bargein_qseg_t *seg = &w->segs[s];
        const int64_t col0 = unit * UNIT;
        const int cols = (int)(seg->rows - col0 < UNIT ? seg->rows - col0 : UNIT);
        for (int64_t r0 = 0; r0 < job->m;) {
            const int left = (int)(job->m - r0 < 64 ? job->m - r0 : 64);
            r0 += rows_by(job, seg, col0, start + col0, cols, r0, left);
        }
    }
}

static int half_isa_available(int isa) {
    if (isa == ISA_C) return 1;
#ifdef HALF_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c")) return 0;
    if (isa == ISA_AVX2) return 1;
    if (isa == ISA_AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#endif
    return 0;
}

int bargein_half_matmul(const float *x, int64_t m, const bargein_qmat_t *w, float *y, int num_threads, int isa) {
    if (isa < 0) isa = half_isa_available(ISA_AVX512) ? ISA_AVX512 : half_isa_available(ISA_AVX2) ? ISA_AVX2 : ISA_C;
    /* The int8 kernels' paths name the instruction sets a caller may force; a path of theirs
     * that this CPU runs but this file cannot (no F16C) gives the same bits in plain C. */
    if (!bargein_q8_isa_available(isa)) return -2;
    if (isa == ISA_INT8_AMX) isa = ISA_AVX512;
    if (!half_isa_available(isa)) isa = half_isa_available(ISA_AVX2) ? ISA_AVX2 : ISA_C;
    half_job_t job = {x, w, y, m, 0, isa, NULL};
    for (int64_t s = 0; s < w->num_segs; s++) job.num_units += segment_units(&w->segs[s]);
    if (m <= 0 || job.num_units == 0) return 0;
    if (num_threads > job.num_units) num_threads = (int)job.num_units;
    if (num_threads < 1) num_threads = 1;
    job.shares = bargein_shares_new(num_threads, job.num_units);
    if (!job.shares) return -1;
    bargein_parallel_run(run_units, &job, num_threads);
    free(job.shares);
    return 0;
}

#ifdef HALF_X86
static TARGET_AVX2 int64_t widen_row_avx2(int64_t type, const uint8_t *row, int64_t k, float *out) {
    int64_t j = 0;
    if (type == T_F16)
        for (; j + 8 <= k; j += 8) _mm256_storeu_ps(out + j, widen8(T_F16, row + 2 * j));
    else
        for (; j + 8 <= k; j += 8) _mm256_storeu_ps(out + j, widen8(T_BF16, row + 2 * j));
    return j;
}
#endif

void bargein_half_row(const bargein_qseg_t *seg, int64_t i, int64_t k, float *out, int avx2) {
    const uint8_t *row = half_row(seg, i);
    int64_t j = 0;
#ifdef HALF_X86
    if (avx2 && half_isa_available(ISA_AVX2)) j = widen_row_avx2(seg->type, row, k, out);
#else
    (void)avx2;
#endif
    for (; j < k; j++) out[j] = widen_c(seg->type, row + 2 * j);
}
