"""A replica set described in plain data (``GET /v1/cluster`` is formatted from it by the server)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bargein.engine.client import ReplicaEntry, ReplicaSetInfo

try:
    import ray
except ModuleNotFoundError:  # a replica set needs Ray; this module is imported without it
    ray = None

if TYPE_CHECKING:
    from bargein.distributed.replicas.facade import ReplicaSet


def describe(replica_set: ReplicaSet) -> ReplicaSetInfo:
    """Each replica's routing, losses and, where it answered, its load, cache and stages;
    its node's address goes with the routing view (``node_address``), as stages show theirs."""
    infos = replica_set.replica_infos()
    routing = replica_set.router.snapshot()
    addresses = node_addresses()
    entries = []
    for i in range(len(replica_set.actors)):
        entry = ReplicaEntry(i, routing[i], replica_set.lost[i], replica_set.restarted[i])
        info = infos.get(i)
        if info is not None:
            routing[i]["node_address"] = addresses.get(info.node_id, "?")
            c = info.counters
            entry = ReplicaEntry(
                i, routing[i], replica_set.lost[i], replica_set.restarted[i], node_id=info.node_id, pid=info.pid,
                stats=info.stats, submitted=c.submitted, resumed=c.resumed, aborts=dict(c.aborts),
                dropped_late=c.dropped_late, evictions=info.evictions, weights_from=info.weights_from,
                weights_received_bytes=info.weights_received_bytes, pipeline=info.pipeline,
                threads=info.threads, wait_policy=info.wait_policy)
        entries.append(entry)
    return ReplicaSetInfo(tuple(entries), replica_set.options.stages_per_replica, replica_set.options.routing,
                          replica_set.facts.num_blocks, replica_set.resubmitted, replica_set.dropped_late,
                          replica_set.weights_shipped_bytes, tuple(replica_set.nodes_without_file))


def node_addresses() -> dict[str, str]:
    """Ray's node ids -> their addresses (live nodes; empty without a connection)."""
    if ray is None or not ray.is_initialized():
        return {}
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
