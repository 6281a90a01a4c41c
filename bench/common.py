"""Shared helpers for the benchmarks: statistics, a plain-text table, JSON output.

Benchmarks report medians over repeats (this machine is shared and noisy), never
assert, and print a human table followed by one JSON object on the last line of
stdout (and, with ``--json PATH``, the same object to a file).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TREE = Path(__file__).resolve().parents[1]  # the tree these benchmarks belong to


def run_fresh_python(script: str, argv: Sequence[str], timeout: float,
                     extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -c script *argv`` in a fresh process that imports this tree's bargein: the
    tree is first on PYTHONPATH, and the process starts in it (``-c`` puts the working
    directory on sys.path before PYTHONPATH: started from another tree's directory, it
    would import that tree's bargein). stdout and stderr are captured as text."""
    env = {**os.environ, **(extra_env or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TREE), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=TREE)


@dataclass
class Drive:
    """What ``drive_to_completion`` saw: tokens, time to first token, decode steps."""

    generated: int = 0
    first: dict[str, float] = field(default_factory=dict)  # request id -> seconds to its first token
    decode_steps: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) per decode step
    truncated: bool = False  # the budget ran out and the rest was cancelled

    @property
    def decode_tok_s(self) -> float:
        seconds = sum(t for _, t in self.decode_steps)
        return sum(n for n, _ in self.decode_steps) / seconds if seconds else float("nan")


def drive_to_completion(step: Callable[[], Iterable[Any]], abort: Callable[[str], Any], live: set[str],
                        started: float, budget_s: float) -> Drive:
    """Steps until every request in ``live`` finished; past ``budget_s`` (from ``started``)
    the rest are aborted and drained. A decode step is one after every request had its
    first token. ``step`` returns outputs with ``request_id``, ``new_token_ids``, ``finished``."""
    result, n = Drive(), len(live)
    while live:
        step_start = time.perf_counter()
        outs = step()
        now = time.perf_counter()
        in_decode = len(result.first) == n  # every request past its prompt before this step
        tokens = 0
        for out in outs:
            tokens += len(out.new_token_ids)
            if out.new_token_ids and out.request_id not in result.first:
                result.first[out.request_id] = now - started
            if out.finished:
                live.discard(out.request_id)
        result.generated += tokens
        if in_decode and tokens:
            result.decode_steps.append((tokens, now - step_start))
        if live and now - started > budget_s:
            result.truncated = True
            for rid in list(live):
                abort(rid)
            while live:
                live -= {out.request_id for out in step() if out.finished}
    return result


def token_gaps(collector: Any) -> list[float]:
    """Steps an OutputCollector until nothing is pending; the seconds between consecutive
    steps that emitted a token (the first emitting step starts the clock)."""
    last, gaps = None, []
    while collector.pending:
        outs = collector.step()
        now = time.perf_counter()
        if any(o.new_token_ids for o in outs):
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps


def median(values: Iterable[float]) -> float:
    data = list(values)
    return statistics.median(data) if data else math.nan


def percentile(values: Iterable[float], p: float) -> float:
    """The p-th percentile (0..100), linear interpolation between closest ranks."""
    data = sorted(values)
    if not data:
        return math.nan
    k = (len(data) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Runs fn once; returns (seconds, result)."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def repeat_timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeats`` calls of fn, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return [timed(fn)[0] for _ in range(repeats)]


def rnd(value: Any, digits: int = 3) -> Any:
    """Rounds floats (recursively) for JSON; NaN becomes None."""
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, digits)
    if isinstance(value, dict):
        return {k: rnd(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rnd(v, digits) for v in value]
    return value


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A plain-text table of dict rows (columns default to the first row's keys)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    cells = [[fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True)))
            for r in cells]
    return "\n".join([line, sep, *body])


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on, including how busy the machine was."""
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }
    with contextlib.suppress(OSError):
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return info


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a smoke run (under a minute)")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON result to PATH")
    parser.add_argument("--model", default=None, help="model reference (default: the bundled SmolLM2)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    return parser


def apply_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def emit(title: str, sections: Sequence[tuple[str, str]], result: dict[str, Any], json_path: str | None) -> None:
    """Prints the tables, then the JSON object as the last line; writes it to json_path too."""
    print(f"\n== {title} ==")
    for heading, table in sections:
        print(f"\n{heading}\n{table}")
    text = json.dumps(rnd(result), sort_keys=False)
    if json_path:
        Path(json_path).write_text(text + "\n")
    print()
    print(text, flush=True)


def histogram_quantile(before: str, after: str, name: str, q: float, *, interpolate: bool = True) -> float:
    """The q-quantile (0..1) of a Prometheus histogram's observations between two scrapes.

    Like PromQL's ``histogram_quantile`` over the bucket increase: linear within the bucket
    that holds the rank (or that bucket's upper bound with ``interpolate=False``, right for
    integer counts such as steps); the last finite bound when the rank falls in +Inf.
    NaN for no observations.
    """
    def buckets(text: str) -> dict[float, float]:
        out = {}
        for le, value in re.findall(rf'^{re.escape(name)}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M):
            out[math.inf if le == "+Inf" else float(le)] = float(value)
        return out

    old, new = buckets(before), buckets(after)
    bounds = sorted(new)
    counts = [new[b] - old.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return math.nan
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, cumulative in zip(bounds, counts, strict=True):
        if cumulative >= rank:
            if math.isinf(bound):
                return lower
            inside = cumulative - below
            if not interpolate:
                return bound
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cumulative
    return lower
