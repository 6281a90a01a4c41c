#!/usr/bin/env bash
# The long fuzzing runs (not in `make test`, which runs the same tests with few examples):
# the HTTP API from its OpenAPI schema (schemathesis) and the GGUF / safetensors readers
# (hypothesis). EXAMPLES sets examples per operation / per test (default 200).
set -euo pipefail
cd "$(dirname "$0")/.."
EXAMPLES="${EXAMPLES:-200}"
PY="${PY:-.venv/bin/python}"
BARGEIN_API_FUZZ_EXAMPLES="$EXAMPLES" BARGEIN_FUZZ_EXAMPLES="$EXAMPLES" \
    "$PY" -m pytest -q -p no:cacheprovider --timeout 3600 tests/server/test_api_fuzz.py tests/model/test_loader_fuzz.py "$@"
