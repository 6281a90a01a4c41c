"""``/v1/cluster`` of a replica set: each replica's routing, health, load, cache and losses."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bargein.distributed.replicas.facade import ReplicaSet


def cluster_info(replica_set: ReplicaSet) -> dict[str, Any]:
    """The replicas as ``/v1/cluster`` shows them (a replica that did not answer: routing only)."""
    infos = replica_set.replica_infos()
    routing = replica_set.router.snapshot()
    replicas = []
    for i in range(len(replica_set.actors)):
        info = infos.get(i)
        entry: dict[str, Any] = {"index": i, **routing[i], "lost": replica_set.lost[i], "restarted": replica_set.restarted[i]}
        if info is not None:
            s = info.stats
            computed = s.computed_tokens + s.prefix_cache_hit_tokens
            entry.update(node_id=info.node_id, pid=info.pid, running=s.running, waiting=s.waiting,
                         kv_blocks_total=s.kv_blocks_total, kv_blocks_free=s.kv_blocks_free,
                         prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
                         cache_hit_rate=round(s.prefix_cache_hit_tokens / computed, 4) if computed else 0.0,
                         steps=s.steps, generated_tokens=s.generated_tokens,
                         submitted=info.counters.submitted, resumed=info.counters.resumed,
                         aborts=dict(info.counters.aborts), dropped_late=info.counters.dropped_late,
                         evictions=info.evictions, weights_from=info.weights_from,
                         weights_received_bytes=info.weights_received_bytes)
            if info.pipeline is not None:
                entry.update(stages=info.pipeline["stages"], pipeline_health=info.pipeline.get("health"))
        replicas.append(entry)
    return {"object": "cluster", "pipeline": False, "replicas": replicas, "num_replicas": len(replica_set.actors),
            "stages_per_replica": replica_set.options.stages_per_replica,
            "routing": replica_set.options.routing, "kv_blocks": replica_set.facts.num_blocks,
            "resubmitted": replica_set.resubmitted, "dropped_late": replica_set.dropped_late,
            "weights_shipped_bytes": replica_set.weights_shipped_bytes,
            "nodes_without_file": list(replica_set.nodes_without_file)}
