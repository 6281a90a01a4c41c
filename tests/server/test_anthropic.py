"""The Anthropic Messages API through the official ``anthropic`` SDK, on a real server with
the bundled model: a message and its stream (the raw event sequence checked event by
event), tool use and a tool result, every cancel route and its ``stop_reason``, the next
turn's cache reuse as ``cache_read_input_tokens``, stop sequences, token counting, and
errors in Anthropic's shape (``x-api-key`` included).

The SDK no longer takes ``temperature``; it goes in ``extra_body``, as clients send it.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.conftest import GUARDED_ARGS, GUARDED_KEY, listed_requests, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("check_kv")]

GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "Tell me about the moon."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def client(server_factory) -> anthropic.Anthropic:
    server = server_factory.get()
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory.get()


def raw_events(server, body: dict) -> list[tuple[str, dict]]:
    """A streamed message's events as (event name, data), read off the wire."""
    events, name = [], None
    with httpx.stream("POST", f"{server.base_url}/v1/messages", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    return events


def test_a_message_and_its_stream_agree_event_by_event(client, server):
    body = {"model": "m", "max_tokens": 10, "messages": ASK, **GREEDY}
    message = client.messages.create(model="m", max_tokens=10, messages=ASK, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 10
    [block] = message.content
    assert block.type == "text" and block.text

    events = raw_events(server, body)
    names = [n for n, _ in events]
    assert all(n == d["type"] for n, d in events)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["model"] == message.model
    usage = start["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == (
        message.usage.input_tokens + message.usage.cache_read_input_tokens)
    assert usage["cache_read_input_tokens"] > 0  # the same prompt again: its K/V is reused
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [d["delta"] for _, d in events[3:-3]]
    assert all(d["type"] == "text_delta" for d in deltas) and "".join(d["text"] for d in deltas) == block.text
    assert events[-3][1] == {"type": "content_block_stop", "index": 0}
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 10

    with client.messages.stream(model="m", max_tokens=10, messages=ASK, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == block.text and final.content[0].text == block.text and final.stop_reason == "max_tokens"


def test_tool_use_then_a_tool_result(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    message = client.messages.create(model="m", max_tokens=40, messages=ask, tools=TOOLS,
                                     tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert message.stop_reason == "tool_use"
    [use] = message.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    with client.messages.stream(model="m", max_tokens=40, messages=ask, tools=TOOLS, tool_choice={"type": "any"},
                                extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and [b.type for b in streamed.content] == ["tool_use"]
    assert "input_json" in kinds and streamed.content[0].input == use.input  # the same greedy call, streamed

    history = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 degrees"}]}]
    answer = client.messages.create(model="m", max_tokens=2, messages=history, tools=TOOLS, extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The call is written back as the model wrote it: the first turn and its call are reused.
    first = message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert answer.usage.cache_read_input_tokens >= first + message.usage.output_tokens - 1


def test_a_disconnect_mid_stream_cancels_and_the_next_turn_reuses_the_answer(client, server):
    ask = [{"role": "user", "content": "Tell me about rivers."}]
    received, deltas = "", 0
    with client.messages.stream(model="m", max_tokens=400, messages=ask, extra_body=GREEDY,
                                extra_headers={"X-Request-Id": "anthropic-disconnect"}) as stream:
        for event in stream:
            if event.type == "message_start":
                prompt_tokens = event.message.usage.input_tokens + event.message.usage.cache_read_input_tokens
            if event.type == "content_block_delta":
                received += event.delta.text
                deltas += 1
                if deltas == 4:
                    break
    wait_until(lambda: "anthropic-disconnect" not in listed_requests(server), timeout=30)
    history = [*ask, {"role": "assistant", "content": received}, {"role": "user", "content": "Go on."}]
    nxt = client.messages.create(model="m", max_tokens=4, messages=history, extra_body=GREEDY)
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": history}, timeout=30).json()
    assert nxt.usage.input_tokens + nxt.usage.cache_read_input_tokens == tokens["count"]
    # Every delivered token's K/V but the last one's: at least a token per delta received.
    assert nxt.usage.cache_read_input_tokens >= prompt_tokens + deltas - 1


def test_a_cancel_by_id_and_a_deadline_end_with_stop_reason_cancelled(client, server):
    with client.messages.stream(model="m", max_tokens=400, messages=ASK, extra_body=GREEDY,
                                extra_headers={"X-Request-Id": "anthropic-cancel"}) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                httpx.post(f"{server.base_url}/v1/requests/anthropic-cancel/cancel", timeout=10).raise_for_status()
                break
        final = stream.get_final_message()
    assert final.stop_reason == "cancelled" and final.content[0].text
    assert final.usage.output_tokens < 400
    body = {"model": "m", "max_tokens": 2000, "messages": ASK, "timeout": 0.5, **GREEDY}
    r = httpx.post(f"{server.base_url}/v1/messages", json=body, timeout=60).json()
    assert (r["stop_reason"], r["cancel_reason"]) == ("cancelled", "deadline")
    events = raw_events(server, {**body, "messages": [{"role": "user", "content": "Tell me about the sea."}]})
    assert events[-2][1]["delta"]["stop_reason"] == "cancelled"
    assert events[-2][1]["delta"]["cancel_reason"] == "deadline" and events[-1][0] == "message_stop"


def test_a_stop_sequence_ends_the_answer_and_is_named(client):
    full = client.messages.create(model="m", max_tokens=10, messages=ASK, extra_body=GREEDY).content[0].text
    word = full.split()[3]
    stopped = client.messages.create(model="m", max_tokens=10, messages=ASK, stop_sequences=["qqqq", word],
                                     extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == full[:full.index(word)]


def test_count_tokens_matches_the_prompt(client, server):
    counted = client.messages.count_tokens(model="m", messages=ASK, system="Be brief.")
    message = client.messages.create(model="m", max_tokens=1, messages=ASK, system="Be brief.", extra_body=GREEDY)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    with_tools = client.messages.count_tokens(model="m", messages=ASK, tools=TOOLS)
    assert with_tools.input_tokens > counted.input_tokens


def test_errors_are_in_anthropic_shape(client, server):
    bad = [
        ({"model": "m", "messages": ASK}, "max_tokens"),
        ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "image"),
        ({"model": "m", "max_tokens": 5, "messages": [*ASK, {"role": "assistant", "content": "The "}]},
         "trailing whitespace"),
        ({"model": "m", "max_tokens": 5, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "x"}},
         "tool_choice"),
        ({"model": "m", "max_tokens": 5, "messages": ASK, "temperature": 7}, "temperature"),
    ]
    for body, word in bad:
        r = httpx.post(f"{server.base_url}/v1/messages", json=body, timeout=30)
        assert r.status_code == 400, body
        payload = r.json()
        assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
        assert word in payload["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model="m", max_tokens=0, messages=ASK)


def test_the_api_key_is_checked_as_x_api_key(server_factory):
    guarded = server_factory.get(GUARDED_ARGS, api_key=GUARDED_KEY)
    good = anthropic.Anthropic(base_url=guarded.base_url, api_key=GUARDED_KEY, max_retries=0)
    assert good.messages.count_tokens(model="m", messages=ASK).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=guarded.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(model="m", messages=ASK)
    bearer = httpx.post(f"{guarded.base_url}/v1/messages/count_tokens", json={"model": "m", "messages": ASK},
                        headers={"Authorization": f"Bearer {GUARDED_KEY}"}, timeout=30)
    assert bearer.status_code == 200  # both headers are accepted on every route
    missing = httpx.post(f"{guarded.base_url}/v1/messages", json={"model": "m", "max_tokens": 1, "messages": ASK},
                         timeout=30)
    assert missing.status_code == 401 and missing.json()["error"] == {  # the header Anthropic's clients send
        "type": "authentication_error",
        "message": "missing API key: send 'x-api-key: <key>' (or 'Authorization: Bearer <key>')"}


def test_output_config_format_constrains_the_answer(client):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"],
              "additionalProperties": False}
    message = client.messages.create(model="m", max_tokens=40, messages=[{"role": "user", "content": "A person"}],
                                     output_config={"format": {"type": "json_schema", "schema": person}},
                                     extra_body=GREEDY)
    jsonschema.validate(json.loads(message.content[0].text), person)
    with pytest.raises(anthropic.BadRequestError, match="output_config.format"):
        client.messages.create(model="m", max_tokens=5, messages=ASK, output_config={"format": {"type": "xml"}})
