/*
 * Two builds of the kernels' library, A and B, timed on the many-row `fast` GGUF matmul
 * (gguf_matmul.c's tile passes) over the four matrix shapes of a Llama-3.2-1B layer (q/o
 * 2048 x 2048, k/v 512 x 2048, gate/up 8192 x 2048, down 2048 x 8192), interleaved in one
 * process: a same-run ratio that survives a loaded machine better than two runs do
 * (issue 33, the 32-stream and prefill targets).
 *
 * Each call reads one of enough copies of the matrix (>= 128 MB in all) that the
 * weights come from memory, as in a decode step of a 1B model, and A and B alternate
 * call by call on different copies. Per round, each side's time for one call of every
 * copy; the result is the median of the rounds' B / A ratios (and each side's median ms
 * per call). Random bytes are valid blocks; the float16 scales are set to small values.
 * Both sides' outputs are compared bit for bit on the first copy (a build that changes
 * the bits is reported, not timed, unless AB_DIFFERENT is set in the environment: for a
 * change meant to round differently).
 *
 *   cc -O2 -o /tmp/gemm_tile_ab bench/gemm_tile_ab.c -ldl -lm
 *   /tmp/gemm_tile_ab A.so B.so TYPE ROWS [ISA] [ROUNDS] [THREADS] [N K]
 *
 * TYPE: Q4_K Q5_K Q6_K Q4_0 Q8_0 Q4_1 IQ4_NL Q5_0 Q5_1; ROWS: 32 (a 32-stream decode step), 512 (a prefill
 * chunk); ISA: 1 AVX2, 2 AVX-512 VNNI (default 2); THREADS default 1; N K: one shape
 * instead of the layer's five. Build A and B with bargein/kernels' flags (native.py):
 * cc -O3 -std=c11 -shared -fPIC -pthread -ffp-contract=off -march=native -fopenmp
 * -o X.so bargein/kernels/[a-z]*.c -lm (the .c files), from each tree.
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
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gguf_ab.h"

static double now(void) { return seconds_on(CLOCK_MONOTONIC); }

/* One shape: returns B / A (median over rounds), prints the line. */
static double shape(matmul_fn fa, matmul_fn fb, const type_t *ty, int n, int k, int m, int isa, int rounds,
                    int threads) {
    const int64_t row_bytes = (int64_t)k / ty->qk * ty->bytes, matrix = row_bytes * n;
    const int copies = (int)(128e6 / (double)matrix) + 2;
    uint8_t *data = aligned_alloc(64, (size_t)((matrix * copies + 63) / 64 * 64));
    float *x = malloc(sizeof(float) * (size_t)k * m);
    float *ya = malloc(sizeof(float) * (size_t)n * m), *yb = malloc(sizeof(float) * (size_t)n * m);
    double *ta = malloc(sizeof(double) * rounds), *tb = malloc(sizeof(double) * rounds),
           *ratio = malloc(sizeof(double) * rounds);
    srand(1);
    for (int64_t i = 0; i < matrix * copies; i++) data[i] = (uint8_t)rand();
    for (int64_t b = 0; b < matrix * copies / ty->bytes; b++)
        for (int f = 0; f < 2; f++)
            if (ty->f16_at[f] >= 0) {
                const uint16_t half = (uint16_t)(0x1800 + (rand() & 0xff));
                memcpy(data + b * ty->bytes + ty->f16_at[f], &half, 2);
            }
    for (int i = 0; i < k * m; i++) x[i] = ((float)rand() / (float)RAND_MAX - 0.5f) * (i % 97 == 3 ? 40.0f : 1.0f);
    const bargein_qseg_t first = {ty->type, data, row_bytes, n, NULL};
    const bargein_qmat_t w0 = {&first, 1, n, k};
    if (fa(x, m, &w0, ya, 0, threads, isa) || fb(x, m, &w0, yb, 0, threads, isa)) {
        fprintf(stderr, "a call failed (isa %d not here?)\n", isa);
        exit(1);
    }
    if (memcmp(ya, yb, sizeof(float) * (size_t)n * m)) {
        printf("%s %dx%d rows %d: A and B DIFFER in bits\n", ty->name, n, k, m);
        if (!getenv("AB_DIFFERENT")) exit(1); /* set where a change of the activations' rounding is meant */
    }
    for (int r = 0; r < rounds; r++) {
        ta[r] = tb[r] = 0;
        for (int c = 0; c < copies; c++)
            for (int side = 0; side < 2; side++) {
                /* B reads the copy half way round from A's: neither finds the other's in cache */
                const bargein_qseg_t seg = {ty->type, data + (int64_t)((c + side * copies / 2) % copies) * matrix,
                                            row_bytes, n, NULL};
                const bargein_qmat_t w = {&seg, 1, n, k};
                const double t0 = now();
                (side ? fb : fa)(x, m, &w, side ? yb : ya, 0, threads, isa);
                const double t = now() - t0;
                if (side) tb[r] += t;
                else ta[r] += t;
            }
        ratio[r] = tb[r] / ta[r];
    }
    const double q = median(ratio, rounds), ma = median(ta, rounds) / copies, mb = median(tb, rounds) / copies;
    printf("%s %5dx%-5d rows %3d isa %d: A %8.3f ms  B %8.3f ms  B/A %.3f  (A %.0f GMAC/s)\n", ty->name, n, k, m,
           isa, 1e3 * ma, 1e3 * mb, q, (double)n * k * m / ma / 1e9);
    free(data), free(x), free(ya), free(yb), free(ta), free(tb), free(ratio);
    return q;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s A.so B.so TYPE ROWS [ISA] [ROUNDS] [THREADS] [N K]\n", argv[0]);
        return 2;
    }
    const type_t *ty = type_named(argv[3]);
    const int m = atoi(argv[4]), isa = argc > 5 ? atoi(argv[5]) : 2, rounds = argc > 6 ? atoi(argv[6]) : 5;
    const int threads = argc > 7 ? atoi(argv[7]) : 1;
    matmul_fn fa = load_matmul(argv[1]), fb = load_matmul(argv[2]);
    if (!ty || !fa || !fb || m < 1 || rounds < 1) return 2;
    static const int LAYER[4][2] = {{2048, 2048}, {512, 2048}, {8192, 2048}, {2048, 8192}};
    const int one = argc > 9;
    double product = 1;
    int count = 0;
    for (int s = 0; s < (one ? 1 : 4); s++) {
        const int n = one ? atoi(argv[8]) : LAYER[s][0], k = one ? atoi(argv[9]) : LAYER[s][1];
        if (k % ty->qk) continue;
        product *= shape(fa, fb, ty, n, k, m, isa, rounds, threads);
        count++;
    }
    if (count > 1) {
        printf("geometric mean B/A over the shapes: %.3f\n", pow(product, 1.0 / count));
    }
    return 0;
}
