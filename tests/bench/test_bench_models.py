"""bench/bench_models.py's account of a side that died: the exit status or the signal in
words, and on a CPU with AMX a llama.cpp segfault named with its known cause."""

from __future__ import annotations

import pytest

from bench.bench_models import _run, exit_reason, llama_failure


def test_an_exit_code_in_words():
    assert exit_reason(3) == "exit status 3"
    assert exit_reason(-11) == "killed by SIGSEGV"
    assert exit_reason(-9) == "killed by SIGKILL"
    assert exit_reason(-200) == "killed by signal 200"


def test_a_child_killed_by_a_signal_says_so():
    script = "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)"
    with pytest.raises(RuntimeError, match="^killed by SIGSEGV$"):
        _run(script, {})


def test_a_llama_cpp_segfault_on_an_amx_cpu_names_the_cause():
    amx, plain = frozenset({"avx512f", "amx_tile", "amx_int8"}), frozenset({"avx2", "avx512f"})
    named = llama_failure("killed by SIGSEGV", amx)
    assert named.startswith("killed by SIGSEGV (") and "issue 20824" in named and "GGML_NATIVE=OFF" in named
    assert llama_failure("killed by SIGSEGV", plain) == "killed by SIGSEGV"
    assert llama_failure("exit status 1", amx) == "exit status 1"
