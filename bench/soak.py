"""Soak test: many clients doing everything a careless or hostile client does, for minutes.

Starts its own ``bargein serve`` (bundled model, debug endpoints, short read timeouts)
unless ``--url`` names a running one (then ``--pid`` enables RSS sampling). ``--clients``
clients loop for ``--duration`` seconds, each request picking one behaviour:

- ``complete`` / ``stream``: a short chat completion, plain or streamed to ``[DONE]``;
- ``disconnect``: a stream closed after a few chunks; ``abandon``: a plain request whose
  client gives up waiting; ``deadline``: an endless request with ``timeout``;
- ``cancel_*``: an endless stream cancelled by every route: ``POST /v1/requests/{id}/cancel``,
  ``POST /v1/chat/cancel``, ``POST /v1/requests/cancel {"ids"}``, and a background
  Responses request cancelled with ``POST /v1/responses/{id}/cancel``;
- ``slow_headers`` / ``slow_body``: bytes trickled slower than the server's timeouts (408);
- ``fresh_prompt``: a chat of ~300 random words that no prefix cache holds, so its prompt
  is computed beside the running streams' decodes (every other prompt here is a cache hit);
- ``too_large`` (over ``--max-body``: 413), ``huge_prompt`` (a 4 MB chat message under
  that limit: 400 ``context_length_exceeded``; while it is refused, every stream's
  longest gap is recorded), ``invalid`` (bad JSON, a lone surrogate, caps: 400).

Stream gaps are counted after ``--warmup`` seconds: at the start every client connects at
once and the first steps prefill dozens of prompts, a stall no input causes. A gap is
measured in engine steps: those that ended between the stream's two chunks, read from
``/debug/steps`` (``step_trace.py``; the server and this client share the machine's
monotonic clock). Streams ask for logprobs, so every token makes a chunk. One step is a
token every step; ms and ms over the median step period are reported beside (a long
step is one step, however long). A stream's wait for its first token (queueing, its own
prompt) is reported apart from its gaps. Gaps outside the 4 MB prompts' windows are the
control: the huge prompts cost what the gaps during them add over it. The server's own
stalls (``/debug/stalls``: event-loop lag, collector pauses) and this client's loop lag
are reported too, so a gap can be told from a stall on either side.

Every response is checked against what its behaviour must get; anything else (a 5xx, a
wrong status, a stream without ``[DONE]``, a connection error the client did not cause)
is an unexpected error. After the run: block accounting via ``/debug/kv`` (no block
referenced, nothing in flight), RSS every ``--rss-every`` seconds, cancel latency from
the client's side (ms, cancel sent -> cancelled chunk) and the engine's (steps, from the
``/metrics`` histogram). Prints a table and one JSON object on the last line.

The ``tenants`` mode (``--mode tenants``, issue 34) is the shared-server soak instead:
two tenants, hostile schemas, long prompts, background responses; see ``soak_tenants.py``.

    .venv/bin/python bench/soak.py --clients 64 --duration 600      # the full soak
    .venv/bin/python bench/soak.py --clients 10 --duration 25       # a quick one
    .venv/bin/python bench/soak.py --mode tenants --duration 600    # issue 34's two-tenant soak
    .venv/bin/python bench/soak.py --mode tenants --duration 30 --clients 2  # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import soak_tenants  # noqa: E402
from common import format_table, histogram_quantile, machine_info, percentile, rnd  # noqa: E402
from step_trace import StepTrace  # noqa: E402

BEHAVIOURS = {  # behaviour -> weight
    "complete": 6, "stream": 6, "disconnect": 4, "abandon": 2, "deadline": 2,
    "cancel_by_id": 3, "cancel_chat": 2, "cancel_many": 2, "cancel_response": 2,
    "slow_headers": 1, "slow_body": 1, "too_large": 1, "huge_prompt": 1, "invalid": 2, "fresh_prompt": 1,
}
WORDS = ("harbor", "lantern", "copper", "meadow", "glacier", "violin", "orchard", "thunder", "pebble", "saddle",
         "quartz", "falcon", "tapestry", "cinder", "marble", "willow", "compass", "ember", "juniper", "anvil")
PROMPTS = ["Tell me a story about a lighthouse.", "List three colors.", "Why is the sky blue?",
           "Write a haiku about rain.", "Count from one to twenty."]
ENDLESS = {"ignore_eos": True, "max_tokens": 4000}
LAG_TICK_S = 0.02
SERVER_ARGS = ("--header-timeout", "5", "--body-timeout", "10", "--max-body", "4MiB")


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    cancel_ms: list[float] = field(default_factory=list)
    huge_windows: list[tuple[float, float]] = field(default_factory=list)
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (start, end) token -> token
    first_waits: list[tuple[float, float]] = field(default_factory=list)  # (start, end) opening -> first token
    client_lag: list[tuple[float, float]] = field(default_factory=list)  # (at, s): this process's loop lag
    rss_mb: list[tuple[float, float, bool]] = field(default_factory=list)  # (s, MB, quiet)

    def bad(self, behaviour: str, detail: str) -> None:
        self.outcomes["unexpected"] += 1
        if len(self.unexpected) < 20:
            self.unexpected.append(f"{behaviour}: {detail}"[:400])


class Soak:
    def __init__(self, base: str, args: argparse.Namespace, rng: random.Random):
        self.base, self.args, self.rng = base, args, rng
        self.tally = Tally()
        self.ids = 0
        self.huge_started: dict[int, float] = {}  # huge prompts being refused: token -> start
        self.gaps_from = 0.0  # gaps that start before this (the warm-up) are not counted
        host, port = base.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host.strip("[]"), int(port)
        # The big bodies are built once: encoding 4 MB on this loop for every request would
        # stall every stream this client reads (a gap the server did not cause).
        text = "lorem ipsum " * (4_000_000 // 12 - 100)  # ~4 MB, under the 4 MiB body limit
        self.huge_body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 1}).encode()
        self.too_large_body = json.dumps(self.chat(max_tokens=1)).encode() + b" " * (4 * 1024**2 + 10)

    def overlaps_huge(self, start: float, end: float) -> bool:
        """Whether [start, end] overlaps the time a huge prompt was being refused."""
        if any(s < end for s in self.huge_started.values()):
            return True
        return any(s < end and start < e for s, e in self.tally.huge_windows[-8:])

    def next_id(self, kind: str) -> str:
        self.ids += 1
        return f"soak-{kind}-{self.ids}"

    def chat(self, **extra) -> dict:
        return {"messages": [{"role": "user", "content": self.rng.choice(PROMPTS)}], **extra}

    # -- streams -------------------------------------------------------------------------
    async def stream(self, http: httpx.AsyncClient, body: dict, rid: str,
                     after_chunks=None, stop_after: int | None = None) -> tuple[list[dict], bool]:
        """Reads a stream; calls ``after_chunks`` once after a few chunks; returns (chunks, saw [DONE])."""
        chunks, done = [], False
        arrivals: list[float] = []  # when each data line came: the opening, the first token, ...
        # With logprobs every token makes a chunk (a token without text, such as a special
        # token an ignore_eos stream samples, would otherwise make none: a gap no stall caused).
        body = {**body, "stream": True, "logprobs": True}
        try:
            async with http.stream("POST", f"{self.base}/v1/chat/completions", json=body,
                                   headers={"X-Request-Id": rid}) as r:
                if r.status_code != 200:
                    raise _Status(r.status_code, (await r.aread()).decode(errors="replace"))
                async for line in _sse_lines(r):
                    if not line.startswith("data: "):
                        continue
                    arrivals.append(time.monotonic())
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunks.append(json.loads(line[6:]))
                    if stop_after is not None and len(chunks) >= stop_after:
                        return chunks, False  # hang up
                    if after_chunks is not None and len(chunks) == 3:
                        await after_chunks()
        finally:
            self.record_gaps(arrivals)
        return chunks, done

    def record_gaps(self, arrivals: list[float]) -> None:
        """Files a stream's waits after the warm-up: opening -> first token (the first-token
        wait, which queueing and the prompt's own prefill make long), then token -> token
        (the gaps). Sorted into during / outside the 4 MB prompts' windows after the run."""
        t = self.tally
        for i, (start, end) in enumerate(zip(arrivals, arrivals[1:], strict=False)):
            if start >= self.gaps_from:
                (t.first_waits if i == 0 else t.gaps).append((start, end))

    # -- behaviours ----------------------------------------------------------------------
    async def complete(self, http: httpx.AsyncClient) -> str:
        r = await http.post(f"{self.base}/v1/chat/completions",
                            json=self.chat(max_tokens=self.rng.randint(1, 24)))
        _expect(r, 200)
        finish = r.json()["choices"][0]["finish_reason"]
        if finish not in ("stop", "length"):
            raise _Unexpected(f"finish_reason {finish}")
        return "completed"

    async def stream_complete(self, http: httpx.AsyncClient) -> str:
        chunks, done = await self.stream(http, self.chat(max_tokens=self.rng.randint(1, 32)), self.next_id("s"))
        if not done or _finish(chunks) not in ("stop", "length"):
            raise _Unexpected(f"stream ended without [DONE] or with {_finish(chunks)}")
        return "completed"

    async def disconnect(self, http: httpx.AsyncClient) -> str:
        await self.stream(http, self.chat(**ENDLESS), self.next_id("d"), stop_after=self.rng.randint(1, 12))
        return "disconnected"

    async def abandon(self, http: httpx.AsyncClient) -> str:
        with contextlib.suppress(httpx.ReadTimeout):
            await http.post(f"{self.base}/v1/chat/completions", json=self.chat(**ENDLESS),
                            timeout=httpx.Timeout(30, read=self.rng.uniform(0.2, 1.5)))
            raise _Unexpected("an endless request finished")
        return "abandoned"

    async def deadline(self, http: httpx.AsyncClient) -> str:
        r = await http.post(f"{self.base}/v1/chat/completions",
                            json=self.chat(timeout=self.rng.uniform(0.3, 1.5), **ENDLESS))
        _expect(r, 200)
        choice = r.json()["choices"][0]
        if (choice["finish_reason"], choice.get("cancel_reason")) != ("cancelled", "deadline"):
            raise _Unexpected(f"deadline gave {choice['finish_reason']}/{choice.get('cancel_reason')}")
        return "deadline"

    async def cancel_stream(self, http: httpx.AsyncClient, route: str) -> str:
        rid = self.next_id("c")
        sent: list[float] = []

        async def cancel() -> None:
            sent.append(time.monotonic())
            if route == "cancel_by_id":
                r = await http.post(f"{self.base}/v1/requests/{rid}/cancel")
            elif route == "cancel_chat":
                r = await http.post(f"{self.base}/v1/chat/cancel", json={"request_id": rid})
            else:
                r = await http.post(f"{self.base}/v1/requests/cancel", json={"ids": [rid]})
            _expect(r, 200)

        chunks, done = await self.stream(http, self.chat(**ENDLESS), rid, after_chunks=cancel)
        if not done or _finish(chunks) != "cancelled":
            raise _Unexpected(f"cancelled stream ended with {_finish(chunks)}, [DONE]={done}")
        self.tally.cancel_ms.append((time.monotonic() - sent[0]) * 1000)
        return route

    async def cancel_response(self, http: httpx.AsyncClient) -> str:
        r = await http.post(f"{self.base}/v1/responses", json={"input": self.rng.choice(PROMPTS), "background": True,
                                                               "max_output_tokens": 4000, "ignore_eos": True})
        _expect(r, 200)
        rid = r.json()["id"]
        await asyncio.sleep(self.rng.uniform(0.0, 0.5))
        r = await http.post(f"{self.base}/v1/responses/{rid}/cancel")
        _expect(r, 200)
        if r.json()["status"] not in ("cancelled", "completed"):
            raise _Unexpected(f"response status {r.json()['status']}")
        _expect(await http.delete(f"{self.base}/v1/responses/{rid}"), 200)
        return "cancel_response"

    async def slow(self, behaviour: str) -> str:
        """Trickles a request slower than the server's timeouts; expects 408 (read while writing)."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        answer = asyncio.ensure_future(reader.read(65536))  # the first bytes back: the 408's head
        name = f"[{self.host}]" if ":" in self.host else self.host
        host = f"Host: {name}\r\n".encode()  # a name the server answers to (its Host allow-list)
        try:
            if behaviour == "slow_headers":
                head = b"POST /v1/chat/completions HTTP/1.1\r\n" + host
                for i in range(len(head)):
                    if answer.done():
                        break
                    with contextlib.suppress(OSError):  # the server may have closed already
                        writer.write(head[i:i + 1])
                        await writer.drain()
                    await asyncio.sleep(0.3)
            else:
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\n" + host + b"Content-Type: application/json\r\n"
                             b"Content-Length: 500\r\n\r\n{")
                await writer.drain()
            reply = await asyncio.wait_for(answer, 30)
        finally:
            answer.cancel()
            writer.close()
        if not reply.startswith(b"HTTP/1.1 408 "):
            raise _Unexpected(f"slow client got {reply[:60]!r}")
        return behaviour

    async def too_large(self, http: httpx.AsyncClient) -> str:
        r = await http.post(f"{self.base}/v1/chat/completions", content=self.too_large_body,
                            headers={"content-type": "application/json"})
        _expect(r, 413)
        return "too_large"

    async def huge_prompt(self, http: httpx.AsyncClient) -> str:
        token = self.ids = self.ids + 1
        self.huge_started[token] = started = time.monotonic()
        try:
            r = await http.post(f"{self.base}/v1/chat/completions", content=self.huge_body,
                                headers={"content-type": "application/json"})
        finally:
            del self.huge_started[token]
            self.tally.huge_windows.append((started, time.monotonic()))
        _expect(r, 400)
        return "huge_prompt"

    async def fresh_prompt(self, http: httpx.AsyncClient) -> str:
        """A prompt of ~300 random words no cache holds: prefilled beside the running streams."""
        text = " ".join(self.rng.choice(WORDS) for _ in range(300))
        r = await http.post(f"{self.base}/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": text}],
                                  "max_tokens": self.rng.randint(1, 4)})
        _expect(r, 200)
        return "fresh_prompt"

    async def invalid(self, http: httpx.AsyncClient) -> str:
        kind = self.rng.choice(["json", "surrogate", "temperature", "stop"])
        content = {"json": b'{"messages": [', "surrogate": b'{"messages":[{"role":"user","content":"a\\ud800"}]}',
                   "temperature": b'{"messages":[{"role":"user","content":"a"}],"temperature":9}',
                   "stop": json.dumps(self.chat(stop=["x"] * 100)).encode()}[kind]
        r = await http.post(f"{self.base}/v1/chat/completions", content=content,
                            headers={"content-type": "application/json"})
        _expect(r, 400)
        if set(r.json()["error"]) != {"message", "type", "param", "code"}:
            raise _Unexpected(f"error not in the OpenAI shape: {r.text[:200]}")
        return "invalid"

    async def one(self, http: httpx.AsyncClient, behaviour: str) -> str:
        if behaviour in ("cancel_by_id", "cancel_chat", "cancel_many"):
            return await self.cancel_stream(http, behaviour)
        if behaviour in ("slow_headers", "slow_body"):
            return await self.slow(behaviour)
        method = {"stream": self.stream_complete}.get(behaviour) or getattr(self, behaviour)
        return await method(http)

    async def client(self, deadline: float) -> None:
        names, weights = zip(*BEHAVIOURS.items(), strict=True)
        async with httpx.AsyncClient(timeout=120) as http:
            while time.monotonic() < deadline:
                behaviour = self.rng.choices(names, weights)[0]
                try:
                    self.tally.outcomes[await self.one(http, behaviour)] += 1
                except (_Unexpected, _Status) as exc:
                    self.tally.bad(behaviour, str(exc))
                except Exception as exc:  # a connection error, a broken event...: counted, the soak goes on
                    self.tally.bad(behaviour, f"{type(exc).__name__}: {exc}")

    async def watch_lag(self, deadline: float, every: float = LAG_TICK_S) -> None:
        """This process's own event-loop lag (a sleep's overshoot): a stall the client made,
        which a stream would show as a gap the server did not cause."""
        while time.monotonic() < deadline:
            before = time.monotonic()
            await asyncio.sleep(every)
            self.tally.client_lag.append((before, time.monotonic() - before - every))

    async def sample_rss(self, pid: int | None, deadline: float, every: float) -> None:
        started = time.monotonic()
        while pid is not None:
            now = time.monotonic()
            # "quiet": no 4 MB prompt in flight or just refused, whose transient buffers would show
            quiet = not self.overlaps_huge(now - 2.0, now)
            self.tally.rss_mb.append((now - started, rss_mb(pid), quiet))
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(every, max(0.0, deadline - time.monotonic())))


class _Unexpected(Exception):
    pass


class _Status(Exception):
    def __init__(self, status: int, text: str):
        super().__init__(f"status {status}: {text[:300]}")


async def _sse_lines(r: httpx.Response):
    """Lines split at LF only, as SSE defines them (``aiter_lines`` also splits at U+2028,
    U+0085 and the like, which a model's text may hold raw inside a JSON string)."""
    pending = ""
    async for text in r.aiter_text():
        pending += text
        *lines, pending = pending.split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending


def _expect(r: httpx.Response, status: int) -> None:
    if r.status_code != status:
        raise _Status(r.status_code, r.text)


def _finish(chunks: list[dict]) -> str | None:
    return next((c["choices"][0]["finish_reason"] for c in reversed(chunks)
                 if c.get("choices") and c["choices"][0].get("finish_reason")), None)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def run(base: str, args: argparse.Namespace, pid: int | None) -> dict:
    soak = Soak(base, args, random.Random(args.seed))
    trace, stop_trace = StepTrace(), asyncio.Event()
    async with httpx.AsyncClient(timeout=30) as http:
        before = (await http.get(f"{base}/metrics")).text
        steps_before = _metric(before, "bargein_engine_steps_total")
        await trace.start(http, base)  # the steps before are not this run's
        started = time.monotonic()
        deadline = started + args.duration
        soak.gaps_from = started + args.warmup
        follow = asyncio.ensure_future(trace.follow(http, base, stop_trace))
        await asyncio.gather(soak.sample_rss(pid, deadline, args.rss_every), soak.watch_lag(deadline),
                             *(soak.client(deadline) for _ in range(args.clients)))
        elapsed = time.monotonic() - started
        kv = await soak_tenants.settled_kv(http, base)  # disconnects and abandons settle within a step each
        stop_trace.set()
        await follow
        after = (await http.get(f"{base}/metrics")).text
        listed = (await http.get(f"{base}/v1/requests")).json()["data"]
    t = soak.tally
    if args.dump:
        Path(args.dump).write_text(json.dumps({
            "started": started, "gaps_from": soak.gaps_from, "gaps": t.gaps, "first_waits": t.first_waits,
            "huge_windows": t.huge_windows, "client_lag": t.client_lag, "server_loop_lags": trace.loop_lags,
            "server_gc_pauses": trace.gc_pauses,
            "steps": list(zip(trace.ended, trace.forward_s, trace.tokens, trace.decodes, strict=True))}))
    steps = _metric(after, "bargein_engine_steps_total") - steps_before
    step_ms = histogram_quantile(before, after, "bargein_step_duration_seconds", 0.5) * 1000
    rss = [mb for _, mb, _ in t.rss_mb]
    half = [mb for s, mb, quiet in t.rss_mb if s >= elapsed / 2 and quiet]
    windows = _merged(t.huge_windows)
    period_ms = trace.period_s(soak.gaps_from) * 1000
    lag_during = [lag for at, lag in t.client_lag if _inside(windows, at, at + LAG_TICK_S + lag)]
    return {
        "mode": "clients", "clients": args.clients, "duration_s": elapsed, "requests": sum(t.outcomes.values()),
        "outcomes": dict(sorted(t.outcomes.items())), "unexpected_errors": t.outcomes.get("unexpected", 0),
        "unexpected_samples": t.unexpected,
        "leaked_blocks": kv["kv_blocks_used"], "kv_ok": kv["ok"], "kv_error": kv["error"],
        "in_flight_after": len(listed) + kv["engine_live_requests"] + kv["running"] + kv["waiting"],
        "engine_steps": steps, "step_p50_ms": step_ms, "step_period_p50_ms": period_ms,
        "cancel_client_p50_ms": percentile(t.cancel_ms, 50), "cancel_client_p99_ms": percentile(t.cancel_ms, 99),
        "cancel_engine_p50_steps": histogram_quantile(before, after, "bargein_cancel_latency_steps", 0.5,
                                                      interpolate=False),
        "cancel_engine_p99_steps": histogram_quantile(before, after, "bargein_cancel_latency_steps", 0.99,
                                                      interpolate=False),
        "cancel_engine_p50_ms": histogram_quantile(before, after, "bargein_cancel_latency_seconds", 0.5) * 1000,
        "cancel_engine_p99_ms": histogram_quantile(before, after, "bargein_cancel_latency_seconds", 0.99) * 1000,
        "huge_prompts": len(t.huge_windows),
        **_waits("gap", t.gaps, windows, trace, period_ms),
        **_waits("first_token_wait", t.first_waits, windows, trace, period_ms),
        "client_lag_max_ms": max((lag for _, lag in t.client_lag), default=float("nan")) * 1000,
        "client_lag_during_huge_max_ms": max(lag_during, default=float("nan")) * 1000,
        **_stalls("server_loop_lag", trace.loop_lags, windows, soak.gaps_from),
        **_stalls("server_gc_pause", trace.gc_pauses, windows, soak.gaps_from),
        "steps": trace.summary(soak.gaps_from),
        "rss_mb_samples": [[round(s), round(mb, 1), quiet] for s, mb, quiet in t.rss_mb],
        "rss_mb_first": rss[0] if rss else None, "rss_mb_last": rss[-1] if rss else None,
        "rss_second_half_quiet_spread_pct": ((max(half) - min(half)) / min(half) * 100) if len(half) > 1 else None,
        "machine": machine_info(),
    }


def _waits(name: str, waits: list[tuple[float, float]], windows: list[tuple[float, float]], trace: StepTrace,
           period_ms: float) -> dict:
    """The longest waits during the 4 MB prompts' windows and outside them (the control):
    in ms, in steps that ended during the wait (the measure, see step_trace.py), and in ms
    over the median step period (which also counts a long step as several)."""
    out = {}
    for where, inside in (("during_huge", True), ("outside_huge", False)):
        group = [(a, b) for a, b in waits if _inside(windows, a, b) == inside]
        ms = [(b - a) * 1000 for a, b in group]
        steps = [trace.steps_between(a, b) for a, b in group] if trace.same_clock else []
        out |= {f"{name}s_{where}": len(group),
                f"longest_{name}_{where}_ms": max(ms, default=float("nan")),
                f"longest_{name}_{where}_steps": max(steps, default=float("nan")),
                f"{name}_{where}_p99_steps": percentile(steps, 99),
                f"longest_{name}_{where}_periods": max(ms, default=float("nan")) / period_ms
                if period_ms > 0 else float("nan")}
    return out


def _stalls(name: str, stalls: list[list[float]], windows: list[tuple[float, float]], start: float) -> dict:
    """The longest server stall (over 10 ms) after the warm-up, during the 4 MB windows and outside."""
    out = {}
    for where, inside in (("during_huge", True), ("outside_huge", False)):
        ms = [s[1] * 1000 for s in stalls if s[0] >= start and _inside(windows, s[0] - s[1], s[0]) == inside]
        out |= {f"{name}_{where}_max_ms": max(ms, default=0.0), f"{name}s_{where}": len(ms)}
    return out


def _merged(windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping windows joined, sorted by start."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(windows):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _inside(merged: list[tuple[float, float]], start: float, end: float) -> bool:
    """Whether [start, end] overlaps one of the merged windows."""
    i = bisect.bisect_left(merged, (end, float("inf"))) - 1  # the last window starting before end
    return i >= 0 and merged[i][1] > start


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def report(result: dict) -> None:
    rows = [{"metric": f"outcome: {k}", "value": v} for k, v in result["outcomes"].items()]
    keys = ["requests", "unexpected_errors", "leaked_blocks", "kv_ok", "in_flight_after", "engine_steps",
            "step_p50_ms", "step_period_p50_ms", "cancel_client_p50_ms", "cancel_client_p99_ms",
            "cancel_engine_p50_steps", "cancel_engine_p99_steps", "cancel_engine_p50_ms", "cancel_engine_p99_ms",
            "huge_prompts"]
    for name in ("gap", "first_token_wait"):
        for where in ("during_huge", "outside_huge"):
            keys += [f"{name}s_{where}", f"longest_{name}_{where}_steps", f"{name}_{where}_p99_steps",
                     f"longest_{name}_{where}_ms", f"longest_{name}_{where}_periods"]
    keys += ["client_lag_max_ms", "client_lag_during_huge_max_ms"]
    keys += [f"{n}{k}" for n in ("server_loop_lag", "server_gc_pause")
             for k in ("_during_huge_max_ms", "s_during_huge", "_outside_huge_max_ms", "s_outside_huge")]
    keys += ["rss_mb_first", "rss_mb_last",
             "rss_second_half_quiet_spread_pct"]
    rows += [{"metric": k, "value": result[k]} for k in keys]
    rows += [{"metric": f"steps: {k}", "value": v} for k, v in result["steps"].items()]
    print(f"soak: {result['clients']} clients for {result['duration_s']:.0f} s")
    print(format_table(rows, ["metric", "value"]))
    print("RSS (s, MB; * = a 4 MB prompt in flight):",
          " ".join(f"{s}:{mb}{'' if quiet else '*'}" for s, mb, quiet in result["rss_mb_samples"]))
    for sample in result["unexpected_samples"]:
        print("unexpected:", sample)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("clients", "tenants"), default="clients",
                   help="clients: every client behaviour (issue 14); tenants: the shared server, two tenants "
                        "(issue 34, soak_tenants.py) (default: %(default)s)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds (default: %(default)s)")
    p.add_argument("--clients", type=int, default=None,
                   help="clients (default: 64); in the tenants mode, per tenant (default: 4)")
    p.add_argument("--url", default=None, help="a running server (started with --debug-endpoints)")
    p.add_argument("--keys", nargs=2, default=None, metavar=("KEY_A", "KEY_B"),
                   help="tenants mode with --url: two keys of different tenants")
    p.add_argument("--max-step-ms", type=float, default=250.0,
                   help="tenants mode: the server's step target (its own default, 250); the gaps' p99 is judged against two "
                        "(default: %(default)s)")
    p.add_argument("--long-words", type=int, default=1500,
                   help="tenants mode: words in a long prompt (default: %(default)s)")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's pid, for RSS")
    p.add_argument("--rss-every", type=float, default=30.0, help="seconds between RSS samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=float, default=10.0,
                   help="seconds at the start whose stream gaps are not counted (default: %(default)s)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for the server it starts (repeat: --server-arg=--flag --server-arg=N)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the JSON result here")
    p.add_argument("--dump", default=None, metavar="PATH",
                   help="write the raw series (stream waits, 4 MB windows, client lag, steps) as JSON, to study")
    args = p.parse_args(argv)
    if args.clients is None:
        args.clients = 64 if args.mode == "clients" else 4
    if args.mode == "tenants" and args.url is not None and args.keys is None:
        p.error("--mode tenants with --url needs --keys KEY_A KEY_B (two tenants' keys)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.mode == "tenants":
        return _print(_tenants(args), args, soak_tenants.report)
    server = None
    if args.url is None:
        from tests.conftest import ServerProcess  # the tests' way of running bargein serve

        server = ServerProcess(("--debug-endpoints", *SERVER_ARGS, *args.server_arg)).start().wait_ready()
    try:
        base = args.url or server.base_url
        pid = args.pid if server is None else server.proc.pid
        result = asyncio.run(run(base, args, pid))
    finally:
        if server is not None:
            server.stop()
    return _print(result, args, report)


def _tenants(args: argparse.Namespace) -> dict:
    if args.url is not None:
        return asyncio.run(soak_tenants.run(args.url, list(args.keys), args))
    with soak_tenants.tenant_server(args) as (base, keys):
        return asyncio.run(soak_tenants.run(base, keys, args))


def _print(result: dict, args: argparse.Namespace, table) -> dict:
    """The mode's table, then the whole result as one JSON line (also to ``--json``)."""
    table(result)
    line = json.dumps(rnd(result))
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return result


if __name__ == "__main__":
    main()
