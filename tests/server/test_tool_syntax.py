"""Tool calls in each family's syntax: which syntax a template gets, the parser fed every
way of splitting an answer into deltas (the same calls, content and events), and the
grammar of a forced call in each syntax."""

from __future__ import annotations

import json

import pytest

from bargein.engine.grammar import check_constraint
from bargein.server.tool_syntax import (
    HERMES,
    LLAMA3,
    MISTRAL,
    ArgumentsDelta,
    CallEnd,
    CallStart,
    ToolCallParser,
    tool_syntax_for,
)
from bargein.server.tools import prompt_messages, tool_plan

NAMES = {"get_weather", "get_time"}

# (syntax, answer text, content expected, calls expected as (name, arguments text))
CASES = [
    (HERMES, 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
     "Sure.", [("get_weather", '{"city": "Oslo"}')]),
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',  # Qwen3's layout
     "\n", [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Oslo"}')]),
    (HERMES, '<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>', "",
     [("get_time", '{"zone": "UTC"}')]),  # arguments first: judged whole at the closing tag
    (HERMES, 'No call: <tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     'No call: <tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
              '{"name": "get_time", "arguments": {"zone": "CET"}}]',
     "", [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "CET"}')]),
    (MISTRAL, 'Plain [TOOL_CALLS] mention.', "Plain [TOOL_CALLS] mention.", []),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Oslo", "days": [1, 2]}}', "",
     [("get_weather", '{"city": "Oslo", "days": [1, 2]}')]),
    (LLAMA3, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
             '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
     "", [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Oslo"}')]),
    (LLAMA3, '{"answer": 42}', '{"answer": 42}', []),  # JSON that is no call is content
    (LLAMA3, 'The weather is {"name": "get_time"} fine.', 'The weather is {"name": "get_time"} fine.', []),
]


def run(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list]:
    events = []
    for i, piece in enumerate(pieces):
        events += parser.feed(piece, final=i == len(pieces) - 1)[1]
    return parser.text, events


def splits(text: str):
    yield [text]
    for at in range(1, len(text)):
        yield [text[:at], text[at:]]
    yield list(text) + [""]  # one character per delta


@pytest.mark.parametrize("syntax,text,content,calls", CASES)
def test_every_split_gives_the_same_calls_and_content(syntax, text, content, calls):
    whole = None
    for pieces in splits(text):
        parser = ToolCallParser(NAMES, syntax)
        got_content, events = run(parser, pieces)
        assert got_content == content, pieces
        assert [(c.name, c.arguments) for c in parser.calls] == calls, pieces
        assert all(c.done for c in parser.calls)
        # Events are in order: each call starts, streams its arguments exactly, then ends.
        for call in parser.calls:
            mine = [e for e in events if not isinstance(e, str) and
                    (e.call.index if isinstance(e, CallStart) else e.index) == call.index]
            assert isinstance(mine[0], CallStart) and isinstance(mine[-1], CallEnd)
            assert "".join(e.text for e in mine if isinstance(e, ArgumentsDelta)) == call.arguments
        kinds = [type(e).__name__ for e in events if not isinstance(e, str)]
        kinds = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # argument pieces as one
        if whole is None:
            whole = kinds
        assert kinds == whole, pieces


def test_a_call_streams_before_it_ends():
    parser = ToolCallParser(NAMES, MISTRAL)
    _, events = parser.feed('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Os')
    assert [type(e) for e in events] == [CallStart, ArgumentsDelta]
    assert events[0].call.name == "get_weather" and events[1].text == '{"city": "Os'
    _, events = parser.feed('lo"}}]', final=True)
    assert [type(e) for e in events] == [ArgumentsDelta, CallEnd]
    assert parser.calls[0].arguments == '{"city": "Oslo"}'


def test_a_call_cut_short_stays_a_call():
    parser = ToolCallParser(NAMES, LLAMA3)
    parser.feed('{"name": "get_time", "parameters": {"zo', final=True)
    [call] = parser.calls
    assert (call.name, call.arguments, call.done) == ("get_time", '{"zo', False)


TEMPLATES = {
    "hermes": "{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}<tool_call>",
    "qwen3": "{%- if tools %}<tools>{% endif %}<tool_call>\\n{{ tool_call | tojson }}</tool_call>",
    "mistral": "{% if message.tool_calls %}[TOOL_CALLS][{% endif %}",
    "llama3": "{{- '<|python_tag|>' }}{% if message.role == 'ipython' %}{% endif %}",
    "llama3_json": "{{ '\"parameters\": ' }}{% if message.role == 'ipython' %}{% endif %}",
    "none": "{% for m in messages %}{{ m.content }}{% endfor %}",
}


def test_the_syntax_follows_the_template():
    chosen = {name: tool_syntax_for(t).name for name, t in TEMPLATES.items()}
    assert chosen == {"hermes": "hermes", "qwen3": "hermes", "mistral": "mistral", "llama3": "llama3",
                      "llama3_json": "llama3", "none": "hermes"}
    assert tool_syntax_for(None) is HERMES


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("syntax", [HERMES, MISTRAL, LLAMA3])
def test_a_forced_call_is_written_in_the_syntax_and_parses_back(syntax):
    plan = tool_plan(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, syntax)
    constraint = plan.constraint()
    check_constraint(constraint)  # the grammar compiles
    before, after = syntax.forced_frame()
    assert f"start: {json.dumps(before) + ' ' if before else ''}call{' ' + json.dumps(after) if after else ''}" \
        in constraint.text
    assert f'"{syntax.arguments_key}"' in constraint.text
    written = syntax.write([("get_weather", '{"city":"Oslo"}')])
    assert written.startswith(before) and written.endswith(after)
    parser = ToolCallParser({"get_weather"}, syntax)
    parser.feed(written, final=True)
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_weather", '{"city":"Oslo"}')]
    assert parser.text == ""


def test_a_history_call_is_written_once():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    history = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    plan = tool_plan(TOOLS, None, MISTRAL)
    folded, _ = prompt_messages(history, plan, "{{ messages }}")  # a template that ignores tool_calls
    assert folded[-1] == {"role": "assistant", "content": '[TOOL_CALLS][{"name":"get_weather","arguments":'
                                                          '{"city":"Oslo"}}]'}
    kept, _ = prompt_messages(history, plan, "{% for c in message.tool_calls %}{% endfor %}{{ tools }}")
    assert kept[-1]["content"] == "" and kept[-1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
