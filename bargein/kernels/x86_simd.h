/* x86 vector helpers for the kernels that choose their instruction set at run time, function
 * by function (target attributes), so they build without -march: unlike simd.h's, which need
 * the whole file built for AVX2. A helper's target is a subset of its callers', so it inlines
 * into their AVX2 and AVX-512 functions alike. Include after <immintrin.h>, on x86 only. */
#ifndef BARGEIN_X86_SIMD_H
#define BARGEIN_X86_SIMD_H

/* Eight rows of eight 32-bit values, transposed in place. */
static inline __attribute__((target("avx2"), always_inline)) void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}


/* Pins *v in a register at this point of the code. GCC otherwise regroups a chain of
 * integer adds (exact, so it may): in the AVX2 tile passes it computed every maddubs of a
 * block first and parked the products on the stack, where 16 ymm registers (an AVX2-only
 * CPU) cannot hold them. Pinning each group's sum kept the chain in order: built for Zen 3
 * (-march=znver3), gguf_matmul.c's tile passes took 0.68-0.86x the time (Q8_0 0.93) at 512
 * rows on 2 threads (bench/gemm_tile_ab.c), the same bits. */
static inline __attribute__((always_inline)) void in_order(__m256i *v) { __asm__("" : "+v"(*v)); }

/* in_order for a float vector (attention_prompt_x86.h's score step). */
static inline __attribute__((always_inline)) void in_order_ps(__m256 *v) { __asm__("" : "+v"(*v)); }

#endif
