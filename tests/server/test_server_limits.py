"""Limits and operations on a strict server: API key, body size, queue, server deadline, shutdown
(the deadline measured on the session's guarded server, whose is 3 s).

One server for the module (``--max-num-seqs 1`` so a second request queues behind the
first, ``--max-queue 2`` so a third is refused), shut down by the last test, which
checks that SIGTERM answers in-flight streams with ``finish_reason: "cancelled"``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from tests.conftest import GUARDED_ARGS, listed_requests, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("check_kv")]
MODEL = "SmolLM2-135M-Instruct"
KEY = "test-secret"
SERVER_TIMEOUT_S = 8.0
GUARDED_TIMEOUT_S = float(GUARDED_ARGS[GUARDED_ARGS.index("--request-timeout") + 1])
STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]
ENDLESS = {"ignore_eos": True, "max_tokens": 2000}
ARGS = ("--max-num-seqs", "1", "--max-queue", "2", "--request-timeout", str(SERVER_TIMEOUT_S),
        "--max-body", "64KiB")


@pytest.fixture(scope="module")
def strict(server_factory):
    return server_factory.get(ARGS, api_key=KEY)


@pytest.fixture
async def aclient(strict):
    async with openai.AsyncOpenAI(base_url=f"{strict.base_url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=server.headers, **kwargs)


def test_api_key_protects_everything_but_health(strict):
    base = strict.base_url
    assert httpx.get(f"{base}/health").status_code == 200
    for method, path in [("GET", "/v1/models"), ("GET", "/v1/requests"), ("GET", "/metrics"),
                         ("POST", "/v1/chat/completions"), ("POST", "/v1/requests/x/cancel"),
                         ("GET", "/v1/responses/x"), ("GET", "/debug/kv"), ("GET", "/openapi.json"),
                         ("GET", "/docs")]:
        r = httpx.request(method, base + path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "authentication_error"
        assert httpx.request(method, base + path).status_code == 401
    assert httpx.get(f"{base}/v1/models", headers=strict.headers).status_code == 200
    assert httpx.get(f"{base}/openapi.json", headers=strict.headers).status_code == 200
    assert httpx.get(f"{base}/").status_code == 200  # the chat page loads, then asks for the key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    assert good.chat.completions.create(model=MODEL, messages=STORY, max_tokens=2).choices[0].message.content


def test_body_over_the_limit_is_413(strict):
    big = {"messages": [{"role": "user", "content": "x" * 100_000}], "max_tokens": 1}
    r = post(strict, "/v1/chat/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    client = openai.OpenAI(base_url=f"{strict.base_url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=big["messages"], max_tokens=1)
    assert info.value.status_code == 413


@pytest.mark.anyio
async def test_queue_full_429_and_cancel_or_disconnect_while_queued(aclient, strict):
    async def long_stream(rid: str) -> str | None:
        stream = await aclient.chat.completions.create(model=MODEL, messages=STORY, stream=True,
                                                       extra_headers={"X-Request-Id": rid}, extra_body=ENDLESS)
        finish = None
        async for chunk in stream:
            finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
        return finish

    running = asyncio.ensure_future(long_stream("q-running"))
    await asyncio.to_thread(wait_until, lambda: listed_requests(strict).get("q-running", {}).get("status") == "running")
    queued = asyncio.ensure_future(aclient.chat.completions.create(
        model=MODEL, messages=STORY, extra_headers={"X-Request-Id": "q-queued"}, extra_body=ENDLESS))
    await asyncio.to_thread(wait_until, lambda: listed_requests(strict).get("q-queued", {}).get("status") == "queued")

    with pytest.raises(openai.RateLimitError) as info:  # two in flight: the third is refused
        await aclient.chat.completions.create(model=MODEL, messages=STORY, max_tokens=1)
    assert info.value.body["code"] == "queue_full"

    cancelled_at = time.monotonic()
    assert post(strict, "/v1/requests/q-queued/cancel", {}).json()["status"] == "cancelled"
    completion = await asyncio.wait_for(queued, 30)
    assert time.monotonic() - cancelled_at < 30
    assert completion.choices[0].finish_reason == "cancelled" and completion.usage.completion_tokens == 0

    # A queued non-streaming request whose client hangs up leaves without computing anything.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{strict.base_url}/v1/chat/completions", headers={**strict.headers, "X-Request-Id": "q-gone"},
                   json={"messages": STORY, **ENDLESS}, timeout=httpx.Timeout(30, read=1.5))
    await asyncio.to_thread(wait_until, lambda: "q-gone" not in listed_requests(strict), 30)
    assert listed_requests(strict)["q-running"]["status"] == "running"

    assert post(strict, "/v1/requests/q-running/cancel", {}).json()["status"] == "cancelled"
    assert await asyncio.wait_for(running, 30) == "cancelled"


def test_server_request_timeout_is_a_deadline(guarded_server):
    """On the session's guarded server (``--request-timeout 3``, tests/conftest.py): the
    strict server's 8 s, which keeps the queue test's stream alive under load, would be an
    8 s wait here."""
    client = openai.OpenAI(base_url=f"{guarded_server.base_url}/v1", api_key=guarded_server.api_key,
                           max_retries=0, timeout=120)
    started = time.monotonic()
    completion = client.chat.completions.create(model=MODEL, messages=STORY, extra_body=ENDLESS)
    took = time.monotonic() - started
    [choice] = completion.choices
    assert choice.finish_reason == "cancelled" and choice.model_extra["cancel_reason"] == "deadline"
    assert GUARDED_TIMEOUT_S - 0.5 <= took < GUARDED_TIMEOUT_S + 30
    assert completion.usage.completion_tokens > 0 and choice.message.content


def test_graceful_shutdown_answers_in_flight_streams(strict):
    """Last in this module: SIGTERM cancels the stream with reason shutdown, then the server exits 0."""
    payload = {"messages": STORY, "stream": True, "stream_options": {"include_usage": True}, **ENDLESS}
    events = []
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{strict.base_url}/v1/chat/completions",
                                                        json=payload, headers=strict.headers) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 4:
                strict.proc.send_signal(signal.SIGTERM)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    final = next(c for c in reversed(chunks) if c["choices"])["choices"][0]
    assert final["finish_reason"] == "cancelled" and final["cancel_reason"] == "shutdown"
    assert chunks[-1]["usage"]["completion_tokens"] >= 3
    assert strict.proc.wait(30) == 0
    assert "cancelled (shutdown)" in strict.log()


def test_a_mixed_prefill_cap_below_one_is_a_usage_error(capsys):
    """``--max-mixed-prefill-tokens`` must be positive: one error line, status 2, before any
    model loads. In this process (``python -m bargein.cli`` calls the same ``main``): a
    subprocess costs seconds of imports."""
    import torch

    from bargein.cli import main

    capsys.readouterr()
    threads = torch.get_num_threads()  # serve sets them as it starts: this process's tests keep theirs
    try:
        status = main(["serve", "--port", "0", "--max-mixed-prefill-tokens", "0"])
    finally:
        torch.set_num_threads(threads)
    stderr = capsys.readouterr().err
    assert status == 2 and "Traceback" not in stderr, stderr
    assert "max_mixed_prefill_tokens must be positive" in stderr
