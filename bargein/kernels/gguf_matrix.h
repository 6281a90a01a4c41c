/* A weight matrix held in a GGUF file's own blocks, as gguf_matmul.c reads it: segments
 * stacked along rows, each of one block type, its stored rows read in place (row_bytes
 * apart, never written) through an optional row order. Shared by gguf_matmul.c, which
 * defines the matmul, and moe_matmul.c, which runs it on one expert's slice. */
#ifndef BARGEIN_GGUF_MATRIX_H
#define BARGEIN_GGUF_MATRIX_H

#include <stdint.h>

typedef struct {
    int64_t type;
    const uint8_t *data;
    int64_t row_bytes, rows;
    const int64_t *order;
} bargein_qseg_t;

typedef struct {
    const bargein_qseg_t *segs;
    int64_t num_segs, n, k;
} bargein_qmat_t;

int bargein_gguf_matmul(const float *x, int64_t m, const bargein_qmat_t *w, float *y, int exact, int num_threads,
                        int isa);

/* bargein_gguf_matmul on one thread for the few rows of one expert (moe_matmul.c), its row
 * passes chosen for them: the same bits as bargein_gguf_matmul. */
int bargein_gguf_matmul_expert(const float *x, int64_t m, const bargein_qmat_t *w, float *y, int exact, int isa);

#endif
