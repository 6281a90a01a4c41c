"""Noticing a lost stage, and what its recoveries cost: the head's side of issue 13.

A stage is lost when its actor died (its process or its node went away) or when it
stops answering: the heartbeat (``StageWorker.ping``, answered on the stage's own
health thread, so it never waits behind plans) gets no answer within its timeout. The
runner's watchdog sends it while a plan takes longer than a heartbeat interval; a
plan that exceeds the step deadline while every stage answers marks the stage that
holds it (the first that has not finished it) as hung.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray


@dataclass
class RecoveryStats:
    """Losses and recoveries of a pipeline's stages (plain data, read by /v1/cluster)."""

    num_stages: int
    losses: int = 0  # times one or more stages were found lost
    recoveries: int = 0  # times every lost stage was re-created
    restarts: list[int] = field(default_factory=list)  # per stage: times it was re-created
    recover_seconds: list[float] = field(default_factory=list)  # loss noticed -> stages ready again

    def __post_init__(self) -> None:
        if not self.restarts:
            self.restarts = [0] * self.num_stages

    def as_dict(self) -> dict[str, Any]:
        last = self.recover_seconds[-1] if self.recover_seconds else None
        return {"losses": self.losses, "recoveries": self.recoveries, "restarts": list(self.restarts),
                "last_recover_s": last, "recover_seconds_total": sum(self.recover_seconds)}


def unanswered(actors: Sequence[Any], timeout_s: float) -> dict[int, str]:
    """Pings every stage at once; returns the stages that did not answer within
    ``timeout_s`` (or whose actor is dead), with why, in one line each."""
    pings = [a.ping.remote() for a in actors]
    ready, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
    answered = set(ready)
    lost = {}
    for i, ref in enumerate(pings):
        if ref not in answered:
            lost[i] = f"no heartbeat within {timeout_s:g} s"
            continue
        try:
            ray.get(ref)
        except ray.exceptions.RayError as exc:
            lost[i] = f"its actor died ({type(exc).__name__})"
    return lost


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
