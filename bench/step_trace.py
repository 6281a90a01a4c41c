"""The engine's steps as a client on the same machine sees them (``/debug/steps``, polled).

A stream's gap between two chunks is measured in the engine steps that *ended* between
them. The server stamps each step with ``time.monotonic()`` when its outputs are ready
for the streams; a client on the same machine reads the same clock (Linux's
``CLOCK_MONOTONIC`` is one clock for every process) when a chunk arrives. A stream
that gets a token every step sees one step end per gap (give or take one, as the
delivery delay varies); a gap of k step ends is k steps without a token, whatever made
them: the stream was not in the batch, the server's event loop or the client did not
pass the chunk on. A long step counts once: how long steps are is the step-time
distribution's business (``summary``), which this reports beside.

The server's own stalls come along (``/debug/stalls``): its event loop's lag and the
collector's pauses, each stamped on the same clock.

The poller reads every ``every`` seconds; the server keeps the last ``kept`` steps, so
none is missed while steps are longer than ``every / kept`` (``missed`` says if any was).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from dataclasses import dataclass, field

import httpx
from common import percentile  # noqa: E402  (bench/ is on sys.path for every bench script)

CLOCK_SLACK_S = 0.5  # a server clock further off than this from ours is not the same clock


@dataclass
class StepTrace:
    ended: list[float] = field(default_factory=list)  # sorted: steps end in order
    forward_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    decodes: list[int] = field(default_factory=list)
    last_index: int = 0
    missed: int = 0  # steps evicted from the server's history before a poll read them
    same_clock: bool | None = None  # None until the first poll
    loop_lags: list[list[float]] = field(default_factory=list)  # the server's: [ended at, s]
    gc_pauses: list[list[float]] = field(default_factory=list)  # the server's: [ended at, s, generation]
    stalls_after: float = 0.0

    def add(self, rows: list[list[float]]) -> None:
        for index, ended, forward_s, _seqs, tokens, decodes in rows:
            self.missed += max(0, int(index) - self.last_index - 1)
            self.last_index = int(index)
            self.ended.append(ended)
            self.forward_s.append(forward_s)
            self.tokens.append(int(tokens))
            self.decodes.append(int(decodes))

    async def poll(self, http: httpx.AsyncClient, base: str) -> None:
        before = time.monotonic()
        body = await _get_json(http, f"{base}/debug/steps", {"after": self.last_index})
        after = time.monotonic()
        same = before - CLOCK_SLACK_S <= body["now"] <= after + CLOCK_SLACK_S
        self.same_clock = same if self.same_clock is None else self.same_clock and same
        self.add(body["steps"])
        stalls = await _get_json(http, f"{base}/debug/stalls", {"after": self.stalls_after})
        self.loop_lags += stalls["loop_lags"]
        self.gc_pauses += stalls["gc_pauses"]
        self.stalls_after = max([self.stalls_after] + [x[0] for x in stalls["loop_lags"] + stalls["gc_pauses"]])

    async def start(self, http: httpx.AsyncClient, base: str) -> None:
        """Skips the steps so far: the trace holds the steps after this call."""
        body = await _get_json(http, f"{base}/debug/steps", {"after": 2**62})
        self.last_index, self.stalls_after = body["steps_total"], body["now"]

    async def follow(self, http: httpx.AsyncClient, base: str, stop: asyncio.Event, every: float = 1.0) -> None:
        """Polls until ``stop`` is set, then once more."""
        while not stop.is_set():
            await self.poll(http, base)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)
        await self.poll(http, base)

    def steps_between(self, start: float, end: float) -> int | None:
        """Steps that ended in (start, end]; None if the server's clock is not ours."""
        if not self.same_clock:
            return None
        return bisect.bisect_right(self.ended, end) - bisect.bisect_right(self.ended, start)

    def period_s(self, start: float = float("-inf")) -> float:
        """The median time from one step's end to the next's (steps after ``start``)."""
        first = bisect.bisect_right(self.ended, start)
        ends = self.ended[first:]
        return percentile([b - a for a, b in zip(ends, ends[1:], strict=False)], 50)

    def summary(self, start: float = float("-inf")) -> dict:
        """Step times and sizes (steps that ended after ``start``): what makes a step long."""
        first = bisect.bisect_right(self.ended, start)
        fwd, tok, dec = self.forward_s[first:], self.tokens[first:], self.decodes[first:]
        pure = [f for f, t, d in zip(fwd, tok, dec, strict=True) if t == d]
        mixed = [(f, t - d) for f, t, d in zip(fwd, tok, dec, strict=True) if t > d]
        return {
            "steps": len(fwd), "steps_missed": self.missed, "same_clock": self.same_clock,
            "period_p50_ms": self.period_s(start) * 1000,
            "forward_p50_ms": percentile(fwd, 50) * 1000, "forward_p99_ms": percentile(fwd, 99) * 1000,
            "forward_max_ms": max(fwd, default=float("nan")) * 1000,
            "tokens_p50": percentile(tok, 50), "tokens_p99": percentile(tok, 99), "tokens_max": max(tok, default=0),
            "decodes_p50": percentile(dec, 50),
            "decode_only_steps": len(pure), "decode_only_forward_p50_ms": percentile(pure, 50) * 1000,
            "mixed_steps": len(mixed), "mixed_forward_p50_ms": percentile([f for f, _ in mixed], 50) * 1000,
            "mixed_forward_max_ms": max((f for f, _ in mixed), default=float("nan")) * 1000,
            "mixed_prompt_tokens_p50": percentile([p for _, p in mixed], 50),
            "mixed_prompt_tokens_max": max((p for _, p in mixed), default=0),
        }


async def _get_json(http: httpx.AsyncClient, url: str, params: dict, attempts: int = 3) -> dict:
    """A GET that survives a kept-alive connection the server closed as it was reused
    (its idle timeout racing the request): the reads are idempotent, so try again."""
    for attempt in range(attempts):
        try:
            r = await http.get(url, params=params)
            r.raise_for_status()
            return r.json()
        except httpx.TransportError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")
