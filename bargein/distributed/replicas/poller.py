"""One poller thread per replica: deltas in, losses and hangs found, restarts awaited.

A long ``poll`` returns a batch of deltas (one Ray call for every request's tokens of one
or more steps), which the facade pushes into the requests' streams. A replica is lost
when its poll raises (the actor or its node died) or does not answer within
``call_timeout_s``; it is hung when it answers but its engine finishes no step for
``hang_timeout_s`` while it holds requests (Ray is then asked to replace it). Either way
the facade resubmits its requests, and the poller pings until Ray's restarted actor (a
new incarnation) answers, then reports the replica back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bargein.distributed.replicas.actor import ReplicaBatch

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError
except ModuleNotFoundError as exc:  # the optional extra is missing: launching says so in one line
    if exc.name != "ray" and not (exc.name or "").startswith("ray."):
        raise
    ray = None

log = logging.getLogger("bargein.distributed")

POLL_S = 0.5  # a poll's long wait when nothing happens


@dataclass
class Progress:
    """A poller's view of whether its replica's engine is still stepping."""

    steps: int = -1
    since: float = field(default_factory=time.monotonic)

    def stalled(self, steps: int, busy: bool, timeout_s: float) -> bool:
        now = time.monotonic()
        if steps != self.steps or not busy:
            self.steps, self.since = steps, now
            return False
        return now - self.since > timeout_s


@dataclass
class PollerHooks:
    """What a poller reports to the facade, and asks it."""

    deliver: Callable[[int, ReplicaBatch], None]  # a batch of replica ``index``
    lose: Callable[[int, str], None]  # replica ``index`` is gone (why)
    back: Callable[[int], None]  # replica ``index`` answers again (a new incarnation)
    busy: Callable[[int], bool]  # replica ``index`` holds requests


class Poller:
    """The thread that polls replica ``index`` (see the module doc)."""

    def __init__(self, index: int, actor: Any, started: float, call_timeout_s: float, hang_timeout_s: float,
                 stopping: threading.Event, hooks: PollerHooks):
        self.index = index
        self.actor = actor
        self.incarnation = started  # the replica's start time, as its ping reports it
        self.call_timeout_s = call_timeout_s
        self.hang_timeout_s = hang_timeout_s
        self.stopping = stopping
        self.hooks = hooks
        self.thread = threading.Thread(target=self._loop, name=f"bargein-poll-{index}", daemon=True)

    def start(self) -> Poller:
        self.thread.start()
        return self

    def join(self) -> None:
        self.thread.join(timeout=2 * POLL_S + 1)

    def _loop(self) -> None:
        timeout = POLL_S + self.call_timeout_s
        progress = Progress()
        while not self.stopping.is_set():
            try:
                batch = ray.get(self.actor.poll.remote(POLL_S), timeout=timeout)
            except (RayActorError, GetTimeoutError) as exc:
                if self.stopping.is_set():
                    return
                if isinstance(exc, GetTimeoutError):  # the actor stopped answering: have Ray replace it
                    ray.kill(self.actor, no_restart=False)
                first = str(exc).strip().splitlines()[0] if str(exc) else ""
                self._replace(f"{type(exc).__name__}: {first}")
                progress = Progress()
                continue
            except Exception:
                log.exception("replica %d: polling failed", self.index)
                time.sleep(POLL_S)
                continue
            self.hooks.deliver(self.index, batch)
            if progress.stalled(batch.steps, self.hooks.busy(self.index), self.hang_timeout_s):
                # Its actor answers, but its engine has not finished a step for that long
                # while it holds requests: a hung forward. Replace it like a lost one.
                ray.kill(self.actor, no_restart=False)
                self._replace(f"no step finished in {self.hang_timeout_s:g} s")
                progress = Progress()

    def _replace(self, why: str) -> None:
        self.hooks.lose(self.index, why)
        self._await_restart()

    def _await_restart(self) -> None:
        """Pings the lost replica until Ray has restarted it (a new incarnation answers)."""
        while not self.stopping.is_set():
            try:
                started = ray.get(self.actor.ping.remote(), timeout=self.call_timeout_s)
            except (RayActorError, GetTimeoutError):
                time.sleep(POLL_S)
                continue
            except Exception:
                log.exception("replica %d: ping failed", self.index)
                time.sleep(POLL_S)
                continue
            if started == self.incarnation:  # the old one, not yet gone (a hung one being killed)
                time.sleep(POLL_S)
                continue
            self.incarnation = started
            self.hooks.back(self.index)
            log.info("replica %d is back", self.index)
            return
