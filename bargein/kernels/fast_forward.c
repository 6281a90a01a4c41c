/*
 * The `fast` precision's decoder layers, a whole range of them in one call.
 *
 * Each layer is exactly the sequence of kernels the per-operation path calls from Python
 * (bargein/model/llama.py with a fast KernelSet), in the same order, on the same inputs:
 *
 *   h    = rms_norm(x, attn_norm)                       bargein_rms_norm
 *   qkv  = h @ Wqkv.T (+ bias)                           bargein_q8_block_matmul, then one add
 *   q    = rope(qkv); K, V -> float16 caches             bargein_rope_store_f16
 *   a    = attention(q, caches)                          bargein_paged_attention_f16
 *   x    = x + a @ Wo.T                                  bargein_q8_block_matmul, then one add
 *   h    = rms_norm(x, ffn_norm)                         bargein_rms_norm
 *   g    = silu(h @ W1.T) * (h @ W3.T)                   bargein_q8_block_matmul, bargein_silu_mul
 *   x    = x + g @ W2.T                                  bargein_q8_block_matmul, then one add
 *
 * with the features some families add (each NULL or 0 where a model has none; see
 * bargein.config.ModelConfig):
 *   - the embedding rows times embed_scale (Gemma's sqrt(hidden)), one float multiply;
 *   - q_norm, k_norm: each head of q and k RMS-normed (rows of head_dim) before RoPE
 *     (Qwen3, Gemma 3), gathered into rows of their own as the Python side reshapes them;
 *   - a local layer's own RoPE tables (Gemma 3) and its window, the score scale and soft cap
 *     (bargein_paged_attention_f16_ex), partial rotary being in the tables themselves;
 *   - post_attn_norm, post_ffn_norm: the attention's and the MLP's outputs RMS-normed before
 *     they are added (Gemma 2/3);
 *   - GeGLU (bargein_gelu_tanh_mul) in place of SwiGLU, and the logits soft-capped
 *     (bargein_softcap) after the head.
 *   - a mixture of experts in place of the MLP (layer->moe; Qwen2/3-MoE, Mixtral): routing,
 *     the chosen experts and their weighted sum (moe_matmul.c), and a shared expert
 *     behind its sigmoid gate (Qwen2-MoE), as bargein/model/moe.py's fast path runs them.
 *
 * so its results (the hidden states and the K/V written) are bit for bit those of the
 * per-operation path: every kernel computes a row by the same code whatever the number of
 * rows and threads, and an add of two floats rounds alike in C and in PyTorch. With a head,
 * the last layer's attention and MLP run on the head's rows only (rows_t): the logits and
 * the K/V are the per-operation path's bits, the other rows' hidden states are not made. What the
 * call saves is Python: some fifteen ctypes calls and tensor allocations per layer.
 *
 * A weight is either a BlockWeight's arrays (bargein_q8_block_matmul) or, where its
 * `quant` is set, a GGUF file's blocks (bargein_qmat_t: any mix of types, segments and
 * row orders, read by bargein_gguf_matmul, as KernelSet.quant_linear reads it).
 *
 * The first stage of a model may hand its token embedding (bargein_fast_embed_t): the
 * rows of the forward's token ids are then looked up here, widened from their blocks as
 * BlockWeight.dequantize widens them (q * scale, then + min: two roundings), or from a
 * GGUF file's blocks as bargein_gguf_dequantize_rows widens them, or copied
 * from a float32 table. The last stage of a model may hand its head too (bargein_fast_head_t): the final norm and
 * the LM head then run on the rows asked for, as LlamaStage.forward runs them
 * (rms_norm of the gathered rows, then the int8 matmul), and write their logits.
 *
 * Contract (the Python caller, bargein/model/fused_layers.py, prepares it):
 *   layers[i]     the i-th layer's weights and caches (see bargein_fast_layer_t)
 *   x             (m, hidden) float32, contiguous; the input (or written from embed), overwritten
 *                 with the output; where `head` asks for some rows only, the last layer's
 *                 second half runs on those alone (rows_t) and x is left with that layer's input
 *   positions     (m,) int64: each token's position, a row of the RoPE tables
 *   slots         (m,) int64: the cache slot each token's K/V goes to
 *   block_tables, table_width, token_seq, token_ctx: as bargein_paged_attention_f16 takes
 *                 them (each token's context at least 1 and within its table row)
 *   head          NULL, or the head and the rows of x to compute logits for
 *   workspace     the call's buffers: at least bargein_fast_workspace_floats(shape, m) floats,
 *                 the caller's to keep from call to call (a prompt chunk's buffers, tens of
 *                 MB, mapped and unmapped by malloc on every call took a page fault and a
 *                 zeroed page per 4 KB each time)
 * Returns 0; -1 when scratch memory could not be had; -2 when the int8 matmul's `isa` is not
 * this CPU's; -3 when a slot lies outside a cache,
 * -4 when a position lies outside the RoPE tables, -5 when a logits row is not a row of x,
 * -6 when a token id is not a row of the embedding (all checked before anything is written),
 * -7 when a GGUF weight's block type has no kernels, -8 when the workspace is too small.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The exported kernels of the other files in this folder. */
int bargein_q8_block_matmul(const float *x, int64_t m, int64_t k, const uint8_t *qs, const float *scales,
                            const float *mins, int bits, int64_t n, float *y, int num_threads, int isa);
int bargein_gguf_dequantize_rows(const void *w, const int64_t *ids, int64_t count, float *out, int num_threads);
void bargein_rms_norm(const float *x, const float *w, float *y, int64_t m, int64_t n, float eps, int num_threads);
void bargein_silu_mul(const float *x, float *y, int64_t m, int64_t n, int num_threads);
void bargein_rope_store_f16(const float *qkv, const float *cos, const float *sin, const int64_t *slots,
                            uint16_t *k_cache, uint16_t *v_cache, float *q_out, int64_t num_tokens, int num_heads,
                            int num_kv_heads, int head_dim, int num_threads);
int bargein_paged_attention_f16_ex(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                   const int64_t *block_tables, int64_t table_width, const int64_t *query_seq,
                                   const int64_t *query_ctx, float *out, int64_t num_queries, int num_heads,
                                   int num_kv_heads, int head_dim, int block_size, float scale, int64_t window,
                                   float softcap, int num_threads);
void bargein_gelu_tanh_mul(const float *x, float *y, int64_t m, int64_t n, int num_threads);
void bargein_softcap(const float *x, float *y, int64_t m, int64_t n, float cap, int num_threads);

#include "fast_forward.h" /* and gguf_matrix.h: bargein_gguf_matmul */

#include "moe_matmul.h"

static int embed_rows(const bargein_fast_embed_t *e, float *x, int64_t m, int64_t hidden, int threads) {
    const bargein_q8_weight_t *w = &e->blocks;
    if (!e->dense && w->quant) return bargein_gguf_dequantize_rows(w->quant, e->ids, m, x, threads) ? -7 : 0;
    const int64_t nb = hidden / 32;
    for (int64_t t = 0; t < m; t++) {
        float *row = x + t * hidden;
        const int64_t id = e->ids[t];
        if (e->dense) {
            memcpy(row, e->dense + id * hidden, sizeof(float) * (size_t)hidden);
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            const float scale = w->scales[id * nb + b];
            float *out = row + b * 32;
            if (w->bits == 4) {
                const uint8_t *q = w->qs + (id * nb + b) * 16;
                const float min = w->mins[id * nb + b];
                for (int i = 0; i < 16; i++) {
                    const float lo = (float)(q[i] & 0x0F) * scale, hi = (float)(q[i] >> 4) * scale;
                    out[i] = lo + min;
                    out[i + 16] = hi + min;
                }
            } else {
                const int8_t *q = (const int8_t *)w->qs + (id * nb + b) * 32;
                for (int i = 0; i < 32; i++) out[i] = (float)q[i] * scale;
            }
        }
    }
    return 0;
}

static int matmul(const float *x, int64_t m, const bargein_q8_weight_t *w, float *y, int threads, int isa) {
    if (w->quant) {
        const int status = bargein_gguf_matmul(x, m, w->quant, y, 0, threads, isa);
        return status == -3 ? -7 : status;
    }
    return bargein_q8_block_matmul(x, m, w->k, w->qs, w->scales, w->mins, (int)w->bits, w->n, y, threads, isa);
}

static void add_into(float *x, const float *y, int64_t count) {
    for (int64_t i = 0; i < count; i++) x[i] = x[i] + y[i];
}

/* RMS-norms each of `heads` heads (head_dim d) at column `first` of every token's row of qkv
 * (m rows of `width`), in place: gathered into rows of d (gather), normed into out, put back. */
static void norm_heads(float *qkv, int64_t m, int64_t width, int64_t first, int64_t heads, int64_t d,
                       const float *w, float eps, float *gather, float *out, int threads) {
    for (int64_t t = 0; t < m; t++)
        memcpy(gather + t * heads * d, qkv + t * width + first, sizeof(float) * (size_t)(heads * d));
    bargein_rms_norm(gather, w, out, m * heads, d, eps, threads);
    for (int64_t t = 0; t < m; t++)
        memcpy(qkv + t * width + first, out + t * heads * d, sizeof(float) * (size_t)(heads * d));
}

/* x += y, or x += rms_norm(y, post_norm) (into scratch) where the layer has a post-norm. */
static void add_branch(float *x, const float *y, const float *post_norm, float *scratch, int64_t m, int64_t hidden,
                       float eps, int threads) {
    if (post_norm) {
        bargein_rms_norm(y, post_norm, scratch, m, hidden, eps, threads);
        y = scratch;
    }
    add_into(x, y, m * hidden);
}

/* y = the mixture of experts' MLP of x (m, hidden), as MoEFeedForward's fast path computes it:
 * routing, the chosen experts grouped by expert with their weighted sum (moe_matmul.c),
 * then, with a shared expert, y = y + gate * shared(x) (a product, then a sum: two roundings,
 * as PyTorch's two operations). */
static int moe_mlp(const bargein_fast_moe_t *moe, const float *x, int64_t m, int64_t hidden, float *y, int threads,
                   int isa, bargein_moe_scratch_t *scratch) {
    const int64_t rows = m > 0 ? m : 1, k = moe->topk, shared = moe->shared_w13.n ? moe->shared_w2.k : 0;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(rows * k));
    float *weights = malloc(sizeof(float) * (size_t)(rows * k)), *gate = malloc(sizeof(float) * (size_t)rows);
    float *gate_up = shared ? malloc(sizeof(float) * (size_t)(rows * 2 * shared)) : NULL;
    float *act = shared ? malloc(sizeof(float) * (size_t)(rows * shared)) : NULL;
    float *out = shared ? malloc(sizeof(float) * (size_t)(rows * hidden)) : NULL;
    int status = ids && weights && gate && (!shared || (gate_up && act && out)) ? 0 : -1;
    if (status == 0)
        status = bargein_moe_route(x, m, hidden, moe->router, moe->experts, moe->rows_w, k, (int)moe->norm, ids,
                                   weights, gate, threads);
    if (status == 0) {
        status = bargein_moe_experts_in(x, m, hidden, moe->inter, moe->gate, moe->up, moe->down, moe->experts, ids,
                                        weights, k, y, 0, threads, isa, scratch);
        if (status == -3) status = -7;
    }
    if (status == 0 && shared) {
        if ((status = matmul(x, m, &moe->shared_w13, gate_up, threads, isa)) == 0) {
            bargein_silu_mul(gate_up, act, m, shared, threads);
            status = matmul(act, m, &moe->shared_w2, out, threads, isa);
        }
        for (int64_t r = 0; r < m && status == 0; r++)
            for (int64_t i = 0; i < hidden; i++) y[r * hidden + i] = y[r * hidden + i] + gate[r] * out[r * hidden + i];
    }
    free(ids);
    free(weights);
    free(gate);
    free(gate_up);
    free(act);
    free(out);
    return status;
}

/* The head on rows `rows` of x (NULL: rows 0 .. num_rows - 1, x holding only them). */
static int run_head(const bargein_fast_head_t *head, const float *x, const int64_t *rows, int64_t hidden, float eps,
                    float final_softcap, int threads, int isa) {
    const int64_t r = head->num_rows > 0 ? head->num_rows : 1;
    float *gathered = malloc(sizeof(float) * (size_t)(r * hidden)), *normed = malloc(sizeof(float) * (size_t)(r * hidden));
    int status = -1;
    if (gathered && normed) {
        for (int64_t i = 0; i < head->num_rows; i++)
            memcpy(gathered + i * hidden, x + (rows ? rows[i] : i) * hidden, sizeof(float) * (size_t)hidden);
        bargein_rms_norm(gathered, head->norm, normed, head->num_rows, hidden, eps, threads);
        status = matmul(normed, head->num_rows, &head->weight, head->logits, threads, isa);
        if (status == 0 && final_softcap > 0.0f)
            bargein_softcap(head->logits, head->logits, head->num_rows, head->weight.n, final_softcap, threads);
    }
    free(gathered);
    free(normed);
    return status;
}

/* The rows a layer's second half (its attention onward) runs on: every row of the call, or
 * in a stage's last layer where the call has a head, the head's rows alone, gathered. Only
 * they reach the logits; the layer's K/V, which later tokens read, come from its first half
 * (the QKV matmul and RoPE) and are written for every row before. So a prompt chunk's last
 * layer runs its attention, output projection and MLP on one row (none where the chunk asks
 * for no logits), as llama.cpp's graphs leave out the outputs nothing reads; each kernel
 * computes a row by the same code whatever the rows beside it, so the logits keep their bits. */
typedef struct {
    int64_t m;                  /* the rows */
    float *x;                   /* (m, hidden): their hidden states */
    const float *q;             /* (m, q_width): their queries, as RoPE wrote them */
    const int64_t *seq, *ctx;   /* (m,): their sequences and contexts, as the attention takes them */
    void *held;                 /* the gathered copies (NULL: the call's own rows) */
} rows_t;

/* The head's rows of x, q, seq and ctx (m rows each) gathered into `out`; the call's own where
 * the head asks for as many rows as there are or more (some twice: the workspace's buffers
 * hold m rows). Returns 0, or -1 when memory could not be had. */
static int head_rows(const bargein_fast_head_t *head, int64_t m, float *x, const float *q, const int64_t *seq,
                     const int64_t *ctx, int64_t hidden, int64_t q_width, rows_t *out) {
    *out = (rows_t){m, x, q, seq, ctx, NULL};
    if (head->num_rows >= m) return 0;
    const int64_t r = head->num_rows;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(2 * r + 1) + sizeof(float) * (size_t)(r * (hidden + q_width)));
    if (!ids) return -1;
    float *xs = (float *)(ids + 2 * r + 1), *qs = xs + r * hidden;
    for (int64_t i = 0; i < r; i++) {
        const int64_t row = head->rows[i];
        memcpy(xs + i * hidden, x + row * hidden, sizeof(float) * (size_t)hidden);
        memcpy(qs + i * q_width, q + row * q_width, sizeof(float) * (size_t)q_width);
        ids[i] = seq[row], ids[r + i] = ctx[row];
    }
    *out = (rows_t){r, xs, qs, ids, ids + r, ids};
    return 0;
}

/* A call's buffers in its workspace, each starting a multiple of 16 floats (64 bytes) from the
 * workspace's start (torch's CPU allocations start on a 64-byte boundary). */
typedef struct {
    float *normed, *qkv, *q, *attn, *proj, *gate_up, *act, *cos, *sin, *local_cos, *local_sin;
} buffers_t;

/* Lays the buffers of an m-row call out from `base` (NULL: only counts); returns the floats
 * they take. */
static int64_t lay_out(const bargein_fast_shape_t *shape, int64_t m, float *base, buffers_t *out) {
    const int64_t hidden = shape->hidden, heads = shape->num_heads, kv_heads = shape->num_kv_heads;
    const int64_t d = shape->head_dim, q_width = heads * d, qkv_width = (heads + 2 * kv_heads) * d;
    const int64_t inter = shape->intermediate, rows = m > 0 ? m : 1;
    const int has_local = shape->local_cos_table && shape->local_sin_table;
    const int64_t sizes[11] = {rows * hidden, rows * qkv_width, rows * q_width, rows * q_width, rows * hidden,
                               rows * 2 * inter, rows * inter, rows * d, rows * d, has_local ? rows * d : 0,
                               has_local ? rows * d : 0};
    float **slots[11] = {&out->normed, &out->qkv, &out->q, &out->attn, &out->proj, &out->gate_up,
                         &out->act, &out->cos, &out->sin, &out->local_cos, &out->local_sin};
    int64_t at = 0;
    for (int i = 0; i < 11; i++) {
        if (base) *slots[i] = base + at;
        at += (sizes[i] + 15) / 16 * 16;
    }
    if (base && !has_local) out->local_cos = out->cos, out->local_sin = out->sin;
    return at;
}

int64_t bargein_fast_workspace_floats(const bargein_fast_shape_t *shape, int64_t m) {
    buffers_t unused;
    return lay_out(shape, m, NULL, &unused);
}

int bargein_fast_layers(const bargein_fast_layer_t *layers, int num_layers, const bargein_fast_shape_t *shape,
                        float *x, int64_t m, const int64_t *positions, const int64_t *slots,
                        const int64_t *block_tables, int64_t table_width, const int64_t *token_seq,
                        const int64_t *token_ctx, const bargein_fast_embed_t *embed, const bargein_fast_head_t *head,
                        float *workspace, int64_t workspace_floats, int num_threads, int isa) {
    for (int64_t t = 0; t < m; t++) {
        if (slots[t] < 0 || slots[t] >= shape->num_slots) return -3;
        if (positions[t] < 0 || positions[t] >= shape->num_positions) return -4;
    }
    for (int64_t i = 0; head && i < head->num_rows; i++)
        if (head->rows[i] < 0 || head->rows[i] >= m) return -5;
    for (int64_t t = 0; embed && t < m; t++)
        if (embed->ids[t] < 0 || embed->ids[t] >= embed->vocab) return -6;
    buffers_t buf;
    if (!workspace || workspace_floats < lay_out(shape, m, workspace, &buf)) return -8;
    const int64_t hidden = shape->hidden, heads = shape->num_heads, kv_heads = shape->num_kv_heads;
    const int64_t d = shape->head_dim, q_width = heads * d, qkv_width = (heads + 2 * kv_heads) * d;
    const int64_t inter = shape->intermediate;
    float *normed = buf.normed, *qkv = buf.qkv, *q = buf.q, *attn = buf.attn, *proj = buf.proj;
    float *gate_up = buf.gate_up, *act = buf.act, *cos = buf.cos, *sin = buf.sin;
    float *local_cos = buf.local_cos, *local_sin = buf.local_sin;
    const int has_local = shape->local_cos_table && shape->local_sin_table;
    int status = 0;
    bargein_moe_scratch_t moe_scratch = {NULL, 0}; /* the MoE layers' buffers, shared by them */
    if (embed) status = embed_rows(embed, x, m, hidden, num_threads);
    if (status == 0 && shape->embed_scale != 0.0f)
        for (int64_t j = 0; j < m * hidden; j++) x[j] = x[j] * shape->embed_scale;
    for (int64_t t = 0; t < m && status == 0; t++) { /* each token's angles, shared by every layer */
        memcpy(cos + t * d, shape->cos_table + positions[t] * d, sizeof(float) * (size_t)d);
        memcpy(sin + t * d, shape->sin_table + positions[t] * d, sizeof(float) * (size_t)d);
        if (has_local) {
            memcpy(local_cos + t * d, shape->local_cos_table + positions[t] * d, sizeof(float) * (size_t)d);
            memcpy(local_sin + t * d, shape->local_sin_table + positions[t] * d, sizeof(float) * (size_t)d);
        }
    }
    rows_t tail = {m, x, q, token_seq, token_ctx, NULL}; /* the rows of each layer's second half */
    for (int i = 0; i < num_layers && status == 0; i++) {
        const bargein_fast_layer_t *layer = &layers[i];
        bargein_rms_norm(x, layer->attn_norm, normed, m, hidden, shape->eps, num_threads);
        if ((status = matmul(normed, m, &layer->wqkv, qkv, num_threads, isa))) break;
        if (layer->qkv_bias)
            for (int64_t t = 0; t < m; t++)
                for (int64_t j = 0; j < qkv_width; j++) qkv[t * qkv_width + j] += layer->qkv_bias[j];
        /* q and attn are free until RoPE writes q: the heads' scratch rows */
        if (layer->q_norm) norm_heads(qkv, m, qkv_width, 0, heads, d, layer->q_norm, shape->eps, attn, q, num_threads);
        if (layer->k_norm)
            norm_heads(qkv, m, qkv_width, q_width, kv_heads, d, layer->k_norm, shape->eps, attn, q, num_threads);
        bargein_rope_store_f16(qkv, layer->local ? local_cos : cos, layer->local ? local_sin : sin, slots,
                               layer->k_cache, layer->v_cache, q, m, (int)heads, (int)kv_heads, (int)d, num_threads);
        if (head && i == num_layers - 1 &&
            (status = head_rows(head, m, x, q, token_seq, token_ctx, hidden, q_width, &tail)))
            break;
        const int64_t n = tail.m;
        if (n == 0) continue;
        if ((status = bargein_paged_attention_f16_ex(tail.q, layer->k_cache, layer->v_cache, block_tables, table_width,
                                                     tail.seq, tail.ctx, attn, n, (int)heads, (int)kv_heads, (int)d,
                                                     (int)shape->block_size, shape->scale, layer->window,
                                                     shape->softcap, num_threads)))
            break;
        if ((status = matmul(attn, n, &layer->wo, proj, num_threads, isa))) break;
        add_branch(tail.x, proj, layer->post_attn_norm, normed, n, hidden, shape->eps, num_threads);
        bargein_rms_norm(tail.x, layer->ffn_norm, normed, n, hidden, shape->eps, num_threads);
        if (layer->moe) {
            if ((status = moe_mlp(layer->moe, normed, n, hidden, proj, num_threads, isa, &moe_scratch))) break;
        } else {
            if ((status = matmul(normed, n, &layer->w13, gate_up, num_threads, isa))) break;
            if (shape->gelu)
                bargein_gelu_tanh_mul(gate_up, act, n, inter, num_threads);
            else
                bargein_silu_mul(gate_up, act, n, inter, num_threads);
            if ((status = matmul(act, n, &layer->w2, proj, num_threads, isa))) break;
        }
        add_branch(tail.x, proj, layer->post_ffn_norm, normed, n, hidden, shape->eps, num_threads);
    }
    if (status == 0 && head)
        status = run_head(head, tail.x, tail.held ? NULL : head->rows, hidden, shape->eps, shape->final_softcap,
                          num_threads, isa);
    free(tail.held);
    bargein_moe_scratch_free(&moe_scratch);
    return status;
}
