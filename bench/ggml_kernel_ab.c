/*
 * One GGUF block matrix, the same blocks, bargein's kernel (gguf_matmul.c, its AVX2 and
 * its AVX-512 VNNI path) against llama.cpp's ggml-cpu dot product for the type
 * (ggml_vec_dot_<type>_q8_K / _q8_0, activations quantized by its quantize_row_*), one
 * thread, interleaved in one process: a same-run ratio for the kernels alone (issue 33).
 *
 * Each call reads one of enough copies of the matrix (>= 96 MB) that the weights stream
 * from memory, as in a decode step, and the two sides never read the copy the other has
 * just read; the best of the repeats is kept for each side (colleagues share the cores).
 * ggml here is the plain per-row dot product: llama.cpp's runtime may instead repack
 * Q4_K/Q4_0/IQ4_NL into interleaved rows at load (its CPU "repack" buffers, a private copy
 * of the weights) and use those GEMV kernels, so bench/bench_models.py stays the
 * end-to-end measure. Random bytes are valid blocks; the float16 scales are set to small
 * finite values.
 *
 *   cc -O2 -o /tmp/ggml_kernel_ab bench/ggml_kernel_ab.c -ldl
 *   LD_LIBRARY_PATH=/work/llamacpp/build/bin /tmp/ggml_kernel_ab \
 *       $BARGEIN_CACHE_DIR/kernels/bargein_kernels_*.so Q4_K 2048 2048 [repeats] [rows]
 *
 * Types: Q4_0 Q8_0 Q4_K Q5_K Q6_K. Prints milliseconds per call and ggml / bargein (above
 * 1: bargein faster).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../bargein/kernels/gguf_matrix.h" /* the matrix as the library takes it */

typedef bargein_qseg_t seg_t;
typedef bargein_qmat_t mat_t;
typedef int (*matmul_fn)(const float *, int64_t, const mat_t *, float *, int, int, int);
typedef void (*vec_dot_fn)(int, float *, size_t, const void *, size_t, const void *, size_t, int);
typedef void (*quantize_fn)(const float *, void *, int64_t);

typedef struct {
    const char *name, *dot, *quantize;
    int type, qk, bytes, f16_at[2];
} type_t;

static const type_t TYPES[] = {
    {"Q4_0", "ggml_vec_dot_q4_0_q8_0", "quantize_row_q8_0", 2, 32, 18, {0, -1}},
    {"Q8_0", "ggml_vec_dot_q8_0_q8_0", "quantize_row_q8_0", 8, 32, 34, {0, -1}},
    {"Q4_K", "ggml_vec_dot_q4_K_q8_K", "quantize_row_q8_K", 12, 256, 144, {0, 2}},
    {"Q5_K", "ggml_vec_dot_q5_K_q8_K", "quantize_row_q8_K", 13, 256, 176, {0, 2}},
    {"Q6_K", "ggml_vec_dot_q6_K_q8_K", "quantize_row_q8_K", 14, 256, 210, {208, -1}},
};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s BARGEIN_KERNELS.so TYPE N K [repeats] [rows]\n", argv[0]);
        return 2;
    }
    const type_t *ty = NULL;
    for (size_t i = 0; i < sizeof(TYPES) / sizeof(TYPES[0]); i++)
        if (!strcmp(argv[2], TYPES[i].name)) ty = &TYPES[i];
    void *ours = dlopen(argv[1], RTLD_NOW), *ggml = dlopen("libggml-cpu.so", RTLD_NOW);
    if (!ty || !ours || !ggml) {
        fprintf(stderr, "%s\n", !ty ? "unknown type" : dlerror());
        return 2;
    }
    const matmul_fn matmul = (matmul_fn)dlsym(ours, "bargein_gguf_matmul");
    const vec_dot_fn dot = (vec_dot_fn)dlsym(ggml, ty->dot);
    const quantize_fn quantize = (quantize_fn)dlsym(ggml, ty->quantize);
    const int n = atoi(argv[3]), k = atoi(argv[4]), repeats = argc > 5 ? atoi(argv[5]) : 10;
    const int m = argc > 6 ? atoi(argv[6]) : 1;
    if (!matmul || !dot || !quantize || n < 1 || k % ty->qk) return 2;
    const int64_t row_bytes = (int64_t)k / ty->qk * ty->bytes, matrix = row_bytes * n;
    const int copies = (int)(96e6 / (double)matrix) + 2;
    uint8_t *data = aligned_alloc(64, (size_t)((matrix * copies + 63) / 64 * 64));
    float *x = malloc(sizeof(float) * (size_t)k * m), *y = malloc(sizeof(float) * (size_t)n * m);
    uint8_t *xq = malloc((size_t)k * 2 + 4096);
    srand(1);
    for (int64_t i = 0; i < matrix * copies; i++) data[i] = (uint8_t)rand();
    for (int64_t b = 0; b < matrix * copies / ty->bytes; b++)
        for (int f = 0; f < 2; f++)
            if (ty->f16_at[f] >= 0) {
                const uint16_t half = (uint16_t)(0x1800 + (rand() & 0xff)); /* about 2^-9 .. 2^-8 */
                memcpy(data + b * ty->bytes + ty->f16_at[f], &half, 2);
            }
    for (int i = 0; i < k * m; i++) x[i] = (float)rand() / (float)RAND_MAX - 0.5f;
    double best[3] = {1e9, 1e9, 1e9};
    for (int rep = 0; rep < repeats; rep++)
        for (int c = 0; c < copies; c++) {
            const uint8_t *w = data + (int64_t)c * matrix;
            double t0 = now();
            for (int r = 0; r < m; r++) {
                quantize(x + (int64_t)r * k, xq, k);
                for (int j = 0; j < n; j++) dot(k, y + j, 0, w + j * row_bytes, 0, xq, 0, 1);
            }
            double t = now() - t0;
            best[0] = t < best[0] ? t : best[0];
            for (int isa = 1; isa <= 2; isa++) { /* 1: AVX2, 2: AVX-512 VNNI; each on another copy */
                const seg_t seg = {ty->type, data + (int64_t)((c + isa * copies / 3) % copies) * matrix, row_bytes, n,
                                   NULL};
                const mat_t mat = {&seg, 1, n, k};
                t0 = now();
                const int status = matmul(x, m, &mat, y, 0, 1, isa);
                t = now() - t0;
                if (status == 0 && t < best[isa]) best[isa] = t;
            }
        }
    printf("%s %dx%d rows %d: ggml %.3f ms | bargein AVX2 %.3f ms (ggml/bargein %.2f)", ty->name, n, k, m,
           best[0] * 1e3, best[1] * 1e3, best[0] / best[1]);
    if (best[2] < 1e9) printf(" | VNNI %.3f ms (%.2f)", best[2] * 1e3, best[0] / best[2]);
    printf("\n");
    return 0;
}
