"""Forced tool calls in Qwen3-Coder's XML finish within ``max_tokens`` (issue 32, item 5).

A string parameter is free text between its tags, which the tiny random-weight model never
closes on its own: in the budget's last tokens the engine steers the call to its end
(``engine/xml_steering``). Every answer, greedy and sampled, tight budget or roomy, ends
``tool_calls`` with a call that parses, holds only declared parameters and every required
one; and steering waits for the budget's end: a larger budget gives the same tokens until
the smaller one's last ``needed + STEER_MARGIN`` tokens.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from bargein.engine.json_steering import STEER_MARGIN
from bargein.server.tool_syntax import QWEN3_XML
from tests.server.inprocess_app import inprocess_app
from tests.server.test_forced_call_syntax import with_tokenizer
from tests.server.test_tool_syntax_xml import CoderByteTokenizer
from tests.tiny_engine import ByteTokenizer, tiny_engine

TEXT = {"type": "string"}
SCHEMAS = {
    "write_file": {"type": "object", "properties": {"path": TEXT, "mode": {"enum": ["w", "a"]}, "content": TEXT},
                   "required": ["path", "content"]},
    "search": {"type": "object", "properties": {"query": TEXT, "limit": {"type": "integer"},
                                                "filters": {"type": "object"}}, "required": ["query", "filters"]},
    "note": {"type": "object", "properties": {"title": TEXT, "tags": {"type": "array", "items": TEXT}, "body": TEXT},
             "required": ["body"]},
}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in SCHEMAS.items()]
ASK = [{"role": "user", "content": "do it"}]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def coder() -> AsyncIterator[httpx.AsyncClient]:
    core = with_tokenizer(tiny_engine(num_blocks=1024), CoderByteTokenizer())
    async with inprocess_app(core, timeout=300) as (_, client):
        yield client


def check_call(choice: dict) -> tuple[str, dict]:
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
    schema = SCHEMAS[name]
    assert set(schema["required"]) <= set(args) <= set(schema["properties"]), args
    assert ByteTokenizer().decode(choice["token_ids"]) == QWEN3_XML.write([(name, call["function"]["arguments"])])
    return name, args


async def chat(client: httpx.AsyncClient, **body) -> dict:
    response = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS,
                                                              "return_token_ids": True, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


@pytest.mark.anyio
async def test_every_forced_call_finishes_within_its_budget(coder):
    """Named and ``required`` choices, greedy and sampled, budgets from tight to roomy: one batch."""
    requests = []
    for name in SCHEMAS:
        for max_tokens in (150, 200, 300):
            requests.append({"tool_choice": {"type": "function", "function": {"name": name}},
                             "max_tokens": max_tokens, "temperature": 0})
    for seed in range(4):
        requests.append({"tool_choice": "required", "max_tokens": 220, "temperature": 1.0, "seed": seed})
    choices = await asyncio.gather(*(chat(coder, **body) for body in requests))
    for body, choice in zip(requests, choices, strict=True):
        name, _ = check_call(choice)
        assert len(choice["token_ids"]) <= body["max_tokens"]
        if isinstance(body["tool_choice"], dict):
            assert name == body["tool_choice"]["function"]["name"]


@pytest.mark.anyio
async def test_steering_waits_for_the_end_of_the_budget(coder):
    """Greedy: a larger budget writes the same tokens until the smaller one starts steering,
    and the smaller one needed it (it differs from the larger one's tokens there)."""
    forced = {"tool_choice": {"type": "function", "function": {"name": "write_file"}}, "temperature": 0}
    small, large = await asyncio.gather(chat(coder, max_tokens=160, **forced), chat(coder, max_tokens=400, **forced))
    check_call(small)
    check_call(large)
    same = next(i for i, (a, b) in enumerate(zip(small["token_ids"], large["token_ids"], strict=False)) if a != b)
    # From a value of "path": its closing tag (14), "content" (18 + 14 + 1), </function> and </tool_call> (24).
    assert 160 - same <= 14 + 33 + 24 + 1 + STEER_MARGIN, (same, small["token_ids"])
