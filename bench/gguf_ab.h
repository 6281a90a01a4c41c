/* What the kernel drivers of bench/ share (gemm_tile_ab.c, gemv_stream.c, k_chain_cost.c,
 * attention_ab.c): the library's matmul entry point loaded from a built kernel library,
 * a clock, a median, and the block types they time. Each driver includes it once; nothing
 * here is part of bargein. */
#ifndef BARGEIN_BENCH_GGUF_AB_H
#define BARGEIN_BENCH_GGUF_AB_H

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../bargein/kernels/gguf_matrix.h" /* the matrix as the library takes it */

/* bargein_gguf_matmul(x, m, w, y, exact, threads, isa) */
typedef int (*matmul_fn)(const float *, int64_t, const bargein_qmat_t *, float *, int, int, int);

/* A block type: ggml's type id, values per block, bytes per block, and the byte offsets
 * of its float16 scale fields (-1: none) that a random block must hold finite. */
typedef struct {
    const char *name;
    int type, qk, bytes, f16_at[2];
} type_t;

static const type_t TYPES[] __attribute__((unused)) = {
    {"Q4_0", 2, 32, 18, {0, -1}},   {"Q8_0", 8, 32, 34, {0, -1}},     {"Q4_K", 12, 256, 144, {0, 2}},
    {"Q5_K", 13, 256, 176, {0, 2}}, {"Q6_K", 14, 256, 210, {208, -1}}, {"Q4_1", 3, 32, 20, {0, 2}},
    {"IQ4_NL", 20, 32, 18, {0, -1}}, {"Q5_0", 6, 32, 22, {0, -1}},   {"Q5_1", 7, 32, 24, {0, 2}},
};

/* The block type called `name` (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, Q4_1, IQ4_NL, Q5_0, Q5_1), or NULL. */
static inline const type_t *type_named(const char *name) {
    for (size_t i = 0; i < sizeof(TYPES) / sizeof(TYPES[0]); i++)
        if (!strcmp(name, TYPES[i].name)) return &TYPES[i];
    return NULL;
}

/* Seconds on `clock` (CLOCK_MONOTONIC: wall; CLOCK_THREAD_CPUTIME_ID: this thread's CPU). */
static inline double seconds_on(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of v[0 .. n) (n >= 1), which it sorts in place. */
static inline double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof(double), by_value);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* The matmul of the kernel library at `path`, loaded privately so that two builds of the
 * same library can be timed side by side in one process; exits 2 where it cannot load. */
static inline matmul_fn load_matmul(const char *path) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "%s\n", dlerror());
        exit(2);
    }
    return (matmul_fn)dlsym(lib, "bargein_gguf_matmul");
}

#endif
