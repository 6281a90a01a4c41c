/*
 * Two builds of the kernels' library, A and B, timed on the `fast` float16 prompt
 * attention (attention_f16.c's paged attention, every position of one sequence as a query,
 * as a prefill calls it), alternated call by call in one process on one thread: a same-run
 * ratio for a change of the attention's kernels (issue 33, the 4,096-token prefill), steadier
 * on a shared machine than bench/bench_prompt_attention.py's fresh process per measurement.
 *
 * The caches are random float16 values in scattered blocks of 16 positions (a pool's
 * block table); queries random. Per round, A then B (B then A in odd rounds), each one call
 * timed by the thread's CPU clock; the result is each side's best call and the median of
 * the rounds' B / A ratios. Both sides' outputs are compared bit for bit ("same 1": the
 * attention's bits do not depend on the build's instruction set).
 *
 *   cc -O2 -o /tmp/attention_ab bench/attention_ab.c -ldl -lm
 *   /tmp/attention_ab A.so B.so TOKENS [ROUNDS] [HEADS KV_HEADS HEAD_DIM [SEQUENCES [SOFTCAP]]]
 *
 * Defaults: 7 rounds, Llama-3.2-1B's shape (32 query heads, 8 KV heads, head dim 64).
 * SEQUENCES > 0 times a decode step instead: that many sequences of TOKENS positions, one
 * query each (the last position), each call repeated until it has run 0.2 s. SOFTCAP > 0
 * caps the scores (Gemma 2's 50).
 * Build A and B as bench/gemm_tile_ab.c's header says, from each tree; for an AVX2-only
 * build on an AVX-512 machine, -march=x86-64-v3 (or skylake) in place of -march=native.
 */
#include <math.h>

#include "gguf_ab.h" /* seconds_on, median */

typedef int (*attention_t)(const float *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *tables,
                           int64_t table_width, const int64_t *query_seq, const int64_t *query_ctx, float *out,
                           int64_t num_queries, int num_heads, int num_kv_heads, int head_dim, int block_size,
                           float scale, int64_t window, float softcap, int num_threads);

#define BLOCK 16

static float uniform(void) { return (float)rand() / (float)RAND_MAX * 2.0f - 1.0f; }

static uint16_t half_of(float f) {
    _Float16 h = (_Float16)f;
    uint16_t bits;
    memcpy(&bits, &h, sizeof bits);
    return bits;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s A.so B.so TOKENS [ROUNDS] [HEADS KV_HEADS HEAD_DIM [SEQUENCES [SOFTCAP]]]\n", argv[0]);
        return 2;
    }
    const int64_t n = atoll(argv[3]);
    const int rounds = argc > 4 ? atoi(argv[4]) : 7;
    const int heads = argc > 7 ? atoi(argv[5]) : 32, kv = argc > 7 ? atoi(argv[6]) : 8, dim = argc > 7 ? atoi(argv[7]) : 64;
    const int64_t sequences = argc > 8 ? atoll(argv[8]) : 0; /* 0: one prompt, every position a query */
    const float softcap = argc > 9 ? (float)atof(argv[9]) : 0.0f;
    if (n < 1 || rounds < 1 || heads < 1 || kv < 1 || heads % kv || dim < 1 || sequences < 0) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    attention_t attention[2];
    for (int i = 0; i < 2; i++) {
        void *library = dlopen(argv[1 + i], RTLD_NOW | RTLD_LOCAL);
        if (!library || !(attention[i] = (attention_t)dlsym(library, "bargein_paged_attention_f16_ex"))) {
            fprintf(stderr, "%s\n", dlerror());
            return 1;
        }
    }
    const int64_t width = (n + BLOCK - 1) / BLOCK, seqs = sequences ? sequences : 1, blocks = width * seqs;
    const int64_t queries = sequences ? sequences : n, cache = blocks * BLOCK * kv * dim, values = queries * heads * dim;
    uint16_t *k_cache = malloc(sizeof(uint16_t) * (size_t)cache), *v_cache = malloc(sizeof(uint16_t) * (size_t)cache);
    int64_t *tables = malloc(sizeof(int64_t) * (size_t)blocks), *seq = malloc(sizeof(int64_t) * (size_t)queries);
    int64_t *ctx = malloc(sizeof(int64_t) * (size_t)queries);
    float *q = malloc(sizeof(float) * (size_t)values), *out[2];
    double *ratios = malloc(sizeof(double) * (size_t)rounds);
    for (int i = 0; i < 2; i++) out[i] = malloc(sizeof(float) * (size_t)values);
    srand(1);
    for (int64_t i = 0; i < cache; i++) k_cache[i] = half_of(uniform()), v_cache[i] = half_of(uniform());
    for (int64_t i = 0; i < values; i++) q[i] = uniform();
    for (int64_t i = 0; i < blocks; i++) tables[i] = i;
    for (int64_t i = blocks - 1; i > 0; i--) { /* scattered blocks (each sequence's table row: width of them) */
        const int64_t j = rand() % (i + 1), t = tables[i];
        tables[i] = tables[j], tables[j] = t;
    }
    for (int64_t i = 0; i < queries; i++) {
        seq[i] = sequences ? i : 0;
        ctx[i] = sequences ? n : i + 1;
    }
    /* A decode step is short: each timing repeats it as often as 0.2 s of the first call's pace takes. */
    int reps = 1;
    if (sequences) {
        const double start = seconds_on(CLOCK_THREAD_CPUTIME_ID);
        attention[0](q, k_cache, v_cache, tables, width, seq, ctx, out[0], queries, heads, kv, dim, BLOCK,
                     1.0f / sqrtf((float)dim), 0, softcap, 1);
        const double took = seconds_on(CLOCK_THREAD_CPUTIME_ID) - start;
        reps = took > 0 ? (int)(0.2 / took) + 1 : 1000;
    }
    const float scale = 1.0f / sqrtf((float)dim);
    double best[2] = {1e30, 1e30};
    for (int r = 0; r < rounds; r++) {
        double took[2];
        for (int s = 0; s < 2; s++) {
            const int i = r % 2 ? 1 - s : s;
            const double start = seconds_on(CLOCK_THREAD_CPUTIME_ID);
            for (int rep = 0; rep < reps; rep++)
                if (attention[i](q, k_cache, v_cache, tables, width, seq, ctx, out[i], queries, heads, kv, dim, BLOCK,
                                 scale, 0, softcap, 1)) {
                    fprintf(stderr, "%s failed\n", argv[1 + i]);
                    return 1;
                }
            took[i] = (seconds_on(CLOCK_THREAD_CPUTIME_ID) - start) / reps;
            if (took[i] < best[i]) best[i] = took[i];
        }
        ratios[r] = took[1] / took[0];
    }
    const double ratio = median(ratios, rounds);
    printf("tokens %lld heads %d/%d dim %d%s: A %.6f s  B %.6f s (best)  B/A median %.3f  same %d\n", (long long)n, heads,
           kv, dim, sequences ? " (a decode step)" : "", best[0], best[1], ratio,
           !memcmp(out[0], out[1], sizeof(float) * (size_t)values));
    if (sequences) printf("sequences %lld, %d calls a timing\n", (long long)sequences, reps);
    return 0;
}
