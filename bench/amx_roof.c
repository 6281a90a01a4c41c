/*
 * The roof of the K chain's AMX pass (gguf_tile_amx.h) on this machine, one thread: what
 * the tile unit alone does with the pass's instructions in the pass's order, from operands
 * in L1 to operands where the pass finds them, so that the pass's own rate
 * (bench/gemm_tile_ab.c, bench/vnni_roof.c's matmul rows) can be read against it (issue
 * 33: where a 512-token prefill of a Q5_K_M file loses its time).
 *
 * A chunk is the pass's unit: alo and ahi (16 rows x 64 bytes of activations, amx_stride
 * apart) and the weights' low and high bytes (1 KB each), four tile products into three
 * accumulators: 16 rows x 16 columns x 64 of k, 16,384 MACs of the K chain. A step is a
 * superblock of one tile: three tilezero, four chunks, three tilestored.
 *
 *   load           tileloadd of one register, 64-byte rows from L1
 *   product        tdpbusd into four independent accumulators
 *   chunk          four loads and four products, operands in L1
 *   step           a step, operands in L1
 *   step-weights   steps over a set of 16 tiles' weights (64 KB each at k = 2,048; a
 *                  chunk's low and high bytes side by side) in the pass's order
 *                  (superblock by superblock over the tiles), from L2
 *   step-pass      the same with 512 rows' activations (alo, ahi: 1 MB each) read as the
 *                  pass reads them, 16 rows at a time: the first tile of each superblock
 *                  finds them beyond L2
 *
 * Each: nanoseconds per unit (median of ROUNDS), and for the chunk-based rows the MAC
 * rate that the tile unit alone would give the pass (16,384 MACs a chunk).
 *
 *   cc -O2 -mamx-tile -mamx-int8 -o /tmp/amx_roof bench/amx_roof.c -lm
 *   /tmp/amx_roof [ROUNDS]            (default 5)
 *
 * Prints a table, then one line of JSON (the same numbers) starting with '{'. Exits 2
 * where the kernel does not grant AMX's tile data (no AMX, or not permitted).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "gguf_ab.h" /* seconds_on, median */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define STRIDE 2112 /* amx_stride at k = 2,048: k + AMX_ROW_PAD */
#define ROWS 512
#define TILES 16
#define SUPERS 8 /* k / 256 */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config_t;

#define LOAD(T, at, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #T ::"r"(at), "r"((int64_t)(stride)) : "memory")
#define STORE(T, at) __asm__ volatile("tilestored %%tmm" #T ", (%0,%1,1)" ::"r"(at), "r"((int64_t)64) : "memory")
#define ZERO(T) __asm__ volatile("tilezero %%tmm" #T ::: "memory")
#define PRODUCT(OP, C, A, B) __asm__ volatile(#OP " %%tmm" #B ", %%tmm" #A ", %%tmm" #C ::: "memory")

/* The pass's chunk (amx_chunk): activations at x (rows STRIDE apart), weights at w. */
#define CHUNK(x, w)                                                                                        \
    do {                                                                                                   \
        LOAD(4, (x), STRIDE);                                                                              \
        LOAD(5, (x) + ROWS * STRIDE, STRIDE);                                                              \
        LOAD(6, (w), 64);                                                                                  \
        LOAD(7, (w) + 1024, 64);                                                                           \
        PRODUCT(tdpbuud, 0, 4, 6);                                                                         \
        PRODUCT(tdpbusd, 1, 4, 7);                                                                         \
        PRODUCT(tdpbsud, 1, 5, 6);                                                                         \
        PRODUCT(tdpbssd, 2, 5, 7);                                                                         \
    } while (0)

static int32_t sums[3][16][16] __attribute__((aligned(64)));
static uint8_t *acts;    /* alo then ahi: ROWS rows of STRIDE bytes each */
static uint8_t *weights; /* TILES tiles of SUPERS superblocks: 4 chunks x 2 KB */

static double now(void) { return seconds_on(CLOCK_MONOTONIC); }

static inline void step(const uint8_t *x, const uint8_t *w) {
    ZERO(0);
    ZERO(1);
    ZERO(2);
    for (int c = 0; c < 4; c++) CHUNK(x + 64 * c, w + 2048 * c);
    STORE(0, sums[0]);
    STORE(1, sums[1]);
    STORE(2, sums[2]);
}

/* Each measure: returns nanoseconds per unit over `n` units. */
static double loads(long n) {
    const double t0 = now();
    for (long i = 0; i < n; i++) LOAD(4, acts, 64);
    return (now() - t0) / (double)n * 1e9;
}

static double products(long n) {
    const double t0 = now();
    for (long i = 0; i < n; i++) {
        PRODUCT(tdpbusd, 0, 4, 6);
        PRODUCT(tdpbusd, 1, 4, 7);
        PRODUCT(tdpbusd, 2, 5, 6);
        PRODUCT(tdpbusd, 3, 5, 7);
    }
    return (now() - t0) / (double)n / 4 * 1e9;
}

static double chunks(long n) {
    const double t0 = now();
    for (long i = 0; i < n; i++) CHUNK(acts, weights);
    return (now() - t0) / (double)n * 1e9;
}

static double steps_l1(long n) {
    const double t0 = now();
    for (long i = 0; i < n; i++) step(acts, weights);
    return (now() - t0) / (double)n * 1e9;
}

/* The pass's order over the set: for 16 rows, superblock by superblock, each over the
 * tiles; `pass`: the rows advance through the 512 rows' activations (else the first 16
 * rows' only). */
static double steps_set(long n, int pass) {
    long done = 0;
    const double t0 = now();
    while (done < n)
        for (int64_t r0 = 0; r0 < ROWS && done < n; r0 += 16)
            for (int t = 0; t < SUPERS; t++)
                for (int v = 0; v < TILES; v++, done++)
                    step(acts + (pass ? r0 : 0) * STRIDE + 256 * t, weights + ((int64_t)v * SUPERS + t) * 8192);
    return (now() - t0) / (double)done * 1e9;
}

int main(int argc, char **argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 5;
    if (rounds < 1) {
        fprintf(stderr, "usage: %s [ROUNDS]\n", argv[0]);
        return 1;
    }
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        fprintf(stderr, "amx_roof: the kernel grants no AMX tile data here (no AMX, or not permitted)\n");
        return 2;
    }
    acts = aligned_alloc(4096, (size_t)2 * ROWS * STRIDE);
    weights = aligned_alloc(4096, (size_t)TILES * SUPERS * 8192);
    memset(acts, 3, (size_t)2 * ROWS * STRIDE);
    memset(weights, 5, (size_t)TILES * SUPERS * 8192);
    amx_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));

    static const struct {
        const char *name, *unit;
        int chunks_per_unit; /* 0: no MAC rate */
    } rows[] = {{"load", "load", 0},          {"product", "product", 0},   {"chunk", "chunk", 1},
                {"step", "step", 4},          {"step-weights", "step", 4}, {"step-pass", "step", 4}};
    enum { N_ROWS = sizeof rows / sizeof rows[0] };
    double ns[N_ROWS][64];
    for (int r = 0; r < rounds && r < 64; r++) {
        ns[0][r] = loads(2000000);
        ns[1][r] = products(500000);
        ns[2][r] = chunks(500000);
        ns[3][r] = steps_l1(100000);
        ns[4][r] = steps_set(100000, 0);
        ns[5][r] = steps_set(100000, 1);
    }
    __asm__ volatile("tilerelease" ::: "memory");

    printf("AMX tile unit, 1 thread, median of %d rounds\n%-14s %8s %-8s %14s\n", rounds, "pattern", "ns", "per",
           "GMAC/s (pass)");
    char json[2048];
    int at = snprintf(json, sizeof json, "{\"rounds\": %d, \"ns\": {", rounds);
    for (int i = 0; i < N_ROWS; i++) {
        const double med = median(ns[i], rounds < 64 ? rounds : 64);
        const double gmac = rows[i].chunks_per_unit ? 16384.0 * rows[i].chunks_per_unit / med : 0.0;
        if (gmac > 0)
            printf("%-14s %8.2f %-8s %14.0f\n", rows[i].name, med, rows[i].unit, gmac);
        else
            printf("%-14s %8.2f %-8s %14s\n", rows[i].name, med, rows[i].unit, "-");
        at += snprintf(json + at, sizeof json - (size_t)at, "%s\"%s\": %.3f", i ? ", " : "", rows[i].name, med);
    }
    snprintf(json + at, sizeof json - (size_t)at, "}}");
    printf("\n%s\n", json);
    free(acts);
    free(weights);
    return 0;
}
