"""bench/bench_models.py: the order of its runs (a measurement on both sides back to back),
and its account of a side that died: the exit status or the signal in words, and on a CPU
with AMX a llama.cpp segfault named with its known cause."""

from __future__ import annotations

import pytest

from bench import bench_models
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


class FakeRuns:
    """Stands in for bench_models._run: records each child as (side, what it measured) and
    answers with numbers that say which run they came from; ``fail`` names a side whose
    run of that measurement raises as a dead child does."""

    def __init__(self, fail: tuple[str, str] | None = None):
        self.calls: list[tuple[str, str]] = []
        self.fail = fail

    def __call__(self, script: str, args: dict) -> dict:
        if "module" in args:  # an import floor: the side by the module it imports
            side, what = {"torch": "a", "llama_cpp": "b"}[args["module"]], "floor"
        else:  # a measurement: decodes named by their streams
            side = {"A": "a", "B": "b"}[script]
            what = str(len(args["prompts"])) if args["kind"] == "decode" else args["kind"]
        self.calls.append((side, what))
        if (side, what) == self.fail:
            raise RuntimeError("killed by SIGSEGV")
        n = len(self.calls)
        if what == "floor":
            return {"seconds": 1.0 if side == "a" else 0.5, "peak_mb": 100.0}
        return {"load_s": 3.0, "tok_s": float(n), "anon_mb": 1.0, "file_mb": 2.0, "peak_mb": 100.0 + n}


PLANS = {"load": {"kind": "load"}, "1_stream": {"kind": "decode", "prompts": [[1]]},
         "2_stream": {"kind": "decode", "prompts": [[1], [2]]}, "prefill_8": {"kind": "prefill"}}


def test_a_round_runs_each_measurement_on_both_sides_back_to_back(monkeypatch):
    runs = FakeRuns()
    monkeypatch.setattr(bench_models, "_run", runs)
    sides = [("llama.cpp", "B", "llama_cpp"), ("bargein", "A", "torch")]
    failed: dict[str, str] = {}
    got = bench_models.interleaved_round(sides, PLANS, {}, 2, failed)
    assert runs.calls == [("b", "floor"), ("a", "floor")] * 2 + [("b", "load"), ("a", "load")] * 2 + [
        ("b", "1"), ("a", "1"), ("b", "2"), ("a", "2"), ("b", "prefill"), ("a", "prefill")]
    assert failed == {}
    # each value is its own side's run: call numbers 9 .. 14 in the order above
    assert got["llama.cpp"]["1_stream_tok_s"] == 9 and got["bargein"]["1_stream_tok_s"] == 10
    assert got["bargein"]["2_stream_tok_s"] == 12 and got["bargein"]["prefill_8_tok_s"] == 14
    assert got["bargein"]["load_s"] == 2.0 and got["llama.cpp"]["load_s"] == 2.5  # minus each side's floor
    assert got["bargein"]["peak_above_floor_mb"] == 14 and got["llama.cpp"]["peak_above_floor_mb"] == 13
    assert (got["bargein"]["anon_mb"], got["bargein"]["file_mb"]) == (1.0, 2.0)


def test_a_side_that_dies_is_dropped_and_the_other_goes_on(monkeypatch):
    runs = FakeRuns(fail=("b", "2"))
    monkeypatch.setattr(bench_models, "_run", runs)
    sides = [("bargein", "A", "torch"), ("llama.cpp", "B", "llama_cpp")]
    failed: dict[str, str] = {}
    got = bench_models.interleaved_round(sides, PLANS, {}, 1, failed)
    assert list(got) == ["bargein"] and set(got["bargein"]) >= {"1_stream_tok_s", "2_stream_tok_s", "prefill_8_tok_s"}
    assert failed == {"llama.cpp": "killed by SIGSEGV"}
    assert runs.calls[-3:] == [("a", "2"), ("b", "2"), ("a", "prefill")]
    # a later round leaves the dead side out from the start
    runs.calls.clear()
    bench_models.interleaved_round(sides, PLANS, {}, 1, failed)
    assert {side for side, _ in runs.calls} == {"a"}
