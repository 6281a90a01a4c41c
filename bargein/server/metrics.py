"""Prometheus metrics, hand-rolled: counters, histograms and a text renderer.

Two sources: what the HTTP layer measures itself (time to first token, inter-token
latency, request durations, rejections, generated tokens per second), and the engine's
own snapshot (``EngineStats``: requests by finish and cancel reason, KV blocks, prefix
hits, queue length) and recent cancel latencies, read between steps at scrape time.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence

from bargein.engine.stats import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_RATE_WINDOW_S = 10.0


class Histogram:
    """Cumulative-bucket histogram in the Prometheus sense."""

    def __init__(self, name: str, help: str, buckets: Sequence[float] = LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            running += n
            le = "+Inf" if math.isinf(bound) else f"{bound:g}"
            lines.append(f'{self.name}_bucket{{le="{le}"}} {running}')
        lines += [f"{self.name}_sum {self.sum:.6f}", f"{self.name}_count {running}"]
        return lines


class TokenRate:
    """Generated tokens per second over the last few seconds."""

    def __init__(self, window_s: float = _RATE_WINDOW_S):
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()

    def add(self, n: int, now: float | None = None) -> None:
        if n:
            self._events.append((time.monotonic() if now is None else now, n))

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
        return sum(n for _, n in self._events) / self.window_s


class ServerMetrics:
    """What the HTTP layer measures; owned by the event loop."""

    def __init__(self) -> None:
        self.ttft = Histogram("bargein_time_to_first_token_seconds",
                              "Time from receiving a request to its first generated token.")
        self.itl = Histogram("bargein_inter_token_latency_seconds",
                             "Time between consecutive outputs of one request, per token.")
        self.duration = Histogram("bargein_request_duration_seconds",
                                  "Time from receiving a request to its last output.", DURATION_BUCKETS)
        self.http_requests: Counter[tuple[str, str]] = Counter()  # (endpoint, outcome)
        self.rejected: Counter[str] = Counter()  # why a request was refused before it ran
        self.token_rate = TokenRate()

    def record_outcome(self, endpoint: str, outcome: str) -> None:
        self.http_requests[(endpoint, outcome)] += 1

    def render(self, stats: EngineStats | None, cancel_latencies: Sequence[float],
               cancel_steps: Sequence[int], live_requests: int) -> str:
        lines: list[str] = []
        for hist in (self.ttft, self.itl, self.duration):
            lines += hist.render()
        lines += _counter("bargein_http_requests_total", "HTTP generation requests by endpoint and outcome.",
                          (({"endpoint": e, "outcome": o}, n) for (e, o), n in sorted(self.http_requests.items())))
        lines += _counter("bargein_requests_rejected_total", "Requests refused before running, by reason.",
                          (({"reason": r}, n) for r, n in sorted(self.rejected.items())))
        lines += _gauge("bargein_generation_tokens_per_second",
                        f"Generated tokens per second over the last {_RATE_WINDOW_S:g} s.", self.token_rate.rate())
        lines += _gauge("bargein_http_requests_live", "HTTP requests in flight.", live_requests)
        lines += _summary("bargein_cancel_latency_seconds",
                          "From a cancel being requested to the request leaving the batch (recent cancels).",
                          cancel_latencies)
        lines += _summary("bargein_cancel_latency_steps",
                          "Engine steps between a cancel being requested and taking effect (recent cancels).",
                          cancel_steps)
        if stats is not None:
            lines += _engine_lines(stats)
        return "\n".join(lines) + "\n"


def _engine_lines(s: EngineStats) -> list[str]:
    lines = _counter("bargein_requests_finished_total", "Engine requests finished, by finish reason.",
                     (({"finish_reason": r}, n) for r, n in sorted(s.finished.items())))
    lines += _counter("bargein_requests_cancelled_total",
                      "Engine requests cancelled, by cancel reason (user, disconnect, deadline, shutdown, error).",
                      (({"cancel_reason": r}, n) for r, n in sorted(s.cancelled.items())))
    lines += _counter("bargein_generation_tokens_total", "Tokens generated.", [({}, s.generated_tokens)])
    lines += _counter("bargein_computed_tokens_total", "Tokens whose K/V was computed.", [({}, s.computed_tokens)])
    lines += _counter("bargein_prefix_cache_hit_tokens_total", "Prompt tokens reused from the prefix cache.",
                      [({}, s.prefix_cache_hit_tokens)])
    lines += _counter("bargein_engine_steps_total", "Engine steps (forwards).", [({}, s.steps)])
    lines += _counter("bargein_preemptions_total", "Requests preempted for lack of KV blocks.",
                      [({}, s.preemptions)])
    lines += _gauge("bargein_kv_blocks", "KV cache blocks by state.", None, [
        ({"state": "used"}, s.kv_blocks_used), ({"state": "cached"}, s.kv_blocks_cached),
        ({"state": "free"}, s.kv_blocks_free), ({"state": "total"}, s.kv_blocks_total)])
    lines += _gauge("bargein_kv_cache_usage_ratio", "Share of KV blocks referenced by live sequences.",
                    s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
    lines += _gauge("bargein_requests_waiting", "Requests queued (the queue length).", s.waiting)
    lines += _gauge("bargein_requests_running", "Requests in the running batch.", s.running)
    return lines


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _counter(name: str, help: str, samples: Iterable[tuple[dict, float]]) -> list[str]:
    lines = [f"# HELP {name} {help}", f"# TYPE {name} counter"]
    lines += [f"{name}{_labels(labels)} {value:g}" for labels, value in samples]
    return lines


def _gauge(name: str, help: str, value: float | None,
           samples: Iterable[tuple[dict, float]] | None = None) -> list[str]:
    lines = [f"# HELP {name} {help}", f"# TYPE {name} gauge"]
    if samples is None:
        samples = [({}, value or 0.0)]
    lines += [f"{name}{_labels(labels)} {v:g}" for labels, v in samples]
    return lines


def _summary(name: str, help: str, values: Sequence[float]) -> list[str]:
    lines = [f"# HELP {name} {help}", f"# TYPE {name} summary"]
    ordered = sorted(values)
    for q in (0.5, 0.9, 0.99):
        lines.append(f'{name}{{quantile="{q:g}"}} {quantile(ordered, q):.6g}')
    lines += [f"{name}_sum {sum(ordered):.6g}", f"{name}_count {len(ordered)}"]
    return lines


def quantile(ordered: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values (nearest rank); NaN for none."""
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
