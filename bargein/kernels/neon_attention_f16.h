/* attention_f16.c's one-query path (attend_one) on ARM64 NEON, lane for lane as its AVX2
 * body (see arm64_simd.h): each score one fused multiply-add chain over the head in eight
 * lanes, f8_hsum's tree, times the scale; the same softmax; each output value one chain
 * of fused multiply-adds over the positions in order, times 1 / sum. So its bits are
 * attend_tile's and x86's. Included by attention_f16.c after score() and softmax_row(). */
#ifndef BARGEIN_NEON_ATTENTION_F16_H
#define BARGEIN_NEON_ATTENTION_F16_H

/* Query qi over query heads [h0, h1), head_dim a multiple of 64; scores: max_context floats
 * (acc, the x86 path's (heads, head_dim) scratch, is not needed here). */
static void attend_one(const f16_batch_t *b, int64_t qi, int h0, int h1, float *scores, float *acc) {
    (void)acc;
    const int n_heads = b->num_heads, group = n_heads / b->num_kv_heads, d_len = b->head_dim, bs = b->block_size;
    const int64_t row_len = (int64_t)b->num_kv_heads * d_len, per_q = (int64_t)n_heads * d_len;
    const int64_t *table = b->block_tables + b->query_seq[qi] * b->table_width;
    const int64_t ctx = b->query_ctx[qi], start = first_position(b, ctx);
    for (int h = h0; h < h1; h++) {
        const float *q = b->q + qi * per_q + (int64_t)h * d_len;
        const int64_t off = (int64_t)(h / group) * d_len;
        for (int64_t t = start; t < ctx; t++) {
            const uint16_t *k = b->k_cache + (table[t / bs] * bs + t % bs) * row_len + off;
            f32x8 acc = f8_set1(0.0f);
            for (int d = 0; d < d_len; d += 8) acc = f8_fmadd(f8_load(q + d), f8_load_halves(k + d), acc);
            scores[t - start] = score(b, f8_hsum(acc));
        }
        const f32x8 inv = f8_set1(softmax_row(scores, ctx - start));
        float *out = b->out + qi * per_q + (int64_t)h * d_len;
        for (int d0 = 0; d0 < d_len; d0 += 64) {
            f32x8 a[8];
            for (int j = 0; j < 8; j++) a[j] = f8_set1(0.0f);
            for (int64_t t = start; t < ctx; t++) {
                const uint16_t *v = b->v_cache + (table[t / bs] * bs + t % bs) * row_len + off + d0;
                const f32x8 w = f8_set1(scores[t - start]);
                for (int j = 0; j < 8; j++) a[j] = f8_fmadd(w, f8_load_halves(v + 8 * j), a[j]);
            }
            for (int j = 0; j < 8; j++) f8_store(out + d0 + 8 * j, f8_mul(a[j], inv));
        }
    }
}

#endif
