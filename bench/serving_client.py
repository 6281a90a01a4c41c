"""A light load generator for OpenAI-compatible chat servers, reporting AIPerf's metrics.

One process, one asyncio loop, raw HTTP/1.1 over loopback sockets: no HTTP library, no
tokenizer, one ``json.loads`` per server-sent event. On a 2-core machine the load
generator shares the cores with the server under test, so what it costs is part of the
result: ``Run.client_cpu_s`` is this process's CPU time over the run.

Metric definitions follow AIPerf's (its metrics reference, v0.13):
- time to first token (TTFT): from sending the request to the first event whose delta
  carries non-empty content (or reasoning content);
- inter-token latency (ITL) of a request: (request latency - TTFT) / (output tokens - 1);
- request latency: from sending to the last event;
- output token throughput: the completed requests' output tokens over the benchmark's
  duration (first request sent to last response received);
- goodput: completed requests per second that meet every SLO.
Output tokens are the server's own ``usage.completion_tokens`` (AIPerf re-tokenizes the
text with the model's tokenizer; both servers here use the same tokenizer and the
answers are forced to their length with ``ignore_eos``, so the two agree).

Load shapes: a fixed concurrency (``run_concurrency``), a Poisson request rate
(``run_rate``), each optionally cancelling a share of requests a fixed delay after
sending them (the client closes the connection, as AIPerf's request cancellation does),
and multi-turn conversations where the client cuts off some answers after a number of
content events and continues the conversation from the partial answer (``run_conversations``).
"""

from __future__ import annotations

import asyncio
import json
import random
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Record:
    """One request as the client saw it; times are ``time.perf_counter()`` seconds."""

    sent: float
    first_token: float | None = None
    last_event: float | None = None
    output_tokens: int = 0  # usage.completion_tokens, else the content events counted
    content_events: int = 0
    text: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    outcome: str = "ok"  # ok | cancelled (by the load's cancellation) | cut (multi-turn) | error
    #                      | stopped (closed when its run's verdict was already certain)
    error: str | None = None
    turn: int = 0
    continued: bool = False  # this turn continues a conversation whose last answer was cut off
    cancel_planned: bool = False  # the load chose this request to cancel (goodput does not judge it)
    ended: bool = False  # no longer in flight (set last, whatever the outcome)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def latency(self) -> float | None:
        return None if self.last_event is None else self.last_event - self.sent

    @property
    def itl(self) -> float | None:
        if self.first_token is None or self.last_event is None or self.output_tokens < 2:
            return None
        return (self.last_event - self.first_token) / (self.output_tokens - 1)


@dataclass
class Run:
    """What one load run produced."""

    records: list[Record] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0
    client_cpu_s: float = 0.0

    @property
    def duration(self) -> float:
        return self.ended - self.started

    @property
    def completed(self) -> list[Record]:
        return [r for r in self.records if r.outcome == "ok"]


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    model: str
    headers: tuple[tuple[str, str], ...] = ()


class StreamError(Exception):
    pass


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise StreamError("the server closed the connection before answering")
    parts = status_line.split(b" ", 2)
    status = int(parts[1])
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            return status, headers
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()


async def _body_pieces(reader: asyncio.StreamReader, headers: dict[str, str]):
    """The body's bytes as they arrive, chunked transfer encoding undone."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readline()
            if not size_line:
                return
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    else:
        while data := await reader.read(65536):
            yield data


async def stream_chat(target: Target, body: dict[str, Any], record: Record,
                      stop_after_events: int | None = None) -> None:
    """Sends one streaming chat request and fills ``record`` as its events arrive.

    ``stop_after_events``: close the connection after that many content events (the
    client cuts the answer off; outcome ``cut``). Cancelling the task that runs this
    closes the connection too (the caller sets the outcome)."""
    payload = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\nConnection: close\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in target.headers)
            + f"Content-Length: {len(payload)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        record.sent = time.perf_counter()
        writer.write(head + payload)
        status, headers = await _read_head(reader)
        if status != 200:
            text = b"".join([p async for p in _body_pieces(reader, headers)]).decode(errors="replace")
            raise StreamError(f"HTTP {status}: {text[:200]}")
        buffer = b""
        async for piece in _body_pieces(reader, headers):
            now = time.perf_counter()
            buffer += piece
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    _observe(json.loads(data), record, now)
            if stop_after_events is not None and record.content_events >= stop_after_events:
                record.outcome = "cut"
                return
        if record.output_tokens == 0:
            record.output_tokens = record.content_events
    finally:
        writer.close()


def _observe(chunk: dict[str, Any], record: Record, now: float) -> None:
    record.last_event = now
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
        if text or delta.get("reasoning_content"):
            record.content_events += 1
            record.text += text
            if record.first_token is None:
                record.first_token = now
    usage = chunk.get("usage")
    if usage:
        record.output_tokens = usage.get("completion_tokens") or record.output_tokens
        record.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            record.cached_tokens = details["cached_tokens"]
    timings = chunk.get("timings")  # llama-server's own report: cache_n prompt tokens reused
    if timings and record.cached_tokens is None and "cache_n" in timings:
        record.cached_tokens = timings["cache_n"]


def chat_body(target: Target, messages: Sequence[dict[str, str]], max_tokens: int,
              ignore_eos: bool = True) -> dict[str, Any]:
    return {"model": target.model, "messages": list(messages), "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}


async def _one(target: Target, body: dict[str, Any], cancel_after_s: float | None,
               record: Record | None = None) -> Record:
    """One request into ``record`` (a new one by default); ``cancel_after_s``: the load
    cancels it that long after sending. Cancelling the task that runs this closes the
    connection, marks the record ``stopped`` and re-raises."""
    record = record if record is not None else Record(sent=time.perf_counter())
    record.sent = time.perf_counter()
    task = asyncio.ensure_future(stream_chat(target, body, record))
    try:
        if cancel_after_s is None:
            await task
        else:
            done, _ = await asyncio.wait({task}, timeout=cancel_after_s)
            if not done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                record.outcome, record.output_tokens = "cancelled", record.content_events
            else:
                task.result()
    except (OSError, StreamError, ValueError, asyncio.IncompleteReadError) as exc:
        record.outcome, record.error = "error", f"{type(exc).__name__}: {exc}"
    except asyncio.CancelledError:
        task.cancel()  # asyncio.wait does not cancel what it waits on
        await asyncio.gather(task, return_exceptions=True)
        record.outcome = "stopped"
        raise
    finally:
        record.ended = True
    return record


def cancelled_count(n: int, share: float) -> int:
    """How many of ``n`` requests the load cancels at a cancel share (whatever the seed)."""
    return round(share * n)


def _cancel_plan(n: int, share: float, seed: int) -> list[bool]:
    """Exactly ``cancelled_count(n, share)`` requests, chosen by the seed, are cancelled."""
    chosen = set(random.Random(seed).sample(range(n), cancelled_count(n, share)))
    return [i in chosen for i in range(n)]


def _timed(coro_factory):
    async def run() -> Run:
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        result = Run(started=time.perf_counter())
        result.records = await coro_factory()
        result.ended = max([r.last_event or r.sent for r in result.records] + [result.started])
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        result.client_cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        return result
    return run()


async def run_concurrency(target: Target, prompts: Sequence[str], concurrency: int, max_tokens: int,
                          cancel_share: float = 0.0, cancel_after_s: float = 1.0, seed: int = 0) -> Run:
    """Every prompt once, ``concurrency`` requests in flight at a time (AIPerf's
    ``--concurrency``); a seeded ``cancel_share`` of them cancelled ``cancel_after_s`` after sending."""
    cancels = _cancel_plan(len(prompts), cancel_share, seed)

    async def load() -> list[Record]:
        queue = list(enumerate(prompts))
        records: list[Record | None] = [None] * len(prompts)

        async def worker() -> None:
            while queue:
                i, prompt = queue.pop(0)
                body = chat_body(target, [{"role": "user", "content": prompt}], max_tokens)
                records[i] = await _one(target, body, cancel_after_s if cancels[i] else None)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return [r for r in records if r is not None]

    return await _timed(load)


StopRule = Callable[[Sequence[Record], float], bool]


async def run_rate(target: Target, prompts: Sequence[str], rate: float, max_tokens: int,
                   cancel_share: float = 0.0, cancel_after_s: float = 1.0, seed: int = 0,
                   stop_when: StopRule | None = None, poll_s: float = 0.05) -> Run:
    """Every prompt once, sent at Poisson arrivals of ``rate`` requests per second (seeded),
    however many are then in flight (AIPerf's ``--request-rate``).

    ``stop_when(records, now)``, asked every ``poll_s`` with the requests sent so far (in
    sending order): once it is true, nothing more is sent and the requests in flight are
    closed (outcome ``stopped``); the run's records are then the ones sent, and it ends
    when it stopped (not at its last event: a stopped run may have had none)."""
    rng = random.Random(seed)
    gaps = [rng.expovariate(rate) for _ in prompts]
    cancels = _cancel_plan(len(prompts), cancel_share, seed + 1)

    stopped_at: list[float] = []

    async def load() -> list[Record]:
        records: list[Record] = []
        tasks: list[asyncio.Future] = []

        async def send() -> None:
            for i, prompt in enumerate(prompts):
                body = chat_body(target, [{"role": "user", "content": prompt}], max_tokens)
                record = Record(sent=time.perf_counter(), cancel_planned=cancels[i])
                records.append(record)
                tasks.append(asyncio.ensure_future(_one(target, body, cancel_after_s if cancels[i] else None,
                                                        record)))
                await asyncio.sleep(gaps[i])

        sender = asyncio.ensure_future(send())
        if stop_when is None:
            await sender
        else:
            while not (sender.done() and all(t.done() for t in tasks)):
                if stop_when(records, now := time.perf_counter()):
                    stopped_at.append(now)
                    sender.cancel()
                    break
                await asyncio.sleep(poll_s)
            await asyncio.gather(sender, return_exceptions=True)
            for t in tasks:
                t.cancel()
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(outcome, Exception):  # not a CancelledError: a fault of this client, not a result
                raise outcome
        for record in records:  # a task cancelled before it first ran never marked its record
            if not record.ended:
                record.outcome, record.ended = "stopped", True
        return records

    run = await _timed(load)
    run.ended = max([run.ended, *stopped_at])
    return run


async def run_conversations(target: Target, openings: Sequence[Sequence[str]], max_tokens: int,
                            cut_after_events: int, seed: int = 0) -> Run:
    """Each conversation's user turns in order, all conversations at once. Every second
    answer (turns 1, 3, ...) is cut off by the client after ``cut_after_events`` content
    events; the next turn carries the partial answer as the assistant's message, so a
    server that kept it answers from its cache (``Record.cached_tokens``, ``continued``)."""
    del seed

    async def conversation(turns: Sequence[str]) -> list[Record]:
        messages: list[dict[str, str]] = []
        out, cut_before = [], False
        for t, user in enumerate(turns):
            messages.append({"role": "user", "content": user})
            record = Record(sent=time.perf_counter(), turn=t, continued=cut_before)
            cut = t % 2 == 1
            try:
                await stream_chat(target, chat_body(target, messages, max_tokens), record,
                                  stop_after_events=cut_after_events if cut else None)
            except (OSError, StreamError, ValueError, asyncio.IncompleteReadError) as exc:
                record.outcome, record.error = "error", f"{type(exc).__name__}: {exc}"
            if record.outcome == "ok" and record.output_tokens == 0:
                record.output_tokens = record.content_events
            out.append(record)
            messages.append({"role": "assistant", "content": record.text})
            cut_before = record.outcome == "cut"
        return out

    async def load() -> list[Record]:
        per = await asyncio.gather(*(conversation(turns) for turns in openings))
        return [r for conv in per for r in conv]

    return await _timed(load)
