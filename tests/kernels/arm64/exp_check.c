/*
 * bargein_expf (bargein/kernels/exp.h) over float inputs, for one machine's build:
 *   exp_check STRIDE [FIRST LAST]
 * runs every STRIDE-th bit pattern from FIRST to LAST (default: all 2^32, as unsigned
 * 32-bit numbers), then the edge cases below, and prints
 *   hash     FNV-1a of every output's bits, in input order (one set of bits everywhere:
 *            compared across machines)
 *   count    inputs run
 *   max_ulp  the largest distance in units in the last place (ordered bit patterns) from
 *            the double-precision exp rounded to float; NaN must give NaN
 *   over_one inputs more than 1 ulp away
 *   vector_mismatch  inputs where the build's vector body (AVX2 exp256 or NEON
 *            exp4_mirror; none in a plain-C build) gives other bits than the scalar one
 *   vector   which vector body ran: avx2, neon or none
 * Used by tests/kernels/test_arm64_emulated.py (a dense sample) and bench/bench_exp.py
 * (every float, natively and under qemu-aarch64).
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"
#include "simd.h"

static float from_bits(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}
static uint32_t to_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}
/* Bit patterns in the order of the floats they stand for (-0 and +0 one apart). */
static int64_t ordered(uint32_t b) { return b & 0x80000000u ? -(int64_t)(b & 0x7FFFFFFFu) : (int64_t)b; }

#if defined(BARGEIN_AVX2)
#define LANES 8
static const char *VECTOR = "avx2";
static void vector_exp(const float *x, float *y) { _mm256_storeu_ps(y, exp256(_mm256_loadu_ps(x))); }
#elif defined(BARGEIN_NEON)
#define LANES 4
static const char *VECTOR = "neon";
static void vector_exp(const float *x, float *y) { vst1q_f32(y, exp4_mirror(vld1q_f32(x))); }
#else
#define LANES 1
static const char *VECTOR = "none";
static void vector_exp(const float *x, float *y) { y[0] = bargein_expf(x[0]); }
#endif

static uint64_t hash = 0xcbf29ce484222325ULL, count, over_one, vector_mismatch;
static int64_t max_ulp;
static float batch[LANES];
static uint32_t batch_out[LANES];
static int batched;

static void flush_vector(void) {
    float y[LANES];
    for (int i = batched; i < LANES; i++) batch[i] = 0.0f;
    vector_exp(batch, y);
    for (int i = 0; i < batched; i++) vector_mismatch += to_bits(y[i]) != batch_out[i];
    batched = 0;
}

static void check(uint32_t bits) {
    const float x = from_bits(bits), y = bargein_expf(x);
    const uint32_t out = to_bits(y);
    hash = (hash ^ out) * 0x100000001b3ULL;
    count++;
    const float want = (float)exp((double)x);
    int64_t ulp;
    if (want != want) ulp = y != y ? 0 : INT64_MAX;
    else ulp = llabs(ordered(out) - ordered(to_bits(want)));
    if (ulp > max_ulp) max_ulp = ulp;
    over_one += ulp > 1;
    batch[batched] = x, batch_out[batched] = out;
    if (++batched == LANES) flush_vector();
}

int main(int argc, char **argv) {
    const uint64_t stride = argc > 1 ? strtoull(argv[1], NULL, 0) : 1;
    const uint64_t first = argc > 2 ? strtoull(argv[2], NULL, 0) : 0;
    const uint64_t last = argc > 3 ? strtoull(argv[3], NULL, 0) : 0xFFFFFFFFull;
    for (uint64_t b = first; b <= last; b += stride) check((uint32_t)b);
    /* Edge cases: zeros, infinities, NaNs (quiet, signalling, with payloads), the
     * overflow and underflow limits and their neighbours, the fast path's limit, and the
     * two inputs glibc 2.36's expf rounds apart on x86-64 and AArch64. */
    static const uint32_t edges[] = {0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                                     0x7F800001, 0x7FA5A5A5, 0xFFBFFFFF, 0x42B17217, 0x42B17218, 0x42B20000,
                                     0x42B20001, 0xC2CFF1B4, 0xC2CFF1B5, 0xC2D00000, 0xC2D00001, 0xC2AEAC4F,
                                     0xC2AEAC50, 0x42AEAC4F, 0x42AEAC50, 0x4202422F, 0xC27C65D9, 0x00000001,
                                     0x80000001, 0x33800000, 0xB3800000, 0x3F800000, 0xBF800000};
    for (size_t i = 0; i < sizeof edges / sizeof edges[0]; i++) check(edges[i]);
    /* Every float around the subnormal boundary and the overflow threshold. */
    for (uint32_t b = 0xC2AEAC50u - 4096; b <= 0xC2AEAC50u + 4096; b++) check(b);
    for (uint32_t b = 0x42B17218u - 4096; b <= 0x42B17218u + 4096; b++) check(b);
    for (uint32_t b = 0xC2CFF1B5u - 4096; b <= 0xC2CFF1B5u + 4096; b++) check(b);
    if (batched) flush_vector();
    printf("hash\t%016" PRIx64 "\ncount\t%" PRIu64 "\nmax_ulp\t%" PRId64 "\nover_one\t%" PRIu64
           "\nvector_mismatch\t%" PRIu64 "\nvector\t%s\n",
           hash, count, max_ulp, over_one, vector_mismatch, VECTOR);
    return 0;
}
