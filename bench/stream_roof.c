/*
 * The memory roof of a one-stream decode step on this machine: how fast THREADS threads
 * read a step's bytes (667 MB by default, llama1b.Q4_K_M's one-row matmuls) with nothing
 * but 32-byte loads and adds, in the orders a weight pass can read them, on 4 KB and on
 * 2 MB pages. bench/gemv_stream.c times the kernels over the same bytes; its GB/s against
 * this tool's say how much of the memory the pass leaves unused.
 *
 * Orders (each thread takes an equal share of groups of 8 rows of ROW bytes, 1,152 by
 * default: a Q4_K row of k = 2048):
 *   rows          the 8 rows of a group read side by side, a superblock (144 bytes) of
 *                 each in turn, as the few-row pass reads its columns;
 *   rows+fetch    the same with the next group's lines asked for (prefetcht1) a share per
 *                 superblock, as the pass's prefetch plan does;
 *   sequential    each group's bytes front to back (one stream per thread).
 *
 *   cc -O2 -mavx2 -pthread -o /tmp/stream_roof bench/stream_roof.c
 *   /tmp/stream_roof [--threads 2] [--mb 667] [--row 1152] [--rounds 7]
 *
 * Prints the best of ROUNDS per order and page size in GB/s, then one line of JSON.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

enum { ROWS, ROWS_FETCH, SEQUENTIAL, ORDERS };
static const char *ORDER_NAMES[ORDERS] = {"rows", "rows+fetch", "sequential"};

typedef struct {
    const uint8_t *data;
    int64_t groups, row, order;
    int index, threads;
} job_t;

static volatile int sink;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *read_share(void *arg) {
    const job_t *j = (const job_t *)arg;
    const int64_t group = 8 * j->row, steps = j->row / 144, lines = (group + 63) / 64;
    const int64_t per_step = (lines + steps - 1) / steps;
    const int64_t g0 = j->groups * j->index / j->threads, g1 = j->groups * (j->index + 1) / j->threads;
    __m256i acc = _mm256_setzero_si256();
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *at = j->data + g * group, *next = at + group;
        if (j->order == SEQUENTIAL) {
            for (int64_t b = 0; b + 32 <= group; b += 32)
                acc = _mm256_add_epi32(acc, _mm256_loadu_si256((const __m256i *)(at + b)));
            continue;
        }
        for (int64_t s = 0; s < steps; s++) {
            if (j->order == ROWS_FETCH && g + 1 < g1)
                for (int64_t l = s * per_step; l < (s + 1) * per_step && l < lines; l++)
                    _mm_prefetch((const char *)(next + 64 * l), _MM_HINT_T1);
            for (int r = 0; r < 8; r++) /* a superblock of each row: 144 bytes, 4.5 loads */
                for (int64_t b = 0; b < 144; b += 32)
                    acc = _mm256_add_epi32(acc, _mm256_loadu_si256((const __m256i *)(at + r * j->row + s * 144 + b)));
        }
    }
    sink += _mm256_extract_epi32(acc, 0);
    return NULL;
}

static double best_gbs(const uint8_t *data, int64_t bytes, int64_t row, int order, int threads, int rounds) {
    job_t jobs[64];
    pthread_t ids[64];
    const int64_t groups = bytes / (8 * row);
    double best = 1e30;
    for (int r = 0; r < rounds; r++) {
        const double t0 = now();
        for (int i = 0; i < threads; i++) {
            jobs[i] = (job_t){data, groups, row, order, i, threads};
            pthread_create(&ids[i], NULL, read_share, &jobs[i]);
        }
        for (int i = 0; i < threads; i++) pthread_join(ids[i], NULL);
        const double t = now() - t0;
        best = t < best ? t : best;
    }
    return (double)(groups * 8 * row) / best / 1e9;
}

int main(int argc, char **argv) {
    int threads = 2, rounds = 7;
    int64_t mb = 667, row = 1152;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--mb")) mb = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--row")) row = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "usage: %s [--threads T] [--mb MB] [--row BYTES] [--rounds R]\n", argv[0]);
            return 2;
        }
    }
    if (threads < 1 || threads > 64 || rounds < 1 || row < 144 || row % 144 || mb < 1) {
        fprintf(stderr, "threads 1-64, rounds >= 1, row a positive multiple of 144, mb >= 1\n");
        return 2;
    }
    const int64_t bytes = mb << 20;
    double gbs[2][ORDERS];
    for (int huge = 0; huge < 2; huge++) {
        uint8_t *data = mmap(NULL, (size_t)bytes + (8 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (data == MAP_FAILED) {
            perror("mmap");
            return 1;
        }
        madvise(data, (size_t)bytes + (8 << 20), huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
        memset(data, 1, (size_t)bytes + (8 << 20));
        for (int o = 0; o < ORDERS; o++) gbs[huge][o] = best_gbs(data, bytes, row, o, threads, rounds);
        munmap(data, (size_t)bytes + (8 << 20));
    }
    printf("reading %lld MB in groups of 8 rows of %lld bytes, %d threads, best of %d (GB/s)\n", (long long)mb,
           (long long)row, threads, rounds);
    printf("%-12s %8s %8s\n", "order", "4 KB", "2 MB");
    for (int o = 0; o < ORDERS; o++) printf("%-12s %8.1f %8.1f\n", ORDER_NAMES[o], gbs[0][o], gbs[1][o]);
    printf("{\"benchmark\": \"stream_roof\", \"threads\": %d, \"mb\": %lld, \"row\": %lld", threads, (long long)mb,
           (long long)row);
    for (int o = 0; o < ORDERS; o++)
        printf(", \"%s\": {\"4k\": %.2f, \"2m\": %.2f}", ORDER_NAMES[o], gbs[0][o], gbs[1][o]);
    printf("}\n");
    return 0;
}
