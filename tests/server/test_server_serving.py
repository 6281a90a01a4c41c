"""The serving path on a real server: engine ids that no client id can collide with, and
large inputs that are refused or tokenized without stalling other streams."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import httpx
import openai
import pytest

from tests.conftest import listed_requests, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("check_kv")]
LONG = [{"role": "user", "content": "Write a long story about a fox who learns to sail."}]


@pytest.fixture
async def aclient(live_server):
    async with openai.AsyncOpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def cancel(server, request_id: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/requests/{request_id}/cancel", timeout=10)


@pytest.mark.anyio
async def test_a_client_id_equal_to_another_requests_old_engine_id_cancels_only_its_own(aclient, live_server):
    # Engine ids used to be "{id}-{index}": a client choosing "coll-0" took choice 0 of "coll".
    streams = {}

    async def run(request_id: str, n: int) -> dict[int, str]:
        finals: dict[int, str] = {}
        stream = await aclient.chat.completions.create(
            model="m", messages=LONG, max_tokens=400, n=n, temperature=0, stream=True,
            extra_headers={"X-Request-Id": request_id})
        streams[request_id] = 0
        async for chunk in stream:
            for choice in chunk.choices:
                streams[request_id] += bool(choice.delta.content)
                if choice.finish_reason is not None:
                    finals[choice.index] = f"{choice.finish_reason}:{getattr(choice, 'cancel_reason', None)}"
        return finals

    both = asyncio.gather(run("coll", 2), run("coll-0", 1))
    await asyncio.to_thread(wait_until, lambda: streams.get("coll", 0) >= 4 and streams.get("coll-0", 0) >= 2)
    assert cancel(live_server, "coll-0").json()["status"] == "cancelled"
    seen = streams["coll"]
    await asyncio.to_thread(wait_until, lambda: streams["coll"] >= seen + 6)  # "coll" goes on
    assert set(listed_requests(live_server)) == {"coll"}
    assert cancel(live_server, "coll").json()["status"] == "cancelled"
    coll, other = await both
    assert coll == {0: "cancelled:user", 1: "cancelled:user"} and other == {0: "cancelled:user"}


def test_engine_ids_are_outside_what_clients_may_choose_and_the_engine_answers_for_finished_ones(live_server):
    url = f"{live_server.base_url}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(url, json=body, headers={"X-Request-Id": "ids#0"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
    assert httpx.post(url, json=body, headers={"X-Request-Id": "ids-done"}).status_code == 200
    assert cancel(live_server, "ids-done").json()["status"] == "already_finished"
    r = cancel(live_server, "ids-never-seen")
    assert r.status_code == 404


def test_large_inputs_do_not_stall_another_stream(live_server):
    """A 3.9 MB chat body is refused by its size, a 200 kB one after tokenizing in the pool;
    meanwhile another stream keeps its pace (before: a 1.86 s gap, issue 14)."""
    times: list[float] = []

    def stream() -> None:
        body = {"messages": LONG, "max_tokens": 150, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{live_server.base_url}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.monotonic())

    reader = threading.Thread(target=stream)
    reader.start()
    wait_until(lambda: len(times) >= 15)
    window_start = time.monotonic()
    for size, what in ((3_900_000, "bytes"), (200_000, "tokens")):
        r = httpx.post(f"{live_server.base_url}/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "word " * (size // 5)}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert what in r.json()["error"]["message"]
    window_end = time.monotonic()
    reader.join()
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    during = [b - a for a, b in zip(times, times[1:], strict=False) if b > window_start and a < window_end]
    step = statistics.median(gaps)
    # "A step or two", with room for a loaded 2-core machine (a 0.37 s gap was seen with
    # other test processes running beside it): still far under the old 1.86 s.
    assert max(during) <= 4 * step + 0.5, (max(during), step)
