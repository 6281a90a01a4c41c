"""Counters the engine keeps, and the snapshot it reports."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from bargein.engine.kv_disk.stats import DiskTierStats, merge_disk_stats


@dataclass(frozen=True)
class EngineStats:
    """A point-in-time view of the engine (``engine.stats()``)."""

    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_blocks_used: int
    block_size: int
    running: int  # in the running batch, paused ones included
    waiting: int
    conversations: int
    steps: int
    prefix_cache_hit_tokens: int
    prefix_cache_hit_blocks: int
    prefix_cache_query_blocks: int
    computed_tokens: int
    generated_tokens: int
    preemptions: int
    finished: dict[str, int]  # by finish reason
    cancelled: dict[str, int]  # by cancel reason
    kv_disk: DiskTierStats | None = None  # the disk tier's, when the engine has one
    paused: int = 0  # of ``running``, those paused: their client stopped reading (backpressure)
    paused_longest_s: float = 0.0  # how long the longest-paused of them has been paused (0: none)
    # Speculative decoding: guesses verified, and of those confirmed (delivered unless a
    # cancel or a stop came first). ``generated_tokens`` counts delivered tokens only.
    speculative_drafted_tokens: int = 0
    speculative_accepted_tokens: int = 0


@dataclass(frozen=True)
class RequestInfo:
    """One queued or running request, as ``GET /v1/requests`` lists it."""

    request_id: str
    status: str  # "queued" | "running" | "paused" | "preempted"
    prompt_tokens: int  # the request's prompt length
    prompt_computed: int  # prompt tokens with K/V computed so far (prefix-cache hits included)
    completion_tokens: int
    age_s: float
    deadline_s: float | None  # seconds left until its deadline
    session_id: str | None
    paused_s: float | None = None  # seconds since its client stopped reading (status "paused")


STEP_HISTORY = 8192  # recent steps kept in ``EngineCounters.recent_steps``


@dataclass(frozen=True)
class StepRecord:
    """One finished step, as ``/debug/steps`` reports it (plain data, for measuring).

    ``index`` is the engine's running step count after this step (1, 2, ...; steps that
    ran nothing are not counted); ``ended`` is ``time.monotonic()`` when its outputs were
    ready to hand to the streams, so a client on the same machine can count the steps
    that ended between two chunks it read. ``decodes`` counts the sequences that computed
    one token, ``tokens`` every token of the forward (decodes plus prompt chunks).
    """

    index: int
    ended: float
    forward_s: float
    seqs: int
    tokens: int
    decodes: int


@dataclass
class EngineCounters:
    """Mutable tallies, owned by the engine thread."""

    steps: int = 0
    generated_tokens: int = 0
    finished: Counter = field(default_factory=Counter)
    cancelled: Counter = field(default_factory=Counter)
    kv_losses: int = 0  # times the runner lost every block's K/V (a pipeline stage)
    recomputed_tokens: int = 0  # computed tokens dropped by those losses, recomputed from their tokens
    # Recent samples for latency reporting (seconds); bounded so memory stays flat.
    cancel_samples: int = 0  # cancel latencies recorded, ever (the deques keep the recent ones)
    cancel_latencies: deque = field(default_factory=lambda: deque(maxlen=4096))
    cancel_latency_steps: deque = field(default_factory=lambda: deque(maxlen=4096))
    step_durations: deque = field(default_factory=lambda: deque(maxlen=4096))
    recent_steps: deque = field(default_factory=lambda: deque(maxlen=STEP_HISTORY))  # StepRecord


def merge_stats(parts: Sequence[EngineStats], block_size: int) -> EngineStats:
    """Several engines' snapshots (a replica set's) as one: counts and gauges summed, the
    replicas' disk tiers too (``merge_disk_stats``)."""
    def total(name: str) -> int:
        return sum(getattr(s, name) for s in parts)

    def tally(name: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in parts:
            for k, v in getattr(s, name).items():
                out[k] = out.get(k, 0) + v
        return out

    numeric = ("kv_blocks_total", "kv_blocks_free", "kv_blocks_cached", "kv_blocks_used", "running", "waiting",
               "conversations", "paused", "steps", "prefix_cache_hit_tokens", "prefix_cache_hit_blocks",
               "prefix_cache_query_blocks", "computed_tokens", "generated_tokens", "preemptions",
               "speculative_drafted_tokens", "speculative_accepted_tokens")
    return EngineStats(block_size=block_size, finished=tally("finished"), cancelled=tally("cancelled"),
                       paused_longest_s=max((s.paused_longest_s for s in parts), default=0.0),
                       kv_disk=merge_disk_stats([s.kv_disk for s in parts if s.kv_disk is not None]),
                       **{name: total(name) for name in numeric})
