"""Backpressure and capped background work (issue 34 items 7 and 4), written as the attack.

A client that stops reading a stream: its generation must pause once the server's bounded
buffer is full (not run to max_tokens into memory), and after the stall timeout the request
is cancelled with reason ``disconnect``; the conversation then holds exactly what was
generated and delivered, and the next turn continues from it token-exactly (C3, C7).

The client is an ASGI caller whose ``send`` stops returning after some events: exactly
what a full socket does to a server's response (uvicorn's flow control waits in ``send``),
and it never disconnects. Token counts come from the chunks' logprobs (one entry a token)
and from the engine's own request list; waits are polls, and the one time bound (the pause
must hold for a while) is far below the stall timeout.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from bargein.engine.request import FinishReason
from tests.server.inprocess_app import inprocess_app
from tests.tiny_engine import ByteTokenizer, tiny_engine

BUFFER = 8  # stream_buffer_tokens
STALL_S = 2.0  # stream_stall_timeout
GREEDY = {"ignore_eos": True, "temperature": 0}


class ChatByteTokenizer(ByteTokenizer):
    """Byte tokens with a chat template: ``<role>content\\n`` per message."""

    def apply_chat_template(self, messages, *, add_generation_prompt=True, tools=None, **extra) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@asynccontextmanager
async def tiny_app(**settings: Any) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    core = tiny_engine(num_blocks=256)
    core.tokenizer = ChatByteTokenizer()
    async with inprocess_app(core, **settings) as (app, client):
        yield app, client


class StoppedReader:
    """Calls the app as a client that reads ``reads`` body messages, then stops reading (its
    ``send`` never returns again) without ever disconnecting."""

    def __init__(self, app: Any, path: str, body: dict[str, Any], reads: int):
        self.chunks: list[dict[str, Any]] = []
        self.stopped = asyncio.Event()  # the client stopped reading
        self._reads = reads
        payload = json.dumps(body).encode()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 80),
                 "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(payload)).encode())]}
        messages = [{"type": "http.request", "body": payload, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # never disconnects
            raise AssertionError("unreachable")

        self.task = asyncio.ensure_future(app(scope, receive, self._send))

    async def _send(self, message: dict[str, Any]) -> None:
        if message["type"] != "http.response.body":
            return
        if len(self.chunks) >= self._reads:
            self.stopped.set()
            await asyncio.Event().wait()  # a full socket: this send never completes
        for line in message.get("body", b"").decode().splitlines():
            if line.startswith("data: {"):
                self.chunks.append(json.loads(line[6:]))

    @property
    def tokens_read(self) -> int:
        return sum(len((c["choices"][0].get("logprobs") or {}).get("content") or []) for c in self.chunks
                   if c.get("choices"))


async def live_tokens(client: httpx.AsyncClient, request_id: str) -> int | None:
    """The engine's generated tokens for a live request; None once it has ended."""
    body = (await client.get("/v1/requests")).json()
    for entry in body["data"]:
        if entry["id"] == request_id:
            return entry["completion_tokens"]
    return None


async def until(condition, timeout: float = 30.0, every: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(every)


@pytest.mark.anyio
async def test_a_client_that_stops_reading_pauses_then_is_cancelled_as_disconnect_and_the_next_turn_continues():
    async with tiny_app(stream_buffer_tokens=BUFFER, stream_stall_timeout=STALL_S) as (app, client):
        ctx = app.state.ctx
        messages = [{"role": "user", "content": "tell me everything"}]
        reader = StoppedReader(app, "/v1/chat/completions",
                               {"messages": messages, "stream": True, "logprobs": True, "max_tokens": 400,
                                **GREEDY}, reads=6)
        await asyncio.wait_for(reader.stopped.wait(), 30)
        request_id = reader.chunks[0]["id"]

        # Generation pauses: the engine's count stops growing while the request is live.
        history: list[int | None] = []

        async def paused() -> bool:
            history.append(await live_tokens(client, request_id))
            last = history[-15:]
            return len(last) == 15 and len(set(last)) == 1 and last[0] is not None

        started = time.monotonic()
        await until(paused, timeout=STALL_S)  # well before the stall timeout ends it
        assert time.monotonic() - started < STALL_S
        generated_while_paused = history[-1]
        assert generated_while_paused is not None
        # What was generated: what the client read, plus the server's two bounded buffers
        # (the job's, and the engine stream's) and the step in flight; far from max_tokens.
        assert generated_while_paused <= reader.tokens_read + 3 * BUFFER + 2, (generated_while_paused,
                                                                               reader.tokens_read)

        # After the stall timeout the request ends, cancelled as a disconnect.
        await until(lambda: _ended(client, request_id), timeout=STALL_S * 5)
        await asyncio.wait_for(reader.task, 10)  # the response ended too, without the client reading
        stats = await ctx.engine.stats()
        assert stats.cancelled.get("disconnect") == 1

        # C3: the engine kept exactly the delivered answer; the server remembered its ids.
        await until(lambda: _remembered(ctx), timeout=10)
        (known,) = ctx.memory.snapshot()
        answer_ids = list(known.ids)
        assert reader.tokens_read <= len(answer_ids) <= generated_while_paused
        answer_text = known.text[len(known.prefix_text):]

        # The next turn, with that answer in its history, continues from it token-exactly.
        next_turn = [*messages, {"role": "assistant", "content": answer_text}, {"role": "user", "content": "go on"}]
        r = await client.post("/v1/chat/completions", json={"messages": next_turn, "max_tokens": 3,
                                                            "return_token_ids": True, **GREEDY})
        assert r.status_code == 200, r.text
        body = r.json()
        sent = body["choices"][0]["prompt_token_ids"]
        assert sent[:len(known.prefix_ids) + len(answer_ids)] == list(known.prefix_ids) + answer_ids
        # Every token of the previous prompt and answer was computed already, but the last
        # delivered one (C3: it is computed with the next prompt): the cache serves all of
        # their full blocks (the tiny engine's blocks hold 4 tokens), and nothing beyond them.
        reusable = len(known.prefix_ids) + len(answer_ids) - 1
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reusable // 4 * 4 <= cached <= reusable + 1, (cached, reusable)
        await ctx.engine.check_block_accounting()


async def _ended(client: httpx.AsyncClient, request_id: str) -> bool:
    return await live_tokens(client, request_id) is None


async def _remembered(ctx: Any) -> bool:
    return len(ctx.memory.snapshot()) == 1


@pytest.mark.anyio
async def test_a_client_that_reads_slowly_gets_its_whole_answer():
    async with tiny_app(stream_buffer_tokens=BUFFER, stream_stall_timeout=STALL_S) as (_, client):
        tokens = 0
        async with client.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "stream": True, "logprobs": True,
                "max_tokens": 60, **GREEDY}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    tokens += len((chunk["choices"][0].get("logprobs") or {}).get("content") or [])
                    finish = chunk["choices"][0].get("finish_reason")
                    await asyncio.sleep(0.01)  # slower than the engine: it waits for this reader
        assert tokens == 60 and finish == "length"


@pytest.mark.anyio
async def test_a_background_response_without_max_output_tokens_gets_the_default_and_counts_in_the_queue():
    async with tiny_app(background_max_output_tokens=5, max_queue=1) as (_, client):
        r = await client.post("/v1/responses", json={"input": "hi", "background": True, "store": True, **GREEDY})
        assert r.status_code == 200, r.text
        response_id = r.json()["id"]
        # While it runs it holds the one queue slot: another request is refused.
        busy = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                               "max_tokens": 1})
        finished = (await client.get(f"/v1/responses/{response_id}")).json()["status"] != "in_progress"
        assert busy.status_code == 429 or finished

        async def done() -> bool:
            return (await client.get(f"/v1/responses/{response_id}")).json()["status"] not in ("queued",
                                                                                               "in_progress")

        await until(done)
        stored = (await client.get(f"/v1/responses/{response_id}")).json()
        assert stored["usage"]["output_tokens"] == 5  # the default cap, not the end of the context
        assert stored["status"] == "incomplete" and stored["incomplete_details"]["reason"] == "max_output_tokens"


def test_the_scheduler_skips_a_paused_request_preempts_it_first_and_resumes_it_where_it_was():
    """The engine side of backpressure, exactly: no torch, no clock."""
    from bargein.config import SchedulerConfig
    from bargein.engine.blocks import BlockPool
    from bargein.engine.request import Request, Sequence
    from bargein.engine.sampling import SamplingParams
    from bargein.engine.scheduler import Scheduler

    class Token:
        def __init__(self, token_id: int):
            self.token_id, self.logprobs = token_id, None

    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockPool(4, 4, True), 64,
                  frozenset({0}))

    def add(rid: str, n: int, first: int) -> None:
        s.ids.claim(rid)
        s.add(Request(request_id=rid, sequence=Sequence(rid, list(range(first, first + n))),
                      params=SamplingParams(max_tokens=50, ignore_eos=True), prompt_len=n, new_prompt_tokens=n))

    def step() -> list[str]:
        plan = s.schedule()
        s.update(plan, {c.request_id: Token(7) for c in plan.chunks if c.sample})
        s.take_outcome()
        return [c.request_id for c in plan.chunks]

    add("slow", 6, first=1)
    step()
    s.pause("slow")
    assert step() == [] and not s.has_work  # nothing to do: the engine loop waits, it does not spin
    tokens = list(s.requests["slow"].sequence.token_ids)
    add("busy", 7, first=100)  # no prefix in common
    assert step() == ["busy"]
    # Its decodes soon need a fifth block: the paused request gives its blocks back, though
    # the busy one is newer (a plain preemption would take the newest).
    for _ in range(3):
        assert step() == ["busy"]
    assert s.num_preemptions == 1 and s.requests["slow"].sequence.num_computed == 0
    assert s.requests["slow"].sequence.token_ids == tokens  # its tokens are kept (C3)
    assert step() == ["busy"]  # preempted while paused: it waits for resume, not for blocks
    s.finish(["busy"], FinishReason.CANCELLED)
    s.take_outcome()
    assert not s.has_work
    s.resume("slow")
    assert s.has_work and step() == ["slow"]  # it goes on from its tokens
    assert s.requests["slow"].sequence.token_ids[:len(tokens)] == tokens
