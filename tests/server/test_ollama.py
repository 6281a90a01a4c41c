"""Ollama's API through the official ``ollama`` client, on a real server with the bundled
model: chat and generate, streamed and not (the raw NDJSON checked line by line), the
model lists, ``format`` as a JSON schema, tool calls, a dropped connection that cancels,
``context`` continuation, errors in Ollama's shape and the API key."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest

from tests.conftest import GUARDED_ARGS, GUARDED_KEY, listed_requests, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("check_kv")]

ASK = [{"role": "user", "content": "Tell me about the moon."}]
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory.get()


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=120)


def ndjson(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in r.iter_lines() if line]


def test_the_model_lists(client, server):
    [listed] = client.list().models
    assert listed.model and listed.details.format == "gguf"
    [loaded] = client.ps().models
    assert loaded.model == listed.model and loaded.digest == listed.digest
    shown = client.show(listed.model)
    assert "completion" in shown.capabilities and shown.modelinfo["llama.context_length"] > 0
    assert "<|im_start|>" in shown.template
    version = httpx.get(f"{server.base_url}/api/version", timeout=10).json()
    assert version["version"].count(".") == 2


def test_chat_streamed_and_not_agree_line_by_line(client, server):
    whole = client.chat(model="m", messages=ASK, options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 8
    assert whole.message.role == "assistant" and whole.message.content
    parts = list(client.chat(model="m", messages=ASK, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    lines = ndjson(server, "/api/chat", {"model": "m", "messages": ASK, "options": GREEDY})
    assert all(set(line) == {"model", "created_at", "message", "done"} and line["done"] is False for line in lines[:-1])
    assert all(line["message"]["role"] == "assistant" and line["message"]["content"] for line in lines[:-1])
    last = lines[-1]
    assert last["done"] is True and last["done_reason"] == "length" and last["message"]["content"] == ""
    assert last["eval_count"] == 8 and last["prompt_eval_count"] >= 0 and last["total_duration"] > 0
    assert "".join(line["message"]["content"] for line in lines) == whole.message.content


def test_generate_and_its_context_continue_exactly(client, server):
    first = client.generate(model="m", prompt="Tell me about the moon.", options=GREEDY)
    assert first.done_reason == "length" and first.response
    streamed = list(client.generate(model="m", prompt="Tell me about the moon.", options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == first.response
    assert streamed[-1].context == first.context
    # The context is the prompt and the answer's exact tokens: sent back, they are all reused.
    nxt = client.generate(model="m", prompt="Go on.", context=first.context, options={**GREEDY, "num_predict": 2})
    assert nxt.context[:len(first.context)] == first.context
    assert nxt.prompt_eval_count <= len(nxt.context) - len(first.context) - 2 + 1
    raw = client.generate(model="m", prompt="The moon is", raw=True, options={**GREEDY, "num_predict": 3})
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "The moon is"}, timeout=30).json()["tokens"]
    assert raw.context[:len(tokens)] == tokens


def test_format_as_a_schema_and_a_tool_call(client):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat(model="m", messages=[{"role": "user", "content": "Describe a person as JSON."}],
                    format=person, options={"temperature": 0, "num_predict": 40})
    jsonschema.validate(json.loads(r.message.content), person)
    tools = [{"type": "function", "function": {"name": "get_time", "description": "The time",
                                               "parameters": {"type": "object", "properties": {}}}}]
    ask = [{"role": "user", "content": "What time is it? Call get_time."}]
    r = client.chat(model="m", messages=ask, tools=tools, options={"temperature": 0, "num_predict": 30})
    for call in r.message.tool_calls or ():  # the model may answer in text; a call it makes is parsed whole
        assert call.function.name == "get_time" and isinstance(call.function.arguments, dict)


def test_a_dropped_connection_cancels(server):
    body = {"model": "m", "messages": ASK, "options": {"temperature": 0, "num_predict": 2000}}
    with httpx.stream("POST", f"{server.base_url}/api/chat", json=body, timeout=60,
                      headers={"X-Request-Id": "ollama-drop"}) as r:
        lines = r.iter_lines()
        assert not json.loads(next(lines))["done"]
        assert "ollama-drop" in listed_requests(server)
    wait_until(lambda: "ollama-drop" not in listed_requests(server), timeout=30)
    r = httpx.post(f"{server.base_url}/v1/requests/ollama-drop/cancel", timeout=10)
    assert r.json()["status"] == "already_finished"


def test_errors_are_in_ollama_shape(client, server):
    for body, word in (({"messages": [{"role": "robot", "content": "x"}]}, "role"),
                       ({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "images"),
                       ({"messages": ASK, "format": "xml"}, "format"),
                       ({"messages": ASK, "options": {"temperature": -1}}, "temperature")):
        r = httpx.post(f"{server.base_url}/api/chat", json=body, timeout=30)
        assert r.status_code == 400 and set(r.json()) == {"error"} and word in r.json()["error"], body
    r = httpx.post(f"{server.base_url}/api/generate", json={"prompt": "x", "suffix": "y"}, timeout=30)
    assert r.status_code == 400 and "suffix" in r.json()["error"]
    loaded = httpx.post(f"{server.base_url}/api/generate", json={"model": "m"}, timeout=30).json()
    assert loaded["done"] is True and loaded["done_reason"] == "load"
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="m", messages=[{"role": "robot", "content": "x"}])
    assert info.value.status_code == 400


def test_the_api_key_guards_the_routes(server_factory):
    guarded = server_factory.get(GUARDED_ARGS, api_key=GUARDED_KEY)
    good = ollama.Client(host=guarded.base_url, headers={"Authorization": f"Bearer {GUARDED_KEY}"})
    assert good.list().models
    for path in ("/api/tags", "/api/ps", "/api/version"):
        assert httpx.get(f"{guarded.base_url}{path}", timeout=10).status_code == 401
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=guarded.base_url).chat(model="m", messages=ASK)
    assert info.value.status_code == 401  # the header the ollama client's users set (as for Ollama's cloud)
    assert info.value.error == "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
