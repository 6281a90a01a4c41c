"""Where each whole-model replica runs and with how many compute threads, when ``serve``
is given no ``--threads``: per node, from what the node offers.

A node offers the smaller of its Ray CPUs and the CPUs its processes may use (measured
there: affinity and cgroup quota, :func:`~bargein.distributed.node_cpus.node_offer`; a
Ray node may declare more logical CPUs than it has). Replicas go one at a time to the
node that would then give each of its replicas the most whole threads (ties: the node
with fewer replicas, then more memory), and each replica on a node gets an equal share
of what it offers as threads, at least one, reserving as many Ray CPUs. Pure: the caller
measures the nodes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bargein.distributed.errors import PipelineSetupError
from bargein.distributed.node_cpus import node_offer


@dataclass(frozen=True)
class ReplicaSlot:
    """One replica's node (None: where Ray finds room), threads and the Ray CPUs it takes."""

    node_id: str | None
    threads: int
    num_cpus: float


def plan_replica_slots(num_replicas: int, nodes: Sequence[Mapping[str, Any]],
                       usable_cpus: Mapping[str, float]) -> list[ReplicaSlot]:
    """The slot of each replica (see the module doc). ``nodes``: ``ray.nodes()`` entries;
    ``usable_cpus``: node id -> the CPUs measured there (a node left out offers its Ray
    CPUs). Raises PipelineSetupError, in one line, when the replicas do not fit one Ray
    CPU each."""
    offers = {n["NodeID"]: node_offer(n, usable_cpus) for n in nodes}
    ray_cpus = {n["NodeID"]: int(n["Resources"].get("CPU", 0)) for n in nodes}
    memory = {n["NodeID"]: n["Resources"].get("memory", 0) for n in nodes}
    if num_replicas > sum(ray_cpus.values()):
        raise PipelineSetupError(f"{num_replicas} replicas need a CPU each, but the cluster's {len(nodes)} nodes "
                                 f"offer {sum(ray_cpus.values())}: use fewer replicas or add nodes")
    counts = dict.fromkeys(offers, 0)
    for _ in range(num_replicas):
        room = [n for n in offers if counts[n] < ray_cpus[n]]
        pick = max(room, key=lambda n: (math.floor(offers[n] / (counts[n] + 1)), -counts[n], memory[n]))
        counts[pick] += 1
    threads = {n: max(1, math.floor(offers[n] / c)) if c else 0 for n, c in counts.items()}
    return [ReplicaSlot(n, threads[n], float(min(threads[n], ray_cpus[n] // counts[n])))
            for n in counts for _ in range(counts[n])]
