"""The CPUs a process may use on its machine: its affinity (``taskset``, a container's
cpuset), lowered by its cgroup's CPU quota (a container's or a slice's ``cpu.max``; cgroup
v2, or v1's ``cpu`` controller). Plain file reads, no torch: cheap to ask anywhere."""

from __future__ import annotations

import os
from pathlib import Path


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
