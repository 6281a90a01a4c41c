/*
 * y = x @ W.T for W held in a GGUF file's own blocks, every common type (gguf_types.h),
 * in both precisions, and the rows of W widened to float32 (embedding lookups, the exact
 * precision's many-row chunks).
 *
 * W (n, k) is a matrix descriptor (bargein_qmat_t): segments stacked along rows, each of
 * one block type, its stored rows read in place (row_bytes apart, never written) through
 * an optional row order (output row i of the segment reads stored row order[i]).
 *
 * `fast`. Each row of x is quantized per block of 32 exactly as quant_matmul.c does (d =
 * max|x| / 127, xq = rint(x / d), xs = d * sum(xq)); S_lo and S_hi are the integer sums
 * of xq over each half of 16. For output y[r, j], with the 32-blocks b of column j in
 * order, D_lo and D_hi the exact integer dot products of its quants with xq over each half:
 *
 *   acc = 0
 *   for b = 0, 1, ..., k/32 - 1:
 *       D = D_lo + D_hi                  (KIND_SPLIT*: sc_lo * D_lo + sc_hi * D_hi)
 *       acc = fma((float)D, s_b * d[r, b], acc)          (the product rounded first)
 *       KIND_MIN:        acc = fma(m_b, xs[r, b], acc)
 *       KIND_SPLIT_MIN:  acc = fma((float)(mn_lo * S_lo + mn_hi * S_hi), m_b * d[r, b], acc)
 *   y[r, j] = acc
 *
 * Every integer is exact in int32 and in float (|D| < 2^24). For Q4_1 and Q8_0 this is
 * quant_matmul.c's chain with its scales and mins, so a weight read here from the file's
 * blocks gives the bits a BlockWeight of the same blocks gives there. The chain depends
 * on nothing but row r, column j and k: work is split over output columns (tiles of 16
 * within a segment), so every row count, thread count and instruction-set path (plain C,
 * AVX2, AVX-512 VNNI on 256-bit registers) gives the same bits.
 *
 * Vector paths. Each thread decodes a tile of 16 columns, the whole of k, once per call:
 * a column's blocks into bytes u = q + off (the type's offset, so every quant is
 * unsigned), then transposed so that one 32-byte vector holds four consecutive quants of
 * eight columns; the per-block scales go to block-major panels, eight columns to a
 * vector. Rows then pass over the tile a few at a time: a row's four activation bytes,
 * broadcast, meet a vector in one vpdpbusd (AVX2: maddubs + madd; for 8-bit quants the
 * signed bytes with llama.cpp's sign trick, since u * x could overflow maddubs' int16),
 * and the offset comes off as off * S (exact). Only the decode is per type.
 *
 * `exact`. y[r, j] = sum over halves of 16 in order of es * <q, x> (+ em * sum x), in
 * float32 from float32 x: the dequantized values' product to float rounding.
 *
 * isa: < 0 the best here, 0 plain C, 1 AVX2, 2 AVX-512 VNNI (exact ignores it).
 * Returns 0; -1 when scratch memory could not be had; -2 when the forced instruction set
 * is not this CPU's; -3 when a segment's type has no kernels.
 */
#include "gguf_types.h"
#include "parallel.h"

#include <stdlib.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GGUF_X86 1
#if defined(__clang__) ? __clang_major__ >= 7 : __GNUC__ >= 9
#define GGUF_VNNI 1
#endif
#endif

#define TILE 16 /* output columns per unit of work */

enum { ISA_C = 0, ISA_AVX2 = 1, ISA_VNNI = 2 };

int bargein_q8_isa_available(int isa); /* quant_matmul.c */

typedef struct {
    int64_t type;
    const uint8_t *data;
    int64_t row_bytes, rows;
    const int64_t *order;
} bargein_qseg_t;

typedef struct {
    const bargein_qseg_t *segs;
    int64_t num_segs, n, k;
} bargein_qmat_t;

/* ---- activations -------------------------------------------------------------------- */

typedef struct {
    const float *x;
    int8_t *q;       /* (m, k) */
    float *d, *s;    /* (m, nb) */
    int32_t *s16;    /* (m, 2 nb): S_lo, S_hi */
    float *xsum16;   /* exact: (m, 2 nb) float sums of x per half */
    int64_t m, k, nb;
    int exact;
} acts_t;

static void quantize_rows(void *arg, int index, int count) {
    const acts_t *a = (const acts_t *)arg;
    for (int64_t r = a->m * index / count; r < a->m * (index + 1) / count; r++)
        for (int64_t b = 0; b < a->nb; b++) {
            const float *x = a->x + r * a->k + b * 32;
            if (a->exact) {
                for (int h = 0; h < 2; h++) {
                    float sum = 0.0f;
                    for (int i = 0; i < 16; i++) sum += x[16 * h + i];
                    a->xsum16[r * 2 * a->nb + 2 * b + h] = sum;
                }
                continue;
            }
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            int sum[2] = {0, 0};
            int8_t *q = a->q + r * a->k + b * 32;
            for (int i = 0; i < 32; i++) {
                const int v = (int)rintf(x[i] * inv);
                q[i] = (int8_t)(v > 127 ? 127 : (v < -127 ? -127 : v));
                sum[i / 16] += q[i];
            }
            a->d[r * a->nb + b] = d;
            a->s[r * a->nb + b] = d * (float)(sum[0] + sum[1]);
            a->s16[r * 2 * a->nb + 2 * b] = sum[0];
            a->s16[r * 2 * a->nb + 2 * b + 1] = sum[1];
        }
}

/* ---- the job ------------------------------------------------------------------------ */

typedef struct {
    const bargein_qmat_t *w;
    const acts_t *a;
    float *y;
    int64_t m, n, k, nb;
    int isa;
    int64_t num_tiles;
    int64_t *tile_seg, *tile_col, *seg_start; /* a tile's segment and first column in it; segments' first rows */
    uint8_t *scratch;                          /* per thread: scratch_bytes */
    int64_t scratch_bytes;
} job_t;

static inline const uint8_t *column_row(const bargein_qseg_t *seg, int64_t i) {
    return seg->data + (seg->order ? seg->order[i] : i) * seg->row_bytes;
}

/* ---- plain C ------------------------------------------------------------------------ */

/* Column j (row i of segment seg) for every row of x, fast. acc: m floats of scratch. */
static void column_fast_c(const job_t *job, const bargein_qseg_t *seg, const qinfo_t *info, int64_t i, int64_t j,
                          float *acc) {
    const acts_t *a = job->a;
    const uint8_t *row = column_row(seg, i);
    const int64_t blocks = job->k / info->qk, subs = info->qk / 32, nb = job->nb;
    dblock_t o;
    for (int64_t r = 0; r < job->m; r++) acc[r] = 0.0f;
    for (int64_t t = 0; t < blocks; t++) {
        gguf_decode_c((int)seg->type, row + t * info->bytes, &o);
        for (int64_t r = 0; r < job->m; r++) {
            float v = acc[r];
            for (int64_t sb = 0; sb < subs; sb++) {
                const int64_t b = t * subs + sb;
                const int8_t *x = a->q + r * job->k + b * 32;
                const uint8_t *u = o.u + 32 * sb;
                int32_t dh[2] = {0, 0};
                for (int i2 = 0; i2 < 32; i2++) dh[i2 / 16] += ((int32_t)u[i2] - info->off) * x[i2];
                const int32_t D = info->kind >= KIND_SPLIT ? o.sc[2 * sb] * dh[0] + o.sc[2 * sb + 1] * dh[1]
                                                           : dh[0] + dh[1];
                const float xd = a->d[r * nb + b];
                v = fmaf((float)D, o.s[sb] * xd, v);
                if (info->kind == KIND_MIN) v = fmaf(o.m[sb], a->s[r * nb + b], v);
                if (info->kind == KIND_SPLIT_MIN) {
                    const int32_t M = o.mn[2 * sb] * a->s16[r * 2 * nb + 2 * b] +
                                      o.mn[2 * sb + 1] * a->s16[r * 2 * nb + 2 * b + 1];
                    v = fmaf((float)M, o.m[sb] * xd, v);
                }
            }
            acc[r] = v;
        }
    }
    for (int64_t r = 0; r < job->m; r++) job->y[r * job->n + j] = acc[r];
}

/* The same column in float32 (exact). */
static void column_exact_c(const job_t *job, const bargein_qseg_t *seg, const qinfo_t *info, int64_t i, int64_t j,
                           float *acc) {
    const acts_t *a = job->a;
    const uint8_t *row = column_row(seg, i);
    const int64_t blocks = job->k / info->qk, halves = info->qk / 16, nb = job->nb;
    dblock_t o;
    float q[256], es[16], em[16];
    for (int64_t r = 0; r < job->m; r++) acc[r] = 0.0f;
    for (int64_t t = 0; t < blocks; t++) {
        gguf_decode_c((int)seg->type, row + t * info->bytes, &o);
        for (int i2 = 0; i2 < info->qk; i2++) q[i2] = (float)((int)o.u[i2] - info->off);
        for (int h = 0; h < halves; h++) gguf_half_params(info, &o, h, &es[h], &em[h]);
        for (int64_t r = 0; r < job->m; r++) {
            const float *x = a->x + r * job->k + t * info->qk;
            float v = acc[r];
            for (int h = 0; h < halves; h++) {
                float lanes[8];
                for (int l = 0; l < 8; l++) lanes[l] = q[16 * h + l] * x[16 * h + l];
                for (int l = 0; l < 8; l++) lanes[l] += q[16 * h + 8 + l] * x[16 * h + 8 + l];
                const float dot = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
                                  ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
                float part = es[h] * dot;
                if (info->kind == KIND_MIN || info->kind == KIND_SPLIT_MIN)
                    part += em[h] * a->xsum16[r * 2 * nb + t * halves + h];
                v += part;
            }
            acc[r] = v;
        }
    }
    for (int64_t r = 0; r < job->m; r++) job->y[r * job->n + j] = acc[r];
}

/* ---- x86 vector paths: a tile of 16 columns, decoded once per call ------------------ */

#ifdef GGUF_X86
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#define TARGET_VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

/* Per-thread tile scratch: tile 16 * k bytes (32-byte vectors tile[(b * 8 + g) * 2 + v]:
 * lane c holds elements 4g .. 4g + 3 of block b of column 8v + c), column bytes 16 * k,
 * panels: s, m (nb * 16 floats each, block-major), sc, mn (2 nb * 16 int32 each). */
typedef struct {
    uint8_t *tile, *cols;
    float *ps, *pm;
    int32_t *psc, *pmn;
} tile_t;

static tile_t tile_scratch(const job_t *job, int index) {
    uint8_t *base = job->scratch + (int64_t)index * job->scratch_bytes;
    const int64_t k = job->k, nb = job->nb;
    tile_t t;
    t.tile = base;
    t.cols = base + TILE * k;
    t.ps = (float *)(t.cols + TILE * k);
    t.pm = t.ps + nb * TILE;
    t.psc = (int32_t *)(t.pm + nb * TILE);
    t.pmn = t.psc + 2 * nb * TILE;
    return t;
}

static inline TARGET_AVX2 __attribute__((always_inline)) void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* The scalar parameters of block t of a column into the panels (column c of the tile). */
static inline void put_params(const tile_t *tl, const qinfo_t *info, const dblock_t *o, int64_t t, int c) {
    const int subs = info->qk / 32;
    for (int sb = 0; sb < subs; sb++) {
        const int64_t b = t * subs + sb;
        tl->ps[b * TILE + c] = o->s[sb];
        tl->pm[b * TILE + c] = o->m[sb];
        tl->psc[(2 * b) * TILE + c] = o->sc[2 * sb];
        tl->psc[(2 * b + 1) * TILE + c] = o->sc[2 * sb + 1];
        tl->pmn[(2 * b) * TILE + c] = o->mn[2 * sb];
        tl->pmn[(2 * b + 1) * TILE + c] = o->mn[2 * sb + 1];
    }
}

/* One column's blocks as bytes u into cols (k bytes) and its parameters into the panels. */
static TARGET_AVX2 void decode_column(const tile_t *tl, const bargein_qseg_t *seg, const qinfo_t *info,
                                      const uint8_t *row, int64_t k, int c) {
    const int64_t blocks = k / info->qk;
    uint8_t *out = tl->cols + (int64_t)c * k;
    dblock_t o;
    for (int64_t t = 0; t < blocks; t++) {
        gguf_decode_c((int)seg->type, row + t * info->bytes, &o);
        memcpy(out + t * info->qk, o.u, (size_t)info->qk);
        put_params(tl, info, &o, t, c);
    }
}

/* Columns col0 .. col0 + 15 of a segment (the last repeated past its end) into the tile. */
static TARGET_AVX2 void build_tile(const job_t *job, const tile_t *tl, const bargein_qseg_t *seg,
                                   const qinfo_t *info, int64_t col0) {
    const int64_t k = job->k, nb = job->nb;
    for (int c = 0; c < TILE; c++) {
        const int64_t i = col0 + c < seg->rows ? col0 + c : seg->rows - 1;
        decode_column(tl, seg, info, column_row(seg, i), k, c);
    }
    __m256i *tile = (__m256i *)tl->tile;
    for (int v = 0; v < 2; v++)
        for (int64_t b = 0; b < nb; b++) {
            __m256 r[8];
            for (int c = 0; c < 8; c++) r[c] = _mm256_loadu_ps((const float *)(tl->cols + (8 * v + c) * k + 32 * b));
            transpose8(r);
            for (int g = 0; g < 8; g++) _mm256_store_si256(tile + (b * 8 + g) * 2 + v, _mm256_castps_si256(r[g]));
        }
}

/* The float steps of the header for one block b, eight columns (v) and one row. */
#define FLOAT_STEPS(ACC, DLO, DHI, V, R)                                                                   \
    {                                                                                                      \
        const int64_t cell = (r0 + (R)) * nb + b;                                                          \
        __m256i D;                                                                                         \
        if (KIND >= KIND_SPLIT)                                                                            \
            D = _mm256_add_epi32(_mm256_mullo_epi32(DLO, _mm256_loadu_si256((const __m256i *)(tl->psc + 2 * b * TILE + 8 * (V)))), \
                                 _mm256_mullo_epi32(DHI, _mm256_loadu_si256((const __m256i *)(tl->psc + (2 * b + 1) * TILE + 8 * (V))))); \
        else                                                                                               \
            D = DLO;                                                                                       \
        const __m256 xd = _mm256_set1_ps(a->d[cell]);                                                      \
        ACC = _mm256_fmadd_ps(_mm256_cvtepi32_ps(D), _mm256_mul_ps(_mm256_loadu_ps(tl->ps + b * TILE + 8 * (V)), xd), ACC); \
        if (KIND == KIND_MIN) ACC = _mm256_fmadd_ps(_mm256_loadu_ps(tl->pm + b * TILE + 8 * (V)), _mm256_set1_ps(a->s[cell]), ACC); \
        if (KIND == KIND_SPLIT_MIN) {                                                                      \
            const __m256i M = _mm256_add_epi32(                                                            \
                _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i *)(tl->pmn + 2 * b * TILE + 8 * (V))),       \
                                   _mm256_set1_epi32(a->s16[2 * cell])),                                   \
                _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i *)(tl->pmn + (2 * b + 1) * TILE + 8 * (V))), \
                                   _mm256_set1_epi32(a->s16[2 * cell + 1])));                              \
            ACC = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_mul_ps(_mm256_loadu_ps(tl->pm + b * TILE + 8 * (V)), xd), ACC); \
        }                                                                                                  \
    }

/* Rows r0 .. r0 + ROWS_N - 1 over the whole tile: per block, the two halves' dot products
 * for 16 columns (DOT_GROUP adds one group of four quants), then the float steps. */
#define TILE_ROWS_BODY(ROWS_MAX)                                                                           \
    const acts_t *a = job->a;                                                                              \
    const int64_t nb = job->nb, k = job->k;                                                                \
    const __m256i *tile = (const __m256i *)tl->tile;                                                       \
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);                        \
    (void)ones;                                                                                            \
    (void)flip;                                                                                            \
    __m256 acc[ROWS_MAX][2];                                                                               \
    for (int r = 0; r < ROWS_N; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                          \
    for (int64_t b = 0; b < nb; b++) {                                                                     \
        __m256i dlo[ROWS_MAX][2], dhi[ROWS_MAX][2];                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {                                         \
            const int64_t cell = (r0 + r) * nb + b;                                                        \
            if (KIND >= KIND_SPLIT) {                                                                      \
                dlo[r][0] = dlo[r][1] = _mm256_set1_epi32(-OFF * a->s16[2 * cell]);                        \
                dhi[r][0] = dhi[r][1] = _mm256_set1_epi32(-OFF * a->s16[2 * cell + 1]);                    \
            } else {                                                                                       \
                dlo[r][0] = dlo[r][1] = _mm256_set1_epi32(-OFF * (a->s16[2 * cell] + a->s16[2 * cell + 1])); \
            }                                                                                              \
        }                                                                                                  \
        const __m256i *wb = tile + b * 16;                                                                 \
        _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) {                                              \
            const __m256i w0 = _mm256_load_si256(wb + 2 * g), w1 = _mm256_load_si256(wb + 2 * g + 1);      \
            PREP                                                                                           \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {                                     \
                int32_t four;                                                                              \
                memcpy(&four, a->q + (r0 + r) * k + 32 * b + 4 * g, 4);                                    \
                const __m256i xv = _mm256_set1_epi32(four);                                                \
                if (KIND >= KIND_SPLIT && g >= 4) {                                                        \
                    dhi[r][0] = DOT_GROUP(dhi[r][0], w0, xv, 0);                                           \
                    dhi[r][1] = DOT_GROUP(dhi[r][1], w1, xv, 1);                                           \
                } else {                                                                                   \
                    dlo[r][0] = DOT_GROUP(dlo[r][0], w0, xv, 0);                                           \
                    dlo[r][1] = DOT_GROUP(dlo[r][1], w1, xv, 1);                                           \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {                                         \
            FLOAT_STEPS(acc[r][0], dlo[r][0], dhi[r][0], 0, r)                                             \
            FLOAT_STEPS(acc[r][1], dlo[r][1], dhi[r][1], 1, r)                                             \
        }                                                                                                  \
    }                                                                                                      \
    for (int r = 0; r < ROWS_N; r++)                                                                       \
        for (int v = 0; v < 2; v++) {                                                                      \
            const int64_t c0 = 8 * v;                                                                      \
            if (c0 >= cols) break;                                                                         \
            float lanes[8];                                                                                \
            _mm256_storeu_ps(lanes, acc[r][v]);                                                            \
            float *out = job->y + (r0 + r) * job->n + j0 + c0;                                             \
            for (int c = 0; c < 8 && c0 + c < cols; c++) out[c] = lanes[c];                                \
        }

/* AVX2, quants below 128 (u * x fits maddubs' int16 pairs): maddubs + madd. */
#define PREP
#define DOT_GROUP(ACC, W, X, V) _mm256_add_epi32(ACC, _mm256_madd_epi16(_mm256_maddubs_epi16(W, X), ones))
static inline TARGET_AVX2 __attribute__((always_inline)) void rows_avx2_narrow(const job_t *job, const tile_t *tl,
                                                                                int64_t j0, int cols, int64_t r0,
                                                                                const int ROWS_N, const int KIND,
                                                                                const int OFF) {
    TILE_ROWS_BODY(2)
}
#undef PREP
#undef DOT_GROUP

/* AVX2, 8-bit quants (u = q + 128): |q| against x with q's sign, no offset to undo. */
#define PREP                                                                                               \
    const __m256i q0 = _mm256_xor_si256(w0, flip), q1 = _mm256_xor_si256(w1, flip);                       \
    const __m256i a0 = _mm256_sign_epi8(q0, q0), a1 = _mm256_sign_epi8(q1, q1);
#define DOT_GROUP(ACC, W, X, V)                                                                            \
    _mm256_add_epi32(ACC, _mm256_madd_epi16(_mm256_maddubs_epi16((V) ? a1 : a0, _mm256_sign_epi8(X, (V) ? q1 : q0)), ones))
static inline TARGET_AVX2 __attribute__((always_inline)) void rows_avx2_wide(const job_t *job, const tile_t *tl,
                                                                              int64_t j0, int cols, int64_t r0,
                                                                              const int ROWS_N, const int KIND,
                                                                              const int OFF) {
    TILE_ROWS_BODY(2)
}
#undef PREP
#undef DOT_GROUP

#define AVX2_KINDS(FN, OFFV)                                                                               \
    switch (kind) {                                                                                        \
    case KIND_PLAIN: if (rows == 2) FN(job, tl, j0, cols, r0, 2, KIND_PLAIN, OFFV); else FN(job, tl, j0, cols, r0, 1, KIND_PLAIN, OFFV); break; \
    case KIND_MIN: if (rows == 2) FN(job, tl, j0, cols, r0, 2, KIND_MIN, OFFV); else FN(job, tl, j0, cols, r0, 1, KIND_MIN, OFFV); break; \
    case KIND_SPLIT: if (rows == 2) FN(job, tl, j0, cols, r0, 2, KIND_SPLIT, OFFV); else FN(job, tl, j0, cols, r0, 1, KIND_SPLIT, OFFV); break; \
    default: if (rows == 2) FN(job, tl, j0, cols, r0, 2, KIND_SPLIT_MIN, OFFV); else FN(job, tl, j0, cols, r0, 1, KIND_SPLIT_MIN, OFFV); \
    }

static TARGET_AVX2 void rows_avx2(const job_t *job, const tile_t *tl, const qinfo_t *info, int64_t j0, int cols,
                                  int64_t r0, int rows) {
    const int kind = info->kind;
    if (info->off == 128) {
        AVX2_KINDS(rows_avx2_wide, 0)
    } else if (info->off == 0) {
        AVX2_KINDS(rows_avx2_narrow, 0)
    } else {
        const int off = info->off; /* 4, 8, 16, 32: a run-time offset costs a multiply per block */
        AVX2_KINDS(rows_avx2_narrow, off)
    }
}
#define ROWS_AVX2 2

#ifdef GGUF_VNNI
#define PREP
#define DOT_GROUP(ACC, W, X, V) _mm256_dpbusd_epi32(ACC, W, X)
static inline TARGET_VNNI __attribute__((always_inline)) void rows_vnni_kind(const job_t *job, const tile_t *tl,
                                                                              int64_t j0, int cols, int64_t r0,
                                                                              const int ROWS_N, const int KIND,
                                                                              const int OFF) {
    TILE_ROWS_BODY(6)
}
#undef PREP
#undef DOT_GROUP

#define VNNI_ROWS(KINDV, MAXR)                                                                             \
    switch (rows < MAXR ? rows : MAXR) {                                                                   \
    case 6: rows_vnni_kind(job, tl, j0, cols, r0, 6, KINDV, off); break;                                   \
    case 5: rows_vnni_kind(job, tl, j0, cols, r0, 5, KINDV, off); break;                                   \
    case 4: rows_vnni_kind(job, tl, j0, cols, r0, 4, KINDV, off); break;                                   \
    case 3: rows_vnni_kind(job, tl, j0, cols, r0, 3, KINDV, off); break;                                   \
    case 2: rows_vnni_kind(job, tl, j0, cols, r0, 2, KINDV, off); break;                                   \
    default: rows_vnni_kind(job, tl, j0, cols, r0, 1, KINDV, off);                                         \
    }
/* Returns the rows done (split kinds take four at a time: two accumulators per half). */
static TARGET_VNNI int rows_vnni(const job_t *job, const tile_t *tl, const qinfo_t *info, int64_t j0, int cols,
                                 int64_t r0, int rows) {
    const int off = info->off;
    switch (info->kind) {
    case KIND_PLAIN: VNNI_ROWS(KIND_PLAIN, 6) return rows < 6 ? rows : 6;
    case KIND_MIN: VNNI_ROWS(KIND_MIN, 6) return rows < 6 ? rows : 6;
    case KIND_SPLIT: VNNI_ROWS(KIND_SPLIT, 4) return rows < 4 ? rows : 4;
    default: VNNI_ROWS(KIND_SPLIT_MIN, 4) return rows < 4 ? rows : 4;
    }
}
#endif /* GGUF_VNNI */
#endif /* GGUF_X86 */

/* ---- the work, split over tiles of output columns ----------------------------------- */

static void run_tiles(void *arg, int index, int count) {
    const job_t *job = (const job_t *)arg;
    const int64_t t0 = job->num_tiles * index / count, t1 = job->num_tiles * (index + 1) / count;
    for (int64_t t = t0; t < t1; t++) {
        const bargein_qseg_t *seg = &job->w->segs[job->tile_seg[t]];
        qinfo_t info = {32, 0, 0, KIND_PLAIN};
        gguf_qinfo((int)seg->type, &info);
        const int64_t col0 = job->tile_col[t], j0 = job->seg_start[job->tile_seg[t]] + col0;
        const int cols = (int)(seg->rows - col0 < TILE ? seg->rows - col0 : TILE);
        if (job->isa == ISA_C || job->a->exact) {
            float *acc = (float *)(job->scratch + (int64_t)index * job->scratch_bytes);
            for (int c = 0; c < cols; c++) {
                if (job->a->exact) column_exact_c(job, seg, &info, col0 + c, j0 + c, acc);
                else column_fast_c(job, seg, &info, col0 + c, j0 + c, acc);
            }
            continue;
        }
#ifdef GGUF_X86
        const tile_t tl = tile_scratch(job, index);
        build_tile(job, &tl, seg, &info, col0);
        for (int64_t r0 = 0; r0 < job->m;) {
            const int left = (int)(job->m - r0 < 64 ? job->m - r0 : 64);
#ifdef GGUF_VNNI
            if (job->isa == ISA_VNNI) {
                r0 += rows_vnni(job, &tl, &info, j0, cols, r0, left);
                continue;
            }
#endif
            const int rows = left < ROWS_AVX2 ? left : ROWS_AVX2;
            rows_avx2(job, &tl, &info, j0, cols, r0, rows);
            r0 += rows;
        }
#endif
    }
}

static int check_types(const bargein_qmat_t *w) {
    for (int64_t s = 0; s < w->num_segs; s++) {
        qinfo_t info;
        if (gguf_qinfo((int)w->segs[s].type, &info) || w->k % info.qk) return -3;
    }
    return 0;
}

int bargein_gguf_matmul(const float *x, int64_t m, const bargein_qmat_t *w, float *y, int exact, int num_threads,
                        int isa) {
    if (check_types(w)) return -3;
    if (isa < 0)
        isa = bargein_q8_isa_available(ISA_VNNI) ? ISA_VNNI : bargein_q8_isa_available(ISA_AVX2) ? ISA_AVX2 : ISA_C;
    if (!bargein_q8_isa_available(isa)) return -2;
    if (exact) isa = ISA_C;
    const int64_t k = w->k, nb = k / 32, n = w->n;
    int64_t num_tiles = 0;
    for (int64_t s = 0; s < w->num_segs; s++) num_tiles += (w->segs[s].rows + TILE - 1) / TILE;
    if (num_threads > num_tiles) num_threads = (int)num_tiles;
    if (num_threads < 1) num_threads = 1;
    const size_t cells = (size_t)(m * nb > 0 ? m * nb : 1);
    acts_t a = {x, NULL, NULL, NULL, NULL, NULL, m, k, nb, exact};
    job_t job = {w, &a, y, m, n, k, nb, isa, num_tiles, NULL, NULL, NULL, NULL, 0};
    job.scratch_bytes = isa == ISA_C ? (int64_t)sizeof(float) * (m > 0 ? m : 1)
                                     : 2 * TILE * k + (int64_t)TILE * nb * (2 * 4 + 4 * 4);
    job.scratch_bytes = (job.scratch_bytes + 63) / 64 * 64;
    int status = 0;
    if (exact) a.xsum16 = malloc(sizeof(float) * 2 * cells);
    else {
        a.q = malloc((size_t)(m * k > 0 ? m * k : 1));
        a.d = malloc(sizeof(float) * cells);
        a.s = malloc(sizeof(float) * cells);
        a.s16 = malloc(sizeof(int32_t) * 2 * cells);
    }
    job.tile_seg = malloc(sizeof(int64_t) * (size_t)(num_tiles + 1));
    job.tile_col = malloc(sizeof(int64_t) * (size_t)(num_tiles + 1));
    job.seg_start = malloc(sizeof(int64_t) * (size_t)(w->num_segs + 1));
    job.scratch = aligned_alloc(64, (size_t)(job.scratch_bytes * num_threads));
    if ((exact ? !a.xsum16 : (!a.q || !a.d || !a.s || !a.s16)) || !job.tile_seg || !job.tile_col || !job.seg_start ||
        !job.scratch) {
        status = -1;
        goto done;
    }
    int64_t tile = 0, start = 0;
    for (int64_t s = 0; s < w->num_segs; s++) {
        job.seg_start[s] = start;
        for (int64_t c = 0; c < w->segs[s].rows; c += TILE) job.tile_seg[tile] = s, job.tile_col[tile++] = c;
        start += w->segs[s].rows;
    }
    const int64_t quant_threads = m / 16 < num_threads ? m / 16 : num_threads;
    bargein_parallel_run(quantize_rows, &a, quant_threads > 1 ? (int)quant_threads : 1);
    bargein_parallel_run(run_tiles, &job, num_threads);
done:
    free(a.q);
    free(a.d);
    free(a.s);
    free(a.s16);
    free(a.xsum16);
    free(job.tile_seg);
    free(job.tile_col);
    free(job.seg_start);
    free(job.scratch);
    return status;
}

/* ---- rows widened to float32 -------------------------------------------------------- */

typedef struct {
    const bargein_qmat_t *w;
    const int64_t *ids;
    int64_t count;
    float *out;
} rows_job_t;

static void dequantize_row(const bargein_qseg_t *seg, int64_t i, int64_t k, float *out) {
    qinfo_t info = {32, 0, 0, KIND_PLAIN};
    gguf_qinfo((int)seg->type, &info);
    const uint8_t *row = column_row(seg, i);
    dblock_t o;
    for (int64_t t = 0; t < k / info.qk; t++) {
        gguf_decode_c((int)seg->type, row + t * info.bytes, &o);
        for (int h = 0; h < info.qk / 16; h++) {
            float es, em;
            gguf_half_params(&info, &o, h, &es, &em);
            float *dst = out + t * info.qk + 16 * h;
            for (int l = 0; l < 16; l++) {
                const float v = es * (float)((int)o.u[16 * h + l] - info.off);
                dst[l] = (info.kind == KIND_MIN || info.kind == KIND_SPLIT_MIN) ? v + em : v;
            }
        }
    }
}

static void dequantize_rows_part(void *arg, int index, int count) {
    const rows_job_t *job = (const rows_job_t *)arg;
    const bargein_qmat_t *w = job->w;
    for (int64_t t = job->count * index / count; t < job->count * (index + 1) / count; t++) {
        int64_t id = job->ids[t], s = 0;
        while (id >= w->segs[s].rows) id -= w->segs[s++].rows;
        dequantize_row(&w->segs[s], id, w->k, job->out + t * w->k);
    }
}

/* Rows ids[0 .. count) of W (each in [0, n)) as float32 (count, k): the values gguf.quants
 * gives. Returns 0, -3 for a type without kernels, -6 for an id outside W. */
int bargein_gguf_dequantize_rows(const bargein_qmat_t *w, const int64_t *ids, int64_t count, float *out,
                                 int num_threads) {
    if (check_types(w)) return -3;
    for (int64_t t = 0; t < count; t++)
        if (ids[t] < 0 || ids[t] >= w->n) return -6;
    rows_job_t job = {w, ids, count, out};
    const int64_t threads = count / 4 < num_threads ? count / 4 : num_threads;
    bargein_parallel_run(dequantize_rows_part, &job, threads > 1 ? (int)threads : 1);
    return 0;
}
