"""Prometheus metrics on ``prometheus_client``, one ``CollectorRegistry`` per app.

Two sources:

- what the HTTP layer measures itself, as it happens (time to first token, inter-token
  latency, request durations, outcomes, rejections): ``ServerMetrics``' histograms and
  counters, updated on the event loop;
- the engine's own counts, read at scrape time: requests by finish and cancel reason,
  tokens, steps, preemptions (cumulative ``EngineStats`` counts, exposed as counters by
  ``_EngineCollector``), KV blocks and queue lengths (gauges), and the samples the engine
  recorded since the last scrape (step durations, cancel latency in seconds and steps),
  each observed once into a histogram; and the KV disk tier's blocks, bytes, hits,
  misses, writes, dropped writes, skipped files and latencies when it is on. So every
  counter and every histogram's ``_count``/``_sum`` only grows, and ``rate()`` is right.

- a pipeline's stages (read at scrape time from its ``/v1/cluster`` snapshot, off the
  event loop): per stage compute, wait and transfer seconds, plans and restarts; the
  pipeline's losses, recoveries, time to recover, recomputed tokens and degraded state
  (``_ClusterCollector``).

The registry is the app's own (never prometheus_client's global default), so tests and
benchmarks can build several apps in one process. Metric names are listed in the README.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bargein.engine.kv_disk.stats import DiskTierStats
from bargein.engine.stats import EngineStats
from bargein.server.cluster import cluster_snapshot
from bargein.server.metrics_tenants import TenantSeries, TenantView

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CANCEL_STEP_BUCKETS = (0, 1, 2, 3, 5, 10, 20, 50)
SEND_DELAY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_RATE_WINDOW_S = 10.0


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


class _Tally:
    """``tally[label] += 1`` onto a one-label Counter; a decrease is refused (ValueError)."""

    def __init__(self, counter: Counter):
        self._counter = counter
        self._counts: collections.Counter[str] = collections.Counter()

    def __getitem__(self, label: str) -> int:
        return self._counts[label]

    def __setitem__(self, label: str, value: int) -> None:
        self._counter.labels(label).inc(value - self._counts[label])  # inc refuses a negative amount
        self._counts[label] = value


@dataclass
class EngineSamples:
    """Engine samples not yet observed: step durations and cancel latencies (s, steps)."""

    step_durations: list[float]
    cancel_latencies: list[float]
    cancel_latency_steps: list[int]


class SampleCursor:
    """How many of the engine's per-step and per-cancel samples were observed already.

    The engine keeps the recent samples in bounded deques plus running totals
    (``steps``, ``cancel_samples``); what arrived since the last scrape is the tail of the
    deque of that length. ``take`` must run on the engine thread (``EngineClient.call``),
    between steps, where the deques and totals agree.
    """

    def __init__(self) -> None:
        self.steps = 0
        self.cancels = 0

    def take(self, counters: Any) -> EngineSamples:
        new_steps, self.steps = counters.steps - self.steps, counters.steps
        new_cancels, self.cancels = counters.cancel_samples - self.cancels, counters.cancel_samples
        return EngineSamples(_tail(counters.step_durations, new_steps), _tail(counters.cancel_latencies, new_cancels),
                             _tail(counters.cancel_latency_steps, new_cancels))


def _tail(samples: deque, n: int) -> list:
    n = min(max(n, 0), len(samples))
    return list(samples)[len(samples) - n:] if n else []


class ServerMetrics:
    """The app's metrics and its registry; updated and scraped on the event loop."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("bargein_time_to_first_token_seconds",
                              "Time from receiving a request to its first generated token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("bargein_inter_token_latency_seconds",
                             "Time between consecutive outputs of one request, per token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("bargein_request_duration_seconds",
                                  "Time from receiving a request to its last output.", buckets=DURATION_BUCKETS,
                                  registry=r)
        self.step_time = Histogram("bargein_step_duration_seconds", "Duration of one engine step (a forward).",
                                   buckets=STEP_BUCKETS, registry=r)
        self.send_delay = Histogram("bargein_output_send_delay_seconds",
                                    "From the engine thread emitting a token delta to the server having "
                                    "written its stream events to the connection (or processed it, for "
                                    "a whole answer): the server's own cost per output.",
                                    buckets=SEND_DELAY_BUCKETS, registry=r)
        self.cancel_latency = Histogram("bargein_cancel_latency_seconds",
                                        "From a cancel being requested to the request leaving the batch.",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.cancel_steps = Histogram("bargein_cancel_latency_steps",
                                      "Engine steps between a cancel being requested and taking effect.",
                                      buckets=CANCEL_STEP_BUCKETS, registry=r)
        self.http_requests = Counter("bargein_http_requests", "HTTP generation requests by endpoint and outcome.",
                                     ["endpoint", "outcome"], registry=r)
        self._rejected = Counter("bargein_requests_rejected", "Requests refused before running, by reason.",
                                 ["reason"], registry=r)
        self.rejected = _Tally(self._rejected)  # ``metrics.rejected["queue_full"] += 1``
        self.token_rate = TokenRate()
        Gauge("bargein_generation_tokens_per_second",
              f"Generated tokens per second over the last {_RATE_WINDOW_S:g} s.",
              registry=r).set_function(self.token_rate.rate)
        self._live = Gauge("bargein_http_requests_live", "HTTP requests in flight.", registry=r)
        self._engine = _EngineCollector()
        r.register(self._engine)
        self._cluster = _ClusterCollector()
        r.register(self._cluster)
        self.cursor = SampleCursor()
        self.tenants = TenantSeries()  # per-tenant series; the app sets its tenants (context.py)

    def reject(self, tenant: str, reason: str) -> None:
        """A request refused before running (a 429): server-wide and in its tenant's series."""
        self.rejected[reason] += 1
        self.tenants.refused(tenant, reason)

    def record_outcome(self, endpoint: str, outcome: str) -> None:
        self.http_requests.labels(endpoint, outcome).inc()

    def record_rejected(self, reason: str) -> None:
        self.rejected[reason] += 1

    def observe_engine(self, stats: EngineStats | None, samples: EngineSamples | None) -> None:
        """Takes a scrape's engine snapshot (None when the engine is gone: the last one stays)."""
        if stats is not None:
            self._engine.stats = stats
        if samples is not None:
            for value in samples.step_durations:
                self.step_time.observe(value)
            for value in samples.cancel_latencies:
                self.cancel_latency.observe(value)
            for steps in samples.cancel_latency_steps:
                self.cancel_steps.observe(steps)

    def render(self, live_requests: int, reader: str | None = None) -> bytes:
        """The exposition text (``generate_latest``): the server-wide series, and the
        per-tenant ones that ``reader`` (a tenant name; None: everything) may see."""
        self._live.set(live_requests)
        return generate_latest(self.registry) + generate_latest(TenantView(self.tenants, reader))

    async def scrape(self, engine: Any, live_requests: int, reader: str | None = None) -> bytes:
        """Reads the engine's snapshot and new samples (between steps), then renders for
        ``reader`` (``metrics_tenants.py``: a tenant reads its own series only).

        ``engine`` is the app's ``EngineClient``; when it is not alive, the last snapshot is
        rendered, so counters never go back.
        """
        if engine.is_alive:
            stats = await engine.stats()
            counters = engine.counters
            samples = await engine.call(lambda: self.cursor.take(counters))
            self.observe_engine(stats, samples)
            if engine.describe().pipeline_stages:  # a pipeline: its stages answer off the loop
                self._cluster.info = await asyncio.to_thread(cluster_snapshot, engine)
        return self.render(live_requests, reader)


class _EngineCollector(Collector):
    """The engine's cumulative counts and current gauges, from the last snapshot taken."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def describe(self) -> list[Metric]:
        return []  # the families depend on the snapshot; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        finished = CounterMetricFamily("bargein_requests_finished", "Engine requests finished, by finish reason.",
                                       labels=["finish_reason"])
        for reason, n in sorted(s.finished.items()):
            finished.add_metric([reason], n)
        cancelled = CounterMetricFamily(
            "bargein_requests_cancelled",
            "Engine requests cancelled, by cancel reason (user, disconnect, deadline, shutdown, error).",
            labels=["cancel_reason"])
        for reason, n in sorted(s.cancelled.items()):
            cancelled.add_metric([reason], n)
        yield finished
        yield cancelled
        for name, help, value in (
                ("bargein_generation_tokens", "Tokens generated.", s.generated_tokens),
                ("bargein_computed_tokens", "Tokens whose K/V was computed.", s.computed_tokens),
                ("bargein_prefix_cache_hit_tokens", "Prompt tokens reused from the prefix cache.",
                 s.prefix_cache_hit_tokens),
                ("bargein_engine_steps", "Engine steps (forwards).", s.steps),
                ("bargein_preemptions", "Requests preempted for lack of KV blocks.", s.preemptions),
                ("bargein_speculative_drafted_tokens", "Speculative guesses verified (not counted in usage).",
                 s.speculative_drafted_tokens),
                ("bargein_speculative_accepted_tokens", "Speculative guesses the model confirmed.",
                 s.speculative_accepted_tokens)):
            yield CounterMetricFamily(name, help, value=value)
        blocks = GaugeMetricFamily("bargein_kv_blocks", "KV cache blocks by state.", labels=["state"])
        for state, n in (("used", s.kv_blocks_used), ("cached", s.kv_blocks_cached), ("free", s.kv_blocks_free),
                         ("total", s.kv_blocks_total)):
            blocks.add_metric([state], n)
        yield blocks
        yield GaugeMetricFamily("bargein_kv_cache_usage_ratio", "Share of KV blocks referenced by live sequences.",
                                value=s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield GaugeMetricFamily("bargein_requests_waiting", "Requests queued (the queue length).", value=s.waiting)
        yield GaugeMetricFamily("bargein_requests_running", "Requests in the running batch, paused ones not counted.",
                                value=s.running - s.paused)
        yield GaugeMetricFamily("bargein_requests_paused",
                                "Requests paused because their client stopped reading (backpressure).", value=s.paused)
        yield GaugeMetricFamily("bargein_requests_paused_longest_seconds",
                                "How long the longest-paused request has been paused (0: none is).",
                                value=s.paused_longest_s)
        if s.kv_disk is not None:
            yield from _disk_tier_metrics(s.kv_disk)


def _disk_tier_metrics(d: DiskTierStats) -> Iterator[Metric]:
    """The KV disk tier's (``--kv-disk``): its size now, its cumulative block counts, and
    per-block read and write latencies (mean and max since start)."""
    for name, help, value in (
            ("bargein_kv_disk_blocks", "KV blocks held in the disk tier.", d.blocks),
            ("bargein_kv_disk_bytes", "Bytes of the disk tier's block files.", d.bytes),
            ("bargein_kv_disk_max_bytes", "The disk tier's size bound (least recently used blocks go first).",
             d.max_bytes),
            ("bargein_kv_disk_queued_writes", "Blocks waiting for the disk tier's writer.", d.queued_writes)):
        yield GaugeMetricFamily(name, help, value=value)
    for name, help, value in (
            ("bargein_kv_disk_hits", "Blocks read back from the disk tier whole and matching.", d.hits),
            ("bargein_kv_disk_misses", "Blocks a disk read wanted but did not get (missing or bad: recomputed).",
             d.misses),
            ("bargein_kv_disk_writes", "Blocks written to the disk tier.", d.writes),
            ("bargein_kv_disk_dropped_writes", "Blocks not written because the writer's queue was full.",
             d.dropped_writes),
            ("bargein_kv_disk_deleted", "Blocks deleted from the disk tier (closed conversations).", d.deleted),
            ("bargein_kv_disk_skipped_files", "Bad block files (truncated, corrupt, another model's) skipped "
             "and deleted.", d.skipped_files)):
        yield CounterMetricFamily(name, help, value=value)
    for name, help, mean, worst in (
            ("bargein_kv_disk_read_seconds", "Seconds to read and check one block from the disk tier.",
             d.read_seconds_mean, d.read_seconds_max),
            ("bargein_kv_disk_write_seconds", "Seconds to write one block to the disk tier.",
             d.write_seconds_mean, d.write_seconds_max)):
        family = GaugeMetricFamily(name, help + " (mean and max since start)", labels=["stat"])
        family.add_metric(["mean"], mean)
        family.add_metric(["max"], worst)
        yield family


class _ClusterCollector(Collector):
    """A pipeline's per-stage times and its recoveries, from the last ``/v1/cluster`` snapshot."""

    def __init__(self) -> None:
        self.info: dict[str, Any] | None = None

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        info = self.info
        if not info or not info.get("pipeline"):
            return
        per_stage = (
            ("bargein_stage_compute_seconds", "Seconds each pipeline stage spent computing plans.", "busy_s"),
            ("bargein_stage_wait_seconds", "Seconds each stage waited for the previous stage's hidden states.",
             "wait_s"),
            ("bargein_stage_transfer_seconds", "Of that wait, seconds from the previous stage's send to receipt.",
             "transfer_s"),
            ("bargein_stage_plans", "Plans each pipeline stage executed.", "plans"))
        for name, help, key in per_stage:
            family = CounterMetricFamily(name, help, labels=["stage"])
            for stage in info["stages"]:
                if key in stage:
                    family.add_metric([str(stage["index"])], stage[key])
            yield family
        restarts = CounterMetricFamily("bargein_stage_restarts", "Times each pipeline stage was re-created.",
                                       labels=["stage"])
        for stage in info["stages"]:
            restarts.add_metric([str(stage["index"])], stage.get("restarts", 0))
        yield restarts
        recovery = info.get("recovery", {})
        for name, help, key in (
                ("bargein_pipeline_losses", "Times pipeline stages were found lost.", "losses"),
                ("bargein_pipeline_recoveries", "Times every lost stage was re-created.", "recoveries"),
                ("bargein_pipeline_recover_seconds", "Seconds from noticing lost stages to running again, summed.",
                 "recover_seconds_total"),
                ("bargein_pipeline_recomputed_tokens", "Computed tokens dropped with a lost stage and recomputed.",
                 "tokens_recomputed")):
            yield CounterMetricFamily(name, help, value=recovery.get(key, 0) or 0)
        yield GaugeMetricFamily("bargein_pipeline_last_recover_seconds", "Time the last recovery took.",
                                value=recovery.get("last_recover_s") or 0.0)
        yield CounterMetricFamily("bargein_pipeline_logits_transfer_seconds",
                                  "Seconds from the last stage's send to the head having the logits.",
                                value=info.get("logits_transfer_s", 0.0))
        yield GaugeMetricFamily("bargein_pipeline_degraded",
                                "1 while a lost stage could not be re-created in time (requests fail).",
                                value=1.0 if info.get("health") == "degraded" else 0.0)
