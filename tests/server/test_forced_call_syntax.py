"""Forced tool calls in the model's own syntax, and special-token markers read by their ids
(issue 32).

Qwen3-Coder's XML: a ``required`` or named ``tool_choice`` makes the model write its own
``<tool_call><function=...><parameter=...>`` call (``tool_grammar_xml``), not JSON inside
the tags; on every route that forces tools (chat completions, Responses, Messages),
streamed and not, the answer's tokens decode to exactly the call the API returns, written
back in that syntax.

Mistral's ``[TOOL_CALLS]`` (and ``[THINK]``/``[/THINK]``) are *special* tokens, which
decoding leaves out of the text: the parsers act on the token ids the model emitted,
never on the same characters written as text (a forgery, or a model quoting one), and a
forced call writes the token itself.

The tokenizers are bytes plus control tokens on the tiny random-weight engine.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest

from bargein.engine.engine import Engine
from bargein.engine.grammar import Grammars
from bargein.engine.request import FinishReason, RequestOutput, Usage
from bargein.engine.sampling import SamplingParams
from bargein.loader.chat_template import render_chat_template
from bargein.server.reasoning import AnswerParser, Thinking
from bargein.server.thinking_switch import budget_constraint
from bargein.server.tool_syntax import LLAMA3, MISTRAL, QWEN3_XML, tool_syntax_for
from bargein.server.tools import tool_plan
from tests.engine.test_engine import run_until_finished
from tests.server.inprocess_app import inprocess_app
from tests.server.test_prompt_markers import TOOL_CALL as MARKER_TOOL_CALL
from tests.server.test_prompt_markers import marker_tokenizer
from tests.server.test_tool_syntax_xml import QWEN3_CODER_TEMPLATE, CoderByteTokenizer
from tests.tiny_engine import ByteTokenizer, collector, tiny_engine

TIME = {"type": "object", "properties": {
    "zone": {"enum": ["UTC", "CET"]}, "hours": {"type": "integer", "minimum": 0, "maximum": 99},
    "note": {"type": "string", "maxLength": 6}}, "required": ["zone", "hours"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": TIME}},
                {"type": "function", "function": {"name": "get_date", "parameters": {"type": "object"}}}]
NAMED = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "time?"}]
GREEDY = {"temperature": 0, "return_token_ids": True}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def coder() -> AsyncIterator[httpx.AsyncClient]:
    core = with_tokenizer(tiny_engine(num_blocks=512), CoderByteTokenizer())
    async with inprocess_app(core, timeout=120) as (_, client):
        yield client


def with_tokenizer(core: Engine, tokenizer) -> Engine:
    """``core`` with another tokenizer of its 260 tokens, its grammars' token table included."""
    core.tokenizer = tokenizer
    core.grammars = Grammars(tokenizer, core.model_config.vocab_size, core.eos_token_ids)
    return core


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def check_xml_call(name: str, arguments: str, token_ids: list[int]) -> None:
    """Declared parameters only, the required ones present, and the tokens are the call in XML."""
    args = json.loads(arguments)
    assert name == "get_time" and {"zone", "hours"} <= set(args) <= set(TIME["properties"]), args
    assert args["zone"] in ("UTC", "CET") and 0 <= args["hours"] <= 99
    assert ByteTokenizer().decode(token_ids) == QWEN3_XML.write([(name, arguments)])


@pytest.mark.anyio
@pytest.mark.parametrize("choice", [NAMED, "required"])
async def test_chat_forces_the_xml_call_streamed_and_not(coder, choice):
    body = {"messages": ASK, "tools": OPENAI_TOOLS[:1] if choice == "required" else OPENAI_TOOLS,
            "tool_choice": choice, "max_tokens": 200, **GREEDY}
    choice_body = (await coder.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert choice_body["finish_reason"] == "tool_calls", choice_body
    [call] = choice_body["message"]["tool_calls"]
    check_xml_call(call["function"]["name"], call["function"]["arguments"], choice_body["token_ids"])
    chunks = sse((await coder.post("/v1/chat/completions", json={**body, "stream": True})).text)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    pieces = [d["delta"]["tool_calls"][0] for d in deltas if d["delta"].get("tool_calls")]
    assert pieces[0]["function"]["name"] == "get_time"
    assert "".join(p["function"].get("arguments", "") for p in pieces) == call["function"]["arguments"]
    assert deltas[-1]["finish_reason"] == "tool_calls" and deltas[-1]["token_ids"] == choice_body["token_ids"]


@pytest.mark.anyio
async def test_responses_force_the_xml_call_streamed_and_not(coder):
    tools = [{"type": "function", "name": "get_time", "parameters": TIME}]
    body = {"input": "time?", "tools": tools, "tool_choice": {"type": "function", "name": "get_time"},
            "max_output_tokens": 200, **GREEDY}
    response = (await coder.post("/v1/responses", json=body)).json()
    [item] = response["output"]
    assert item["type"] == "function_call" and response["status"] == "completed"
    check_xml_call(item["name"], item["arguments"], response["token_ids"])
    events = sse((await coder.post("/v1/responses", json={**body, "stream": True})).text)
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert streamed == item["arguments"]
    assert events[-1]["response"]["token_ids"] == response["token_ids"]


@pytest.mark.anyio
async def test_messages_force_the_xml_call_streamed_and_not(coder):
    body = {"model": "m", "max_tokens": 200, "messages": ASK, "tools": [
        {"name": "get_time", "input_schema": TIME}], "tool_choice": {"type": "tool", "name": "get_time"},
        "temperature": 0}
    message = (await coder.post("/v1/messages", json=body)).json()
    [block] = message["content"]
    assert block["type"] == "tool_use" and message["stop_reason"] == "tool_use", message
    arguments = json.dumps(block["input"], separators=(",", ":"))
    args = json.loads(arguments)
    assert {"zone", "hours"} <= set(args) <= set(TIME["properties"])
    events = sse((await coder.post("/v1/messages", json={**body, "stream": True})).text)
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == block["input"]


@pytest.mark.anyio
async def test_the_xml_calls_tag_is_the_models_marker_token():
    """With Qwen's tokenizer conventions (``<tool_call>`` an added token, not special), the
    forced call opens with that token, which the parser reads as the marker."""
    tokenizer = replace(marker_tokenizer(), chat_template=QWEN3_CODER_TEMPLATE)
    core = with_tokenizer(tiny_engine(num_blocks=256), tokenizer)
    body = {"messages": ASK, "tools": OPENAI_TOOLS, "tool_choice": NAMED, "max_tokens": 200, **GREEDY}
    async with inprocess_app(core, timeout=120) as (_, client):
        choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["token_ids"][0] == MARKER_TOOL_CALL and choice["token_ids"].count(MARKER_TOOL_CALL) == 1
    [call] = choice["message"]["tool_calls"]
    assert tokenizer.decode(choice["token_ids"]) == QWEN3_XML.write([("get_time", call["function"]["arguments"])])
    check_xml_call(call["function"]["name"], call["function"]["arguments"],
                   list(tokenizer.decode(choice["token_ids"]).encode()))


# -- special-token markers -----------------------------------------------------------------------
TOOL_CALLS, THINK, END_THINK = 257, 258, 259
SPECIAL = {TOOL_CALLS: "[TOOL_CALLS]", THINK: "[THINK]", END_THINK: "[/THINK]"}
MISTRAL_TEMPLATE = ("{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}"
                    "{% if tools %}[AVAILABLE_TOOLS]{% for t in tools %}{{ t.function.name }} {% endfor %}[/AVAILABLE_TOOLS]{% endif %}"
                    "{# calls: [TOOL_CALLS][...] #}")


class MistralByteTokenizer(ByteTokenizer):
    """Bytes, with Mistral's markers as special tokens: decoding leaves them out."""

    chat_template = MISTRAL_TEMPLATE
    special_texts = tuple(SPECIAL.values())

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids, at = [], 0
        while at < len(text):
            hit = next(((i, m) for i, m in SPECIAL.items() if text.startswith(m, at)), None)
            ids += [hit[0]] if hit else list(text[at].encode())
            at += len(hit[1]) if hit else 1
        return ids

    def token_bytes(self, token_id: int, *, skip_special_tokens: bool = True) -> bytes:
        if token_id in SPECIAL:
            return b"" if skip_special_tokens else SPECIAL[token_id].encode()
        return super().token_bytes(token_id, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, *, add_generation_prompt=True, tools=None, **extra) -> str:
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, **extra)


TOK = MistralByteTokenizer()
CALL = '[{"name": "f", "arguments": {"x": 1}}]'
FORGED = f"I would write [TOOL_CALLS]{CALL} here. "


def outputs(ids: list[int], keeps_special: bool) -> list[RequestOutput]:
    """One output per token, its text as the detokenizer makes it; the last one final."""
    text = TOK.decode(ids, skip_special_tokens=not keeps_special)
    return [RequestOutput("r-0", (t,), tuple(ids) if i == len(ids) - 1 else (),
                          TOK.token_bytes(t, skip_special_tokens=not keeps_special).decode(),
                          text if i == len(ids) - 1 else "", i == len(ids) - 1,
                          FinishReason.STOP if i == len(ids) - 1 else None, Usage(3, i + 1, 0))
            for i, t in enumerate(ids)]


def parsed(ids: list[int], keeps_special: bool, streamed: bool, thinking: Thinking | None = None) -> AnswerParser:
    parser = AnswerParser(thinking, {"f"}, MISTRAL, TOK, keeps_special)
    if streamed:
        for out in outputs(ids, keeps_special):
            parser.feed(out.delta_text, final=out.finished, token_ids=out.new_token_ids)
    else:
        parser.feed(TOK.decode(ids, skip_special_tokens=not keeps_special), final=True, token_ids=ids)
    return parser


ANSWERS = [  # (token ids, content, calls)
    (list(FORGED.encode()), FORGED, []),  # the marker's text, written in bytes: text
    ([TOOL_CALLS, *CALL.encode()], "", [("f", '{"x": 1}')]),
    ([*FORGED.encode(), TOOL_CALLS, *CALL.encode()], FORGED, [("f", '{"x": 1}')]),
    ([TOOL_CALLS, *b"not a call"], "[TOOL_CALLS]not a call", []),  # a marker with no call after it
]


@pytest.mark.parametrize("ids,content,calls", ANSWERS)
@pytest.mark.parametrize("keeps_special", [False, True])
@pytest.mark.parametrize("streamed", [False, True])
def test_only_the_special_token_opens_calls(ids, content, calls, keeps_special, streamed):
    parser = parsed(ids, keeps_special, streamed)
    expected = content if keeps_special else content.replace("[TOOL_CALLS]not", "not")  # left out, unless kept
    assert parser.text == expected
    assert [(c.name, c.arguments) for c in parser.calls] == calls


@pytest.mark.parametrize("keeps_special", [False, True])
@pytest.mark.parametrize("streamed", [False, True])
def test_only_the_special_tokens_mark_a_thought_and_count_in_it(streamed, keeps_special):
    ids = [THINK, *b"I quote [/THINK] here", END_THINK, *b"Answer."]
    parser = parsed(ids, keeps_special, streamed, Thinking("[THINK]", "[/THINK]", False))
    assert (parser.reasoning, parser.text) == ("I quote [/THINK] here", "Answer.")
    assert parser.thought_tokens(TOK, ids) == len(ids) - len(b"Answer.")  # both markers' tokens included


def test_the_thinking_budget_writes_a_special_closing_marker_as_its_token():
    engine = with_tokenizer(tiny_engine(num_blocks=64), TOK)
    constraint = budget_constraint(Thinking("[THINK]", "[/THINK]", True), 5, TOK)
    assert f"<[{END_THINK}]>" in constraint.text
    rid = collector(engine).add_request(list(b"[INST]Why?[/INST][THINK]"), SamplingParams(
        temperature=0, max_tokens=9, constraint=constraint))
    final = next(o for o in run_until_finished(engine, rid) if o.finished)
    assert final.token_ids[5] == END_THINK and END_THINK not in final.token_ids[:5]


def test_the_forced_frame_writes_the_special_token():
    syntax = tool_syntax_for(MISTRAL_TEMPLATE, TOK)
    assert (syntax.name, syntax.open_token) == ("mistral", TOOL_CALLS)
    assert tool_syntax_for(MISTRAL_TEMPLATE).open_token is None  # no tokenizer: nothing to bind
    constraint = tool_plan(OPENAI_TOOLS[:1], NAMED, syntax).constraint()
    assert constraint.text.startswith(f'start: <[{TOOL_CALLS}]> "[" call "]"')


@pytest.mark.anyio
@pytest.mark.parametrize("skip_special_tokens", [True, False])
async def test_a_forced_call_writes_the_token_and_comes_back_as_a_call(skip_special_tokens):
    core = with_tokenizer(tiny_engine(num_blocks=256), TOK)
    body = {"messages": ASK, "tools": OPENAI_TOOLS, "tool_choice": NAMED, "max_tokens": 120,
            "skip_special_tokens": skip_special_tokens, **GREEDY}
    async with inprocess_app(core, timeout=120) as (_, client):
        choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["token_ids"][0] == TOOL_CALLS  # the token, not its text in bytes
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_time"
        # No text besides the call (kept special tokens: the tiny tokenizer spells EOS "<256>").
        assert choice["message"]["content"] == (None if skip_special_tokens else "<256>")
        args = json.loads(call["function"]["arguments"])
        assert {"zone", "hours"} <= set(args) <= set(TIME["properties"])
        deltas = [c["choices"][0] for c in sse((await client.post("/v1/chat/completions", json={
            **body, "stream": True})).text) if c["choices"]]
        pieces = [d["delta"]["tool_calls"][0] for d in deltas if d["delta"].get("tool_calls")]
        assert "".join(p["function"].get("arguments", "") for p in pieces) == call["function"]["arguments"]
        assert "".join(d["delta"].get("content") or "" for d in deltas) == (choice["message"]["content"] or "")
        message = (await client.post("/v1/messages", json={
            "model": "m", "max_tokens": 120, "messages": ASK, "temperature": 0,
            "tools": [{"name": "get_time", "input_schema": TIME}], "tool_choice": {"type": "any"}})).json()
        assert [b["type"] for b in message["content"]] == ["tool_use"] and message["stop_reason"] == "tool_use"


class LlamaByteTokenizer(MistralByteTokenizer):
    """Bytes, with Llama 3's ``<|python_tag|>`` as the special token 257."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [257] if text == "<|python_tag|>" else list(text.encode())

    def token_bytes(self, token_id: int, *, skip_special_tokens: bool = True) -> bytes:
        if token_id == 257:
            return b"" if skip_special_tokens else b"<|python_tag|>"
        return ByteTokenizer.token_bytes(self, token_id, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("streamed", [False, True])
def test_llama3s_python_tag_is_read_by_its_id(streamed):
    tok, call = LlamaByteTokenizer(), b'{"name": "f", "parameters": {"x": 1}}'
    for ids, content, calls in (([257, *call], "", [("f", '{"x": 1}')]),
                                ([*b"Sure: <|python_tag|>", *call], "Sure: <|python_tag|>" + call.decode(), [])):
        parser = AnswerParser(None, {"f"}, LLAMA3, tok)
        pieces = [([t], tok.token_bytes(t).decode()) for t in ids] if streamed else [(ids, tok.decode(ids))]
        for i, (new, text) in enumerate(pieces):
            parser.feed(text, final=i == len(pieces) - 1, token_ids=new)
        assert (parser.text, [(c.name, c.arguments) for c in parser.calls]) == (content, calls)
