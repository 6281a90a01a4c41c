"""Operations: ``/health``, ``/metrics`` (Prometheus text), ``/v1/cluster``, ``/v1/cache``, and
``/debug/kv`` and ``/debug/steps`` and ``/debug/stalls`` for tests and benchmarks."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from bargein.engine.kv_disk.stats import DiskTierStats
from bargein.engine.stats import STEP_HISTORY, EngineStats
from bargein.server.cluster import cluster_snapshot
from bargein.server.context import Caller, Ctx
from bargein.server.metrics import CONTENT_TYPE

router = APIRouter()
debug_router = APIRouter()


@router.get("/health")
async def health(ctx: Ctx) -> JSONResponse:
    """ok (200); recovering (200: a pipeline re-creates a lost stage, requests pause);
    degraded (503: no node could host a lost stage in time; requests fail until one can,
    and the server heals by itself); unavailable (503: shutting down or the loop died)."""
    alive = ctx.engine.is_alive and not ctx.draining
    if not alive:
        return JSONResponse({"status": "unavailable", "model": ctx.model_name}, status_code=503)
    runner = ctx.engine.health()
    body: dict[str, Any] = {"status": runner.state, "model": ctx.model_name}
    if runner.message:
        body["message"] = runner.message
    return JSONResponse(body, status_code=503 if runner.state == "degraded" else 200)


@router.get("/metrics")
async def metrics(ctx: Ctx, tenant: Caller) -> Response:
    """Prometheus text; per-tenant series only the caller's own (``metrics_tenants.py``)."""
    text = await ctx.metrics.scrape(ctx.engine, live_requests=len(ctx.registry), reader=tenant.name)
    return Response(text, media_type=CONTENT_TYPE)


@router.get("/v1/cluster")
async def cluster(ctx: Ctx) -> dict[str, Any]:
    """Where the model runs: its stages, layer ranges, nodes, memory and step times.

    Read off the event loop and off the engine thread (a pipeline asks its stages).
    """
    return await asyncio.to_thread(cluster_snapshot, ctx.engine)


@router.get("/v1/cache")
async def cache(ctx: Ctx) -> dict[str, Any]:
    """The KV cache: blocks by state, prefix-cache reuse, and the disk tier (``kv_disk``:
    null when it is off; a replica set's tiers summed)."""
    stats = await ctx.engine.stats()
    return {"block_size": stats.block_size,
            "blocks": {"total": stats.kv_blocks_total, "used": stats.kv_blocks_used,
                       "cached": stats.kv_blocks_cached, "free": stats.kv_blocks_free},
            "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
            "prefix_cache_hit_blocks": stats.prefix_cache_hit_blocks,
            "prefix_cache_query_blocks": stats.prefix_cache_query_blocks,
            "kv_disk": disk_tier_body(stats)}


def disk_tier_body(stats: EngineStats) -> dict[str, Any] | None:
    """The disk tier's snapshot as JSON: blocks, bytes, max_bytes, hits, misses, writes,
    dropped_writes, deleted, skipped_files, queued_writes, per-block read/write seconds
    (mean, max) and the index rebuild's seconds."""
    disk: DiskTierStats | None = stats.kv_disk
    return None if disk is None else dataclasses.asdict(disk)


@debug_router.get("/debug/kv")
async def debug_kv(ctx: Ctx) -> dict[str, Any]:
    """The engine's KV block accounting, checked against every live block table (C5)."""
    engine = ctx.engine
    try:
        await engine.check_block_accounting()
        ok, error = True, None
    except AssertionError as exc:
        ok, error = False, str(exc) or "block accounting is inconsistent"
    stats = await ctx.engine.stats()
    return {"ok": ok, "error": error, "kv_blocks_total": stats.kv_blocks_total,
            "kv_blocks_free": stats.kv_blocks_free, "kv_blocks_cached": stats.kv_blocks_cached,
            "kv_blocks_used": stats.kv_blocks_used, "running": stats.running, "waiting": stats.waiting,
            "live_requests": len(ctx.registry), "engine_live_requests": len(engine.live_request_ids()),
            "block_size": stats.block_size,
            "supports_partial_block_reuse": engine.describe().supports_partial_block_reuse,
            "continuation_memory": {"entries": len(ctx.memory), "tokens": ctx.memory.num_tokens},
            "kv_disk": disk_tier_body(stats)}


@debug_router.get("/debug/steps")
async def debug_steps(ctx: Ctx, after: int = 0) -> dict[str, Any]:
    """The engine's recent steps with an index above ``after``, oldest first: for measuring.

    ``ended`` is the server's ``time.monotonic()`` (``now`` too), comparable with a
    client's on the same machine; ``kept`` is how many recent steps the engine holds,
    so a reader polling at least that often misses none.
    """
    engine = ctx.engine
    records = await engine.steps_after(after)
    return {"now": time.monotonic(), "steps_total": engine.counters.steps, "kept": STEP_HISTORY,
            "fields": ["index", "ended", "forward_s", "seqs", "tokens", "decodes"],
            "steps": [[r.index, r.ended, r.forward_s, r.seqs, r.tokens, r.decodes] for r in records]}


@debug_router.get("/debug/stalls")
async def debug_stalls(ctx: Ctx, after: float = 0.0) -> dict[str, Any]:
    """Event-loop lags and collector pauses over 10 ms that ended after ``after`` (the
    server's ``time.monotonic()``): ``[ended at, seconds]`` and ``[ended at, seconds, generation]``."""
    return {"now": time.monotonic(), **ctx.stalls.since(after)}
