"""The body of ``GET /v1/cluster``, formatted here from the engine client's plain data: one
engine's runner (:class:`~bargein.engine.runner.RunnerInfo`: stages in this process, or a
pipeline's stages on Ray with its health, recoveries and traffic) or a replica set
(:class:`~bargein.engine.client.ReplicaSetInfo`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from bargein.engine.client import EngineClient, ReplicaEntry, ReplicaSetInfo
from bargein.engine.runner import RunnerInfo, StageInfo
from bargein.engine.stats import EngineCounters


def cluster_snapshot(engine: EngineClient) -> dict[str, Any]:
    """``GET /v1/cluster``. Any thread: a pipeline's stages and the replicas answer on their
    own; this may block for one that does not answer, so call it off the event loop."""
    info = engine.cluster()
    if isinstance(info, ReplicaSetInfo):
        return replica_set_body(info)
    return runner_body(info, engine.counters)


def runner_body(info: RunnerInfo, counters: EngineCounters | None = None) -> dict[str, Any]:
    """One engine's runner; with ``counters``, a pipeline's recovery counts include the
    engine's K/V losses and tokens recomputed."""
    pipe = info.pipeline
    if pipe is None:
        return {"object": "cluster", "pipeline": False, "num_stages": len(info.stages),
                "max_in_flight": info.max_in_flight, "kv_blocks": info.kv_blocks,
                "stages": [{"index": s.index, "layers": list(s.layers), "node_address": s.node_address,
                            "device": s.device} for s in info.stages]}
    r = pipe.recovery
    recovery: dict[str, Any] = {"losses": r.losses, "recoveries": r.recoveries, "restarts": list(r.restarts),
                                "last_recover_s": r.recover_seconds[-1] if r.recover_seconds else None,
                                "recover_seconds_total": sum(r.recover_seconds)}
    if counters is not None:
        recovery |= {"kv_losses": counters.kv_losses, "tokens_recomputed": counters.recomputed_tokens}
    return {
        "object": "cluster",
        "pipeline": True,
        "num_stages": len(info.stages),
        "max_in_flight": info.max_in_flight,
        "transport": pipe.transport,
        "kv_blocks": info.kv_blocks,
        "health": pipe.health.state,
        "health_message": pipe.health.message,
        "recovery": recovery,
        "head_traffic": asdict(pipe.head_traffic) | {"total": pipe.head_traffic.total},
        "logits_transfer_s": pipe.logits_transfer_s,
        "split": pipe.split_reason,
        "wait_policy": pipe.wait_policy,
        "stages": [_pipeline_stage(s) for s in info.stages],
    }


def _pipeline_stage(s: StageInfo) -> dict[str, Any]:
    entry: dict[str, Any] = {"index": s.index, "layers": list(s.layers), "node_id": s.node_id,
                             "node_address": s.node_address, "node_memory_bytes": s.node_memory_bytes,
                             "threads": s.threads,
                             "state": "ok" if s.work is not None else "lost", "restarts": s.restarts}
    w = s.work
    if w is not None:
        entry |= {
            "weights_from": w.weights_from,
            "weights_received_bytes": w.weights_received_bytes,
            "plans": w.plans,
            "tokens": w.tokens,
            "busy_s": w.busy_s,
            "mean_step_ms": 1000 * w.busy_s / w.plans if w.plans else None,
            "wait_s": w.wait_s,
            "transfer_s": w.transfer_s,
            "mean_transfer_ms": 1000 * w.transfer_s / w.plans if w.plans and s.index else None,
            "idle_fraction": w.idle_fraction,
            "hidden_bytes_out": w.hidden_bytes_out,
        }
    return entry


def replica_set_body(info: ReplicaSetInfo) -> dict[str, Any]:
    """A replica set: each replica's routing, load, cache hits, losses and, for a replica that
    is a pipeline, its stages."""
    return {"object": "cluster", "pipeline": False, "replicas": [_replica(r) for r in info.replicas],
            "num_replicas": len(info.replicas), "stages_per_replica": info.stages_per_replica,
            "routing": info.routing, "kv_blocks": info.kv_blocks,
            "resubmitted": info.resubmitted, "dropped_late": info.dropped_late,
            "weights_shipped_bytes": info.weights_shipped_bytes,
            "nodes_without_file": list(info.nodes_without_file)}


def _replica(r: ReplicaEntry) -> dict[str, Any]:
    entry: dict[str, Any] = {"index": r.index, **r.routing, "lost": r.lost, "restarted": r.restarted}
    s = r.stats
    if s is None:  # it did not answer
        return entry
    computed = s.computed_tokens + s.prefix_cache_hit_tokens
    entry.update(node_id=r.node_id, pid=r.pid, running=s.running, waiting=s.waiting,
                 kv_blocks_total=s.kv_blocks_total, kv_blocks_free=s.kv_blocks_free,
                 prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
                 cache_hit_rate=round(s.prefix_cache_hit_tokens / computed, 4) if computed else 0.0,
                 steps=s.steps, generated_tokens=s.generated_tokens,
                 submitted=r.submitted, resumed=r.resumed, aborts=dict(r.aborts or {}),
                 dropped_late=r.dropped_late, evictions=r.evictions, weights_from=r.weights_from,
                 weights_received_bytes=r.weights_received_bytes, threads=r.threads, wait_policy=r.wait_policy)
    if r.pipeline is not None:
        body = runner_body(r.pipeline)
        entry.update(stages=body["stages"], pipeline_health=body.get("health"))
    return entry
