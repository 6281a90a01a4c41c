/*
 * One-row 16-bit matmul (a decode step's y = x @ W.T over F16 or BF16 rows) against the
 * memory it reads, one thread, interleaved in one process: a same-run measure of how close
 * half_matmul.c gets to reading its weights at memory speed (issue 33's F16 file).
 *
 * Per call, in turn, each on its own copy of the matrix (enough copies, >= 192 MB, that the
 * weights stream from memory as in a decode step, and no side reads what another just read):
 *   read     a plain AVX2 loop summing the matrix's bytes (the one-core read ceiling);
 *   ggml     llama.cpp's ggml-cpu: x converted to the weight type once, then
 *            ggml_vec_dot_f16 / _bf16 per row (its CPU path for an F16/BF16 matrix);
 *   AVX2, AVX-512   bargein_gguf_matmul (half_matmul.c's paths), m rows of x.
 * The best of the repeats is kept for each (colleagues share the cores); GB/s is the
 * matrix's bytes over that time. Above 1.00 in "vs ggml": bargein faster.
 *
 *   cc -O2 -mavx2 -o /tmp/half_matmul_ab bench/half_matmul_ab.c -ldl
 *   LD_LIBRARY_PATH=/work/llamacpp/build/bin /tmp/half_matmul_ab \
 *       $BARGEIN_CACHE_DIR/kernels/bargein_kernels_*.so F16 2048 8192 [repeats] [rows]
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../bargein/kernels/gguf_matrix.h" /* the matrix as the library takes it */

typedef bargein_qseg_t seg_t;
typedef bargein_qmat_t mat_t;
typedef int (*matmul_fn)(const float *, int64_t, const mat_t *, float *, int, int, int);
typedef int (*half_fn)(const float *, int64_t, const mat_t *, float *, int, int); /* a library of half_matmul.c alone */
typedef void (*vec_dot_fn)(int, float *, size_t, const void *, size_t, const void *, size_t, int);
typedef void (*convert_fn)(const float *, void *, int64_t);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

__attribute__((target("avx2"), noinline)) static uint64_t read_all(const uint8_t *p, int64_t bytes) {
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    for (int64_t i = 0; i + 128 <= bytes; i += 128) {
        a = _mm256_add_epi64(a, _mm256_load_si256((const __m256i *)(p + i)));
        b = _mm256_add_epi64(b, _mm256_load_si256((const __m256i *)(p + i + 32)));
        c = _mm256_add_epi64(c, _mm256_load_si256((const __m256i *)(p + i + 64)));
        d = _mm256_add_epi64(d, _mm256_load_si256((const __m256i *)(p + i + 96)));
    }
    a = _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d));
    return (uint64_t)_mm256_extract_epi64(a, 0) + (uint64_t)_mm256_extract_epi64(a, 3);
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s BARGEIN_KERNELS.so F16|BF16 N K [repeats] [rows]\n", argv[0]);
        return 2;
    }
    const int bf16 = !strcmp(argv[2], "BF16");
    void *ours = dlopen(argv[1], RTLD_NOW), *ggml = dlopen("libggml-cpu.so", RTLD_NOW);
    if (!ours || !ggml) {
        fprintf(stderr, "%s\n", dlerror());
        return 2;
    }
    const matmul_fn matmul = (matmul_fn)dlsym(ours, "bargein_gguf_matmul");
    const half_fn half = (half_fn)dlsym(ours, "bargein_half_matmul");
    const vec_dot_fn dot = (vec_dot_fn)dlsym(ggml, bf16 ? "ggml_vec_dot_bf16" : "ggml_vec_dot_f16");
    const convert_fn convert = (convert_fn)dlsym(ggml, bf16 ? "ggml_cpu_fp32_to_bf16" : "ggml_cpu_fp32_to_fp16");
    const int n = atoi(argv[3]), k = atoi(argv[4]), repeats = argc > 5 ? atoi(argv[5]) : 10;
    const int m = argc > 6 ? atoi(argv[6]) : 1;
    if ((!matmul && !half) || !dot || !convert || n < 1 || k < 8) return 2;
    const int64_t row_bytes = 2 * (int64_t)k, matrix = (row_bytes * n + 127) / 128 * 128;
    const int copies = (int)(192e6 / (double)matrix) + 4;
    uint8_t *data = aligned_alloc(64, (size_t)(matrix * copies));
    float *x = malloc(sizeof(float) * (size_t)k * m), *y = malloc(sizeof(float) * (size_t)n * m);
    uint16_t *xh = malloc(2 * (size_t)k + 64);
    srand(1);
    for (int64_t i = 0; i < matrix * copies / 2; i++) /* finite values of a layer's spread */
        ((uint16_t *)data)[i] = bf16 ? (uint16_t)(0x3c00 + (rand() & 0x1ff) + ((rand() & 1) << 15))
                                     : (uint16_t)(0x2000 + (rand() & 0xfff) + ((rand() & 1) << 15));
    for (int i = 0; i < k * m; i++) x[i] = (float)rand() / (float)RAND_MAX - 0.5f;
    double best[4] = {1e9, 1e9, 1e9, 1e9};
    uint64_t sink = 0;
    for (int rep = 0; rep < repeats; rep++)
        for (int c = 0; c < copies; c++) {
            const uint8_t *w[4];
            for (int s = 0; s < 4; s++) w[s] = data + (int64_t)((c + s * copies / 4) % copies) * matrix;
            double t0 = now();
            sink += read_all(w[0], row_bytes * n);
            double t = now() - t0;
            best[0] = t < best[0] ? t : best[0];
            t0 = now();
            for (int r = 0; r < m; r++) {
                convert(x + (int64_t)r * k, xh, k);
                for (int j = 0; j < n; j++) dot(k, y + j, 0, w[1] + j * row_bytes, 0, xh, 0, 1);
            }
            t = now() - t0;
            best[1] = t < best[1] ? t : best[1];
            for (int isa = 1; isa <= 2; isa++) {
                const seg_t seg = {bf16 ? 30 : 1, w[1 + isa], row_bytes, n, NULL};
                const mat_t mat = {&seg, 1, n, k};
                t0 = now();
                const int status = matmul ? matmul(x, m, &mat, y, 0, 1, isa) : half(x, m, &mat, y, 1, isa);
                t = now() - t0;
                if (status == 0 && t < best[1 + isa]) best[1 + isa] = t;
            }
        }
    const double gb = (double)(row_bytes * n) / 1e9;
    printf("%s %dx%d rows %d: read %.3f ms (%.1f GB/s) | ggml %.3f ms (%.1f GB/s) | bargein AVX2 %.3f ms "
           "(%.1f GB/s, vs ggml %.2f, vs read %.2f)",
           argv[2], n, k, m, best[0] * 1e3, gb / best[0], best[1] * 1e3, gb / best[1], best[2] * 1e3, gb / best[2],
           best[1] / best[2], best[0] / best[2]);
    if (best[3] < 1e9)
        printf(" | AVX-512 %.3f ms (%.1f GB/s, vs ggml %.2f, vs read %.2f)", best[3] * 1e3, gb / best[3],
               best[1] / best[3], best[0] / best[3]);
    printf("%s\n", sink == 42 ? " " : "");
    return 0;
}
