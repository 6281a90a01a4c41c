"""The ``goodput`` workload: the rate search of ``serving_goodput`` run against a server.

Each run sends Poisson arrivals at one offered rate for about ``window_s`` seconds
(``max(min_requests, round(rate * window_s))`` requests, input and output as the other
rate workloads), a seeded share of them cancelled by the client a fixed delay after
sending; it ends as soon as its verdict is certain (``serving_goodput.settled``), which
bounds a run to its arrivals plus ``Slo.longest_wait_s`` (14.7 s at output 128). A run
starts only if that much still fits the server's time budget. After each run (and before
the first) the server is let finish what it still works on (its own gauges; a server that
keeps computing the requests whose clients left takes a while), so no run inherits
another's backlog; that wait is reported (``drain_after_s``) and counts against the budget.

Seeds: every rate's first run uses the same seed (arrival gaps that scale with the rate,
the same prompts and the same cancelled requests: common random numbers, so rates differ
by their rate only); a repeat of a rate uses another seed. Both servers get the same.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Any

from common import format_table, rnd
from serving_client import Target, cancelled_count, run_rate
from serving_goodput import (
    RunTally,
    SearchPlan,
    Slo,
    passes,
    ratio_bounds,
    search,
    settled,
    summary,
    tally,
)
from serving_metrics import summarize
from serving_servers import Server
from serving_workloads import PromptMaker

REPEAT_SEED_STEP = 101  # a repeat's seed offset: other arrivals, prompts and cancelled requests


@dataclass(frozen=True)
class GoodputLoad:
    """What every run of the search sends."""

    input_tokens: int = 128
    output_tokens: int = 128
    cancel_share: float = 0.2
    cancel_after_s: float = 1.0
    window_s: float = 20.0  # arrivals span about this long at any rate
    min_requests: int = 13  # 10 judged at a 20% cancel share: the least that lets one request miss
    budget_s: float = 190.0  # per server: a run starts only if its arrivals and longest wait fit
    seed: int = 0

    def requests(self, rate: float) -> int:
        return max(self.min_requests, round(rate * self.window_s))


def measure_goodput(server: Server, target: Target, maker: PromptMaker, load: GoodputLoad, plan: SearchPlan,
                    slo: Slo) -> dict[str, Any]:
    """Runs the search against ``server``; returns its summary and every run's row."""
    rows: list[dict[str, Any]] = []

    def run_at(rate: float, prior: list[RunTally]) -> RunTally:
        n, repeat = load.requests(rate), len(prior)
        judged = n - cancelled_count(n, load.cancel_share)
        seed = load.seed + REPEAT_SEED_STEP * repeat
        prompts = maker.prompts(n, load.input_tokens, seed + 3)
        cpu0 = server.cpu_seconds()

        def stop(records, now: float) -> bool:
            return settled(records, n, judged, slo, plan.share, now, load.output_tokens, prior)

        run = asyncio.run(run_rate(target, prompts, rate, load.output_tokens, cancel_share=load.cancel_share,
                                   cancel_after_s=load.cancel_after_s, seed=seed, stop_when=stop))
        cpu_share = (server.cpu_seconds() - cpu0) / max(run.duration, 1e-6)
        drain = server.wait_idle()
        met = tally(run.records, slo)
        stopped = len(run.records) < n or any(r.outcome == "stopped" for r in run.records)
        rows.append({"rate": rate, "repeat": repeat, "planned": n, "sent": len(run.records), "judged": judged,
                     "met": met, "share": met / judged, "passed": passes(met, judged, plan.share),
                     "ended_early": stopped, "drain_after_s": drain, **summarize(run, slo),
                     "server_cpu_share": cpu_share})
        return RunTally(rate, met, judged, stopped)

    started = time.monotonic()
    drain_before = server.wait_idle()  # what an earlier workload left

    def fits(rate: float) -> bool:  # the arrivals' expected span and the longest a request is waited for
        longest = load.requests(rate) / rate + slo.longest_wait_s(load.output_tokens)
        return time.monotonic() - started + longest <= load.budget_s

    tallies = search(run_at, plan, fits)
    return {"load": asdict(load), "plan": asdict(plan), "slo": asdict(slo), **summary(tallies, plan),
            "seconds": time.monotonic() - started, "drain_before_s": drain_before, "runs_detail": rows}


def goodput_sections(results: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """The per-run table, the per-server summary and, for two servers, the ratio."""
    found = {s: res["goodput"] for s, res in results.items() if "goodput" in res}
    if not found:
        return []
    any_result = next(iter(found.values()))
    load, share = any_result["load"], any_result["plan"]["share"]
    what = (f"Poisson arrivals, {load['cancel_share']:.0%} cancelled after {load['cancel_after_s']:g} s, "
            f"SLO share >= {share:.0%} of the requests not cancelled")
    runs = [{"server": s, "rate/s": r["rate"], "run": r["repeat"] + 1, "sent": r["sent"], "judged": r["judged"],
             "met": r["met"], "share": r["share"], "verdict": "pass" if r["passed"] else "miss",
             "early end": "yes" if r["ended_early"] else "", "goodput req/s": r["goodput_request_s"],
             "TTFT p50 ms": r["ttft_ms"]["p50"], "TTFT p99 ms": r["ttft_ms"]["p99"], "ITL p50 ms": r["itl_ms"]["p50"],
             "client cpu": r["client_cpu_share"], "server cpu": r["server_cpu_share"], "errors": r["errors"]}
            for s, g in found.items() for r in g["runs_detail"]]
    best = [{"server": s, "max SLO rate/s": g["max_slo_rate"], "lowest failing/s": g["lowest_failing_rate"],
             "crossing/s": g["crossing_rate"],
             "boundary shares": " ".join(f"{x:.2f}" for x in g["boundary_shares"]) or "-",
             "runs": g["runs"], "complete": "yes" if g["complete"] else "no", "seconds": g["seconds"]}
            for s, g in found.items()]
    sections = [(f"Goodput search runs ({what})", format_table(rnd(runs, 2))),
                ("Goodput: the highest rate meeting the SLO share", format_table(rnd(best, 2)))]
    if len(found) == 2:
        (a, ga), (b, gb) = found.items()
        ratio, low, high = ratio_bounds(ga, gb)
        sections.append((f"Goodput ratio {a} / {b}", format_table(rnd([{
            "ratio": ratio, "lowest (brackets)": low, "highest (brackets)": high}], 2))))
    return sections
