"""What an engine reports about itself, read on its thread: a stats snapshot, its recent
steps, and its queued and running requests (``GET /v1/requests``)."""

from __future__ import annotations

import itertools
import time

from bargein.engine.blocks import BlockPool
from bargein.engine.kv_disk.stats import DiskTierStats
from bargein.engine.request import RequestStatus
from bargein.engine.scheduler import Scheduler
from bargein.engine.speculative.controller import SpeculationCounts
from bargein.engine.stats import EngineCounters, EngineStats, RequestInfo, StepRecord


def engine_stats(scheduler: Scheduler, pool: BlockPool, counters: EngineCounters,
                 kv_disk: DiskTierStats | None = None, speculation: SpeculationCounts | None = None) -> EngineStats:
    paused_since = [scheduler.paused_since[r.request_id] for r in scheduler.running
                    if r.request_id in scheduler.paused_since]
    return EngineStats(
        kv_blocks_total=pool.num_blocks,
        kv_blocks_free=pool.num_free,
        kv_blocks_cached=pool.num_cached,
        kv_blocks_used=pool.num_referenced,
        block_size=pool.block_size,
        running=len(scheduler.running),
        paused=len(paused_since),
        paused_longest_s=time.monotonic() - min(paused_since) if paused_since else 0.0,
        waiting=len(scheduler.waiting),
        conversations=len(scheduler.conversations),
        steps=counters.steps,
        prefix_cache_hit_tokens=scheduler.num_prefix_hit_tokens,
        prefix_cache_hit_blocks=pool.prefix_hit_blocks,
        prefix_cache_query_blocks=pool.prefix_query_blocks,
        computed_tokens=scheduler.num_computed_tokens,
        generated_tokens=counters.generated_tokens,
        preemptions=scheduler.num_preemptions,
        finished=dict(counters.finished),
        cancelled=dict(counters.cancelled),
        kv_disk=kv_disk,
        speculative_drafted_tokens=speculation.drafted_tokens if speculation else 0,
        speculative_accepted_tokens=speculation.accepted_tokens if speculation else 0,
    )


def steps_after(counters: EngineCounters, index: int) -> list[StepRecord]:
    """The recent steps whose index is above ``index``, oldest first.

    At most ``STEP_HISTORY`` are kept: a reader that polls less often loses the oldest (it
    can tell from the first index it gets).
    """
    recent = counters.recent_steps
    if not recent:
        return []
    # By the records' own indexes: between a step's forward and its record (the inbox is
    # drained there), ``counters.steps`` is one ahead of the last record.
    # Clamped to the records held: an ``index`` past the last (any integer a client sends) skips them all.
    skip = min(len(recent), max(0, len(recent) - (recent[-1].index - index)))
    return list(itertools.islice(recent, skip, None))


def request_infos(scheduler: Scheduler) -> list[RequestInfo]:
    """Queued and running requests, oldest first. ``session_id`` is the wire name of the
    conversation a request generates onto. A running request whose consumer stopped
    reading (backpressure, ``Scheduler.pause``) is ``paused``, with the seconds since."""
    now = time.monotonic()
    names = {RequestStatus.WAITING: "queued", RequestStatus.RUNNING: "running",
             RequestStatus.PREEMPTED: "preempted"}
    infos = []
    for req in sorted(scheduler.requests.values(), key=lambda r: r.arrival_time):
        status = names.get(req.status, req.status.name.lower())
        paused_since = scheduler.paused_since.get(req.request_id) if status == "running" else None
        infos.append(RequestInfo(
            request_id=req.request_id,
            status=status if paused_since is None else "paused",
            prompt_tokens=req.prompt_len,
            prompt_computed=min(req.sequence.num_computed, req.prompt_len),
            completion_tokens=req.num_output_tokens,
            age_s=now - req.arrival_time,
            deadline_s=None if req.deadline is None else max(0.0, req.deadline - now),
            session_id=None if req.owns_sequence else req.sequence.seq_id,
            paused_s=None if paused_since is None else now - paused_since,
        ))
    return infos
