/* Stand-in for macOS's <sys/sysctl.h> (Linux has none): just the declaration arm64_simd.h
 * uses, so its macOS branch builds here against darwin_dotprod.c's own sysctlbyname. */
#include <stddef.h>
int sysctlbyname(const char *name, void *value, size_t *size, void *new_value, size_t new_size);
