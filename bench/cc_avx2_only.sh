#!/usr/bin/env bash
# A C compiler that builds bargein's kernels as for an AVX2-only CPU on a machine that has
# more (AVX-512): the compiler ($AVX2_ONLY_CC, default gcc) with -march=native replaced by
# -march=$AVX2_ONLY_MARCH (default znver3: a Zen 3, AVX2 without AVX-512), every other flag
# kept. The kernels' cache key holds the compiler's path, so this build gets its own entry.
#
#   CC=bench/cc_avx2_only.sh BARGEIN_Q8_ISA=avx2 BARGEIN_CACHE_DIR=/tmp/avx2-kernels \
#   LLAMA_CPP_LIB_PATH=LLAMA_AVX2_BUILD/bin python bench/bench_models.py FILES ...
#
# (BARGEIN_Q8_ISA=avx2: the int8 matmuls' VNNI paths are function targets, built either
# way; the variable picks the AVX2 ones. LLAMA_CPP_LIB_PATH: llama.cpp's libraries built
# with -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
# -DGGML_AVX512=OFF, as docs/benchmarks.md's thirty-fifth session shows.)
set -euo pipefail
march="-march=${AVX2_ONLY_MARCH:-znver3}"
args=()
for arg in "$@"; do
    if [ "$arg" = "-march=native" ]; then args+=("$march"); else args+=("$arg"); fi
done
exec "${AVX2_ONLY_CC:-gcc}" "${args[@]}"
