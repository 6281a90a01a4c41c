"""Goodput as the field defines it for comparing servers: the highest request rate a
server sustains while at least a stated share of its requests meets every SLO.

DistServe (OSDI'24) defines a server's goodput as the maximum request rate at which a
target share (here 90%) of requests meets its latency objectives (SLO attainment);
vLLM's and SGLang's serving benchmarks follow it. Goodput *per rate* (requests meeting
the SLOs per second at one offered rate) cannot separate two servers that both keep up
at that rate; the highest sustained rate can.

Everything here is plain data and pure functions, so that the accounting and the search
are tested exactly without a server:

- :class:`Slo`: the objectives (TTFT <= 2 s, ITL <= 100 ms) and a request's verdict,
  including the verdict that is already certain while the request still streams;
- :func:`tally`, :func:`settled`: one run's SLO share, and whether it is already decided;
- :func:`boundary`, :func:`next_rate`, :func:`crossing`, :func:`search`: the rate search
  (step by a factor until the share is missed, bisect, repeat the boundary rate).

Requests the load cancels (a seeded share, closed by the client a fixed delay after
sending) are load, not judged: they are excluded from the share whether or not the
client got to cancel them (``Record.cancel_planned``). docs/serving.md says why.

Records are duck-typed (``bench/serving_client.Record``): ``sent``, ``first_token``,
``last_event``, ``output_tokens``, ``outcome``, ``ended``, ``cancel_planned``, ``ttft``, ``itl``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_EPS = 1e-9  # shares are compared as met >= share * judged; this absorbs 0.9 * n's rounding


@dataclass(frozen=True)
class Slo:
    """Goodput's service level objectives: a completed request is good if it meets both."""

    ttft_s: float = 2.0
    itl_s: float = 0.100

    def met(self, r: Any) -> bool:
        """A completed request's verdict (AIPerf's TTFT and ITL definitions)."""
        itl = r.itl
        return r.ttft is not None and r.ttft <= self.ttft_s and (itl is None or itl <= self.itl_s)

    def surely_missed(self, r: Any, now: float, max_tokens: int) -> bool:
        """True when a request still streaming at ``now`` can no longer meet the SLOs.

        No first token ``ttft_s`` after sending is a TTFT miss. After the first token, the
        request's ITL is (last event - first token) / (output tokens - 1) with at most
        ``max_tokens`` output tokens, so it exceeds ``itl_s`` once
        ``now - first_token > itl_s * (max_tokens - 1)`` and the stream has not ended.
        Consequently every request in flight ``ttft_s + itl_s * (max_tokens - 1)`` after
        sending is a sure miss (:func:`settled` relies on it to end a run)."""
        if r.first_token is None:
            return now - r.sent > self.ttft_s
        if r.first_token - r.sent > self.ttft_s:
            return True
        return now - r.first_token > self.itl_s * (max_tokens - 1)

    def longest_wait_s(self, max_tokens: int) -> float:
        """After this long in flight, a request is a sure miss (see :meth:`surely_missed`)."""
        return self.ttft_s + self.itl_s * (max_tokens - 1)


@dataclass(frozen=True)
class RunTally:
    """One run at one offered rate: ``met`` of ``judged`` requests within the SLOs."""

    rate: float  # offered requests/s, cancelled ones included
    met: int  # a run stopped because its rate failed counts only what met before the stop
    judged: int
    stopped: bool = False  # ended early because the verdict was certain

    @property
    def share(self) -> float:
        return self.met / self.judged if self.judged else math.nan


def passes(met: int, judged: int, share: float) -> bool:
    """Whether ``met`` of ``judged`` requests is at least ``share`` (none judged: no)."""
    return judged > 0 and met >= share * judged - _EPS


def allowed_misses(judged: int, share: float) -> int:
    """The most judged requests that may miss while the share still passes."""
    return judged - math.ceil(share * judged - _EPS)


def judged_records(records: Sequence[Any]) -> list[Any]:
    """The requests the SLO share is over: every one the load did not plan to cancel."""
    return [r for r in records if not r.cancel_planned]


def tally(records: Sequence[Any], slo: Slo) -> int:
    """How many judged requests completed within the SLOs. A judged request that errored,
    was stopped with its run, or was never sent counts as missed."""
    return sum(1 for r in judged_records(records) if r.ended and r.outcome == "ok" and slo.met(r))


def misses(records: Sequence[Any], slo: Slo, now: float, max_tokens: int) -> int:
    """Judged requests already known to miss at ``now``: ended without meeting the SLOs
    (an error included), or in flight and :meth:`Slo.surely_missed`."""
    n = 0
    for r in judged_records(records):
        if r.ended:
            n += not (r.outcome == "ok" and slo.met(r))
        elif slo.surely_missed(r, now, max_tokens):
            n += 1
    return n


def settled(records: Sequence[Any], planned: int, judged: int, slo: Slo, share: float, now: float,
            max_tokens: int, prior: Sequence[RunTally] = ()) -> bool:
    """Whether the verdict on a run's rate is already certain, so the run may stop early.

    ``records`` are the requests sent so far (in sending order) of ``planned``, of which
    ``judged`` are not planned to be cancelled; ``prior``: the rate's earlier runs, whose
    requests are pooled with these (:func:`boundary`). Certain when more judged requests
    surely missed, these and the earlier runs' together, than the pooled share allows (the
    rate fails whatever comes), or when every request was sent and no judged request is
    still undecided (ended, or surely missed)."""
    prior_misses = sum(t.judged - t.met for t in prior)
    pooled_judged = judged + sum(t.judged for t in prior)
    if misses(records, slo, now, max_tokens) + prior_misses > allowed_misses(pooled_judged, share):
        return True
    if len(records) < planned:
        return False
    return all(r.ended or slo.surely_missed(r, now, max_tokens) for r in judged_records(records))


@dataclass(frozen=True)
class SearchPlan:
    """How the rate search steps; rates in requests/s."""

    start: float = 1.0  # the first run's rate
    factor: float = 2.0  # step up (or down) by this until the share is missed (or met)
    resolution: float = 1.2  # bisect until the lowest failing rate is within this factor of the boundary
    repeats: int = 2  # runs of the boundary rate (each with other arrivals, prompts and cancels)
    floor: float = 0.05  # stepping down stops below this: the server meets no rate
    max_runs: int = 10
    share: float = 0.9  # the SLO share a rate must reach (DistServe's attainment target)


def pooled(tallies: Sequence[RunTally]) -> dict[float, tuple[int, int]]:
    """(met, judged) summed over the runs of each rate, in increasing rate order."""
    out: dict[float, tuple[int, int]] = {}
    for t in sorted(tallies, key=lambda t: t.rate):
        met, judged = out.get(t.rate, (0, 0))
        out[t.rate] = (met + t.met, judged + t.judged)
    return out


def boundary(tallies: Sequence[RunTally], share: float) -> tuple[float | None, float | None]:
    """(highest sustained rate, lowest failing rate) on the runs' pooled shares.

    The lowest rate whose pooled share misses caps the result: a passing rate above it
    (noise) is not counted, so the sustained rate is the highest passing rate below the
    lowest failing one. None where no rate passed (first) or none failed (second)."""
    by_rate = pooled(tallies)
    failing = [rate for rate, (met, judged) in by_rate.items() if not passes(met, judged, share)]
    hi = min(failing) if failing else None
    ok = [rate for rate, (met, judged) in by_rate.items()
          if passes(met, judged, share) and (hi is None or rate < hi)]
    return (max(ok) if ok else None), hi


def next_rate(tallies: Sequence[RunTally], plan: SearchPlan) -> float | None:
    """The next rate to run, or None when the search is done.

    In order: the start rate; up by ``factor`` while every rate passed; down by ``factor``
    while none passed (None below ``floor``); the geometric middle of the bracket while
    the failing rate is more than ``resolution`` times the sustained one; the sustained
    rate again until it has ``repeats`` runs. A repeat that pulls the pooled share under
    the target moves the boundary down and the search goes on from there."""
    if not tallies:
        return plan.start
    lo, hi = boundary(tallies, plan.share)
    if hi is None:
        return max(t.rate for t in tallies) * plan.factor
    if lo is None:
        lower = min(t.rate for t in tallies) / plan.factor
        return lower if lower >= plan.floor else None
    if hi / lo > plan.resolution:
        return math.sqrt(lo * hi)
    if sum(t.rate == lo for t in tallies) < plan.repeats:
        return lo
    return None


def crossing(tallies: Sequence[RunTally], share: float) -> float | None:
    """The rate where the pooled share, linear between the sustained rate and the lowest
    failing rate, reaches ``share``: an estimate inside the bracket, not a measured rate."""
    lo, hi = boundary(tallies, share)
    if lo is None or hi is None:
        return None
    by_rate = pooled(tallies)
    s_lo, s_hi = (by_rate[r][0] / by_rate[r][1] for r in (lo, hi))
    return lo + (hi - lo) * (s_lo - share) / (s_lo - s_hi)


def search(run_at: Callable[[float, list[RunTally]], RunTally], plan: SearchPlan,
           fits: Callable[[float], bool] = lambda rate: True) -> list[RunTally]:
    """Runs ``run_at(rate, prior)`` (``prior``: that rate's earlier runs) at the rates
    :func:`next_rate` picks, until it says done, ``plan.max_runs`` runs, or ``fits(rate)``
    says a run at the next rate no longer fits the time left. Returns the runs in the
    order they ran."""
    tallies: list[RunTally] = []
    while len(tallies) < plan.max_runs:
        rate = next_rate(tallies, plan)
        if rate is None or not fits(rate):
            break
        tallies.append(run_at(rate, [t for t in tallies if t.rate == rate]))
    return tallies


def summary(tallies: Sequence[RunTally], plan: SearchPlan) -> dict[str, Any]:
    """What a search found: the sustained rate (goodput), the bracket, the interpolated
    crossing, the boundary's per-run shares (their spread), and whether the search ended
    on its own (``complete``) or by the run or time limit."""
    lo, hi = boundary(tallies, plan.share)
    return {"max_slo_rate": lo, "lowest_failing_rate": hi, "crossing_rate": crossing(tallies, plan.share),
            "boundary_shares": [t.share for t in tallies if lo is not None and t.rate == lo],
            "runs": len(tallies), "complete": next_rate(tallies, plan) is None}


def ratio_bounds(a: dict[str, Any], b: dict[str, Any]) -> tuple[float | None, float | None, float | None]:
    """Server a's goodput over server b's from two :func:`summary` results: (measured
    ratio, lowest, highest consistent with the brackets). Each true boundary lies in
    [max_slo_rate, lowest_failing_rate); a missing bound leaves its side open (None)."""
    a_lo, a_hi, b_lo, b_hi = a["max_slo_rate"], a["lowest_failing_rate"], b["max_slo_rate"], b["lowest_failing_rate"]
    ratio = a_lo / b_lo if a_lo and b_lo else None
    low = a_lo / b_hi if a_lo and b_hi else None
    high = a_hi / b_lo if a_hi and b_lo else None
    return ratio, low, high
