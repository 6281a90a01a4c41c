/*
 * y = x @ W.T for W held in a GGUF file's own blocks, every common type (gguf_types.h),
 * in both precisions, and the rows of W widened to float32 (embedding lookups, the exact
 * precision's many-row chunks).
 *
 * W (n, k) is a matrix descriptor (bargein_qmat_t): segments stacked along rows, each of
 * one block type, its stored rows read in place (row_bytes apart, never written) through
 * an optional row order (output row i of the segment reads stored row order[i]).
 *
 * `fast`, the 32 chain (every type but the K chain's below). Each row of x is quantized
 * per block of 32 exactly as quant_matmul.c does (d = max|x| / 127, xq = rint(x / d),
 * xs = d * sum(xq)); S_lo and S_hi are the integer sums of xq over each half of 16. For output y[r, j], with the 32-blocks b of column j in
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
 * The K chain (Q4_K, Q5_K, Q6_K: superblocks of 256 with integer sub-scales, as
 * llama.cpp's q8_K dot products). Each row of x is quantized per superblock of 256 with
 * one float unit kd and an integer multiple m_j per 32-block j (k_chain_step), in one of
 * two ways, by the weight's type (acts_t's k_flat, k_flat_type):
 *   - flat (Q4_K, Q5_K; llama.cpp's Q8_K): with amax the superblock's max|x|, d = amax /
 *     127, every m_j = 1, kq = rint(x / d) (clamped to +-127), kd = d;
 *   - per 32 (Q6_K): with amax_j the 32-block's max|x|, m_j = ceil(amax_j / amax * 16)
 *     (1 where amax_j or amax is 0), the block's step (d * m_j) * (1/16), kq = rint(x /
 *     step), kd = d * (1/16); so a 32-block without the superblock's outlier channel is
 *     rounded on a step up to 16 times finer.
 * Either way x ~ kd * m_j * kq, and a matrix whose segments mix the two has its rows
 * quantized both ways (a column's bits depend on its own type only). kq's integer sums
 * per 32 (S32_j) and per 16 (S16_h) are kept. For output y[r, j], over the superblocks t
 * of column j in order, with D_j (D_h) the exact integer dot product of the unsigned
 * quants u of 32-block j (of half h) with kq, sc and mn the block's integer scales and
 * mins, d and dmin its float16 fields, m_h = m of the half's 32-block:
 *
 *   acc = 0
 *   for t = 0, 1, ..., k/256 - 1:
 *       Q4_K, Q5_K:  D = sum_j sc_j * D_j,  M = sum_j mn_j * S32_j    (m_j = 1)
 *                    acc = fma((float)D, d * kd[r, t], acc)
 *                    acc = fma((float)M, (-dmin) * kd[r, t], acc)
 *       Q6_K:        D = sum_h sc_h * m_h * (D_h - 32 * S16_h)
 *                    acc = fma((float)D, d * kd[r, t], acc)
 *   y[r, j] = acc
 *
 * D and M are exact int32 sums (so any order of summing gives them, and a path may let
 * a partial sum wrap around 2^32 where the total fits): the worst cases are |D| <= 8 *
 * 63 * 32 * 31 * 127 < 2^26 (Q5_K), 16 * 128 * 16 * 16 * 32 * 127 < 2^31 (Q6_K), |M| <= 8
 * * 63 * 32 * 127 < 2^21. (float)D rounds to nearest even where |D| >= 2^24, the same on
 * every path. Per superblock, one float step (two with mins) instead of one per 32-block:
 * the few-row path keeps each column's integer lanes for the whole superblock and sums the
 * lanes across columns once per superblock, not once per 32-block. Q6_K's multiples cost
 * an integer multiply per row and superblock of a column (its scales times the row's
 * m_h) in the few-row pass, one per row and 32-block in the tile pass (AVX2: its m takes
 * the place of maddubs' pair-summing ones), none on VNNI from Q6K_TABLE_MIN_ROWS rows,
 * where a table per tile holds the scales times every m; Q4_K's
 * and Q5_K's flat activations cost none
 * (AVX2: a block's maddubs pairs summed in int16 meet sc in one madd). On VNNI, Q4_K's
 * few-row passes of 2 rows or more put four 32-blocks in each vector (the quad pass,
 * k_quads_vnni_t, with the activations re-ordered once per call to match): the same
 * integer D by other partial sums.
 *
 * On the 32 chain every integer is exact in int32 and in float (|D| < 2^24). For Q4_1
 * and Q8_0 it is quant_matmul.c's chain with its scales and mins, so a weight read here
 * from the file's blocks gives the bits a BlockWeight of the same blocks gives there.
 * Either chain depends on nothing but row r, column j and k: work is split over output columns (tiles of 16
 * within a segment), so every row count, thread count and instruction-set path (plain C,
 * AVX2, AVX-512 VNNI on 256-bit registers, its K chain's many-row tile pass on 512-bit
 * ones: gguf_tile_zmm.h) gives the same bits. Threads start with even shares of the
 * tiles and take what is left of each other's when done with theirs (run_tiles), so
 * which thread computes a tile varies from call to call; its bits do not.
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
 * F16 and BF16 segments are half_matmul.c's (float32 activations in both precisions).
 *
 * isa: < 0 the best here, 0 plain C, 1 AVX2, 2 AVX-512 VNNI (exact ignores it).
 * Returns 0; -1 when scratch memory could not be had; -2 when the forced instruction set
 * is not this CPU's; -3 when a segment's type has no kernels.
 */
#include "gguf_matrix.h"
#include "gguf_types.h"
#include "half_matmul.h"
#include "parallel.h"

#include <stdlib.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include "x86_simd.h"
#define GGUF_X86 1
#if defined(__clang__) ? __clang_major__ >= 7 : __GNUC__ >= 9
#define GGUF_VNNI 1
#endif
#if defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11
#define GGUF_AMX 1 /* the K chain's tile pass on AMX (gguf_tile_amx.h): the assembler knows tdpbsud */
#endif
#endif
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define GGUF_ARM64 1 /* NEON and sdot paths: neon_gguf_matmul.h */
#endif

#define TILE 16 /* output columns per unit of work */
/* Below this many rows, the 32 chain's few-row passes decode each block in registers; from
 * it on, a tile is built once and read by the 512-bit passes (rows_zmm32; the K chain has
 * K_GEMM_MIN_ROWS). Tile passes against few-row ones (bench/gemm_tile_ab.c, the 1B layer's
 * shapes from memory, one thread, Zen 5, new / old time): 4 rows Q4_0 1.061, Q8_0 1.074,
 * Q4_1 1.064; 5 rows 0.860, 0.743, 0.828; 6 rows 0.806, 0.711, 0.785; 7 rows 0.742, 0.692,
 * 0.790. */
#ifndef GEMM_MIN_ROWS_VNNI
#define GEMM_MIN_ROWS_VNNI 5
#endif
#define GEMM_MIN_ROWS_AVX2 8
/* Rows a pass of AVX2's few-row strided passes at most (pair_rows_avx2_t, k_rows_avx2_t:
 * eight columns that are rows evenly apart); other few-row passes take two. Four rows a
 * pass against two (bench/gemm_tile_ab.c, the 1B layer's shapes from memory, one thread,
 * Zen 3, new / old time): 3 rows Q4_0 0.80, Q8_0 0.82, Q6_K 0.84, Q4_K 0.86; 4 rows 0.86,
 * 0.87, 0.91, 0.92; 5 rows 0.89, 0.88, 0.95, 0.97; 7 rows Q4_0 and Q8_0 0.82. */
#define STRIDED_ROWS_AVX2 4
/* From this many rows the tile passes of the plain kinds read a signed tile (signed_tile):
 * the tile's sign pass costs more than it saves below (bench/gemm_tile_ab.c, Q4_0, one
 * thread, the signed pass's time over the unsigned one's: VNNI's 256-bit pass on a Zen 4
 * 1.076 at 16 rows, 0.976 at 32, 0.973 at 64, 0.918 at 512; its 512-bit pass on a Zen 5
 * 0.956 at 16 rows and 0.929 at 24 (Q8_0 0.975, 0.985); AVX2 0.915 at 16, 0.872 at 32,
 * 0.844 at 512). */
#ifndef SIGNED_MIN_ROWS_VNNI
#define SIGNED_MIN_ROWS_VNNI 16
#endif
#define SIGNED_MIN_ROWS_AVX2 GEMM_MIN_ROWS_AVX2
/* From this many rows the AVX2 tile pass of 8-bit quants (Q8_0, IQ4_NL, IQ4_XS) reads |q|
 * from a copy made once per tile (build_tile's ABS) instead of making it in every pass
 * (bench/gemm_tile_ab.c, one thread, built for Skylake, new / old time, Q8_0: 1.113 at 8
 * rows, 1.030 at 16, 0.968 at 32, 0.890 at 512; IQ4_NL 0.893 at 512). */
#ifndef ABS_MIN_ROWS_AVX2
#define ABS_MIN_ROWS_AVX2 32
#endif
#define AHEAD_MAX_ROWS_32 64 /* the 32 chain's tile passes fetch the next tile up to this many rows */
/* From AHEAD_SPREAD_MIN_ROWS rows, the K chain's first AHEAD_PASSES tile passes share the
 * next tile's fetch, a part each, instead of the first pass alone: a VNNI pass of 8 rows
 * reads a tile in ~2.5 us, too short for 18 KB from memory, and build_tile's demand misses
 * were 9% of a VNNI prefill's samples (bench/gemm_tile_ab.c, 512 rows, one thread, new /
 * old time: VNNI Q4_K 0.981, Q5_K 0.990, Q6_K 0.985; AVX2, built for Skylake, 0.995,
 * 0.994, 0.987; 8 passes no better). */
#ifndef AHEAD_PASSES
#define AHEAD_PASSES 4
#endif
#define AHEAD_SPREAD_MIN_ROWS 64
/* From this many rows the K chain takes the tile passes; below, the few-row passes, which
 * decode each block in registers for their rows. Since the tile's parameters are unpacked
 * eight columns at once (k_params8), the tile wins from 6 rows on (bench/gemm_tile_ab.c,
 * weights from memory, the layer's five shapes, one thread, tile time over few-row time:
 * VNNI Q4_K 1.14 at 4 rows, 0.92 at 6, 0.87 at 8, 0.73 at 16; Q5_K 0.97, 0.76, 0.73, 0.60;
 * Q6_K -, 0.85, 0.74, 0.59; AVX2 Q4_K 0.76 at 4, 0.57 at 8). It was 24: in-process decode
 * of llama1b.Q4_K_M, 16 streams 118-120 -> 165-167 tok/s, the MoE file's 32 streams
 * 258-287 -> 314-321 (its experts see ~5 rows each; 6 and 8 measured the same there). */
#define K_GEMM_MIN_ROWS 6
/* From this many rows Q6_K's 512-bit tile pass reads its scales times each row's m from a
 * table built per tile (q6k_scale_table): 16 products a 32-block and column, which only
 * many rows' passes repay (bench/gemm_tile_ab.c, the 1B layer's shapes, one thread, Zen 4,
 * time with the table over without: 1.031 at 64 rows, 1.001 at 128, 0.964 at 160, 0.955
 * at 192, 0.947 at 512). -DQ6K_TABLE_MIN_ROWS=N moves it. */
#ifndef Q6K_TABLE_MIN_ROWS
#define Q6K_TABLE_MIN_ROWS 160
#endif
/* (The AVX2 pass multiplies: a table of its int16 pairs of sc times m, 1 KB a 32-block,
 * read 1.05-1.06x the time of the multiplies on a Zen 3, the one AVX2-only CPU the pass
 * runs on here, at 96, 160 and 512 rows, though 0.97x on a Zen 4 built for AVX2 only.) */
#define K_GROUP_ROWS_VNNI 4
/* From this many rows the K chain's tile pass runs on AMX where the CPU has it (isa
 * ISA_AMX, gguf_tile_amx.h): its activations are laid out and each tile's quants scaled
 * once per call, which a few 16-row passes do not repay (bench/gemm_tile_ab.c, the 1B
 * layer's shapes, one thread, AMX time over VNNI's, since Q4_K's and Q5_K's activations
 * are flat: Q4_K 1.31 at 16 rows, 1.085 at 32, 0.940 at 48; Q5_K 1.32, 1.087, 0.958;
 * Q6_K 1.22, 1.02, 0.903; with per-32 activations Q4_K took 1.09 at 48, 0.90 at 64, 0.79
 * at 512). One bound for the job: its segments mix the types. -DAMX_MIN_ROWS=N moves it,
 * to measure. */
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 48
#endif
/* An AMX job's item of the K chain: as many tiles as keep their scaled quants (32 k bytes a
 * tile) within AMX_SET_BYTES, for L2, and AMX_SET_TILES at most (gguf_tile_amx.h's loop
 * order; at 512 rows of a 1B layer, 0.5 MB and 1 MB measured the same but for the down
 * shape, k = 8,192: 0.88 and 0.85 of the AVX-512 pass's time). */
#define AMX_SET_TILES 16
#define AMX_SET_ITEMS 4 /* and at most as many as give each thread this many items */
#ifndef AMX_ROW_PAD
#define AMX_ROW_PAD 64 /* bytes between the AMX activations' rows past k (gguf_tile_amx.h: L1's sets) */
#endif
#ifndef AMX_SET_BYTES
#define AMX_SET_BYTES (1 << 20)
#endif
/* One expert's few rows (bargein_gguf_matmul_expert; ~5 at 32 rows of a 48-expert top-8
 * model): VNNI passes of up to 8 rows decode each block once for 5 to 8 rows, where passes
 * of 4 decoded it twice (measured on the 2-core Zen 4, the MoE file's experts of six layers
 * at 32 rows, interleaved rounds: 0.85-0.89x the time of passes of 4, 0.90-0.91x with
 * passes of up to 6). Since K_GEMM_MIN_ROWS is 6, an expert's 6 rows or more take the tile
 * (it lost from 7, 9 or 12 rows before k_params8) and these passes serve five rows at most. */
#define EXPERT_K_GROUP_ROWS_VNNI 8
/* From this many rows a VNNI few-row pass of Q4_K puts four 32-blocks in each vector (the
 * quad pass, k_quads_vnni_t). Its transpose costs each column and superblock more than the
 * paired pass's decode, which one row does not repay (1.02x the paired pass's time at 1
 * row; 0.95x at 2, 0.87x at 3, 0.85x at 4: docs/benchmarks.md). */
#define K_QUADS_MIN_ROWS 2

/* ISA_AMX: the VNNI paths, with the K chain's tile pass on AMX from AMX_MIN_ROWS rows. */
enum { ISA_C = 0, ISA_AVX2 = 1, ISA_VNNI = 2, ISA_AMX = 5 };

int bargein_q8_isa_available(int isa); /* quant_matmul.c */
int bargein_q8_isa_best(void);


/* ---- activations -------------------------------------------------------------------- */

typedef struct {
    const float *x;
    int8_t *q;       /* (m, k) */
    float *d, *s;    /* (m, nb) */
    int32_t *s16;    /* (m, 2 nb): S_lo, S_hi */
    float *xsum16;   /* exact: (m, 2 nb) float sums of x per half */
    /* the K chain's (k_chain_type), see the header: per superblock of 256 the unit kd, per
     * 32-block the multiple km of kd, kq = rint(x / (kd * km)), and kq's sums per 16
     * (ks16) and per 32 (ks32); NULL when no segment of the matrix is of such a type */
    int8_t *kq;      /* (m, k) */
    float *kd;       /* (m, k / 256) */
    int16_t *km;     /* (m, k / 32): 1 .. 16 */
    int16_t *ks16, *ks32; /* (m, k / 16), (m, k / 32) */
    int64_t m, k, nb;
    int exact;
    /* kq again in quad order (quad_order), for the VNNI few-row passes of Q4_K (the quad
     * pass); NULL where none runs */
    int8_t *kx; /* (m, k) */
    /* Q6_K's AVX2 tile pass (rows_q6k_avx2_t): kq in halves order (halves_order32: per
     * 32-block, bytes 4g .. 4g + 3 are kq's 2g, 2g + 1, 16 + 2g, 17 + 2g), and per quarter
     * of it (groups 0-3, 4-7) its offset's part of each int16 lane of a maddubs sum: -32 *
     * (the sum of its values from the first half; from the second half) as two int16 in one
     * int32 (|.| <= 32 * 8 * 127); NULL where none runs. Both, and a copy of km (km4),
     * per group of four rows (the pass's rows, from a multiple of 4), so that the pass
     * addresses its rows from one pointer: row R's 32-block b of kqh at ((R / 4) * (k / 32)
     * + b) * 128 + (R % 4) * 32, its entry i of kc16 at ((R / 4) * (k / 16) + i) * 4 + R % 4,
     * of km4 at ((R / 4) * (k / 32) + i) * 4 + R % 4 */
    int8_t *kqh;   /* (m rounded up to 4, k) */
    int32_t *kc16; /* (m rounded up to 4, k / 16) */
    int16_t *km4;  /* (m rounded up to 4, k / 32) */
    /* q + 128 as unsigned bytes, for the signed tile passes of the plain kinds (signed_tile:
     * activations unsigned, the tile's quants signed); NULL where none runs */
    uint8_t *qu; /* (m, k) */
    /* The AMX tile pass's activations (gguf_tile_amx.h): km * kq per 32-block as 256 * ahi +
     * alo; NULL where none runs */
    uint8_t *alo; /* (m, amx_stride) */
    int8_t *ahi;  /* (m, amx_stride) */
    int64_t amx_stride; /* k + AMX_ROW_PAD */
    /* The K chain's activations on one step per superblock (k_flat_type: Q4_K's and Q5_K's):
     * every m_j 1 and kd = max|x| / 127, so alo holds kq itself and ahi is NULL; else a step
     * per 32-block (Q6_K's) */
    int k_flat;
    /* Q6_K's 512-bit tile pass (rows_k_zmm_t), written by quantize_rows_avx2 (the VNNI
     * paths' quantizer), NULL where none runs; both per group of eight rows (the pass's
     * rows, from a multiple of 8), so that the pass addresses its eight rows from one
     * pointer (GCC kept eight row pointers and spilled the terms' to the stack):
     * - kz, per superblock 24 int32 terms, the eight m_j then the sixteen offsets' starts
     *   -32 * S16_h, read as its broadcast operands; term i of row R's superblock t at
     *   ((R / 8) * (k / 256) + t) * 192 + i * 8 + R % 8. Widened by each pass from km and
     *   ks16 instead, once per row and superblock, the prologue took ~6% of the pass's
     *   samples (perf, Zen 4): 0.95x the pass's time at 512 rows, 0.97x at 32 and at 8;
     * - kq8, kq with a group's rows side by side per 32-block: row R's 32-block b at
     *   ((R / 8) * (k / 32) + b) * 256 + (R % 8) * 32.
     * Both against row-major arrays, 0.96x the pass's time at 512 rows (bench/gemm_tile_ab.c,
     * one thread, Zen 4). */
    int32_t *kz; /* (m rounded up to 8, k / 256 * 24) */
    int8_t *kq8; /* (m rounded up to 8, k) */
} acts_t;

/* Whether a K-chain type's activations take one step per superblock (acts_t's k_flat), as
 * llama.cpp's Q8_K: Q4_K and Q5_K. Q6_K keeps a step per 32-block: next to its small weight
 * error, one outlier channel per 256 values setting the step of the 255 others cost
 * smollm2.Q6_K's fast perplexity +1.8% (docs/benchmarks.md), while Q4_K's and Q5_K's larger
 * error hides it; and with one step their AMX tile pass multiplies one-byte activations,
 * two tile products per superblock chunk instead of four (gguf_tile_amx.h). */
static inline int k_flat_type(int64_t type) { return type == T_Q4_K || type == T_Q5_K; }

/* The K chain's multiple of a 32-block whose max|x| is amax32 in a superblock whose max|x|
 * is amax: ceil(amax32 / amax * 16), in 1..16 (the quotient is at most 1, so 16 at most). */
static inline int k_chain_multiple(float amax32, float amax, int flat) {
    const int m = amax > 0.0f && !flat ? (int)ceilf(amax32 / amax * 16.0f) : 1;
    return m < 1 ? 1 : m;
}

/* The step of a 32-block with multiple m in a superblock whose max|x| is amax: (d * m) / 16,
 * d = amax / 127 (the float operations every path does, in this order); flat: d. 0 where
 * amax is 0. */
static inline float k_chain_step(float amax, int m, int flat) {
    return flat ? amax / 127.0f : amax / 127.0f * (float)m * 0.0625f;
}

/* The superblock's float unit kd = d / 16 (exact: a power of two); flat: d. */
static inline float k_chain_unit(float amax, int flat) { return flat ? amax / 127.0f : amax / 127.0f * 0.0625f; }

/* Row r's superblock t quantized for the K chain from its 256 values x (plain C). */
static void quantize_superblock_c(const acts_t *a, int64_t r, int64_t t, const float *x) {
    float amax = 0.0f, amax32[8];
    for (int j = 0; j < 8; j++) {
        amax32[j] = 0.0f;
        for (int i = 32 * j; i < 32 * j + 32; i++) amax32[j] = fmaxf(amax32[j], fabsf(x[i]));
        amax = fmaxf(amax, amax32[j]);
    }
    int8_t *q = a->kq + r * a->k + t * 256;
    int16_t *s16 = a->ks16 + r * (a->k / 16) + t * 16, *s32 = a->ks32 + r * (a->k / 32) + t * 8;
    int16_t *km = a->km + r * (a->k / 32) + t * 8;
    for (int j = 0; j < 8; j++) {
        km[j] = (int16_t)k_chain_multiple(amax32[j], amax, a->k_flat);
        const float step = k_chain_step(amax, km[j], a->k_flat), inv = step > 0.0f ? 1.0f / step : 0.0f;
        for (int h = 2 * j; h < 2 * j + 2; h++) {
            int sum = 0;
            for (int i = 16 * h; i < 16 * h + 16; i++) {
                const int v = (int)rintf(x[i] * inv);
                q[i] = (int8_t)(v > 127 ? 127 : (v < -127 ? -127 : v));
                sum += q[i];
            }
            s16[h] = (int16_t)sum;
        }
        s32[j] = (int16_t)(s16[2 * j] + s16[2 * j + 1]);
    }
    a->kd[r * (a->k / 256) + t] = k_chain_unit(amax, a->k_flat);
}

static void quantize_rows(void *arg, int index, int count) {
    const acts_t *a = (const acts_t *)arg;
    for (int64_t r = a->m * index / count; r < a->m * (index + 1) / count; r++) {
        if (a->kq)
            for (int64_t t = 0; t < a->k / 256; t++) quantize_superblock_c(a, r, t, a->x + r * a->k + t * 256);
        if (!a->q && !a->exact) continue;
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
            if (a->qu)
                for (int i = 0; i < 32; i++) a->qu[r * a->k + b * 32 + i] = (uint8_t)(q[i] ^ 0x80);
        }
    }
}

/* ---- the job ------------------------------------------------------------------------ */

typedef struct {
    const bargein_qmat_t *w;
    const acts_t *a;      /* the 32 chain's activations and Q6_K's K chain's */
    const acts_t *a_flat; /* Q4_K's and Q5_K's (k_flat), or NULL: run_tile passes them as a */
    float *y;
    int64_t m, n, k, nb;
    int isa;
    int64_t gemm_min_rows; /* from this many rows on, the vector paths decode a tile once per call */
    int64_t num_tiles;
    int64_t *tile_seg, *tile_col, *seg_start; /* a tile's segment and first column in it; segments' first rows */
    uint8_t *scratch;                          /* per thread: scratch_bytes */
    int64_t scratch_bytes;
    int64_t k_group_rows; /* the K chain's few-row passes on VNNI take this many rows at most */
    bargein_share_t *shares; /* per thread index: its share of the tiles (parallel.h) */
    int amx;                 /* the K chain's tile pass runs on AMX (isa is ISA_VNNI) */
    int64_t amx_at;          /* then: where a tile's scratch holds tile_t's amx_lo (bytes) */
    /* and an item of the K chain is up to AMX_SET_TILES tiles (run_amx_set), each in its own
     * scratch of sub_bytes within the thread's */
    int64_t sub_bytes;
    int amx_set; /* tiles per item: 1 .. AMX_SET_TILES, within AMX_SET_BYTES and AMX_SET_ITEMS */
    int64_t q6k_table_at; /* where a tile's scratch holds tile_t's q6k_table (bytes), or 0: none */
} job_t;

static inline const uint8_t *column_row(const bargein_qseg_t *seg, int64_t i) {
    return seg->data + (seg->order ? seg->order[i] : i) * seg->row_bytes;
}

/* ---- plain C ------------------------------------------------------------------------ */

/* Whether a type's blocks take the K chain (see the header). */
static inline int k_chain_type(int64_t type) { return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K; }

/* The columns of the tile from column col0 of seg: TILE, or what is left of the segment. */
static inline int tile_width(const bargein_qseg_t *seg, int64_t col0) {
    return (int)(seg->rows - col0 < TILE ? seg->rows - col0 : TILE);
}

/* A K-chain superblock's float d and -dmin (0 for Q6_K) and its integer scales: per 32
 * sc[0..7] and mn[0..7] (Q4_K, Q5_K), per 16 sc[0..15] (Q6_K). */
static inline void k_chain_params_c(int type, const uint8_t *b, float *d, float *neg_dmin, int32_t *sc,
                                    int32_t *mn) {
    if (type == T_Q6_K) {
        *d = gguf_f16(b + 208), *neg_dmin = 0.0f;
        for (int i = 0; i < 16; i++) sc[i] = (int8_t)b[192 + i];
        return;
    }
    *d = gguf_f16(b), *neg_dmin = -gguf_f16(b + 2);
    for (int j = 0; j < 8; j++) {
        int s, m;
        k_scale_min(b + 4, j, &s, &m);
        sc[j] = s, mn[j] = m;
    }
}

/* Column j (row i of segment seg, a K-chain type) for every row of x, fast. */
static void column_k_chain_c(const job_t *job, const bargein_qseg_t *seg, const qinfo_t *info, int64_t i, int64_t j,
                             float *acc) {
    const acts_t *a = job->a;
    const uint8_t *row = column_row(seg, i);
    const int64_t k = job->k, supers = k / 256;
    uint8_t u[256];
    int32_t sc[16], mn[8];
    float d, neg_dmin;
    for (int64_t r = 0; r < job->m; r++) acc[r] = 0.0f;
    for (int64_t t = 0; t < supers; t++) {
        const uint8_t *blk = row + t * info->bytes;
        k_chain_params_c((int)seg->type, blk, &d, &neg_dmin, sc, mn);
        gguf_quants_c((int)seg->type, blk, u);
        for (int64_t r = 0; r < job->m; r++) {
            const int8_t *x = a->kq + r * k + t * 256;
            const int16_t *km = a->km + r * (k / 32) + t * 8;
            int32_t D = 0, M = 0;
            if (seg->type == T_Q6_K) {
                for (int h = 0; h < 16; h++) {
                    int32_t dot = 0;
                    for (int l = 16 * h; l < 16 * h + 16; l++) dot += ((int32_t)u[l] - 32) * x[l];
                    D += sc[h] * km[h / 2] * dot;
                }
            } else {
                for (int s = 0; s < 8; s++) {
                    int32_t dot = 0;
                    for (int l = 32 * s; l < 32 * s + 32; l++) dot += (int32_t)u[l] * x[l];
                    D += sc[s] * km[s] * dot;
                    M += mn[s] * km[s] * a->ks32[r * (k / 32) + t * 8 + s];
                }
            }
            const float xd = a->kd[r * supers + t];
            acc[r] = fmaf((float)D, d * xd, acc[r]);
            if (seg->type != T_Q6_K) acc[r] = fmaf((float)M, neg_dmin * xd, acc[r]);
        }
    }
    for (int64_t r = 0; r < job->m; r++) job->y[r * job->n + j] = acc[r];
}

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

#ifdef GGUF_ARM64
#include "neon_gguf_matmul.h"
#include "neon_gguf_tile.h" /* many rows with sdot, 32 chain */
#endif

/* ---- x86 vector paths: a tile of 16 columns, decoded once per call ------------------ */

#ifdef GGUF_X86
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

/* ---- per type: a 32-block's quants as 32 bytes u, in registers ----------------------- */

static inline TARGET_AVX2 __attribute__((always_inline)) int type_qk(const int TYPE) {
    return TYPE == T_Q2_K || TYPE == T_Q3_K || TYPE == T_Q4_K || TYPE == T_Q5_K || TYPE == T_Q6_K ||
                   TYPE == T_IQ4_XS ? 256 : 32;
}

static inline TARGET_AVX2 __attribute__((always_inline)) __m256i nibbles16(const uint8_t *qs) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

/* Each byte of spread, a copy of the byte of qh that holds its bit (byte i of a lane of
 * eight: bit i), as 0x10 where that bit is set, else 0. */
static inline TARGET_AVX2 __attribute__((always_inline)) __m256i bit_bytes(__m256i spread) {
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

/* Bit i of the 32-bit little-endian qh as 0x10 in byte i (the fifth bit of Q5_0/Q5_1). */
static inline TARGET_AVX2 __attribute__((always_inline)) __m256i fifth_bits(const uint8_t *qh) {
    uint32_t h;
    memcpy(&h, qh, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    return bit_bytes(spread);
}

/* The fifth bits of two Q5_0/Q5_1 blocks at once, as PAIR_BODY holds their quants: qh0's
 * bits 0-15 (elements 0-15 of the first block, against its low nibbles) in the low lane and
 * qh1's in the high one (upper = 0); with upper = 1 bits 16-31 (elements 16-31, the high
 * nibbles). Each bit as 0x10 in its byte, shared by every row of the pass. */
static inline TARGET_AVX2 __attribute__((always_inline)) __m256i fifth_bits_pair(const uint8_t *qh0, const uint8_t *qh1,
                                                                                 const int upper) {
    uint32_t h0, h1;
    memcpy(&h0, qh0, 4);
    memcpy(&h1, qh1, 4);
    const __m256i both = _mm256_set_m128i(_mm_set1_epi32((int)h1), _mm_set1_epi32((int)h0));
    const __m256i lower_bytes = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m256i spread = _mm256_shuffle_epi8(both, upper ? _mm256_add_epi8(lower_bytes, _mm256_set1_epi8(2))
                                                           : lower_bytes);
    return bit_bytes(spread);
}

static inline TARGET_AVX2 __attribute__((always_inline)) __m256i iq4_values(__m256i nib) {
    const __m256i table = _mm256_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153, (char)166,
                                           (char)181, (char)197, (char)217, (char)241, 1, 24, 45, 63, 79, 93, 106, 118,
                                           (char)129, (char)141, (char)153, (char)166, (char)181, (char)197, (char)217,
                                           (char)241); /* KVALUES_IQ4NL + 128 */
    return _mm256_shuffle_epi8(table, nib);
}

/* Sub-block j (0 .. qk/32 - 1) of the type's block at blk, as u = q + off (gguf_quants_c's bytes). */
static inline TARGET_AVX2 __attribute__((always_inline)) __m256i quants32(const int TYPE, const uint8_t *blk,
                                                                          const int j) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(3), low1 = _mm256_set1_epi8(1);
    switch (TYPE) {
    case T_Q4_0: return nibbles16(blk + 2);
    case T_Q4_1: return nibbles16(blk + 4);
    case T_Q5_0: return _mm256_or_si256(nibbles16(blk + 6), fifth_bits(blk + 2));
    case T_Q5_1: return _mm256_or_si256(nibbles16(blk + 8), fifth_bits(blk + 4));
    case T_Q8_0: return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)), _mm256_set1_epi8((char)0x80));
    case T_IQ4_NL: return iq4_values(nibbles16(blk + 2));
    case T_IQ4_XS: return iq4_values(nibbles16(blk + 8 + 16 * j));
    case T_Q2_K: {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * (j / 4)));
        return _mm256_and_si256(_mm256_srli_epi16(q, 2 * (j % 4)), low2);
    }
    case T_Q3_K: {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * (j / 4)));
        const __m256i h = _mm256_loadu_si256((const __m256i *)blk);
        return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * (j % 4)), low2),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, j), low1), 2));
    }
    case T_Q4_K:
    case T_Q5_K: {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + (TYPE == T_Q4_K ? 16 : 48) + 32 * (j / 2)));
        __m256i u = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(q, 4) : q, low4);
        if (TYPE == T_Q5_K) { /* bit j of each qh byte to 0x10 in one 16-bit shift: no bit crosses a byte into it */
            const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 16));
            const __m256i moved = j <= 4 ? _mm256_slli_epi16(h, 4 - j) : _mm256_srli_epi16(h, j - 4);
            u = _mm256_or_si256(u, _mm256_and_si256(moved, _mm256_set1_epi8(0x10)));
        }
        return u;
    }
    default: { /* T_Q6_K */
        const int h = j / 4, kq = j % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (kq % 2)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        const __m256i lo = _mm256_and_si256(kq < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
        return _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * kq), low2), 4));
    }
    }
}

static inline TARGET_AVX2 __attribute__((always_inline)) float f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The per-32 s, m of the type's block (the per-16 sc, mn where the kind has them) into
 * panels at [sub * stride + c] (sc, mn at [half * stride + c]); the values gguf_params_c gives.
 * Not the K chain's types (Q4_K, Q5_K, Q6_K): k_params8 writes theirs, eight columns at once. */
static inline TARGET_AVX2 __attribute__((always_inline)) void params_at(const int TYPE, const uint8_t *b, float *ps,
                                                                         float *pm, int32_t *psc, int32_t *pmn,
                                                                         const int stride, int c) {
    switch (TYPE) {
    case T_Q4_0: case T_Q5_0: case T_Q8_0: case T_IQ4_NL:
        ps[c] = f16c(b);
        return;
    case T_Q4_1: case T_Q5_1:
        ps[c] = f16c(b), pm[c] = f16c(b + 2);
        return;
    default: {
        dblock_t o;
        gguf_params_c(TYPE, b, &o);
        for (int j = 0; j < 8; j++) ps[j * stride + c] = o.s[j], pm[j * stride + c] = o.m[j];
        if (TYPE == T_Q2_K || TYPE == T_Q3_K)
            for (int i = 0; i < 16; i++) psc[i * stride + c] = o.sc[i], pmn[i * stride + c] = o.mn[i];
    }
    }
}


/* The largest of v's eight lanes. */
static inline TARGET_AVX2 __attribute__((always_inline)) float hmax_avx2(__m256 v) {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

/* max|x| over blocks32 blocks of 32 floats (a max: the order does not matter). */
static inline TARGET_AVX2 __attribute__((always_inline)) float amax_avx2(const float *x, int blocks32) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 4 * blocks32; i++) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)));
    return hmax_avx2(mx);
}

/* max|x| of each of a superblock's eight 32-blocks (x: 256 floats), lane j for block j:
 * each block's four vectors maxed into one, then the eight reduced side by side (the
 * pairs' unpacks, the quads' shuffles, the halves' permutes) instead of one horizontal
 * reduction per block. */
static inline TARGET_AVX2 __attribute__((always_inline)) __m256 amax8_avx2(const float *x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[8];
    for (int j = 0; j < 8; j++) {
        __m256 mx = _mm256_setzero_ps(); /* from 0, as amax_avx2 */
        for (int i = 0; i < 4; i++) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 32 * j + 8 * i)));
        v[j] = mx;
    }
    __m256 pairs[4], quads[2];
    for (int p = 0; p < 4; p++) /* per 128-bit half: block 2p's and 2p + 1's maxima of lanes (0, 2), (1, 3) */
        pairs[p] = _mm256_max_ps(_mm256_unpacklo_ps(v[2 * p], v[2 * p + 1]), _mm256_unpackhi_ps(v[2 * p], v[2 * p + 1]));
    for (int q = 0; q < 2; q++) /* per 128-bit half: blocks 4q .. 4q + 3, each over its half's four lanes */
        quads[q] = _mm256_max_ps(_mm256_shuffle_ps(pairs[2 * q], pairs[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(pairs[2 * q], pairs[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_max_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20), _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}

/* A superblock's eight multiples (into km) and the inverses of their steps (into inv, 0
 * where the step is 0), from its blocks' maxima amax32 and its own amax: the operations of
 * k_chain_multiple and k_chain_step lane by lane, so the same bits (flat: every m 1, every
 * step amax / 127). */
static inline TARGET_AVX2 __attribute__((always_inline)) void k_chain_steps8_avx2(__m256 amax32, float amax, int flat,
                                                                                   int16_t *km, float *inv) {
    __m256i m8 = _mm256_set1_epi32(1);
    if (flat) {
        const float step = k_chain_step(amax, 1, 1);
        _mm256_storeu_ps(inv, _mm256_set1_ps(step > 0.0f ? 1.0f / step : 0.0f));
        _mm_storeu_si128((__m128i *)km, _mm_set1_epi16(1));
        return;
    }
    if (amax > 0.0f) {
        const __m256 up = _mm256_round_ps(_mm256_mul_ps(_mm256_div_ps(amax32, _mm256_set1_ps(amax)), _mm256_set1_ps(16.0f)),
                                          _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
        m8 = _mm256_max_epi32(_mm256_cvttps_epi32(up), m8);
    }
    const __m256 step = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(amax / 127.0f), _mm256_cvtepi32_ps(m8)),
                                      _mm256_set1_ps(0.0625f));
    _mm256_storeu_ps(inv, _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), step),
                                        _mm256_cmp_ps(step, _mm256_setzero_ps(), _CMP_GT_OQ)));
    _mm_storeu_si128((__m128i *)km, _mm_packs_epi32(_mm256_castsi256_si128(m8), _mm256_extracti128_si256(m8, 1)));
}

/* One 32-block of x quantized to out (and, where uout is not NULL, plus 128 to uout; where
 * out2 is not NULL, again to out2); its halves' values (elements 0-15, 16-31) as vectors of
 * pair sums into lo and hi (lane i: values i and 8 + i of the half), for the caller to
 * reduce (hsum8x8_epi32 for eight blocks at once). */
static inline TARGET_AVX2 __attribute__((always_inline)) void quantize32_halves_avx2(const float *x, float inv,
                                                                                      int8_t *out, uint8_t *uout,
                                                                                      int8_t *out2, __m256i *lo,
                                                                                      __m256i *hi) {
    const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
    const __m256 scale = _mm256_set1_ps(inv);
    __m256i q[4];
    for (int i = 0; i < 4; i++) {
        const __m256 rounded = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), scale),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(rounded), top), bottom);
    }
    /* the packs work within 128-bit halves: dword i of their result holds four values of
     * q[i % 4], from its lane 4 (i / 4) on; the permute puts the dwords in order */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i packed = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)out, packed);
    if (out2) _mm256_storeu_si256((__m256i *)out2, packed);
    if (uout) _mm256_storeu_si256((__m256i *)uout, _mm256_xor_si256(packed, _mm256_set1_epi8((char)0x80)));
    *lo = _mm256_add_epi32(q[0], q[1]);
    *hi = _mm256_add_epi32(q[2], q[3]);
}

/* The sum of the eight int32 lanes of v. */
static inline TARGET_AVX2 __attribute__((always_inline)) int32_t hsum_epi32_avx2(__m256i v) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    return _mm_cvtsi128_si32(s4);
}

/* Lane j: the sum of v[j]'s eight int32 lanes (exact, so in any order): two rounds of
 * pairwise adds within 128-bit halves, then the halves added. Eight blocks' sums at the
 * cost of about one horizontal reduction. */
static inline TARGET_AVX2 __attribute__((always_inline)) __m256i hsum8x8_epi32(const __m256i v[8]) {
    const __m256i lo = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i hi = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}

/* A 32-block's a = m * kq (|a| <= 16 * 127) as the AMX pass's two bytes, a = 256 * ahi + alo
 * (gguf_tile_amx.h), written as the block is quantized rather than by a pass of its own
 * over every row again. */
static inline TARGET_AVX2 __attribute__((always_inline)) void amx_split32_avx2(const int8_t *kq, int m, uint8_t *alo,
                                                                                int8_t *ahi) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)kq), mult = _mm256_set1_epi16((short)m);
    const __m256i a0 = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)), mult);
    const __m256i a1 = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)), mult);
    const __m256i low = _mm256_set1_epi16(0xff);
    /* the packs work within 128-bit halves: the permute puts the four quarters in order */
    const __m256i lo = _mm256_packus_epi16(_mm256_and_si256(a0, low), _mm256_and_si256(a1, low));
    const __m256i hi = _mm256_packs_epi16(_mm256_srai_epi16(a0, 8), _mm256_srai_epi16(a1, 8));
    _mm256_storeu_si256((__m256i *)alo, _mm256_permute4x64_epi64(lo, _MM_SHUFFLE(3, 1, 2, 0)));
    _mm256_storeu_si256((__m256i *)ahi, _mm256_permute4x64_epi64(hi, _MM_SHUFFLE(3, 1, 2, 0)));
}

/* A 32-block's 32 bytes in halves order (acts_t's kqh, and the quants of Q6_K's AVX2
 * tile): 16-bit word 2g is word g, word 2g + 1 is word 8 + g, so that each four bytes
 * 4g .. 4g + 3 hold two values of the first half and the two 16 positions on. */
static inline TARGET_AVX2 __attribute__((always_inline)) __m256i halves_order32(__m256i v) {
    const __m256i words = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                           0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    /* 64-bit words 0, 2, 1, 3: each 128-bit lane holds four words of each half */
    return _mm256_shuffle_epi8(_mm256_permute4x64_epi64(v, 0xD8), words);
}

/* A 32-block's two quarters' offsets for Q6_K's AVX2 tile pass (acts_t's kc16), from its
 * bytes in halves order kh: per quarter (bytes 0-15, 16-31 of kh), the sums of its values
 * from the first half and from the second, times -32, as two int16 in one int32. */
static inline TARGET_AVX2 __attribute__((always_inline)) void q6k_offsets32_avx2(__m256i kh, int32_t *kc16,
                                                                                 int64_t stride) {
    /* pairs of bytes (2i, 2i + 1) summed; each int32 lane then holds one (first half, second
     * half) pair of sums, and the two shuffles add a quarter's four lanes int16 by int16 */
    const __m256i p = _mm256_maddubs_epi16(_mm256_set1_epi8(1), kh);
    __m256i s = _mm256_add_epi16(p, _mm256_shuffle_epi32(p, 0x4E));
    s = _mm256_mullo_epi16(_mm256_add_epi16(s, _mm256_shuffle_epi32(s, 0xB1)), _mm256_set1_epi16(-32));
    kc16[0] = _mm256_cvtsi256_si32(s);
    kc16[stride] = _mm256_extract_epi32(s, 4);
}

/* The 4 x 4 transpose of 64-bit words: qword p of v[s] is qword s of src[p]. */
static inline TARGET_AVX2 __attribute__((always_inline)) void qwords4x4(const __m256i src[4], __m256i v[4]) {
    const __m256i t0 = _mm256_unpacklo_epi64(src[0], src[1]), t1 = _mm256_unpackhi_epi64(src[0], src[1]);
    const __m256i t2 = _mm256_unpacklo_epi64(src[2], src[3]), t3 = _mm256_unpackhi_epi64(src[2], src[3]);
    v[0] = _mm256_permute2x128_si256(t0, t2, 0x20), v[2] = _mm256_permute2x128_si256(t0, t2, 0x31);
    v[1] = _mm256_permute2x128_si256(t1, t3, 0x20), v[3] = _mm256_permute2x128_si256(t1, t3, 0x31);
}

/* A superblock's 256 activation bytes q (eight 32-blocks) in quad order, into out: eight
 * 32-byte vectors, h = 0 (the even 32-blocks) then h = 1 (the odd ones), s = 0 .. 3 each,
 * where vector 4h + s holds in its 64-bit word p bytes 8s .. 8s + 7 of 32-block 2p + h.
 * A Q4_K superblock's quants are stored a pair of 32-blocks to 32 bytes (2p in the low
 * nibbles, 2p + 1 in the high ones), so the same transpose of its four 32-byte runs
 * (k_quads_vnni_t) meets these vectors lane for lane. */
static inline TARGET_AVX2 __attribute__((always_inline)) void quad_order(const int8_t *q, int8_t *out) {
    for (int h = 0; h < 2; h++) {
        __m256i src[4], v[4];
        for (int p = 0; p < 4; p++) src[p] = _mm256_loadu_si256((const __m256i *)(q + 32 * (2 * p + h)));
        qwords4x4(src, v);
        for (int i = 0; i < 4; i++) _mm256_storeu_si256((__m256i *)(out + 32 * (4 * h + i)), v[i]);
    }
}

/* The 32 chain's activations for the eight 32-blocks of row r from block b0 on, each the
 * values quantize_rows_avx2's loop makes of one block: their maxima side by side
 * (amax8_avx2), their steps d = amax / 127 and inverses 1 / d (0 where d is 0) by vector
 * divisions (IEEE's: the scalar ones' bits), their halves' sums reduced together. Block by
 * block, a horizontal maximum, two scalar divisions and two horizontal sums in a chain were
 * most of the quantizer's time (6% of a SmolLM2 prefill). */
static inline TARGET_AVX2 __attribute__((always_inline)) void quantize8_blocks_avx2(const acts_t *a, int64_t r,
                                                                                     int64_t b0) {
    const int64_t at = r * a->k + b0 * 32, cell = r * a->nb + b0;
    const float *x = a->x + at;
    const __m256 d = _mm256_div_ps(amax8_avx2(x), _mm256_set1_ps(127.0f));
    float inv[8];
    _mm256_storeu_ps(inv, _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), d),
                                        _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_GT_OQ)));
    __m256i lo[8], hi[8];
    for (int j = 0; j < 8; j++)
        quantize32_halves_avx2(x + 32 * j, inv[j], a->q + at + 32 * j, a->qu ? a->qu + at + 32 * j : NULL, NULL,
                               &lo[j], &hi[j]);
    const __m256i s0 = hsum8x8_epi32(lo), s1 = hsum8x8_epi32(hi);
    _mm256_storeu_ps(a->d + cell, d);
    _mm256_storeu_ps(a->s + cell, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1))));
    /* S_lo, S_hi per block: the unpacks interleave within 128-bit halves (blocks 0, 1 | 4, 5
     * and 2, 3 | 6, 7), the permutes put the halves in order */
    const __m256i il = _mm256_unpacklo_epi32(s0, s1), ih = _mm256_unpackhi_epi32(s0, s1);
    _mm256_storeu_si256((__m256i *)(a->s16 + 2 * cell), _mm256_permute2x128_si256(il, ih, 0x20));
    _mm256_storeu_si256((__m256i *)(a->s16 + 2 * cell + 8), _mm256_permute2x128_si256(il, ih, 0x31));
}

/* A superblock's terms of Q6_K's 512-bit tile pass (acts_t's kz) for the row at `lane` of
 * its group, into z (the group's terms of that superblock): its multiples km and, from its
 * sixteen S16 (sums16), the offsets' starts -32 * S16, as int32, term i at z[i * 8 + lane]. */
static inline TARGET_AVX2 __attribute__((always_inline)) void k_zmm_terms_avx2(const int16_t *km, __m256i sums16,
                                                                               int lane, int32_t *z) {
    int32_t terms[24];
    _mm256_storeu_si256((__m256i *)terms, _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)km)));
    const __m256i halves[2] = {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(sums16)),
                               _mm256_cvtepi16_epi32(_mm256_extracti128_si256(sums16, 1))};
    for (int h = 0; h < 2; h++)
        _mm256_storeu_si256((__m256i *)(terms + 8 + 8 * h), _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(halves[h], 5)));
    for (int i = 0; i < 24; i++) z[i * 8 + lane] = terms[i];
}

/* quantize_rows on AVX2: the same values (the same float operations, round to nearest even). */
static TARGET_AVX2 void quantize_rows_avx2(void *arg, int index, int count) {
    const acts_t *a = (const acts_t *)arg;
    for (int64_t r = a->m * index / count; r < a->m * (index + 1) / count; r++) {
        if (a->kq)
            for (int64_t t = 0; t < a->k / 256; t++) {
                const float *x = a->x + r * a->k + t * 256;
                int8_t *kq = a->kq + r * a->k + t * 256;
                int16_t *s16 = a->ks16 + r * (a->k / 16) + t * 16, *s32 = a->ks32 + r * (a->k / 32) + t * 8;
                int16_t *km = a->km + r * (a->k / 32) + t * 8;
                const __m256 amax32 = amax8_avx2(x);
                const float amax = hmax_avx2(amax32);
                float inv[8];
                k_chain_steps8_avx2(amax32, amax, a->k_flat, km, inv);
                __m256i lo[8], hi[8];
                for (int j = 0; j < 8; j++) {
                    uint8_t *alo = a->alo ? a->alo + r * a->amx_stride + t * 256 + 32 * j : NULL;
                    /* flat: the AMX pass's one byte is kq itself */
                    quantize32_halves_avx2(x + 32 * j, inv[j], kq + 32 * j, NULL, a->k_flat ? (int8_t *)alo : NULL,
                                           &lo[j], &hi[j]);
                    if (alo && !a->k_flat) amx_split32_avx2(kq + 32 * j, km[j], alo, a->ahi + r * a->amx_stride + t * 256 + 32 * j);
                    if (a->kqh) {
                        const __m256i kh = halves_order32(_mm256_loadu_si256((const __m256i *)(kq + 32 * j)));
                        const int64_t group = r / 4, lane = r % 4, b = t * 8 + j; /* acts_t's groups of four rows */
                        _mm256_storeu_si256((__m256i *)(a->kqh + (group * (a->k / 32) + b) * 128 + lane * 32), kh);
                        q6k_offsets32_avx2(kh, a->kc16 + (group * (a->k / 16) + 2 * b) * 4 + lane, 4);
                        a->km4[(group * (a->k / 32) + b) * 4 + lane] = km[j];
                    }
                }
                /* the eight blocks' S_lo, S_hi as int16 (|S| <= 16 * 127): the unpacks interleave
                 * within 128-bit halves (blocks 0, 1 | 4, 5 and 2, 3 | 6, 7), and the pack's
                 * order (per half, its first operand's then its second's) puts them in order */
                const __m256i sum_lo = hsum8x8_epi32(lo), sum_hi = hsum8x8_epi32(hi);
                const __m256i sums16 = _mm256_packs_epi32(_mm256_unpacklo_epi32(sum_lo, sum_hi),
                                                          _mm256_unpackhi_epi32(sum_lo, sum_hi));
                _mm256_storeu_si256((__m256i *)s16, sums16);
                if (a->kz) {
                    k_zmm_terms_avx2(km, sums16, r % 8, a->kz + (r / 8 * (a->k / 256) + t) * 192);
                    int8_t *kq8 = a->kq8 + (r / 8 * (a->k / 32) + t * 8) * 256 + r % 8 * 32;
                    for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)(kq8 + 256 * j), _mm256_loadu_si256((const __m256i *)(kq + 32 * j)));
                }
                const __m256i sum = _mm256_add_epi32(sum_lo, sum_hi);
                _mm_storeu_si128((__m128i *)s32, _mm_packs_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1)));
                a->kd[r * (a->k / 256) + t] = k_chain_unit(amax, a->k_flat);
                if (a->kx) quad_order(kq, a->kx + r * a->k + t * 256);
            }
        if (!a->q) continue;
        int64_t b = 0;
        for (; b + 8 <= a->nb; b += 8) quantize8_blocks_avx2(a, r, b);
        for (; b < a->nb; b++) {
            const float *x = a->x + r * a->k + b * 32;
            const float d = amax_avx2(x, 1) / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            __m256i lo, hi;
            quantize32_halves_avx2(x, inv, a->q + r * a->k + b * 32, a->qu ? a->qu + r * a->k + b * 32 : NULL, NULL, &lo,
                                   &hi);
            const int32_t sums[2] = {hsum_epi32_avx2(lo), hsum_epi32_avx2(hi)};
            a->d[r * a->nb + b] = d;
            a->s[r * a->nb + b] = d * (float)(sums[0] + sums[1]);
            a->s16[r * 2 * a->nb + 2 * b] = sums[0];
            a->s16[r * 2 * a->nb + 2 * b + 1] = sums[1];
        }
    }
}

/* Per-thread tile scratch: tile 16 * k bytes (32-byte vectors tile[(b * 8 + g) * 2 + v]:
 * lane c holds elements 4g .. 4g + 3 of block b of column 8v + c; Q6_K's for the AVX2 pass
 * in halves order, halves_order32), column bytes 16 * k (the
 * tile's |q| where build_tile writes them: abs_tiled),
 * panels: s, m (nb * 16 floats each, block-major), sc, mn (2 nb * 16 int32 each). */
typedef struct {
    uint8_t *tile, *cols;
    float *ps, *pm;
    int32_t *psc, *pmn;
    uint8_t *amx_lo, *amx_hi; /* the AMX pass's weights (scale times quant) as low and high bytes (gguf_tile_amx.h), or NULL */
    int32_t *q6k_table; /* Q6_K's scales times each multiple m (VNNI: q6k_scale_table), or NULL */
} tile_t;

static tile_t tile_scratch_sub(const job_t *job, int index, int sub) {
    uint8_t *base = job->scratch + (int64_t)index * job->scratch_bytes + (int64_t)sub * job->sub_bytes;
    const int64_t k = job->k, nb = job->nb;
    tile_t t;
    t.tile = base;
    t.cols = base + TILE * k;
    t.ps = (float *)(t.cols + TILE * k);
    t.pm = t.ps + nb * TILE;
    t.psc = (int32_t *)(t.pm + nb * TILE);
    t.pmn = t.psc + 2 * nb * TILE;
    t.amx_lo = job->amx_at ? base + job->amx_at : NULL;
    t.amx_hi = job->amx_at ? t.amx_lo + TILE * k : NULL;
    t.q6k_table = job->q6k_table_at ? (int32_t *)(base + job->q6k_table_at) : NULL;
    return t;
}

static tile_t tile_scratch(const job_t *job, int index) { return tile_scratch_sub(job, index, 0); }

/* The types on the 32 chain (the few-row group kernels); the K chain's have their own. */
#define TYPES_32_CHAIN(CALL)                                                                               \
    case T_Q4_0: CALL(T_Q4_0); break;                                                                      \
    case T_Q4_1: CALL(T_Q4_1); break;                                                                      \
    case T_Q5_0: CALL(T_Q5_0); break;                                                                      \
    case T_Q5_1: CALL(T_Q5_1); break;                                                                      \
    case T_Q8_0: CALL(T_Q8_0); break;                                                                      \
    case T_Q2_K: CALL(T_Q2_K); break;                                                                      \
    case T_Q3_K: CALL(T_Q3_K); break;                                                                      \
    case T_IQ4_NL: CALL(T_IQ4_NL); break;                                                                  \
    default: CALL(T_IQ4_XS);

#define TYPE_CASES(CALL)                                                                                   \
    case T_Q4_0: CALL(T_Q4_0); break;                                                                      \
    case T_Q4_1: CALL(T_Q4_1); break;                                                                      \
    case T_Q5_0: CALL(T_Q5_0); break;                                                                      \
    case T_Q5_1: CALL(T_Q5_1); break;                                                                      \
    case T_Q8_0: CALL(T_Q8_0); break;                                                                      \
    case T_Q2_K: CALL(T_Q2_K); break;                                                                      \
    case T_Q3_K: CALL(T_Q3_K); break;                                                                      \
    case T_Q4_K: CALL(T_Q4_K); break;                                                                      \
    case T_Q5_K: CALL(T_Q5_K); break;                                                                      \
    case T_Q6_K: CALL(T_Q6_K); break;                                                                      \
    case T_IQ4_NL: CALL(T_IQ4_NL); break;                                                                  \
    default: CALL(T_IQ4_XS);

static void build_tile(const job_t *job, const tile_t *tl, const bargein_qseg_t *seg, const qinfo_t *info,
                       int64_t col0);

/* The weights of the group a tile ahead, fetched into L2 by the first pass(es) over a group,
 * a few lines per step (block or pair of blocks), each line once: eight interleaved
 * column streams are more than the hardware prefetcher follows at one row's speed, and a
 * block or a pair can span two lines or more (fetching one line per block left the rest
 * to demand misses: the 1-row head ran at half BlockWeight's speed). The range is one
 * stretch where the eight rows lie back to back, else one per column. A prefetch past
 * the data never faults. */
typedef struct {
    const uint8_t *base[8];
    int ranges;
    int64_t lines, per_step; /* lines per range, lines fetched per range and step */
    int64_t first;           /* the line step 0 fetches (a pass after the first: its part's start) */
} ahead_t;

/* Writes the plan in place: returned by value, the 88-byte struct was built on the stack and
 * copied out by wider loads than its stores, a store-forwarding stall per call; with one
 * call per eight columns of a one-row step that was 2.3% of a decode's samples. */
static void ahead_plan(ahead_t *p, const bargein_qseg_t *seg, int64_t first, int64_t span, int64_t steps) {
    const int together = seg->order == NULL && first + 7 < seg->rows;
    p->ranges = together ? 1 : 8;
    if (together) {
        p->base[0] = column_row(seg, first); /* the only range */
    } else {
        for (int c = 0; c < 8; c++) p->base[c] = column_row(seg, first + c < seg->rows ? first + c : seg->rows - 1);
    }
    const int64_t bytes = together ? 7 * seg->row_bytes + span : span;
    p->lines = (bytes + 126) / 64; /* from an unaligned start */
    p->per_step = (p->lines + steps - 1) / steps;
    p->first = 0;
}

static inline TARGET_AVX2 __attribute__((always_inline)) void prefetch_step(const ahead_t *p, int64_t step) {
    const int64_t l0 = p->first + step * p->per_step, l1 = l0 + p->per_step < p->lines ? l0 + p->per_step : p->lines;
    for (int i = 0; i < p->ranges; i++)
        for (int64_t l = l0; l < l1; l++) _mm_prefetch((const char *)(p->base[i] + 64 * l), _MM_HINT_T1);
}

/* A row's eight float sums (one column to a lane) into y, columns j0 .. j0 + cols - 1. */
static inline TARGET_AVX2 __attribute__((always_inline)) void store_row8(const job_t *job, __m256 sums, int64_t row,
                                                                          int64_t j0, int cols) {
    float lanes[8];
    _mm256_storeu_ps(lanes, sums);
    float *out = job->y + row * job->n + j0;
    for (int c = 0; c < cols; c++) out[c] = lanes[c];
}

/* The rows of eight columns evenly apart (the strided passes' col0 and stride), as the
 * column pointers the pass bodies read. */
typedef struct {
    const uint8_t *c[8];
} cols8_t;

static inline TARGET_AVX2 __attribute__((always_inline)) cols8_t strided_cols8(const uint8_t *col0, int64_t stride) {
    const uint8_t *const c4 = col0 + 4 * stride;
    return (cols8_t){{col0, col0 + stride, col0 + 2 * stride, col0 + 3 * stride, c4, c4 + stride, c4 + 2 * stride,
                      c4 + 3 * stride}};
}

/* The few-row strided passes' fetch of the next tile (pair_rows_avx2_t, k_rows_avx2_t): where
 * its rows lie back to back (one range), a fixed count of lines per step from a running
 * pointer, without prefetch_step's bounds (a prefetch past the data never faults); else
 * prefetch_step's. */
typedef struct {
    const ahead_t *plan; /* NULL: nothing to fetch */
    const char *at;      /* the next line, one range only (else NULL) */
    int per;
} ahead_run_t;

static inline TARGET_AVX2 __attribute__((always_inline)) ahead_run_t ahead_run(const ahead_t *plan) {
    const int one = plan && plan->ranges == 1;
    return (ahead_run_t){plan, one ? (const char *)plan->base[0] : NULL, one ? (int)plan->per_step : 0};
}

static inline TARGET_AVX2 __attribute__((always_inline)) void ahead_run_step(ahead_run_t *run, int64_t step) {
    if (run->at) {
        for (int i = 0; i < run->per; i++) _mm_prefetch(run->at + 64 * i, _MM_HINT_T1);
        run->at += 64 * run->per;
    } else if (run->plan) {
        prefetch_step(run->plan, step);
    }
}

/* The plans for tile `next` (the tile this thread is likely to take after the current one;
 * any segment; -1: none), one per eight columns, in k / block steps (the first pass's
 * steps: superblocks on the K chain, 32-blocks on the 32 chain): 1 if there is one, else
 * 0. The many-row passes read a tile many times from L1/L2 while its successor's blocks
 * would otherwise wait for build_tile's demand misses: 16 column streams are more than the
 * hardware prefetcher follows. */
static int tile_ahead(const job_t *job, int64_t next, int64_t block, int passes, ahead_t ahead[2]) {
    if (next < 0) return 0;
    const bargein_qseg_t *seg = &job->w->segs[job->tile_seg[next]];
    qinfo_t info;
    if (gguf_qinfo((int)seg->type, &info)) return 0;
    const int64_t span = job->k / info.qk * info.bytes, steps = (job->k / block > 0 ? job->k / block : 1) * passes;
    for (int v = 0; v < 2; v++) ahead_plan(&ahead[v], seg, job->tile_col[next] + 8 * v, span, steps);
    return 1;
}


/* Writes the first `cols` of a tile row's 16 sums (lo: columns 0-7, hi: 8-15) to out. */
static inline TARGET_AVX2 __attribute__((always_inline)) void store_tile_row(float *out, int cols, __m256 lo, __m256 hi) {
    if (cols == TILE) { /* a pass is short (600 cycles at 2 rows, k = 2,048): no call to memcpy here */
        _mm256_storeu_ps(out, lo);
        _mm256_storeu_ps(out + 8, hi);
        return;
    }
    float lanes[TILE];
    _mm256_storeu_ps(lanes, lo);
    _mm256_storeu_ps(lanes + 8, hi);
    for (int c = 0; c < cols; c++) out[c] = lanes[c];
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
        if (AHEAD) { /* a constant: the passes without it keep their code */                               \
            prefetch_step(&ahead[0], b);                                                                   \
            prefetch_step(&ahead[1], b);                                                                   \
        }                                                                                                  \
        __m256i dlo[ROWS_MAX][2], dhi[ROWS_MAX][2];                                                        \
        const __m256i *toff = (const __m256i *)(tl->psc + b * TILE);                                       \
        const __m256i toff0 = SIGNED_W || TILE_STARTS ? _mm256_load_si256(toff) : _mm256_setzero_si256();  \
        const __m256i toff1 = SIGNED_W || TILE_STARTS ? _mm256_load_si256(toff + 1) : _mm256_setzero_si256(); \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {                                         \
            const int64_t cell = (r0 + r) * nb + b;                                                        \
            if (SIGNED_W || TILE_STARTS) { /* the tile's terms: sign_tile's, or build_tile's ABS ones */   \
                dlo[r][0] = toff0;                                                                         \
                dlo[r][1] = toff1;                                                                         \
            } else if (KIND >= KIND_SPLIT) {                                                               \
                dlo[r][0] = dlo[r][1] = _mm256_set1_epi32(-OFF * a->s16[2 * cell]);                        \
                dhi[r][0] = dhi[r][1] = _mm256_set1_epi32(-OFF * a->s16[2 * cell + 1]);                    \
            } else {                                                                                       \
                dlo[r][0] = dlo[r][1] = _mm256_set1_epi32(-OFF * (a->s16[2 * cell] + a->s16[2 * cell + 1])); \
            }                                                                                              \
        }                                                                                                  \
        const __m256i *wb = tile + b * 16;                                                                 \
        __m256i s16[ROWS_MAX][2]; /* GROUPS16's int16 sums */                                              \
        (void)s16;                                                                                         \
        _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) {                                              \
            __m256i w0 = _mm256_load_si256(wb + 2 * g), w1 = _mm256_load_si256(wb + 2 * g + 1);            \
            PREP                                                                                           \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {                                     \
                int32_t four;                                                                              \
                memcpy(&four, (SIGNED_W ? (const int8_t *)a->qu : a->q) + (r0 + r) * k + 32 * b + 4 * g, 4); \
                const __m256i xv = _mm256_set1_epi32(four);                                                \
                if (GROUPS16 > 1) {                                                                        \
                    const __m256i p0 = GROUP_PAIRS(w0, xv), p1 = GROUP_PAIRS(w1, xv);                      \
                    s16[r][0] = g % GROUPS16 ? _mm256_add_epi16(s16[r][0], p0) : p0;                       \
                    s16[r][1] = g % GROUPS16 ? _mm256_add_epi16(s16[r][1], p1) : p1;                       \
                    in_order(&s16[r][0]), in_order(&s16[r][1]);                                            \
                    if (g % GROUPS16 == GROUPS16 - 1) {                                                    \
                        dlo[r][0] = _mm256_add_epi32(dlo[r][0], _mm256_madd_epi16(s16[r][0], ones));       \
                        dlo[r][1] = _mm256_add_epi32(dlo[r][1], _mm256_madd_epi16(s16[r][1], ones));       \
                    }                                                                                      \
                } else if (KIND >= KIND_SPLIT && g >= 4) {                                                 \
                    dhi[r][0] = DOT_GROUP(dhi[r][0], w0, xv, 0);                                           \
                    dhi[r][1] = DOT_GROUP(dhi[r][1], w1, xv, 1);                                           \
                    in_order(&dhi[r][0]), in_order(&dhi[r][1]);                                            \
                } else {                                                                                   \
                    dlo[r][0] = DOT_GROUP(dlo[r][0], w0, xv, 0);                                           \
                    dlo[r][1] = DOT_GROUP(dlo[r][1], w1, xv, 1);                                           \
                    in_order(&dlo[r][0]), in_order(&dlo[r][1]);                                            \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {                                         \
            FLOAT_STEPS(acc[r][0], dlo[r][0], dhi[r][0], 0, r)                                             \
            FLOAT_STEPS(acc[r][1], dlo[r][1], dhi[r][1], 1, r)                                             \
        }                                                                                                  \
    }                                                                                                      \
    for (int r = 0; r < ROWS_N; r++) store_tile_row(job->y + (r0 + r) * job->n + j0, cols, acc[r][0], acc[r][1]);

#define SIGNED_W 0
#define TILE_STARTS 0 /* the lanes start from the tile's psc panel (build_tile's ABS terms) */
#define GROUPS16 1 /* groups whose maddubs pairs TILE_ROWS_BODY sums in int16 before a madd (1: none) */
#define GROUP_PAIRS(W, X) _mm256_maddubs_epi16(X, W) /* the AVX2 signed pass's pairs (GROUPS16 > 1) */
/* AVX2, quants below 128 (u * x fits maddubs' int16 pairs): maddubs + madd. PREP holds the
 * weights in registers for both rows, as rows_k16_avx2_t (0.96x the time of Q4_1's pass on a
 * Zen 3; not the 8-bit passes below, whose |q| vectors take the registers: 1.04x). */
#define PREP in_order(&w0), in_order(&w1);
#define DOT_GROUP(ACC, W, X, V) _mm256_add_epi32(ACC, _mm256_madd_epi16(_mm256_maddubs_epi16(W, X), ones))
static inline TARGET_AVX2 __attribute__((always_inline)) void rows_avx2_narrow(const job_t *job, const tile_t *tl, const ahead_t *ahead,
                                                                                int64_t j0, int cols, int64_t r0,
                                                                                const int ROWS_N, const int KIND,
                                                                                const int OFF, const int AHEAD) {
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
static inline TARGET_AVX2 __attribute__((always_inline)) void rows_avx2_wide(const job_t *job, const tile_t *tl, const ahead_t *ahead,
                                                                              int64_t j0, int cols, int64_t r0,
                                                                              const int ROWS_N, const int KIND,
                                                                              const int OFF, const int AHEAD) {
    TILE_ROWS_BODY(2)
}
#undef PREP
#undef DOT_GROUP
/* The same from ABS_MIN_ROWS_AVX2 rows (abs_tiled): the tile holds each quant's sign as a
 * mask (0xFF where q < 0) and its column bytes |q| (build_tile's ABS). x XOR the mask is x
 * where q >= 0 and -x - 1 where q < 0, so maddubs(|q|, x ^ mask) sums q x less |q| for each
 * negative q, and each column's lanes start from that sum (build_tile's terms, in the psc
 * panel: TILE_STARTS): the same int32 D as the vpsignb of x by q above (|x| <= 127,
 * quantize32's range), with an XOR, which any vector port runs, for the vpsignb, which on a
 * Zen 3 takes one of the two ports of the maddubs and the madd. A pair is at most 2 * 128 *
 * 128 in magnitude: maddubs never saturates. (Four rows a pass with the float sums in
 * memory read 0.98x this pass's time on the 1B shapes but 1.04-1.07x on SmolLM2's 1536 x
 * 576: not kept.) */
#define PREP                                                                                               \
    const __m256i a0 = _mm256_load_si256((const __m256i *)tl->cols + b * 16 + 2 * g);                     \
    const __m256i a1 = _mm256_load_si256((const __m256i *)tl->cols + b * 16 + 2 * g + 1);
#define DOT_GROUP(ACC, W, X, V)                                                                            \
    _mm256_add_epi32(ACC, _mm256_madd_epi16(_mm256_maddubs_epi16((V) ? a1 : a0, _mm256_xor_si256(X, (V) ? w1 : w0)), ones))
#undef TILE_STARTS
#define TILE_STARTS 1
static inline TARGET_AVX2 __attribute__((always_inline)) void rows_avx2_wide_abs(const job_t *job, const tile_t *tl,
                                                                                  const ahead_t *ahead, int64_t j0,
                                                                                  int cols, int64_t r0,
                                                                                  const int ROWS_N, const int KIND,
                                                                                  const int OFF, const int AHEAD) {
    TILE_ROWS_BODY(2)
}
#undef TILE_STARTS
#define TILE_STARTS 0
#undef PREP
#undef DOT_GROUP

/* AVX2, the plain kinds whose quants times 255 fit maddubs' int16 pairs (|q| <= 16: Q4_0,
 * Q5_0), made signed as rows_zmm32's SIGNED pass: maddubs of the activations plus 128
 * against q, the pairs of GROUPS16 groups summed in int16 before one madd by ones (OFF, the
 * type's offset, bounds |q|: a pair is at most 2 * 255 * OFF, so 8 groups of Q4_0's stay
 * at 32640 and 4 of Q5_0's), instead of a madd per group: the same int32. */
#define PREP in_order(&w0), in_order(&w1); /* as rows_avx2_narrow's */
#undef SIGNED_W
#define SIGNED_W 1
#undef GROUPS16
#define GROUPS16 (OFF <= 8 ? 8 : 4)
#define DOT_GROUP(ACC, W, X, V) _mm256_add_epi32(ACC, _mm256_madd_epi16(_mm256_maddubs_epi16(X, W), ones))
static inline TARGET_AVX2 __attribute__((always_inline)) void rows_avx2_signed(const job_t *job, const tile_t *tl, const ahead_t *ahead,
                                                                                int64_t j0, int cols, int64_t r0,
                                                                                const int ROWS_N, const int KIND,
                                                                                const int OFF, const int AHEAD) {
    TILE_ROWS_BODY(2)
}
#undef PREP
#undef DOT_GROUP
#undef SIGNED_W
#define SIGNED_W 0
#undef GROUPS16
#define GROUPS16 1

/* Whether the tile passes read a plain kind's tile signed (sign_tile) against acts_t's qu:
 * on VNNI every plain kind, on AVX2 those whose |q| <= 16 (maddubs' pairs of 255 q fit). */
static inline int signed_tile(int isa, const qinfo_t *info) {
    return info->kind == KIND_PLAIN && (isa == ISA_VNNI || (isa == ISA_AVX2 && info->off <= 16));
}

/* Whether the AVX2 tile pass of 8-bit quants (off 128) for a job of m rows is
 * rows_avx2_wide_abs, its tile built with the signs' masks and |q| (build_tile's ABS). */
static inline int abs_tiled(int isa, const qinfo_t *info, int64_t m) {
    return isa == ISA_AVX2 && info->off == 128 && m >= ABS_MIN_ROWS_AVX2;
}

/* The tile's quants made signed for the signed passes: q = u - off in place, and per
 * 32-block and column the lanes' start -128 * sum q (into the tile's psc panel, which the
 * plain kinds do not use): sum q (x + 128) - 128 sum q = sum (u - off) x, the same int32 D
 * as the unsigned passes' with no per-row offset to work out. */
static TARGET_AVX2 void sign_tile(const job_t *job, const tile_t *tl, int off) {
    __m256i *tile = (__m256i *)tl->tile;
    const __m256i offv = _mm256_set1_epi8((char)off), ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < job->nb; b++)
        for (int v = 0; v < 2; v++) {
            __m256i sum = _mm256_setzero_si256();
            for (int g = 0; g < 8; g++) {
                __m256i *at = tile + (b * 8 + g) * 2 + v;
                const __m256i q = _mm256_sub_epi8(_mm256_load_si256(at), offv);
                _mm256_store_si256(at, q);
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, q), ones16));
            }
            _mm256_storeu_si256((__m256i *)(tl->psc + b * TILE + 8 * v),
                                _mm256_slli_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), sum), 7));
        }
}

#define AVX2_KINDS(FN, OFFV)                                                                               \
    switch (kind) {                                                                                        \
    case KIND_PLAIN: if (rows == 2) FN(job, tl, ahead, j0, cols, r0, 2, KIND_PLAIN, OFFV, AHEAD); else FN(job, tl, ahead, j0, cols, r0, 1, KIND_PLAIN, OFFV, AHEAD); break; \
    case KIND_MIN: if (rows == 2) FN(job, tl, ahead, j0, cols, r0, 2, KIND_MIN, OFFV, AHEAD); else FN(job, tl, ahead, j0, cols, r0, 1, KIND_MIN, OFFV, AHEAD); break; \
    case KIND_SPLIT: if (rows == 2) FN(job, tl, ahead, j0, cols, r0, 2, KIND_SPLIT, OFFV, AHEAD); else FN(job, tl, ahead, j0, cols, r0, 1, KIND_SPLIT, OFFV, AHEAD); break; \
    default: if (rows == 2) FN(job, tl, ahead, j0, cols, r0, 2, KIND_SPLIT_MIN, OFFV, AHEAD); else FN(job, tl, ahead, j0, cols, r0, 1, KIND_SPLIT_MIN, OFFV, AHEAD); \
    }

static inline TARGET_AVX2 __attribute__((always_inline)) void rows_avx2_t(const job_t *job, const tile_t *tl,
                                                                           const ahead_t *ahead, const qinfo_t *info,
                                                                           int64_t j0, int cols, int64_t r0, int rows,
                                                                           const int AHEAD) {
    const int kind = info->kind;
    if (job->a->qu && signed_tile(ISA_AVX2, info)) { /* the tile made signed (sign_tile) */
        if (info->off <= 8) { /* Q4_0 */
            if (rows == 2) rows_avx2_signed(job, tl, ahead, j0, cols, r0, 2, KIND_PLAIN, 8, AHEAD);
            else rows_avx2_signed(job, tl, ahead, j0, cols, r0, 1, KIND_PLAIN, 8, AHEAD);
        } else if (rows == 2) rows_avx2_signed(job, tl, ahead, j0, cols, r0, 2, KIND_PLAIN, 16, AHEAD);
        else rows_avx2_signed(job, tl, ahead, j0, cols, r0, 1, KIND_PLAIN, 16, AHEAD);
    } else if (abs_tiled(ISA_AVX2, info, job->m)) {
        AVX2_KINDS(rows_avx2_wide_abs, 0)
    } else if (info->off == 128) {
        AVX2_KINDS(rows_avx2_wide, 0)
    } else if (info->off == 0) {
        AVX2_KINDS(rows_avx2_narrow, 0)
    } else {
        const int off = info->off; /* 4, 8, 16, 32: a run-time offset costs a multiply per block */
        AVX2_KINDS(rows_avx2_narrow, off)
    }
}
/* ahead: NULL, or the next tile's plans, fetched a part per 32-block. */
static TARGET_AVX2 void rows_avx2(const job_t *job, const tile_t *tl, const ahead_t *ahead, const qinfo_t *info,
                                  int64_t j0, int cols, int64_t r0, int rows) {
    if (ahead) rows_avx2_t(job, tl, ahead, info, j0, cols, r0, rows, 1);
    else rows_avx2_t(job, tl, NULL, info, j0, cols, r0, rows, 0);
}
#define ROWS_AVX2 2

/* The K chain's AVX2 passes' inner step: a row's four activation bytes at x, broadcast,
 * against a group's two weight vectors (columns 0-7, 8-15), their maddubs pairs added into
 * the row's int16 sums s (first: s starts from them). */
static inline TARGET_AVX2 __attribute__((always_inline)) void group_pairs_avx2(const int8_t *x, __m256i w0, __m256i w1,
                                                                                int first, __m256i s[2]) {
    int32_t four;
    memcpy(&four, x, 4);
    const __m256i xv = _mm256_set1_epi32(four);
    const __m256i p0 = _mm256_maddubs_epi16(w0, xv), p1 = _mm256_maddubs_epi16(w1, xv);
    s[0] = first ? p0 : _mm256_add_epi16(s[0], p0);
    s[1] = first ? p1 : _mm256_add_epi16(s[1], p1);
    in_order(&s[0]), in_order(&s[1]);
}

#define K_ROWS_AVX2 4 /* rows per AVX2 tile pass of the K chain (every type) at most */

/* The K chain's AVX2 tile passes, rows r0 .. r0 + ROWS_N - 1 over the tile: per
 * superblock, each 32-block's (Q6_K: each quarter's) dot products for 16 columns times the
 * integer scales from the panels (Q6_K: and the row's multiple m of the block), summed in
 * int32 (exact, so in any order), then the header's float steps once. Panels (params_at):
 * sc at [(2 * b) * TILE + c] per 32-block b (Q6_K: the pair (sc of the first half, sc of
 * the second) at [2 * b * TILE + c] in pmn), the mins as int16 pairs at [(16 t + p) * TILE
 * + c] (against the rows' pairs of sum q: Q4_K's and Q5_K's activations are flat, m = 1),
 * d and -dmin at the superblock's first 32-block.
 *
 * Q6_K (offset 32): the tile's quants and the row's activations (acts_t's kqh) are in
 * halves order (halves_order32), so that each int32 lane of a maddubs sum holds a product
 * pair of the block's first half in its low int16 and one of its second half in its high
 * int16. A quarter's four groups are summed in int16 from the row's offsets (kc16: -32
 * times the activations each int16 lane meets), so that each int16 is its half's sum (q -
 * 32) x over the lane's eight products, |.| <= 8 * 32 * 127 = 32,512. The uncentred pairs
 * (up to 2 * 63 * 127 each) pass int16 on the way, but the adds wrap modulo 2^16 and the end
 * fits, so the sum is exact. It meets the pair (sc_first * m, sc_second * m) (|sc * m| <=
 * 128 * 16) in one madd. Per block, row and 8 columns: 8 maddubs, 2 madds and one int16
 * multiply on the multiply ports, where the halves summed apart (each lane's int16 of one
 * half) took two multiplies and a shuffle per half to spread sc over both int16. The adds of
 * the int32 D wrap too where the weights are all 63; D itself fits int32 (|q - 32| <= 32: 16
 * * 2,048 * 16 * 32 * 127 < 2^31), so the wrapped sum is D: the same bits. */
static inline TARGET_AVX2 __attribute__((always_inline)) void rows_q6k_avx2_t(const job_t *job, const tile_t *tl,
                                                                               const ahead_t *ahead, int64_t j0,
                                                                               int cols, int64_t r0, const int ROWS_N) {
    const acts_t *a = job->a;
    const int64_t k = job->k, supers = k / 256;
    const __m256i *tile = (const __m256i *)tl->tile;
    /* the rows' group (acts_t's kqh, kc16, km4): row r at + r, + 32 r in a block */
    const int8_t *kqh = a->kqh + r0 / 4 * 4 * k;
    const int32_t *kc16 = a->kc16 + r0 / 4 * 4 * (k / 16);
    const int16_t *km4 = a->km4 + r0 / 4 * 4 * (k / 32);
    /* in memory, updated once per superblock, as rows_k16_avx2_t's */
    float acc[K_ROWS_AVX2][TILE] __attribute__((aligned(32)));
    memset(acc, 0, sizeof(acc));
    for (int64_t t = 0; t < supers; t++) {
        if (ahead) prefetch_step(ahead, t), prefetch_step(ahead + 1, t);
        __m256i dk[K_ROWS_AVX2][2];
        for (int r = 0; r < ROWS_N; r++) dk[r][0] = dk[r][1] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const int64_t b = t * 8 + j;
            const __m256i *wb = tile + b * 16;
            /* the block's pairs of sc times the row's m, for both quarters */
            __m256i scm[K_ROWS_AVX2][2];
            _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++) {
                const __m256i pair = _mm256_loadu_si256((const __m256i *)(tl->pmn + 2 * b * TILE + 8 * v));
                _Pragma("GCC unroll 4") for (int r = 0; r < ROWS_N; r++)
                    scm[r][v] = _mm256_mullo_epi16(pair, _mm256_set1_epi16(km4[4 * b + r]));
            }
            _Pragma("GCC unroll 2") for (int q = 0; q < 2; q++) {
                __m256i sum[K_ROWS_AVX2][2]; /* [row][v]: the quarter's int16 sums, from the row's offsets */
                _Pragma("GCC unroll 4") for (int r = 0; r < ROWS_N; r++)
                    sum[r][0] = sum[r][1] = _mm256_set1_epi32(kc16[(2 * b + q) * 4 + r]);
                _Pragma("GCC unroll 4") for (int g = 4 * q; g < 4 * q + 4; g++) {
                    __m256i w0 = _mm256_load_si256(wb + 2 * g), w1 = _mm256_load_si256(wb + 2 * g + 1);
                    in_order(&w0), in_order(&w1); /* in registers for every row: as rows_k16_avx2_t */
                    _Pragma("GCC unroll 4") for (int r = 0; r < ROWS_N; r++)
                        group_pairs_avx2(kqh + 128 * b + 32 * r + 4 * g, w0, w1, 0, sum[r]);
                }
                _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++)
                    _Pragma("GCC unroll 4") for (int r = 0; r < ROWS_N; r++) {
                        dk[r][v] = _mm256_add_epi32(dk[r][v], _mm256_madd_epi16(sum[r][v], scm[r][v]));
                        in_order(&dk[r][v]);
                    }
            }
        }
        const int64_t at = t * 8 * TILE;
        const __m256 d[2] = {_mm256_loadu_ps(tl->ps + at), _mm256_loadu_ps(tl->ps + at + 8)};
        _Pragma("GCC unroll 4") for (int r = 0; r < ROWS_N; r++) {
            const __m256 xd = _mm256_set1_ps(a->kd[(r0 + r) * supers + t]);
            _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++)
                _mm256_store_ps(acc[r] + 8 * v, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dk[r][v]), _mm256_mul_ps(d[v], xd),
                                                                _mm256_load_ps(acc[r] + 8 * v)));
        }
    }
    for (int r = 0; r < ROWS_N; r++)
        store_tile_row(job->y + (r0 + r) * job->n + j0, cols, _mm256_load_ps(acc[r]), _mm256_load_ps(acc[r] + 8));
}

/* Q4_K and Q5_K's AVX2 pass (the header's D and M, their activations flat: m = 1): a
 * 32-block's maddubs pairs are summed in int16 and meet the block's sc in one madd,
 * instead of one madd per group of four and a multiply by sc per block. The int16 sums
 * are exact: a pair is at most 2 * 15 * 127 = 3,810 (Q4_K), so the block's eight groups
 * stay under 30,480; Q5_K's pairs reach 2 * 31 * 127 = 7,874, so its halves of four groups
 * are summed apart (31,496) and meet sc in a madd each. A madd pair's products <= 2 *
 * 30,480 * 63 fit int32. Per block, row and 8 columns: 8 maddubs and 1-2 madds on the
 * multiply ports instead of 8 maddubs, 8 madds and a mullo_epi32. */
static inline TARGET_AVX2 __attribute__((always_inline)) void rows_k16_avx2_t(const job_t *job, const tile_t *tl,
                                                                               const ahead_t *ahead, int64_t j0,
                                                                               int cols, int64_t r0, const int ROWS_N,
                                                                               const int HALVES) {
    const acts_t *a = job->a;
    const int64_t k = job->k, supers = k / 256;
    const __m256i *tile = (const __m256i *)tl->tile;
    /* in memory, updated once per superblock: with 16 ymm registers (an AVX2-only CPU) the
     * block's int16 sums, dk, the two weight vectors and the broadcasts take them all */
    float acc[K_ROWS_AVX2][TILE] __attribute__((aligned(32)));
    memset(acc, 0, sizeof(acc));
    for (int64_t t = 0; t < supers; t++) {
        if (ahead) prefetch_step(ahead, t), prefetch_step(ahead + 1, t);
        __m256i dk[K_ROWS_AVX2][2];
        for (int r = 0; r < ROWS_N; r++) dk[r][0] = dk[r][1] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const int64_t b = t * 8 + j;
            const __m256i *wb = tile + b * 16;
            _Pragma("GCC unroll 2") for (int h = 0; h < HALVES; h++) {
                __m256i sum[K_ROWS_AVX2][2]; /* [row][columns 0-7, 8-15]: the half's int16 pairs */
                _Pragma("GCC unroll 8") for (int g = h * (8 / HALVES); g < (h + 1) * (8 / HALVES); g++) {
                    /* held in registers for every row (in_order): left to itself GCC, short of the
                     * 16 ymm registers, loads them again for each row, three loads per two maddubs
                     * where a Zen 3 or a Skylake does two 256-bit loads a cycle (0.91x the time) */
                    __m256i w0 = _mm256_load_si256(wb + 2 * g), w1 = _mm256_load_si256(wb + 2 * g + 1);
                    in_order(&w0), in_order(&w1);
                    /* the sum starts from the half's first group's pairs: no zeroed start to add to
                     * (an add fewer per 8 maddubs; 0.97-0.99x the pass's time built for Zen 3) */
                    _Pragma("GCC unroll 4") for (int r = 0; r < ROWS_N; r++)
                        group_pairs_avx2(a->kq + (r0 + r) * k + 32 * b + 4 * g, w0, w1, g == h * (8 / HALVES), sum[r]);
                }
                /* each half meets sc as soon as it is summed, so that a row holds one half's
                 * sums at a time and Q5_K takes as many rows a pass as Q4_K */
                _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++) {
                    /* sc in both int16 halves of its column's lane, as the tile holds it on AVX2
                     * (k_params8) */
                    const __m256i sc2 = _mm256_loadu_si256((const __m256i *)(tl->psc + 2 * b * TILE + 8 * v));
                    _Pragma("GCC unroll 4") for (int r = 0; r < ROWS_N; r++)
                        dk[r][v] = _mm256_add_epi32(dk[r][v], _mm256_madd_epi16(sum[r][v], sc2));
                }
            }
        }
        const int64_t at = t * 8 * TILE;
        const __m256 d[2] = {_mm256_loadu_ps(tl->ps + at), _mm256_loadu_ps(tl->ps + at + 8)};
        const __m256 nm[2] = {_mm256_loadu_ps(tl->pm + at), _mm256_loadu_ps(tl->pm + at + 8)};
        _Pragma("GCC unroll 4") for (int r = 0; r < ROWS_N; r++) {
            const __m256 xd = _mm256_set1_ps(a->kd[(r0 + r) * supers + t]);
            __m256i mk[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            const int64_t row32 = (r0 + r) * (k / 32) + t * 8;
            for (int p = 0; p < 4; p++) { /* the mins against sum q (flat activations: m = 1) */
                int32_t spair;
                memcpy(&spair, a->ks32 + row32 + 2 * p, 4);
                const __m256i sv = _mm256_set1_epi32(spair);
                _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++) {
                    const __m256i mn = _mm256_loadu_si256((const __m256i *)(tl->pmn + (t * 16 + p) * TILE + 8 * v));
                    mk[v] = _mm256_add_epi32(mk[v], _mm256_madd_epi16(mn, sv));
                }
            }
            _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++) {
                __m256 sum = _mm256_load_ps(acc[r] + 8 * v);
                sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dk[r][v]), _mm256_mul_ps(d[v], xd), sum);
                _mm256_store_ps(acc[r] + 8 * v, _mm256_fmadd_ps(_mm256_cvtepi32_ps(mk[v]), _mm256_mul_ps(nm[v], xd), sum));
            }
        }
    }
    for (int r = 0; r < ROWS_N; r++)
        store_tile_row(job->y + (r0 + r) * job->n + j0, cols, _mm256_load_ps(acc[r]), _mm256_load_ps(acc[r] + 8));
}

/* Each type's K pass for 1-4 rows, the row count a constant in each (a switch per row count
 * with the types inside read 1.25-1.29x Q6_K's time: GCC laid the passes out worse), and
 * each type's in a function of its own, which GCC lays out and gives registers apart: with
 * two Q6_K passes (with and without a table of scales) inlined in one function, GCC moved
 * each quarter's int16 sums from register to register (210 vmovdqa where one pass alone
 * has 90), and the pass took 1.10-1.14x the time on a Zen 3 (bench/gemm_tile_ab.c, 512 rows). */
#define K_PASSES_AVX2(NAME, PASS)                                                                          \
    static TARGET_AVX2 __attribute__((noinline)) void NAME(const job_t *job, const tile_t *tl,             \
                                                           const ahead_t *ahead, int64_t j0, int cols,     \
                                                           int64_t r0, int n) {                            \
        switch (n) {                                                                                       \
        case 4: PASS(4); break;                                                                            \
        case 3: PASS(3); break;                                                                            \
        case 2: PASS(2); break;                                                                            \
        default: PASS(1);                                                                                  \
        }                                                                                                  \
    }
#define Q4K_PASS(N) rows_k16_avx2_t(job, tl, ahead, j0, cols, r0, N, 1)
#define Q5K_PASS(N) rows_k16_avx2_t(job, tl, ahead, j0, cols, r0, N, 2)
#define Q6K_PASS(N) rows_q6k_avx2_t(job, tl, ahead, j0, cols, r0, N)
K_PASSES_AVX2(rows_q4k_avx2, Q4K_PASS)
K_PASSES_AVX2(rows_q5k_avx2, Q5K_PASS)
K_PASSES_AVX2(rows_q6k_avx2, Q6K_PASS)
#undef K_PASSES_AVX2
#undef Q4K_PASS
#undef Q5K_PASS
#undef Q6K_PASS

/* Returns the rows done of the `left` from r0: up to K_ROWS_AVX2. ahead: NULL, or the next
 * tile's plans (tile_ahead), fetched a part per superblock. */
static TARGET_AVX2 int rows_k_avx2(const job_t *job, const tile_t *tl, const ahead_t *ahead, int64_t type,
                                   int64_t j0, int cols, int64_t r0, int left) {
    const int n = left < K_ROWS_AVX2 ? left : K_ROWS_AVX2;
    if (type == T_Q4_K) rows_q4k_avx2(job, tl, ahead, j0, cols, r0, n);
    else if (type == T_Q5_K) rows_q5k_avx2(job, tl, ahead, j0, cols, r0, n);
    else rows_q6k_avx2(job, tl, ahead, j0, cols, r0, n);
    return n;
}

#undef SIGNED_W

#ifdef GGUF_VNNI
#include "gguf_tile_zmm.h" /* the tile passes of VNNI, on 512-bit registers */
#ifdef GGUF_AMX
#include "gguf_tile_amx.h" /* and the K chain's on AMX's tile registers */
#endif
#endif /* GGUF_VNNI */
#endif /* GGUF_X86 */

/* ---- x86, few rows: eight columns at a time, each block decoded in registers ---------- */

#ifdef GGUF_X86
static inline TARGET_AVX2 __attribute__((always_inline)) int type_kind(const int TYPE) {
    return TYPE == T_Q4_1 || TYPE == T_Q5_1 || TYPE == T_Q4_K || TYPE == T_Q5_K ? KIND_MIN
           : TYPE == T_Q3_K || TYPE == T_Q6_K                                ? KIND_SPLIT
           : TYPE == T_Q2_K                                                  ? KIND_SPLIT_MIN
                                                                             : KIND_PLAIN;
}

static inline TARGET_AVX2 __attribute__((always_inline)) int type_off(const int TYPE) {
    switch (TYPE) {
    case T_Q4_0: return 8;
    case T_Q5_0: return 16;
    case T_Q8_0: case T_IQ4_NL: case T_IQ4_XS: return 128;
    case T_Q3_K: return 4;
    case T_Q6_K: return 32;
    default: return 0;
    }
}

/* The 32-bit words at byte `at` of eight columns' rows, one to a lane: each a broadcast
 * load (a load port's work only), blended in (any vector port). Eight inserts into a
 * register, or eight narrow stores and one wide load, would cost shuffles or a missed
 * store forwarding; these words are read once per block and column, as often as the
 * quants themselves, on the few-row path. */
static inline TARGET_AVX2 __attribute__((always_inline)) __m256i words8(const uint8_t *const *col, int64_t at) {
    int32_t w[8];
    for (int c = 0; c < 8; c++) memcpy(&w[c], col[c] + at, 4);
    __m256i v = _mm256_set1_epi32(w[0]);
    v = _mm256_blend_epi32(v, _mm256_set1_epi32(w[1]), 0x02);
    v = _mm256_blend_epi32(v, _mm256_set1_epi32(w[2]), 0x04);
    v = _mm256_blend_epi32(v, _mm256_set1_epi32(w[3]), 0x08);
    v = _mm256_blend_epi32(v, _mm256_set1_epi32(w[4]), 0x10);
    v = _mm256_blend_epi32(v, _mm256_set1_epi32(w[5]), 0x20);
    v = _mm256_blend_epi32(v, _mm256_set1_epi32(w[6]), 0x40);
    return _mm256_blend_epi32(v, _mm256_set1_epi32(w[7]), 0x80);
}

/* The halves in the low 16 bits of two vectors' words as floats: first's, then second's. */
static inline TARGET_AVX2 __attribute__((always_inline)) void low_halves16(__m256i first, __m256i second,
                                                                            __m256 *a, __m256 *b) {
    const __m256i mask = _mm256_set1_epi32(0xFFFF);
    const __m256i packed = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(first, mask), _mm256_and_si256(second, mask)), 0xD8);
    *a = _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
    *b = _mm256_cvtph_ps(_mm256_extracti128_si256(packed, 1));
}

/* The half at byte `at` of eight columns' blocks (a 32-block's d), as floats. Reads 4
 * bytes: every block has more after its d. */
static inline TARGET_AVX2 __attribute__((always_inline)) __m256 halves8(const uint8_t *const *col, int64_t at) {
    __m256 a, b;
    const __m256i w = words8(col, at);
    low_halves16(w, w, &a, &b);
    return a;
}

/* The two halves at byte `at` of eight columns' blocks (Q4_1's d and m), from one word each
 * (inserted: for Q4_1 a few percent faster here than words8's broadcasts and blends). */
static inline TARGET_AVX2 __attribute__((always_inline)) void half_pairs8(const uint8_t *const *col, int64_t at,
                                                                           __m256 *first, __m256 *second) {
    uint32_t w8[8];
    for (int c = 0; c < 8; c++) memcpy(&w8[c], col[c] + at, 4);
    const __m256i w = _mm256_setr_epi32((int)w8[0], (int)w8[1], (int)w8[2], (int)w8[3], (int)w8[4], (int)w8[5],
                                        (int)w8[6], (int)w8[7]);
    low_halves16(w, _mm256_srli_epi32(w, 16), first, second);
}

/* The parameters of eight columns' blocks at byte `at` of their rows into panels [sub * 8 + c]. */
static inline TARGET_AVX2 __attribute__((always_inline)) void params_group(const int TYPE, const uint8_t *const *col,
                                                                            int64_t at, float *ps, float *pm,
                                                                            int32_t *psc, int32_t *pmn) {
    if (type_qk(TYPE) == 32) { /* d (and m) are the block's first halves: eight conversions at once */
        _mm256_storeu_ps(ps, halves8(col, at));
        if (TYPE == T_Q4_1 || TYPE == T_Q5_1) _mm256_storeu_ps(pm, halves8(col, at + 2));
        return;
    }
    for (int c = 0; c < 8; c++) params_at(TYPE, col[c] + at, ps, pm, psc, pmn, 8, c);
}

/* Each lane's 32-bit word shifted right by `shift` and masked: one packed field of eight
 * columns at once. */
static inline TARGET_AVX2 __attribute__((always_inline)) __m256i word_bits(__m256i w, int shift, int mask) {
    return _mm256_and_si256(_mm256_srli_epi32(w, shift), _mm256_set1_epi32(mask));
}

/* A Q4_K/Q5_K/Q6_K superblock's parameters for eight columns at once, one column to a
 * lane, into the tile's panels (ps, pm, psc, pmn already at the eight columns' first lane),
 * as the K passes read them: Q4_K/Q5_K's d and -dmin once, each 32-block j's six-bit scale
 * as an int32 at [2 j * TILE] (for the AVX2 pass, avx2_panels: in both int16 of the int32),
 * the mins as int16 pairs (2p, 2p + 1) at [p * TILE]; Q6_K's d at every [j * TILE], its
 * sixteen scales at [i * TILE] and, for the AVX2 pass, as int16 pairs per 32-block j in pmn:
 * (sc_lo, sc_hi) at [2 j * TILE]. The packed scales
 * are read as 32-bit words of the eight columns (words8), so each scale or min is a shift
 * and a mask for all eight (k_scale_min's formulas, byte i of a word being p[4 w + i]);
 * column by column, the scalar unpacking was ~40% of a Q5_K tile's build, a fifth of a
 * 32-row matmul's time (bench/k_chain_cost.c). */
static inline TARGET_AVX2 __attribute__((always_inline)) void k_params8(const int TYPE, const uint8_t *const *col,
                                                                         int64_t at, float *ps, float *pm,
                                                                         int32_t *psc, int32_t *pmn, int avx2_panels) {
    if (TYPE == T_Q6_K) { /* d repeated per 32-block; sixteen int8 scales, sign-extended */
        __m256 d, scales;
        /* d, the block's last two bytes, as the high half of the word before it: a word at d
         * would read past a tensor's last block, which may end the file's mapping */
        const __m256i tail = words8(col, at + 206);
        low_halves16(_mm256_srli_epi32(tail, 16), tail, &d, &scales);
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(ps + j * TILE, d);
        for (int w = 0; w < 4; w++) {
            const __m256i sc4 = words8(col, at + 192 + 4 * w);
            for (int i = 0; i < 4; i++)
                _mm256_storeu_si256((__m256i *)(psc + (4 * w + i) * TILE),
                                    _mm256_srai_epi32(_mm256_slli_epi32(sc4, 24 - 8 * i), 24));
            /* the AVX2 pass's int16 pairs of 32-block 2w + h: (sc_lo, sc_hi) at [2 (2w + h) * TILE];
             * the other passes do without (written for them too, pairs and their multiples of
             * -32 cost a VNNI pass of 32 rows 1.06x its time) */
            if (!avx2_panels) continue;
            const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(sc4, 8), 8), odd = _mm256_srai_epi16(sc4, 8);
            const __m256i pairs[2] = {_mm256_blend_epi16(even, _mm256_slli_epi32(odd, 16), 0xAA),
                                      _mm256_blend_epi16(_mm256_srli_epi32(even, 16), odd, 0xAA)};
            for (int h = 0; h < 2; h++) _mm256_storeu_si256((__m256i *)(pmn + 2 * (2 * w + h) * TILE), pairs[h]);
        }
        return;
    }
    __m256 d, dmin;
    const __m256i head = words8(col, at);
    low_halves16(head, _mm256_srli_epi32(head, 16), &d, &dmin);
    _mm256_storeu_ps(ps, d);
    _mm256_storeu_ps(pm, _mm256_xor_ps(dmin, _mm256_set1_ps(-0.0f))); /* -dmin, as params_at's negation */
    const __m256i w0 = words8(col, at + 4), w1 = words8(col, at + 8), w2 = words8(col, at + 12);
    __m256i mn[8];
    __m256i sc[8];
    for (int i = 0; i < 4; i++) { /* j = i: p[i] & 63, p[i + 4] & 63 */
        sc[i] = word_bits(w0, 8 * i, 63);
        mn[i] = word_bits(w1, 8 * i, 63);
    }
    for (int i = 0; i < 4; i++) { /* j = i + 4: (p[j + 4] & 15) | (p[j - 4] >> 6) << 4, (p[j + 4] >> 4) | (p[j] >> 6) << 4 */
        sc[i + 4] = _mm256_or_si256(word_bits(w2, 8 * i, 15), word_bits(w0, 8 * i + 2, 0x30));
        mn[i + 4] = _mm256_or_si256(word_bits(w2, 8 * i + 4, 15), word_bits(w1, 8 * i + 2, 0x30));
    }
    /* the AVX2 pass's sc in both int16 of its lane, the factor of its madds (rows_k16_avx2_t:
     * spread there per block, half and eight columns, an or and a shift shared by four rows) */
    for (int j = 0; j < 8; j++)
        _mm256_storeu_si256((__m256i *)(psc + 2 * j * TILE), avx2_panels ? _mm256_or_si256(sc[j], _mm256_slli_epi32(sc[j], 16)) : sc[j]);
    for (int p = 0; p < 4; p++) /* the mins as int16 pairs (2p, 2p + 1) */
        _mm256_storeu_si256((__m256i *)(pmn + p * TILE), _mm256_or_si256(mn[2 * p], _mm256_slli_epi32(mn[2 * p + 1], 16)));
}

/* quants32's bytes less the offset 128 (q, signed), for the 8-bit kinds (type_off 128):
 * Q8_0's stored bytes as they are, instead of flipped twice. */
static inline TARGET_AVX2 __attribute__((always_inline)) __m256i signed_quants32(const int TYPE, const uint8_t *blk,
                                                                                 const int j) {
    if (TYPE == T_Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
    return _mm256_xor_si256(quants32(TYPE, blk, j), _mm256_set1_epi8((char)0x80));
}

/* Eight groups of a 32-block (group g: bytes 4g .. 4g + 3 of each of eight columns, as
 * transposed) put in halves order (halves_order32), the order Q6_K's AVX2 pass reads: group
 * g takes word g % 2 of groups g / 2 and 4 + g / 2. A shift and a blend each, in the
 * 128-bit lanes (permuting each column's 32 bytes before the transpose crosses them: the
 * tile's build took 1.17x its time, eight rows, 2048 x 2048). */
static inline TARGET_AVX2 __attribute__((always_inline)) void halves_order_groups(__m256 r[8]) {
    __m256i g[8];
    for (int i = 0; i < 4; i++) {
        const __m256i first = _mm256_castps_si256(r[i]), second = _mm256_castps_si256(r[4 + i]);
        g[2 * i] = _mm256_blend_epi16(first, _mm256_slli_epi32(second, 16), 0xAA);
        g[2 * i + 1] = _mm256_blend_epi16(_mm256_srli_epi32(first, 16), second, 0xAA);
    }
    for (int i = 0; i < 8; i++) r[i] = _mm256_castsi256_ps(g[i]);
}

/* Columns col0 .. col0 + 15 of a segment (the last repeated past its end) into the tile:
 * each 32-block of eight columns decoded in registers, transposed, stored. ABS (8-bit
 * quants, off 128: abs_tiled), the tile made ready for rows_avx2_wide_abs as it is stored:
 * with q = u - 128, q's sign mask (0xFF where q < 0) into the tile, |q| into its column bytes
 * (as unsigned bytes: |-128| is 128), and per 32-block and column the sum of |q| over the
 * negative q into the psc panel (which the plain kinds do not use), once per tile instead
 * of per group in every pass. (A second pass over the built tile took 4% of a 32-stream
 * decode of smollm2.Q8_0, Zen 3.) */
static inline TARGET_AVX2 __attribute__((always_inline)) void build_tile_t(const int TYPE, const job_t *job,
                                                                            const tile_t *tl,
                                                                            const bargein_qseg_t *seg, int bytes,
                                                                            int64_t col0, const int ABS) {
    const int64_t k = job->k;
    const int qk = type_qk(TYPE), subs = qk / 32;
    __m256i *tile = (__m256i *)tl->tile;
    for (int v = 0; v < 2; v++) {
        const uint8_t *col[8];
        for (int c = 0; c < 8; c++) {
            const int64_t i = col0 + 8 * v + c;
            col[c] = column_row(seg, i < seg->rows ? i : seg->rows - 1);
        }
        for (int64_t t = 0; t < k / qk; t++) {
            const int64_t at = t * bytes;
            if (qk == 32) {
                _mm256_storeu_ps(tl->ps + t * TILE + 8 * v, halves8(col, at));
                if (TYPE == T_Q4_1 || TYPE == T_Q5_1) _mm256_storeu_ps(tl->pm + t * TILE + 8 * v, halves8(col, at + 2));
            } else if (TYPE == T_Q4_K || TYPE == T_Q5_K || TYPE == T_Q6_K) {
                k_params8(TYPE, col, at, tl->ps + t * subs * TILE + 8 * v, tl->pm + t * subs * TILE + 8 * v,
                          tl->psc + 2 * t * subs * TILE + 8 * v, tl->pmn + 2 * t * subs * TILE + 8 * v,
                          job->isa == ISA_AVX2);
            } else {
                for (int c = 0; c < 8; c++)
                    params_at(TYPE, col[c] + at, tl->ps + t * subs * TILE, tl->pm + t * subs * TILE,
                              tl->psc + 2 * t * subs * TILE, tl->pmn + 2 * t * subs * TILE, TILE, 8 * v + c);
            }
            for (int j = 0; j < subs; j++) {
                __m256 r[8];
                const int signed_q = ABS && type_off(TYPE) == 128; /* the ABS tile's q = u - 128 */
                for (int c = 0; c < 8; c++)
                    r[c] = _mm256_castsi256_ps(signed_q ? signed_quants32(TYPE, col[c] + at, j) : quants32(TYPE, col[c] + at, j));
                transpose8(r);
                if (TYPE == T_Q6_K && job->isa == ISA_AVX2) halves_order_groups(r);
                const int64_t b = t * subs + j;
                /* ABS: each column's sum of |q| over q < 0, as int16 pairs (8 groups of two
                 * bytes <= 128 each: <= 2,048) widened once */
                __m256i negs = _mm256_setzero_si256();
                for (int g = 0; g < 8; g++) {
                    const int64_t at_g = (b * 8 + g) * 2 + v;
                    if (signed_q) {
                        const __m256i q = _mm256_castps_si256(r[g]);
                        const __m256i mask = _mm256_cmpgt_epi8(_mm256_setzero_si256(), q), aq = _mm256_abs_epi8(q);
                        _mm256_store_si256(tile + at_g, mask);
                        _mm256_store_si256((__m256i *)tl->cols + at_g, aq);
                        negs = _mm256_add_epi16(negs, _mm256_maddubs_epi16(_mm256_and_si256(aq, mask), _mm256_set1_epi8(1)));
                    } else {
                        _mm256_store_si256(tile + at_g, _mm256_castps_si256(r[g]));
                    }
                }
                if (signed_q)
                    _mm256_storeu_si256((__m256i *)(tl->psc + b * TILE + 8 * v), _mm256_madd_epi16(negs, _mm256_set1_epi16(1)));
            }
        }
    }
}

static TARGET_AVX2 void build_tile(const job_t *job, const tile_t *tl, const bargein_qseg_t *seg, const qinfo_t *info,
                                   int64_t col0) {
    const int abs = abs_tiled(job->isa, info, job->m);
#define BUILD_TILE(TY) build_tile_t(TY, job, tl, seg, info->bytes, col0, abs)
    switch (seg->type) { TYPE_CASES(BUILD_TILE) }
#undef BUILD_TILE
}

/* The lanes a pair of blocks' dot products start from so that their sums come out with the
 * type's offset taken: -off times block b's activation sum (its halves' sums s16[0] +
 * s16[1]) in lane 0, block b + 1's in lane 4 (zero where there is none), zero elsewhere.
 * Lanes 0-3 and 4-7 then sum to D - off * sum(x): the int32 that subtracting afterwards
 * gives, two broadcasts and subtractions fewer per row and pair, and no zeroed register per
 * column. */
static inline TARGET_AVX2 __attribute__((always_inline)) __m256i offset_lanes(int off, const int32_t *s16, int two) {
    const int32_t first = -off * (s16[0] + s16[1]), second = two ? -off * (s16[2] + s16[3]) : 0;
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_cvtsi32_si128(first)), _mm_cvtsi32_si128(second), 1);
}

#define SUM_PAIRS32(a, b) _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b))
#define SUM_PAIRS64(a, b) _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b))

/* Columns j0 .. j0 + 7 (the first `cols` stored; col[c] their rows' blocks, the last
 * repeated) for rows r0 .. r0 + ROWS_N - 1: per 32-block, each column's quants decoded in
 * registers and dotted with every row (eight int32 lanes, four per half), four columns'
 * lanes summed into one per column and half, then the header's float steps, one column
 * to a lane. DOT(U, X) and PREP are the instruction set's byte dot product. */
#define GROUP_BODY(ROWS_MAX)                                                                               \
    const acts_t *a = job->a;                                                                              \
    const int64_t nb = job->nb, k = job->k;                                                                \
    const int qk = type_qk(TYPE), subs = qk / 32, KIND = type_kind(TYPE), OFF = type_off(TYPE);            \
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);                        \
    (void)ones;                                                                                            \
    (void)flip;                                                                                            \
    float ps[8 * 8], pm[8 * 8];                                                                            \
    int32_t psc[16 * 8], pmn[16 * 8];                                                                      \
    __m256 acc[ROWS_MAX];                                                                                  \
    for (int r = 0; r < ROWS_N; r++) acc[r] = _mm256_setzero_ps();                                         \
    for (int64_t t = 0; t < k / qk; t++) {                                                                 \
        params_group(TYPE, col, t * bytes, ps, pm, psc, pmn);                                              \
        if (ahead) prefetch_step(ahead, t);                                                                \
        for (int j = 0; j < subs; j++) {                                                                   \
            const int64_t b = t * subs + j;                                                                \
            __m256i h[ROWS_MAX][2];                                                                        \
            _Pragma("GCC unroll 2") for (int half = 0; half < 2; half++) {                                 \
                __m256i sp[ROWS_MAX][2];                                                                   \
                _Pragma("GCC unroll 2") for (int cp = 0; cp < 2; cp++) {                                   \
                    __m256i tt[ROWS_MAX][2];                                                               \
                    _Pragma("GCC unroll 2") for (int cc = 0; cc < 2; cc++) {                               \
                        const __m256i u = quants32(TYPE, col[half * 4 + cp * 2 + cc] + t * bytes, j);      \
                        PREP                                                                               \
                        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {                         \
                            const __m256i xv = _mm256_loadu_si256((const __m256i *)(a->q + (r0 + r) * k + 32 * b)); \
                            tt[r][cc] = DOT(u, xv);                                                        \
                        }                                                                                  \
                    }                                                                                      \
                    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) sp[r][cp] = SUM_PAIRS32(tt[r][0], tt[r][1]); \
                }                                                                                          \
                _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) h[r][half] = SUM_PAIRS64(sp[r][0], sp[r][1]); \
            }                                                                                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {                                     \
                const int64_t cell = (r0 + r) * nb + b;                                                    \
                __m256i lo = _mm256_permute2x128_si256(h[r][0], h[r][1], 0x20);                            \
                __m256i hi = _mm256_permute2x128_si256(h[r][0], h[r][1], 0x31);                            \
                if (OFF_APPLIES && OFF) {                                                                  \
                    lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(OFF * a->s16[2 * cell]));                  \
                    hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(OFF * a->s16[2 * cell + 1]));              \
                }                                                                                          \
                __m256i D;                                                                                 \
                if (KIND >= KIND_SPLIT)                                                                    \
                    D = _mm256_add_epi32(_mm256_mullo_epi32(lo, _mm256_loadu_si256((const __m256i *)(psc + 2 * j * 8))), \
                                         _mm256_mullo_epi32(hi, _mm256_loadu_si256((const __m256i *)(psc + (2 * j + 1) * 8)))); \
                else                                                                                       \
                    D = _mm256_add_epi32(lo, hi);                                                          \
                const __m256 xd = _mm256_set1_ps(a->d[cell]);                                              \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(D), _mm256_mul_ps(_mm256_loadu_ps(ps + j * 8), xd), acc[r]); \
                if (KIND == KIND_MIN)                                                                      \
                    acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(pm + j * 8), _mm256_set1_ps(a->s[cell]), acc[r]); \
                if (KIND == KIND_SPLIT_MIN) {                                                              \
                    const __m256i M = _mm256_add_epi32(                                                    \
                        _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i *)(pmn + 2 * j * 8)), _mm256_set1_epi32(a->s16[2 * cell])), \
                        _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i *)(pmn + (2 * j + 1) * 8)), _mm256_set1_epi32(a->s16[2 * cell + 1]))); \
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_mul_ps(_mm256_loadu_ps(pm + j * 8), xd), acc[r]); \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
    for (int r = 0; r < ROWS_N; r++) store_row8(job, acc[r], r0 + r, j0, cols);


/* A column's two blocks at byte offsets at0 and at1 of its row w, as PAIR_BODY holds them
 * (see below): elements 0-15 of both blocks in *lo, 16-31 in *hi (Q8_0: their bytes,
 * offset by 128; Q5: with their fifth bits; IQ4_NL: the table's values). */
static inline TARGET_AVX2 __attribute__((always_inline)) void pair_quants(const int TYPE, const uint8_t *w, int64_t at0,
                                                                           int64_t at1, __m256i *lo, __m256i *hi) {
    const int FIVE = TYPE == T_Q5_0 || TYPE == T_Q5_1, qh = TYPE == T_Q5_1 ? 4 : 2; /* Q5: qh's offset */
    const int qoff = TYPE == T_Q4_1 ? 4 : TYPE == T_Q5_0 ? 6 : TYPE == T_Q5_1 ? 8 : 2;
    const __m256i q = _mm256_loadu2_m128i((const __m128i *)(w + at1 + qoff), (const __m128i *)(w + at0 + qoff));
    if (TYPE == T_Q8_0) { /* the blocks' first and second 16 bytes, offset by 128 */
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        *lo = _mm256_xor_si256(q, flip);
        *hi = _mm256_xor_si256(_mm256_loadu2_m128i((const __m128i *)(w + at1 + qoff + 16),
                                                   (const __m128i *)(w + at0 + qoff + 16)), flip);
    } else {
        const __m256i low4 = _mm256_set1_epi8(0x0F);
        *lo = _mm256_and_si256(q, low4), *hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
    }
    if (FIVE) { /* the fifth bits, elements 0-15 with the low nibbles, 16-31 the high */
        *lo = _mm256_or_si256(*lo, fifth_bits_pair(w + at0 + qh, w + at1 + qh, 0));
        *hi = _mm256_or_si256(*hi, fifth_bits_pair(w + at0 + qh, w + at1 + qh, 1));
    }
    if (TYPE == T_IQ4_NL) *lo = iq4_values(*lo), *hi = iq4_values(*hi);
}

/* A row's int8 activations of blocks b and b + 1 (where two; else b again) as PAIR_BODY
 * pairs them: elements 0-15 of both in *lo, 16-31 in *hi. */
static inline TARGET_AVX2 __attribute__((always_inline)) void pair_acts(const acts_t *a, int64_t k, int64_t row,
                                                                         int64_t b, int two, __m256i *lo, __m256i *hi) {
    const int8_t *x0 = a->q + row * k + 32 * b, *x1 = two ? x0 + 32 : x0;
    *lo = _mm256_loadu2_m128i((const __m128i *)x1, (const __m128i *)x0);
    *hi = _mm256_loadu2_m128i((const __m128i *)(x1 + 16), (const __m128i *)(x0 + 16));
}

/* The float steps of PAIR_BODY for one row at blocks b (cell) and b + 1 (where two):
 * d0 and d1 the eight columns' int32 sums of each, less the type's offset terms where
 * SUB_OFF (OFF times the row's activation sums, as a->s16 holds them), then each block's
 * steps in block order (KIND_MIN: and its m). */
static inline TARGET_AVX2 __attribute__((always_inline)) void pair_float_steps(const int KIND, const int SUB_OFF,
                                                                                const int OFF, const acts_t *a,
                                                                                int64_t cell, int two, __m256i d0,
                                                                                __m256i d1, __m256 s0, __m256 s1,
                                                                                __m256 m0, __m256 m1, __m256 *acc) {
    if (SUB_OFF) {
        d0 = _mm256_sub_epi32(d0, _mm256_set1_epi32(OFF * (a->s16[2 * cell] + a->s16[2 * cell + 1])));
        if (two) d1 = _mm256_sub_epi32(d1, _mm256_set1_epi32(OFF * (a->s16[2 * cell + 2] + a->s16[2 * cell + 3])));
    }
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_mul_ps(s0, _mm256_set1_ps(a->d[cell])), *acc);
    if (KIND == KIND_MIN) *acc = _mm256_fmadd_ps(m0, _mm256_set1_ps(a->s[cell]), *acc);
    if (two) {
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_mul_ps(s1, _mm256_set1_ps(a->d[cell + 1])), *acc);
        if (KIND == KIND_MIN) *acc = _mm256_fmadd_ps(m1, _mm256_set1_ps(a->s[cell + 1]), *acc);
    }
}

/* Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q8_0: two blocks of a column at once. One 32-byte vector
 * holds both blocks' low nibbles (elements 0..15 of b, then of b + 1; Q5: with their fifth
 * bits, fifth_bits_pair; Q8_0: their first 16 bytes), another their high ones (Q8_0: the
 * second 16), against the
 * rows' activations loaded to match; the lane sums then give D_b and D_b+1 per column,
 * and the float steps run block b first, as the header says. PAIR_PARAMS reads the eight
 * columns' d (and m) of both blocks; with PAIR_FOLDS the offset's terms start the lanes
 * (offset_lanes), else they are subtracted from the sums. */
#define PAIR_BODY(ROWS_MAX)                                                                                \
    const acts_t *a = job->a;                                                                              \
    const int64_t nb = job->nb, k = job->k;                                                                \
    const int KIND = type_kind(TYPE), OFF = type_off(TYPE);                                                \
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);                        \
    (void)ones;                                                                                            \
    (void)flip;                                                                                            \
    __m256 acc[ROWS_MAX];                                                                                  \
    for (int r = 0; r < ROWS_N; r++) acc[r] = _mm256_setzero_ps();                                         \
    for (int64_t b = 0; b < nb; b += 2) {                                                                  \
        const int two = b + 1 < nb;                                                                        \
        const int64_t at0 = b * bytes, at1 = (two ? b + 1 : b) * bytes;                                    \
        __m256 s0, s1, m0, m1;                                                                             \
        PAIR_PARAMS(col, at0, at1, &s0, &s1, &m0, &m1);                                                    \
        if (ahead) prefetch_step(ahead, b / 2);                                                            \
        __m256i xlo[ROWS_MAX], xhi[ROWS_MAX];                                                              \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) pair_acts(a, k, r0 + r, b, two, &xlo[r], &xhi[r]); \
        __m256i start[ROWS_MAX]; /* where each column's lanes start: zero, or the offset's terms */      \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++)                                           \
            start[r] = PAIR_FOLDS && OFF ? offset_lanes(OFF, a->s16 + 2 * ((r0 + r) * nb + b), two)        \
                                         : _mm256_setzero_si256();                                         \
        (void)start; /* AVX2's PAIR_DOT starts from zero */                                                \
        __m256i h[ROWS_MAX][2];                                                                            \
        _Pragma("GCC unroll 2") for (int half = 0; half < 2; half++) {                                     \
            __m256i sp[ROWS_MAX][2];                                                                       \
            _Pragma("GCC unroll 2") for (int cp = 0; cp < 2; cp++) {                                       \
                __m256i tt[ROWS_MAX][2];                                                                   \
                _Pragma("GCC unroll 2") for (int cc = 0; cc < 2; cc++) {                                   \
                    __m256i lo, hi;                                                                        \
                    pair_quants(TYPE, col[half * 4 + cp * 2 + cc], at0, at1, &lo, &hi);                    \
                    PAIR_PREP                                                                              \
                    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) tt[r][cc] = PAIR_DOT(start[r], lo, hi, xlo[r], xhi[r]); \
                }                                                                                          \
                _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) sp[r][cp] = SUM_PAIRS32(tt[r][0], tt[r][1]); \
            }                                                                                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) h[r][half] = SUM_PAIRS64(sp[r][0], sp[r][1]); \
        }                                                                                                  \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {                                         \
            pair_float_steps(KIND, !PAIR_FOLDS && OFF_APPLIES && OFF, OFF, a, (r0 + r) * nb + b, two,        \
                             _mm256_permute2x128_si256(h[r][0], h[r][1], 0x20),                            \
                             _mm256_permute2x128_si256(h[r][0], h[r][1], 0x31), s0, s1, m0, m1, &acc[r]);  \
        }                                                                                                  \
    }                                                                                                      \
    for (int r = 0; r < ROWS_N; r++) store_row8(job, acc[r], r0 + r, j0, cols);

/* PAIR_BODY's parameters read with words8's broadcasts and blends (Q4_1: inserted). */
#define PAIR_PARAMS_WORDS(COL, AT0, AT1, S0, S1, M0, M1)                                                   \
    if (KIND == KIND_MIN) {                                                                                \
        half_pairs8(COL, AT0, S0, M0);                                                                     \
        half_pairs8(COL, AT1, S1, M1);                                                                     \
    } else {                                                                                               \
        low_halves16(words8(COL, AT0), words8(COL, AT1), S0, S1);                                          \
        *(M0) = *(S0), *(M1) = *(S1);                                                                      \
    }

#define PAIRED(TYPE)                                                                                        \
    ((TYPE) == T_Q4_0 || (TYPE) == T_Q4_1 || (TYPE) == T_Q5_0 || (TYPE) == T_Q5_1 || (TYPE) == T_IQ4_NL ||     \
     (TYPE) == T_Q8_0)
static int paired_type(int type) { return PAIRED(type); }

#define GROUP_ARGS const job_t *job, const uint8_t *const *col, const ahead_t *ahead, int bytes, int64_t j0, \
                   int cols, int64_t r0
/* AVX2: maddubs + madd; 8-bit quants (offset 128) as |q| against x with q's sign. */
#define PREP                                                                                               \
    const __m256i sq = _mm256_xor_si256(u, flip), aq = _mm256_sign_epi8(sq, sq);                           \
    (void)aq;
#define DOT(U, X)                                                                                          \
    (OFF == 128 ? _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(X, sq)), ones)               \
                : _mm256_madd_epi16(_mm256_maddubs_epi16(U, X), ones))
#define OFF_APPLIES (OFF != 128)
#define PAIR_PARAMS PAIR_PARAMS_WORDS
#define PAIR_FOLDS 0 /* maddubs' sign trick for 8-bit quants leaves no lanes to start from */
#define PAIR_PREP                                                                                          \
    const __m256i sl = _mm256_xor_si256(lo, flip), sh = _mm256_xor_si256(hi, flip);                        \
    const __m256i al = _mm256_sign_epi8(sl, sl), ah = _mm256_sign_epi8(sh, sh);                            \
    (void)al;                                                                                              \
    (void)ah;
#define PAIR_DOT(START, LO, HI, XL, XH)                                                                    \
    (OFF == 128 ? _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(al, _mm256_sign_epi8(XL, sl)), ones),  \
                                   _mm256_madd_epi16(_mm256_maddubs_epi16(ah, _mm256_sign_epi8(XH, sh)), ones))  \
                : _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(LO, XL), _mm256_maddubs_epi16(HI, XH)), ones))
static inline TARGET_AVX2 __attribute__((always_inline)) void group_avx2_t(GROUP_ARGS, const int ROWS_N,
                                                                           const int TYPE) {
    if (PAIRED(TYPE)) {
        PAIR_BODY(2)
    } else {
        GROUP_BODY(2)
    }
}
/* PAIR_BODY's arithmetic for ROWS_N rows (r0 on) of eight columns that are rows `stride`
 * bytes apart (col0 the first), at blocks b and b + 1 (TWO; else b alone, the odd last block
 * of a row), added to acc[r]: PAIR_BODY's decoding (pair_quants) and float steps
 * (pair_float_steps), so the same bits. PAIR_BODY takes eight column pointers (GCC keeps
 * them on the stack and loads one for each block it reads) and tests for a second block in
 * every step; this step is addressed from col0 and the stride, and pair_rows_avx2_t takes
 * the odd block after its loop. */
static inline TARGET_AVX2 __attribute__((always_inline)) void pair_rows_step(const int TYPE, const acts_t *a, int64_t nb,
                                                                              int64_t k, const uint8_t *col0,
                                                                              int64_t stride, int bytes, int64_t r0,
                                                                              int64_t b, const int TWO, const int ROWS_N,
                                                                              __m256 *acc) {
    const int KIND = type_kind(TYPE), OFF = type_off(TYPE);
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80); /* (PAIR_PREP's) */
    (void)ones;
    (void)flip;
    const cols8_t rows8 = strided_cols8(col0, stride);
    const uint8_t *const *const wc = rows8.c;
    const int64_t at0 = b * bytes, at1 = (TWO ? b + 1 : b) * bytes;
    __m256 s0, s1, m0, m1;
    PAIR_PARAMS_WORDS(wc, at0, at1, &s0, &s1, &m0, &m1);
    __m256i xlo[STRIDED_ROWS_AVX2], xhi[STRIDED_ROWS_AVX2], tt[STRIDED_ROWS_AVX2][8];
    for (int r = 0; r < ROWS_N; r++) pair_acts(a, k, r0 + r, b, TWO, &xlo[r], &xhi[r]);
    _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {
        __m256i lo, hi;
        pair_quants(TYPE, wc[c], at0, at1, &lo, &hi);
        PAIR_PREP
        for (int r = 0; r < ROWS_N; r++) tt[r][c] = PAIR_DOT(_mm256_setzero_si256(), lo, hi, xlo[r], xhi[r]);
    }
    for (int r = 0; r < ROWS_N; r++) {
        const __m256i h0 = SUM_PAIRS64(SUM_PAIRS32(tt[r][0], tt[r][1]), SUM_PAIRS32(tt[r][2], tt[r][3]));
        const __m256i h1 = SUM_PAIRS64(SUM_PAIRS32(tt[r][4], tt[r][5]), SUM_PAIRS32(tt[r][6], tt[r][7]));
        pair_float_steps(KIND, OFF_APPLIES && OFF, OFF, a, (r0 + r) * nb + b, TWO,
                         _mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31), s0, s1,
                         m0, m1, &acc[r]);
    }
}

/* group_avx2's rows (one to STRIDED_ROWS_AVX2) where its eight columns are rows evenly
 * apart (col[c] = col[0] + c stride): pair_rows_step over the blocks, then the odd last
 * one. The next tile's lines are fetched as ahead_run_t says.
 *
 * A one-stream decode step's matmuls (bench/gemv_layout.c, the file mapped, two threads,
 * Zen 3), new / old time: smollm2.Q8_0 0.82-0.84, smollm2.Q4_0 0.89, smollm2.Q4_K_M (its
 * Q5_0 and Q5_1 matrices) 0.90, llama1b.Q4_0 0.93-0.97. Either change alone gained nothing
 * there: the step alone read 1.02-1.07x the old time from memory (faster where the matrix
 * stays in L2), the prefetch alone 1.01-1.04x. Two rows, against PAIR_BODY's (bench/
 * gemm_tile_ab.c, the 1B layer's shapes, one thread): Q4_0 0.87, Q8_0 0.92. */
static inline TARGET_AVX2 __attribute__((always_inline)) void pair_rows_avx2_t(const int TYPE, const job_t *job,
                                                                                const uint8_t *col0, int64_t stride,
                                                                                const ahead_t *ahead, int bytes,
                                                                                int64_t j0, int cols, int64_t r0,
                                                                                const int ROWS_N) {
    const acts_t *a = job->a;
    const int64_t nb = job->nb, k = job->k;
    __m256 acc[STRIDED_ROWS_AVX2];
    for (int r = 0; r < ROWS_N; r++) acc[r] = _mm256_setzero_ps();
    int64_t b = 0;
    ahead_run_t run = ahead_run(ahead);
    for (; b + 1 < nb; b += 2) {
        ahead_run_step(&run, b / 2);
        pair_rows_step(TYPE, a, nb, k, col0, stride, bytes, r0, b, 1, ROWS_N, acc);
    }
    if (b < nb) { /* (prefetch_step: the run kept past the loop made the loop 1.03x its time) */
        if (ahead) prefetch_step(ahead, b / 2);
        pair_rows_step(TYPE, a, nb, k, col0, stride, bytes, r0, b, 0, ROWS_N, acc);
    }
    for (int r = 0; r < ROWS_N; r++) store_row8(job, acc[r], r0 + r, j0, cols);
}
#undef PAIR_PREP
#undef PAIR_PARAMS
#undef PAIR_FOLDS
#undef PAIR_DOT
#undef PREP
#undef DOT
#undef OFF_APPLIES
#define GROUP_ROWS_AVX2 2

#define PAIRED_CASES(CALL)                                                                                 \
    case T_Q4_0: CALL(T_Q4_0); break;                                                                      \
    case T_Q4_1: CALL(T_Q4_1); break;                                                                      \
    case T_Q5_0: CALL(T_Q5_0); break;                                                                      \
    case T_Q5_1: CALL(T_Q5_1); break;                                                                      \
    case T_Q8_0: CALL(T_Q8_0); break;                                                                      \
    default: CALL(T_IQ4_NL);

/* Three or four strided rows of a paired type (out of line: inlined into group_avx2, these
 * copies made its one- and two-row passes 2-3% slower). */
static TARGET_AVX2 __attribute__((noinline)) void pair_rows_wide_avx2(int type, GROUP_ARGS, int rows) {
#define PAIR_ROWS_WIDE(TY)                                                                                 \
    if (rows == 4) pair_rows_avx2_t(TY, job, col[0], col[1] - col[0], ahead, bytes, j0, cols, r0, 4);      \
    else pair_rows_avx2_t(TY, job, col[0], col[1] - col[0], ahead, bytes, j0, cols, r0, 3)
    switch (type) { PAIRED_CASES(PAIR_ROWS_WIDE) }
#undef PAIR_ROWS_WIDE
}

/* strided: col[c] is col[0] + c * (col[1] - col[0]) (eight rows of the segment in its
 * stored order, or every other one under the Q/K row order), which a paired type's rows
 * take through pair_rows_avx2_t. */
static TARGET_AVX2 void group_avx2(int type, GROUP_ARGS, int rows, int strided) {
#define GROUP_AVX2(TY)                                                                                     \
    if (PAIRED(TY) && strided && rows == 2) pair_rows_avx2_t(TY, job, col[0], col[1] - col[0], ahead, bytes, j0, cols, r0, 2); \
    else if (PAIRED(TY) && strided) pair_rows_avx2_t(TY, job, col[0], col[1] - col[0], ahead, bytes, j0, cols, r0, 1); \
    else if (rows == 2) group_avx2_t(job, col, ahead, bytes, j0, cols, r0, 2, TY);                         \
    else group_avx2_t(job, col, ahead, bytes, j0, cols, r0, 1, TY)
    switch (type) { TYPES_32_CHAIN(GROUP_AVX2) }
#undef GROUP_AVX2
}

#ifdef GGUF_VNNI
/* Word lane `lane` (a one-bit mask) of v replaced by the half at p: a masked broadcast
 * from memory, one load. Written out: GCC makes the intrinsic a scalar load, a spill and
 * an insert. */
static inline TARGET_VNNI __attribute__((always_inline)) __m128i merge_half(__m128i v, const uint8_t *p, __mmask8 lane) {
    __asm__("vpbroadcastw %1, %0%{%2%}" : "+v"(v) : "m"(*(const uint16_t *)p), "Yk"(lane));
    return v;
}

/* The halves at byte `at0` and at byte `at1` of eight columns' blocks as floats, each
 * column's into its lane: two chains of eight masked broadcasts, 18 instructions where
 * words8's broadcasts, blends, masks and pack take ~36 per pair of blocks. */
static inline TARGET_VNNI __attribute__((always_inline)) void halves2_vnni(const uint8_t *const *col, int64_t at0,
                                                                           int64_t at1, __m256 *first,
                                                                           __m256 *second) {
    __m128i v0 = _mm_setzero_si128(), v1 = _mm_setzero_si128();
    _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {
        v0 = merge_half(v0, col[c] + at0, (__mmask8)(1u << c));
        v1 = merge_half(v1, col[c] + at1, (__mmask8)(1u << c));
    }
    *first = _mm256_cvtph_ps(v0);
    *second = _mm256_cvtph_ps(v1);
}

#define PREP
#define DOT(U, X) _mm256_dpbusd_epi32(_mm256_setzero_si256(), U, X)
#define OFF_APPLIES 1
/* Q4_0 and IQ4_NL at one or two rows read d by masked broadcasts (halves2_vnni) and start
 * their lanes from the offset's terms (offset_lanes): 0.87-0.89x the time of words8 and a
 * subtraction afterwards (bench/gemm_tile_ab.c, a 1B layer's shapes, one thread). Not
 * Q4_1 (four chains for d and m: 1.04-1.06x), Q8_0 (1.03-1.09x at 2-3 rows) or four rows
 * (1.01-1.02x), where the broadcasts' loads and the lanes' registers cost more than they
 * save. */
#define PAIR_LEAN (ROWS_N <= 2 && (TYPE == T_Q4_0 || TYPE == T_IQ4_NL))
#define PAIR_PARAMS(COL, AT0, AT1, S0, S1, M0, M1)                                                         \
    if (PAIR_LEAN) {                                                                                       \
        halves2_vnni(COL, AT0, AT1, S0, S1);                                                               \
        *(M0) = *(S0), *(M1) = *(S1);                                                                      \
    } else {                                                                                               \
        PAIR_PARAMS_WORDS(COL, AT0, AT1, S0, S1, M0, M1)                                                   \
    }
#define PAIR_FOLDS PAIR_LEAN
#define PAIR_PREP
#define PAIR_DOT(START, LO, HI, XL, XH) _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(START, LO, XL), HI, XH)
static inline TARGET_VNNI __attribute__((always_inline)) void group_vnni_t(GROUP_ARGS, const int ROWS_N,
                                                                           const int TYPE) {
    if (PAIRED(TYPE)) {
        PAIR_BODY(4)
    } else {
        GROUP_BODY(4)
    }
}
#undef PAIR_PREP
#undef PAIR_PARAMS
#undef PAIR_FOLDS
#undef PAIR_LEAN
#undef PAIR_DOT
#undef PREP
#undef DOT
#undef OFF_APPLIES
#define GROUP_ROWS_VNNI 4

static TARGET_VNNI void group_vnni(int type, GROUP_ARGS, int rows) {
#define GROUP_VNNI(TY)                                                                                     \
    switch (rows) {                                                                                        \
    case 4: group_vnni_t(job, col, ahead, bytes, j0, cols, r0, 4, TY); break;                              \
    case 3: group_vnni_t(job, col, ahead, bytes, j0, cols, r0, 3, TY); break;                              \
    case 2: group_vnni_t(job, col, ahead, bytes, j0, cols, r0, 2, TY); break;                              \
    default: group_vnni_t(job, col, ahead, bytes, j0, cols, r0, 1, TY);                                    \
    }
    switch (type) { TYPES_32_CHAIN(GROUP_VNNI) }
#undef GROUP_VNNI
}
#endif

/* ---- x86, few rows, the K chain: a superblock of eight columns at a time -------------- */

/* A Q4_K/Q5_K superblock's eight six-bit scales as int16 in both 128-bit lanes (sc) and
 * its eight mins as int16 (mn), as k_scale_min reads the twelve packed bytes p: scale j < 4
 * is p[j] & 63, min j < 4 p[j + 4] & 63; scale j >= 4 is (p[j + 4] & 15) | (p[j - 4] >> 6) << 4,
 * min j >= 4 (p[j + 4] >> 4) | (p[j] >> 6) << 4. Two byte shuffles place the bytes each word
 * is made of (scales in the low lane, mins in the high one, high bytes zero), then masks and
 * shifts per word: ten vector instructions where the scalar unpacking took about 25, once
 * per column and superblock of the few-row pass (a third of its instructions at one row). */
static inline TARGET_AVX2 __attribute__((always_inline)) void k_scales_mins(const uint8_t *b, __m256i *sc,
                                                                             __m128i *mn) {
#define Z (char)0x80
    /* bytes 12..15 of the load are the block's first quants: never selected */
    const __m256i p = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + 4)));
    const __m256i low = _mm256_shuffle_epi8(p, _mm256_setr_epi8(0, Z, 1, Z, 2, Z, 3, Z, 8, Z, 9, Z, 10, Z, 11, Z,
                                                                4, Z, 5, Z, 6, Z, 7, Z, 8, Z, 9, Z, 10, Z, 11, Z));
    const __m256i top = _mm256_shuffle_epi8(p, _mm256_setr_epi8(Z, Z, Z, Z, Z, Z, Z, Z, 0, Z, 1, Z, 2, Z, 3, Z,
                                                                Z, Z, Z, Z, Z, Z, Z, Z, 4, Z, 5, Z, 6, Z, 7, Z));
#undef Z
    const __m256i keep = _mm256_setr_epi16(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
    const __m256i shifted = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15);
    const __m256i words = _mm256_or_si256(
        _mm256_or_si256(_mm256_and_si256(low, keep), _mm256_and_si256(_mm256_srli_epi16(low, 4), shifted)),
        _mm256_and_si256(_mm256_srli_epi16(top, 2), _mm256_set1_epi16(0x30)));
    *sc = _mm256_permute4x64_epi64(words, 0x44);
    *mn = _mm256_extracti128_si256(words, 1);
}

/* Byte shuffles repeating an int16 lane over each 128-bit lane: LANE_WORDS[j] takes word
 * j of both lanes (Q4_K, Q5_K), LANE_WORDS[8 + j] word 2j % 8 of the low lane and
 * (2j + 1) % 8 of the high one (Q6_K's halves). LANE_WORDS[12 + j / 2] (j even) and
 * [16 + j % 4 / 2] are the same for a pair of 32-blocks j, j + 1 as k_pair_vnni packs
 * them: each lane's words 0-3 from block j's word, 4-7 from block j + 1's. A table:
 * built from immediates, the compiler rematerialized them in the loop. */
static const uint8_t LANE_WORDS[18][32] __attribute__((aligned(32))) = {
#define W4(i) 2 * (i), 2 * (i) + 1, 2 * (i), 2 * (i) + 1, 2 * (i), 2 * (i) + 1, 2 * (i), 2 * (i) + 1
#define W16(i) W4(i), W4(i)
    {W16(0), W16(0)}, {W16(1), W16(1)}, {W16(2), W16(2)}, {W16(3), W16(3)},
    {W16(4), W16(4)}, {W16(5), W16(5)}, {W16(6), W16(6)}, {W16(7), W16(7)},
    {W16(0), W16(1)}, {W16(2), W16(3)}, {W16(4), W16(5)}, {W16(6), W16(7)},
    {W4(0), W4(1), W4(0), W4(1)}, {W4(2), W4(3), W4(2), W4(3)},
    {W4(4), W4(5), W4(4), W4(5)}, {W4(6), W4(7), W4(6), W4(7)},
    {W4(0), W4(2), W4(1), W4(3)}, {W4(4), W4(6), W4(5), W4(7)},
#undef W16
#undef W4
};

static inline TARGET_AVX2 __attribute__((always_inline)) __m256i lane_word(__m256i v, int table) {
    return _mm256_shuffle_epi8(v, _mm256_load_si256((const __m256i *)LANE_WORDS[table]));
}

/* Eight columns' eight int32 lanes summed into one lane per column, in column order. */
static inline TARGET_AVX2 __attribute__((always_inline)) __m256i sum_columns8(const __m256i v[8]) {
    const __m256i h0 = SUM_PAIRS64(SUM_PAIRS32(v[0], v[1]), SUM_PAIRS32(v[2], v[3]));
    const __m256i h1 = SUM_PAIRS64(SUM_PAIRS32(v[4], v[5]), SUM_PAIRS32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}

/* One row's sum(mn * S32) over a superblock's eight 32-blocks for eight columns (Q4_K,
 * Q5_K: flat activations, m = 1), one lane per column in column order: mw[c] holds column
 * c's mins (int16) in its low lane and column c + 4's in its high one (built once per
 * superblock for all rows), s32 the row's 32-sums in both lanes. Four madds and the sums
 * of pairs per row where a madd per column and row took eight. */
static inline TARGET_AVX2 __attribute__((always_inline)) __m256i mins_columns8(const __m256i mw[4], __m256i s32) {
    __m256i t[4];
    for (int c = 0; c < 4; c++) t[c] = _mm256_madd_epi16(mw[c], s32);
    return SUM_PAIRS64(SUM_PAIRS32(t[0], t[1]), SUM_PAIRS32(t[2], t[3]));
}

/* Columns j0 .. j0 + 7 (col[c] their rows, the last repeated) of a Q4_K, Q5_K or Q6_K
 * segment for rows r0 .. r0 + ROWS_N - 1, the K chain: per superblock and column, the
 * block's integer scales (Q6_K: times each row's multiples m, int16: at most 128 * 16),
 * then each 32-block's quants decoded in registers, their byte products with the row's
 * int8 activations summed and multiplied by that row's scale into int32 lanes two
 * 32-blocks at a time (K_PAIR, either order of the integer sums: the same total), summed
 * over the superblock (the lanes may wrap around 2^32: the total fits, see the header);
 * Q6_K's offset comes off as 32 * sum(sc * m * S16), Q4_K/Q5_K's mins as sum(mn * S32)
 * apart (for the eight columns at once per row: mins_columns8). Then once per superblock
 * the eight columns' lanes are summed into one lane each and the header's float steps
 * run, one column to a lane. */
#define K_GROUP_BODY(ROWS_MAX)                                                                             \
    const acts_t *a = job->a;                                                                              \
    const int64_t k = job->k, supers = k / 256;                                                            \
    const int Q6 = TYPE == T_Q6_K;                                                                         \
    __m256 acc[ROWS_MAX];                                                                                  \
    for (int r = 0; r < ROWS_N; r++) acc[r] = _mm256_setzero_ps();                                        \
    for (int64_t t = 0; t < supers; t++) {                                                                 \
        if (ahead) prefetch_step(ahead, t);                                                                \
        K_SUPER(ROWS_MAX)                                                                                  \
    }                                                                                                      \
    K_STORE_ROWS

/* K_GROUP_BODY's superblock t (columns col[0 .. 7], rows r0 .. r0 + ROWS_N - 1), added to
 * acc[r]. */
#define K_SUPER(ROWS_MAX)                                                                                  \
    {                                                                                                      \
        const int64_t at = t * bytes;                                                                      \
        __m256i cd[ROWS_MAX][8], rm[ROWS_MAX]; /* rm: the row's m per 32-block (Q6_K: per half), int16 */ \
        __m128i mns[8];                        /* Q4_K/Q5_K: each column's mins */                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N && Q6; r++) {                                   \
            const __m128i m8 = _mm_loadu_si128((const __m128i *)(a->km + (r0 + r) * (k / 32) + t * 8));   \
            rm[r] = _mm256_setr_m128i(_mm_unpacklo_epi16(m8, m8), _mm_unpackhi_epi16(m8, m8));             \
        }                                                                                                  \
        for (int c = 0; c < 8; c++) {                                                                      \
            const uint8_t *blk = col[c] + at;                                                              \
            __m256i sc, sc_a[ROWS_MAX], sc_b[ROWS_MAX]; /* the scales, and per row times m */              \
            if (Q6) sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));             \
            else k_scales_mins(blk, &sc, &mns[c]);                                                         \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {                                     \
                sc_a[r] = Q6 ? _mm256_mullo_epi16(sc, rm[r]) : sc; /* Q4_K, Q5_K: flat, m = 1 */          \
                sc_b[r] = Q6 ? _mm256_permute4x64_epi64(sc_a[r], 0xEE) : sc_a[r];                          \
            }                                                                                              \
            __m256i dc[ROWS_MAX];                                                                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {                                     \
                if (Q6) {                                                                                  \
                    const __m256i s16 = _mm256_loadu_si256((const __m256i *)(a->ks16 + (r0 + r) * (k / 16) + t * 16)); \
                    dc[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc_a[r], s16), 5)); \
                    sc_a[r] = _mm256_permute4x64_epi64(sc_a[r], 0x44);                                     \
                } else                                                                                     \
                    dc[r] = _mm256_setzero_si256();                                                        \
            }                                                                                              \
            _Pragma("GCC unroll 4") for (int j = 0; j < 8; j += 2) {                                       \
                const __m256i u0 = quants32(TYPE, blk, j), u1 = quants32(TYPE, blk, j + 1);                \
                _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {                                 \
                    const int8_t *xr = a->kq + (r0 + r) * k + t * 256 + 32 * j;                            \
                    dc[r] = K_PAIR(dc[r], u0, u1, _mm256_loadu_si256((const __m256i *)xr),                 \
                                   _mm256_loadu_si256((const __m256i *)(xr + 32)), j < 4 ? sc_a[r] : sc_b[r], j); \
                }                                                                                          \
            }                                                                                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) cd[r][c] = dc[r];                     \
        }                                                                                                  \
        K_SUPER_STEPS                                                                                      \
    }

/* The end of a superblock of eight columns for each row (in the K pass bodies): cd[r][c]
 * column c's int32 lanes of D, summed into one lane per column; the mins' M from mns[c]
 * (Q4_K/Q5_K); then the header's float steps, one column to a lane. */
#define K_SUPER_STEPS                                                                                      \
        __m256i mw[4];                                                                                     \
        for (int c = 0; c < 4 && !Q6; c++) mw[c] = _mm256_setr_m128i(mns[c], mns[c + 4]);                 \
        __m256 d, neg_dmin = _mm256_setzero_ps();                                                          \
        if (Q6) {                                                                                          \
            const __m256i w = _mm256_srli_epi32(words8(col, at + 206), 16); /* d: the block's last two bytes */ \
            low_halves16(w, w, &d, &neg_dmin);                                                             \
        } else {                                                                                           \
            half_pairs8(col, at, &d, &neg_dmin);                                                           \
            neg_dmin = _mm256_xor_ps(neg_dmin, _mm256_set1_ps(-0.0f));                                     \
        }                                                                                                  \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {                                         \
            const __m256 xd = _mm256_set1_ps(a->kd[(r0 + r) * supers + t]);                                \
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_columns8(cd[r])), _mm256_mul_ps(d, xd), acc[r]); \
            if (!Q6) {                                                                                     \
                const __m256i s32 = _mm256_broadcastsi128_si256(                                           \
                    _mm_loadu_si128((const __m128i *)(a->ks32 + (r0 + r) * (k / 32) + t * 8)));            \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins_columns8(mw, s32)), _mm256_mul_ps(neg_dmin, xd), acc[r]); \
            }                                                                                              \
        }

/* The rows' float sums acc[r] into y, columns j0 .. j0 + cols - 1. */
#define K_STORE_ROWS                                                                                       \
    for (int r = 0; r < ROWS_N; r++) store_row8(job, acc[r], r0 + r, j0, cols);

/* 32-block j's scale words of one row (SC: sc_a or sc_b, as K_GROUP_BODY makes them). */
#define K_SCALE(SC, J) (Q6 ? lane_word(SC, 8 + (J) % 4) : lane_word(SC, J))

/* 32-blocks j, j + 1 (j even): their byte products paired to int16 (maddubs: |u x| pairs
 * stay below 2^15), each multiplied by its scale words and added into the int32 lanes. */
static inline TARGET_AVX2 __attribute__((always_inline)) __m256i k_pair_avx2(const int Q6, __m256i acc, __m256i u0,
                                                                             __m256i u1, __m256i x0, __m256i x1,
                                                                             __m256i sc, int j) {
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u0, x0), K_SCALE(sc, j)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u1, x1), K_SCALE(sc, j + 1)));
}
#undef K_SCALE

#define K_PAIR(ACC, U0, U1, X0, X1, SC, J) k_pair_avx2(Q6, ACC, U0, U1, X0, X1, SC, J)
static inline TARGET_AVX2 __attribute__((always_inline)) void k_group_avx2_t(GROUP_ARGS, const int ROWS_N,
                                                                             const int TYPE) {
    K_GROUP_BODY(2)
}

/* K_GROUP_BODY's superblock t for ROWS_N rows (r0 on) of eight columns that are rows
 * `stride` bytes apart (col0 the first), added to acc[r]: the same operations, so the same
 * bits, addressed from col0 and the stride instead of eight column pointers that GCC keeps
 * on the stack (pair_rows_step's change, for the K chain). */
static inline TARGET_AVX2 __attribute__((always_inline)) void k_rows_step(const int TYPE, const acts_t *a, int64_t k,
                                                                           const uint8_t *col0, int64_t stride,
                                                                           int bytes, int64_t r0, int64_t t,
                                                                           const int ROWS_N, __m256 *acc) {
    const int Q6 = TYPE == T_Q6_K;
    const int64_t supers = k / 256;
    const cols8_t rows8 = strided_cols8(col0, stride);
    const uint8_t *const *const col = rows8.c;
    K_SUPER(STRIDED_ROWS_AVX2)
}

/* k_group_avx2's rows where its eight columns are rows evenly apart (col[c] = col[0] + c
 * stride): k_rows_step per superblock, the next tile fetched as pair_rows_avx2_t does
 * (ahead_run_t). One thread's one-row matmuls of a decode step (bench/gemv_layout.c, the
 * file mapped, CPU time, Zen 3, alternated processes), new / old: llama1b.Q6_K 0.94,
 * llama1b.Q5_K_M 0.95, llama1b.Q4_K_M 0.98; two rows (bench/gemm_tile_ab.c) Q6_K 0.93,
 * Q4_K 0.96. */
static inline TARGET_AVX2 __attribute__((always_inline)) void k_rows_avx2_t(const int TYPE, const job_t *job,
                                                                             const uint8_t *col0, int64_t stride,
                                                                             const ahead_t *ahead, int bytes,
                                                                             int64_t j0, int cols, int64_t r0,
                                                                             const int ROWS_N) {
    const int64_t k = job->k;
    __m256 acc[STRIDED_ROWS_AVX2];
    for (int r = 0; r < ROWS_N; r++) acc[r] = _mm256_setzero_ps();
    ahead_run_t run = ahead_run(ahead);
    for (int64_t t = 0; t < k / 256; t++) {
        ahead_run_step(&run, t);
        k_rows_step(TYPE, job->a, k, col0, stride, bytes, r0, t, ROWS_N, acc);
    }
    for (int r = 0; r < ROWS_N; r++) store_row8(job, acc[r], r0 + r, j0, cols);
}
#undef K_PAIR

#define K_GROUP_TYPES(CALL)                                                                                \
    case T_Q4_K: CALL(T_Q4_K); break;                                                                      \
    case T_Q5_K: CALL(T_Q5_K); break;                                                                      \
    default: CALL(T_Q6_K);

/* Three or four strided rows of the K chain (out of line, as pair_rows_wide_avx2). */
static TARGET_AVX2 __attribute__((noinline)) void k_rows_wide_avx2(int type, GROUP_ARGS, int rows) {
#define K_ROWS_WIDE(TY)                                                                                    \
    if (rows == 4) k_rows_avx2_t(TY, job, col[0], col[1] - col[0], ahead, bytes, j0, cols, r0, 4);         \
    else k_rows_avx2_t(TY, job, col[0], col[1] - col[0], ahead, bytes, j0, cols, r0, 3)
    switch (type) { K_GROUP_TYPES(K_ROWS_WIDE) }
#undef K_ROWS_WIDE
}

/* strided: as group_avx2's, the rows then take k_rows_avx2_t. */
static TARGET_AVX2 void k_group_avx2(int type, GROUP_ARGS, int rows, int strided) {
#define K_GROUP_AVX2(TY)                                                                                   \
    if (strided && rows == 2) k_rows_avx2_t(TY, job, col[0], col[1] - col[0], ahead, bytes, j0, cols, r0, 2); \
    else if (strided) k_rows_avx2_t(TY, job, col[0], col[1] - col[0], ahead, bytes, j0, cols, r0, 1);     \
    else if (rows == 2) k_group_avx2_t(job, col, ahead, bytes, j0, cols, r0, 2, TY);                       \
    else k_group_avx2_t(job, col, ahead, bytes, j0, cols, r0, 1, TY)
    switch (type) { K_GROUP_TYPES(K_GROUP_AVX2) }
#undef K_GROUP_AVX2
}

#ifdef GGUF_VNNI
/* 32-blocks j, j + 1 (j even): each one's byte products summed in fours (vpdpbusd: at
 * most 4 * 63 * 128 = 32256 for Q6_K's u, so packing to int16 never saturates), the two
 * packed into one vector of int16 words (per 128-bit lane block j's four, then j + 1's)
 * and multiplied by their scale words in one vpdpwssd: five instructions per row and
 * pair where maddubs, a shuffle and vpdpwssd per block took six. */
static inline TARGET_VNNI __attribute__((always_inline)) __m256i k_pair_vnni(const int Q6, __m256i acc, __m256i u0,
                                                                             __m256i u1, __m256i x0, __m256i x1,
                                                                             __m256i sc, int j) {
    const __m256i zero = _mm256_setzero_si256();
    const __m256i p = _mm256_packs_epi32(_mm256_dpbusd_epi32(zero, u0, x0), _mm256_dpbusd_epi32(zero, u1, x1));
    return _mm256_dpwssd_epi32(acc, p, lane_word(sc, Q6 ? 16 + j % 4 / 2 : 12 + j / 2));
}

#define K_PAIR(ACC, U0, U1, X0, X1, SC, J) k_pair_vnni(Q6, ACC, U0, U1, X0, X1, SC, J)
static inline TARGET_VNNI __attribute__((always_inline)) void k_group_vnni_t(GROUP_ARGS, const int ROWS_N,
                                                                             const int TYPE) {
    K_GROUP_BODY(4)
}

/* Five to eight rows in one pass (an expert's rows: see EXPERT_K_GROUP_ROWS_VNNI). */
static inline TARGET_VNNI __attribute__((always_inline)) void k_group_vnni8_t(GROUP_ARGS, const int ROWS_N,
                                                                              const int TYPE) {
    K_GROUP_BODY(EXPERT_K_GROUP_ROWS_VNNI)
}
#undef K_PAIR

/* Q4_K, K_QUADS_MIN_ROWS to 8 rows: K_GROUP_BODY's sums, four 32-blocks to a vector (the quad pass). Per
 * column and superblock, the quants' four 32-byte runs (run p: 32-blocks 2p and 2p + 1)
 * transposed in 64-bit words (qwords4x4), so that vector s holds bytes 8s .. 8s + 7 of run
 * p in word p: its low nibbles are quants 8s .. 8s + 7 of the even 32-blocks, its high
 * nibbles of the odd ones, the order of a row's activations in a->kx (quad_order). Per
 * row, four vpdpbusd then sum each int32 lane over 16 products of one 32-block (|sum| <=
 * 16 * 15 * 127 = 30480: Q4_K's quants only, so the pack to int16 never saturates), one
 * pack puts the even and odd blocks' lanes side by side, and one vpdpwssd multiplies them
 * by sc (flat activations: m = 1): ten vector instructions per row, column and superblock
 * where the pairs take twenty (their pack, shuffle and vpdpwssd are per pair of 32-blocks). D is the
 * same exact integer, so the bits are those of every other path. */
static inline TARGET_VNNI __attribute__((always_inline)) void k_quads_vnni_t(GROUP_ARGS, const int ROWS_N) {
    const int Q6 = 0;
    const acts_t *a = job->a;
    const int64_t k = job->k, supers = k / 256;
    const __m256i low4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    /* int16 words 0..7 (both 128-bit lanes) to the blocks of a pack of the even and odd
     * lanes: 0, 0, 2, 2, 1, 1, 3, 3 in the low lane, 4, 4, 6, 6, 5, 5, 7, 7 in the high one */
    const __m256i packed = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 2, 3, 2, 3, 6, 7, 6, 7,
                                            8, 9, 8, 9, 12, 13, 12, 13, 10, 11, 10, 11, 14, 15, 14, 15);
    __m256 acc[EXPERT_K_GROUP_ROWS_VNNI];
    for (int r = 0; r < ROWS_N; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t t = 0; t < supers; t++) {
        const int64_t at = t * bytes;
        if (ahead) prefetch_step(ahead, t);
        __m256i cd[EXPERT_K_GROUP_ROWS_VNNI][8];
        __m128i mns[8];
        for (int c = 0; c < 8; c++) {
            const uint8_t *blk = col[c] + at;
            __m256i sc, runs[4], v[4], lo[4], hi[4];
            k_scales_mins(blk, &sc, &mns[c]);
            sc = _mm256_shuffle_epi8(sc, packed);
            for (int p = 0; p < 4; p++) runs[p] = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * p));
            qwords4x4(runs, v);
            for (int i = 0; i < 4; i++)
                lo[i] = _mm256_and_si256(v[i], low4), hi[i] = _mm256_and_si256(_mm256_srli_epi16(v[i], 4), low4);
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS_N; r++) {
                const __m256i *xr = (const __m256i *)(a->kx + (r0 + r) * k + t * 256);
                __m256i even = zero, odd = zero;
                for (int i = 0; i < 4; i++) {
                    even = _mm256_dpbusd_epi32(even, lo[i], _mm256_loadu_si256(xr + i));
                    odd = _mm256_dpbusd_epi32(odd, hi[i], _mm256_loadu_si256(xr + 4 + i));
                }
                cd[r][c] = _mm256_dpwssd_epi32(zero, _mm256_packs_epi32(even, odd), sc); /* flat: m = 1 */
            }
        }
        K_SUPER_STEPS
    }
    K_STORE_ROWS
}

static TARGET_VNNI void k_group_vnni(int type, GROUP_ARGS, int rows) {
    if (type == T_Q4_K && rows >= K_QUADS_MIN_ROWS && job->a->kx) {
        switch (rows) {
        case 8: k_quads_vnni_t(job, col, ahead, bytes, j0, cols, r0, 8); return;
        case 7: k_quads_vnni_t(job, col, ahead, bytes, j0, cols, r0, 7); return;
        case 6: k_quads_vnni_t(job, col, ahead, bytes, j0, cols, r0, 6); return;
        case 5: k_quads_vnni_t(job, col, ahead, bytes, j0, cols, r0, 5); return;
        case 4: k_quads_vnni_t(job, col, ahead, bytes, j0, cols, r0, 4); return;
        case 3: k_quads_vnni_t(job, col, ahead, bytes, j0, cols, r0, 3); return;
        default: k_quads_vnni_t(job, col, ahead, bytes, j0, cols, r0, 2); return;
        }
    }
#define K_GROUP_VNNI(TY)                                                                                   \
    switch (rows) {                                                                                        \
    case 8: k_group_vnni8_t(job, col, ahead, bytes, j0, cols, r0, 8, TY); break;                           \
    case 7: k_group_vnni8_t(job, col, ahead, bytes, j0, cols, r0, 7, TY); break;                           \
    case 6: k_group_vnni8_t(job, col, ahead, bytes, j0, cols, r0, 6, TY); break;                           \
    case 5: k_group_vnni8_t(job, col, ahead, bytes, j0, cols, r0, 5, TY); break;                           \
    case 4: k_group_vnni_t(job, col, ahead, bytes, j0, cols, r0, 4, TY); break;                            \
    case 3: k_group_vnni_t(job, col, ahead, bytes, j0, cols, r0, 3, TY); break;                            \
    case 2: k_group_vnni_t(job, col, ahead, bytes, j0, cols, r0, 2, TY); break;                            \
    default: k_group_vnni_t(job, col, ahead, bytes, j0, cols, r0, 1, TY);                                  \
    }
    switch (type) { K_GROUP_TYPES(K_GROUP_VNNI) }
#undef K_GROUP_VNNI
}
#endif

/* The rows of the next few-row pass of at most `most` rows with `left` rows to go: the
 * fewest passes, their rows as even as can be (9 rows of passes of up to 8: 5 + 4, where 8 +
 * 1 decoded every block twice for a pass of one row at a few-row pass's cost per row). */
static inline int even_rows(int64_t left, int64_t most) {
    const int64_t passes = (left + most - 1) / most;
    return (int)((left + passes - 1) / passes);
}

/* The tile's columns, two groups of eight, for every row (few rows). */
static void run_groups_x86(const job_t *job, const bargein_qseg_t *seg, const qinfo_t *info, int64_t col0,
                           int64_t j0, int cols, int64_t next_col0) {
    for (int v = 0; v < 2 && 8 * v < cols; v++) {
        const uint8_t *col[8];
        for (int c = 0; c < 8; c++) {
            const int64_t i = col0 + 8 * v + c;
            col[c] = column_row(seg, i < seg->rows ? i : seg->rows - 1);
        }
        const int64_t steps = paired_type((int)seg->type) ? (job->nb + 1) / 2 : job->k / info->qk;
        ahead_t ahead_cols;
        if (next_col0 >= 0) ahead_plan(&ahead_cols, seg, next_col0 + 8 * v, job->k / info->qk * info->bytes, steps);
        const int group_cols = cols - 8 * v < 8 ? cols - 8 * v : 8;
        int strided = 1; /* group_avx2's: eight rows evenly apart (in order, or a Q/K order's every other row) */
        for (int c = 2; c < 8; c++) strided &= col[c] - col[0] == c * (col[1] - col[0]);
        for (int64_t r0 = 0; r0 < job->m;) {
            const ahead_t *ahead = r0 == 0 && next_col0 >= 0 ? &ahead_cols : NULL;
            if (k_chain_type(seg->type)) {
#ifdef GGUF_VNNI
                if (job->isa == ISA_VNNI) {
                    const int rows = even_rows(job->m - r0, job->k_group_rows);
                    k_group_vnni((int)seg->type, job, col, ahead, info->bytes, j0 + 8 * v, group_cols, r0, rows);
                    r0 += rows;
                    continue;
                }
#endif
                const int most = strided ? STRIDED_ROWS_AVX2 : GROUP_ROWS_AVX2;
                const int rows = (int)(job->m - r0 < most ? job->m - r0 : most);
                if (rows > GROUP_ROWS_AVX2) k_rows_wide_avx2((int)seg->type, job, col, ahead, info->bytes, j0 + 8 * v, group_cols, r0, rows);
                else k_group_avx2((int)seg->type, job, col, ahead, info->bytes, j0 + 8 * v, group_cols, r0, rows, strided);
                r0 += rows;
                continue;
            }
#ifdef GGUF_VNNI
            if (job->isa == ISA_VNNI) {
                const int rows = (int)(job->m - r0 < GROUP_ROWS_VNNI ? job->m - r0 : GROUP_ROWS_VNNI);
                group_vnni((int)seg->type, job, col, ahead, info->bytes, j0 + 8 * v, group_cols, r0, rows);
                r0 += rows;
                continue;
            }
#endif
            const int most = strided && paired_type((int)seg->type) ? STRIDED_ROWS_AVX2 : GROUP_ROWS_AVX2;
            const int rows = (int)(job->m - r0 < most ? job->m - r0 : most);
            if (rows > GROUP_ROWS_AVX2) pair_rows_wide_avx2((int)seg->type, job, col, ahead, info->bytes, j0 + 8 * v, group_cols, r0, rows);
            else group_avx2((int)seg->type, job, col, ahead, info->bytes, j0 + 8 * v, group_cols, r0, rows, strided);
            r0 += rows;
        }
    }
}
#endif /* GGUF_X86 */

/* ---- x86, exact: each 32-block widened in registers to the values gguf.quants gives ---- */

#ifdef GGUF_X86
/* Sub-block j of a block as four vectors of eight floats: es * q (+ em), es and em the
 * halves' scale and min, as gguf_half_params gives them (a multiply, then an add). */
static inline TARGET_AVX2 __attribute__((always_inline)) void values32(const int TYPE, const uint8_t *blk, int j,
                                                                        const float *es, const float *em,
                                                                        __m256 w[4]) {
    const __m256i u = quants32(TYPE, blk, j), off = _mm256_set1_epi32(type_off(TYPE));
    const __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; i++) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(parts[i]), off));
        w[i] = _mm256_mul_ps(q, _mm256_set1_ps(es[2 * j + i / 2]));
        if (type_kind(TYPE) == KIND_MIN || type_kind(TYPE) == KIND_SPLIT_MIN)
            w[i] = _mm256_add_ps(w[i], _mm256_set1_ps(em[2 * j + i / 2]));
    }
}

static inline TARGET_AVX2 __attribute__((always_inline)) void half_params_all(const int TYPE, const qinfo_t *info,
                                                                               const uint8_t *blk, float *es,
                                                                               float *em) {
    dblock_t o;
    gguf_params_c(TYPE, blk, &o);
    for (int h = 0; h < type_qk(TYPE) / 16; h++) gguf_half_params(info, &o, h, &es[h], &em[h]);
}

/* Row i of a segment widened to float32 (k values) into out. */
static inline TARGET_AVX2 __attribute__((always_inline)) void dequantize_row_t(const int TYPE, const qinfo_t *info,
                                                                                const uint8_t *row, int64_t k,
                                                                                float *out) {
    const int qk = type_qk(TYPE), subs = qk / 32;
    float es[16], em[16];
    for (int64_t t = 0; t < k / qk; t++) {
        const uint8_t *blk = row + t * info->bytes;
        half_params_all(TYPE, info, blk, es, em);
        for (int j = 0; j < subs; j++) {
            __m256 w[4];
            values32(TYPE, blk, j, es, em, w);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + t * qk + 32 * j + 8 * i, w[i]);
        }
    }
}

static TARGET_AVX2 void dequantize_row_avx2(const bargein_qseg_t *seg, const qinfo_t *info, const uint8_t *row,
                                            int64_t k, float *out) {
#define DEQUANTIZE_ROW(TY) dequantize_row_t(TY, info, row, k, out)
    switch (seg->type) { TYPE_CASES(DEQUANTIZE_ROW) }
#undef DEQUANTIZE_ROW
}

#define EXACT_ROWS 4 /* rows sharing each widened block */

/* Column j (row i of the segment) for every row of x in float32: the widened values
 * against x in eight float lanes per row, summed at the end. */
static inline TARGET_AVX2 __attribute__((always_inline)) void column_exact_t(const int TYPE, const job_t *job,
                                                                              const qinfo_t *info,
                                                                              const uint8_t *row, int64_t j) {
    const int qk = type_qk(TYPE), subs = qk / 32;
    const int64_t k = job->k;
    float es[16], em[16];
    for (int64_t r0 = 0; r0 < job->m; r0 += EXACT_ROWS) {
        const int rows = (int)(job->m - r0 < EXACT_ROWS ? job->m - r0 : EXACT_ROWS);
        __m256 acc[EXACT_ROWS][2];
        for (int r = 0; r < EXACT_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t t = 0; t < k / qk; t++) {
            const uint8_t *blk = row + t * info->bytes;
            half_params_all(TYPE, info, blk, es, em);
            for (int jj = 0; jj < subs; jj++) {
                __m256 w[4];
                values32(TYPE, blk, jj, es, em, w);
                for (int r = 0; r < rows; r++) {
                    const float *x = job->a->x + (r0 + r) * k + t * qk + 32 * jj;
                    acc[r][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), acc[r][1]);
                    acc[r][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), acc[r][1]);
                }
            }
        }
        for (int r = 0; r < rows; r++) {
            const __m256 v = _mm256_add_ps(acc[r][0], acc[r][1]);
            __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
            job->y[(r0 + r) * job->n + j] = _mm_cvtss_f32(s4);
        }
    }
}

static TARGET_AVX2 void column_exact_avx2(const job_t *job, const bargein_qseg_t *seg, const qinfo_t *info,
                                          int64_t i, int64_t j) {
    const uint8_t *row = column_row(seg, i);
#define COLUMN_EXACT(TY) column_exact_t(TY, job, info, row, j)
    switch (seg->type) { TYPE_CASES(COLUMN_EXACT) }
#undef COLUMN_EXACT
}
#endif /* GGUF_X86 */

/* ---- the work, split over tiles of output columns ----------------------------------- */

#ifdef GGUF_AMX
/* An item of an AMX job (job->amx) on the K chain: up to AMX_SET_TILES tiles from column
 * col0, each built and its quants scaled in its own scratch; then each 16-row block of
 * activations passes over all of them, superblock by superblock (rows_k_amx), where a
 * pass per tile over all rows read every row again for every tile. The rows left (fewer than 16)
 * take each tile's AVX-512 pass, without the scale table: the same bits. */
static void run_amx_set(const job_t *job, int index, int64_t next, const bargein_qseg_t *seg, const qinfo_t *info,
                        int64_t col0, int64_t j0) {
    tile_t tl[AMX_SET_TILES];
    int cols[AMX_SET_TILES];
    int subs = 0;
    for (; subs < job->amx_set && col0 + subs * TILE < seg->rows; subs++) {
        tl[subs] = tile_scratch_sub(job, index, subs);
        build_tile(job, &tl[subs], seg, info, col0 + subs * TILE);
        amx_scaled_tile(job, &tl[subs], seg->type);
        cols[subs] = tile_width(seg, col0 + subs * TILE);
    }
    ahead_t ahead[2];
    const int fetch = tile_ahead(job, next, 256, 1, ahead); /* the next item's first tile */
    int64_t r0 = 0;
    for (; job->m - r0 >= AMX_ROWS_K; r0 += AMX_ROWS_K)
        rows_k_amx(job, tl, subs, fetch && r0 == 0 ? ahead : NULL, seg->type, j0, cols, r0);
    for (int v = 0; v < subs; v++)
        for (int64_t r = r0; r < job->m;)
            r += rows_k_zmm(job, &tl[v], NULL, seg->type, j0 + v * TILE, cols[v], r, (int)(job->m - r));
}
#endif

/* Tile t on thread `index` (its scratch), fetching tile `next`'s blocks ahead (-1: none);
 * in an AMX job, an item of the K chain is a set of tiles (run_amx_set). */
static void run_tile(const job_t *job, int index, int64_t t, int64_t next) {
    const bargein_qseg_t *seg = &job->w->segs[job->tile_seg[t]];
    if (job->a_flat && k_flat_type(seg->type)) { /* this tile's activations are the flat ones */
        job_t flat = *job;
        flat.a = job->a_flat, flat.a_flat = NULL;
        run_tile(&flat, index, t, next);
        return;
    }
    qinfo_t info = {32, 0, 0, KIND_PLAIN};
    gguf_qinfo((int)seg->type, &info);
    const int64_t col0 = job->tile_col[t], j0 = job->seg_start[job->tile_seg[t]] + col0;
    const int cols = tile_width(seg, col0);
#ifdef GGUF_X86
    if (job->a->exact && job->isa != ISA_C) {
        for (int c = 0; c < cols; c++) column_exact_avx2(job, seg, &info, col0 + c, j0 + c);
        return;
    }
#endif
    if (job->isa == ISA_C || job->a->exact) {
        float *acc = (float *)(job->scratch + (int64_t)index * job->scratch_bytes);
        for (int c = 0; c < cols; c++) {
            if (job->a->exact) column_exact_c(job, seg, &info, col0 + c, j0 + c, acc);
            else if (k_chain_type(seg->type)) column_k_chain_c(job, seg, &info, col0 + c, j0 + c, acc);
            else column_fast_c(job, seg, &info, col0 + c, j0 + c, acc);
        }
        return;
    }
#ifdef GGUF_ARM64
    if (neon_gguf_tiled(job, seg, &info)) {
        neon_gguf_tile_columns(job, seg, &info, col0, j0, cols, job->scratch + (int64_t)index * job->scratch_bytes);
        return;
    }
    neon_gguf_tile(job, seg, &info, col0, j0, cols, job->scratch + (int64_t)index * job->scratch_bytes);
#endif
#ifdef GGUF_X86
    if (job->m < (k_chain_type(seg->type) ? K_GEMM_MIN_ROWS : job->gemm_min_rows)) {
        /* the next tile's columns, fetched while this one's are read (same segment only) */
        run_groups_x86(job, seg, &info, col0, j0, cols,
                       next >= 0 && job->tile_seg[next] == job->tile_seg[t] ? job->tile_col[next] : -1);
        return;
    }
#ifdef GGUF_AMX
    if (job->amx && k_chain_type(seg->type)) {
        run_amx_set(job, index, next, seg, &info, col0, j0);
        return;
    }
#endif
    tile_t tl = tile_scratch(job, index);
    build_tile(job, &tl, seg, &info, col0);
#ifdef GGUF_VNNI
    if (tl.q6k_table && seg->type == T_Q6_K) q6k_scale_table(job, &tl);
    else tl.q6k_table = NULL;
#endif
    /* (an abs_tiled tile got its signs' masks, |q| and their terms as it was built) */
    if (job->a->qu && signed_tile(job->isa, &info)) sign_tile(job, &tl, info.off);
    ahead_t ahead[2];
    /* The first pass over this tile fetches the next one's blocks, a step per superblock on
     * the K chain, per 32-block on the 32 chain. The 32 chain only up to AHEAD_MAX_ROWS_32
     * rows: a tile read by more passes waits less on its successor's first reads than the
     * fetched lines cost it in L2 (bench/gemm_tile_ab.c, Q4_0 on the 1B shapes, VNNI, new /
     * old time: 0.83 at 16 rows, 0.92 at 32, 0.98 at 64, 1.03 at 128, 1.07 at 512). */
    const int passes = k_chain_type(seg->type) && job->m >= AHEAD_SPREAD_MIN_ROWS ? AHEAD_PASSES : 1;
    const int fetch = (k_chain_type(seg->type) || job->m <= AHEAD_MAX_ROWS_32) &&
                      tile_ahead(job, next, k_chain_type(seg->type) ? 256 : 32, passes, ahead);
    for (int64_t r0 = 0, pass = 0; r0 < job->m; pass++) {
        const int left = (int)(job->m - r0 < 64 ? job->m - r0 : 64);
        if (k_chain_type(seg->type)) {
            /* the first passes fetch the next tile's blocks, a part each, while they read this one */
            const ahead_t *use = fetch && pass < passes ? ahead : NULL;
            for (int v = 0; use && v < 2; v++) ahead[v].first = pass * (job->k / 256) * ahead[v].per_step;
#ifdef GGUF_VNNI
            if (job->isa == ISA_VNNI) {
                r0 += rows_k_zmm(job, &tl, use, seg->type, j0, cols, r0, left);
                continue;
            }
#endif
            r0 += rows_k_avx2(job, &tl, use, seg->type, j0, cols, r0, left);
            continue;
        }
#ifdef GGUF_VNNI
        if (job->isa == ISA_VNNI) {
            r0 += rows_zmm32(job, &tl, fetch && r0 == 0 ? ahead : NULL, &info, j0, cols, r0, left);
            continue;
        }
#endif
        const int rows = left < ROWS_AVX2 ? left : ROWS_AVX2;
        rows_avx2(job, &tl, fetch && r0 == 0 ? ahead : NULL, &info, j0, cols, r0, rows);
        r0 += rows;
    }
#endif
}

/* Tiles for thread `index`: its share, then what is left of the others' (parallel.h's
 * shares: work stealing), each fetching the blocks of the tile likely to come next. */
static void run_tiles(void *arg, int index, int count) {
    const job_t *job = (const job_t *)arg;
    int64_t t, next;
#ifdef GGUF_AMX
    if (job->amx) amx_configure(); /* rows_k_amx's passes may come: their registers' shapes */
#endif
    while (bargein_shares_take(job->shares, index, count, &t, &next)) run_tile(job, index, t, next);
#ifdef GGUF_AMX
    if (job->amx) amx_release();
#endif
}

/* a's K-chain arrays for its m rows of width k: kq .. ks32; kx where quads (the quad
 * pass), alo (and ahi, but where k_flat) where amx, kc16 where q6k_avx2 (Q6_K's AVX2 tile
 * pass), kz where q6k_zmm (its 512-bit one). Returns 0, or -1 when memory could not be had. */
static int k_acts_alloc(acts_t *a, int quads, int amx, int q6k_avx2, int q6k_zmm) {
    const int64_t m = a->m, k = a->k;
    const size_t cells = (size_t)(m * a->nb > 0 ? m * a->nb : 1), bytes = (size_t)(m * k > 0 ? m * k : 1);
    a->kq = malloc(bytes);
    a->kd = malloc(sizeof(float) * cells); /* more than m * k / 256 */
    a->km = malloc(sizeof(int16_t) * cells);
    a->ks16 = malloc(sizeof(int16_t) * 2 * cells);
    a->ks32 = malloc(sizeof(int16_t) * cells);
    if (quads) a->kx = malloc(bytes);
    if (q6k_avx2) { /* in groups of four rows, the last one's rows past m never read */
        const size_t rows4 = (size_t)((m + 3) / 4 * 4 > 0 ? (m + 3) / 4 * 4 : 4);
        a->kc16 = malloc(sizeof(int32_t) * (size_t)(k / 16) * rows4);
        a->kqh = malloc((size_t)k * rows4);
        a->km4 = malloc(sizeof(int16_t) * (size_t)(k / 32) * rows4);
    }
    if (q6k_zmm) { /* in groups of eight rows, the last one's rows past m never read */
        const size_t groups = (size_t)((m + 7) / 8 > 0 ? (m + 7) / 8 : 1);
        a->kz = malloc(sizeof(int32_t) * 3 * 8 * (size_t)a->nb * groups); /* 24 a superblock: 3 a 32-block */
        a->kq8 = malloc((size_t)(8 * k) * groups);
    }
    if (amx) {
        a->amx_stride = k + AMX_ROW_PAD;
        a->alo = malloc((size_t)(m * a->amx_stride));
        if (!a->k_flat) a->ahi = malloc((size_t)(m * a->amx_stride));
    }
    return !a->kq || !a->kd || !a->km || !a->ks16 || !a->ks32 || (quads && !a->kx) || (q6k_avx2 && (!a->kc16 || !a->kqh || !a->km4)) ||
                   (q6k_zmm && (!a->kz || !a->kq8)) || (amx && (!a->alo || (!a->k_flat && !a->ahi)))
               ? -1
               : 0;
}

static void k_acts_free(acts_t *a) {
    free(a->kq);
    free(a->kd);
    free(a->km);
    free(a->ks16);
    free(a->ks32);
    free(a->kx);
    free(a->kc16);
    free(a->kz);
    free(a->kq8);
    free(a->kqh);
    free(a->km4);
    free(a->alo);
    free(a->ahi);
}

static int check_types(const bargein_qmat_t *w) {
    for (int64_t s = 0; s < w->num_segs; s++) {
        qinfo_t info;
        if (half_type(w->segs[s].type)) continue;
        if (gguf_qinfo((int)w->segs[s].type, &info) || w->k % info.qk) return -3;
    }
    return 0;
}

/* bargein_gguf_matmul with the K chain's few-row passes on VNNI of up to k_group_rows rows
 * (any count gives the same bits). */
static int matmul_k_group_rows(const float *x, int64_t m, const bargein_qmat_t *w, float *y, int exact,
                               int num_threads, int isa, int64_t k_group_rows) {
    if (check_types(w)) return -3;
    if (isa < 0) isa = bargein_q8_isa_best();
    if (!bargein_q8_isa_available(isa)) return -2;
#ifdef GGUF_AMX
    int amx = isa == ISA_AMX && !exact && m >= AMX_MIN_ROWS; /* and a segment of the K chain: below */
#else
    int amx = 0;
#endif
    if (isa == ISA_AMX) isa = ISA_VNNI; /* everything but the K tile pass: VNNI's */
    int64_t num_tiles = 0; /* of the block types' segments; the 16-bit floats' are half_matmul.c's */
    for (int64_t s = 0; s < w->num_segs; s++)
        if (!half_type(w->segs[s].type)) num_tiles += (w->segs[s].rows + TILE - 1) / TILE;
    const int half_status = num_tiles < w->n ? bargein_half_matmul(x, m, w, y, num_threads, isa) : 0;
    if (half_status) return half_status;
    if (num_tiles == 0) return 0;
    if (exact && isa == ISA_VNNI) isa = ISA_AVX2; /* exact has a C and an AVX2 path */
    const int64_t k = w->k, nb = k / 32, n = w->n;
    if (num_threads > num_tiles) num_threads = (int)num_tiles;
    if (num_threads < 1) num_threads = 1;
    const size_t cells = (size_t)(m * nb > 0 ? m * nb : 1);
    int has_k = 0, has_32 = 0, has_q4_k = 0; /* segments on the K chain (Q4_K among them), on the 32 chain */
    int has_k_flat = 0, has_q6_k = 0;        /* and on the former, Q4_K or Q5_K (k_flat_type), Q6_K */
    int has_signed = 0;                      /* and on the latter, those with a signed tile pass */
    for (int64_t s = 0; s < w->num_segs; s++) {
        if (k_chain_type(w->segs[s].type))
            has_k = 1, has_q4_k |= w->segs[s].type == T_Q4_K, has_k_flat |= k_flat_type(w->segs[s].type),
            has_q6_k |= w->segs[s].type == T_Q6_K;
        else if (!half_type(w->segs[s].type)) {
            has_32 = 1;
#ifdef GGUF_X86
            qinfo_t info;
            has_signed |= !gguf_qinfo((int)w->segs[s].type, &info) && signed_tile(isa, &info);
#endif
        }
    }
    /* the quad pass's order of kq: VNNI few-row passes of Q4_K */
    const int quads = !exact && has_q4_k && isa == ISA_VNNI && m >= K_QUADS_MIN_ROWS && m < K_GEMM_MIN_ROWS;
    /* Q6_K's tile pass on AVX2 (rows_k_avx2) and so its activations' offsets (kc16) */
    int q6k_avx2 = 0;
#ifdef GGUF_X86
    q6k_avx2 = !exact && has_q6_k && isa == ISA_AVX2 && m >= K_GEMM_MIN_ROWS;
#endif
    /* and on VNNI (rows_k_zmm_t), its terms widened once (kz) */
    const int q6k_zmm = !exact && has_q6_k && isa == ISA_VNNI && m >= K_GEMM_MIN_ROWS;
    acts_t a = {x, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, m, k, nb, exact, NULL, NULL, NULL, NULL, NULL, NULL};
    acts_t af = a; /* Q4_K's and Q5_K's K chain */
    af.k_flat = 1;
    job_t job = {w, &a, has_k_flat && !exact ? &af : NULL, y, m, n, k, nb, isa, isa == ISA_VNNI ? GEMM_MIN_ROWS_VNNI : GEMM_MIN_ROWS_AVX2, num_tiles,
                 NULL, NULL, NULL, NULL, 0, 0, NULL};
    /* tiles are built for many rows on the vector paths only; otherwise a float per row
     * (the C columns' sums): a tile's scratch for one row would be mapped and unmapped
     * by malloc on every call once k is large */
    const int tiles = !exact && isa != ISA_C && m >= (job.gemm_min_rows < K_GEMM_MIN_ROWS ? job.gemm_min_rows : K_GEMM_MIN_ROWS);
    job.scratch_bytes = tiles ? 2 * TILE * k + (int64_t)TILE * nb * (2 * 4 + 4 * 4)
                              : (int64_t)sizeof(float) * (m > 0 ? m : 1);
#ifdef GGUF_ARM64
    if (!exact && isa != ISA_C) job.scratch_bytes = neon_gguf_scratch_bytes(k);
#endif
    job.scratch_bytes = (job.scratch_bytes + 63) / 64 * 64;
    job.amx = amx && tiles && has_k;
    if (job.amx) { /* tile_t's amx_lo, amx_hi */
        job.amx_at = job.scratch_bytes;
        job.scratch_bytes += 2 * TILE * k;
        job.sub_bytes = job.scratch_bytes;
        /* as many tiles as fit AMX_SET_BYTES, but few enough that every thread has
         * AMX_SET_ITEMS items to take (a small matrix on many cores) */
        int64_t amx_tiles = 0, set = AMX_SET_BYTES / (2 * TILE * k);
        for (int64_t s = 0; s < w->num_segs; s++)
            if (k_chain_type(w->segs[s].type)) amx_tiles += (w->segs[s].rows + TILE - 1) / TILE;
        const int64_t spread = amx_tiles / ((int64_t)AMX_SET_ITEMS * num_threads);
        set = set < spread ? set : spread;
        job.amx_set = (int)(set < 1 ? 1 : set > AMX_SET_TILES ? AMX_SET_TILES : set);
        job.scratch_bytes *= job.amx_set;
    }
    if (q6k_zmm && !job.amx && m >= Q6K_TABLE_MIN_ROWS) { /* tile_t's q6k_table */
        job.q6k_table_at = job.scratch_bytes;
        job.scratch_bytes += (int64_t)sizeof(int32_t) * 32 * TILE * nb;
    }
    job.k_group_rows = k_group_rows;
    int status = 0;
    if (exact) a.xsum16 = malloc(sizeof(float) * 2 * cells);
    else {
        if (has_32) {
            a.q = malloc((size_t)(m * k > 0 ? m * k : 1));
            a.d = malloc(sizeof(float) * cells);
            a.s = malloc(sizeof(float) * cells);
            a.s16 = malloc(sizeof(int32_t) * 2 * cells);
            if (tiles && has_signed && m >= (isa == ISA_VNNI ? SIGNED_MIN_ROWS_VNNI : SIGNED_MIN_ROWS_AVX2))
                a.qu = malloc((size_t)(m * k > 0 ? m * k : 1));
        }
        if (has_q6_k && k_acts_alloc(&a, 0, job.amx, q6k_avx2, q6k_zmm)) status = -1;
        if (has_k_flat && k_acts_alloc(&af, quads, job.amx, 0, 0)) status = -1;
    }
    job.tile_seg = malloc(sizeof(int64_t) * (size_t)(num_tiles + 1));
    job.tile_col = malloc(sizeof(int64_t) * (size_t)(num_tiles + 1));
    job.seg_start = malloc(sizeof(int64_t) * (size_t)(w->num_segs + 1));
    job.scratch = aligned_alloc(64, (size_t)(job.scratch_bytes * num_threads));
    job.shares = bargein_shares_new(num_threads, num_tiles);
    if (status || (exact ? !a.xsum16 : has_32 && (!a.q || !a.d || !a.s || !a.s16)) || !job.tile_seg || !job.tile_col || !job.seg_start ||
        !job.scratch || !job.shares) {
        status = -1;
        goto done;
    }
    int64_t tile = 0, start = 0;
    for (int64_t s = 0; s < w->num_segs; s++) {
        job.seg_start[s] = start;
        const int64_t step = job.amx && k_chain_type(w->segs[s].type) ? job.amx_set * TILE : TILE;
        for (int64_t c = 0; c < w->segs[s].rows && !half_type(w->segs[s].type); c += step)
            job.tile_seg[tile] = s, job.tile_col[tile++] = c;
        start += w->segs[s].rows;
    }
    if (tile < job.num_tiles) { /* sets of tiles: fewer items */
        job.num_tiles = tile;
        free(job.shares);
        if (!(job.shares = bargein_shares_new(num_threads, tile))) {
            status = -1;
            goto done;
        }
    }
    const int64_t quant_threads = m / 16 < num_threads ? m / 16 : num_threads;
    bargein_task_fn quantize = quantize_rows;
#ifdef GGUF_X86
    if (isa != ISA_C && !exact) quantize = quantize_rows_avx2; /* exact: the C loop sums x per half */
#endif
#ifdef GGUF_ARM64
    if (isa != ISA_C && !exact) quantize = neon_gguf_quantize_rows;
#endif
    if (exact || has_32 || has_q6_k) bargein_parallel_run(quantize, &a, quant_threads > 1 ? (int)quant_threads : 1);
    if (af.kq) bargein_parallel_run(quantize, &af, quant_threads > 1 ? (int)quant_threads : 1);
    bargein_parallel_run(run_tiles, &job, num_threads);
done:
    free(a.q);
    free(a.d);
    free(a.s);
    free(a.s16);
    free(a.xsum16);
    free(a.qu);
    k_acts_free(&a);
    k_acts_free(&af);
    free(job.tile_seg);
    free(job.tile_col);
    free(job.seg_start);
    free(job.scratch);
    free(job.shares);
    return status;
}

int bargein_gguf_matmul(const float *x, int64_t m, const bargein_qmat_t *w, float *y, int exact, int num_threads,
                        int isa) {
    return matmul_k_group_rows(x, m, w, y, exact, num_threads, isa, K_GROUP_ROWS_VNNI);
}

int bargein_gguf_matmul_expert(const float *x, int64_t m, const bargein_qmat_t *w, float *y, int exact, int isa) {
    return matmul_k_group_rows(x, m, w, y, exact, 1, isa, EXPERT_K_GROUP_ROWS_VNNI);
}

/* ---- rows widened to float32 -------------------------------------------------------- */

typedef struct {
    const bargein_qmat_t *w;
    const int64_t *ids;
    int64_t count;
    float *out;
    int avx2;
} rows_job_t;

static void dequantize_row(const bargein_qseg_t *seg, int64_t i, int64_t k, float *out, int avx2) {
    if (half_type(seg->type)) {
        bargein_half_row(seg, i, k, out, avx2);
        return;
    }
    qinfo_t info = {32, 0, 0, KIND_PLAIN};
    gguf_qinfo((int)seg->type, &info);
    const uint8_t *row = column_row(seg, i);
#ifdef GGUF_X86
    if (avx2) {
        dequantize_row_avx2(seg, &info, row, k, out);
        return;
    }
#else
    (void)avx2;
#endif
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
        dequantize_row(&w->segs[s], id, w->k, job->out + t * w->k, job->avx2);
    }
}

/* Rows ids[0 .. count) of W (each in [0, n)) as float32 (count, k): the values gguf.quants
 * gives. Returns 0, -3 for a type without kernels, -6 for an id outside W. */
int bargein_gguf_dequantize_rows(const bargein_qmat_t *w, const int64_t *ids, int64_t count, float *out,
                                 int num_threads) {
    if (check_types(w)) return -3;
    for (int64_t t = 0; t < count; t++)
        if (ids[t] < 0 || ids[t] >= w->n) return -6;
    rows_job_t job = {w, ids, count, out, bargein_q8_isa_available(ISA_AVX2)};
    const int64_t threads = count / 4 < num_threads ? count / 4 : num_threads;
    bargein_parallel_run(dequantize_rows_part, &job, threads > 1 ? (int)threads : 1);
    return 0;
}
