"""Messages API requests beyond the basics, and the schema checks of the Anthropic and
Ollama routes, through the official clients on a real server on loopback around the tiny
engine (``tiny_live_server``, byte tokens, template ``<role>content\\n``).

- a final assistant message is a prefill: the answer continues its text in the same
  turn, token for token what a raw completion of that text gives;
- image blocks are refused (400 ``invalid_request_error`` naming the block);
- ``thinking.budget_tokens`` is validated as Anthropic validates it;
- ``output_config.format`` and Ollama's ``format`` (and tools) go through the budgeted,
  off-loop check of the OpenAI routes: the same 400s for hostile schemas, and the check
  never runs on the server's event loop thread.
"""

from __future__ import annotations

import re
import threading

import anthropic
import httpx
import ollama
import pytest

import bargein.server.structured as structured
from tests.server.tiny_live_server import tiny_live_server

ASK = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0}


def _obj(**properties) -> dict:
    return {"type": "object", "properties": properties, "required": sorted(properties)}


HOSTILE = {  # quick to refuse: (schema, what the 400 says), as tests/server/test_structured_limits.py
    "recursive $ref": ({"$defs": {"n": _obj(c={"$ref": "#/$defs/n"})}, "$ref": "#/$defs/n"},
                       "recurses through required properties"),
    "5,000-way anyOf": (_obj(x={"anyOf": [{"const": i} for i in range(5000)]}), "more than 4,096 subschemas"),
    "integer bound 1e30": (_obj(x={"type": "integer", "minimum": 1e30}), "within +-2**53"),
}


@pytest.fixture(scope="module")
def server():
    with tiny_live_server() as live:
        yield live


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llama(server) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=60)


def test_a_prefill_is_continued_in_the_same_turn(claude, server):
    messages = [*ASK, {"role": "assistant", "content": "The"}]
    message = claude.messages.create(model="m", max_tokens=8, messages=messages, extra_body=GREEDY)
    prompt = "<user>hi\n<assistant>The"  # the turn is not closed: no "\n" after the prefill
    raw = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                     json={"prompt": prompt, "max_tokens": 8, **GREEDY}).json()
    [block] = message.content
    assert block.type == "text" and block.text == raw["choices"][0]["text"]
    assert message.usage.output_tokens == raw["usage"]["completion_tokens"]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(prompt.encode())
    assert claude.messages.count_tokens(model="m", messages=messages).input_tokens == len(prompt.encode())
    empty = claude.messages.create(model="m", max_tokens=1, messages=[*ASK, {"role": "assistant", "content": ""}],
                                   extra_body=GREEDY)  # an empty prefill: a new turn, as Anthropic reads it
    assert empty.usage.input_tokens + empty.usage.cache_read_input_tokens == len(b"<user>hi\n<assistant>")
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        claude.messages.create(model="m", max_tokens=2, messages=[*ASK, {"role": "assistant", "content": "The "}])


def test_an_image_block_is_refused_naming_it(claude):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model="m", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}])
    assert info.value.type == "invalid_request_error"
    assert "messages.0.content.1" in info.value.api_message and "'image'" in info.value.api_message


def test_the_thinking_budget_is_validated_as_anthropic_does(claude):
    for thinking, max_tokens, says in (({"type": "enabled"}, 2000, "budget_tokens"),
                                       ({"type": "enabled", "budget_tokens": 1023}, 2000, "greater than or equal to 1024"),
                                       ({"type": "enabled", "budget_tokens": 2000}, 2000, "`max_tokens` must be greater"),
                                       ({"type": "sometimes"}, 10, "thinking.type")):
        with pytest.raises(anthropic.BadRequestError, match=re.escape(says)):
            claude.messages.create(model="m", max_tokens=max_tokens, messages=ASK, thinking=thinking)


@pytest.fixture
def check_threads(monkeypatch) -> list[str]:
    """The names of the threads that ran the schema checks of this test."""
    seen: list[str] = []
    check_schema = structured.check_schema

    def recorded(schema, param):
        seen.append(threading.current_thread().name)
        return check_schema(schema, param)

    monkeypatch.setattr(structured, "check_schema", recorded)
    return seen


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_schemas_get_the_openai_routes_400s_off_the_loop(claude, llama, server, check_threads, name):
    schema, says = HOSTILE[name]
    with pytest.raises(anthropic.BadRequestError, match=re.escape(says)) as info:
        claude.messages.create(model="m", max_tokens=2, messages=ASK,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert "output_config.format.schema" in info.value.api_message
    with pytest.raises(anthropic.BadRequestError, match=re.escape(says)):
        claude.messages.create(model="m", max_tokens=2, messages=ASK, tool_choice={"type": "any"},
                               tools=[{"name": "f", "description": "f", "input_schema": schema}])
    with pytest.raises(anthropic.BadRequestError, match=re.escape(says)):
        claude.messages.count_tokens(model="m", messages=ASK,
                                     tools=[{"name": "f", "description": "f", "input_schema": schema}])
    with pytest.raises(ollama.ResponseError, match=re.escape(says)) as refused:
        llama.chat(model="m", messages=ASK, format=schema)
    assert refused.value.status_code == 400 and "format" in refused.value.error
    with pytest.raises(ollama.ResponseError, match=re.escape(says)):
        llama.generate(model="m", prompt="hi", format=schema)
    # (the ollama client rewrites a tool's parameters into its own model: sent raw)
    r = httpx.post(f"{server.base_url}/api/chat", timeout=60, json={"messages": ASK, "tools": [
        {"type": "function", "function": {"name": "f", "description": "f", "parameters": schema}}]})
    assert r.status_code == 400 and set(r.json()) == {"error"} and says in r.json()["error"]
    assert len(check_threads) >= 6 and "tiny-live-server" not in check_threads, check_threads


def test_a_good_schema_still_constrains_both_apis(claude, llama):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
              "additionalProperties": False}
    message = claude.messages.create(model="m", max_tokens=30, messages=ASK, extra_body=GREEDY,
                                     output_config={"format": {"type": "json_schema", "schema": person}})
    assert message.content[0].text.startswith('{"name":"')
    answer = llama.chat(model="m", messages=ASK, format=person, options={"temperature": 0, "num_predict": 30})
    assert answer.message.content.startswith('{"name":"')
