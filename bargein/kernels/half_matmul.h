/* 16-bit float weights (GGUF's F16 and BF16), read in place from a file's rows: the half of
 * bargein_gguf_matmul (gguf_matrix.h) that serves a matrix's F16 and BF16 segments, and
 * the rows of such a segment widened to float32. Defined in half_matmul.c. */
#ifndef BARGEIN_HALF_MATMUL_H
#define BARGEIN_HALF_MATMUL_H

#include "gguf_matrix.h"

#include <stdint.h>

enum { T_F16 = 1, T_BF16 = 30 }; /* ggml_type numbers */

/* Whether a segment of this type is read by half_matmul.c (its rows: k 16-bit floats). */
static inline int half_type(int64_t type) { return type == T_F16 || type == T_BF16; }

/* y[:, j] = x @ W[j].T for the columns j of w's F16 and BF16 segments only (the others'
 * columns are left as they are), x (m, k) float32, y (m, n). One summation order for every
 * row count, thread count and isa (< 0 the best here, 0 C, 1 AVX2, 2 AVX-512): see
 * half_matmul.c. Returns 0; -1 when scratch memory could not be had; -2 when the forced
 * isa is not this CPU's. */
int bargein_half_matmul(const float *x, int64_t m, const bargein_qmat_t *w, float *y, int num_threads, int isa);

/* Row i of an F16 or BF16 segment (k values) widened to float32 into out (exact), with
 * AVX2 where avx2 is set and this CPU has it. */
void bargein_half_row(const bargein_qseg_t *seg, int64_t i, int64_t k, float *out, int avx2);

#endif
