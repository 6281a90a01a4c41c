#!/usr/bin/env bash
# The one prepared GPU check of issue 18, for a machine with an NVIDIA GPU, run from a
# copy of the repository root (no install of bargein needed):
#
#   bash scripts/gpu_check.sh                 # writes to $OUT (else /tmp/gpu_check)
#   BARGEIN_GPU_CHECK_DEVICE=cpu BARGEIN_GPU_CHECK_SMALL=1 bash scripts/gpu_check.sh   # a CPU dry run
#
# Parts, each time-boxed and run even when an earlier one failed:
#   1. nvidia-smi, versions: the GPU, python/torch/CUDA versions, which packages are present
#   2. parity:    a small random-weight model written here, loaded to the device; greedy
#                 answers against this machine's CPU in fp32 (bf16 and fp32, graphs on/off)
#   3. contract:  the engine's contract tests with BARGEIN_TEST_DEVICE=cuda (cancel mid-decode
#                 and mid-prefill, continuation equals no cancel, block accounting, graphs)
#   4. bench:     bench/bench_gpu.py at 1, 32 and 256 streams, CUDA graphs on and off, on a
#                 random-weight model of SmolLM2-135M's shape
#   5. attention: gathered SDPA against flex attention over a paged cache (the choice of path)
# Output: $OUT/log (everything), $OUT/summary.txt, $OUT/parity.json, $OUT/bench_gpu.json,
# $OUT/attention.json. Wheels in .whl/ (e.g. gguf, missing on the GPU image) are installed
# into /tmp/site first, without network.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
DEVICE="${BARGEIN_GPU_CHECK_DEVICE:-cuda}"
SMALL="${BARGEIN_GPU_CHECK_SMALL:-0}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

stage() {  # stage NAME SECONDS COMMAND...: runs it time-boxed, records PASS/FAIL
    local name=$1 limit=$2 started rc
    shift 2
    echo
    echo "=== $name (at most ${limit}s): $* ==="
    started=$(date +%s)
    timeout -k 5 "$limit" "$@"
    rc=$?
    local took=$(( $(date +%s) - started ))
    if [ "$rc" -eq 0 ]; then
        echo "=== $name: PASS in ${took}s ===" | tee -a "$SUMMARY"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "=== $name: FAIL (timed out after ${took}s) ===" | tee -a "$SUMMARY"
    else
        echo "=== $name: FAIL (exit $rc) in ${took}s ===" | tee -a "$SUMMARY"
    fi
}

main() {
    echo "gpu_check: device=$DEVICE small=$SMALL out=$OUT started $(date -u +%H:%M:%S)"
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            && export PYTHONPATH="$PYTHONPATH:/tmp/site" && echo "installed wheels: $(ls .whl)"
    fi
    stage nvidia-smi 15 nvidia-smi
    stage versions 25 "$PY" bench/gpu_check.py info
    if [ "$SMALL" = 1 ]; then
        bench_args=(--small --streams 1,4 --max-tokens 8)
    else
        bench_args=(--streams 1,32,256 --max-tokens 128)
    fi
    stage parity 55 "$PY" bench/gpu_check.py parity --device "$DEVICE" --json "$OUT/parity.json"
    stage contract 110 env BARGEIN_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -p no:cacheprovider -rfE --timeout 60 \
        --durations=5 tests/engine/test_device.py tests/engine/test_engine.py tests/engine/test_async_engine.py \
        tests/engine/test_conversation_state_machine.py
    # 12 runs (3 levels x graphs on/off x warm-up + timed), each cut at 8 s: always inside the box.
    stage bench 130 "$PY" bench/bench_gpu.py --device "$DEVICE" "${bench_args[@]}" --graphs both --level-budget 8 \
        --json "$OUT/bench_gpu.json"
    stage attention 55 "$PY" bench/gpu_check.py attention --device "$DEVICE" --json "$OUT/attention.json"
    echo
    echo "=== summary ($(date -u +%H:%M:%S)) ==="
    cat "$SUMMARY"
}

main 2>&1 | tee "$OUT/log"
