/*
 * One-row `fast` GGUF matmuls of a whole decode step of llama1b.Q4_K_M's shapes (Llama-3.2-1B:
 * 16 layers of QKV, O, gate+up and down, and the tied Q6_K head 49152 x 2048), each matrix
 * its own random but valid blocks, so that every call streams its weights from memory as a
 * real decode step does (~630 MB, far beyond any cache; k_chain_cost.c times one matrix
 * that stays in L3). Two libraries (before, after) are called in turn, round by round, and
 * the per-kind medians and the B / A ratio of each round are printed: a same-run ratio that
 * holds on a loaded machine better than either time alone.
 *
 *   cc -O2 -o /tmp/gemv_stream bench/gemv_stream.c -ldl -lm
 *   /tmp/gemv_stream A.so [B.so] [--threads 2] [--isa 2] [--rounds 9] [--layers 16] [--cpu]
 *
 * --cpu times the calling thread's CPU time instead of the wall clock: with --threads 1 on
 * a loaded machine it leaves out the time the thread waited for a core (not the time its
 * loads waited for memory, which other programs' traffic still lengthens).
 * ISA 0 plain C, 1 AVX2, 2 AVX-512 VNNI (gguf_matmul.c's numbers). The libraries are the
 * cached bargein_kernels_*.so of each tree (or cc -O3 -march=native -fopenmp -shared ...).
 *
 * Two threads or more: each library has its own thread pool (parallel.c), and the two
 * pools' workers spin against each other between calls; a pool that sees its threads
 * descheduled falls back to sleeping workers (one thread's speed) for a while, so a
 * 2-thread ratio of two libraries in one process can be far off (one SmolLM2 A/B read
 * 1.008 one way and 0.481 with the order swapped). For threads, time each library alone
 * in its own process (pass the same .so as A and B) and alternate the processes.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gguf_ab.h"

enum { Q4_K = 12, Q6_K = 14 };
enum { QKV, O, GATE_UP, DOWN4, DOWN6, HEAD, KINDS };
static const char *KIND_NAMES[KINDS] = {"qkv", "o", "gate_up", "down Q4_K", "down Q6_K", "head Q6_K"};

typedef struct {
    bargein_qseg_t segs[3];
    bargein_qmat_t mat;
    int kind;
    int64_t bytes;
} matrix_t;

static clockid_t clock_kind = CLOCK_MONOTONIC;

static double now(void) { return seconds_on(clock_kind); }

/* rows x k of `type`'s blocks, random quants and small float16 steps */
static bargein_qseg_t segment(int type, int64_t rows, int64_t k) {
    const int bytes = type == Q4_K ? 144 : 210;
    const int64_t row_bytes = k / 256 * bytes, total = row_bytes * rows;
    uint8_t *data = malloc((size_t)total);
    for (int64_t i = 0; i < total; i++) data[i] = (uint8_t)rand();
    for (int64_t b = 0; b < total / bytes; b++) {
        const int at[2] = {type == Q4_K ? 0 : 208, type == Q4_K ? 2 : -1};
        for (int f = 0; f < 2; f++)
            if (at[f] >= 0) {
                const uint16_t half = (uint16_t)(0x1800 + (rand() & 0xff));
                memcpy(data + b * bytes + at[f], &half, 2);
            }
    }
    return (bargein_qseg_t){type, data, row_bytes, rows, NULL};
}

static void add(matrix_t *m, int kind, const int *types, const int64_t *rows, int segs, int64_t k) {
    m->kind = kind;
    m->bytes = 0;
    int64_t n = 0;
    for (int s = 0; s < segs; s++) {
        m->segs[s] = segment(types[s], rows[s], k);
        m->bytes += m->segs[s].row_bytes * rows[s];
        n += rows[s];
    }
    m->mat = (bargein_qmat_t){m->segs, segs, n, k};
}

static int by_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const char *libs[2] = {NULL, NULL};
    int threads = 2, isa = 2, rounds = 9, layers = 16;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--isa") && i + 1 < argc) isa = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc) layers = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--cpu")) clock_kind = CLOCK_THREAD_CPUTIME_ID;
        else if (!libs[0]) libs[0] = argv[i];
        else libs[1] = argv[i];
    }
    if (!libs[0] || rounds < 1 || rounds > 99 || layers < 1) {
        fprintf(stderr, "usage: %s A.so [B.so] [--threads T] [--isa I] [--rounds R] [--layers L] [--cpu]\n", argv[0]);
        return 2;
    }
    const int sides = libs[1] ? 2 : 1;
    matmul_fn fns[2] = {load_matmul(libs[0]), libs[1] ? load_matmul(libs[1]) : NULL};
    srand(1);
    const int count = 4 * layers + 1;
    matrix_t *ms = calloc((size_t)count, sizeof(matrix_t));
    int at = 0;
    for (int l = 0; l < layers; l++) { /* as llama-quantize's Q4_K_M: attn_v and ffn_down Q6_K on every other layer */
        const int q6 = l % 2 == 0;
        add(&ms[at++], QKV, (int[]){Q4_K, Q4_K, q6 ? Q6_K : Q4_K}, (int64_t[]){2048, 512, 512}, 3, 2048);
        add(&ms[at++], O, (int[]){Q4_K}, (int64_t[]){2048}, 1, 2048);
        add(&ms[at++], GATE_UP, (int[]){Q4_K, Q4_K}, (int64_t[]){8192, 8192}, 2, 2048);
        add(&ms[at++], q6 ? DOWN6 : DOWN4, (int[]){q6 ? Q6_K : Q4_K}, (int64_t[]){2048}, 1, 8192);
    }
    add(&ms[at++], HEAD, (int[]){Q6_K}, (int64_t[]){49152}, 1, 2048);
    float *x = malloc(sizeof(float) * 8192), *y = malloc(sizeof(float) * 49152);
    for (int i = 0; i < 8192; i++) x[i] = ((float)rand() / (float)RAND_MAX - 0.5f) * (i % 97 == 3 ? 40.0f : 1.0f);
    double bytes[KINDS] = {0};
    for (int i = 0; i < count; i++) bytes[ms[i].kind] += (double)ms[i].bytes;
    static double t[2][KINDS + 1][99];
    for (int round = 0; round < rounds + 1; round++) /* round 0 warms up */
        for (int s = 0; s < sides; s++) {
            double sum[KINDS] = {0};
            for (int i = 0; i < count; i++) {
                const double t0 = now();
                if (fns[s](x, 1, &ms[i].mat, y, 0, threads, isa)) {
                    fprintf(stderr, "matmul failed\n");
                    return 1;
                }
                sum[ms[i].kind] += now() - t0;
            }
            if (round == 0) continue;
            double all = 0;
            for (int kd = 0; kd < KINDS; kd++) t[s][kd][round - 1] = sum[kd], all += sum[kd];
            t[s][KINDS][round - 1] = all;
        }
    printf("one-row matmuls of a decode step, %d layers, %d threads, isa %d, medians of %d rounds\n", layers, threads,
           isa, rounds);
    printf("%-10s %9s %8s", "kind", "MB", "A ms");
    if (sides == 2) printf(" %8s %9s", "B ms", "B/A");
    printf(" %8s\n", "A GB/s");
    for (int kd = 0; kd <= KINDS; kd++) {
        double med[2], ratio[99];
        for (int s = 0; s < sides; s++) {
            double v[99];
            memcpy(v, t[s][kd], sizeof(double) * (size_t)rounds);
            qsort(v, (size_t)rounds, sizeof(double), by_double);
            med[s] = v[rounds / 2];
        }
        for (int r = 0; r < rounds && sides == 2; r++) ratio[r] = t[1][kd][r] / t[0][kd][r];
        if (sides == 2) qsort(ratio, (size_t)rounds, sizeof(double), by_double);
        double mb = 0;
        if (kd < KINDS) mb = bytes[kd] / 1e6;
        else
            for (int i = 0; i < KINDS; i++) mb += bytes[i] / 1e6;
        printf("%-10s %9.1f %8.3f", kd < KINDS ? KIND_NAMES[kd] : "step", mb, med[0] * 1e3);
        if (sides == 2) printf(" %8.3f %9.3f", med[1] * 1e3, ratio[rounds / 2]);
        printf(" %8.2f\n", mb / 1e3 / med[0]);
    }
    return 0;
}
