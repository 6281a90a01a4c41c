/*
 * The cost of one `fast` GGUF matmul (gguf_matmul.c's bargein_gguf_matmul) on random
 * but valid blocks, one thread, for comparing two builds of the kernels (issue 33: the K
 * chain's per-32 activation step). Two ways to read it, both independent of load:
 *
 * - instructions, with one library under callgrind (valgrind 3.19 has no AVX-512, so
 *   the library must be built without it, and only the plain C and AVX2 paths counted):
 *
 *     valgrind --tool=callgrind --toggle-collect=bargein_gguf_matmul --callgrind-out-file=/dev/null \
 *         /tmp/k_chain_cost LIB.so Q4_K 2048 2048 1 1 1
 *
 *   prints nothing of interest itself; callgrind's "Collected" line is the count;
 * - a same-run ratio of two libraries (before, after), calls interleaved, best of the
 *   repeats each (the VNNI path, which callgrind cannot run):
 *
 *     /tmp/k_chain_cost BEFORE.so Q4_K 2048 2048 32 2 50 AFTER.so
 *
 * Build: cc -O2 -o /tmp/k_chain_cost bench/k_chain_cost.c -ldl
 * Arguments: LIB TYPE N K ROWS ISA [REPEATS] [LIB_B]; TYPE one of Q4_K Q5_K Q6_K Q4_0 Q8_0;
 * ISA 0 plain C, 1 AVX2, 2 AVX-512 VNNI (the numbers gguf_matmul.c knows them by).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gguf_ab.h"

typedef bargein_qseg_t seg_t;
typedef bargein_qmat_t mat_t;

static double now(void) { return seconds_on(CLOCK_MONOTONIC); }

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s LIB TYPE N K ROWS ISA [REPEATS] [LIB_B]\n", argv[0]);
        return 2;
    }
    const type_t *ty = type_named(argv[2]);
    const int n = atoi(argv[3]), k = atoi(argv[4]), m = atoi(argv[5]), isa = atoi(argv[6]);
    const int repeats = argc > 7 ? atoi(argv[7]) : 1;
    matmul_fn fns[2] = {load_matmul(argv[1]), argc > 8 ? load_matmul(argv[8]) : NULL};
    if (!ty || !fns[0] || n < 1 || m < 1 || k % ty->qk) return 2;
    const int64_t row_bytes = (int64_t)k / ty->qk * ty->bytes, matrix = row_bytes * n;
    uint8_t *data = malloc((size_t)matrix);
    float *x = malloc(sizeof(float) * (size_t)k * m), *y = malloc(sizeof(float) * (size_t)n * m);
    srand(1);
    for (int64_t i = 0; i < matrix; i++) data[i] = (uint8_t)rand();
    for (int64_t b = 0; b < matrix / ty->bytes; b++)
        for (int f = 0; f < 2; f++)
            if (ty->f16_at[f] >= 0) {
                const uint16_t half = (uint16_t)(0x1800 + (rand() & 0xff)); /* about 2^-9 .. 2^-8 */
                memcpy(data + b * ty->bytes + ty->f16_at[f], &half, 2);
            }
    /* activations with a few large channels, as ffn_down's input has */
    for (int i = 0; i < k * m; i++) x[i] = ((float)rand() / (float)RAND_MAX - 0.5f) * (i % 97 == 3 ? 40.0f : 1.0f);
    const seg_t seg = {ty->type, data, row_bytes, n, NULL};
    const mat_t mat = {&seg, 1, n, k};
    double best[2] = {1e30, 1e30};
    for (int rep = 0; rep < repeats; rep++)
        for (int f = 0; f < 2 && fns[f]; f++) {
            const double t0 = now();
            const int status = fns[f](x, m, &mat, y, 0, 1, isa);
            const double t = now() - t0;
            if (status) {
                fprintf(stderr, "status %d\n", status);
                return 1;
            }
            best[f] = t < best[f] ? t : best[f];
        }
    printf("%s %dx%d rows %d isa %d: %.3f ms", ty->name, n, k, m, isa, best[0] * 1e3);
    if (fns[1]) printf(" | B %.3f ms (B / A %.3f)", best[1] * 1e3, best[1] / best[0]);
    printf("\n");
    return 0;
}
