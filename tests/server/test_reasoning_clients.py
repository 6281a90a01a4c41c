"""Reasoning through the official clients (``openai``, ``anthropic``, ``ollama``), on a real
server on loopback around the tiny thinking model (``test_reasoning``'s template, whose
generation prompt opens a thought unless ``enable_thinking`` is false; its random weights
never close one).

The Responses API's ``reasoning.effort``: ``none`` switches thinking off as chat's
``reasoning_effort`` does, any other level on, ``reasoning_tokens`` count the thought, the
effort is echoed, a bad level is a 400 naming ``reasoning.effort``, and an incomplete
answer continues under the switch it was made with. Then the same greedy thought through
every client, streamed and not: chat's ``reasoning_content``, Messages' thinking blocks
(and a text block with ``thinking`` disabled), Ollama's ``message.thinking`` (``think``).
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import ollama
import openai
import pytest

from tests.server.test_reasoning import ThinkingByteTokenizer
from tests.server.tiny_live_server import TinyServer, tiny_live_server
from tests.tiny_engine import ByteTokenizer

EXTRA = {"ignore_eos": True, "return_token_ids": True}
CLOSED, OPENED = "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<|im_start|>assistant\n<think>\n"


@pytest.fixture(scope="module")
def server() -> Iterator[TinyServer]:
    with tiny_live_server(ThinkingByteTokenizer()) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: TinyServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def create(client: openai.OpenAI, **fields) -> dict:
    response = client.responses.create(model="tiny", input="Why?", max_output_tokens=5, temperature=0,
                                       extra_body=EXTRA, **fields)
    return response.to_dict()


def prompt_text(response: dict) -> str:
    return ByteTokenizer().decode(response["prompt_token_ids"])


def test_effort_none_switches_thinking_off(client):
    off = create(client, reasoning={"effort": "none"})
    assert prompt_text(off).endswith(CLOSED)  # the template's own switch, enable_thinking=False
    assert off["usage"]["output_tokens"] == 5 and off["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    assert [item["type"] for item in off["output"]] == ["message"]
    assert off["reasoning"] == {"effort": "none", "summary": None}


@pytest.mark.parametrize("effort", ["minimal", "low", "medium", "high", None])
def test_every_other_level_and_no_effort_think(client, effort):
    on = create(client, **({"reasoning": {"effort": effort}} if effort else {}))
    assert prompt_text(on).endswith(OPENED)
    assert on["usage"]["output_tokens_details"] == {"reasoning_tokens": 5}  # the thought is never closed
    assert [item["type"] for item in on["output"]][0] == "reasoning"
    assert on["reasoning"]["effort"] == effort


def test_a_bad_level_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, reasoning={"effort": "max"})
    assert info.value.status_code == 400 and info.value.body["param"] == "reasoning.effort"
    assert "'none'" in info.value.body["message"]


def test_an_incomplete_answer_continues_under_its_own_switch(client):
    off = create(client, reasoning={"effort": "none"})
    assert off["status"] == "incomplete"
    more = client.responses.create(model="tiny", input=[], previous_response_id=off["id"], max_output_tokens=3,
                                   temperature=0, extra_body=EXTRA).to_dict()
    assert more["prompt_token_ids"] == off["prompt_token_ids"] + off["token_ids"]  # the same answer, token for token
    assert more["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}  # still outside a thought
    assert more["reasoning"]["effort"] == "none"


# -- the same thought through every client ---------------------------------------------------------
ASK = [{"role": "user", "content": "Why?"}]
N = 6


@pytest.fixture(scope="module")
def thought(client) -> dict:
    """The greedy answer to ASK on chat completions: all of it thought."""
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=N, temperature=0, extra_body=EXTRA)
    return r.to_dict()


def test_chat_returns_the_thought_as_reasoning_content_streamed_and_not(client, thought):
    [choice] = thought["choices"]
    text = ByteTokenizer().decode(choice["token_ids"]).strip()
    assert choice["message"]["reasoning_content"] == text and text and choice["message"]["content"] == ""
    assert thought["usage"]["completion_tokens_details"]["reasoning_tokens"] == N
    chunks = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=N, temperature=0, stream=True,
                                            extra_body=EXTRA)
    deltas = [c.choices[0].delta.model_extra.get("reasoning_content") for c in chunks if c.choices]
    assert "".join(d for d in deltas if d) == text


def test_messages_return_a_thinking_block_streamed_and_not(server, thought):
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    text = thought["choices"][0]["message"]["reasoning_content"]
    fields = {"model": "tiny", "max_tokens": N, "messages": ASK, "extra_body": {"temperature": 0, "ignore_eos": True}}
    message = claude.messages.create(**fields)  # the template's default: thinking
    [block] = message.content
    assert block.type == "thinking" and block.thinking == text and block.signature
    with claude.messages.stream(**fields) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [block.model_dump()]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-1] == "message_stop"
    off = claude.messages.create(**fields, thinking={"type": "disabled"})
    [text_block] = off.content
    assert text_block.type == "text" and text_block.text  # no thought opened: the answer is text


def test_ollama_returns_message_thinking_streamed_and_not(server, thought):
    llama = ollama.Client(host=server.base_url, timeout=60)
    text = thought["choices"][0]["message"]["reasoning_content"]
    options = {"temperature": 0, "num_predict": N}
    whole = llama.chat(model="tiny", messages=ASK, think=True, options=options)
    assert whole.message.thinking == text and whole.message.content == ""
    parts = list(llama.chat(model="tiny", messages=ASK, think=True, stream=True, options=options))
    assert "".join(p.message.thinking or "" for p in parts) == text and parts[-1].done
    off = llama.chat(model="tiny", messages=ASK, think=False, options=options)
    assert not off.message.thinking and off.message.content


def test_responses_stream_the_reasoning_item_first(client, thought):
    text = thought["choices"][0]["message"]["reasoning_content"]
    events = list(client.responses.create(model="tiny", input=ASK, max_output_tokens=N, temperature=0, stream=True,
                                          extra_body=EXTRA))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added[0] == "reasoning"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == text
    final = events[-1].response
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == text
    assert final.usage.output_tokens_details.reasoning_tokens == N
