/* gguf_matmul.c's many-row tile pass of the K chain (Q4_K, Q5_K, Q6_K) on AMX (Intel's
 * tile registers: Sapphire Rapids and later Xeons), 16 rows at a time, with the same bits
 * as every other path.
 *
 * A superblock's D (the header of gguf_matmul.c) takes the AVX-512 pass 8 blocks x (8
 * vpdpbusd + a vpmulld) per row and 16 columns (Q6_K: three vpmulld and an offset's start
 * more). Here the per-block factors go into the tile products' operands, so that one
 * product spans the whole superblock. The activations a = m_j * kq: for Q4_K and Q5_K flat
 * (m_j = 1, acts_t's k_flat), a = kq, one signed byte (acts_t's alo); for Q6_K |a| <= 16 *
 * 127, two bytes, a = 256 * ahi + alo (alo in 0..255, ahi in -8..7: acts_t's alo, ahi),
 * each written as its block is quantized. The weights, built once per tile
 * (amx_scaled_tile), w = 256 * whi + wlo (wlo in 0..255, whi signed), where
 *
 *   Q4_K, Q5_K (D = sum_j sc_j * D_j = sum of (sc_j * q) * a): w = sc * q, the unsigned
 *   quant times its 6-bit scale (at most 31 * 63: whi in 0..7);
 *   Q6_K (D = sum_h sc_h * m_h * (D_h - 32 * S16_h) = sum of (sc_h * (u - 32)) * a): w =
 *   sc_h * (u - 32), the signed quant times its signed scale (|w| <= 128 * 32: whi in
 *   -16..16), so the offset's start needs no term;
 *
 *   Q4_K, Q5_K:  D = C_l + 256 * C_h,  C_l = sum a * wlo, C_h = sum a * whi;
 *   Q6_K:        D = C_ll + 256 * C_mid + 65536 * C_hh,  C_ll = sum alo * wlo, C_hh = sum
 *                ahi * whi, C_mid = sum alo * whi + sum ahi * wlo (both cross products in
 *                one accumulator).
 *
 * Tile products of 64 bytes' depth, four times per superblock: Q4_K's and Q5_K's two
 * (tdpbsud, tdpbssd), 8 products for 16 rows x 16 columns x 256; Q6_K's four (tdpbuud,
 * tdpbusd, tdpbsud, tdpbssd), 16 products, where the AVX-512 pass issues 1,024 vpdpbusd
 * and 128 to 384 vpmulld. (The flat activations halved Q4_K's and Q5_K's products:
 * bench/gemm_tile_ab.c, the 1B layer's shapes at 512 rows, one thread, 0.78x the time of
 * the four products on per-32 activations.) The C sums are exact int32 (|C_ll| <= 256 *
 * 255 * 255), and D is the same integer as any other path's (a wrapped partial sum
 * included: the total fits int32), so after zmm_superblock_floats the bits are the other
 * paths'.
 * (Q4_K and Q5_K split sc into 3-bit halves before, q * slo and q * shi, for four
 * accumulators of factors 1, 8, 256 and 2,048; with three, a step stores and zeroes one
 * tile less and combines one sum less per row: bench/gemm_tile_ab.c, the 1B layer's
 * shapes at 512 rows, 0.956x the time for Q4_K, 0.965 for Q5_K, 0.958 for Q6_K.)
 *
 * Tile registers (amx_configure: all 16 rows of 64 bytes): the sums in 0-2 (C_l, C_h in 0,
 * 1), alo and ahi in 4, 5 (16 rows' 64 bytes, amx_stride apart), the weights' low and high bytes
 * in 6, 7 (the tile's two blocks of 8 rows of 16 columns' 4 bytes: tdpbuud's B as it
 * is); 3 is free. The sums of a step (a superblock of one tile) go out to memory while
 * the tile unit runs the next step; the vector units then combine and scale the first's
 * (a load of what a tilestored has just written waits for it to reach the cache). A
 * thread configures the registers once per call (run_tiles) and releases them at its
 * end. The tile instructions are inline assembly with "memory" clobbers (they read the
 * tiles and activations that plain stores wrote), for GCC and Clang alike.
 *
 * The loop order is a blocked GEMM's (gguf_matmul.c's run_amx_set): an item is a set of
 * tiles whose scaled weights fit L2 together (AMX_SET_BYTES), and each 16-row block of a
 * passes over all of them while it is in L2. A pass per tile over all of a call's rows read
 * every row's a (two bytes a value) again for every tile, and the tile loads of a then
 * held 57% of the pass's samples: as fast as the AVX-512 pass, no faster. With the sets,
 * bench/gemm_tile_ab.c (weights from memory, 512 rows, one thread, a 2-core Sapphire
 * Rapids-class VM) 0.70-0.93x the AVX-512 pass's time per shape of a 1B layer, 0.79 over
 * the five; a 512-token prefill of llama1b.Q4_K_M 1.16-1.24x as fast, of Q5_K_M 1.25x.
 * Q6_K: 0.57-0.71x per shape, 0.63 over the five, at 512 rows; 0.86 at 64 (its crossover
 * is near 40 rows: 1.03 at 32, 0.93 at 48; Q4_K's near 56).
 *
 * Within a set, a 16-row block goes superblock by superblock, each over all the tiles
 * (rows_k_amx_t), so that its activations for one superblock (2 x 16 x 256 bytes) are
 * read from L1 by every tile but the first. Their rows are k + AMX_ROW_PAD bytes apart:
 * k apart (k a multiple of 2,048), a tile load's 16 rows fell in two of L1's 64 sets, and
 * alo's and ahi's 32 lines could not stay in their 12 ways. The padding alone took
 * 0.91-0.96x the time (bench/k_chain_cost.c, Q5_K and Q6_K, 2048 x 2048 and x 8192, 512
 * rows), the order by superblocks on top of it 0.91-0.98x (with the L1 misses, it had
 * gained nothing); both, over the layer's shapes with weights from memory
 * (gemm_tile_ab.c): Q4_K 0.935, Q5_K 0.933, Q6_K 0.839.
 *
 * Included by gguf_matmul.c inside its GGUF_AMX section, after gguf_tile_zmm.h. */
#ifndef BARGEIN_GGUF_TILE_AMX_H
#define BARGEIN_GGUF_TILE_AMX_H

#include <string.h>

#define AMX_ROWS_K 16 /* rows per pass: a tile register's rows */

#define TARGET_AMX __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,amx-tile,amx-int8")))

/* ldtilecfg's 64-byte operand (palette 1). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config_t;

/* The tile registers' shapes for rows_k_amx, set once per thread and call (run_tiles):
 * ldtilecfg took ~1,000 cycles on the machine measured. amx_release hands the state back,
 * so that a thread holds none between calls. */
static void amx_configure(void) {
    amx_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = AMX_ROWS_K, c.colsb[t] = 64;
    __asm__ volatile("ldtilecfg %0" ::"m"(*(const amx_config_t *)&c));
}

static void amx_release(void) { __asm__ volatile("tilerelease" ::: "memory"); }

#define AMX_ZERO(T) __asm__ volatile("tilezero %%tmm" #T ::: "memory")
#define AMX_LOAD(T, at, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #T ::"r"(at), "r"((int64_t)(stride)) : "memory")
#define AMX_STORE(T, at) __asm__ volatile("tilestored %%tmm" #T ", (%0,%1,1)" ::"r"(at), "r"((int64_t)64) : "memory")
#define AMX_DP(OP, C, A, B) __asm__ volatile(#OP " %%tmm" #B ", %%tmm" #A ", %%tmm" #C ::: "memory")

/* tl's weights w as the AMX operands' two bytes, w = 256 * whi + wlo (wlo in 0..255 into
 * amx_lo, whi into amx_hi), in the tile's layout: w = sc * u for Q4_K and Q5_K (the
 * unsigned quant times its 6-bit scale: at most 31 * 63, so whi in 0..7), w = sc * (u - 32)
 * for Q6_K (the signed quant times its signed scale: |w| <= 128 * 32, whi in -16..16). Each
 * 64-byte group of the tile (16 columns' 4 quants) is widened to int16 and multiplied by
 * its column's scale (repeated over the column's 4 lanes by a permute); a scale of Q4_K or
 * Q5_K spans a 32-block (8 groups), one of Q6_K a 16-half (4 groups). */
static TARGET_AMX void amx_scaled_tile(const job_t *job, const tile_t *tl, int64_t type) {
    int16_t lane_col[32] __attribute__((aligned(64))); /* 16-bit lane i of columns 0-7: column i / 4 */
    for (int i = 0; i < 32; i++) lane_col[i] = (int16_t)(i / 4);
    const __m512i cols_lo = _mm512_load_si512(lane_col), cols_hi = _mm512_add_epi16(cols_lo, _mm512_set1_epi16(8));
    const int q6 = type == T_Q6_K, groups = q6 ? 4 : 8; /* groups per scale */
    const __m512i off = _mm512_set1_epi16(q6 ? 32 : 0);
    for (int64_t h = 0; h < job->k / (4 * groups); h++) {
        const int32_t *psc = tl->psc + (q6 ? h : 2 * h) * TILE; /* the panel: Q4_K/Q5_K's at [2 j TILE] */
        const __m512i sc = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_loadu_si512(psc)));
        const __m512i sc_lo = _mm512_permutexvar_epi16(cols_lo, sc), sc_hi = _mm512_permutexvar_epi16(cols_hi, sc);
        for (int g = 0; g < groups; g++) {
            const int64_t at = (groups * h + g) * TILE * 4;
            const __m256i *u = (const __m256i *)(tl->tile + at);
            const __m512i w0 = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_load_si256(u)), off), sc_lo);
            const __m512i w1 = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_load_si256(u + 1)), off), sc_hi);
            _mm256_store_si256((__m256i *)(tl->amx_lo + at), _mm512_cvtepi16_epi8(w0)); /* the low bytes */
            _mm256_store_si256((__m256i *)(tl->amx_lo + at + 32), _mm512_cvtepi16_epi8(w1));
            _mm256_store_si256((__m256i *)(tl->amx_hi + at), _mm512_cvtepi16_epi8(_mm512_srai_epi16(w0, 8)));
            _mm256_store_si256((__m256i *)(tl->amx_hi + at + 32), _mm512_cvtepi16_epi8(_mm512_srai_epi16(w1, 8)));
        }
    }
}

/* Chunk c (64 of 256) of superblock t's products for rows r0 .. r0 + 15 into tile
 * registers 0-2: C_ll, C_mid (both cross products: the same factor 256), C_hh, four
 * products; FLAT (one-byte activations a = kq): C_l = sum a * wlo, C_h = sum a * whi into
 * 0, 1, two products. */
static inline TARGET_AMX __attribute__((always_inline)) void amx_chunk(const job_t *job, const tile_t *tl, int64_t r0,
                                                                        int64_t t, int c, const int FLAT) {
    const acts_t *a = job->a;
    const int64_t x = r0 * a->amx_stride + t * 256 + 64 * c, w = (t * 256 + 64 * c) * TILE;
    AMX_LOAD(4, a->alo + x, a->amx_stride);
    if (!FLAT) AMX_LOAD(5, a->ahi + x, a->amx_stride);
    AMX_LOAD(6, tl->amx_lo + w, 64);
    AMX_LOAD(7, tl->amx_hi + w, 64);
    if (FLAT) {
        AMX_DP(tdpbsud, 0, 4, 6); /* a * wlo */
        AMX_DP(tdpbssd, 1, 4, 7); /* a * whi */
        return;
    }
    AMX_DP(tdpbuud, 0, 4, 6); /* alo * wlo */
    AMX_DP(tdpbusd, 1, 4, 7); /* alo * whi */
    AMX_DP(tdpbsud, 1, 5, 6); /* ahi * wlo */
    AMX_DP(tdpbssd, 2, 5, 7); /* ahi * whi */
}

/* The sums' registers (0-2; FLAT 0-1) zeroed for a step, and stored to s. */
static inline TARGET_AMX __attribute__((always_inline)) void amx_zero_sums(const int FLAT) {
    AMX_ZERO(0);
    AMX_ZERO(1);
    if (!FLAT) AMX_ZERO(2);
}

static inline TARGET_AMX __attribute__((always_inline)) void amx_store_sums(int32_t (*s)[AMX_ROWS_K][TILE],
                                                                             const int FLAT) {
    AMX_STORE(0, s[0]);
    AMX_STORE(1, s[1]);
    if (!FLAT) AMX_STORE(2, s[2]);
}

/* Rows r0 .. r0 + 15 over a set's `subs` tiles tl (MIN: Q4_K or Q5_K, their activations
 * flat (acts_t's k_flat) and so two products a chunk; else Q6_K, four; tile v's
 * columns j0 + 16 v on, cols[v] of them), the registers configured and the tiles' weights
 * scaled (amx_scaled_tile). ahead: NULL, or the next item's plans (tile_ahead), a part per
 * superblock. Step i is superblock i / subs of tile i % subs (the header: the
 * activations of a superblock stay in L1 over the set). Step i + 1's products
 * interleave with the vector units' work on step i: a quarter of i's rows after each of
 * i + 1's four chunks. */
static inline TARGET_AMX __attribute__((always_inline)) void rows_k_amx_t(const job_t *job, const tile_t *tl, int subs,
                                                                          const ahead_t *ahead, int64_t j0,
                                                                          const int *cols, int64_t r0, const int MIN) {
    const int64_t steps = job->k / 256 * subs; /* step i: superblock i / subs of tile i % subs */
    int32_t sums[2][3][AMX_ROWS_K][TILE] __attribute__((aligned(64))); /* step i's at i % 2 */
    float acc[AMX_SET_TILES][AMX_ROWS_K][TILE] __attribute__((aligned(64))); /* the first superblock writes it */
    amx_zero_sums(MIN);
    for (int c = 0; c < 4; c++) amx_chunk(job, tl, r0, 0, c, MIN);
    for (int64_t i = 0; i < steps; i++) {
        const int64_t t = i / subs;
        const int v = (int)(i % subs);
        int32_t(*s)[AMX_ROWS_K][TILE] = sums[i % 2];
        amx_store_sums(s, MIN);
        if (ahead && v == 0) prefetch_step(ahead, t), prefetch_step(ahead + 1, t);
        const int more = i + 1 < steps;
        const int64_t t1 = (i + 1) / subs;
        const tile_t *tl1 = tl + (i + 1) % subs;
        if (more) amx_zero_sums(MIN);
        for (int c = 0; c < 4; c++) {
            if (more) amx_chunk(job, tl1, r0, t1, c, MIN);
            __m512i dk[4];
            const int q = 4 * c; /* rows q .. q + 3 of step i */
            _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
                const __m512i ll = _mm512_load_si512(s[0][q + r]), mid = _mm512_load_si512(s[1][q + r]);
                if (MIN) { /* D = C_l + 256 C_h */
                    dk[r] = _mm512_add_epi32(ll, _mm512_slli_epi32(mid, 8));
                    continue;
                }
                const __m512i hh = _mm512_load_si512(s[2][q + r]); /* D = C_ll + 256 C_mid + 65536 C_hh */
                dk[r] = _mm512_add_epi32(_mm512_add_epi32(ll, _mm512_slli_epi32(mid, 8)), _mm512_slli_epi32(hh, 16));
            }
            zmm_superblock_floats(job, tl + v, r0 + q, t, 4, MIN, dk, acc[v] + q, 1);
        }
    }
    for (int v = 0; v < subs; v++)
        for (int r = 0; r < AMX_ROWS_K; r++) zmm_store_row(job, r0 + r, j0 + v * TILE, cols[v], _mm512_load_ps(acc[v][r]));
}

static TARGET_AMX void rows_k_amx(const job_t *job, const tile_t *tl, int subs, const ahead_t *ahead, int64_t type,
                                  int64_t j0, const int *cols, int64_t r0) {
    if (type == T_Q6_K) rows_k_amx_t(job, tl, subs, ahead, j0, cols, r0, 0);
    else rows_k_amx_t(job, tl, subs, ahead, j0, cols, r0, 1); /* Q4_K, Q5_K: the mins */
}

#endif
