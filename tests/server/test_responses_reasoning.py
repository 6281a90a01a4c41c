"""The Responses API's ``reasoning.effort`` through the official ``openai`` client, on a real
server on loopback around the tiny thinking model (``test_reasoning``'s template, whose
generation prompt opens a thought unless ``enable_thinking`` is false; its random weights
never close one): ``none`` switches thinking off as chat's ``reasoning_effort`` does, any
other level on, ``reasoning_tokens`` count the thought, the effort is echoed, a bad level
is a 400 naming ``reasoning.effort``, and an incomplete answer continues under the
switch it was made with."""

from __future__ import annotations

from collections.abc import Iterator

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
