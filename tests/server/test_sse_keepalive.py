"""SSE keep-alives during a long prefill (issue 27 item 4; ``server/keepalive.py``).

Through a real HTTP server on loopback: the tiny engine reads a ~400-token prompt 8 tokens
a step, each step slowed by 40 ms, so the first token comes after at least 2 s; with a
keep-alive interval of 0.25 s the stream carries keep-alive comments meanwhile, each
exactly ``: keep-alive`` or ``: keep-alive prompt <computed>/<prompt tokens>`` with the
computed count never going back, and the data events, comments taken out, are exactly
the stream a server without keep-alives sends for the same request (ids and timestamps
aside). Ollama's NDJSON stream gets no
comments. The wrapper itself, as units: events unchanged and in order, a comment only
after a quiet interval, a close mid-read ends the inner stream.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from bargein.engine.async_engine import AsyncEngine
from bargein.engine.stats import RequestInfo
from bargein.server.app import create_app
from bargein.server.keepalive import keepalive_comment, prompt_progress_text, with_keepalives
from bargein.server.settings import ServerSettings, SettingsError
from tests.conftest import free_port
from tests.server.test_server_inprocess import ChatByteTokenizer
from tests.tiny_engine import tiny_engine

INTERVAL_S = 0.25
STEP_DELAY_S = 0.04
BUDGET = 8  # prompt tokens a step
PROMPT = [{"role": "user", "content": " ".join(f"w{i * 7 % 97}" for i in range(100))}]  # ~400 byte tokens
BODY = {"model": "tiny", "messages": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}
COMMENT = re.compile(r": keep-alive(?: prompt (\d+)/(\d+))?")


@contextmanager
def live_server(keepalive_s: float) -> Iterator[str]:
    """A real server over the tiny engine (8 prompt tokens a step, each step slowed)."""
    core = tiny_engine(num_blocks=256, max_num_batched_tokens=BUDGET)
    core.tokenizer = ChatByteTokenizer()
    execute = core.runner.execute

    def slowed(plan):
        time.sleep(STEP_DELAY_S)
        return execute(plan)

    core.runner.execute = slowed
    port = free_port()
    app = create_app(AsyncEngine(core), ServerSettings(port=port, sse_keepalive_s=keepalive_s))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="keepalive-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[str, str]]:
    """(a server with keep-alives every INTERVAL_S, one without)."""
    with live_server(INTERVAL_S) as with_keepalives_url, live_server(0) as without_url:
        yield with_keepalives_url, without_url


def stream_events(url: str, path: str = "/v1/chat/completions", body: dict | None = None) -> list[str]:
    """Every SSE event of one streamed request, as its text without the blank line."""
    with httpx.stream("POST", url + path, json={**(body or BODY), "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        raw = "".join(r.iter_text())
    assert raw.endswith("\n\n")
    return raw[:-2].split("\n\n")


def comparable(event: str) -> dict | str:
    """A data event without what differs between two runs (its id, its creation time)."""
    assert event.startswith("data: "), event
    text = event[len("data: "):]
    if text == "[DONE]":
        return text
    payload = json.loads(text)
    payload.pop("id"), payload.pop("created")
    return payload


def test_a_long_prefill_streams_keepalives_with_its_progress_and_the_same_events(servers) -> None:
    url, plain_url = servers
    with ThreadPoolExecutor(2) as pool:  # both servers at once: their steps mostly sleep
        events, reference = pool.map(stream_events, (url, plain_url))
    comments = [e for e in events if e.startswith(":")]
    data = [e for e in events if not e.startswith(":")]
    assert not any(e.startswith(":") for e in reference)  # keep-alives off: none
    assert [comparable(e) for e in data] == [comparable(e) for e in reference]
    final = json.loads(data[-2][len("data: "):])["choices"][0]
    prompt_tokens = len(final["prompt_token_ids"])
    assert len(final["token_ids"]) == BODY["max_tokens"] and prompt_tokens > 50 * BUDGET - 40

    # At least 2 s of prefill (50 steps of 40 ms) against a 0.25 s interval: comments came,
    # all before the first token (decode steps are far shorter than the interval... unless
    # the machine stalls: then a bare one may follow, never one with a prompt's progress).
    first_token = next(i for i, e in enumerate(events) if '"content":"' in e and '"content":""' not in e)
    assert comments and events.index(comments[0]) < first_token
    progress = []
    for i, event in enumerate(events):
        if not event.startswith(":"):
            continue
        match = COMMENT.fullmatch(event)
        assert match, event
        if match.group(1) is not None:
            assert i < first_token and int(match.group(2)) == prompt_tokens
            progress.append(int(match.group(1)))
    assert progress and progress == sorted(progress) and progress[-1] < prompt_tokens


def test_ndjson_streams_get_no_comments(servers) -> None:
    url, _ = servers
    body = {"model": "tiny", "messages": PROMPT, "stream": True, "options": {"num_predict": 2, "temperature": 0}}
    with httpx.stream("POST", url + "/api/chat", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in "".join(r.iter_text()).split("\n") if line]
    assert all(json.loads(line) for line in lines) and json.loads(lines[-1])["done"] is True


# -- units -------------------------------------------------------------------------------


def test_comment_and_progress_text() -> None:
    assert keepalive_comment() == ": keep-alive\n\n"
    assert keepalive_comment("prompt 3/9") == ": keep-alive prompt 3/9\n\n"
    infos = [RequestInfo("a", "running", 100, 40, 0, 1.0, None, None),
             RequestInfo("b", "running", 100, 100, 2, 1.0, None, None),
             RequestInfo("c", "queued", 50, 0, 0, 1.0, None, None)]
    assert prompt_progress_text(infos, ["c", "a", "b", "gone"]) == "prompt 0/50 40/100"
    assert prompt_progress_text(infos, ["b"]) is None and prompt_progress_text([], ["a"]) is None
    with pytest.raises(SettingsError, match="keep-alive"):
        ServerSettings(sse_keepalive_s=-1)
    assert ServerSettings.from_env({"BARGEIN_SSE_KEEPALIVE": "2.5"}).sse_keepalive_s == 2.5


def test_events_pass_unchanged_with_comments_only_after_a_quiet_interval() -> None:
    async def scenario() -> list[str]:
        release = asyncio.Event()

        async def events() -> AsyncGenerator[str, None]:
            yield "data: 1\n\n"
            yield "data: 2\n\n"
            await release.wait()  # quiet until the comments came
            yield "data: 3\n\n"

        asked = 0

        async def progress() -> str | None:
            nonlocal asked
            asked += 1
            if asked == 2:
                release.set()
            return f"prompt {asked}/5" if asked == 1 else None

        out = [e async for e in with_keepalives(events(), 0.05, progress)]
        return out

    out = asyncio.run(scenario())
    assert out == ["data: 1\n\n", "data: 2\n\n", ": keep-alive prompt 1/5\n\n", ": keep-alive\n\n", "data: 3\n\n"]


def test_a_slow_or_failing_progress_never_holds_or_ends_the_stream() -> None:
    async def scenario() -> list[str]:
        async def events() -> AsyncGenerator[str, None]:
            await asyncio.sleep(0.3)
            yield "data: x\n\n"

        async def hangs() -> str | None:
            await asyncio.sleep(10)
            return "never"

        async def fails() -> str | None:
            raise RuntimeError("engine gone")

        slow = [e async for e in with_keepalives(events(), 0.1, hangs)]
        broken = [e async for e in with_keepalives(events(), 0.1, fails)]
        return slow + broken

    out = asyncio.run(asyncio.wait_for(scenario(), 5))
    assert set(out) == {": keep-alive\n\n", "data: x\n\n"} and out.count("data: x\n\n") == 2


def test_closing_the_stream_mid_read_ends_the_inner_stream() -> None:
    async def scenario() -> tuple[list[str], list[str]]:
        log: list[str] = []

        async def events() -> AsyncGenerator[str, None]:
            try:
                yield "data: 1\n\n"
                await asyncio.sleep(10)
                yield "data: never\n\n"
            except asyncio.CancelledError:
                log.append("cancelled")
                raise
            finally:
                log.append("closed")

        wrapped = with_keepalives(events(), 0.05)
        got = [await anext(wrapped), await anext(wrapped)]  # an event, then a keep-alive while it waits
        await wrapped.aclose()  # the client went away
        return got, log

    got, log = asyncio.run(asyncio.wait_for(scenario(), 5))
    assert got == ["data: 1\n\n", ": keep-alive\n\n"] and log == ["cancelled", "closed"]
    with pytest.raises(ValueError, match="positive"):
        asyncio.run(anext(with_keepalives(_empty(), 0)))


async def _empty() -> AsyncGenerator[str, None]:
    return
    yield  # pragma: no cover - makes this an async generator
