"""Risks found in the engine's request lifecycle (issue 9), one test each.

Each of these failed on the engine before the one-owner rewrite (commit abfdbbc); they
use only API that both versions have (``AsyncEngine.generate``, ``Engine.generate``,
``abort``, ``call_soon``), so the failure was the bug and not a renamed method.
"""

from __future__ import annotations

import asyncio
import sys
import threading

from bargein.engine import blocks
from bargein.engine.async_engine import AsyncEngine
from bargein.engine.request import AbortResult, CancelReason, FinishReason
from bargein.engine.sampling import SamplingParams
from tests.tiny_engine import prompt, reference_greedy, tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


async def _final(ae: AsyncEngine, tokens: list[int], params: SamplingParams = GREEDY, **kwargs):
    got: list[int] = []
    async for out in ae.generate(tokens, params, **kwargs):
        got += out.new_token_ids
    return got, out


def test_a_prefix_key_collision_never_serves_another_sequences_kv(monkeypatch) -> None:
    """Even if two different blocks got the same key, a hit is checked against the tokens."""
    monkeypatch.setattr(blocks, "chain_hash", lambda parent, tokens: b"same key for every block")
    engine = tiny_engine(block_size=4)
    a, b = prompt(16, 60), prompt(16, 61)
    assert a[0] != b[0]
    engine.generate([a], GREEDY)
    (out,) = engine.generate([b], GREEDY)
    assert out.usage.cached_tokens == 0
    assert list(out.token_ids) == reference_greedy(b, 6)


def test_waiting_conversation_request_does_not_pin_blocks_a_running_one_needs() -> None:
    """One slot, 8 blocks of 4: a conversation holding 5 blocks waits behind a plain
    request that needs 7. Its blocks are taken back; both answers come out exact."""
    engine = tiny_engine(num_blocks=8, block_size=4, max_num_seqs=1)
    session = engine.open_conversation()
    p = prompt(20, 62)
    first = engine.add_request(p, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                               conversation_id=session)
    while first in engine.live_request_ids():
        engine.step()
    assert len(engine.scheduler.conversation(session).sequence.block_table.block_ids) == 5
    q = prompt(10, 63)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    plain = engine.add_request(q, params)
    conv = engine.add_request([7], params, conversation_id=session)  # waits: one slot
    final = {}
    for _ in range(200):
        result = engine.step()
        for item in getattr(result, "deltas", result):
            if item.finished:
                final[item.request_id] = item
        if len(final) == 2:
            break
    assert final[plain].finish_reason == FinishReason.LENGTH, final[plain].error
    assert final[conv].finish_reason == FinishReason.LENGTH, final[conv].error
    held = engine.conversation_tokens(session)
    answer = held[len(p) + 2:]
    assert len(held) == engine.max_model_len == 32  # the context (the pool) is full
    assert answer == reference_greedy(held[:len(p) + 2], len(answer))
    engine.check_block_accounting()


def test_closing_a_conversation_mid_step_loses_no_other_final_output() -> None:
    """A request that ends inside the scheduler (here: with an error, as when the KV
    cache is too small) and a conversation closed in the same step (a call from another
    thread, run after the forward): both get their last output."""
    engine = tiny_engine()
    session = engine.open_conversation(prompt(20, 64))
    plain = engine.add_request(prompt(10, 65), SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    conv = engine.add_request([7], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
                              conversation_id=session)
    scheduler = engine.scheduler
    schedule = scheduler.schedule
    closed = []

    def schedule_fail_and_close():
        plan = schedule()
        if not closed and engine.stats().steps == 2:
            end = getattr(scheduler, "finish_request", None)  # the engine before issue 9 had this
            if end is not None:
                end(plain, FinishReason.ERROR, error="simulated")
            else:
                scheduler.finish([plain], FinishReason.ERROR, error="simulated")
            closed.append(engine.call_soon(lambda: engine.close_conversation(session)))
        return plan

    scheduler.schedule = schedule_fail_and_close
    final = {}
    for _ in range(20):
        result = engine.step()
        for item in getattr(result, "deltas", result):
            if item.finished:
                final[item.request_id] = item
        if len(final) == 2:
            break
    assert set(final) == {plain, conv}
    assert final[plain].finish_reason == FinishReason.ERROR and final[plain].error == "simulated"
    assert final[conv].finish_reason == FinishReason.CANCELLED
    engine.check_block_accounting()


def test_abort_answers_what_happens_even_when_the_step_in_flight_would_finish_it() -> None:
    """An abort that lands after the step's inbox was read but before its results are
    applied answers CANCELLED; the request then ends cancelled, without that step's token."""
    engine = tiny_engine()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    rid = engine.add_request(prompt(9, 66), params)
    update = engine.scheduler.update
    answers = []

    def abort_then_update(plan, sampled):
        if rid in [c.request_id for c in plan.chunks] and engine.stats().steps == 3 and not answers:
            answers.append(engine.abort(rid))  # the step that samples the third, last token
        return update(plan, sampled)

    engine.scheduler.update = abort_then_update
    final = None
    delivered: list[int] = []
    for _ in range(20):
        result = engine.step()
        for item in getattr(result, "deltas", result):
            delivered += item.new_token_ids
            if item.finished:
                final = item
        if final is not None:
            break
    assert answers == [AbortResult.CANCELLED]
    assert final.finish_reason == FinishReason.CANCELLED
    assert len(delivered) == 2  # the token sampled in the cancelled step never reaches the caller
    assert engine.abort(rid) == AbortResult.ALREADY_FINISHED


def test_a_failure_while_admitting_a_request_fails_that_request_only(monkeypatch) -> None:
    from bargein.engine import engine as engine_module

    real = engine_module.SamplingState.create

    def create(params, *args, **kwargs):
        if params.seed == 13:
            raise RuntimeError("no generator for you")
        return real(params, *args, **kwargs)

    monkeypatch.setattr(engine_module.SamplingState, "create", staticmethod(create))

    async def main():
        ae = AsyncEngine(tiny_engine()).start()
        try:
            p = prompt(9, 67)
            bad = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, seed=13)
            (_, failed), (got, ok) = await asyncio.wait_for(
                asyncio.gather(_final(ae, p, bad), _final(ae, p)), 20)
            assert failed.finish_reason == FinishReason.ERROR and "no generator" in failed.error
            assert ok.finish_reason == FinishReason.LENGTH and got == reference_greedy(p, 6)
            assert ae.is_alive
            got, again = await asyncio.wait_for(_final(ae, p), 20)
            assert got == reference_greedy(p, 6)
        finally:
            await ae.shutdown(timeout=5)

    asyncio.run(main())


def test_a_shutdown_that_times_out_still_ends_every_stream() -> None:
    """A forward that hangs past the shutdown timeout: the awaiting stream gets a final
    cancelled output instead of waiting forever."""
    engine = tiny_engine()
    entered, release = threading.Event(), threading.Event()
    execute = engine.runner.execute

    def hanging(plan):
        entered.set()
        release.wait(30)
        return execute(plan)

    engine.runner.execute = hanging

    async def main():
        ae = AsyncEngine(engine).start()
        task = asyncio.ensure_future(_final(ae, prompt(9, 68)))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        await ae.shutdown(timeout=0.3)
        try:
            _, final = await asyncio.wait_for(task, 5)
        finally:
            release.set()
        assert final.finished and final.finish_reason == FinishReason.CANCELLED
        assert final.cancel_reason == CancelReason.SHUTDOWN

    asyncio.run(main())


def test_abort_takes_no_lock_so_a_signal_handler_may_call_it() -> None:
    """A signal handler runs between two bytecodes of the main thread, which may hold any
    lock at that moment; a handler that takes a lock can deadlock. abort/abort_all take none."""

    async def main():
        ae = AsyncEngine(tiny_engine()).start()
        try:
            stream = ae.generate(prompt(9, 69), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                 request_id="r1")
            await stream.__anext__()
            locks: list[str] = []

            def profile(frame, event, arg):
                if event == "c_call" and type(getattr(arg, "__self__", None)).__name__ in ("lock", "RLock"):
                    locks.append(arg.__qualname__)

            sys.setprofile(profile)
            try:
                answers = (ae.abort("r1", CancelReason.SHUTDOWN), ae.abort_all(CancelReason.SHUTDOWN),
                           ae.abort("no-such-id"))
            finally:
                sys.setprofile(None)
            assert locks == []
            assert answers[0] == AbortResult.CANCELLED and answers[2] == AbortResult.NOT_FOUND
            outs = [out async for out in stream]
            assert outs[-1].finish_reason == FinishReason.CANCELLED
        finally:
            await ae.shutdown(timeout=5)

    asyncio.run(main())
