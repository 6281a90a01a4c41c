/* A probe, not part of the test run: libm's expf over every float with |x| in [2^-26, 2^7)
 * (where it is neither 1, 0 nor inf), one FNV hash per sign and exponent, to compare two
 * machines' libm line by line. Build and run it here and under qemu (about 4 minutes
 * each on a quiet machine), then diff:
 *   gcc -O2 -fno-builtin -o expf_x86 expf_probe.c -lm && ./expf_x86 > x86.txt
 *   aarch64-linux-gnu-gcc -O2 -fno-builtin -o expf_arm expf_probe.c -lm
 *   qemu-aarch64 -L /usr/aarch64-linux-gnu ./expf_arm > arm.txt && diff x86.txt arm.txt
 * Found on 2026-12-02 (Debian glibc 2.36 x86-64 vs libc6-arm64-cross 2.36): the lines for
 * exponent 132 differ, for exactly two inputs: expf(0x4202422f = 32.564632) is 0x56fc9f1c on
 * x86-64, 0x56fc9f1b on AArch64; expf(0xc27c65d9 = -63.099461) is 0x11fa2993 vs 0x11fa2992.
 * -DSTRIDE=16 samples every 16th float (and misses both). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#ifndef STRIDE
#define STRIDE 1
#endif
int main(void) {
    for (uint32_t sign = 0; sign < 2; sign++)
        for (uint32_t e = 127 - 26; e < 127 + 7; e++) {
            uint64_t h = 1469598103934665603ULL;
            for (uint32_t m = 0; m < (1u << 23); m += STRIDE) {
                uint32_t bits = (sign << 31) | (e << 23) | m, out;
                float x, y;
                memcpy(&x, &bits, 4);
                y = expf(x);
                memcpy(&out, &y, 4);
                h = (h ^ out) * 1099511628211ULL;
            }
            printf("%u %u %016llx\n", sign, e, (unsigned long long)h);
            fflush(stdout);
        }
    return 0;
}
