"""Keeping a machine in its Ray cluster: ``bargein cluster join --rejoin``.

Ray takes a node back only while it has not declared it dead. A machine whose link is
down (or that is asleep, or too busy to answer) past the head's health checks (Ray's
``health_check_*`` settings: about half a minute by default) is declared dead; when it
comes back its raylet learns so and ends, and Ray never lets that node in again: the
machine must start a new node. :func:`keep_joined` does that by itself: it watches the
raylet its ``ray start`` started and, once that process has ended, waits until the head
answers and runs the same ``ray start`` again (a new node, with the same address, CPUs and
memory), as often as it takes. The cluster's work then goes there as to any new node
(replicas that Ray restarts, stages re-created, the next servers' placement).

A raylet is found by its command line (the ``raylet`` executable, this node's
``--node_ip_address`` and, when given, its ``--temp_dir``) and followed by process id
and start time, so a recycled id is not mistaken for it. Linux only (``/proc``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bargein.distributed.errors import PipelineSetupError
from bargein.distributed.join import NodeStart, check_reachable

PROC = Path("/proc")


@dataclass(frozen=True)
class Process:
    """A process by id and start time (clock ticks after boot): the pair a recycled id cannot repeat."""

    pid: int
    started: int

    def alive(self) -> bool:
        return _start_time(self.pid) == self.started


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started; None when there is none, or only its exit status (a zombie)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the name, which may hold spaces and parentheses
    return None if fields[0] in ("Z", "X") else int(fields[19])  # state, start time (fields 3 and 22)


def raylets(node_ip: str, temp_dir: str | None = None) -> set[Process]:
    """The raylet processes of the node at ``node_ip`` (with Ray's ``temp_dir``, if given)."""
    found = set()
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if not argv[0].endswith("/raylet") or f"--node_ip_address={node_ip}" not in argv:
            continue
        if temp_dir is not None and f"--temp_dir={temp_dir}" not in argv:
            continue
        started = _start_time(int(entry.name))
        if started is not None:
            found.add(Process(int(entry.name), started))
    return found


def start_node(start: NodeStart, ray_start: Callable[[NodeStart], None], settle_s: float = 5.0) -> set[Process]:
    """Runs ``ray_start(start)`` and returns the raylet it started: the raylets of this node
    that were not there before, looked for during ``settle_s`` at most (a process just
    started shows its command line once it has replaced its image); else all of this node's."""
    before = raylets(start.node_ip, start.temp_dir)
    ray_start(start)
    deadline = time.monotonic() + settle_s
    while not (new := raylets(start.node_ip, start.temp_dir) - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    return new or raylets(start.node_ip, start.temp_dir)


def keep_joined(start: NodeStart, ray_start: Callable[[NodeStart], None], say: Callable[[str], None],
                watched: set[Process], stop: threading.Event, *, poll_s: float = 1.0,
                retry_s: float = 2.0) -> None:
    """Until ``stop`` is set: while a raylet of ``watched`` lives, waits; once none does, waits
    until the head answers and starts the node again (``ray_start``; a failure is said and
    tried again every ``retry_s``). ``say`` gets one line per event."""
    if start.head_address is None:
        raise ValueError("only a worker node joins again: the head is the cluster")
    host, _, port = start.head_address.rpartition(":")
    while not stop.wait(poll_s):
        if any(p.alive() for p in watched):
            continue
        say("this node left the Ray cluster (its raylet ended: Ray declared the node dead, or it crashed); "
            f"joining again once the head at {start.head_address} answers")
        last_problem = None
        while not stop.is_set():
            try:
                check_reachable(host, int(port), timeout=retry_s)
                watched = start_node(start, ray_start)
            except PipelineSetupError as exc:
                if str(exc) != last_problem:  # one line per new problem, not one per try
                    say(f"not yet: {exc}")
                    last_problem = str(exc)
                stop.wait(retry_s)
                continue
            say(f"this machine ({start.node_ip}) joined the Ray cluster at {start.head_address} again")
            break
