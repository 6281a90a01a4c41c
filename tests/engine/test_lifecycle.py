"""The one lifecycle: the transition table, read-only status, one result per step, plans
in flight, deltas processed on the consumer's side (stop strings, coalescing streams)."""

from __future__ import annotations

import asyncio

import pytest

from bargein.engine.async_engine import AsyncEngine
from bargein.engine.conversation import Conversation
from bargein.engine.engine import EngineError
from bargein.engine.outputs import OutputCollector
from bargein.engine.request import (
    TRANSITIONS,
    FinishReason,
    IllegalTransition,
    Request,
    RequestEvent,
    RequestStatus,
    Sequence,
    transition,
)
from bargein.engine.sampling import SamplingParams
from tests.tiny_engine import prompt, reference_greedy, tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _request() -> Request:
    return Request("r", Sequence("r", [1, 2, 3]), GREEDY, prompt_len=3, new_prompt_tokens=3)


def test_status_is_read_only_and_changes_only_by_the_table() -> None:
    req = _request()
    with pytest.raises(AttributeError):
        req.status = RequestStatus.RUNNING  # type: ignore[misc]
    assert transition(req, RequestEvent.SCHEDULE) == (RequestStatus.WAITING, RequestStatus.RUNNING)
    with pytest.raises(IllegalTransition):
        transition(req, RequestEvent.SCHEDULE)  # already running
    transition(req, RequestEvent.STOP)
    assert req.status == RequestStatus.FINISHED_STOPPED and req.finish_time is not None
    for event in RequestEvent:  # nothing happens to a finished request
        with pytest.raises(IllegalTransition):
            transition(req, event)
    assert not any(status.is_finished for status in TRANSITIONS)


def test_a_step_returns_one_result_with_deltas_only() -> None:
    engine = tiny_engine()
    p = prompt(9, 80)
    rid = engine.add_request(p, GREEDY)
    outcome = engine.step()
    (delta,) = outcome.deltas
    assert delta.request_id == rid and len(delta.new_token_ids) == 1 and not delta.finished
    assert delta.prompt_token_ids == tuple(p)  # the first delta carries the prompt, once
    assert engine.step().deltas[0].prompt_token_ids is None
    assert delta.usage.prompt_tokens == 9 and delta.usage.completion_tokens == 1


def test_intermediate_outputs_carry_no_cumulative_fields() -> None:
    engine = tiny_engine()
    collector = OutputCollector(engine)
    p = prompt(9, 81)
    rid = collector.add_request(p, GREEDY)
    outs = []
    while not (outs and outs[-1].finished):
        outs += [o for o in collector.step() if o.request_id == rid]
    assert all(o.token_ids == () and o.text == "" and o.prompt_token_ids == () for o in outs[:-1])
    final = outs[-1]
    assert list(final.token_ids) == reference_greedy(p, 8) == [t for o in outs for t in o.new_token_ids]
    assert final.prompt_token_ids == tuple(p)


def test_the_scheduler_never_puts_a_sequence_in_two_plans_in_flight() -> None:
    engine = tiny_engine()
    a = engine.add_request(prompt(9, 82), GREEDY)
    engine.step()  # a is running, decoding
    b = engine.add_request(prompt(5, 83), GREEDY)
    engine._drain_inbox()
    first = engine.scheduler.schedule()
    second = engine.scheduler.schedule()  # a second plan while the first is in flight
    assert [c.request_id for c in first.chunks] == [a, b]
    assert second.is_empty
    assert engine.scheduler.in_flight == {a, b}


def test_a_stop_string_found_by_the_consumer_ends_the_request_and_cuts_the_conversation() -> None:
    """The engine samples on while the consumer finds the stop; the conversation keeps
    exactly the delivered tokens, up to the one that completed the stop string (C3)."""
    async def main():
        ae = AsyncEngine(tiny_engine()).start()
        try:
            p = prompt(9, 84)
            (free,) = tiny_engine().generate([p], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
            text = free.text
            start = next(i for i in range(6, len(text) - 2) if text.index(text[i:i + 2]) == i)
            stop = text[start:start + 2]  # first shows up some tokens in
            conv = Conversation.open(ae, p)
            params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
            outs = [o async for o in conv.generate(params)]
            final = outs[-1]
            assert final.finish_reason == FinishReason.STOP
            delivered = [t for o in outs for t in o.new_token_ids]
            assert list(final.token_ids) == delivered
            assert stop not in final.text and final.text == text[:text.index(stop)]
            assert await conv.tokens() == p + delivered
            assert final.usage.completion_tokens == len(delivered) < 30
            # The conversation continues exactly from what was delivered.
            more = [o async for o in conv.generate(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))]
            assert list(more[-1].token_ids) == reference_greedy(p + delivered, 4)
            await conv.close()
        finally:
            await ae.shutdown(timeout=5)

    asyncio.run(main())


def test_a_slow_consumer_gets_coalesced_deltas_and_never_blocks_the_engine() -> None:
    async def main():
        ae = AsyncEngine(tiny_engine()).start()
        try:
            p = prompt(9, 85)
            rid, stream = ae.submit(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
            for _ in range(500):  # the engine finishes without anyone reading
                if rid not in ae.engine.live_request_ids():
                    break
                await asyncio.sleep(0.01)
            assert rid not in ae.engine.live_request_ids()
            outs = [o async for o in ae.stream(rid, stream)]
            assert len(outs) == 1  # everything pending was one item
            assert list(outs[0].token_ids) == reference_greedy(p, 20) == list(outs[0].new_token_ids)
        finally:
            await ae.shutdown(timeout=5)

    asyncio.run(main())


def test_a_duplicate_id_is_refused_without_touching_the_live_requests_stream() -> None:
    async def main():
        ae = AsyncEngine(tiny_engine()).start()
        try:
            p = prompt(9, 86)
            rid, stream = ae.submit(p, GREEDY, request_id="same")
            with pytest.raises(EngineError, match="already in use"):
                ae.submit(prompt(5, 87), GREEDY, request_id="same")
            outs = [o async for o in ae.stream(rid, stream)]
            assert list(outs[-1].token_ids) == reference_greedy(p, 8)
            # A finished id may be used again.
            again = [o async for o in ae.generate(p, GREEDY, request_id="same")]
            assert again[-1].token_ids == outs[-1].token_ids
        finally:
            await ae.shutdown(timeout=5)

    asyncio.run(main())
