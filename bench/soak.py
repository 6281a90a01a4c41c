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
- ``too_large`` (over ``--max-body``: 413), ``huge_prompt`` (a 4 MB chat message under
  that limit: 400 ``context_length_exceeded``; while it is refused, every stream's
  longest gap is recorded), ``invalid`` (bad JSON, a lone surrogate, caps: 400).

Stream gaps are counted after ``--warmup`` seconds: at the start every client connects at
once and the first steps prefill dozens of prompts, a stall no input causes. Gaps outside
the 4 MB prompts' windows are reported too, as the control: the huge prompts cost only
what the longest gap during them adds over it.

Every response is checked against what its behaviour must get; anything else (a 5xx, a
wrong status, a stream without ``[DONE]``, a connection error the client did not cause)
is an unexpected error. After the run: block accounting via ``/debug/kv`` (no block
referenced, nothing in flight), RSS every ``--rss-every`` seconds, cancel latency from
the client's side (ms, cancel sent -> cancelled chunk) and the engine's (steps, from the
``/metrics`` histogram). Prints a table and one JSON object on the last line.

    .venv/bin/python bench/soak.py --clients 64 --duration 600      # the full soak
    .venv/bin/python bench/soak.py --clients 10 --duration 25       # a quick one
"""

from __future__ import annotations

import argparse
import asyncio
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

from common import format_table, histogram_quantile, machine_info, percentile, rnd  # noqa: E402

BEHAVIOURS = {  # behaviour -> weight
    "complete": 6, "stream": 6, "disconnect": 4, "abandon": 2, "deadline": 2,
    "cancel_by_id": 3, "cancel_chat": 2, "cancel_many": 2, "cancel_response": 2,
    "slow_headers": 1, "slow_body": 1, "too_large": 1, "huge_prompt": 1, "invalid": 2,
}
PROMPTS = ["Tell me a story about a lighthouse.", "List three colors.", "Why is the sky blue?",
           "Write a haiku about rain.", "Count from one to twenty."]
ENDLESS = {"ignore_eos": True, "max_tokens": 4000}
SERVER_ARGS = ("--header-timeout", "5", "--body-timeout", "10", "--max-body", "4MiB")


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    cancel_ms: list[float] = field(default_factory=list)
    huge_windows: list[tuple[float, float]] = field(default_factory=list)
    gaps_during_huge: list[float] = field(default_factory=list)
    gaps_outside_huge: list[float] = field(default_factory=list)  # the control
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
        last = time.monotonic()
        async with http.stream("POST", f"{self.base}/v1/chat/completions", json={**body, "stream": True},
                               headers={"X-Request-Id": rid}) as r:
            if r.status_code != 200:
                raise _Status(r.status_code, (await r.aread()).decode(errors="replace"))
            async for line in _sse_lines(r):
                now = time.monotonic()
                if last >= self.gaps_from:
                    during = self.overlaps_huge(last, now)
                    (self.tally.gaps_during_huge if during else self.tally.gaps_outside_huge).append(now - last)
                last = now
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunks.append(json.loads(line[6:]))
                if stop_after is not None and len(chunks) >= stop_after:
                    return chunks, False  # hang up
                if after_chunks is not None and len(chunks) == 3:
                    await after_chunks()
        return chunks, done

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
        try:
            if behaviour == "slow_headers":
                head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\n"
                for i in range(len(head)):
                    if answer.done():
                        break
                    with contextlib.suppress(OSError):  # the server may have closed already
                        writer.write(head[i:i + 1])
                        await writer.drain()
                    await asyncio.sleep(0.3)
            else:
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
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
        body = json.dumps(self.chat(max_tokens=1)).encode() + b" " * (4 * 1024**2 + 10)
        r = await http.post(f"{self.base}/v1/chat/completions", content=body,
                            headers={"content-type": "application/json"})
        _expect(r, 413)
        return "too_large"

    async def huge_prompt(self, http: httpx.AsyncClient) -> str:
        text = "lorem ipsum " * (4_000_000 // 12 - 100)  # ~4 MB, under the 4 MiB body limit
        token = self.ids = self.ids + 1
        self.huge_started[token] = started = time.monotonic()
        try:
            r = await http.post(f"{self.base}/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": text}], "max_tokens": 1})
        finally:
            del self.huge_started[token]
            self.tally.huge_windows.append((started, time.monotonic()))
        _expect(r, 400)
        return "huge_prompt"

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
    async with httpx.AsyncClient(timeout=30) as http:
        before = (await http.get(f"{base}/metrics")).text
        steps_before = _metric(before, "bargein_engine_steps_total")
    started = time.monotonic()
    deadline = started + args.duration
    soak.gaps_from = started + args.warmup
    await asyncio.gather(soak.sample_rss(pid, deadline, args.rss_every),
                         *(soak.client(deadline) for _ in range(args.clients)))
    elapsed = time.monotonic() - started
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(600):  # disconnects and abandons settle within a step each
            kv = (await http.get(f"{base}/debug/kv")).json()
            if not (kv["running"] or kv["waiting"] or kv["engine_live_requests"] or kv["live_requests"]):
                break
            await asyncio.sleep(0.1)
        after = (await http.get(f"{base}/metrics")).text
        listed = (await http.get(f"{base}/v1/requests")).json()["data"]
    t = soak.tally
    steps = _metric(after, "bargein_engine_steps_total") - steps_before
    step_ms = histogram_quantile(before, after, "bargein_step_duration_seconds", 0.5) * 1000
    rss = [mb for _, mb, _ in t.rss_mb]
    half = [mb for s, mb, quiet in t.rss_mb if s >= elapsed / 2 and quiet]
    return {
        "clients": args.clients, "duration_s": elapsed, "requests": sum(t.outcomes.values()),
        "outcomes": dict(sorted(t.outcomes.items())), "unexpected_errors": t.outcomes.get("unexpected", 0),
        "unexpected_samples": t.unexpected,
        "leaked_blocks": kv["kv_blocks_used"], "kv_ok": kv["ok"], "kv_error": kv["error"],
        "in_flight_after": len(listed) + kv["engine_live_requests"] + kv["running"] + kv["waiting"],
        "engine_steps": steps, "step_p50_ms": step_ms,
        "cancel_client_p50_ms": percentile(t.cancel_ms, 50), "cancel_client_p99_ms": percentile(t.cancel_ms, 99),
        "cancel_engine_p50_steps": histogram_quantile(before, after, "bargein_cancel_latency_steps", 0.5,
                                                      interpolate=False),
        "cancel_engine_p99_steps": histogram_quantile(before, after, "bargein_cancel_latency_steps", 0.99,
                                                      interpolate=False),
        "cancel_engine_p50_ms": histogram_quantile(before, after, "bargein_cancel_latency_seconds", 0.5) * 1000,
        "cancel_engine_p99_ms": histogram_quantile(before, after, "bargein_cancel_latency_seconds", 0.99) * 1000,
        "huge_prompts": len(t.huge_windows),
        "longest_gap_during_huge_ms": max(t.gaps_during_huge, default=float("nan")) * 1000,
        "longest_gap_during_huge_steps": _steps(max(t.gaps_during_huge, default=float("nan")) * 1000, step_ms),
        "longest_gap_outside_huge_ms": max(t.gaps_outside_huge, default=float("nan")) * 1000,
        "longest_gap_outside_huge_steps": _steps(max(t.gaps_outside_huge, default=float("nan")) * 1000, step_ms),
        "rss_mb_samples": [[round(s), round(mb, 1), quiet] for s, mb, quiet in t.rss_mb],
        "rss_mb_first": rss[0] if rss else None, "rss_mb_last": rss[-1] if rss else None,
        "rss_second_half_quiet_spread_pct": ((max(half) - min(half)) / min(half) * 100) if len(half) > 1 else None,
        "machine": machine_info(),
    }


def _steps(ms: float, step_ms: float) -> float:
    return ms / step_ms if step_ms == step_ms and step_ms > 0 else float("nan")


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def report(result: dict) -> None:
    rows = [{"metric": f"outcome: {k}", "value": v} for k, v in result["outcomes"].items()]
    rows += [{"metric": k, "value": result[k]} for k in (
        "requests", "unexpected_errors", "leaked_blocks", "kv_ok", "in_flight_after", "engine_steps", "step_p50_ms",
        "cancel_client_p50_ms", "cancel_client_p99_ms", "cancel_engine_p50_steps", "cancel_engine_p99_steps",
        "cancel_engine_p50_ms", "cancel_engine_p99_ms", "huge_prompts", "longest_gap_during_huge_ms",
        "longest_gap_during_huge_steps", "longest_gap_outside_huge_ms", "longest_gap_outside_huge_steps",
        "rss_mb_first", "rss_mb_last", "rss_second_half_quiet_spread_pct")]
    print(f"soak: {result['clients']} clients for {result['duration_s']:.0f} s")
    print(format_table(rows, ["metric", "value"]))
    print("RSS (s, MB; * = a 4 MB prompt in flight):",
          " ".join(f"{s}:{mb}{'' if quiet else '*'}" for s, mb, quiet in result["rss_mb_samples"]))
    for sample in result["unexpected_samples"]:
        print("unexpected:", sample)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds (default: %(default)s)")
    p.add_argument("--clients", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--url", default=None, help="a running server (started with --debug-endpoints)")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's pid, for RSS")
    p.add_argument("--rss-every", type=float, default=30.0, help="seconds between RSS samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=float, default=10.0,
                   help="seconds at the start whose stream gaps are not counted (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the JSON result here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    server = None
    if args.url is None:
        from tests.conftest import ServerProcess  # the tests' way of running bargein serve

        server = ServerProcess(("--debug-endpoints", *SERVER_ARGS)).start().wait_ready()
    try:
        base = args.url or server.base_url
        pid = args.pid if server is None else server.proc.pid
        result = asyncio.run(run(base, args, pid))
    finally:
        if server is not None:
            server.stop()
    report(result)
    line = json.dumps(rnd(result))
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return result


if __name__ == "__main__":
    main()
