/* arm64_simd.h's macOS runtime check, run on Linux: built with __APPLE__ defined (and
 * __linux__ not) against a sysctlbyname that reports only the name in $SET as 1 (every
 * other name missing, as on a Mac without it). Prints arm64_has_dotprod(). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arm64_simd.h"

int sysctlbyname(const char *name, void *value, size_t *size, void *new_value, size_t new_size) {
    const char *set = getenv("SET");
    (void)new_value;
    (void)new_size;
    if (set == NULL || strcmp(set, name) != 0 || *size < sizeof(int)) return -1;
    *(int *)value = 1;
    *size = sizeof(int);
    return 0;
}

int main(void) {
    printf("%d\n", arm64_has_dotprod());
    return 0;
}
