"""Tool calls: forced and required calls (streamed and not) through the official client,
a tool result round trip, the 400s, and the parser of the tool-call syntax."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from bargein.server.tools import ToolCallParser

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _valid(call) -> None:
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert call.type == "function" and call.id.startswith("call_")


@pytest.mark.slow
@pytest.mark.usefixtures("check_kv")
def test_forced_and_required_calls_not_streamed(client):
    forced = {"type": "function", "function": {"name": "get_weather"}}
    for choice_arg, names in ((forced, {"get_weather"}), ("required", set(SCHEMAS))):
        c = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice_arg,
                                           max_tokens=60, temperature=0)
        [choice] = c.choices
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.function.name in names and choice.message.content is None
        _valid(call)


@pytest.mark.slow
@pytest.mark.usefixtures("check_kv")
def test_forced_and_required_calls_streamed_equal_plain(client):
    for choice_arg in ({"type": "function", "function": {"name": "get_time"}}, "required"):
        plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice_arg,
                                               max_tokens=60, temperature=0)
        calls: dict[int, dict] = {}
        finish, content = None, ""
        for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice_arg,
                                                    max_tokens=60, temperature=0, stream=True):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                for d in ch.delta.tool_calls or ():
                    entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                    entry["name"] += d.function.name or ""
                    entry["arguments"] += d.function.arguments or ""
                finish = ch.finish_reason or finish
        [expected] = plain.choices[0].message.tool_calls
        assert finish == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (expected.function.name, expected.function.arguments)]


@pytest.mark.slow
@pytest.mark.usefixtures("check_kv")
def test_tool_result_round_trip_reuses_the_call_token_exactly(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=60, temperature=0)
    [call] = first.choices[0].message.tool_calls
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=12, temperature=0)
    assert second.choices[0].message.content and second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.tool_calls is None
    # The call was written back in the syntax the model produced: the cache covers it all.
    previous = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= previous - 1


@pytest.mark.slow
def test_tool_errors_are_400s(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=5,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice"
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "contains": {}}}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=bad, max_tokens=5)
    assert info.value.body["param"] == "tools.0.function.parameters" and "contains" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tool_choice="required", max_tokens=5)
    assert info.value.body["param"] == "tool_choice"


# -- the parser (auto mode reads the model's own text) ------------------------------------------------
TEXT = ('Let me check. <tool_call>{"name":"get_time","arguments":{"zone":"UTC"}}</tool_call>'
        '<tool_call>{"name":"nope","arguments":{}}</tool_call> <tool_ca')


@pytest.mark.parametrize("step", [1, 2, 5, 11, len(TEXT)])
def test_parser_is_independent_of_how_text_is_split(step):
    parser = ToolCallParser({"get_time"})
    pieces = [TEXT[i:i + step] for i in range(0, len(TEXT), step)]
    calls = []
    for i, piece in enumerate(pieces):
        calls += parser.feed(piece, final=i == len(pieces) - 1)[1]
    assert [(c.name, c.arguments, c.index) for c in calls] == [("get_time", '{"zone":"UTC"}', 0)]
    # An unknown function is content, and so is an unfinished tag at the end.
    assert parser.text == 'Let me check. <tool_call>{"name":"nope","arguments":{}}</tool_call> <tool_ca'


def test_parser_keeps_arguments_verbatim():
    parser = ToolCallParser({"f"})
    _, [call] = parser.feed('<tool_call>{"name":"f","arguments":{"x":1.50,"y":[1, 2]}}</tool_call>', final=True)
    assert call.arguments == '{"x":1.50,"y":[1, 2]}' and parser.text == ""
