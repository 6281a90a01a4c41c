/*
 * The mixture-of-experts kernels (moe_matmul.c), for their callers in this folder
 * (fast_forward.c's fused layers; Python reaches the same entry points through ctypes).
 */
#ifndef BARGEIN_MOE_MATMUL_H
#define BARGEIN_MOE_MATMUL_H

#include <stddef.h>
#include <stdint.h>

#include "gguf_matrix.h"

/* Scratch memory that several calls share (one fused forward's MoE layers): grown to the
 * largest need seen, never shrunk, freed by the owner with bargein_moe_scratch_free. A
 * call's buffers of a megabyte or more, malloc'd and freed per layer, would be given back
 * to the system and faulted in again, zeroed, by the next layer. */
typedef struct {
    void *data;
    size_t bytes;
} bargein_moe_scratch_t;

void bargein_moe_scratch_free(bargein_moe_scratch_t *scratch);

int bargein_moe_route(const float *x, int64_t m, int64_t hidden, const float *router, int64_t experts,
                      int64_t rows_w, int64_t topk, int norm, int64_t *ids, float *weights, float *gate,
                      int num_threads);

int bargein_moe_experts(const float *x, int64_t m, int64_t hidden, int64_t inter, const bargein_qmat_t *const *gate,
                        const bargein_qmat_t *const *up, const bargein_qmat_t *const *down, int64_t experts,
                        const int64_t *ids, const float *weights, int64_t topk, float *y, int exact,
                        int num_threads, int isa);

/* bargein_moe_experts with its buffers taken from `scratch` (grown as needed). */
int bargein_moe_experts_in(const float *x, int64_t m, int64_t hidden, int64_t inter,
                           const bargein_qmat_t *const *gate, const bargein_qmat_t *const *up,
                           const bargein_qmat_t *const *down, int64_t experts, const int64_t *ids,
                           const float *weights, int64_t topk, float *y, int exact, int num_threads, int isa,
                           bargein_moe_scratch_t *scratch);

#endif
