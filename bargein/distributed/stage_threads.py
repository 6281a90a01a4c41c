"""Each pipeline stage's compute threads, and the Ray CPUs it takes on its node.

Given (``PipelineConfig.threads_per_stage``, ``--threads N``): N threads and N CPUs for
every stage. Not given (None, ``serve`` without ``--threads``): per node, like replicas
(:mod:`~bargein.distributed.replicas.slots`): a node offers the smaller of its Ray CPUs
and the CPUs its processes may use, measured there (affinity and cgroup quota,
:func:`~bargein.distributed.node_cpus.node_offer`), and the stages placed on one node share
its offer equally, at least one thread each; each takes as many Ray CPUs as it has threads,
at most its share of the node's Ray CPUs (whole, or a fraction under one: so the stages
placed on a node always fit it).

A stage re-created after a loss keeps the threads it was planned with, wherever Ray puts it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StageThreads:
    """One stage's compute threads and the Ray CPUs its actor reserves."""

    threads: int
    num_cpus: float


def plan_stage_threads(nodes: Sequence[Mapping[str, Any]], usable: Mapping[str, float],
                       given: int | None = None) -> list[StageThreads]:
    """The threads of stage i, placed on ``nodes[i]`` (``ray.nodes()`` entries; a node may
    repeat: stages sharing it). ``usable``: node id -> the CPUs measured there (a node left
    out offers its Ray CPUs); ``given``: every stage's threads, as given. Pure."""
    if given is not None:
        return [StageThreads(given, float(given))] * len(nodes)
    from bargein.distributed.node_cpus import node_offer

    sharing = Counter(n["NodeID"] for n in nodes)
    plan = []
    for n in nodes:
        count = sharing[n["NodeID"]]
        threads = max(1, math.floor(node_offer(n, usable) / count))
        share = n["Resources"].get("CPU", 0) / count  # Ray takes fractions under 1 only
        plan.append(StageThreads(threads, float(min(threads, math.floor(share) if share >= 1 else share))))
    return plan


def stage_threads(nodes: Sequence[Mapping[str, Any]], given: int | None) -> list[StageThreads]:
    """:func:`plan_stage_threads` for stages placed on ``nodes``, measuring the nodes' usable
    CPUs (Ray tasks pinned to them) only when the threads are not given."""
    if given is not None:
        return plan_stage_threads(nodes, {}, given)
    from bargein.distributed.node_cpus import measure_usable_cpus

    return plan_stage_threads(nodes, measure_usable_cpus(n["NodeID"] for n in nodes))

