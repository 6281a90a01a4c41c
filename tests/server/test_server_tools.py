"""Tool calls: forced and required calls (streamed and not) through the official client,
a tool result round trip, the 400s, and the parser of the tool-call syntax."""

from __future__ import annotations

import json
import typing

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from bargein.engine.request import FinishReason, RequestOutput, Usage
from bargein.server.job_slots import Slot
from bargein.server.openai_stream import ChatShape, ResponsesShape
from bargein.server.reasoning import AnswerParser
from bargein.server.responses_store import StoredResponse
from bargein.server.tools import ArgumentsDelta, CallEnd, CallStart, ToolCallParser

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
        finish, content, pieces = None, "", []
        for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice_arg,
                                                    max_tokens=60, temperature=0, stream=True):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                for d in ch.delta.tool_calls or ():
                    if d.index not in calls:  # the first delta of a call: id, type, name, no arguments yet
                        assert d.id.startswith("call_") and d.type == "function" and d.function.arguments == ""
                        calls[d.index] = {"name": d.function.name, "arguments": ""}
                    else:  # then the arguments, piece by piece as generated
                        assert d.id is None and d.function.name is None
                        pieces.append(d.function.arguments)
                        calls[d.index]["arguments"] += d.function.arguments
                finish = ch.finish_reason or finish
        [expected] = plain.choices[0].message.tool_calls
        assert finish == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (expected.function.name, expected.function.arguments)]
        # Pieces as the server read them: a reader that falls behind gets the tokens of several
        # steps in one delta (one loaded CI run got the whole call in one), so how many there
        # are is the machine's; one delta per generated piece is the next test's, exactly.
        assert pieces and all(pieces)


def _stream_events(shape, slot, slots, pieces: list[str]) -> list[str]:
    """The events a stream shape writes for one request whose outputs add these pieces of
    text in turn, the last one finishing (STOP): event_stream's order, without a server."""
    events = list(shape.opening(slots))
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out = RequestOutput("r", (i,), tuple(range(len(pieces))) if last else (), piece,
                            "".join(pieces) if last else "", last, FinishReason.STOP if last else None,
                            Usage(1, i + 1, 0))
        shape.observe(slot, out)
        events += shape.content(slot, out)
        if last:
            events += shape.final(slot, out)
    return events + list(shape.closing({}))


def test_chat_tool_call_arguments_stream_one_delta_per_generated_piece():
    """Text, then a call the model wrote: a content delta, the call's opening delta (index,
    id, type, name, empty arguments), then one arguments delta per output that added to
    them; every chunk validates strictly as the SDK's type."""
    shape = ChatShape({"id": "chatcmpl-1", "created": 1, "model": "m", "system_fingerprint": "fp"}, None,
                      logprobs=False, include_usage=False, tool_names={"get_time"})
    slot = Slot("r", None, 0, 0)
    pieces = ["Sure. ", '<tool_call>{"name":"get_time","argu', 'ments":{"zo', 'ne":', '"UTC"', '}}</tool_call>']
    events = _stream_events(shape, slot, [slot], pieces)
    deltas = []
    for event in events:
        if event.strip() == "data: [DONE]":
            continue
        chunk = ChatCompletionChunk.model_validate(json.loads(event.split("data: ", 1)[1]), strict=True)
        [choice] = chunk.choices
        deltas.append((choice.delta.content, [(c.index, c.id, c.function.name, c.function.arguments)
                                              for c in choice.delta.tool_calls or ()], choice.finish_reason))
    call_id = deltas[2][1][0][1]
    assert call_id.startswith("call_")
    assert deltas == [("", [], None), ("Sure. ", [], None), (None, [(0, call_id, "get_time", "")], None),
                      (None, [(0, None, None, '{"zo')], None), (None, [(0, None, None, 'ne":')], None),
                      (None, [(0, None, None, '"UTC"')], None), (None, [(0, None, None, "}")], None),
                      (None, [], "tool_calls")]


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


# -- the Responses API ---------------------------------------------------------------------------------
RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
                    "parameters": t["function"]["parameters"]} for t in TOOLS]


@pytest.mark.slow
@pytest.mark.usefixtures("check_kv")
def test_responses_forced_call_streamed_equals_not_streamed(client):
    forced = {"type": "function", "name": "get_weather"}
    plain = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=RESPONSES_TOOLS,
                                    tool_choice=forced, max_output_tokens=60, temperature=0)
    assert plain.status == "completed"
    [call] = plain.output  # no message item: the answer is the call alone
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert client.responses.retrieve(plain.id).output[0].arguments == call.arguments

    kinds, pieces, final = [], [], None
    with client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=RESPONSES_TOOLS,
                                 tool_choice=forced, max_output_tokens=60, temperature=0, stream=True) as stream:
        for event in stream:  # parsed into the SDK's typed events: their shapes are the API's
            kinds.append(event.type)
            if event.type == "response.output_item.added":
                assert event.item.type == "function_call" and event.item.arguments == ""
                assert event.item.name == "get_weather" and event.output_index == 0
            elif event.type == "response.function_call_arguments.delta":
                pieces.append(event.delta)
            elif event.type == "response.function_call_arguments.done":
                assert event.arguments == "".join(pieces)
            elif event.type == "response.completed":
                final = event.response
    # The same answer, in as many pieces as the reader kept up with (a slow reader gets several
    # tokens in one delta); one event per generated piece is the next test's, exactly.
    assert pieces and all(pieces) and "".join(pieces) == call.arguments
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert "response.output_text.delta" not in kinds
    [streamed] = final.output
    assert (streamed.type, streamed.name, streamed.arguments) == ("function_call", "get_weather", call.arguments)


@pytest.mark.slow
@pytest.mark.usefixtures("check_kv")
def test_responses_tool_result_round_trip(client):
    first = client.responses.create(model=MODEL, input="What time is it?", tools=RESPONSES_TOOLS,
                                    tool_choice="required", max_output_tokens=40, temperature=0)
    [call] = first.output
    assert call.type == "function_call" and call.name in SCHEMAS
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"answer": 12})}
    # Continued from the stored response: its prompt and the call's tokens are reused exactly.
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result],
                                     tools=RESPONSES_TOOLS, tool_choice="none", max_output_tokens=8, temperature=0)
    assert second.output[0].type == "message" and second.output_text
    previous = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= previous - 1
    # The same history sent whole (the call echoed back as an input item) renders the same prompt.
    whole = client.responses.create(
        model=MODEL, tools=RESPONSES_TOOLS, tool_choice="none", max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": "What time is it?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               result])
    assert whole.usage.input_tokens == second.usage.input_tokens and whole.output_text == second.output_text


@pytest.mark.slow
def test_responses_tool_errors_are_400s(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", tools=RESPONSES_TOOLS, max_output_tokens=5,
                                tool_choice={"type": "function", "name": "nope"})
    assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}], max_output_tokens=5)
    assert info.value.body["param"] == "tools.0"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=[{"type": "function_call_output", "output": "x"}],
                                max_output_tokens=5)
    assert info.value.body["param"] == "input.0.call_id"


def test_responses_auto_events_open_items_as_they_appear():
    """Text, then a call the model wrote (auto): the message item opens with the text, the
    call's item when its name is written; every event validates strictly as the SDK's type."""
    event_types = {t.model_fields["type"].annotation.__args__[0]: t
                   for t in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
    stored = StoredResponse(id="resp_1", model="m", prompt_messages=[], conversation=[], prompt_token_ids=[1],
                            answer=AnswerParser(None, {"get_time"}), tools=RESPONSES_TOOLS)
    shape = ResponsesShape(stored)
    pieces = ["Sure. ", '<tool_call>{"name":"get_time","argu', 'ments":{"zone":', '"UTC"}}</tool_call>']
    events = _stream_events(shape, None, [], pieces)
    kinds = []
    for event in events:
        data = json.loads(event.split("data: ", 1)[1])
        event_types[data["type"]].model_validate(data, strict=True)
        kinds.append((data["type"].removeprefix("response."), data.get("output_index")))
    assert kinds == [("created", None), ("in_progress", None), ("output_item.added", 0), ("content_part.added", 0),
                     ("output_text.delta", 0), ("output_item.added", 1), ("function_call_arguments.delta", 1),
                     ("function_call_arguments.delta", 1), ("function_call_arguments.done", 1),
                     ("output_item.done", 1), ("output_text.done", 0), ("content_part.done", 0),
                     ("output_item.done", 0), ("completed", None)]
    body = Response.model_validate(stored.to_dict())
    message, call = body.output
    assert message.content[0].text == "Sure. " and (call.name, call.arguments) == ("get_time", '{"zone":"UTC"}')


# -- the parser (auto mode reads the model's own text) ------------------------------------------------
TEXT = ('Let me check. <tool_call>{"name":"get_time","arguments":{"zone":"U\\"}C"}}</tool_call>'
        '<tool_call>{"name":"nope","arguments":{}}</tool_call> <tool_call>{"arguments":{"zone":"CET"},'
        '"name":"get_time"}</tool_call>, <tool_ca')


def _replay(events) -> tuple[str, list[tuple[int, str, str]]]:
    """Content and (index, name, arguments) per call, rebuilt from a parser's events."""
    content, calls = "", {}
    for e in events:
        if isinstance(e, str):
            content += e
        elif isinstance(e, CallStart):
            calls[e.call.index] = [e.call.name, ""]
        elif isinstance(e, ArgumentsDelta):
            calls[e.index][1] += e.text
    return content, [(i, name, args) for i, (name, args) in calls.items()]


@pytest.mark.parametrize("step", [1, 2, 5, 11, len(TEXT)])
def test_parser_is_independent_of_how_text_is_split(step):
    parser = ToolCallParser({"get_time"})
    pieces = [TEXT[i:i + step] for i in range(0, len(TEXT), step)]
    events = []
    for i, piece in enumerate(pieces):
        events += parser.feed(piece, final=i == len(pieces) - 1)[1]
    content, calls = _replay(events)
    assert calls == [(0, "get_time", '{"zone":"U\\"}C"}'), (1, "get_time", '{"zone":"CET"}')]
    assert [(c.index, c.name, c.arguments, c.done) for c in parser.calls] == [(i, n, a, True) for i, n, a in calls]
    assert sum(isinstance(e, CallEnd) for e in events) == 2
    # An unknown function is content, and so is an unfinished tag at the end.
    assert content == parser.text == ('Let me check. <tool_call>{"name":"nope","arguments":{}}</tool_call> , '
                                      '<tool_ca')


def test_parser_streams_arguments_before_the_call_closes():
    parser = ToolCallParser({"f"})
    assert parser.feed('Hi <tool_call>{"name":') == ("Hi ", ["Hi "])
    _, [start] = parser.feed('"f","arguments":')
    assert isinstance(start, CallStart) and start.call.name == "f" and start.call.id.startswith("call_")
    assert parser.feed(' {"x":"a}') == ("", [ArgumentsDelta(0, '{"x":"a}')])
    assert parser.feed('b"}}</tool') == ("", [ArgumentsDelta(0, 'b"}')])
    assert parser.feed('_call> ok', final=True) == (" ok", [CallEnd(0), " ok"])
    assert parser.calls[0].arguments == '{"x":"a}b"}' and parser.text == "Hi  ok"


def test_parser_keeps_a_call_cut_short():
    parser = ToolCallParser({"f"})
    _, events = parser.feed('<tool_call>{"name":"f","arguments":{"x":[1,', final=True)
    assert _replay(events) == ("", [(0, "f", '{"x":[1,')]) and not parser.calls[0].done


def test_parser_keeps_arguments_verbatim():
    parser = ToolCallParser({"f"})
    parser.feed('<tool_call>{"name":"f","arguments":{"x":1.50,"y":[1, 2]}}</tool_call>', final=True)
    [call] = parser.calls
    assert call.arguments == '{"x":1.50,"y":[1, 2]}' and parser.text == ""
