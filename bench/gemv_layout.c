/*
 * Where one stream's weight pass loses to llama.cpp's repacked weights: the one-row `fast`
 * matmuls of a whole decode step of a real GGUF file (every layer's QKV, O, gate+up and
 * down, and the head: output.weight, else the tied token_embd.weight), the same kernel
 * library on the same blocks in different places of memory, one after the other in each
 * round (interleaved rounds, medians and same-run ratios against the first):
 *
 *   map    the file's pages, mapped read-only and shared (as bargein's loader maps them);
 *   anon   each tensor copied into its own anonymous mapping (4 KB pages);
 *   huge   the same with madvise(MADV_HUGEPAGE) (2 MB pages where THP is `madvise`).

 * A fourth layout, rows interleaved in groups of 8 (a group's superblocks side by side, as
 * llama.cpp's repack lays them), was timed with a prototype of the kernel's addressing
 * (commit c3601fa of branch ilv, layouts ilv and ilvh): on huge pages it gained nothing
 * over the plain rows (docs/benchmarks.md), so neither it nor the prototype was kept.
 *
 *   cc -O2 -o /tmp/gemv_layout bench/gemv_layout.c -ldl -lm
 *   /tmp/gemv_layout FILE.gguf LIB.so [--threads 2] [--isa 2] [--rounds 9] [--cpu]
 *                    [--layouts map,anon,huge]
 *
 * LIB.so is a built kernel library (a tree's bargein_kernels_*.so). --cpu times the calling thread's CPU time (use with --threads 1).
 * Q/K rows are read in the file's order here (bargein reads Q and K through a row order:
 * the same bytes, fetched eight rows apart instead of side by side).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gguf_ab.h"

enum { MAP, ANON, HUGE, LAYOUTS };
static const char *LAYOUT_NAMES[LAYOUTS] = {"map", "anon", "huge"};
enum { MAX_TENSORS = 4096, MAX_MATS = 512 };

typedef struct {
    char name[96];
    int type;
    int64_t dims[4], ndims;
    uint64_t offset;
} tensor_t;

typedef struct {
    const tensor_t *t[3];
    int count;
} mat_spec_t;

static clockid_t clock_kind = CLOCK_MONOTONIC;

/* ---- a minimal GGUF reader: the tensor table, enough to find each matrix's blocks ---- */

static const uint8_t *cur;

static uint64_t u64(void) { uint64_t v; memcpy(&v, cur, 8); cur += 8; return v; }
static uint32_t u32(void) { uint32_t v; memcpy(&v, cur, 4); cur += 4; return v; }

static void skip_value(uint32_t type) {
    static const int size[13] = {1, 1, 2, 2, 4, 4, 4, 1, -1, -1, 8, 8, 8}; /* 8 string, 9 array */
    if (type == 8) { const uint64_t n = u64(); cur += n; return; }
    if (type == 9) {
        const uint32_t inner = u32();
        const uint64_t n = u64();
        for (uint64_t i = 0; i < n; i++) skip_value(inner);
        return;
    }
    cur += size[type];
}

/* The tensors of the mapped file `base`, and the data section's offset. */
static int read_tensors(const uint8_t *base, tensor_t *ts, uint64_t *data_at) {
    cur = base;
    if (memcmp(cur, "GGUF", 4)) return -1;
    cur += 4;
    u32(); /* version */
    const uint64_t n_tensors = u64(), n_kv = u64();
    uint64_t alignment = 32;
    for (uint64_t i = 0; i < n_kv; i++) {
        const uint64_t len = u64();
        const int is_align = len == 17 && !memcmp(cur, "general.alignment", 17);
        cur += len;
        const uint32_t type = u32();
        if (is_align && type == 4) { alignment = u32(); continue; }
        skip_value(type);
    }
    if (n_tensors > MAX_TENSORS) return -1;
    for (uint64_t i = 0; i < n_tensors; i++) {
        const uint64_t len = u64();
        snprintf(ts[i].name, sizeof ts[i].name, "%.*s", (int)len, (const char *)cur);
        cur += len;
        ts[i].ndims = u32();
        for (int d = 0; d < ts[i].ndims; d++) ts[i].dims[d] = (int64_t)u64();
        ts[i].type = (int)u32();
        ts[i].offset = u64();
    }
    *data_at = ((uint64_t)(cur - base) + alignment - 1) / alignment * alignment;
    return (int)n_tensors;
}

static const tensor_t *find(const tensor_t *ts, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (!strcmp(ts[i].name, name)) return &ts[i];
    return NULL;
}

static const type_t *type_of(int id) {
    for (size_t i = 0; i < sizeof(TYPES) / sizeof(TYPES[0]); i++)
        if (TYPES[i].type == id) return &TYPES[i];
    fprintf(stderr, "block type %d: not one this bench knows (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K)\n", id);
    exit(2);
}

/* ---- the layouts ---- */

static uint8_t *anonymous(size_t bytes, int huge) {
    const size_t align = 2u << 20, size = (bytes + align - 1) / align * align;
    uint8_t *raw = mmap(NULL, size + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) { perror("mmap"); exit(1); }
    uint8_t *p = (uint8_t *)(((uintptr_t)raw + align - 1) / align * align);
    madvise(p, size, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    return p;
}

static bargein_qseg_t place(const tensor_t *t, const uint8_t *file, uint64_t data_at, int layout) {
    const type_t *ty = type_of(t->type);
    const int64_t k = t->dims[0], rows = t->dims[1], row_bytes = k / ty->qk * ty->bytes;
    const uint8_t *src = file + data_at + t->offset;
    bargein_qseg_t s = {t->type, src, row_bytes, rows, NULL};
    if (layout == MAP) return s;
    uint8_t *dst = anonymous((size_t)(rows * row_bytes), layout == HUGE);
    memcpy(dst, src, (size_t)(rows * row_bytes));
    s.data = dst;
    return s;
}

static int by_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const char *path = NULL, *lib = NULL, *layouts_arg = "map,anon,huge";
    int threads = 2, isa = 2, rounds = 9;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--isa") && i + 1 < argc) isa = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--layouts") && i + 1 < argc) layouts_arg = argv[++i];
        else if (!strcmp(argv[i], "--cpu")) clock_kind = CLOCK_THREAD_CPUTIME_ID;
        else if (!path) path = argv[i];
        else lib = argv[i];
    }
    if (!path || !lib || rounds < 1 || rounds > 99) {
        fprintf(stderr, "usage: %s FILE.gguf LIB.so [--threads T] [--isa I] [--rounds R] [--cpu] [--layouts L,..]\n",
                argv[0]);
        return 2;
    }
    int use[LAYOUTS], nuse = 0;
    for (int l = 0; l < LAYOUTS; l++) {
        const char *at = strstr(layouts_arg, LAYOUT_NAMES[l]);
        const size_t len = strlen(LAYOUT_NAMES[l]);
        while (at && ((at != layouts_arg && at[-1] != ',') || (at[len] && at[len] != ',')))
            at = strstr(at + 1, LAYOUT_NAMES[l]);
        if (at) use[nuse++] = l;
    }
    const matmul_fn matmul = load_matmul(lib);
    const int fd = open(path, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st)) { perror(path); return 2; }
    const uint8_t *file = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    if (file == MAP_FAILED) { perror("mmap"); return 2; }
    static tensor_t ts[MAX_TENSORS];
    uint64_t data_at;
    const int nt = read_tensors(file, ts, &data_at);
    if (nt < 0) { fprintf(stderr, "%s: not a GGUF file this bench reads\n", path); return 2; }
    static mat_spec_t specs[MAX_MATS];
    int nm = 0;
    char name[128];
    for (int l = 0;; l++) {
        snprintf(name, sizeof name, "blk.%d.attn_q.weight", l);
        if (!find(ts, nt, name)) break;
        const char *parts[4][3] = {{"attn_q", "attn_k", "attn_v"}, {"attn_output"}, {"ffn_gate", "ffn_up"}, {"ffn_down"}};
        for (int p = 0; p < 4; p++) {
            mat_spec_t *m = &specs[nm++];
            m->count = 0;
            for (int q = 0; q < 3 && parts[p][q]; q++) {
                snprintf(name, sizeof name, "blk.%d.%s.weight", l, parts[p][q]);
                m->t[m->count++] = find(ts, nt, name);
            }
        }
    }
    const tensor_t *head = find(ts, nt, "output.weight");
    specs[nm].count = 1, specs[nm++].t[0] = head ? head : find(ts, nt, "token_embd.weight");
    static bargein_qseg_t segs[LAYOUTS][MAX_MATS][3];
    static bargein_qmat_t mats[LAYOUTS][MAX_MATS];
    double total_mb = 0;
    int64_t max_n = 0, max_k = 0;
    for (int u = 0; u < nuse; u++)
        for (int i = 0; i < nm; i++) {
            int64_t n = 0;
            for (int s = 0; s < specs[i].count; s++) {
                segs[use[u]][i][s] = place(specs[i].t[s], file, data_at, use[u]);
                n += specs[i].t[s]->dims[1];
                if (u == 0) total_mb += (double)segs[use[u]][i][s].row_bytes * (double)segs[use[u]][i][s].rows / 1e6;
            }
            const int64_t k = specs[i].t[0]->dims[0];
            mats[use[u]][i] = (bargein_qmat_t){segs[use[u]][i], specs[i].count, n, k};
            max_n = n > max_n ? n : max_n, max_k = k > max_k ? k : max_k;
        }
    FILE *roll = fopen("/proc/self/smaps_rollup", "r"); /* did the huge layouts get 2 MB pages? */
    for (char line[256]; roll && fgets(line, sizeof line, roll);)
        if (!strncmp(line, "AnonHugePages:", 14) || !strncmp(line, "FilePmdMapped:", 14)) printf("%s", line);
    if (roll) fclose(roll);
    float *x = malloc(sizeof(float) * (size_t)max_k), *y = malloc(sizeof(float) * (size_t)max_n);
    float *y0 = malloc(sizeof(float) * (size_t)max_n);
    srand(1);
    for (int64_t i = 0; i < max_k; i++) x[i] = ((float)rand() / (float)RAND_MAX - 0.5f) * (i % 97 == 3 ? 40.0f : 1.0f);
    /* every layout must give the first's bits: the same blocks, read in another place */
    for (int i = 0; i < nm; i++)
        for (int u = 0; u < nuse; u++) {
            if (matmul(x, 1, &mats[use[u]][i], u ? y : y0, 0, threads, isa)) { fprintf(stderr, "matmul failed\n"); return 1; }
            if (u && memcmp(y, y0, sizeof(float) * (size_t)mats[use[0]][i].n)) {
                fprintf(stderr, "layout %s: matrix %d differs from %s\n", LAYOUT_NAMES[use[u]], i, LAYOUT_NAMES[use[0]]);
                return 1;
            }
        }
    static double t[LAYOUTS][99];
    for (int round = 0; round < rounds + 1; round++) /* round 0 warms up */
        for (int u = 0; u < nuse; u++) {
            const int lay = use[(u + round) % nuse]; /* each round starts with another layout */
            const double t0 = seconds_on(clock_kind);
            for (int i = 0; i < nm; i++) matmul(x, 1, &mats[lay][i], y, 0, threads, isa);
            if (round) t[lay][round - 1] = seconds_on(clock_kind) - t0;
        }
    printf("%s: one-row matmuls of a decode step (%d matrices, %.1f MB), %d threads, isa %d, %s, medians of %d rounds\n",
           path, nm, total_mb, threads, isa, clock_kind == CLOCK_MONOTONIC ? "wall" : "thread CPU", rounds);
    printf("%-6s %9s %8s %12s %10s\n", "layout", "step ms", "GB/s", "/ first", "ratio range");
    for (int u = 0; u < nuse; u++) {
        const int lay = use[u];
        double v[99], r[99];
        for (int i = 0; i < rounds; i++) v[i] = t[lay][i], r[i] = t[lay][i] / t[use[0]][i];
        qsort(v, (size_t)rounds, sizeof(double), by_double);
        qsort(r, (size_t)rounds, sizeof(double), by_double);
        printf("%-6s %9.2f %8.2f %12.3f %5.3f-%5.3f\n", LAYOUT_NAMES[lay], v[rounds / 2] * 1e3,
               total_mb / 1e3 / v[rounds / 2], r[rounds / 2], r[rounds / 4], r[rounds - 1 - rounds / 4]);
    }
    return 0;
}
