/*
 * Runs every `fast` kernel of bargein/kernels/ (every .c) on fixed pseudo-random inputs and prints,
 * per case and per path, a hash of the output's bytes: one line "case<TAB>path<TAB>hash".
 * Built with the kernel sources for x86-64 (the host's compiler) and for ARM64 (the cross
 * compiler, run under qemu-aarch64); tests/kernels/test_arm64_emulated.py compares the
 * lines bit for bit: every int8-matmul instruction set of a build against its plain C, every
 * thread count against one thread, and every ARM64 run against the x86-64 run.
 *
 * Paths: "isa=N,t=T" for the int8 matmuls (N as bargein_q8_isa_available numbers them, for
 * every N this CPU runs), "t=T" for the others (their vector body is chosen at build time).
 * The first line, "isas<TAB>-<TAB>0,3,4", lists the instruction sets found.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_matrix.h"
#include "moe_matmul.h" /* the MoE entry points, declared once */

int bargein_q8_isa_available(int isa);
int bargein_q8_block_matmul(const float *x, int64_t m, int64_t k, const uint8_t *qs, const float *scales,
                            const float *mins, int bits, int64_t n, float *y, int num_threads, int isa);
int bargein_block_matmul(const float *x, int64_t m, int64_t k, const uint8_t *qs, const float *scales,
                         const float *mins, int bits, int64_t n, float *y, int num_threads);
int bargein_gguf_dequantize_rows(const bargein_qmat_t *w, const int64_t *ids, int64_t count, float *out,
                                 int num_threads);
int bargein_paged_attention_f16_ex(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                   const int64_t *block_tables, int64_t table_width, const int64_t *query_seq,
                                   const int64_t *query_ctx, float *out, int64_t num_queries, int num_heads,
                                   int num_kv_heads, int head_dim, int block_size, float scale, int64_t window,
                                   float softcap, int num_threads);
void bargein_rope_store_f16(const float *qkv, const float *cos, const float *sin, const int64_t *slots,
                            uint16_t *k_cache, uint16_t *v_cache, float *q_out, int64_t num_tokens, int num_heads,
                            int num_kv_heads, int head_dim, int num_threads);
int bargein_paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                                   const int64_t *block_tables, const int64_t *context_lens, float *out,
                                   int64_t num_seqs, int64_t table_width, int num_heads, int num_kv_heads,
                                   int head_dim, int block_size, float scale, int num_threads);
void bargein_rms_norm(const float *x, const float *w, float *y, int64_t m, int64_t n, float eps, int num_threads);
void bargein_silu_mul(const float *x, float *y, int64_t m, int64_t n, int num_threads);
void bargein_gelu_tanh_mul(const float *x, float *y, int64_t m, int64_t n, int num_threads);
void bargein_softcap(const float *x, float *y, int64_t m, int64_t n, float cap, int num_threads);

/* fast_forward.c's descriptors, by the names this harness uses. */
#include "fast_forward.h"
typedef bargein_q8_weight_t fast_weight_t;
typedef bargein_fast_layer_t fast_layer_t;
typedef bargein_fast_shape_t fast_shape_t;
typedef bargein_fast_head_t fast_head_t;
typedef bargein_fast_embed_t fast_embed_t;

#define NUM_ISAS 5
static const int THREADS[] = {1, 3};
static int isas[NUM_ISAS], num_isas;

/* ---- inputs: xorshift, the same numbers on every machine ---------------------------- */

static uint64_t state = 0x9E3779B97F4A7C15ULL;
static uint32_t next_u32(void) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return (uint32_t)(state >> 32);
}
/* Uniform in [-1, 1), a multiple of 2^-20: exact in float on every machine. */
static float next_float(void) { return (float)((int32_t)(next_u32() >> 11) - (1 << 20)) / (float)(1 << 20); }
static void fill_floats(float *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) x[i] = scale * next_float();
}
static void fill_bytes(uint8_t *p, int64_t n) {
    for (int64_t i = 0; i < n; i++) p[i] = (uint8_t)next_u32();
}
/* A finite float16 of moderate size (the blocks' scales), little-endian at p. */
static void put_half(uint8_t *p) {
    const uint16_t h = (uint16_t)((next_u32() & 0x8000) | ((10 + next_u32() % 8) << 10) | (next_u32() & 0x3FF));
    p[0] = (uint8_t)h, p[1] = (uint8_t)(h >> 8);
}
static void *checked(void *p) {
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

/* ---- output ------------------------------------------------------------------------- */

static uint64_t fnv(const void *data, size_t bytes) {
    const uint8_t *p = (const uint8_t *)data;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < bytes; i++) h = (h ^ p[i]) * 0x100000001b3ULL;
    return h;
}
static void report(const char *name, const char *path, const void *data, size_t bytes) {
    printf("%s\t%s\t%016" PRIx64 "\n", name, path, fnv(data, bytes));
}
static void fail(const char *name, const char *path, int status) {
    printf("%s\t%s\tstatus=%d\n", name, path, status);
}

/* ---- GGUF blocks -------------------------------------------------------------------- */

typedef struct {
    const char *name;
    int type, qk, bytes;
    int halves[2]; /* byte offsets of the block's float16 fields (-1: none) */
} gguf_type_t;

static const gguf_type_t TYPES[] = {
    {"Q4_0", 2, 32, 18, {0, -1}},     {"Q4_1", 3, 32, 20, {0, 2}},     {"Q5_0", 6, 32, 22, {0, -1}},
    {"Q5_1", 7, 32, 24, {0, 2}},      {"Q8_0", 8, 32, 34, {0, -1}},    {"Q2_K", 10, 256, 84, {80, 82}},
    {"Q3_K", 11, 256, 110, {108, -1}}, {"Q4_K", 12, 256, 144, {0, 2}}, {"Q5_K", 13, 256, 176, {0, 2}},
    {"Q6_K", 14, 256, 210, {208, -1}}, {"IQ4_NL", 20, 32, 18, {0, -1}}, {"IQ4_XS", 23, 256, 136, {0, -1}},
};
#define NUM_TYPES (int)(sizeof TYPES / sizeof TYPES[0])

static uint8_t *gguf_rows(const gguf_type_t *t, int64_t rows, int64_t k) {
    const int64_t blocks = rows * (k / t->qk);
    uint8_t *data = checked(malloc((size_t)(blocks * t->bytes)));
    fill_bytes(data, blocks * t->bytes);
    for (int64_t b = 0; b < blocks; b++)
        for (int i = 0; i < 2; i++)
            if (t->halves[i] >= 0) put_half(data + b * t->bytes + t->halves[i]);
    return data;
}

/* y = x @ W.T on every instruction set and thread count; W of one type, or (mixed) two
 * segments, the second read through a row order. */
static void gguf_case(const gguf_type_t *t, const gguf_type_t *second, int64_t m, int64_t n, int64_t k) {
    const int64_t n1 = second ? n / 2 : n, n2 = n - n1;
    uint8_t *d1 = gguf_rows(t, n1, k), *d2 = second ? gguf_rows(second, n2, k) : NULL;
    int64_t *order = checked(malloc(sizeof(int64_t) * (size_t)(n2 + 1)));
    for (int64_t i = 0; i < n2; i++) order[i] = (i * 7 + 3) % n2;
    bargein_qseg_t segs[2] = {{t->type, d1, k / t->qk * t->bytes, n1, NULL},
                              {second ? second->type : 0, d2, second ? k / second->qk * second->bytes : 0, n2, order}};
    const bargein_qmat_t w = {segs, second ? 2 : 1, n, k};
    float *x = checked(malloc(sizeof(float) * (size_t)(m * k))), *y = checked(malloc(sizeof(float) * (size_t)(m * n)));
    fill_floats(x, m * k, 3.0f);
    for (int64_t i = 5; i < m * k; i += 97) x[i] *= 40.0f; /* outlier channels: the K chain's per-32 steps vary */
    char name[96], path[32];
    snprintf(name, sizeof name, "gguf_fast/%s%s%s/m=%" PRId64, t->name, second ? "+" : "", second ? second->name : "", m);
    for (int i = 0; i < num_isas; i++)
        for (int th = 0; th < 2; th++) {
            snprintf(path, sizeof path, "isa=%d,t=%d", isas[i], THREADS[th]);
            const int status = bargein_gguf_matmul(x, m, &w, y, 0, THREADS[th], isas[i]);
            if (status) fail(name, path, status);
            else report(name, path, y, sizeof(float) * (size_t)(m * n));
        }
    /* exact: the plain C everywhere but x86 AVX2 (whose float order is its own) */
    snprintf(name, sizeof name, "gguf_exact_c/%s%s%s/m=%" PRId64, t->name, second ? "+" : "", second ? second->name : "", m);
    for (int th = 0; th < 2; th++) {
        snprintf(path, sizeof path, "t=%d", THREADS[th]);
        const int status = bargein_gguf_matmul(x, m, &w, y, 1, THREADS[th], 0);
        if (status) fail(name, path, status);
        else report(name, path, y, sizeof(float) * (size_t)(m * n));
    }
    int64_t ids[5] = {0, n - 1, n / 2, 1, second ? n1 : 2}; /* n1: the second segment's first row */
    float *rows = checked(malloc(sizeof(float) * 5 * (size_t)k));
    snprintf(name, sizeof name, "gguf_rows/%s%s%s", t->name, second ? "+" : "", second ? second->name : "");
    const int status = bargein_gguf_dequantize_rows(&w, ids, 5, rows, 1);
    if (status) fail(name, "t=1", status);
    else report(name, "t=1", rows, sizeof(float) * 5 * (size_t)k);
    free(rows);
    free(d1), free(d2), free(order), free(x), free(y);
}

/* ---- BlockWeight int8 and float matmuls ---------------------------------------------- */

static void block_case(int bits, int64_t m, int64_t n, int64_t k) {
    const int64_t nb = k / 32, bytes = bits == 4 ? 16 : 32;
    uint8_t *qs = checked(malloc((size_t)(n * nb * bytes)));
    fill_bytes(qs, n * nb * bytes);
    if (bits == 8)
        for (int64_t i = 0; i < n * nb * bytes; i++) qs[i] = qs[i] == 0x80 ? 0x81 : qs[i]; /* -127..127 */
    float *scales = checked(malloc(sizeof(float) * (size_t)(n * nb))), *mins = checked(malloc(sizeof(float) * (size_t)(n * nb)));
    fill_floats(scales, n * nb, 0.05f), fill_floats(mins, n * nb, 0.2f);
    float *x = checked(malloc(sizeof(float) * (size_t)(m * k))), *y = checked(malloc(sizeof(float) * (size_t)(m * n)));
    fill_floats(x, m * k, 2.0f);
    char name[64], path[32];
    snprintf(name, sizeof name, "q8_block/bits=%d/m=%" PRId64, bits, m);
    for (int i = 0; i < num_isas; i++)
        for (int th = 0; th < 2; th++) {
            snprintf(path, sizeof path, "isa=%d,t=%d", isas[i], THREADS[th]);
            const int status = bargein_q8_block_matmul(x, m, k, qs, scales, bits == 4 ? mins : NULL, bits, n, y,
                                                       THREADS[th], isas[i]);
            if (status) fail(name, path, status);
            else report(name, path, y, sizeof(float) * (size_t)(m * n));
        }
    snprintf(name, sizeof name, "block_float/bits=%d/m=%" PRId64, bits, m);
    for (int th = 0; th < 2; th++) {
        snprintf(path, sizeof path, "t=%d", THREADS[th]);
        const int status = bargein_block_matmul(x, m, k, qs, scales, bits == 4 ? mins : NULL, bits, n, y, THREADS[th]);
        if (status) fail(name, path, status);
        else report(name, path, y, sizeof(float) * (size_t)(m * n));
    }
    free(qs), free(scales), free(mins), free(x), free(y);
}

/* ---- attention ---------------------------------------------------------------------- */

static uint16_t to_half(float f) { /* inputs only: small values, truncated (any halves do) */
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t abs = x & 0x7FFFFFFF;
    if (abs < 0x38800000u) return (uint16_t)((x >> 16) & 0x8000);
    return (uint16_t)(((x >> 16) & 0x8000) | (((abs >> 23) - 112) << 10) | ((abs >> 13) & 0x3FF));
}

/* Queries of two sequences (a prompt chunk of 11 and a decode) over float16 caches. */
static void attention_f16_case(int head_dim, int64_t window, float softcap) {
    const int heads = 4, kv = 2, bs = 8, num_blocks = 8, width = 4;
    const int64_t cache = (int64_t)num_blocks * bs * kv * head_dim, nq = 12;
    uint16_t *k = checked(malloc(2 * (size_t)cache)), *v = checked(malloc(2 * (size_t)cache));
    for (int64_t i = 0; i < cache; i++) k[i] = to_half(next_float()), v[i] = to_half(next_float());
    const int64_t tables[8] = {3, 0, 6, 1, 7, 2, 5, 4};
    int64_t seq[12], ctx[12];
    for (int i = 0; i < 11; i++) seq[i] = 0, ctx[i] = 15 + i;
    seq[11] = 1, ctx[11] = 29;
    float *q = checked(malloc(sizeof(float) * (size_t)(nq * heads * head_dim)));
    float *out = checked(malloc(sizeof(float) * (size_t)(nq * heads * head_dim)));
    fill_floats(q, nq * heads * head_dim, 1.5f);
    char name[80], one_name[80], path[16];
    snprintf(name, sizeof name, "attention_f16/d=%d,window=%" PRId64 ",softcap=%g", head_dim, window, softcap);
    snprintf(one_name, sizeof one_name, "attention_f16_decode/d=%d,window=%" PRId64 ",softcap=%g", head_dim, window,
             softcap);
    for (int th = 0; th < 2; th++) {
        snprintf(path, sizeof path, "t=%d", THREADS[th]);
        const int status = bargein_paged_attention_f16_ex(q, k, v, tables, width, seq, ctx, out, nq, heads, kv,
                                                          head_dim, bs, 0.125f, window, softcap, THREADS[th]);
        if (status) fail(name, path, status);
        else report(name, path, out, sizeof(float) * (size_t)(nq * heads * head_dim));
        /* the decode alone: one query, the one-query path where the build has one */
        const int one = bargein_paged_attention_f16_ex(q + 11 * heads * head_dim, k, v, tables, width, seq + 11,
                                                       ctx + 11, out, 1, heads, kv, head_dim, bs, 0.125f, window,
                                                       softcap, THREADS[th]);
        if (one) fail(one_name, path, one);
        else report(one_name, path, out, sizeof(float) * (size_t)(heads * head_dim));
    }
    free(k), free(v), free(q), free(out);
}

static void rope_case(int head_dim) {
    const int heads = 4, kv = 2, tokens = 5, slots_total = 16;
    const int64_t width = (int64_t)(heads + 2 * kv) * head_dim, kv_row = (int64_t)kv * head_dim;
    float *qkv = checked(malloc(sizeof(float) * (size_t)(tokens * width)));
    float *cs = checked(malloc(sizeof(float) * (size_t)(tokens * head_dim))), *sn = checked(malloc(sizeof(float) * (size_t)(tokens * head_dim)));
    fill_floats(qkv, tokens * width, 4.0f), fill_floats(cs, tokens * head_dim, 1.0f), fill_floats(sn, tokens * head_dim, 1.0f);
    const int64_t slots[5] = {9, 2, 15, 0, 7};
    uint16_t *kc = checked(calloc((size_t)(slots_total * kv_row), 2)), *vc = checked(calloc((size_t)(slots_total * kv_row), 2));
    float *qo = checked(malloc(sizeof(float) * (size_t)(tokens * heads * head_dim)));
    char name[48], path[16];
    snprintf(name, sizeof name, "rope_store_f16/d=%d", head_dim);
    for (int th = 0; th < 2; th++) {
        snprintf(path, sizeof path, "t=%d", THREADS[th]);
        bargein_rope_store_f16(qkv, cs, sn, slots, kc, vc, qo, tokens, heads, kv, head_dim, THREADS[th]);
        uint64_t parts[3] = {fnv(kc, 2 * (size_t)(slots_total * kv_row)), fnv(vc, 2 * (size_t)(slots_total * kv_row)),
                             fnv(qo, sizeof(float) * (size_t)(tokens * heads * head_dim))};
        report(name, path, parts, sizeof parts);
    }
    free(qkv), free(cs), free(sn), free(kc), free(vc), free(qo);
}

static void decode_attention_case(int head_dim) {
    const int heads = 8, kv = 2, bs = 4, num_blocks = 10, width = 5, seqs = 3;
    const int64_t cache = (int64_t)num_blocks * bs * kv * head_dim;
    float *k = checked(malloc(sizeof(float) * (size_t)cache)), *v = checked(malloc(sizeof(float) * (size_t)cache));
    fill_floats(k, cache, 1.0f), fill_floats(v, cache, 1.0f);
    const int64_t tables[15] = {9, 1, 4, 0, 0, 2, 3, 8, 7, 6, 5, 0, 0, 0, 0};
    const int64_t lens[3] = {13, 19, 3};
    float *q = checked(malloc(sizeof(float) * (size_t)(seqs * heads * head_dim)));
    float *out = checked(malloc(sizeof(float) * (size_t)(seqs * heads * head_dim)));
    fill_floats(q, seqs * heads * head_dim, 1.5f);
    char name[48], path[16];
    snprintf(name, sizeof name, "decode_attention/d=%d", head_dim);
    for (int th = 0; th < 2; th++) {
        snprintf(path, sizeof path, "t=%d", THREADS[th]);
        const int status = bargein_paged_decode_attention(q, k, v, tables, lens, out, seqs, width, heads, kv, head_dim,
                                                          bs, 0.2f, THREADS[th]);
        if (status) fail(name, path, status);
        else report(name, path, out, sizeof(float) * (size_t)(seqs * heads * head_dim));
    }
    free(k), free(v), free(q), free(out);
}

/* ---- row-wise ----------------------------------------------------------------------- */

static void rowwise_case(int64_t m, int64_t n) {
    float *x = checked(malloc(sizeof(float) * (size_t)(m * 2 * n))), *w = checked(malloc(sizeof(float) * (size_t)n));
    float *y = checked(malloc(sizeof(float) * (size_t)(m * 2 * n)));
    fill_floats(x, m * 2 * n, 6.0f), fill_floats(w, n, 1.0f);
    char name[64], path[16];
    for (int th = 0; th < 2; th++) {
        snprintf(path, sizeof path, "t=%d", THREADS[th]);
        snprintf(name, sizeof name, "rms_norm/m=%" PRId64 ",n=%" PRId64, m, n);
        bargein_rms_norm(x, w, y, m, n, 1e-5f, THREADS[th]);
        report(name, path, y, sizeof(float) * (size_t)(m * n));
        snprintf(name, sizeof name, "silu_mul/m=%" PRId64 ",n=%" PRId64, m, n);
        bargein_silu_mul(x, y, m, n, THREADS[th]);
        report(name, path, y, sizeof(float) * (size_t)(m * n));
        snprintf(name, sizeof name, "gelu_tanh_mul/m=%" PRId64 ",n=%" PRId64, m, n);
        bargein_gelu_tanh_mul(x, y, m, n, THREADS[th]);
        report(name, path, y, sizeof(float) * (size_t)(m * n));
        snprintf(name, sizeof name, "softcap/m=%" PRId64 ",n=%" PRId64, m, n);
        bargein_softcap(x, y, m, 2 * n, 30.0f, THREADS[th]);
        report(name, path, y, sizeof(float) * (size_t)(m * 2 * n));
    }
    free(x), free(w), free(y);
}

/* SiLU over the inputs whose exp glibc 2.36 rounds apart on x86-64 and AArch64 (e^32.564632,
 * e^-63.099461: what a / (1 + expf(-a)) met at these a) and the exp's range limits, in the
 * vector bodies and in the scalar tail (n = 11: one eight, three more). */
static void exp_edges_case(void) {
    static const uint32_t bits[11] = {0xC202422F, 0x427C65D9, 0x4202422F, 0xC27C65D9, 0xC2B17218, 0x42CFF1B5,
                                      0xC2AEAC51, 0x3F800000, 0xC202422F, 0x427C65D9, 0xC2AEAC51};
    float x[44], y[22];
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 11; i++) {
            memcpy(&x[22 * r + i], &bits[(i + 3 * r) % 11], 4);
            x[22 * r + 11 + i] = 1.0f + (float)i / 8.0f;
        }
    char path[16];
    for (int th = 0; th < 2; th++) {
        snprintf(path, sizeof path, "t=%d", THREADS[th]);
        bargein_silu_mul(x, y, 2, 11, THREADS[th]);
        report("silu_mul/exp_edges", path, y, sizeof y);
    }
}

/* ---- mixture of experts: routing, and the grouped experts on every instruction set ---- */

static void moe_case(const gguf_type_t *t, int64_t m) {
    const int64_t experts = 3, hidden = 256, inter = 256, topk = 2;
    uint8_t *data[9];
    bargein_qseg_t segs[9];
    bargein_qmat_t mats[9];
    const bargein_qmat_t *gate[3], *up[3], *down[3];
    for (int i = 0; i < 9; i++) {
        const int64_t rows = i < 6 ? inter : hidden, k = i < 6 ? hidden : inter;
        data[i] = gguf_rows(t, rows, k);
        segs[i] = (bargein_qseg_t){t->type, data[i], k / t->qk * t->bytes, rows, NULL};
        mats[i] = (bargein_qmat_t){&segs[i], 1, rows, k};
    }
    for (int e = 0; e < 3; e++) gate[e] = &mats[e], up[e] = &mats[3 + e], down[e] = &mats[6 + e];
    float *x = checked(malloc(sizeof(float) * (size_t)(m * hidden))), *router = checked(malloc(sizeof(float) * (size_t)(experts * hidden)));
    fill_floats(x, m * hidden, 2.0f), fill_floats(router, experts * hidden, 0.1f);
    int64_t *ids = checked(malloc(sizeof(int64_t) * (size_t)(m * topk)));
    float *weights = checked(malloc(sizeof(float) * (size_t)(m * topk))), *y = checked(malloc(sizeof(float) * (size_t)(m * hidden)));
    char name[48], path[32];
    snprintf(name, sizeof name, "moe_route/m=%" PRId64, m);
    for (int th = 0; th < 2; th++) {
        snprintf(path, sizeof path, "t=%d", THREADS[th]);
        const int status = bargein_moe_route(x, m, hidden, router, experts, experts, topk, 1, ids, weights, NULL, THREADS[th]);
        if (status) fail(name, path, status);
        else {
            uint64_t parts[2] = {fnv(ids, sizeof(int64_t) * (size_t)(m * topk)), fnv(weights, sizeof(float) * (size_t)(m * topk))};
            report(name, path, parts, sizeof parts);
        }
    }
    snprintf(name, sizeof name, "moe_experts/%s/m=%" PRId64, t->name, m);
    for (int i = 0; i < num_isas; i++)
        for (int th = 0; th < 2; th++) {
            snprintf(path, sizeof path, "isa=%d,t=%d", isas[i], THREADS[th]);
            const int status = bargein_moe_experts(x, m, hidden, inter, gate, up, down, experts, ids, weights, topk, y,
                                                   0, THREADS[th], isas[i]);
            if (status) fail(name, path, status);
            else report(name, path, y, sizeof(float) * (size_t)(m * hidden));
        }
    for (int i = 0; i < 9; i++) free(data[i]);
    free(x), free(router), free(ids), free(weights), free(y);
}

/* ---- the fused fast forward: two layers, embedding to logits -------------------------- */

/* A GGUF weight (n, k) of type t: its blocks, segment and matrix kept in *keep. */
typedef struct {
    uint8_t *data;
    bargein_qseg_t seg;
    bargein_qmat_t mat;
} gguf_weight_t;
static fast_weight_t gguf_weight(gguf_weight_t *keep, const gguf_type_t *t, int64_t n, int64_t k) {
    keep->data = gguf_rows(t, n, k);
    keep->seg = (bargein_qseg_t){t->type, keep->data, k / t->qk * t->bytes, n, NULL};
    keep->mat = (bargein_qmat_t){&keep->seg, 1, n, k};
    return (fast_weight_t){NULL, NULL, NULL, n, k, 0, &keep->mat};
}
/* A BlockWeight (n, k) of bits 4 or 8; its arrays freed by the caller through keep. */
static fast_weight_t block_weight(void **keep, int bits, int64_t n, int64_t k) {
    const int64_t nb = k / 32, bytes = bits == 4 ? 16 : 32;
    uint8_t *qs = checked(malloc((size_t)(n * nb * bytes)));
    fill_bytes(qs, n * nb * bytes);
    if (bits == 8)
        for (int64_t i = 0; i < n * nb * bytes; i++) qs[i] = qs[i] == 0x80 ? 0x81 : qs[i];
    float *scales = checked(malloc(sizeof(float) * (size_t)(n * nb))), *mins = checked(malloc(sizeof(float) * (size_t)(n * nb)));
    fill_floats(scales, n * nb, 0.01f), fill_floats(mins, n * nb, 0.05f);
    keep[0] = qs, keep[1] = scales, keep[2] = mins;
    return (fast_weight_t){qs, scales, bits == 4 ? mins : NULL, n, k, bits, NULL};
}

/* Seven tokens, a prompt of six (sequence 0) and one decode (sequence 1), embedded, through
 * a layer of GGUF weights (Q4_K, Q6_K, Q4_0, and a 4-bit BlockWeight) and a layer of 8-bit
 * BlockWeights with a sliding window of 4, to the logits of the last two (a Q8_0 head);
 * SwiGLU, or GeGLU with soft caps. Hashes the logits, the residual stream and the caches. */
static void fused_case(int gelu, float softcap) {
    const int64_t hidden = 256, inter = 256, heads = 4, kv = 2, d = 64, bs = 8, slots_n = 32, vocab = 97, m = 7;
    const int64_t qkv_n = (heads + 2 * kv) * d, positions_n = 16;
    gguf_weight_t g[4];
    void *keep[5][3];
    fast_layer_t layers[2];
    float *norms = checked(malloc(sizeof(float) * 5 * (size_t)hidden));
    fill_floats(norms, 5 * hidden, 1.0f);
    uint16_t *caches = checked(calloc((size_t)(4 * slots_n * kv * d), 2));
    layers[0] = (fast_layer_t){norms, norms + hidden, NULL, gguf_weight(&g[0], &TYPES[7], qkv_n, hidden),
                               gguf_weight(&g[1], &TYPES[9], hidden, heads * d), gguf_weight(&g[2], &TYPES[0], 2 * inter, hidden),
                               block_weight(keep[0], 4, hidden, inter), caches, caches + slots_n * kv * d,
                               NULL, NULL, NULL, NULL, 0, 0};
    layers[1] = (fast_layer_t){norms + 2 * hidden, norms + 3 * hidden, NULL, block_weight(keep[1], 8, qkv_n, hidden),
                               block_weight(keep[2], 8, hidden, heads * d), block_weight(keep[3], 8, 2 * inter, hidden),
                               block_weight(keep[4], 8, hidden, inter), caches + 2 * slots_n * kv * d,
                               caches + 3 * slots_n * kv * d, NULL, NULL, NULL, NULL, 4, 0};
    float *tables = checked(malloc(sizeof(float) * 2 * (size_t)(positions_n * d)));
    fill_floats(tables, 2 * positions_n * d, 1.0f);
    const fast_shape_t shape = {hidden, inter, slots_n, heads, kv, d, bs, 1e-5f, 0.125f, tables,
                                tables + positions_n * d, positions_n, softcap, softcap, 0.0f, gelu, NULL, NULL};
    float *embedding = checked(malloc(sizeof(float) * (size_t)(vocab * hidden)));
    fill_floats(embedding, vocab * hidden, 1.0f);
    const int64_t ids[7] = {5, 96, 0, 41, 41, 7, 63}, positions[7] = {0, 1, 2, 3, 4, 5, 0};
    const int64_t slots[7] = {0, 1, 2, 3, 4, 5, 16}, tables_bt[2] = {0, 2}, seq[7] = {0, 0, 0, 0, 0, 0, 1};
    const int64_t ctx[7] = {1, 2, 3, 4, 5, 6, 1}, head_rows[2] = {5, 6};
    const fast_embed_t embed = {embedding, {NULL, NULL, NULL, 0, 0, 0, NULL}, ids, vocab};
    float *logits = checked(malloc(sizeof(float) * 2 * (size_t)vocab)), *x = checked(malloc(sizeof(float) * (size_t)(m * hidden)));
    const fast_head_t head = {norms + 4 * hidden, gguf_weight(&g[3], &TYPES[4], vocab, hidden), head_rows, 2, logits};
    const int64_t workspace_floats = bargein_fast_workspace_floats(&shape, m);
    float *workspace = checked(malloc(sizeof(float) * (size_t)workspace_floats));
    char name[64], path[32];
    snprintf(name, sizeof name, "fast_layers/gelu=%d,softcap=%g", gelu, softcap);
    for (int i = 0; i < num_isas; i++)
        for (int th = 0; th < 2; th++) {
            snprintf(path, sizeof path, "isa=%d,t=%d", isas[i], THREADS[th]);
            memset(caches, 0, 2 * (size_t)(4 * slots_n * kv * d));
            const int status = bargein_fast_layers(layers, 2, &shape, x, m, positions, slots, tables_bt, 1, seq, ctx,
                                                   &embed, &head, workspace, workspace_floats, THREADS[th], isas[i]);
            if (status) {
                fail(name, path, status);
                continue;
            }
            uint64_t parts[3] = {fnv(logits, sizeof(float) * 2 * (size_t)vocab), fnv(x, sizeof(float) * (size_t)(m * hidden)),
                                 fnv(caches, 2 * (size_t)(4 * slots_n * kv * d))};
            report(name, path, parts, sizeof parts);
        }
    for (int i = 0; i < 4; i++) free(g[i].data);
    for (int i = 0; i < 5; i++) free(keep[i][0]), free(keep[i][1]), free(keep[i][2]);
    free(norms), free(caches), free(tables), free(embedding), free(logits), free(x), free(workspace);
}

int main(void) {
    char list[32] = "", *at = list;
    for (int isa = 0; isa < NUM_ISAS; isa++)
        if (bargein_q8_isa_available(isa)) {
            isas[num_isas++] = isa;
            at += sprintf(at, "%s%d", at == list ? "" : ",", isa);
        }
    printf("isas\t-\t%s\n", list);
    /* odd row counts on both sides of the x86 paths' many-row thresholds (8, 24); 37
     * columns: a partial tile and a partial quad; k = 512: two superblocks */
    const int64_t rows[] = {1, 3, 9, 25};
    for (int t = 0; t < NUM_TYPES; t++)
        for (int r = 0; r < 4; r++) gguf_case(&TYPES[t], NULL, rows[r], 37, 512);
    /* the ARM64 sdot tiles' types (one scale, and a min, per 32) from their threshold of 4
     * rows on: whole and partial passes of 6 rows */
    const int64_t tile_rows[] = {4, 7, 16, 33};
    for (int t = 0; t < NUM_TYPES; t++)
        if (TYPES[t].qk == 32 || TYPES[t].type == 23)
            for (int r = 0; r < 4; r++) gguf_case(&TYPES[t], NULL, tile_rows[r], 37, 512);
    gguf_case(&TYPES[0], &TYPES[9], 3, 37, 512); /* Q4_0 over Q6_K, through a row order */
    gguf_case(&TYPES[7], &TYPES[4], 9, 37, 512); /* Q4_K over Q8_0 */
    for (int r = 0; r < 4; r++) block_case(4, rows[r], 37, 96), block_case(8, rows[r], 37, 96);
    for (int r = 0; r < 4; r++) block_case(4, tile_rows[r], 37, 96), block_case(8, tile_rows[r], 37, 96);
    block_case(4, 17, 41, 256);
    block_case(8, 17, 41, 256);
    for (int d = 0; d < 2; d++) {
        const int dims[2] = {64, 36};
        attention_f16_case(dims[d], 0, 0.0f);
        attention_f16_case(dims[d], 6, 0.0f);
        attention_f16_case(dims[d], 0, 5.0f);
        rope_case(dims[d]);
        decode_attention_case(dims[d]);
    }
    rowwise_case(5, 67);
    exp_edges_case();
    rowwise_case(9, 256);
    moe_case(&TYPES[7], 5);
    moe_case(&TYPES[4], 3);
    fused_case(0, 0.0f);
    fused_case(1, 30.0f); /* GeGLU and soft caps: libm's tanhf */
    return 0;
}
