"""The stream grammar and the job runner on outputs of the engine's delta contract (no model).

Intermediate outputs carry deltas only (``text`` and ``token_ids`` empty), the finished
one the cumulative fields (INTERFACES.md contract 1): the server must build its answers
from the deltas and the final output, never from an intermediate ``text``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import types

import pytest

from bargein.engine.request import AbortResult, CancelReason, FinishReason, RequestOutput, Usage
from bargein.engine.sampling import SamplingParams
from bargein.server.generation import JobRunner
from bargein.server.metrics import ServerMetrics
from bargein.server.openai_stream import ChatShape, CompletionShape, collect, event_stream
from bargein.server.registry import RequestRegistry


class FakeStream:
    """Stands in for the engine's RequestStream: outputs are put straight into ``queue``."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.processor = types.SimpleNamespace(num_delivered=0)


class FakeEngine:
    """Just what JobRunner uses: submit (a stream per request), next_output and abort."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue] = {}
        self.aborted: list[tuple[str, CancelReason]] = []

    def submit(self, prompt, params, *, request_id, timeout=None, constraint_from=None):
        stream = FakeStream()
        self.queues[request_id] = stream.queue
        return request_id, stream

    async def next_output(self, stream: FakeStream) -> RequestOutput:
        return await stream.queue.get()

    def abort(self, request_id, reason=CancelReason.USER, *, delivered=None):
        self.aborted.append((request_id, reason))
        return AbortResult.CANCELLED


def delta(rid: str, tokens: tuple[int, ...], text: str, usage: Usage) -> RequestOutput:
    return RequestOutput(rid, tokens, (), text, "", False, None, usage)


def final(rid: str, tokens: tuple[int, ...], text: str, all_tokens: tuple[int, ...], all_text: str, usage: Usage,
          reason: FinishReason, cancel: CancelReason | None = None) -> RequestOutput:
    return RequestOutput(rid, tokens, all_tokens, text, all_text, True, reason, usage, cancel_reason=cancel,
                         prompt_token_ids=(1, 2, 3))


class Tokenizer:
    def token_bytes(self, token_id, *, skip_special_tokens=True):
        return bytes([token_id])


def runner() -> tuple[JobRunner, FakeEngine]:
    engine = FakeEngine()
    return JobRunner(engine, RequestRegistry(), ServerMetrics(), max_queue=None, draining=lambda: False), engine


def parse(events: list[str]) -> list:
    out = []
    for event in events:
        data = event.removeprefix("data: ").strip()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.anyio
async def test_chat_grammar_from_deltas_with_a_cancelled_final_that_still_adds_text():
    jobs, engine = runner()
    job = jobs.start("c1", "chat", [[1, 2, 3]], SamplingParams(max_tokens=10))
    q = engine.queues["c1#0"]
    q.put_nowait(delta("c1#0", (72,), "H", Usage(3, 1, 0)))
    q.put_nowait(delta("c1#0", (105,), "", Usage(3, 2, 0)))  # held back (could start a stop string)
    q.put_nowait(final("c1#0", (), "i", (72, 105), "Hi", Usage(3, 2, 0), FinishReason.CANCELLED, CancelReason.USER))
    head = {"id": "c1", "created": 1, "model": "m", "system_fingerprint": "fp_0123456789"}
    shape = ChatShape(head, Tokenizer(), logprobs=False, include_usage=True)
    chunks = parse([e async for e in event_stream(jobs, job, shape)])
    choices = [c["choices"] for c in chunks[:-1]]
    assert choices == [
        [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "H"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "i"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "cancelled", "cancel_reason": "user"}],
        [],
    ]
    assert all(c["usage"] is None for c in chunks[:-2]) and chunks[-1] == "[DONE]"
    assert chunks[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(c["system_fingerprint"] == "fp_0123456789" and c["id"] == "c1" for c in chunks[:-1])
    assert job.closed and len(jobs.registry) == 0 and engine.aborted == []


@pytest.mark.anyio
async def test_two_choices_interleave_and_the_body_reads_only_final_outputs():
    jobs, engine = runner()
    job = jobs.start("c2", "completions", [[1]], SamplingParams(max_tokens=2), n=2)
    a, b = engine.queues["c2#0"], engine.queues["c2#1"]
    a.put_nowait(delta("c2#0", (97,), "a", Usage(1, 1, 0)))
    b.put_nowait(delta("c2#1", (98,), "b", Usage(1, 1, 0)))
    b.put_nowait(final("c2#1", (99,), "c", (98, 99), "bc", Usage(1, 2, 0), FinishReason.LENGTH))
    a.put_nowait(final("c2#0", (100,), "d", (97, 100), "ad", Usage(1, 2, 0), FinishReason.LENGTH))
    head = {"id": "c2", "created": 1, "model": "m", "system_fingerprint": "fp_0123456789"}
    shape = CompletionShape(head, Tokenizer(), ["", ""], logprobs=False, include_usage=False)
    await collect(jobs, job, shape)
    body = shape.body(job)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [(0, "ad", "length"),
                                                                                     (1, "bc", "length")]
    assert body["usage"]["completion_tokens"] == 4 and body["usage"]["prompt_tokens"] == 1


@pytest.mark.anyio
async def test_a_consumer_that_leaves_aborts_and_the_late_final_still_reaches_the_hook():
    jobs, engine = runner()
    seen = []
    job = jobs.start("c3", "chat", [[1]], SamplingParams(max_tokens=5), on_final=lambda s, o: seen.append(o))
    q = engine.queues["c3#0"]
    q.put_nowait(delta("c3#0", (97,), "a", Usage(1, 1, 0)))
    async with contextlib.aclosing(jobs.outputs(job)) as outputs:
        async for _ in outputs:
            break  # the client hung up
    assert engine.aborted == [("c3#0", CancelReason.DISCONNECT)] and job.closed
    q.put_nowait(final("c3#0", (), "", (97,), "a", Usage(1, 1, 0), FinishReason.CANCELLED, CancelReason.DISCONNECT))
    for _ in range(10):
        await asyncio.sleep(0)
    assert [o.token_ids for o in seen] == [(97,)]


@pytest.mark.anyio
async def test_a_slot_whose_outputs_cannot_be_read_ends_with_an_error_not_a_hang():
    jobs, engine = runner()

    async def broken(stream):
        raise RuntimeError("the stream broke")

    engine.next_output = broken
    job = jobs.start("c4", "chat", [[1]], SamplingParams(max_tokens=5))
    outs = [out async for _, out in jobs.outputs(job)]
    assert [(o.finished, o.finish_reason) for o in outs] == [(True, FinishReason.ERROR)]
    assert "the stream broke" in outs[0].error
