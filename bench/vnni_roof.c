/*
 * The roof of the many-row `fast` GGUF matmul on this machine (issue 33: prefill >= 2x
 * llama.cpp): the int8 multiply-accumulate peak per core and on 2 threads of the
 * instructions gguf_matmul.c's tile passes use, and the fraction of it that the
 * library's matmul reaches on the four matrix shapes of a Llama-3.2-1B layer at 512 rows
 * (a prefill chunk).
 *
 * Peaks (MACs per second, one MAC = one int8 x int8 product added; 2 ops per MAC):
 *   vnni-zmm       vpdpbusd zmm, 12 independent accumulators, operands in registers
 *   vnni-zmm-bcst  vpdpbusd zmm with the signed operand a 4-byte broadcast from memory,
 *                  one weight register shared by 8 accumulators: the 512-bit K pass's
 *                  inner step (gguf_tile_zmm.h)
 *   vnni-zmm+kmul  12 vpdpbusd zmm and 3 independent vpmulld zmm per step: the mix of
 *                  the 512-bit K pass (8 and 2 per 32-block and row), its ceiling
 *   vnni-ymm       vpdpbusd ymm, 12 accumulators (the 256-bit 32-chain pass)
 *   avx2           vpmaddubsw + vpmaddwd (by ones) + vpaddd on ymm, 8 accumulators: the
 *                  AVX2 pass's three instructions per 32 MACs
 *   avx2-i16       vpmaddubsw + vpaddw on ymm, the activation a 4-byte broadcast from
 *                  memory shared by two weight registers, 8 int16 sums: the step of
 *                  Q4_K's AVX2 pass (its groups summed in int16, one madd per 32-block)
 * Each on 1 thread and on THREADS threads at once (their MACs summed over the wall time).
 *
 * The matmul: bargein_gguf_matmul(fast) of the library LIB on one resident matrix of
 * random valid blocks, 512 rows of activations (the call includes quantizing them), best
 * of REPEATS calls, per type, ISA path and thread count; its MAC rate (N * K * ROWS per
 * second) over the peak of the path's instruction (VNNI: vnni-zmm; AVX2: avx2) at the
 * same thread count. A 1B-class token costs 0.973 GMAC in the 16 layers' matrices
 * (2 * 2048^2 + 2 * 512 * 2048 + 3 * 8192 * 2048 per layer) plus 0.263 GMAC for the
 * head (128256 x 2048) where a token's logits are computed; the table's last column is
 * the tokens/s that the layer rate alone would allow (the matrices only: no attention,
 * norms or head).
 *
 *   cc -O2 -march=native -pthread -o /tmp/vnni_roof bench/vnni_roof.c -ldl -lm
 *   /tmp/vnni_roof LIB.so [THREADS] [REPEATS] [TYPES...]     (default 2, 3, Q4_K Q4_0 Q6_K)
 *
 * Prints a table, then one line of JSON (the same numbers) starting with '{'.
 * Build LIB with bargein/kernels' flags (see gemm_tile_ab.c's header). Needs AVX-512
 * VNNI for the VNNI rows; without it those rows are skipped.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>

#include "gguf_ab.h"

#define ROWS 512
#define PEAK_ITERS 10000000L /* per thread and repeat: ~0.1 s on a 3 GHz core */

static double now(void) { return seconds_on(CLOCK_MONOTONIC); }

/* ---- peaks: each kernel returns its MACs; the checksum keeps the loop alive ---------- */

static volatile int sink;

/* The loops' bodies are asm on named accumulators (an array of them spills at -O2) so
 * that the counts are the instructions named and nothing else but the loop's counter.
 * AT&T order: vpdpbusd SIGNED, UNSIGNED, ACC. */
#define DPBUSD(ACC, W, X) __asm__("vpdpbusd %2, %1, %0" : "+v"(ACC) : "v"(W), "v"(X))
#define DPBUSD_BCST(ACC, W, P) __asm__("vpdpbusd %1%{1to16%}, %2, %0" : "+v"(ACC) : "m"(*(P)), "v"(W))
#define MADD3(ACC, W, X, ONES)                                                                             \
    do {                                                                                                   \
        __m256i t_;                                                                                        \
        __asm__("vpmaddubsw %3, %2, %1\n\tvpmaddwd %4, %1, %1\n\tvpaddd %1, %0, %0"                        \
                : "+x"(ACC), "=&x"(t_)                                                                     \
                : "x"(W), "x"(X), "x"(ONES));                                                              \
    } while (0)
#define EACH8(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7)
#define EACH12(F) EACH8(F) F(8) F(9) F(10) F(11)

/* Keeps a ymm loop's sums alive: their total's first lane to the sink. */
__attribute__((target("avx2"))) static inline void sink_ymm(__m256i s) {
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, s);
    sink = lanes[0];
}

/* A ymm loop's accumulators a0, a1, ... (started apart: none folded away), and their total
 * handed to the sink once the loop is done (EACH: EACH8 or EACH12). */
#define YMM_ACC(i) __m256i a##i = _mm256_set1_epi32(i);
#define YMM_ADD(i) total_ = _mm256_add_epi32(total_, a##i);
#define SINK_YMM(EACH)                                                                                     \
    do {                                                                                                   \
        __m256i total_ = _mm256_setzero_si256();                                                           \
        EACH(YMM_ADD)                                                                                      \
        sink_ymm(total_);                                                                                  \
    } while (0)

__attribute__((target("avx512f,avx512vnni"))) static long peak_vnni_zmm(long iters) {
    const __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
#define DECL(i) __m512i a##i = _mm512_set1_epi32(i);
#define STEP(i) DPBUSD(a##i, w, x);
#define SUM(i) s = _mm512_add_epi32(s, a##i);
    EACH12(DECL)
    for (long it = 0; it < iters; it++) {
        EACH12(STEP)
    }
    __m512i s = _mm512_setzero_si512();
    EACH12(SUM)
    sink = _mm512_reduce_add_epi32(s);
    return iters * 12 * 64;
#undef STEP
}

/* The tile pass's step: per group of four quants, one weight register for 16 columns and
 * per row a 4-byte activation broadcast from memory (vpdpbusd's m32bcst operand), 8 rows. */
__attribute__((target("avx512f,avx512vnni"))) static long peak_vnni_zmm_bcst(long iters) {
    static int32_t xs[8 * 64] __attribute__((aligned(64)));
    for (int i = 0; i < 8 * 64; i++) xs[i] = 0x01020304 + i;
    const __m512i w = _mm512_set1_epi8(3);
#define STEP(i) DPBUSD_BCST(a##i, w, x + 64 * i);
    EACH8(DECL)
    for (long it = 0; it < iters; it++) {
        const int32_t *x = xs + (it & 15);
        EACH8(STEP)
    }
    __m512i s = _mm512_setzero_si512();
    EACH8(SUM)
    sink = _mm512_reduce_add_epi32(s);
    return iters * 8 * 64;
#undef STEP
#undef DECL
#undef SUM
}

__attribute__((target("avx2,avx512f,avx512vl,avx512vnni"))) static long peak_vnni_ymm(long iters) {
    const __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
#define STEP(i) DPBUSD(a##i, w, x);
    EACH12(YMM_ACC)
    for (long it = 0; it < iters; it++) {
        EACH12(STEP)
    }
    SINK_YMM(EACH12);
    return iters * 12 * 32;
#undef STEP
}

/* The 512-bit K pass's mix (gguf_tile_zmm.h, Q4_K/Q5_K): per 32-block and row, 8 vpdpbusd
 * and 2 vpmulld (the column's scale, the row's multiple m); here 12 vpdpbusd and 3
 * independent vpmulld per step. MACs count the vpdpbusd only: the ceiling of that mix. */
__attribute__((target("avx512f,avx512vnni"))) static long peak_vnni_zmm_kmul(long iters) {
    const __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5), sc = _mm512_set1_epi32(7);
    __m512i p0 = _mm512_set1_epi32(1), p1 = _mm512_set1_epi32(2), p2 = _mm512_set1_epi32(3);
#define KDECL(i) __m512i a##i = _mm512_set1_epi32(i);
#define KSTEP(i) DPBUSD(a##i, w, x);
#define KSUM(i) s = _mm512_add_epi32(s, a##i);
#define MUL(P) __asm__("vpmulld %1, %0, %0" : "+v"(P) : "v"(sc))
    EACH12(KDECL)
    for (long it = 0; it < iters; it++) {
        KSTEP(0) KSTEP(1) KSTEP(2) KSTEP(3) MUL(p0);
        KSTEP(4) KSTEP(5) KSTEP(6) KSTEP(7) MUL(p1);
        KSTEP(8) KSTEP(9) KSTEP(10) KSTEP(11) MUL(p2);
    }
    __m512i s = _mm512_add_epi32(p0, _mm512_add_epi32(p1, p2));
    EACH12(KSUM)
    sink = _mm512_reduce_add_epi32(s);
    return iters * 12 * 64;
#undef KSTEP
#undef KDECL
#undef KSUM
#undef MUL
}

/* AVX2's three instructions per 32 MACs (ymm0-15 only: "x"), 8 accumulators. */
__attribute__((target("avx2"))) static long peak_avx2(long iters) {
    const __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5), ones = _mm256_set1_epi16(1);
#define STEP(i) MADD3(a##i, w, x, ones);
    EACH8(YMM_ACC)
    for (long it = 0; it < iters; it++) {
        EACH8(STEP)
    }
    SINK_YMM(EACH8);
    return iters * 8 * 32;
#undef STEP
}

/* Q4_K's AVX2 step: per row a broadcast activation against two weight registers (16
 * columns), the products added to int16 sums; 4 rows, 8 sums (ymm0-15 only). */
__attribute__((target("avx2"))) static long peak_avx2_i16(long iters) {
    static int32_t xs[4 * 64] __attribute__((aligned(64)));
    for (int i = 0; i < 4 * 64; i++) xs[i] = 0x01010101 * (i & 7);
    const __m256i w0 = _mm256_set1_epi8(3), w1 = _mm256_set1_epi8(2);
#define ROW(R, A, B)                                                                                       \
    do {                                                                                                   \
        __m256i xv_, t0_, t1_;                                                                             \
        __asm__("vpbroadcastd %5, %2\n\tvpmaddubsw %2, %6, %3\n\tvpmaddubsw %2, %7, %4\n\t"                 \
                "vpaddw %3, %0, %0\n\tvpaddw %4, %1, %1"                                                    \
                : "+x"(A), "+x"(B), "=&x"(xv_), "=&x"(t0_), "=&x"(t1_)                                      \
                : "m"(x[64 * (R)]), "x"(w0), "x"(w1));                                                     \
    } while (0)
    EACH8(YMM_ACC)
    for (long it = 0; it < iters; it++) {
        const int32_t *x = xs + (it & 15);
        ROW(0, a0, a1);
        ROW(1, a2, a3);
        ROW(2, a4, a5);
        ROW(3, a6, a7);
    }
    SINK_YMM(EACH8);
    return iters * 8 * 32;
#undef ROW
}

typedef long (*peak_fn)(long);
typedef struct {
    peak_fn fn;
    long iters, macs;
} peak_job_t;

static void *peak_thread(void *arg) {
    peak_job_t *j = arg;
    j->macs = j->fn(j->iters);
    return NULL;
}

/* MACs per second of fn on `threads` threads at once (best of 3). */
static double peak(peak_fn fn, int threads) {
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        pthread_t tid[64];
        peak_job_t jobs[64];
        const double t0 = now();
        for (int i = 0; i < threads; i++) {
            jobs[i] = (peak_job_t){fn, PEAK_ITERS, 0};
            pthread_create(&tid[i], NULL, peak_thread, &jobs[i]);
        }
        long macs = 0;
        for (int i = 0; i < threads; i++) pthread_join(tid[i], NULL), macs += jobs[i].macs;
        const double rate = (double)macs / (now() - t0);
        best = rate > best ? rate : best;
    }
    return best;
}

/* ---- the matmul ----------------------------------------------------------------------- */

/* Best MACs per second of the library's fast matmul, ROWS rows, one n x k matrix. */
static double matmul_rate(matmul_fn fn, const type_t *ty, int n, int k, int isa, int threads, int repeats) {
    const int64_t row_bytes = (int64_t)k / ty->qk * ty->bytes, matrix = row_bytes * n;
    uint8_t *data = malloc((size_t)matrix);
    float *x = malloc(sizeof(float) * (size_t)k * ROWS), *y = malloc(sizeof(float) * (size_t)n * ROWS);
    srand(1);
    for (int64_t i = 0; i < matrix; i++) data[i] = (uint8_t)rand();
    for (int64_t b = 0; b < matrix / ty->bytes; b++)
        for (int f = 0; f < 2; f++)
            if (ty->f16_at[f] >= 0) {
                const uint16_t half = (uint16_t)(0x1800 + (rand() & 0xff));
                memcpy(data + b * ty->bytes + ty->f16_at[f], &half, 2);
            }
    for (int64_t i = 0; i < (int64_t)k * ROWS; i++) x[i] = (float)rand() / (float)RAND_MAX - 0.5f;
    const bargein_qseg_t seg = {ty->type, data, row_bytes, n, NULL};
    const bargein_qmat_t w = {&seg, 1, n, k};
    double best = 1e30;
    for (int rep = 0; rep < repeats + 1; rep++) { /* the first call warms the scratch */
        const double t0 = now();
        if (fn(x, ROWS, &w, y, 0, threads, isa)) {
            best = -1;
            break;
        }
        const double t = now() - t0;
        if (rep && t < best) best = t;
    }
    free(data), free(x), free(y);
    return best < 0 ? -1 : (double)n * k * ROWS / best;
}

static int has_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s LIB.so [THREADS] [REPEATS] [TYPES...]\n", argv[0]);
        return 2;
    }
    matmul_fn fn = load_matmul(argv[1]);
    const int threads = argc > 2 ? atoi(argv[2]) : 2, repeats = argc > 3 ? atoi(argv[3]) : 3;
    const char *default_types[] = {"Q4_K", "Q4_0", "Q6_K"};
    const char **types = argc > 4 ? (const char **)argv + 4 : default_types;
    const int ntypes = argc > 4 ? argc - 4 : 3, vnni = has_vnni();
    if (!fn || threads < 1 || threads > 64 || repeats < 1) return 2;

    static const struct {
        const char *name;
        peak_fn fn;
        int needs_vnni;
    } PEAKS[] = {{"vnni-zmm", peak_vnni_zmm, 1},
                 {"vnni-zmm-bcst", peak_vnni_zmm_bcst, 1},
                 {"vnni-zmm+kmul", peak_vnni_zmm_kmul, 1},
                 {"vnni-ymm", peak_vnni_ymm, 1},
                 {"avx2", peak_avx2, 0},
                 {"avx2-i16", peak_avx2_i16, 0}};
    enum { NPEAK = 6 };
    double peaks[NPEAK][2] = {{0}};
    printf("int8 MAC peaks (GMAC/s; GOP/s = 2x)\n%-14s %10s %12s\n", "instruction", "1 thread", "threads");
    for (int p = 0; p < NPEAK; p++) {
        if (PEAKS[p].needs_vnni && !vnni) continue;
        peaks[p][0] = peak(PEAKS[p].fn, 1);
        peaks[p][1] = peak(PEAKS[p].fn, threads);
        printf("%-14s %10.1f %9.1f (%d)\n", PEAKS[p].name, peaks[p][0] / 1e9, peaks[p][1] / 1e9, threads);
    }

    static const int LAYER[4][2] = {{2048, 2048}, {512, 2048}, {8192, 2048}, {2048, 8192}};
    static const int PER_LAYER[4] = {2, 2, 2, 1}; /* q and o, k and v, gate and up, down */
    printf("\nbargein_gguf_matmul fast, %d rows, best of %d (fraction of the path's peak at the same threads)\n",
           ROWS, repeats);
    printf("%-5s %-4s %-3s %-11s %9s %9s\n", "type", "isa", "thr", "shape", "GMAC/s", "of peak");
    char json[16384];
    int at = snprintf(json, sizeof json, "{\"rows\": %d, \"threads\": %d, \"peaks_gmac\": {", ROWS, threads);
    for (int p = 0; p < NPEAK; p++)
        at += snprintf(json + at, sizeof json - at, "%s\"%s\": [%.2f, %.2f]", p ? ", " : "", PEAKS[p].name,
                       peaks[p][0] / 1e9, peaks[p][1] / 1e9);
    at += snprintf(json + at, sizeof json - at, "}, \"matmul\": [");
    int first = 1;
    for (int ti = 0; ti < ntypes; ti++) {
        const type_t *ty = type_named(types[ti]);
        if (!ty) {
            fprintf(stderr, "unknown type %s\n", types[ti]);
            return 2;
        }
        for (int isa = 2; isa >= 1; isa--) {
            if (isa == 2 && !vnni) continue;
            const int peak_index = isa == 2 ? 0 : 4; /* vnni-zmm; avx2 (madd by ones: every type's step) */
            for (int th = 1; th <= threads; th += threads > 1 ? threads - 1 : 1) {
                const double roof = peaks[peak_index][th == 1 ? 0 : 1];
                double seconds_per_layer = 0; /* the 16-layer stack's matrices at this rate */
                for (int s = 0; s < 4; s++) {
                    const int n = LAYER[s][0], k = LAYER[s][1];
                    const double rate = matmul_rate(fn, ty, n, k, isa, th, repeats);
                    if (rate < 0) {
                        fprintf(stderr, "%s isa %d: the call failed\n", ty->name, isa);
                        return 1;
                    }
                    seconds_per_layer += PER_LAYER[s] * (double)n * k / rate; /* per token */
                    char shape[32];
                    snprintf(shape, sizeof shape, "%dx%d", n, k);
                    printf("%-5s %-4s %-3d %-11s %9.1f %8.0f%%\n", ty->name, isa == 2 ? "vnni" : "avx2", th, shape,
                           rate / 1e9, 100 * rate / roof);
                    at += snprintf(json + at, sizeof json - at,
                                   "%s{\"type\": \"%s\", \"isa\": \"%s\", \"threads\": %d, \"n\": %d, \"k\": %d, "
                                   "\"gmac_s\": %.2f, \"of_peak\": %.3f}",
                                   first ? "" : ", ", ty->name, isa == 2 ? "vnni" : "avx2", th, n, k, rate / 1e9,
                                   rate / roof);
                    first = 0;
                }
                const double layer_macs = 60817408.0; /* 2*2048^2 + 2*512*2048 + 3*8192*2048 */
                printf("%-5s %-4s %-3d %-11s %9.1f %8.0f%%   -> %.0f tok/s from the 16 layers' matrices alone\n",
                       ty->name, isa == 2 ? "vnni" : "avx2", th, "layer", layer_macs / seconds_per_layer / 1e9,
                       100 * layer_macs / seconds_per_layer / roof, 1.0 / (16 * seconds_per_layer));
            }
        }
    }
    snprintf(json + at, sizeof json - at, "]}");
    printf("\n%s\n", json);
    return 0;
}
