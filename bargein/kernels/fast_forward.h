/*
 * The fused forward's descriptors (fast_forward.c), one definition for every reader: the
 * kernel itself and the ARM64 emulation harness (tests/kernels/arm64/kernel_harness.c).
 * bargein/kernels/native_structs.py mirrors them field for field for Python.
 */
#ifndef BARGEIN_FAST_FORWARD_H
#define BARGEIN_FAST_FORWARD_H

#include <stdint.h>

#include "gguf_matrix.h"

/* A weight held in blocks, as bargein_q8_block_matmul reads it: (n, k), mins NULL for Q8_0;
 * or, where quant is not NULL, a GGUF matrix (gguf_matmul.c's bargein_qmat_t) and n, k. */
typedef struct {
    const uint8_t *qs;
    const float *scales, *mins;
    int64_t n, k, bits;
    const void *quant;
} bargein_q8_weight_t;

/* A mixture-of-experts MLP as bargein/model/moe.py's `fast` path runs it (moe_matmul.c): the
 * router (rows_w, hidden) float32, whose row `experts` is the shared expert's gate where
 * rows_w == experts + 1; the top `topk` of `experts`, their weights renormalised where
 * `norm`; each expert's gate and up (inter, hidden) and down (hidden, inter) GGUF matrices
 * (arrays of `experts` pointers); and the shared expert's fused gate/up (2 s, hidden) and
 * down (hidden, s), or shared_w13.n == 0 where there is none. */
typedef struct {
    const float *router;
    int64_t experts, rows_w, topk, norm, inter;
    const bargein_qmat_t *const *gate;
    const bargein_qmat_t *const *up;
    const bargein_qmat_t *const *down;
    bargein_q8_weight_t shared_w13, shared_w2;
} bargein_fast_moe_t;

/* One decoder layer: its norms' weights (hidden,), the fused projections, the qkv bias
 * (NULL if none) and its caches (num_slots, num_kv_heads, head_dim) float16; then the
 * families' features: the per-head norms' weights (head_dim,) and the post-norms' (hidden,),
 * NULL where none; its sliding window (0: none); local: its RoPE angles are the shape's
 * local tables; moe: its MLP is a mixture of experts (w13 and w2 unused), NULL where dense. */
typedef struct {
    const float *attn_norm, *ffn_norm, *qkv_bias;
    bargein_q8_weight_t wqkv, wo, w13, w2;
    uint16_t *k_cache, *v_cache;
    const float *q_norm, *k_norm, *post_attn_norm, *post_ffn_norm;
    int64_t window, local;
    const bargein_fast_moe_t *moe;
} bargein_fast_layer_t;

/* The shapes every layer shares, and the RoPE tables (num_positions, head_dim) float32; then
 * the families' features: the score soft cap and the logits' (0: none), the embedding scale
 * (0: none), gelu (GeGLU, else SwiGLU), the local layers' RoPE tables (NULL: the global ones). */
typedef struct {
    int64_t hidden, intermediate, num_slots;
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float eps, scale;
    const float *cos_table, *sin_table;
    int64_t num_positions;
    float softcap, final_softcap, embed_scale;
    int64_t gelu;
    const float *local_cos_table, *local_sin_table;
} bargein_fast_shape_t;

/* The final norm and LM head, and where their logits go: (num_rows, weight.n) float32 for
 * rows `rows` of the layers' output. */
typedef struct {
    const float *norm;
    bargein_q8_weight_t weight;
    const int64_t *rows;
    int64_t num_rows;
    float *logits;
} bargein_fast_head_t;

/* The token embedding: a float32 table (vocab, hidden), or blocks (dense NULL), and the ids
 * (m,) whose rows become x. */
typedef struct {
    const float *dense;
    bargein_q8_weight_t blocks;
    const int64_t *ids;
    int64_t vocab;
} bargein_fast_embed_t;

int bargein_fast_layers(const bargein_fast_layer_t *layers, int num_layers, const bargein_fast_shape_t *shape,
                        float *x, int64_t m, const int64_t *positions, const int64_t *slots,
                        const int64_t *block_tables, int64_t table_width, const int64_t *token_seq,
                        const int64_t *token_ctx, const bargein_fast_embed_t *embed, const bargein_fast_head_t *head,
                        float *workspace, int64_t workspace_floats, int num_threads, int isa);
/* The floats of bargein_fast_layers' workspace for an m-row call. */
int64_t bargein_fast_workspace_floats(const bargein_fast_shape_t *shape, int64_t m);

#endif
