"""Usage counts the thoughts' tokens, and Anthropic's thinking budget caps them: chat completions' ``completion_tokens_details`` and
Responses' ``output_tokens_details.reasoning_tokens``.

On the shapes, with outputs made here from byte tokens (one token per character), an
answer that closes its thought midway counts exactly the tokens up to the closing
marker's end, streamed or not, however the deltas are cut. On the tiny thinking model
(``test_reasoning.thinking_app``), whose random weights never close a thought, every
output token is a thought.
"""

from __future__ import annotations

import json

import pytest

import bargein.server.anthropic.request as anthropic_request
from bargein.engine.grammar import check_constraint
from bargein.engine.request import FinishReason, RequestOutput, Usage
from bargein.engine.sampling import SamplingParams
from bargein.server.generation import Slot
from bargein.server.openai_stream import ChatShape
from bargein.server.reasoning import (
    Thinking,
    parse_answer,
    reasoning_token_count,
)
from bargein.server.thinking_switch import budget_constraint
from tests.server.test_reasoning import ASK, GREEDY, ThinkingByteTokenizer, thinking_app
from tests.tiny_engine import ByteTokenizer, collector, run_until_finished, tiny_engine

INSIDE = Thinking("<think>", "</think>", True)
OPENS = Thinking("<think>", "</think>", False)
SLOT = Slot("r-0", None, 0, 0)
ANSWERS = [  # (thinking, answer, tokens of thought)
    (INSIDE, "\nabcde</think>\n\nHello", len("\nabcde</think>")),
    (OPENS, "  <think>hm</think>Yes", len("  <think>hm</think>")),
    (INSIDE, "still thinking when cut", len("still thinking when cut")),
    (OPENS, "No thought. <think>x</think>", 0),
]


def outputs(text: str, cuts: list[int]) -> list[RequestOutput]:
    """The answer as byte-token outputs, cut at ``cuts``; the last one final."""
    ids = list(text.encode())
    bounds = [0, *cuts, len(ids)]
    outs = []
    for i in range(len(bounds) - 1):
        last = i == len(bounds) - 2
        piece = ids[bounds[i]:bounds[i + 1]]
        outs.append(RequestOutput("r-0", tuple(piece), tuple(ids) if last else (), bytes(piece).decode(),
                                  text if last else "", last, FinishReason.STOP if last else None,
                                  Usage(10, bounds[i + 1], 0)))
    return outs


@pytest.mark.parametrize("thinking,answer,expected", ANSWERS)
def test_the_thoughts_tokens_are_counted_however_the_answer_streams(thinking, answer, expected):
    tokenizer = ByteTokenizer()
    parsed = parse_answer(answer, thinking, None)
    assert reasoning_token_count(tokenizer, list(answer.encode()), parsed.thought_chars) == expected
    for cuts in ([], [1], [3, 9], list(range(1, len(answer)))):
        shape = ChatShape({"id": "c"}, tokenizer, logprobs=False, include_usage=True, thinking=thinking)
        for out in outputs(answer, cuts):
            list(shape.content(SLOT, out))
            if out.finished:
                list(shape.final(SLOT, out))
        *_, usage_chunk, done = shape.closing({"completion_tokens": len(answer)})
        usage = json.loads(usage_chunk[6:])["usage"]
        assert usage["completion_tokens_details"] == {"reasoning_tokens": expected}, cuts


def test_no_thinking_no_details():
    shape = ChatShape({"id": "c"}, ByteTokenizer(), logprobs=False, include_usage=True)
    *_, usage_chunk, _ = shape.closing({"completion_tokens": 3})
    assert "completion_tokens_details" not in json.loads(usage_chunk[6:])["usage"]


@pytest.mark.anyio
async def test_a_thought_cut_by_max_tokens_is_all_reasoning_tokens():
    assert ThinkingByteTokenizer.chat_template  # the tiny model's template opens a thought
    async with thinking_app() as client:
        chat = (await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 9, **GREEDY})).json()
        assert chat["usage"]["completion_tokens"] == 9
        assert chat["usage"]["completion_tokens_details"] == {"reasoning_tokens": 9}
        streamed = await client.post("/v1/chat/completions", json={
            "messages": ASK, "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True}, **GREEDY})
        usage = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")][-1]
        assert usage["usage"]["completion_tokens_details"] == {"reasoning_tokens": 9}
        response = (await client.post("/v1/responses", json={"input": "Why?", "max_output_tokens": 7,
                                                             **GREEDY})).json()
        assert response["usage"]["output_tokens"] == 7
        assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 7}
        # OpenAI's reasoning_effort is the thinking switch: "none" closes the thought in the prompt.
        off = (await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, **GREEDY,
                                                               "reasoning_effort": "none",
                                                               "return_token_ids": True})).json()
        assert ByteTokenizer().decode(off["choices"][0]["prompt_token_ids"]).endswith("<think>\n\n</think>\n\n")
        assert off["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
        on = (await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, **GREEDY,
                                                              "reasoning_effort": "low"})).json()
        assert on["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
        bad = await client.post("/v1/chat/completions", json={"messages": ASK, "reasoning_effort": "max"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"


# -- Anthropic's thinking budget ------------------------------------------------------------
def test_the_budget_grammar_closes_the_thought_after_budget_tokens():
    engine = tiny_engine(num_blocks=256)
    engine.tokenizer = ThinkingByteTokenizer()
    prompt_ids = list(b"<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n<think>\n")
    constraint = budget_constraint(INSIDE, 5)
    rid = collector(engine).add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=24, constraint=constraint))
    final = next(o for o in run_until_finished(engine, rid) if o.finished)
    assert bytes(final.token_ids[5:13]) == b"</think>"  # 5 tokens of thought, then the closing marker
    assert len(final.token_ids) == 24 and b"</think>" not in bytes(final.token_ids[:5])
    parsed = parse_answer(final.text, INSIDE, None)
    assert reasoning_token_count(ByteTokenizer(), final.token_ids, parsed.thought_chars) == 13
    check_constraint(budget_constraint(OPENS, 5))  # a thought the answer may open


@pytest.mark.anyio
async def test_messages_thinking_budget_is_enforced(monkeypatch):
    monkeypatch.setattr(anthropic_request, "MIN_THINKING_BUDGET", 4)  # the tiny model's context is 512 tokens
    body = {"model": "m", "max_tokens": 20, "temperature": 0, "messages": ASK,
            "thinking": {"type": "enabled", "budget_tokens": 4}}
    async with thinking_app() as client:
        message = (await client.post("/v1/messages", json=body)).json()
        assert [b["type"] for b in message["content"]] == ["thinking", "text"], message  # 4 byte tokens, then text
        assert message["stop_reason"] == "max_tokens" and message["usage"]["output_tokens"] == 20
        unbudgeted = (await client.post("/v1/messages", json={**body, "thinking": {"type": "adaptive"}})).json()
        assert [b["type"] for b in unbudgeted["content"]] == ["thinking"]  # random weights never close it
        assert len(message["content"][0]["thinking"].encode()) <= 4 < len(unbudgeted["content"][0]["thinking"].encode())
