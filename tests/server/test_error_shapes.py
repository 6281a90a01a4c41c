"""Every refusal in each client's own error shape, through the official clients.

A real server on loopback around the tiny engine (``tiny_live_server``) with a key, a
Host list, a small body limit and a queue of one. Each refusal the middleware or a route
makes (401, 403, 413, 400, 429, 503, and a 500 for an unexpected failure) is sent by the official ``anthropic`` SDK (which
must raise its own typed error, with the message and Anthropic's error type), the
official ``ollama`` client (``ResponseError`` with the message and the status) and an
OpenAI-shaped request, so the shape follows the route family and nothing else.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import ollama
import pytest

import bargein.server.anthropic.routes as anthropic_routes
import bargein.server.ollama.routes as ollama_routes
from bargein.server.error_shapes import ErrorFamily, error_family
from tests.conftest import wait_until
from tests.server.tiny_live_server import tiny_live_server

KEY = "shape-secret"
ASK = [{"role": "user", "content": "hi"}]
BIG = "x" * 4096  # over the 2 KiB body limit


@pytest.fixture(scope="module")
def server():
    with tiny_live_server(api_key=KEY, allowed_hosts=("127.0.0.1",), max_body_bytes=2048, max_queue=1) as live:
        yield live


def claude(server, key: str = KEY, **headers: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0, timeout=30,
                               default_headers=headers or None)


def llama(server, key: str | None = KEY, **headers: str) -> ollama.Client:
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return ollama.Client(host=server.base_url, headers=headers, timeout=30)


def anthropic_error(exc_type: type[anthropic.APIStatusError], kind: str, words: str, call) -> None:
    with pytest.raises(exc_type) as info:
        call()
    assert info.value.type == kind, info.value.body
    assert words in (info.value.api_message or ""), info.value.body
    assert info.value.body["type"] == "error" and set(info.value.body["error"]) == {"type", "message"}


def ollama_error(status: int, words: str, call) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        call()
    assert info.value.status_code == status and words in info.value.error, info.value.error


def test_the_family_follows_the_path():
    assert error_family("/v1/messages") == error_family("/v1/messages/count_tokens") == ErrorFamily.ANTHROPIC
    assert error_family("/api/chat") == error_family("/api") == ErrorFamily.OLLAMA
    assert error_family("/api.js") == error_family("/v1/chat/completions") == ErrorFamily.OPENAI
    assert error_family("/v1/messagesx") == ErrorFamily.OPENAI


def test_a_missing_or_wrong_key(server):
    create = lambda c: c.messages.create(model="m", max_tokens=2, messages=ASK)  # noqa: E731
    anthropic_error(anthropic.AuthenticationError, "authentication_error", "invalid API key",
                    lambda: create(claude(server, key="wrong")))
    anthropic_error(anthropic.AuthenticationError, "authentication_error", "invalid API key",
                    lambda: claude(server, key="wrong").messages.count_tokens(model="m", messages=ASK))
    ollama_error(401, "missing API key", lambda: llama(server, key=None).chat(model="m", messages=ASK))
    ollama_error(401, "invalid API key", lambda: llama(server, key="wrong").list())
    r = httpx.get(f"{server.base_url}/v1/models", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"


def test_a_foreign_host(server):
    anthropic_error(anthropic.PermissionDeniedError, "permission_error", "does not answer to the host",
                    lambda: claude(server, Host="evil.example").messages.create(model="m", max_tokens=2,
                                                                                messages=ASK))
    ollama_error(403, "does not answer to the host", lambda: llama(server, Host="evil.example").list())


def test_a_body_over_the_limit(server):
    anthropic_error(anthropic.ContentTooLargeError, "request_too_large", "larger than 2048 bytes",
                    lambda: claude(server).messages.create(model="m", max_tokens=2,
                                                           messages=[{"role": "user", "content": BIG}]))
    ollama_error(413, "larger than 2048 bytes",
                 lambda: llama(server).chat(model="m", messages=[{"role": "user", "content": BIG}]))
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": BIG}]},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_body_that_is_not_json_or_not_valid(server):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for path, shape in (("/v1/messages", lambda b: b["type"] == "error" and b["error"]["type"] ==
                         "invalid_request_error"), ("/api/chat", lambda b: set(b) == {"error"}),
                        ("/v1/chat/completions", lambda b: b["error"]["type"] == "invalid_request_error")):
        r = httpx.post(server.base_url + path, content=b"{not json", headers=headers, timeout=30)
        assert r.status_code == 400 and shape(r.json()), (path, r.text)
        assert "not valid JSON" in json.dumps(r.json())
    anthropic_error(anthropic.BadRequestError, "invalid_request_error", "max_tokens",
                    lambda: claude(server).messages.create(model="m", max_tokens=0, messages=ASK))
    ollama_error(400, "role", lambda: llama(server).chat(model="m", messages=[{"role": "robot", "content": "x"}]))
    r = httpx.post(f"{server.base_url}/v1/nowhere", json={}, headers=headers, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(f"{server.base_url}/v1/messages", headers=headers, timeout=30)  # a route, the wrong method
    assert r.status_code == 405 and r.json()["type"] == "error" and "POST" in r.json()["error"]["message"]


def test_an_overloaded_queue_and_the_shutdown_drain(server):
    server.step_delay_s = 0.05  # the first request stays in flight while the others are refused
    try:
        with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                          json={"prompt": "a", "max_tokens": 400, "ignore_eos": True, "stream": True},
                          headers={"Authorization": f"Bearer {KEY}"}) as busy:
            lines = busy.iter_lines()  # held: a dropped iterator closes the stream (a disconnect)
            assert next(line for line in lines if line.startswith("data: {"))
            anthropic_error(anthropic.RateLimitError, "rate_limit_error", "requests in flight",
                            lambda: claude(server).messages.create(model="m", max_tokens=2, messages=ASK))
            ollama_error(429, "requests in flight", lambda: llama(server).generate(model="m", prompt="x"))
    finally:
        server.step_delay_s = 0.0
    wait_until(lambda: not len(server.ctx.registry))
    server.ctx.draining = True
    try:
        anthropic_error(anthropic.ServiceUnavailableError, "overloaded_error", "shutting down",
                        lambda: claude(server).messages.create(model="m", max_tokens=2, messages=ASK))
        ollama_error(503, "shutting down", lambda: llama(server).chat(model="m", messages=ASK))
        r = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert r.headers["retry-after"]
    finally:
        server.ctx.draining = False
    message = claude(server).messages.create(model="m", max_tokens=2, messages=ASK)  # served again
    assert message.usage.output_tokens >= 1


def test_an_unexpected_failure_is_a_500_in_each_shape(server, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("internal detail that must not leak")

    monkeypatch.setattr(anthropic_routes, "conversation", fail)
    monkeypatch.setattr(ollama_routes, "chat_messages", fail)
    anthropic_error(anthropic.InternalServerError, "api_error", "the error is logged",
                    lambda: claude(server).messages.create(model="m", max_tokens=2, messages=ASK))
    ollama_error(500, "the error is logged", lambda: llama(server).chat(model="m", messages=ASK))
    monkeypatch.undo()
    assert llama(server).chat(model="m", messages=ASK, options={"num_predict": 1}).done
