"""The OpenAI API surface against a real server, through the official ``openai`` client.

Sync and async clients for every endpoint the client covers (models, chat completions,
completions, responses), raw HTTP for the rest (health, metrics, the web UI, errors).
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("check_kv")]
MODEL = "SmolLM2-135M-Instruct"
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
async def aclient(live_server):
    async with openai.AsyncOpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0,
                                  timeout=120) as client:
        yield client


def test_models(client):
    [model] = client.models.list().data
    assert model.id == MODEL and model.object == "model"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_completion_has_id_usage_and_header(client):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    completion = raw.parse()
    assert raw.headers["x-request-id"] == completion.id
    assert completion.object == "chat.completion"
    [choice] = completion.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_client_chosen_id_and_max_completion_tokens(client):
    completion = client.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=3, temperature=0,
                                                extra_headers={"X-Request-Id": "my-chosen-id.1"})
    assert completion.id == "my-chosen-id.1"
    assert completion.usage.completion_tokens <= 3


def test_chat_greedy_is_deterministic_and_stop_works(client):
    first = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    assert first.choices[0].message.content == again.choices[0].message.content
    text = first.choices[0].message.content
    word = text.split()[1] if len(text.split()) > 1 else text.split()[0]
    stopped = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0, stop=[word])
    assert word not in stopped.choices[0].message.content
    assert stopped.choices[0].finish_reason == "stop"


def test_chat_n_seed_logprobs_and_penalties(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=4, n=2, seed=7, temperature=1.0, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"28120": -5}, logprobs=True, top_logprobs=2,
        user="tester", extra_body={"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1})
    assert sorted(c.index for c in completion.choices) == [0, 1]
    for choice in completion.choices:
        entries = choice.logprobs.content
        assert entries and len(entries[0].top_logprobs) == 2
        assert all(e.logprob <= 0 for e in entries)
    again = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=4, n=2, seed=7, temperature=1.0, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"28120": -5},
        extra_body={"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1})
    assert [c.message.content for c in again.choices] == [c.message.content for c in completion.choices]


@pytest.mark.anyio
async def test_chat_stream_async_with_usage(aclient):
    stream = await aclient.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    pieces, finish, usage, ids = [], None, None, set()
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert len(ids) == 1 and "".join(pieces)
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens <= 6


def test_chat_stream_sync(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_completions_sync_batch_and_logprobs(client):
    completion = client.completions.create(model=MODEL, prompt=["The capital of France is", "One, two,"],
                                           max_tokens=4, temperature=0, logprobs=2)
    assert completion.object == "text_completion"
    assert sorted(c.index for c in completion.choices) == [0, 1]
    for choice in completion.choices:
        assert choice.text and len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs)
        assert choice.logprobs.text_offset[0] == 0
    assert completion.usage.completion_tokens <= 8


@pytest.mark.anyio
async def test_completions_async_stream_and_token_prompt(aclient, live_server):
    ids = httpx.post(f"{live_server.base_url}/v1/completions",
                     json={"prompt": "Paris is", "max_tokens": 1, "temperature": 0}).json()
    assert ids["choices"][0]["text"]
    stream = await aclient.completions.create(model=MODEL, prompt=[28120, 28], max_tokens=5, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    texts, usage = [], None
    async for chunk in stream:
        usage = chunk.usage or usage
        texts += [c.text for c in chunk.choices]
    assert "".join(texts) and usage.prompt_tokens == 2


@pytest.mark.anyio
async def test_concurrent_requests_do_not_disturb_each_other(aclient):
    good = [aclient.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0) for _ in range(4)]
    bad = [aclient.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=9) for _ in range(2)]
    results = await asyncio.gather(*good, *bad, return_exceptions=True)
    texts = {r.choices[0].message.content for r in results[:4]}
    assert len(texts) == 1  # greedy: the same answer whatever it was batched with
    assert all(isinstance(r, openai.BadRequestError) for r in results[4:])


def test_responses_sync_create_get_delete(client):
    response = client.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.",
                                       max_output_tokens=6, temperature=0)
    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert response.output_text
    assert response.usage.input_tokens > 0 and response.usage.output_tokens <= 6
    fetched = client.responses.retrieve(response.id)
    assert fetched.output_text == response.output_text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


@pytest.mark.anyio
async def test_responses_async_stream(aclient):
    stream = await aclient.responses.create(model=MODEL, input=[{"role": "user", "content": "Say hello."}],
                                            max_output_tokens=5, temperature=0, stream=True)
    kinds, deltas, final = [], [], None
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert final.output_text == "".join(deltas)


def test_responses_store_false_is_not_retrievable(client):
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="Hi", background=True, store=False)


@pytest.mark.parametrize(("body", "param"), [
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 5}, "presence_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"top_k": 0}, "top_k"),
    ({"timeout": -1}, "timeout"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
    ({"temperature": "hot"}, "temperature"),
])
def test_invalid_chat_field_is_400_naming_it(live_server, body, param):
    payload = {"messages": HELLO, "max_tokens": 2, **body}
    r = httpx.post(f"{live_server.base_url}/v1/chat/completions", json=payload, timeout=30,
                   headers={"X-Request-Id": "my-bad-request"})
    assert r.status_code == 400, r.text
    assert r.headers["X-Request-Id"] == "my-bad-request"  # errors carry the request's id too
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_invalid_json_and_bad_request_id(live_server):
    r = httpx.post(f"{live_server.base_url}/v1/chat/completions", content=b"{nope",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(f"{live_server.base_url}/v1/chat/completions", json={"messages": HELLO},
                   headers={"X-Request-Id": "bad id with spaces"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
    assert "X-Request-Id" not in r.headers  # an invalid id is never echoed


def test_prompt_longer_than_context_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[28120] * 9000, max_tokens=1)
    error = info.value.body
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "9000 tokens" in error["message"]


def test_not_found_shapes(live_server):
    base = live_server.base_url
    for method, path in [("GET", "/v1/nothing"), ("POST", "/v1/requests/nope/cancel"), ("GET", "/v1/responses/nope"),
                         ("POST", "/v1/responses/nope/cancel"), ("DELETE", "/v1/responses/nope")]:
        r = httpx.request(method, base + path)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(f"{base}/v1/chat/cancel", json={"request_id": "nope"})
    assert r.status_code == 404


def test_responses_unknown_previous_id_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope")
    assert info.value.body["param"] == "previous_response_id"


def test_health_metrics_and_ui(live_server, client):
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    base = live_server.base_url
    assert httpx.get(f"{base}/health").json()["status"] == "ok"
    text = httpx.get(f"{base}/metrics").text
    for name in ["bargein_time_to_first_token_seconds_bucket", "bargein_inter_token_latency_seconds_count",
                 "bargein_cancel_latency_seconds", "bargein_requests_finished_total", "bargein_requests_cancelled_total",
                 "bargein_generation_tokens_total", "bargein_generation_tokens_per_second", 'bargein_kv_blocks{state="used"}',
                 'bargein_kv_blocks{state="cached"}', "bargein_prefix_cache_hit_tokens_total",
                 "bargein_requests_waiting", "bargein_requests_running"]:
        assert name in text, name
    page = httpx.get(f"{base}/")
    assert page.status_code == 200 and "<html" in page.text.lower()
    assert httpx.get(f"{base}/v1/requests").json() == {"object": "list", "data": []}
