"""Shutdown risks, in process with a tiny engine: the signal handler takes no lock, and a
shutdown never leaves a stream or a collector waiting for an engine that does not answer."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest
import uvicorn

from bargein.engine.async_engine import AsyncEngine
from bargein.engine.request import CancelReason, FinishReason
from bargein.engine.sampling import SamplingParams
from bargein.server.app import begin_shutdown, create_app, request_shutdown
from bargein.server.serve import BargeinServer
from bargein.server.settings import ServerSettings
from tests.tiny_engine import tiny_engine


def test_the_signal_handler_only_sets_a_flag_and_schedules_the_shutdown():
    engine = AsyncEngine(tiny_engine())
    app = create_app(engine, ServerSettings())
    ctx = app.state.ctx
    loop = asyncio.new_event_loop()
    ctx.loop = loop
    calls: list[CancelReason] = []
    # Anything that reaches the engine (whose abort takes the id registry's lock) from
    # inside the handler would show up here before the loop runs.
    engine.abort_all = lambda reason=CancelReason.USER: calls.append(reason) or []
    server = BargeinServer(uvicorn.Config(app), on_exit_signal=lambda: request_shutdown(app))
    try:
        server.handle_exit(signal.SIGTERM, None)
        assert ctx.draining and server.should_exit
        assert calls == [], "the signal handler called into the engine"
        loop.run_until_complete(asyncio.sleep(0.05))
        assert calls == [CancelReason.SHUTDOWN] and ctx.shutdown_started
    finally:
        loop.close()
        ctx.pool.shutdown()


@pytest.mark.anyio
async def test_shutdown_ends_streams_and_collectors_the_engine_does_not_answer():
    core = tiny_engine()
    entered, release = threading.Event(), threading.Event()
    real_execute = core.runner.execute
    calls = 0

    def stuck_execute(plan):  # the 4th step never ends (until the test releases it)
        nonlocal calls
        calls += 1
        if calls >= 4:
            entered.set()
            release.wait(30)
        return real_execute(plan)

    core.runner.execute = stuck_execute
    engine = AsyncEngine(core).start()
    app = create_app(engine, ServerSettings(shutdown_timeout=0.5))
    ctx = app.state.ctx
    ctx.loop = asyncio.get_running_loop()
    params = SamplingParams(max_tokens=200, temperature=0.0)
    streamed = ctx.jobs.start("s1", "chat", [[1, 2, 3, 4, 5]], params)
    collected = ctx.jobs.start("c1", "completions", [[6, 7, 8]], params, n=2)
    outputs = []

    async def stream() -> None:
        async for _, out in ctx.jobs.outputs(streamed):
            outputs.append(out)

    tasks = [asyncio.ensure_future(stream()), asyncio.ensure_future(ctx.jobs.collect(collected))]
    try:
        assert await asyncio.to_thread(entered.wait, 30)
        started = time.monotonic()
        begin_shutdown(ctx)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
        elapsed = time.monotonic() - started
        assert elapsed < 0.5 + 0.3, f"answered {elapsed:.2f} s after the shutdown began (timeout 0.5 s)"
        final = outputs[-1]
        assert final.finished and final.finish_reason == FinishReason.CANCELLED
        assert final.cancel_reason == CancelReason.SHUTDOWN
        assert final.text == "".join(o.delta_text for o in outputs)
        assert list(final.token_ids) == [t for o in outputs for t in o.new_token_ids]
        for progress in collected.progress.values():
            assert progress.final is not None and progress.final.cancel_reason == CancelReason.SHUTDOWN
        assert len(ctx.registry) == 0
    finally:
        release.set()
        await engine.shutdown(timeout=10)
        ctx.pool.shutdown()
