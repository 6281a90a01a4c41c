"""CPU limits for test processes: a cgroup with a CPU quota (a slow machine) or a large
CPU weight (one that wins the cores from the rest of a loaded machine), on cgroup v2 or
v1's ``cpu`` controller, whichever this machine mounts.

:func:`cpu_group` makes one, moves the given processes in, and on exit moves every
process still in it back to the root group and removes it. Needs root; :func:`unavailable`
says why not where it cannot be made.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

V2 = Path("/sys/fs/cgroup")
V1_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def _root() -> tuple[Path, bool]:
    """The cgroup root that has the cpu controller, and whether it is v2."""
    if (V2 / "cgroup.controllers").exists() and "cpu" in (V2 / "cgroup.controllers").read_text().split():
        return V2, True
    return V1_CPU, False


def unavailable() -> str | None:
    """Why a CPU cgroup cannot be made here, or None."""
    if os.geteuid() != 0:
        return "cgroups need root"
    root, v2 = _root()
    if not root.is_dir() or not os.access(root, os.W_OK):
        return f"no writable cgroup cpu controller at {root}"
    if v2:
        try:  # a container's cgroup root that holds processes cannot give controllers to children
            (root / "cgroup.subtree_control").write_text("+cpu")
        except OSError as exc:
            return f"cannot enable the cpu controller for child cgroups of {root}: {exc.strerror or exc}"
    return None


@contextlib.contextmanager
def cpu_group(pids: Iterable[int] = (), *, cpus: float | None = None, weight_max: bool = False) -> Iterator[Path]:
    """A new cgroup holding ``pids`` (and what they start later): at most ``cpus`` CPUs
    (a quota over 100 ms periods), and with ``weight_max`` the largest CPU weight."""
    root, v2 = _root()
    group = root / f"bargein-test-{random.getrandbits(32):08x}"
    if v2:  # the controller enabled for children (unavailable() says where it cannot be)
        (root / "cgroup.subtree_control").write_text("+cpu")
    group.mkdir()
    try:
        if cpus is not None:
            quota = str(int(cpus * PERIOD_US))
            if v2:
                (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(quota)
        if weight_max:
            (group / ("cpu.weight" if v2 else "cpu.shares")).write_text("10000" if v2 else "262144")
        for pid in pids:
            add(group, pid)
        yield group
    finally:
        for _ in range(3):  # processes forked meanwhile land in the group too
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (root / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            group.rmdir()


def add(group: Path, pid: int) -> None:
    """Moves process ``pid`` (all its threads) into ``group``; one that has exited is skipped."""
    with contextlib.suppress(ProcessLookupError, FileNotFoundError):
        try:
            (group / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            if exc.errno != 3:  # ESRCH: gone
                raise
