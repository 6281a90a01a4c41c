"""Reasoning content: thoughts split from answers, on every API, for a tiny model whose
chat template marks thinking.

The tiny model's template opens a thought in the generation prompt (``<think>\\n``, as
Qwen3's thinking templates and DeepSeek-R1's do), closes an empty one when
``enable_thinking`` is false, and, like Qwen3's, strips the thoughts of earlier turns
from the history. Random weights never write ``</think>``, so an answer is one thought
that runs to ``max_tokens``: its text must come back as reasoning, token for token what
``--reasoning-format none`` returns as content. Answers that close their thought midway
are checked on the shapes themselves, event by event, with outputs made here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from bargein.engine.request import FinishReason, RequestOutput, Usage
from bargein.loader.chat_template import render_chat_template
from bargein.server.anthropic.shape import MessagesShape, signature
from bargein.server.generation import Slot
from bargein.server.ollama.shape import OllamaShape
from bargein.server.openai_stream import ChatShape
from bargein.server.reasoning import (
    ReasoningDelta,
    ReasoningSplitter,
    Thinking,
    parse_answer,
    thinking_for,
)
from bargein.server.settings import ServerSettings, SettingsError
from bargein.server.tool_syntax import HERMES
from tests.server.inprocess_app import inprocess_app
from tests.tiny_engine import ByteTokenizer, tiny_engine

THINKING_TEMPLATE = (
    "{% set ns = namespace(last_user=0) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and loop.index0 > ns.last_user and m.reasoning_content is defined %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)


class ThinkingByteTokenizer(ByteTokenizer):
    """Byte tokens with a chat template that marks thinking."""

    chat_template = THINKING_TEMPLATE

    def apply_chat_template(self, messages, *, add_generation_prompt=True, tools=None, **extra) -> str:
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, **extra)


@asynccontextmanager
async def thinking_app(**settings) -> AsyncIterator[httpx.AsyncClient]:
    core = tiny_engine(num_blocks=256)
    core.tokenizer = ThinkingByteTokenizer()
    async with inprocess_app(core, timeout=60, **settings) as (_, client):
        yield client


GREEDY = {"ignore_eos": True, "temperature": 0}
ASK = [{"role": "user", "content": "Why?"}]


def decoded(ids: list[int]) -> str:
    return ByteTokenizer().decode(ids)


def sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


# -- the splitter ------------------------------------------------------------------------
THINK = Thinking("<think>", "</think>", starts_inside=False)
SPLITS = [  # (thinking, answer text, reasoning, text)
    (THINK, "<think>\nLet me see.\n</think>\n\nIt is 4.", "Let me see.", "It is 4."),
    (Thinking("<think>", "</think>", True), "\nLet me see.\n</think>\n\nIt is 4.", "Let me see.", "It is 4."),
    (Thinking("<think>", "</think>", True), "Still thinking  ", "Still thinking", ""),  # cut mid-thought
    (THINK, "It is 4. <think>no</think>", "", "It is 4. <think>no</think>"),  # a marker after the answer is text
    (THINK, "  <thin", "", "<thin"),  # a marker never completed is text
    (Thinking("[THINK]", "[/THINK]", False), "[THINK]hm[/THINK]Yes", "hm", "Yes"),
]


@pytest.mark.parametrize("thinking,text,reasoning,answer", SPLITS)
def test_every_split_of_an_answer_gives_the_same_thoughts_and_text(thinking, text, reasoning, answer):
    cuts = [[text], list(text) + [""], *([text[:i], text[i:]] for i in range(1, len(text)))]
    for pieces in cuts:
        splitter = ReasoningSplitter(thinking)
        out = []
        for i, piece in enumerate(pieces):
            out += splitter.feed(piece, final=i == len(pieces) - 1)
        assert "".join(p.text for p in out if isinstance(p, ReasoningDelta)) == reasoning, pieces
        assert "".join(p for p in out if isinstance(p, str)) == answer, pieces
    parsed = parse_answer(text, thinking, None)
    assert (parsed.reasoning, parsed.text) == (reasoning, answer)


def test_thinking_follows_the_template_and_the_format():
    assert thinking_for(THINKING_TEMPLATE, "x<think>\n", "separate") == Thinking("<think>", "</think>", True)
    assert thinking_for(THINKING_TEMPLATE, "x<think>\n\n</think>\n\n", "separate").starts_inside is False
    assert thinking_for(THINKING_TEMPLATE, "x<think>\n", "none") is None
    assert thinking_for("{{ messages }}", "x", "separate") is None


def test_thoughts_and_a_call_after_them():
    parsed = parse_answer('<think>call it</think><tool_call>{"name":"f","arguments":{}}</tool_call>', THINK, {"f"})
    assert parsed.reasoning == "call it" and parsed.text == ""
    assert [(c.name, c.arguments) for c in parsed.calls] == [("f", "{}")]


# -- the shapes, event by event ----------------------------------------------------------
PIECES = ["\nabc", "de</thi", "nk>\n\nHel", "lo"]


def outputs() -> list[RequestOutput]:
    outs = []
    for i, piece in enumerate(PIECES):
        last = i == len(PIECES) - 1
        outs.append(RequestOutput("r-0", (i,), tuple(range(len(PIECES))) if last else (), piece,
                                  "".join(PIECES) if last else "", last, FinishReason.STOP if last else None,
                                  Usage(10, i + 1, 4)))
    return outs


SLOT = Slot("r-0", None, 0, 0)
INSIDE = Thinking("<think>", "</think>", True)


def test_chat_streams_reasoning_content_as_its_own_delta():
    shape = ChatShape({"id": "c"}, ByteTokenizer(), logprobs=False, include_usage=False, thinking=INSIDE)
    deltas = []
    for out in outputs():
        deltas += [json.loads(e[6:])["choices"][0]["delta"] for e in shape.content(SLOT, out)]
    assert deltas == [{"reasoning_content": "abc"}, {"reasoning_content": "de"}, {"content": "Hel"}, {"content": "lo"}]


def test_messages_stream_thinking_then_text_blocks():
    shape = MessagesShape("msg_1", "tiny", ByteTokenizer(), eos_token_ids=frozenset({256}), stop_sequences=(),
                          thinking=INSIDE, tool_names=None, syntax=HERMES)
    events = list(shape.opening([SLOT]))
    for out in outputs():
        events += shape.content(SLOT, out)
        if out.finished:
            events += shape.final(SLOT, out)
    events += shape.closing({})
    kinds = [e.split("\n")[0][7:] for e in events]
    data = [json.loads(e.split("\n")[1][6:]) for e in events]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_delta", "content_block_stop", "content_block_start", "content_block_delta",
                     "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert [d["type"] for d in data] == kinds
    assert data[0]["message"]["usage"] == {"input_tokens": 6, "cache_creation_input_tokens": 0,
                                           "cache_read_input_tokens": 4, "output_tokens": 0}
    assert data[2] == {"type": "content_block_start", "index": 0,
                       "content_block": {"type": "thinking", "thinking": "", "signature": ""}}
    assert [d["delta"] for d in data[3:6]] == [{"type": "thinking_delta", "thinking": "abc"},
                                               {"type": "thinking_delta", "thinking": "de"},
                                               {"type": "signature_delta", "signature": signature("abcde")}]
    assert data[7]["content_block"] == {"type": "text", "text": ""} and data[7]["index"] == 1
    assert [d["delta"]["text"] for d in data[8:10]] == ["Hel", "lo"]
    assert data[11]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert data[11]["usage"]["output_tokens"] == 4


def test_ollama_lines_carry_thinking_then_content():
    shape = OllamaShape("tiny", chat=True, received=0.0, thinking=INSIDE, tool_names=None, syntax=HERMES)
    lines = []
    for out in outputs():
        lines += [json.loads(x) for x in shape.content(SLOT, out)]
    assert [line["message"] for line in lines] == [
        {"role": "assistant", "content": "", "thinking": "abc"}, {"role": "assistant", "content": "", "thinking": "de"},
        {"role": "assistant", "content": "Hel"}, {"role": "assistant", "content": "lo"}]


# -- the tiny thinking model, end to end ---------------------------------------------------
@pytest.mark.anyio
async def test_a_thought_comes_back_as_reasoning_token_for_token():
    body = {"messages": ASK, "max_tokens": 12, "return_token_ids": True, **GREEDY}
    async with thinking_app(reasoning_format="none") as client:
        raw = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
    async with thinking_app() as client:
        split = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert split["token_ids"] == raw["token_ids"] and split["prompt_token_ids"] == raw["prompt_token_ids"]
    assert decoded(raw["prompt_token_ids"]).endswith("<|im_start|>assistant\n<think>\n")
    assert "reasoning_content" not in raw["message"]
    assert split["message"]["reasoning_content"] == raw["message"]["content"].strip()
    assert split["message"]["content"] == "" and split["finish_reason"] == "length"
    deltas = [c["choices"][0]["delta"] for c in sse_data(streamed.text) if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}
    assert all(set(d) == {"reasoning_content"} for d in deltas[1:-1])
    assert "".join(d["reasoning_content"] for d in deltas[1:-1]) == split["message"]["reasoning_content"]


@pytest.mark.anyio
async def test_the_thinking_switches():
    async with thinking_app() as client:
        off = {"messages": ASK, "max_tokens": 6, "return_token_ids": True,
               "chat_template_kwargs": {"enable_thinking": False}, **GREEDY}
        r = (await client.post("/v1/chat/completions", json=off)).json()["choices"][0]
        assert decoded(r["prompt_token_ids"]).endswith("<think>\n\n</think>\n\n")
        assert r["message"]["reasoning_content"] is None
        assert r["message"]["content"] == decoded(r["token_ids"]).lstrip()
        bad = await client.post("/v1/chat/completions", json={**off, "chat_template_kwargs": {"enable_thinking": 1}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs.enable_thinking"
        for name in ("self", "messages", "not a name"):
            bad = await client.post("/v1/chat/completions", json={**off, "chat_template_kwargs": {name: 1}})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs", name

        messages = {"model": "tiny", "max_tokens": 6, "messages": ASK, **GREEDY}
        on = (await client.post("/v1/messages", json={**messages, "thinking": {"type": "adaptive"}})).json()
        assert [b["type"] for b in on["content"]] == ["thinking"] and on["stop_reason"] == "max_tokens"
        assert on["content"][0]["signature"] == signature(on["content"][0]["thinking"])
        off_blocks = (await client.post("/v1/messages", json={**messages, "thinking": {"type": "disabled"}})).json()
        assert [b["type"] for b in off_blocks["content"]] == ["text"]

        chat = {"model": "tiny", "messages": ASK, "stream": False, "options": {"num_predict": 6, "temperature": 0}}
        think = (await client.post("/api/chat", json={**chat, "think": True})).json()
        assert think["message"]["content"] == "" and think["message"]["thinking"]
        plain = (await client.post("/api/chat", json={**chat, "think": False})).json()
        assert plain["message"]["content"] and "thinking" not in plain["message"]


@pytest.mark.anyio
async def test_a_cancel_mid_thought_keeps_it_and_the_next_turn_reports_its_reuse_truthfully():
    async with thinking_app() as client:
        ctx = client._transport.app.state.ctx
        first = asyncio.ensure_future(client.post(
            "/v1/chat/completions", headers={"X-Request-Id": "thought-1"},
            json={"messages": ASK, "max_tokens": 400, "return_token_ids": True, **GREEDY}))
        while not first.done():  # cancel once some of the thought was delivered
            live = await client.get("/v1/requests")
            entry = {e["id"]: e for e in live.json()["data"]}.get("thought-1")
            if entry is not None and entry.get("completion_tokens", 0) >= 3:
                break
            await asyncio.sleep(0.01)
        assert (await client.post("/v1/requests/thought-1/cancel")).status_code == 200
        choice = (await first).json()["choices"][0]
        assert choice["finish_reason"] == "cancelled" and choice["cancel_reason"] == "user"
        assert 3 <= len(choice["token_ids"]) < 400
        thought = choice["message"]["reasoning_content"]
        assert thought == decoded(choice["token_ids"]).strip() and choice["message"]["content"] == ""

        # The template strips earlier thoughts: the new prompt shares the old one up to the
        # assistant's turn only, and the reuse reported is exactly that shared prefix.
        history = [*ASK, {"role": "assistant", "content": "", "reasoning_content": thought},
                   {"role": "user", "content": "Go on."}]
        nxt = (await client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 2,
                                                                "return_token_ids": True, **GREEDY})).json()
        before = choice["prompt_token_ids"] + choice["token_ids"]
        new = nxt["choices"][0]["prompt_token_ids"]
        assert thought not in decoded(new)
        shared = next(i for i, (a, b) in enumerate(zip(before, new, strict=False)) if a != b)
        assert shared < len(choice["prompt_token_ids"])
        assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] == shared

        messages = [{"role": "user", "content": "Why?"},
                    {"role": "assistant", "content": [{"type": "thinking", "thinking": thought, "signature": ""},
                                                      {"type": "text", "text": ""}]},
                    {"role": "user", "content": "Go on."}]
        again = (await client.post("/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": messages,
                                                         **GREEDY})).json()
        usage = again["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(new)
        assert usage["cache_read_input_tokens"] >= shared  # the same prompt: now all of it is cached but the last
        assert ctx.engine is not None


@pytest.mark.anyio
async def test_responses_return_a_reasoning_item_first():
    async with thinking_app() as client:
        chat = (await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 6, **GREEDY})).json()
        thought = chat["choices"][0]["message"]["reasoning_content"]
        body = {"input": "Why?", "max_output_tokens": 6, **GREEDY}
        r = (await client.post("/v1/responses", json=body)).json()
        assert [item["type"] for item in r["output"]] == ["reasoning", "message"]
        assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": thought}]
        assert r["output"][1]["content"][0]["text"] == "" and r["status"] == "incomplete"
        streamed = await client.post("/v1/responses", json={**body, "stream": True})
    events = sse_data(streamed.text)
    kinds = [e["type"].removeprefix("response.") for e in events]
    deltas = kinds.count("reasoning_text.delta")
    assert kinds == ["created", "in_progress", "output_item.added", *["reasoning_text.delta"] * deltas,
                     "reasoning_text.done", "output_item.done", "output_item.added", "content_part.added",
                     "output_text.done", "content_part.done", "output_item.done", "incomplete"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == thought
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1]
    without_ids = [[{k: v for k, v in item.items() if k != "id"} for item in output]
                   for output in (events[-1]["response"]["output"], r["output"])]
    assert without_ids[0] == without_ids[1]


def test_the_reasoning_format_setting():
    assert ServerSettings().reasoning_format == "separate"
    assert ServerSettings.from_env({"BARGEIN_REASONING_FORMAT": "none"}).reasoning_format == "none"
    with pytest.raises(SettingsError, match="reasoning format"):
        ServerSettings(reasoning_format="hidden")


def test_ollama_sends_a_call_whole_and_one_cut_short_with_the_last_line():
    shape = OllamaShape("tiny", chat=True, received=0.0, thinking=None, tool_names={"f"}, syntax=HERMES)
    texts = ['<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>', '<tool_call>{"name":"f","arguments":{"b"']
    outs = [RequestOutput("r-0", (0,), (), texts[0], "", False, None, Usage(3, 1, 0)),
            RequestOutput("r-0", (1,), (0, 1), texts[1], "".join(texts), True, FinishReason.LENGTH, Usage(3, 2, 0))]
    lines = [json.loads(x) for x in shape.content(SLOT, outs[0])]
    assert [line["message"].get("tool_calls") for line in lines] == [[{"function": {"name": "f",
                                                                                      "arguments": {"a": 1}}}]]
    assert list(shape.content(SLOT, outs[1])) == []
    [last] = [json.loads(x) for x in shape.final(SLOT, outs[1])]
    assert last["done"] and last["done_reason"] == "length"
    assert last["message"]["tool_calls"] == [{"function": {"name": "f", "arguments": {"_partial_json": '{"b"'}}}]


@pytest.mark.anyio
async def test_a_constrained_answer_has_no_thoughts():
    async with thinking_app() as client:
        body = {"messages": ASK, "max_tokens": 8, "response_format": {"type": "json_object"}, "temperature": 0}
        message = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        assert "reasoning_content" not in message and message["content"].startswith("{")
