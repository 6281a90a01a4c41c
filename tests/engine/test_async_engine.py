"""AsyncEngine: every way a consumer can stop a request ends it under the contract."""

from __future__ import annotations

import asyncio
import threading

import pytest

from bargein.engine.async_engine import AsyncEngine
from bargein.engine.conversation import Conversation
from bargein.engine.request import AbortResult, CancelReason, FinishReason
from bargein.engine.sampling import SamplingParams
from tests.tiny_engine import prompt, reference_greedy, tiny_engine

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture
def engine():
    ae = AsyncEngine(tiny_engine(num_blocks=128)).start()
    yield ae
    asyncio.run(ae.shutdown())


async def settle(ae: AsyncEngine) -> None:
    """Waits until no request is live, then checks the block accounting (C5)."""
    for _ in range(500):
        if not ae.engine.live_request_ids():
            break
        await asyncio.sleep(0.01)
    assert not ae.engine.live_request_ids()
    await ae.call(ae.engine.check_block_accounting)
    assert (await ae.stats()).kv_blocks_used == 0


def test_streams_the_same_tokens_as_the_reference(engine) -> None:
    async def main():
        p = prompt(9, 1)
        tokens = [t async for out in engine.generate(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
                  for t in out.new_token_ids]
        assert tokens == reference_greedy(p, 6)
        await settle(engine)

    asyncio.run(main())


def test_breaking_out_of_the_loop_cancels(engine) -> None:
    async def main():
        rid = "walk-away"
        agen = engine.generate(prompt(9, 2), LONG, request_id=rid)
        got = 0
        async for out in agen:
            got += len(out.new_token_ids)  # intermediate outputs carry deltas only
            if got >= 3:
                break
        await agen.aclose()
        await settle(engine)
        assert engine.abort(rid) == AbortResult.ALREADY_FINISHED
        assert (await engine.stats()).cancelled == {"disconnect": 1}

    asyncio.run(main())


def test_cancelling_the_consuming_task_cancels(engine) -> None:
    async def main():
        seen = asyncio.Event()

        async def consume():
            async for _ in engine.generate(prompt(9, 3), LONG):
                seen.set()

        task = asyncio.create_task(consume())
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await settle(engine)
        assert (await engine.stats()).cancelled == {"disconnect": 1}

    asyncio.run(main())


def test_abort_from_another_thread_ends_the_stream_with_cancelled(engine) -> None:
    async def main():
        outs = []
        async for out in engine.generate(prompt(9, 4), LONG, request_id="by-id"):
            outs.append(out)
            if len(outs) == 2:
                result: list = []
                t = threading.Thread(target=lambda out=result: out.append(engine.abort("by-id")))
                t.start()
                t.join()
                assert result == [AbortResult.CANCELLED]
        final = outs[-1]
        assert final.finished and final.finish_reason == FinishReason.CANCELLED
        assert final.cancel_reason == CancelReason.USER
        assert sum(len(o.new_token_ids) for o in outs) == len(final.token_ids)
        await settle(engine)

    asyncio.run(main())


def test_deadline_ends_the_stream(engine) -> None:
    async def main():
        outs = [o async for o in engine.generate(prompt(9, 5), SamplingParams(temperature=0, max_tokens=100_000 // 400,
                                                                            ignore_eos=True), timeout=0.05)]
        assert outs[-1].finish_reason == FinishReason.CANCELLED and outs[-1].cancel_reason == CancelReason.DEADLINE
        await settle(engine)

    asyncio.run(main())


def test_shutdown_answers_in_flight_requests() -> None:
    async def main():
        ae = AsyncEngine(tiny_engine()).start()
        outs = []

        async def consume():
            async for out in ae.generate(prompt(9, 6), LONG):
                outs.append(out)

        task = asyncio.create_task(consume())
        while not outs:
            await asyncio.sleep(0.005)
        await ae.shutdown()
        await task
        assert outs[-1].finish_reason == FinishReason.CANCELLED and outs[-1].cancel_reason == CancelReason.SHUTDOWN
        assert not ae.is_alive

    asyncio.run(main())


def test_conversation_cancel_then_continue_is_exact(engine) -> None:
    async def main():
        p, q = prompt(12, 7), prompt(4, 8)
        conv = Conversation.open(engine)
        await conv.prompt(p)
        got = []
        async for out in conv.generate(LONG):
            got += out.new_token_ids
            if len(got) >= 3:
                conv.cancel()
        assert out.finish_reason == FinishReason.CANCELLED
        assert await conv.tokens() == p + got
        await conv.prompt(q)
        outs = [o async for o in conv.generate(SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))]
        assert list(outs[-1].token_ids) == reference_greedy(p + got + q, 5)
        assert outs[-1].usage.cached_tokens >= len(p) + len(got) - 1
        await conv.close()
        await settle(engine)

    asyncio.run(main())
