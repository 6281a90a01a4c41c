"""Qwen3-Coder's XML tool calls: the parser fed every way of splitting an answer (the same
calls, content and events), parameter types coerced from the tool's schema, calls cut
short, JSON bodies inside the tags, the history written back, and a forced call through
the chat API on the tiny model with a template in Qwen3-Coder's conventions.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bargein.engine.grammar import check_constraint
from bargein.loader.chat_template import render_chat_template
from bargein.server.tool_syntax import (
    QWEN3_XML,
    ArgumentsDelta,
    CallEnd,
    CallStart,
    call_parser,
    tool_syntax_for,
)
from bargein.server.tool_syntax_xml import coerce
from bargein.server.tools import tool_plan
from tests.server.inprocess_app import inprocess_app
from tests.server.test_tool_syntax import run, splits
from tests.tiny_engine import ByteTokenizer, tiny_engine

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "scale": {"type": "number"},
    "hot": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}},
    "where": {"type": "object"}, "note": {"type": ["null", "string"]}, "unit": {"enum": ["c", "f"]}}}
SCHEMAS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}}}
SYNTAX = replace(QWEN3_XML, schemas=SCHEMAS)
NAMES = set(SCHEMAS)


def xml_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


CASES = [  # (answer text, content, calls as (name, arguments))
    ("Let me check.\n" + xml_call("get_weather", city="Oslo", days="3"), "Let me check.\n",
     [("get_weather", '{"city":"Oslo","days":3}')]),
    (xml_call("get_time", zone="UTC") + "\n" + xml_call("get_weather", city="New\nYork"), "\n",
     [("get_time", '{"zone":"UTC"}'), ("get_weather", '{"city":"New\\nYork"}')]),
    (xml_call("get_weather", scale="1.5", hot="true", tags='["a", "b"]', where='{"lat": 1}', note="null", unit="f"),
     "", [("get_weather", '{"scale":1.5,"hot":true,"tags":["a","b"],"where":{"lat":1},"note":null,"unit":"f"}')]),
    (xml_call("get_weather", days="three", extra="42"), "",  # not an integer; undeclared: strings
     [("get_weather", '{"days":"three","extra":"42"}')]),
    ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "", [("get_time", "{}")]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>', "",
     [("get_time", '{"zone": "CET"}')]),  # Qwen3's JSON inside the tags
    (xml_call("unknown", a="1"), xml_call("unknown", a="1"), []),  # an unknown tool: content
    ("I would write <tool_call> here.", "I would write <tool_call> here.", []),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_every_split_gives_the_same_calls_and_content(text, content, calls):
    whole = None
    for pieces in splits(text):
        parser = call_parser(NAMES, SYNTAX)
        got_content, events = run(parser, pieces)
        assert got_content == content, pieces
        assert [(c.name, c.arguments) for c in parser.calls] == calls, pieces
        assert all(c.done for c in parser.calls)
        for call in parser.calls:
            json.loads(call.arguments)
            mine = [e for e in events if not isinstance(e, str) and
                    (e.call.index if isinstance(e, CallStart) else e.index) == call.index]
            assert isinstance(mine[0], CallStart) and isinstance(mine[-1], CallEnd)
            assert "".join(e.text for e in mine if isinstance(e, ArgumentsDelta)) == call.arguments
        kinds = [type(e).__name__ for e in events if not isinstance(e, str)]
        kinds = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
        if whole is None:
            whole = kinds
        assert kinds == whole, pieces


def test_a_call_streams_parameter_by_parameter():
    parser = call_parser(NAMES, SYNTAX)
    _, events = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nOs")
    assert [type(e) for e in events] == [CallStart] and events[0].call.name == "get_weather"
    _, events = parser.feed("lo\n</parameter>\n<parameter=days>\n2")
    assert [(type(e), e.text) for e in events] == [(ArgumentsDelta, '{"city":"Oslo"')]
    _, events = parser.feed("\n</parameter>\n</function>\n</tool_call>", final=True)
    assert [type(e) for e in events] == [ArgumentsDelta, ArgumentsDelta, CallEnd]
    assert parser.calls[0].arguments == '{"city":"Oslo","days":2}'


def test_a_call_cut_short_stays_a_call_with_its_complete_parameters():
    parser = call_parser(NAMES, SYNTAX)
    parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=da",
                final=True)
    [call] = parser.calls
    assert (call.name, call.arguments, call.done) == ("get_weather", '{"city":"Oslo"', False)


def test_coercion_follows_the_schema():
    assert coerce("3", {"type": "integer"}) == 3 and coerce("3", {"type": "number"}) == 3
    assert coerce("3", {"type": "string"}) == "3" and coerce("3", None) == "3"
    assert coerce("3", {"type": ["string", "integer"]}) == "3" and coerce("3", {"type": ["integer", "string"]}) == 3
    assert coerce("yes", {"type": "boolean"}) == "yes" and coerce("2", {"enum": [1, 2]}) == 2


QWEN3_CODER_TEMPLATE = (  # Qwen3-Coder's conventions, shortened: tools in the system turn, XML calls
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t.function.name }}{% endfor %}</tools>\n"
    "Call a function as <tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n</function>\n"
    "</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}"
    "</function>\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class CoderByteTokenizer(ByteTokenizer):
    chat_template = QWEN3_CODER_TEMPLATE

    def apply_chat_template(self, messages, *, add_generation_prompt=True, tools=None, **extra) -> str:
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, **extra)


def test_the_template_chooses_the_syntax_and_a_forced_call_compiles():
    assert tool_syntax_for(QWEN3_CODER_TEMPLATE).name == "qwen3_xml"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    plan = tool_plan(tools, "required", tool_syntax_for(QWEN3_CODER_TEMPLATE))
    assert plan.syntax.schemas == {"get_weather": WEATHER}
    check_constraint(plan.constraint())
    written = plan.syntax.write([("get_weather", '{"city":"Oslo","days":3}')])
    assert written == xml_call("get_weather", city="Oslo", days="3")
    parser = call_parser({"get_weather"}, plan.syntax)
    parser.feed(written, final=True)
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_weather", '{"city":"Oslo","days":3}')]


@pytest.mark.anyio
async def test_a_forced_call_comes_back_as_a_tool_call_on_the_chat_api():
    core = tiny_engine(num_blocks=256)
    core.tokenizer = CoderByteTokenizer()
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}]
    body = {"messages": [{"role": "user", "content": "time?"}], "tools": tools, "tool_choice": "required",
            "max_tokens": 120, "temperature": 0}
    async with inprocess_app(core, timeout=60) as (_, client):
        choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_time" and json.loads(call["function"]["arguments"])["zone"] in (
            "UTC", "CET")
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        deltas = [json.loads(line[6:])["choices"][0] for line in streamed.text.splitlines()
                  if line.startswith("data: {") and json.loads(line[6:])["choices"]]
        pieces = [d["delta"]["tool_calls"][0] for d in deltas if d["delta"].get("tool_calls")]
        assert pieces[0]["function"]["name"] == "get_time"
        assert "".join(p["function"].get("arguments", "") for p in pieces) == call["function"]["arguments"]
        assert deltas[-1]["finish_reason"] == "tool_calls"
