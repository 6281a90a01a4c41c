"""``/tokenize`` and ``/detokenize`` in llama.cpp's and vLLM's conventions, on the app in
process around the tiny engine (byte tokens); and what the API key guards on the new
routes (Anthropic's ``x-api-key`` included), and the shutdown cancel of a message."""

from __future__ import annotations

import asyncio

import pytest

from bargein.server.app import begin_shutdown
from tests.server.test_server_inprocess import tiny_app

ASK = [{"role": "user", "content": "hi"}]


@pytest.mark.anyio
async def test_both_conventions():
    async with tiny_app() as client:
        r = (await client.post("/tokenize", json={"content": "héllo"})).json()
        assert r == {"tokens": list("héllo".encode())}
        r = (await client.post("/tokenize", json={"content": "ab", "with_pieces": True})).json()
        assert r == {"tokens": [{"id": 97, "piece": "a"}, {"id": 98, "piece": "b"}]}
        r = (await client.post("/v1/tokenize", json={"prompt": "abc"})).json()
        assert r == {"tokens": [97, 98, 99], "count": 3, "max_model_len": 512}
        r = (await client.post("/detokenize", json={"tokens": list("héllo".encode())})).json()
        assert r == {"content": "héllo", "prompt": "héllo"}
        for body in ({}, {"content": "a", "prompt": "b"}, {"content": 3}):
            assert (await client.post("/tokenize", json=body)).status_code == 400, body
        r = await client.post("/detokenize", json={"tokens": [999]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


@pytest.mark.anyio
async def test_messages_are_tokenized_as_a_chat_request_sends_them():
    async with tiny_app() as client:
        chat = {"messages": ASK, "max_tokens": 5, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
        first = (await client.post("/v1/chat/completions", json=chat)).json()["choices"][0]
        r = (await client.post("/tokenize", json={"messages": ASK})).json()
        assert r["tokens"] == first["prompt_token_ids"] and r["count"] == len(first["prompt_token_ids"])
        # A history that repeats the answer shows its exact ids (the prompt memory), whatever
        # its text re-tokenizes to: the same ids the next chat request is computed from.
        history = [*ASK, {"role": "assistant", "content": first["message"]["content"]},
                   {"role": "user", "content": "more"}]
        r = (await client.post("/tokenize", json={"messages": history})).json()
        nxt = (await client.post("/v1/chat/completions", json={**chat, "messages": history})).json()["choices"][0]
        assert r["tokens"] == nxt["prompt_token_ids"]
        assert r["tokens"][:len(first["prompt_token_ids"]) + 5] == first["prompt_token_ids"] + first["token_ids"]


@pytest.mark.anyio
async def test_the_api_key_guards_the_new_routes():
    async with tiny_app(api_key="k") as client:
        for method, path, body in (("POST", "/tokenize", {"content": "a"}), ("POST", "/detokenize", {"tokens": [97]}),
                                   ("GET", "/api/tags", None), ("GET", "/api/version", None),
                                   ("POST", "/api/chat", {"messages": ASK, "stream": False, "options": {"num_predict": 1}}),
                                   ("POST", "/v1/messages/count_tokens", {"messages": ASK})):
            r = await client.request(method, path, json=body)
            assert r.status_code == 401, path
            for headers in ({"Authorization": "Bearer k"}, {"x-api-key": "k"}):
                r = await client.request(method, path, json=body, headers=headers)
                assert r.status_code == 200, (path, headers, r.text)


@pytest.mark.anyio
async def test_a_message_stopped_by_the_shutdown_says_so():
    async with tiny_app() as client:
        ctx = client._transport.app.state.ctx
        body = {"model": "tiny", "max_tokens": 400, "messages": ASK, "temperature": 0}
        answer = asyncio.ensure_future(client.post("/v1/messages", json=body, headers={"X-Request-Id": "msg_down"}))
        while "msg_down" not in ctx.registry:
            await asyncio.sleep(0.005)
        begin_shutdown(ctx)
        r = (await answer).json()
        assert (r["stop_reason"], r["cancel_reason"]) == ("cancelled", "shutdown")
        assert r["usage"]["output_tokens"] < 400
