"""Stopping requests on a real server: by id, by disconnect, by deadline, all at once.

Every way ends in the same engine abort, takes effect at the next step boundary, and
leaves the conversation consistent: the partial answer is returned with
``finish_reason: "cancelled"`` and usage, nothing stays listed in ``GET /v1/requests``,
the KV accounting holds (``check_kv``), and the next turn reuses the cached prefix.
"""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx
import openai
import pytest

from tests.conftest import listed_requests, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("check_kv")]
MODEL = "SmolLM2-135M-Instruct"
STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]
ENDLESS = {"ignore_eos": True}  # with a large max_tokens: runs until cancelled
PROMPT_CANCEL_BOUND_S = 30.0  # wide: one step on a busy shared CPU, plus HTTP


@pytest.fixture
async def aclient(live_server):
    async with openai.AsyncOpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0,
                                  timeout=120) as client:
        yield client


@pytest.fixture
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def cancel(server, request_id: str) -> dict:
    r = httpx.post(f"{server.base_url}/v1/requests/{request_id}/cancel", headers=server.headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def cancelled_total(server, reason: str) -> int:
    text = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=10).text
    match = re.search(rf'bargein_requests_cancelled_total{{cancel_reason="{reason}"}} (\d+)', text)
    return int(match.group(1)) if match else 0


def running_with(server, request_id: str, min_tokens: int = 0):
    entry = listed_requests(server).get(request_id)
    return entry if entry and entry["status"] == "running" and entry["completion_tokens"] >= min_tokens else None


@pytest.mark.anyio
async def test_cancel_stream_by_id_during_decode(aclient, live_server):
    rid = "cancel-during-decode"
    stream = await aclient.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=2000, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Request-Id": rid}, extra_body=ENDLESS)
    text, finish, usage, cancelled_at, choice_extra = [], None, None, None, {}
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            if choice.finish_reason:
                finish, choice_extra = choice.finish_reason, choice.model_extra
        if cancelled_at is None and sum(1 for t in text if t) >= 3:
            assert (await asyncio.to_thread(cancel, live_server, rid))["status"] == "cancelled"
            cancelled_at = time.monotonic()
    assert cancelled_at is not None and time.monotonic() - cancelled_at < PROMPT_CANCEL_BOUND_S
    assert finish == "cancelled" and choice_extra.get("cancel_reason") == "user"
    assert usage is not None and 3 <= usage.completion_tokens < 2000
    assert "".join(text)
    assert cancel(live_server, rid)["status"] == "already_finished"  # idempotent
    assert rid not in listed_requests(live_server)


@pytest.mark.anyio
async def test_cancel_non_streaming_by_body_returns_partial_text(aclient, live_server):
    rid = "cancel-non-streaming"
    task = asyncio.ensure_future(aclient.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=2000, temperature=0, extra_headers={"X-Request-Id": rid},
        extra_body=ENDLESS))
    await asyncio.to_thread(wait_until, lambda: running_with(live_server, rid, min_tokens=3), 60)
    r = httpx.post(f"{live_server.base_url}/v1/chat/cancel", json={"request_id": rid})
    assert r.json() == {"id": rid, "object": "request.cancel", "status": "cancelled"}
    completion = await asyncio.wait_for(task, PROMPT_CANCEL_BOUND_S)
    [choice] = completion.choices
    assert choice.finish_reason == "cancelled" and choice.message.content
    assert 3 <= completion.usage.completion_tokens < 2000


@pytest.mark.anyio
async def test_cancel_during_prefill_of_a_long_prompt(aclient, live_server):
    rid = "cancel-during-prefill"
    prompt = [random.Random(4).randrange(200, 40000) for _ in range(3000)]  # ~6 steps of 512 tokens
    task = asyncio.ensure_future(aclient.completions.create(
        model=MODEL, prompt=prompt, max_tokens=50, temperature=0, extra_headers={"X-Request-Id": rid}))
    await asyncio.to_thread(wait_until, lambda: running_with(live_server, rid), 60, 0.005)
    cancelled_at = time.monotonic()
    assert cancel(live_server, rid)["status"] == "cancelled"
    completion = await asyncio.wait_for(task, PROMPT_CANCEL_BOUND_S)
    took = time.monotonic() - cancelled_at
    assert completion.choices[0].finish_reason == "cancelled"
    assert completion.usage.completion_tokens == 0, "cancelled mid-prompt: nothing generated"
    assert completion.usage.prompt_tokens == 3000
    assert took < PROMPT_CANCEL_BOUND_S


def test_streaming_disconnect_cancels_within_a_step(live_server):
    rid = "disconnect-streaming"
    before = cancelled_total(live_server, "disconnect")
    payload = {"messages": STORY, "max_tokens": 2000, "stream": True, "temperature": 0, **ENDLESS}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{live_server.base_url}/v1/chat/completions",
                                                        json=payload, headers={"X-Request-Id": rid}) as r:
        pieces = 0
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                pieces += 1
            if pieces >= 3:
                break
    closed_at = time.monotonic()
    wait_until(lambda: rid not in listed_requests(live_server), timeout=PROMPT_CANCEL_BOUND_S)
    assert time.monotonic() - closed_at < PROMPT_CANCEL_BOUND_S
    wait_until(lambda: cancelled_total(live_server, "disconnect") == before + 1, timeout=10)


def test_non_streaming_disconnect_before_the_answer(live_server):
    rid = "disconnect-non-streaming"
    before = cancelled_total(live_server, "disconnect")
    payload = {"messages": STORY, "max_tokens": 2000, "temperature": 0, **ENDLESS}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live_server.base_url}/v1/chat/completions", json=payload, headers={"X-Request-Id": rid},
                   timeout=httpx.Timeout(60, read=2.0))
    wait_until(lambda: rid not in listed_requests(live_server), timeout=PROMPT_CANCEL_BOUND_S)
    wait_until(lambda: cancelled_total(live_server, "disconnect") == before + 1, timeout=10)


@pytest.mark.anyio
async def test_cancel_all(aclient, live_server):
    ids = [f"cancel-all-{i}" for i in range(3)]

    async def one(rid: str) -> str | None:
        stream = await aclient.chat.completions.create(model=MODEL, messages=STORY, max_tokens=2000, stream=True,
                                                       extra_headers={"X-Request-Id": rid}, extra_body=ENDLESS)
        finish = None
        async for chunk in stream:
            finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
        return finish

    tasks = [asyncio.ensure_future(one(rid)) for rid in ids]
    await asyncio.to_thread(wait_until, lambda: all(running_with(live_server, rid, 1) for rid in ids), 60)
    r = httpx.post(f"{live_server.base_url}/v1/requests/cancel", json={"all": True})
    assert sorted(r.json()["cancelled"]) == ids
    assert await asyncio.wait_for(asyncio.gather(*tasks), PROMPT_CANCEL_BOUND_S) == ["cancelled"] * 3
    r = httpx.post(f"{live_server.base_url}/v1/requests/cancel", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "all"


def test_cancel_after_finish_says_already_finished(client, live_server):
    rid = "finished-before-cancel"
    client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=2, extra_headers={"X-Request-Id": rid})
    assert cancel(live_server, rid) == {"id": rid, "object": "request.cancel", "status": "already_finished"}


@pytest.mark.anyio
async def test_per_request_deadline(aclient, live_server):
    rid = "deadline-per-request"
    task = asyncio.ensure_future(aclient.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=2000, extra_headers={"X-Request-Id": rid},
        extra_body={**ENDLESS, "timeout": 3.0}))
    entry = await asyncio.to_thread(wait_until, lambda: listed_requests(live_server).get(rid), 30, 0.01)
    assert entry["deadline_s"] is not None and 0 <= entry["deadline_s"] <= 3.0
    completion = await asyncio.wait_for(task, 60)
    [choice] = completion.choices
    assert choice.finish_reason == "cancelled" and choice.model_extra["cancel_reason"] == "deadline"


@pytest.mark.anyio
async def test_chat_continuation_after_cancel_reuses_the_prompt(aclient, live_server):
    rid = "continue-after-cancel"
    stream = await aclient.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=2000, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Request-Id": rid}, extra_body=ENDLESS)
    partial, usage, sent = [], None, False
    async for chunk in stream:
        usage = chunk.usage or usage
        partial += [c.delta.content or "" for c in chunk.choices]
        if not sent and sum(1 for p in partial if p) >= 20:
            await asyncio.to_thread(cancel, live_server, rid)
            sent = True
    history = [*STORY, {"role": "assistant", "content": "".join(partial)}, {"role": "user", "content": "Go on."}]
    follow = await aclient.chat.completions.create(model=MODEL, messages=history, max_tokens=2, temperature=0)
    cached = follow.usage.prompt_tokens_details.cached_tokens
    assert cached >= usage.prompt_tokens // 16 * 16, (cached, usage)


def test_responses_continuation_after_cancel_reuses_the_partial_answer(client, live_server):
    first = client.responses.create(model=MODEL, input=STORY[0]["content"], max_output_tokens=2000, temperature=0,
                                    background=True, extra_body=ENDLESS)
    assert first.status in ("queued", "in_progress") and first.background
    wait_until(lambda: running_with(live_server, first.id, min_tokens=24), 60)
    stopped = client.responses.cancel(first.id)
    assert stopped.status == "cancelled" and stopped.model_extra["cancel_reason"] == "user"
    assert stopped.output_text and stopped.usage.output_tokens >= 24
    assert client.responses.retrieve(first.id).status == "cancelled"
    assert client.responses.cancel(first.id).status == "cancelled"  # idempotent
    prev_in, prev_out = stopped.usage.input_tokens, stopped.usage.output_tokens
    second = client.responses.create(model=MODEL, input="Go on.", previous_response_id=first.id,
                                     max_output_tokens=2, temperature=0)
    cached = second.usage.input_tokens_details.cached_tokens
    # Token-exact: every full block of the previous prompt and partial answer is reused
    # (the last delivered token's K/V is computed with the new turn, contract C3).
    assert cached >= (prev_in + prev_out - 1) // 16 * 16
    assert cached > prev_in, "the partial answer itself was reused"
    assert second.usage.input_tokens > prev_in + prev_out
    assert second.previous_response_id == first.id


@pytest.mark.anyio
async def test_responses_stream_cancelled_by_id(aclient, live_server):
    stream = await aclient.responses.create(model=MODEL, input=STORY[0]["content"], max_output_tokens=2000,
                                            stream=True, extra_body=ENDLESS)
    deltas, final, response_id = 0, None, None
    async for event in stream:
        if event.type == "response.created":
            response_id = event.response.id
        if event.type == "response.output_text.delta":
            deltas += 1
            if deltas == 3:
                await asyncio.to_thread(cancel, live_server, response_id)
        if event.type in ("response.completed", "response.incomplete", "response.failed"):
            final = event
    assert final.type == "response.incomplete" and final.response.status == "cancelled"
    assert final.response.output_text


def test_background_response_polls_to_completion(client):
    first = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=4, background=True)
    done = wait_until(lambda: (r := client.responses.retrieve(first.id)).status not in ("queued", "in_progress") and r, 60)
    assert done.status in ("completed", "incomplete") and done.output_text
