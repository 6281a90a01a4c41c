"""The CPUs a process may use on its machine: its affinity (``taskset``, a container's
cpuset), lowered by its cgroup's CPU quota (a container's or a slice's ``cpu.max``; cgroup
v2, or v1's ``cpu`` controller). Plain file reads, no torch: cheap to ask anywhere. Also
what a Ray node offers (:func:`node_offer`) and asking every node (:func:`measure_usable_cpus`).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def usable_cpus() -> float:
    """The CPUs this process may use: its affinity, lowered by its cgroup's CPU quota."""
    try:
        cpus = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return float(os.cpu_count() or 1)
    quota = _cgroup_quota()
    return min(cpus, quota) if quota is not None else cpus


def _cgroup_quota() -> float | None:
    """CPUs allowed by this process's cgroup quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        try:
            if controllers == "":  # v2: "max 100000" or "20000 100000"
                quota, period = Path(f"/sys/fs/cgroup{path}/cpu.max").read_text().split()
            elif "cpu" in controllers.split(","):
                base = next(p for p in (Path(f"/sys/fs/cgroup/{c}{path}") for c in ("cpu", "cpu,cpuacct"))
                            if p.is_dir())
                quota = (base / "cpu.cfs_quota_us").read_text().strip()
                period = (base / "cpu.cfs_period_us").read_text().strip()
            else:
                continue
        except (OSError, StopIteration, ValueError):
            continue
        if quota not in ("max", "-1"):
            return int(quota) / int(period)
    return None


def node_offer(node: Mapping[str, Any], usable: Mapping[str, float]) -> float:
    """What a Ray node offers its stages or replicas: the smaller of its Ray CPUs (a node may
    declare more logical CPUs than it has) and the CPUs its processes may use there
    (``usable``: node id -> :func:`usable_cpus` measured on it; a node left out offers its
    Ray CPUs). ``node``: a ``ray.nodes()`` entry."""
    return min(node["Resources"].get("CPU", 0), usable.get(node["NodeID"], math.inf))


def measure_usable_cpus(node_ids: Iterable[str], timeout_s: float = 30.0) -> dict[str, float]:
    """:func:`usable_cpus` on each Ray node (a task pinned there, all at once; Ray must be
    connected); a node that does not answer in time, or fails, is left out."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(usable_cpus)
    refs = {node: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
            for node in dict.fromkeys(node_ids)}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    answered = {}
    for node, ref in refs.items():
        if ref in ready:
            with contextlib.suppress(ray.exceptions.RayError):  # it failed: as if it had not answered
                answered[node] = float(ray.get(ref))
    return answered
