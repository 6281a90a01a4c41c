"""Goodput as the highest rate meeting the SLO share (bench/serving_goodput.py): a
request's verdict, the cancelled-request accounting, a run's early verdict, the rate
search's decisions and the ratio's bounds, exactly, on plain records and a simulated
server; and the load generator's early stop against a loopback stub that never answers."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from bench.serving_client import Record, Target, run_rate
from bench.serving_goodput import (
    RunTally,
    SearchPlan,
    Slo,
    allowed_misses,
    boundary,
    crossing,
    judged_records,
    misses,
    next_rate,
    passes,
    ratio_bounds,
    search,
    settled,
    summary,
    tally,
)

SLO = Slo()  # TTFT <= 2 s, ITL <= 100 ms
MAX_TOKENS = 128


def done(sent: float = 0.0, first: float | None = 0.5, last: float | None = 5.0, tokens: int = 128,
         outcome: str = "ok", cancel_planned: bool = False) -> Record:
    """A request that ended; times in seconds on one clock."""
    return Record(sent=sent, first_token=first, last_event=last, output_tokens=tokens, outcome=outcome,
                  cancel_planned=cancel_planned, ended=True)


def flying(sent: float = 0.0, first: float | None = None, cancel_planned: bool = False) -> Record:
    return Record(sent=sent, first_token=first, cancel_planned=cancel_planned)


def test_a_completed_request_meets_both_slos_or_not():
    assert SLO.met(done(first=2.0, last=2.0 + 0.05 * 127))  # TTFT's bound is inclusive
    assert not SLO.met(done(first=2.01))  # TTFT
    assert not SLO.met(done(first=0.5, last=0.5 + 0.101 * 127))  # ITL = 101 ms
    assert SLO.met(done(first=0.5, last=0.5, tokens=1))  # one token: no ITL, TTFT decides
    assert not SLO.met(done(first=None, last=None, tokens=0))


def test_a_request_in_flight_is_a_sure_miss_only_once_no_ending_can_meet():
    assert not SLO.surely_missed(flying(sent=1.0), now=3.0, max_tokens=MAX_TOKENS)  # 2.0 s: may still come
    assert SLO.surely_missed(flying(sent=1.0), now=3.01, max_tokens=MAX_TOKENS)
    assert SLO.surely_missed(flying(sent=1.0, first=3.5), now=3.6, max_tokens=MAX_TOKENS)  # late first token
    # first token at 0.5: 127 gaps of at most 0.1 s fit until 13.2
    assert not SLO.surely_missed(flying(first=0.5), now=13.1, max_tokens=MAX_TOKENS)
    assert SLO.surely_missed(flying(first=0.5), now=13.3, max_tokens=MAX_TOKENS)
    assert not SLO.surely_missed(flying(first=0.5), now=3.3, max_tokens=32)  # 31 gaps: until 3.6
    assert SLO.surely_missed(flying(first=0.5), now=3.7, max_tokens=32)
    assert SLO.longest_wait_s(MAX_TOKENS) == pytest.approx(14.7)


def test_the_share_passes_at_ninety_percent_and_allowed_misses_agree_with_it():
    assert passes(9, 10, 0.9) and not passes(8, 10, 0.9)
    assert passes(18, 20, 0.9) and not passes(17, 20, 0.9)
    assert not passes(0, 0, 0.9)
    assert [allowed_misses(n, 0.9) for n in (1, 7, 9, 10, 16, 19, 20, 100)] == [0, 0, 0, 1, 1, 1, 2, 10]
    for judged in range(1, 200):
        k = allowed_misses(judged, 0.9)
        assert passes(judged - k, judged, 0.9) and not passes(judged - k - 1, judged, 0.9), judged


def test_cancelled_requests_are_load_not_judged_and_every_other_ending_counts():
    records = [
        done(),  # met
        done(first=0.5, last=0.5 + 0.2 * 127),  # missed: ITL 200 ms
        done(first=None, last=None, tokens=0, outcome="error"),
        done(outcome="stopped"),  # closed with its run: not met even if its times were fine
        flying(first=0.2),  # still in flight: not met (yet)
        done(first=None, last=None, tokens=0, outcome="cancelled", cancel_planned=True),
        done(first=0.5, last=0.9, tokens=5, outcome="cancelled", cancel_planned=True),
        done(first=3.0, last=60.0, cancel_planned=True),  # chosen, ended before its cancel: still not judged
    ]
    assert judged_records(records) == records[:5]
    assert tally(records, SLO) == 1
    # at now = 1: the ITL miss, the error and the stopped one are known; the one in flight may still meet
    assert misses(records, SLO, now=1.0, max_tokens=MAX_TOKENS) == 3
    assert misses(records, SLO, now=13.0, max_tokens=MAX_TOKENS) == 4  # 12.8 s after its first token


def test_a_run_is_settled_once_the_misses_exceed_the_share_or_nothing_judged_is_undecided():
    # 10 planned, 2 of them to be cancelled: 8 judged, none may miss (7 of 8 is 87.5%)
    sent = [done(), flying(sent=0.5, cancel_planned=True), flying(sent=1.0)]
    assert not settled(sent, 10, 8, SLO, 0.9, now=3.0, max_tokens=MAX_TOKENS)
    assert settled(sent, 10, 8, SLO, 0.9, now=3.01, max_tokens=MAX_TOKENS)  # no first token after 2 s
    # 20 planned, 16 judged: one miss allowed
    sent = [done(), done(first=2.5), flying(sent=1.0, first=1.2)]
    assert not settled(sent, 20, 16, SLO, 0.9, now=4.0, max_tokens=MAX_TOKENS)  # more to send
    all_sent = sent + [done()] * 13 + [flying(sent=0.0, cancel_planned=True)] * 4
    assert not settled(all_sent, 20, 16, SLO, 0.9, now=4.0, max_tokens=MAX_TOKENS)  # one judged undecided
    assert settled(all_sent, 20, 16, SLO, 0.9, now=13.91, max_tokens=MAX_TOKENS)  # it is a sure miss now: 2
    all_sent[2] = done(sent=1.0, first=1.2, last=6.0)
    assert settled(all_sent, 20, 16, SLO, 0.9, now=6.0, max_tokens=MAX_TOKENS)  # a cancel in flight waits not


def test_a_repeat_is_settled_on_the_share_pooled_with_the_rates_earlier_runs():
    """A rate passes on its runs' pooled share, so a repeat stops only when the pooled
    verdict is certain: 16 + 16 judged allow 3 misses together, where 16 alone allow 1."""
    two_misses = [done(first=2.5), done(first=2.5)] + [flying(sent=5.0)]
    assert settled(two_misses, 20, 16, SLO, 0.9, now=5.5, max_tokens=MAX_TOKENS)
    assert not settled(two_misses, 20, 16, SLO, 0.9, now=5.5, max_tokens=MAX_TOKENS, prior=[RunTally(1.0, 16, 16)])
    assert not settled(two_misses, 20, 16, SLO, 0.9, now=5.5, max_tokens=MAX_TOKENS, prior=[RunTally(1.0, 15, 16)])
    three = two_misses + [done(first=None, last=None, tokens=0, outcome="error")]
    assert settled(three, 20, 16, SLO, 0.9, now=5.5, max_tokens=MAX_TOKENS, prior=[RunTally(1.0, 15, 16)])


def simulated(capacity: float, below: float = 1.0, above: float = 0.5, judged: int = 20, noise=None):
    """A server whose SLO share is ``below`` at rates up to ``capacity`` and ``above`` past it;
    ``noise(rate, repeat)`` may override the share. Returns run_at and the rates it ran."""
    ran: list[float] = []

    def run_at(rate: float, prior: list[RunTally]) -> RunTally:
        assert all(t.rate == rate for t in prior)
        ran.append(rate)
        share = noise(rate, len(prior)) if noise else None
        if share is None:
            share = below if rate <= capacity else above
        return RunTally(rate, round(share * judged), judged)

    return run_at, ran


def test_the_search_steps_up_bisects_to_the_resolution_and_repeats_the_boundary():
    run_at, ran = simulated(capacity=3.0)
    plan = SearchPlan()  # start 1, factor 2, resolution 1.2, 2 repeats
    tallies = search(run_at, plan)
    r2 = math.sqrt(8)  # between 2 (pass) and 4 (miss)
    r3 = math.sqrt(r2 * 4)  # between 2.83 (pass) and 4: 3.36 misses; 3.36 / 2.83 = 1.19 <= 1.2
    assert ran == pytest.approx([1.0, 2.0, 4.0, r2, r3, r2])
    assert [t.rate for t in tallies] == ran
    s = summary(tallies, plan)
    assert s["max_slo_rate"] == pytest.approx(r2) and s["lowest_failing_rate"] == pytest.approx(r3)
    assert s["boundary_shares"] == [1.0, 1.0] and s["runs"] == 6 and s["complete"]
    # the pooled shares 1.0 at 2.83 and 0.5 at 3.36 cross 0.9 a fifth of the way
    assert s["crossing_rate"] == pytest.approx(r2 + (r3 - r2) * 0.2)


def test_a_boundary_repeat_that_pulls_the_pooled_share_under_moves_the_boundary_down():
    r2 = math.sqrt(8)
    # 2.83 passes once (20 of 20) and then 14 of 20: pooled 34 of 40 = 85%
    run_at, ran = simulated(capacity=3.0, noise=lambda rate, repeat: 0.7 if rate == r2 and repeat == 1 else None)
    tallies = search(run_at, SearchPlan())
    r3 = math.sqrt(r2 * 4)
    r4 = math.sqrt(2 * r2)  # the bracket is now [2, 2.83): its middle 2.38 passes, 2.83 / 2.38 = 1.19
    assert ran[:6] == pytest.approx([1.0, 2.0, 4.0, r2, r3, r2])
    assert ran[6:] == pytest.approx([r4, r4])  # so 2.38 is the boundary, repeated
    s = summary(tallies, SearchPlan())
    assert s["max_slo_rate"] == pytest.approx(r4) and s["lowest_failing_rate"] == pytest.approx(r2)
    assert s["complete"] and s["boundary_shares"] == [1.0, 1.0]


def test_the_boundary_is_the_highest_pass_below_the_lowest_miss_on_pooled_shares():
    assert boundary([RunTally(1.0, 10, 10), RunTally(2.0, 5, 10), RunTally(4.0, 10, 10)], 0.9) == (1.0, 2.0)
    assert boundary([RunTally(2.0, 10, 10), RunTally(2.0, 7, 10)], 0.9) == (None, 2.0)  # 17 of 20
    assert boundary([RunTally(2.0, 10, 10), RunTally(2.0, 8, 10)], 0.9) == (2.0, None)  # 18 of 20
    assert boundary([], 0.9) == (None, None)
    assert crossing([RunTally(2.0, 10, 10)], 0.9) is None  # no miss: nothing to cross


def test_a_server_that_meets_no_rate_is_stepped_down_to_the_floor():
    run_at, ran = simulated(capacity=0.0)
    tallies = search(run_at, SearchPlan())
    assert ran == [1.0, 0.5, 0.25, 0.125, 0.0625]  # 0.03125 is under the floor of 0.05
    s = summary(tallies, SearchPlan())
    assert s["max_slo_rate"] is None and s["lowest_failing_rate"] == 0.0625 and s["complete"]


def test_the_run_limit_and_the_time_limit_end_a_search_that_never_misses():
    run_at, ran = simulated(capacity=math.inf)
    tallies = search(run_at, SearchPlan(max_runs=4))
    assert ran == [1.0, 2.0, 4.0, 8.0]
    s = summary(tallies, SearchPlan(max_runs=4))
    assert s["max_slo_rate"] == 8.0 and s["lowest_failing_rate"] is None and not s["complete"]
    run_at, ran = simulated(capacity=math.inf)
    search(run_at, SearchPlan(), fits=lambda rate: rate < 5.0)  # time left for a run at 4, not at 8
    assert ran == [1.0, 2.0, 4.0]
    assert next_rate([], SearchPlan(start=0.7)) == 0.7


def test_the_ratio_and_its_bounds_from_both_brackets():
    a = {"max_slo_rate": 4.0, "lowest_failing_rate": 4.5}
    b = {"max_slo_rate": 1.0, "lowest_failing_rate": 1.2}
    ratio, low, high = ratio_bounds(a, b)
    assert (ratio, high) == (4.0, 4.5) and low == pytest.approx(4.0 / 1.2)
    assert ratio_bounds(a, {"max_slo_rate": None, "lowest_failing_rate": 0.0625}) == (None, 64.0, None)
    assert ratio_bounds({"max_slo_rate": 8.0, "lowest_failing_rate": None}, b) == (8.0, 8.0 / 1.2, None)


async def _never_answering_server(seen: list[str]):
    """Reads each request, answers nothing, and notes when the client closes the connection."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append("open")
        while await reader.read(65536):  # the request, then nothing until the client's close
            pass
        seen.append("closed")
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_the_load_stops_when_the_verdict_is_settled_and_closes_what_is_in_flight():
    """10 requests at 200/s (all sent within a few ms) to a server that never answers, TTFT
    bound 0.2 s: 8 are judged, none may miss, so the run is settled 0.2 s after the first
    send; every request is closed (outcome stopped) and the server sees every close."""
    slo = Slo(ttft_s=0.2)

    async def main():
        seen: list[str] = []
        server = await _never_answering_server(seen)
        port = server.sockets[0].getsockname()[1]
        run = await run_rate(Target("127.0.0.1", port, "m"), ["hi"] * 10, 200.0, 8, cancel_share=0.2,
                             cancel_after_s=30.0, seed=1,
                             stop_when=lambda records, now: settled(records, 10, 8, slo, 0.9, now, 8))
        for _ in range(200):  # the server's handlers see the closes a moment later
            if seen and seen.count("closed") == seen.count("open"):
                break
            await asyncio.sleep(0.01)
        server.close()
        return run, seen

    started = time.perf_counter()
    run, seen = asyncio.run(main())
    assert time.perf_counter() - started < 10.0  # settled at 0.2 s; without the stop: 30 s, then a hang
    assert 1 <= len(run.records) <= 10
    assert run.duration > 0.2  # the run ends at its stop, which waited for a first miss: 0.2 s after a send
    assert all(r.ended and r.outcome == "stopped" for r in run.records)
    assert sum(r.cancel_planned for r in run.records) <= 2 and tally(run.records, slo) == 0
    assert 1 <= seen.count("open") <= len(run.records) and seen.count("closed") == seen.count("open")
