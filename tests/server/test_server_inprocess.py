"""The app in process around a tiny random-weight engine (fast; no model to load).

The tiny tokenizer is bytes; here it also gets a minimal chat template, so chat and
responses requests run too. Non-streamed answers only (httpx's ASGI transport collects
a body before returning it); streams are tested against real servers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from bargein.server.settings import ServerSettings, SettingsError
from tests.server.inprocess_app import inprocess_app
from tests.tiny_engine import ByteTokenizer, tiny_engine


class ChatByteTokenizer(ByteTokenizer):
    """Byte tokens with a chat template: ``<role>content\\n`` per message."""

    def apply_chat_template(self, messages, *, add_generation_prompt=True, tools=None, **extra) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@asynccontextmanager
async def tiny_app(**settings) -> AsyncIterator[httpx.AsyncClient]:
    core = tiny_engine(num_blocks=128)
    core.tokenizer = ChatByteTokenizer()
    async with inprocess_app(core, **settings) as (_, client):
        yield client


IGNORE_EOS = {"ignore_eos": True, "temperature": 0}  # random weights: an EOS would end answers early


@pytest.mark.anyio
async def test_default_max_tokens_and_the_limit():
    async with tiny_app(default_max_tokens=4, max_tokens_limit=6) as client:
        chat = {"messages": [{"role": "user", "content": "hi"}], **IGNORE_EOS}
        r = (await client.post("/v1/chat/completions", json=chat)).json()
        assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (4, "length")
        r = (await client.post("/v1/chat/completions", json={**chat, "max_tokens": 6})).json()
        assert r["usage"]["completion_tokens"] == 6
        r = await client.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
        r = await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
        r = (await client.post("/v1/responses", json={"input": "hi", **IGNORE_EOS})).json()
        assert r["usage"]["output_tokens"] == 4
        r = (await client.post("/v1/completions", json={"prompt": [1, 2, 3], **IGNORE_EOS})).json()
        assert r["usage"]["completion_tokens"] == 6  # the endpoint's own default (16), capped by the limit


@pytest.mark.anyio
async def test_without_a_default_chat_runs_to_the_end_of_the_context():
    async with tiny_app() as client:
        r = (await client.post("/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "hi"}], **IGNORE_EOS})).json()
        usage = r["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 512  # TINY's max_position_embeddings
        r = (await client.post("/v1/completions", json={"prompt": [1, 2, 3], **IGNORE_EOS})).json()
        assert r["usage"]["completion_tokens"] == 16


def test_max_tokens_settings_are_checked():
    with pytest.raises(SettingsError, match="default max tokens"):
        ServerSettings(default_max_tokens=10, max_tokens_limit=5)
    with pytest.raises(SettingsError):
        ServerSettings(max_tokens_limit=0)
    assert ServerSettings.from_env({"BARGEIN_DEFAULT_MAX_TOKENS": "5", "BARGEIN_MAX_TOKENS_LIMIT": "9"}) == \
        ServerSettings(default_max_tokens=5, max_tokens_limit=9)


@pytest.mark.anyio
async def test_an_input_too_large_by_bytes_is_refused_before_tokenizing():
    async with tiny_app() as client:
        # the bound: TINY's context (512) times the longest token's bytes ("<256>": 5) = 2560
        calls = []
        app_tokenizer = client._transport.app.state.ctx.tokenizer
        real = app_tokenizer.encode
        app_tokenizer.encode = lambda text, **kw: calls.append(len(text)) or real(text, **kw)
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 5000}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert r.json()["error"]["param"] == "messages" and "bytes" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", json={"prompt": "y" * 5000})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert calls == [], "the tokenizer ran on an input refused by its size"
        r = await client.post("/v1/completions", json={"prompt": "y" * 600})  # fits by bytes, not by tokens
        assert r.status_code == 400 and "tokens" in r.json()["error"]["message"] and calls == [600]
