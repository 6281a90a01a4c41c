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
 * row order), and every (expert, column range) of gate and up together, and of down, is
 * one work item: gguf_matmul.c's bargein_gguf_matmul_expert over the range's rows of the
 * matrices (a descriptor pointing into the expert's blocks, no copy: gate's and up's ranges
 * as two segments of one matrix, so that the rows' activations are quantized once for
 * both) for all of the expert's rows at once, on one thread; a gate/up item then writes
 * h = silu(g) * u on its columns as the dense layers' SwiGLU does (rowwise.c's
 * bargein_silu_mul). All items of a layer share one parallel region with no barrier in
 * it (region_t): threads claim them one at a time, the gate/up items first, each kind the
 * costliest first; an expert's down items wait only for that expert's gate/up items. An
 * expert no row chose has no work item and is not read. Once a row's experts are all done
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
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


void bargein_silu_mul(const float *x, float *y, int64_t m, int64_t n, int num_threads); /* rowwise.c */

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

/* The sum of a's and b's lanes, as dot8 below adds them. */
static float lanes_sum(lanes8_t acc, const float *a, const float *b, int64_t i, int64_t n) {
    float lanes[8];
    memcpy(lanes, &acc, sizeof lanes);
    for (int l = 0; i < n; i++, l++) lanes[l] += a[i] * b[i];
    return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

static float dot8(const float *a, const float *b, int64_t n) {
    lanes8_t acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        lanes8_t va, vb;
        memcpy(&va, a + i, sizeof va);
        memcpy(&vb, b + i, sizeof vb);
        acc = acc + va * vb;
    }
    return lanes_sum(acc, a, b, i, n);
}

/* dot8(a, b[j * n ..], n) for j = 0 .. 3, bit for bit: four chains side by side, so that
 * each add need not wait for the one before it in its own chain. */
static void dot8_4(const float *a, const float *b, int64_t n, float *out) {
    lanes8_t acc[4] = {{0, 0, 0, 0, 0, 0, 0, 0}, {0, 0, 0, 0, 0, 0, 0, 0}, {0, 0, 0, 0, 0, 0, 0, 0},
                       {0, 0, 0, 0, 0, 0, 0, 0}};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        lanes8_t va;
        memcpy(&va, a + i, sizeof va);
        for (int j = 0; j < 4; j++) {
            lanes8_t vb;
            memcpy(&vb, b + j * n + i, sizeof vb);
            acc[j] = acc[j] + va * vb;
        }
    }
    for (int j = 0; j < 4; j++) out[j] = lanes_sum(acc[j], a, b + j * n, i, n);
}

static void route_rows(void *arg, int index, int count) {
    const route_t *job = (const route_t *)arg;
    float *logit = malloc(sizeof(float) * (size_t)job->rows_w);
    if (!logit) return; /* the caller checks ids[0] = -1 marks left */
    for (int64_t r = job->m * index / count; r < job->m * (index + 1) / count; r++) {
        const float *x = job->x + r * job->hidden;
        int64_t e = 0;
        for (; e + 4 <= job->rows_w; e += 4) dot8_4(x, job->router + e * job->hidden, job->hidden, logit + e);
        for (; e < job->rows_w; e++) logit[e] = dot8(x, job->router + e * job->hidden, job->hidden);
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

/* One work item: output columns [col0, col0 + cols) of one expert, for all its rows: of
 * gate and up together (the first kind, which then writes h = silu(g) * u on those
 * columns), or of down (the second). A range lies within one segment of each matrix it
 * reads. `cost` orders the items of a kind, largest first. */
typedef struct {
    int64_t expert, col0, cols, cost;
} item_t;

/* The matrices one kind of item reads and the buffers it reads and writes. */
typedef struct {
    const bargein_qmat_t *const *w, *const *w2; /* w2: up beside w's gate (gate/up items), or NULL */
    const float *in;      /* (P, in_width), rows grouped by expert */
    int64_t in_width;
    float *out;           /* (P, out_width) */
    int64_t out_width;
} kind_t;

/* One layer's experts as one parallel region. The gate/up items come first in `items`,
 * then the down items: a thread claims the next item of the list, so every gate/up item
 * is claimed before any down item. A down item of expert e waits for e's gate/up items
 * (up_left[e] reaching 0; they are all claimed by then, so running on other threads, and
 * the wait ends); a row's weighted sum is written by the thread that finishes the last
 * down item any of its slots needs (row_left[r] reaching 0). So no thread waits at a
 * barrier between gate/up and down, or before the sum: with experts of 9 rows beside
 * experts of 1, a thread that is done with its part takes the next item, of either kind. */
typedef struct {
    const item_t *items;  /* gate/up items then down items, each kind largest cost first */
    int64_t num_up, num_items;
    _Atomic int64_t next; /* the next item to claim */
    _Atomic int64_t *up_left;  /* (experts): gate/up items of e not yet done */
    _Atomic int64_t *row_left; /* (m): down items that row r's slots need, not yet done */
    kind_t kinds[2];      /* gate/up, down */
    const int64_t *first; /* (experts + 1): an expert's first grouped row */
    const int64_t *owner; /* (P): the row of x a grouped row belongs to */
    const int64_t *pos;   /* (m, topk): the grouped row of (r, s) */
    const float *weights; /* (m, topk) */
    float *y;
    int64_t hidden, topk;
    float *scratch;       /* per thread: scratch_floats */
    int64_t scratch_floats;
    int *status;          /* per thread */
    _Atomic int failed;   /* set on any item's failure: the others stop claiming */
    int exact, isa;
} region_t;

/* Rows [col0, col0 + cols) of matrix w (which lie in one segment), in place. */
static bargein_qseg_t rows_of(const bargein_qmat_t *w, int64_t col0, int64_t cols) {
    const bargein_qseg_t *seg = w->segs;
    while (col0 >= seg->rows) col0 -= seg++->rows;
    bargein_qseg_t part = *seg;
    part.rows = cols;
    if (seg->order) part.order = seg->order + col0;
    else part.data = seg->data + col0 * seg->row_bytes;
    return part;
}

/* Where the segment of w that holds row c ends. */
static int64_t segment_end(const bargein_qmat_t *w, int64_t c) {
    int64_t end = 0;
    for (int64_t s = 0; s < w->num_segs && end <= c; s++) end += w->segs[s].rows;
    return end;
}

/* y[r] = w[r, 0] * out[r, 0] + w[r, 1] * out[r, 1] + ... (slot order, each product and
 * sum rounded: the library is built with -ffp-contract=off). */
static void combine_row(const region_t *job, int64_t r) {
    const float *out = job->kinds[1].out;
    float *y = job->y + r * job->hidden;
    for (int64_t s = 0; s < job->topk; s++) {
        const float w = job->weights[r * job->topk + s];
        const float *o = out + job->pos[r * job->topk + s] * job->hidden;
        if (s == 0)
            for (int64_t i = 0; i < job->hidden; i++) y[i] = w * o[i];
        else
            for (int64_t i = 0; i < job->hidden; i++) y[i] += w * o[i];
    }
}

/* Until expert e's gate/up items are done (their h rows written: the acquire pairs with
 * their release). Spins briefly, then yields the core: the thread it waits for may be
 * descheduled on a loaded machine, and needs a core more than this one does. */
static void wait_for_up(region_t *job, int64_t e) {
    for (int spins = 0; atomic_load_explicit(&job->up_left[e], memory_order_acquire) > 0; spins++) {
        if (atomic_load_explicit(&job->failed, memory_order_relaxed)) return; /* the item failed */
        if (spins < 256) CPU_RELAX();
        else sched_yield();
    }
}

/* Items are claimed one at a time, in list order, by whichever thread is free: a thread
 * that was descheduled, or got the experts chosen by many rows, leaves the rest to the
 * others. Which thread runs an item changes no bit of its output. */
static void run_items(void *arg, int index, int count) {
    (void)count;
    region_t *job = (region_t *)arg;
    float *tmp = job->scratch + (int64_t)index * job->scratch_floats;
    for (;;) {
        const int64_t t = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);
        if (t >= job->num_items || atomic_load_explicit(&job->failed, memory_order_relaxed)) return;
        const item_t *it = &job->items[t];
        const int up = t < job->num_up;
        const kind_t *kind = &job->kinds[up ? 0 : 1];
        const int64_t e = it->expert, cols = it->cols, r0 = job->first[e], rows = job->first[e + 1] - r0;
        if (!up) {
            wait_for_up(job, e);
            if (atomic_load_explicit(&job->failed, memory_order_relaxed)) return;
        }
        bargein_qseg_t parts[2];
        parts[0] = rows_of(kind->w[e], it->col0, cols);
        if (kind->w2) parts[1] = rows_of(kind->w2[e], it->col0, cols);
        const int64_t width = kind->w2 ? 2 * cols : cols;
        const bargein_qmat_t tile = {parts, kind->w2 ? 2 : 1, width, kind->w[e]->k};
        const int whole = cols == kind->out_width; /* the item writes whole rows of the output */
        float *y = kind->w2 || !whole ? tmp : kind->out + r0 * kind->out_width;
        const int status = bargein_gguf_matmul_expert(kind->in + r0 * kind->in_width, rows, &tile, y, job->exact,
                                                      job->isa);
        if (status) {
            job->status[index] = status;
            atomic_store_explicit(&job->failed, 1, memory_order_relaxed);
            return;
        }
        if (kind->w2) { /* rows of [g | u] in tmp: h into the output's rows, or into tmp's second part */
            float *h = whole ? kind->out + r0 * kind->out_width : tmp + rows * width;
            bargein_silu_mul(tmp, h, rows, cols, 1);
            y = h;
        }
        for (int64_t i = 0; i < rows && !whole; i++)
            memcpy(kind->out + (r0 + i) * kind->out_width + it->col0, y + i * cols, sizeof(float) * (size_t)cols);
        if (up) {
            atomic_fetch_sub_explicit(&job->up_left[e], 1, memory_order_release);
            continue;
        }
        /* the rows whose last needed down item this was: their sum, here (acq_rel: the
         * last decrement sees every other item's writes to those rows' outputs) */
        for (int64_t p = r0; p < r0 + rows; p++) {
            const int64_t r = job->owner[p];
            if (atomic_fetch_sub_explicit(&job->row_left[r], 1, memory_order_acq_rel) == 1) combine_row(job, r);
        }
    }
}

static int by_cost(const void *a, const void *b) {
    const item_t *x = (const item_t *)a, *y = (const item_t *)b;
    if (x->cost != y->cost) return x->cost > y->cost ? -1 : 1;
    if (x->expert != y->expert) return x->expert < y->expert ? -1 : 1;
    return x->col0 < y->col0 ? -1 : x->col0 > y->col0;
}

/* The work items over the `columns` output columns of matrices w[e] (and w2[e] beside
 * them, where not NULL) for the experts with rows, in ranges of at most `tile` within
 * one segment of each, largest cost first. The cost of a range: its columns times the
 * expert's rows plus DECODE_ROWS (each call decodes the blocks it reads once or twice:
 * about as long as two rows' products), for each matrix. */
#define DECODE_ROWS 2
static int64_t list_items(item_t *items, const bargein_qmat_t *const *w, const bargein_qmat_t *const *w2,
                          const int64_t *first, int64_t experts, int64_t columns, int64_t tile) {
    int64_t count = 0;
    for (int64_t e = 0; e < experts; e++) {
        const int64_t rows = first[e + 1] - first[e];
        if (rows == 0) continue; /* no row chose it: never read */
        for (int64_t c = 0; c < columns;) {
            int64_t end = c + tile < columns ? c + tile : columns, seg_end = segment_end(w[e], c);
            end = end < seg_end ? end : seg_end;
            if (w2 && (seg_end = segment_end(w2[e], c)) < end) end = seg_end;
            items[count++] = (item_t){e, c, end - c, (end - c) * (rows + DECODE_ROWS) * (w2 ? 2 : 1)};
            c = end;
        }
    }
    qsort(items, (size_t)count, sizeof(item_t), by_cost);
    return count;
}

/* The items one phase can have at most: every expert's columns in ranges of `tile`, split
 * again at each segment boundary of either matrix. */
static int64_t max_items(const bargein_qmat_t *const *w, const bargein_qmat_t *const *w2, int64_t experts,
                         int64_t columns, int64_t tile) {
    int64_t count = 0;
    for (int64_t e = 0; e < experts; e++)
        count += (columns + tile - 1) / tile + w[e]->num_segs + (w2 ? w2[e]->num_segs : 0);
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
    int64_t *owner = malloc(sizeof(int64_t) * (size_t)(pairs > 0 ? pairs : 1));
    _Atomic int64_t *up_left = calloc((size_t)experts, sizeof(_Atomic int64_t));
    _Atomic int64_t *row_left = calloc((size_t)(m > 0 ? m : 1), sizeof(_Atomic int64_t));
    int *statuses = calloc((size_t)num_threads, sizeof(int));
    item_t *items = NULL;
    if (!first || !pos || !fill || !owner || !up_left || !row_left || !statuses) goto done;
    /* Group the (row, slot) pairs by expert, rows in order within an expert. */
    for (int64_t i = 0; i < pairs; i++) first[ids[i] + 1]++;
    int64_t most = 0;
    for (int64_t e = 0; e < experts; e++) {
        most = first[e + 1] > most ? first[e + 1] : most;
        first[e + 1] += first[e];
    }
    const int64_t tile = tile_for(first, experts, 2 * inter + hidden, num_threads);
    const int64_t up_items = max_items(gate, up, experts, inter, tile), down_items = max_items(down, NULL, experts,
                                                                                                 hidden, tile);
    items = malloc(sizeof(item_t) * (size_t)(up_items + down_items));
    /* per thread: an item's [g | u] rows and its h rows (3 tiles), or its rows of down */
    const int64_t scratch_floats = (most * 3 * tile + 15) / 16 * 16;
    const int64_t sizes[4] = {pairs * hidden, pairs * inter, pairs * hidden, scratch_floats * num_threads};
    float *buffers[4];
    if (!items || take_floats(scratch, 4, sizes, buffers)) goto done;
    float *xg = buffers[0], *h = buffers[1], *out = buffers[2];
    for (int64_t i = 0; i < pairs; i++) {
        const int64_t e = ids[i], p = first[e] + fill[e]++;
        pos[i] = p;
        owner[p] = i / topk;
        memcpy(xg + p * hidden, x + (i / topk) * hidden, sizeof(float) * (size_t)hidden);
    }
    /* gate and up (then h = silu(g) * u), down, and the sum: one region (see region_t) */
    const int64_t num_up = list_items(items, gate, up, first, experts, inter, tile);
    const int64_t num_items = num_up + list_items(items + num_up, down, NULL, first, experts, hidden, tile);
    for (int64_t t = 0; t < num_up; t++) up_left[items[t].expert]++;
    for (int64_t t = num_up; t < num_items; t++) /* as run_items counts them down */
        for (int64_t p = first[items[t].expert]; p < first[items[t].expert + 1]; p++) row_left[owner[p]]++;
    region_t job = {items, num_up, num_items, 0, up_left, row_left,
                    {{gate, up, xg, hidden, h, inter}, {down, NULL, h, inter, out, hidden}},
                    first, owner, pos, weights, y, hidden, topk, buffers[3], scratch_floats, statuses, 0, exact,
                    isa};
    const int threads = num_items < num_threads ? (int)(num_items > 0 ? num_items : 1) : num_threads;
    bargein_parallel_run(run_items, &job, threads);
    status = 0;
    for (int i = 0; i < threads; i++)
        if (statuses[i] && !status) status = statuses[i];
done:
    free(first);
    free(pos);
    free(fill);
    free(owner);
    free(up_left);
    free(row_left);
    free(items);
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
