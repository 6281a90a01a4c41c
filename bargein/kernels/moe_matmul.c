/*
 * Mixture-of-experts feed-forward on the CPU: routing, the experts' SwiGLU MLPs grouped by
 * expert, and the weighted sum, one call each per layer and step.
 *
 * Routing (bargein_moe_route). For row r of x (m, hidden) and router R (rows_w, hidden):
 *   logit[e] = <x[r], R[e]>, summed in 8 lanes (lane l takes i = l mod 8, in order), the
 *              lanes then added ((0+4)+(1+5))+((2+6)+(3+7));
 *   p = softmax(logit[0 .. experts)) (max subtracted, expf, summed in expert order);
 *   the top `topk` of p, largest first (a tie goes to the lower expert), as ids[r, s] and
 *   weights[r, s] = p, divided by their sum (in slot order) where `norm`;
 *   where rows_w == experts + 1 (Qwen2-MoE's shared-expert gate as R's last row),
 *   gate[r] = 1 / (1 + expf(-logit[experts])).
 *
 * Experts (bargein_moe_experts). Each expert e has gate, up (inter, hidden) and down
 * (hidden, inter) matrices in a GGUF file's blocks (bargein_qmat_t, read in place: a slice
 * of a stacked expert tensor in the mapped file). The rows that chose e are gathered (in
 * row order), and every (expert, column tile) of gate and up together, and of down, is one
 * work item: gguf_matmul.c's bargein_gguf_matmul over the tile's rows of the matrices (a
 * descriptor pointing into the expert's blocks, no copy: gate's and up's tiles as two
 * segments of one matrix, so that the rows' activations are quantized once for both) for
 * all of the expert's rows at once, on one thread. The work items of gate and up share one
 * parallel region, those of down another; an expert no row chose has no work item and is
 * not read. Between them h = silu(g) * u with
 * silu(a) = a / (1 + expf(-a)), and at the end
 *   y[r] = w[r, 0] * out[r, 0] + w[r, 1] * out[r, 1] + ... (slot order, each product and
 *          sum rounded: the library is built with -ffp-contract=off).
 *
 * Invariance. bargein_gguf_matmul's output for a row depends on that row, the column and
 * the weight only (not on the row count, the tile, the thread count or the instruction
 * set; see gguf_matmul.c), and everything else here is row by row in a fixed order: so a
 * token's y depends on nothing but its own row, whichever rows share the step and
 * whichever experts they chose.
 *
 * Returns 0; -1 when scratch memory could not be had; -6 for an expert id outside
 * [0, experts); any other status is bargein_gguf_matmul's.
 */
#include "exp.h" /* bargein_expf: libm's expf rounds apart on x86-64 and AArch64 */
#include "moe_matmul.h"
#include "parallel.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>



/* Output columns per work item: about ITEMS_PER_THREAD items per thread over the chosen
 * experts' columns, in multiples of 16 within [MIN_TILE, MAX_TILE]. Few items keep the
 * per-call cost (scratch, activation quantization) small against the blocks read; enough
 * of them keep every thread busy. A column's result does not depend on its tile. */
#define ITEMS_PER_THREAD 8
#define MIN_TILE 32
#define MAX_TILE 1024 /* a tile of all of gate's and up's columns, or down's, writes no copy */

/* ---- routing ------------------------------------------------------------------------- */

typedef struct {
    const float *x, *router;
    int64_t m, hidden, experts, rows_w, topk;
    int norm;
    int64_t *ids;
    float *weights, *gate;
} route_t;

/* Eight lanes as one vector (GCC and Clang lower it to the target's registers: one AVX
 * register, two SSE or NEON ones): a lane's multiply and add round as the scalar ones do
 * (no fma: -ffp-contract=off), so every target gives the per-lane loop's bits. */
typedef float lanes8_t __attribute__((vector_size(32)));

static float dot8(const float *a, const float *b, int64_t n) {
    lanes8_t acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        lanes8_t va, vb;
        memcpy(&va, a + i, sizeof va);
        memcpy(&vb, b + i, sizeof vb);
        acc = acc + va * vb;
    }
    float lanes[8];
    memcpy(lanes, &acc, sizeof lanes);
    for (int l = 0; i < n; i++, l++) lanes[l] += a[i] * b[i];
    return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

static void route_rows(void *arg, int index, int count) {
    const route_t *job = (const route_t *)arg;
    float *logit = malloc(sizeof(float) * (size_t)job->rows_w);
    if (!logit) return; /* the caller checks ids[0] = -1 marks left */
    for (int64_t r = job->m * index / count; r < job->m * (index + 1) / count; r++) {
        const float *x = job->x + r * job->hidden;
        for (int64_t e = 0; e < job->rows_w; e++) logit[e] = dot8(x, job->router + e * job->hidden, job->hidden);
        float mx = logit[0];
        for (int64_t e = 1; e < job->experts; e++) mx = logit[e] > mx ? logit[e] : mx;
        float sum = 0.0f;
        for (int64_t e = 0; e < job->experts; e++) sum += bargein_expf(logit[e] - mx);
        int64_t *ids = job->ids + r * job->topk;
        float *w = job->weights + r * job->topk;
        float chosen = 0.0f;
        for (int64_t s = 0; s < job->topk; s++) {
            int64_t best = -1;
            for (int64_t e = 0; e < job->experts; e++) {
                int taken = 0;
                for (int64_t t = 0; t < s; t++) taken |= ids[t] == e;
                if (!taken && (best < 0 || logit[e] > logit[best])) best = e;
            }
            ids[s] = best;
            w[s] = bargein_expf(logit[best] - mx) / sum;
            chosen += w[s];
        }
        if (job->norm)
            for (int64_t s = 0; s < job->topk; s++) w[s] /= chosen;
        if (job->rows_w > job->experts) job->gate[r] = 1.0f / (1.0f + bargein_expf(-logit[job->experts]));
    }
    free(logit);
}

/* ids (m, topk) int64, weights (m, topk) float, gate (m) float (read only where rows_w ==
 * experts + 1). Returns 0, or -1 when scratch memory could not be had. */
int bargein_moe_route(const float *x, int64_t m, int64_t hidden, const float *router, int64_t experts,
                      int64_t rows_w, int64_t topk, int norm, int64_t *ids, float *weights, float *gate,
                      int num_threads) {
    for (int64_t i = 0; i < m * topk; i++) ids[i] = -1;
    route_t job = {x, router, m, hidden, experts, rows_w, topk, norm, ids, weights, gate};
    const int64_t threads = m / 4 < num_threads ? m / 4 : num_threads;
    bargein_parallel_run(route_rows, &job, threads > 1 ? (int)threads : 1);
    for (int64_t i = 0; i < m * topk; i++)
        if (ids[i] < 0) return -1;
    return 0;
}

/* ---- experts ------------------------------------------------------------------------- */

/* One work item: columns [col0, col0 + tile) of segment `seg` of one expert's matrix w, into
 * output columns from out_col; where w2 is set, the same columns of its segment seg2 too (up's
 * tile beside gate's: one matmul, one quantization of the rows), into columns from out_col2. */
typedef struct {
    int64_t expert, seg, col0, out_col, seg2, out_col2;
    const bargein_qmat_t *w, *w2;
} item_t;

typedef struct {
    const item_t *items;
    int64_t num_items;
    const int64_t *cost;  /* (num_items + 1): the items' running cost (rows x columns), for sharing out */
    const float *in;      /* (P, in_width), rows grouped by expert */
    int64_t in_width;
    float *out;           /* (P, out_width) */
    int64_t out_width;
    const int64_t *first; /* (experts + 1): an expert's first grouped row */
    float *scratch;       /* per thread: max rows of an expert x 2 tiles */
    int64_t scratch_floats;
    int *status;          /* per thread */
    int64_t tile;
    int exact, isa;
} phase_t;

static int64_t item_cols(const item_t *it, int64_t tile) {
    const int64_t left = it->w->segs[it->seg].rows - it->col0;
    return left < tile ? left : tile;
}

/* Rows [col0, col0 + cols) of a segment, in place. */
static bargein_qseg_t seg_part(const bargein_qseg_t *seg, int64_t col0, int64_t cols) {
    bargein_qseg_t part = *seg;
    part.rows = cols;
    if (seg->order) part.order = seg->order + col0;
    else part.data = seg->data + col0 * seg->row_bytes;
    return part;
}

static void run_items(void *arg, int index, int count) {
    const phase_t *job = (const phase_t *)arg;
    float *tmp = job->scratch + (int64_t)index * job->scratch_floats;
    /* A thread takes the items that start within its share of the total cost: experts chosen
     * by many rows cost more than those chosen by few. */
    const int64_t total = job->cost[job->num_items];
    const int64_t from = total * index / count, to = total * (index + 1) / count;
    int64_t t = 0;
    while (t < job->num_items && job->cost[t] < from) t++;
    for (; t < job->num_items && job->cost[t] < to; t++) {
        const item_t *it = &job->items[t];
        const int64_t cols = item_cols(it, job->tile), width = it->w2 ? 2 * cols : cols;
        bargein_qseg_t parts[2];
        parts[0] = seg_part(&it->w->segs[it->seg], it->col0, cols);
        if (it->w2) parts[1] = seg_part(&it->w2->segs[it->seg2], it->col0, cols);
        const bargein_qmat_t tile = {parts, it->w2 ? 2 : 1, width, it->w->k};
        const int64_t r0 = job->first[it->expert], rows = job->first[it->expert + 1] - r0;
        /* an item of all the output's columns, in their order, writes the output rows itself */
        const int whole = width == job->out_width && it->out_col == 0 && (!it->w2 || it->out_col2 == cols);
        float *y = whole ? job->out + r0 * job->out_width : tmp;
        const int status = bargein_gguf_matmul(job->in + r0 * job->in_width, rows, &tile, y, job->exact, 1, job->isa);
        if (status) {
            job->status[index] = status;
            return;
        }
        for (int64_t i = 0; i < rows && !whole; i++) {
            float *row = job->out + (r0 + i) * job->out_width;
            memcpy(row + it->out_col, tmp + i * width, sizeof(float) * (size_t)cols);
            if (it->w2) memcpy(row + it->out_col2, tmp + i * width + cols, sizeof(float) * (size_t)cols);
        }
    }
}

typedef struct {
    float *gu;  /* (P, 2 inter): [g | u] */
    float *h;   /* (P, inter) */
    int64_t rows, inter;
} swiglu_t;

static void swiglu_rows(void *arg, int index, int count) {
    const swiglu_t *job = (const swiglu_t *)arg;
    for (int64_t r = job->rows * index / count; r < job->rows * (index + 1) / count; r++) {
        const float *g = job->gu + r * 2 * job->inter, *u = g + job->inter;
        float *h = job->h + r * job->inter;
        for (int64_t i = 0; i < job->inter; i++) h[i] = g[i] / (1.0f + bargein_expf(-g[i])) * u[i];
    }
}

typedef struct {
    const float *out, *weights;
    const int64_t *pos; /* (m, topk): the grouped row of (r, s) */
    float *y;
    int64_t m, hidden, topk;
} combine_t;

static void combine_rows(void *arg, int index, int count) {
    const combine_t *job = (const combine_t *)arg;
    for (int64_t r = job->m * index / count; r < job->m * (index + 1) / count; r++) {
        float *y = job->y + r * job->hidden;
        for (int64_t s = 0; s < job->topk; s++) {
            const float w = job->weights[r * job->topk + s];
            const float *o = job->out + job->pos[r * job->topk + s] * job->hidden;
            if (s == 0)
                for (int64_t i = 0; i < job->hidden; i++) y[i] = w * o[i];
            else
                for (int64_t i = 0; i < job->hidden; i++) y[i] += w * o[i];
        }
    }
}

/* Whether w2's segments pair with w's (the same number, each of the same rows). */
static int pairable(const bargein_qmat_t *w, const bargein_qmat_t *w2) {
    if (w->num_segs != w2->num_segs || w->k != w2->k) return 0;
    for (int64_t s = 0; s < w->num_segs; s++)
        if (w->segs[s].rows != w2->segs[s].rows) return 0;
    return 1;
}

/* The work items of matrices w[e] (into output columns from out_base) and, where w2 is not
 * NULL, w2[e] (from out_base2), for the experts with rows: each segment's rows in tiles, a
 * tile of w2 beside the same tile of w where their segments pair. */
static int64_t list_items(item_t *items, const bargein_qmat_t *const *w, const bargein_qmat_t *const *w2,
                          const int64_t *first, int64_t experts, int64_t out_base, int64_t out_base2, int64_t tile) {
    int64_t count = 0;
    for (int64_t e = 0; e < experts; e++) {
        if (first[e + 1] == first[e]) continue; /* no row chose it: never read */
        const int paired = w2 && pairable(w[e], w2[e]);
        int64_t col = out_base, col2 = out_base2;
        for (int64_t s = 0; s < w[e]->num_segs; s++) {
            for (int64_t c = 0; c < w[e]->segs[s].rows; c += tile)
                items[count++] = (item_t){e, s, c, col + c, s, col2 + c, w[e], paired ? w2[e] : NULL};
            col += w[e]->segs[s].rows;
            col2 += w[e]->segs[s].rows;
        }
        if (!w2 || paired) continue;
        col2 = out_base2;
        for (int64_t s = 0; s < w2[e]->num_segs; s++) {
            for (int64_t c = 0; c < w2[e]->segs[s].rows; c += tile)
                items[count++] = (item_t){e, s, c, col2 + c, 0, 0, w2[e], NULL};
            col2 += w2[e]->segs[s].rows;
        }
    }
    return count;
}

static int64_t tiles_of(const bargein_qmat_t *const *w, int64_t experts, int64_t tile) {
    int64_t count = 0;
    for (int64_t e = 0; e < experts; e++)
        for (int64_t s = 0; s < w[e]->num_segs; s++) count += (w[e]->segs[s].rows + tile - 1) / tile;
    return count;
}

/* The tile for this call (see ITEMS_PER_THREAD), from the columns of the experts rows chose. */
static int64_t tile_for(const int64_t *first, int64_t experts, int64_t columns_per_expert, int num_threads) {
    int64_t chosen = 0;
    for (int64_t e = 0; e < experts; e++) chosen += first[e + 1] > first[e];
    int64_t tile = chosen * columns_per_expert / ((int64_t)ITEMS_PER_THREAD * num_threads);
    tile = (tile + 15) / 16 * 16;
    return tile < MIN_TILE ? MIN_TILE : tile > MAX_TILE ? MAX_TILE : tile;
}

static int run_phase(phase_t *job, int64_t *cost, int num_threads) {
    cost[0] = 0;
    for (int64_t t = 0; t < job->num_items; t++) {
        const item_t *it = &job->items[t];
        const int64_t rows = job->first[it->expert + 1] - job->first[it->expert];
        cost[t + 1] = cost[t] + rows * item_cols(it, job->tile) * (it->w2 ? 2 : 1);
    }
    job->cost = cost;
    int threads = job->num_items < num_threads ? (int)job->num_items : num_threads;
    if (threads < 1) threads = 1;
    for (int i = 0; i < threads; i++) job->status[i] = 0;
    bargein_parallel_run(run_items, job, threads);
    for (int i = 0; i < threads; i++)
        if (job->status[i]) return job->status[i];
    return 0;
}

void bargein_moe_scratch_free(bargein_moe_scratch_t *scratch) {
    free(scratch->data);
    scratch->data = NULL;
    scratch->bytes = 0;
}

/* `counts` float buffers of the given sizes, 64-byte aligned, from `scratch` (grown if it
 * is too small); 0, or -1 when memory could not be had. */
static int take_floats(bargein_moe_scratch_t *scratch, int count, const int64_t *sizes, float **out) {
    size_t total = 0;
    for (int i = 0; i < count; i++) total += ((size_t)(sizes[i] > 0 ? sizes[i] : 1) * sizeof(float) + 63) / 64 * 64;
    if (scratch->bytes < total) {
        bargein_moe_scratch_free(scratch);
        if (!(scratch->data = aligned_alloc(64, total))) return -1;
        scratch->bytes = total;
    }
    char *at = scratch->data;
    for (int i = 0; i < count; i++) {
        out[i] = (float *)at;
        at += ((size_t)(sizes[i] > 0 ? sizes[i] : 1) * sizeof(float) + 63) / 64 * 64;
    }
    return 0;
}

int bargein_moe_experts_in(const float *x, int64_t m, int64_t hidden, int64_t inter,
                           const bargein_qmat_t *const *gate, const bargein_qmat_t *const *up,
                           const bargein_qmat_t *const *down, int64_t experts, const int64_t *ids,
                           const float *weights, int64_t topk, float *y, int exact, int num_threads, int isa,
                           bargein_moe_scratch_t *scratch) {
    const int64_t pairs = m * topk;
    for (int64_t i = 0; i < pairs; i++)
        if (ids[i] < 0 || ids[i] >= experts) return -6;
    if (num_threads < 1) num_threads = 1;
    int status = -1;
    int64_t *first = calloc((size_t)experts + 1, sizeof(int64_t));
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(pairs > 0 ? pairs : 1));
    int64_t *fill = calloc((size_t)experts, sizeof(int64_t));
    int *statuses = malloc(sizeof(int) * (size_t)num_threads);
    item_t *items = NULL;
    int64_t *cost = NULL;
    if (!first || !pos || !fill || !statuses) goto done;
    /* Group the (row, slot) pairs by expert, rows in order within an expert. */
    for (int64_t i = 0; i < pairs; i++) first[ids[i] + 1]++;
    int64_t most = 0;
    for (int64_t e = 0; e < experts; e++) {
        most = first[e + 1] > most ? first[e + 1] : most;
        first[e + 1] += first[e];
    }
    const int64_t tile = tile_for(first, experts, 2 * inter + hidden, num_threads);
    const int64_t num_items = tiles_of(gate, experts, tile) + tiles_of(up, experts, tile) + tiles_of(down, experts, tile);
    items = malloc(sizeof(item_t) * (size_t)(num_items > 0 ? num_items : 1));
    cost = malloc(sizeof(int64_t) * (size_t)(num_items + 1));
    const int64_t scratch_floats = (most * 2 * tile + 15) / 16 * 16;
    const int64_t sizes[5] = {pairs * hidden, pairs * 2 * inter, pairs * inter, pairs * hidden,
                              scratch_floats * num_threads};
    float *buffers[5];
    if (!items || !cost || take_floats(scratch, 5, sizes, buffers)) goto done;
    float *xg = buffers[0], *gu = buffers[1], *h = buffers[2], *out = buffers[3];
    for (int64_t i = 0; i < pairs; i++) {
        const int64_t e = ids[i], p = first[e] + fill[e]++;
        pos[i] = p;
        memcpy(xg + p * hidden, x + (i / topk) * hidden, sizeof(float) * (size_t)hidden);
    }
    /* gate and up: one region */
    phase_t job = {items, list_items(items, gate, up, first, experts, 0, inter, tile), NULL, xg, hidden, gu,
                   2 * inter, first, buffers[4], scratch_floats, statuses, tile, exact, isa};
    if ((status = run_phase(&job, cost, num_threads))) goto done;
    swiglu_t act = {gu, h, pairs, inter};
    const int64_t act_threads = pairs / 4 < num_threads ? pairs / 4 : num_threads;
    bargein_parallel_run(swiglu_rows, &act, act_threads > 1 ? (int)act_threads : 1);
    /* down: another */
    job.num_items = list_items(items, down, NULL, first, experts, 0, 0, tile);
    job.in = h, job.in_width = inter, job.out = out, job.out_width = hidden;
    if ((status = run_phase(&job, cost, num_threads))) goto done;
    combine_t sum = {out, weights, pos, y, m, hidden, topk};
    const int64_t sum_threads = m / 4 < num_threads ? m / 4 : num_threads;
    bargein_parallel_run(combine_rows, &sum, sum_threads > 1 ? (int)sum_threads : 1);
    status = 0;
done:
    free(first);
    free(pos);
    free(fill);
    free(items);
    free(cost);
    free(statuses);
    return status;
}

int bargein_moe_experts(const float *x, int64_t m, int64_t hidden, int64_t inter, const bargein_qmat_t *const *gate,
                        const bargein_qmat_t *const *up, const bargein_qmat_t *const *down, int64_t experts,
                        const int64_t *ids, const float *weights, int64_t topk, float *y, int exact,
                        int num_threads, int isa) {
    bargein_moe_scratch_t scratch = {NULL, 0};
    const int status = bargein_moe_experts_in(x, m, hidden, inter, gate, up, down, experts, ids, weights, topk, y,
                                              exact, num_threads, isa, &scratch);
    bargein_moe_scratch_free(&scratch);
    return status;
}
