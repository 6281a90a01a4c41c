"""Structured outputs on the real server, through the official ``openai`` client.

Every answer parses and validates (``jsonschema``), or ends with ``length`` and is a
prefix its grammar accepts (checked by replaying its token ids, from the
``return_token_ids`` extension, into a fresh matcher).
"""

from __future__ import annotations

import functools
import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

from bargein.engine.constraint import Constraint
from bargein.engine.grammar import Grammars

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("check_kv")]
MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a pet as JSON."}]
NAME = {"type": "string", "maxLength": 12}
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "owner": {"type": "object", "properties": {"name": NAME, "city": NAME}, "required": ["name", "city"],
                  "additionalProperties": False}}, "required": ["owner"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1,
                                                        "maxItems": 3}},
              "required": ["tags"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "bird"]}}, "required": ["kind"],
             "additionalProperties": False},
    "bounds": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 1, "maximum": 30},
                                                "weight": {"type": "number", "minimum": 0.5, "maximum": 80}},
               "required": ["age", "weight"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"name": NAME, "nickname": NAME, "vaccinated": {"type": "boolean"}},
                 "required": ["name", "vaccinated"], "additionalProperties": False},
}


@pytest.fixture
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@functools.cache
def grammars() -> Grammars:
    from bargein.loader import load_tokenizer, resolve_model_ref

    tokenizer = load_tokenizer(resolve_model_ref(None))
    return Grammars(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def check_answer(text: str, finish_reason: str, token_ids: list[int], schema: dict) -> None:
    if finish_reason == "stop":
        jsonschema.validate(json.loads(text), schema)
    else:
        assert finish_reason == "length"
        grammars().matcher(Constraint.json_schema(schema), token_ids)  # raises unless a valid prefix


def json_schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schemas_greedy_and_sampled(client, name):
    schema = SCHEMAS[name]
    stops = 0
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        c = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, n=1,
                                           response_format=json_schema_format(name, schema),
                                           extra_body={"return_token_ids": True}, **sampling)
        [choice] = c.choices
        check_answer(choice.message.content, choice.finish_reason, choice.model_extra["token_ids"], schema)
        stops += choice.finish_reason == "stop"
    assert stops >= 1


def test_json_mode_streamed_equals_plain(client):
    fmt = {"type": "json_object"}
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0,
                                           response_format=fmt, extra_body={"return_token_ids": True})
    [choice] = plain.choices
    check_answer(choice.message.content, choice.finish_reason, choice.model_extra["token_ids"], {"type": "object"})
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0,
                                            response_format=fmt, stream=True)
    pieces, finish = [], None
    for chunk in stream:
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(pieces) == choice.message.content and finish == choice.finish_reason


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    kind: str = pydantic.Field(json_schema_extra={"enum": ["cat", "dog"]})
    age: int = pydantic.Field(ge=0, le=20)


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=80, temperature=0,
                                               response_format=Pet)
    [choice] = completion.choices
    assert choice.finish_reason == "stop"
    pet = choice.message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog") and 0 <= pet.age <= 20


def test_completions_and_responses_take_a_schema(client):
    schema = SCHEMAS["enum"]
    c = client.completions.create(model=MODEL, prompt="A pet as JSON:", max_tokens=40, temperature=0,
                                  extra_body={"response_format": json_schema_format("pet", schema),
                                              "return_token_ids": True})
    [choice] = c.choices
    check_answer(choice.text, choice.finish_reason, choice.model_extra["token_ids"], schema)
    r = client.responses.create(model=MODEL, input="Describe a pet as JSON.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "pet", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_unsupported_schema_is_a_400_naming_it(live_server, client):
    schema = {"type": "object", "properties": {"x": {"type": "string", "not": {"const": "a"}}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=0,
                                       response_format=json_schema_format("x", schema))
    error = info.value.body
    assert error["param"] == "response_format.json_schema.schema" and '"not"' in error["message"]
    url = f"{live_server.base_url}/v1/responses"
    r = httpx.post(url, json={"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                  "schema": schema}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema"
    r = httpx.post(f"{live_server.base_url}/v1/chat/completions",
                   json={"messages": ASK, "response_format": {"type": "json_object"}, "min_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


# -- cancel, then continue the same answer through the Responses API ------------------------------------
PET_FORMAT = {"type": "json_schema", "name": "pet", "schema": SCHEMAS["nested"], "strict": True}


def _create(client, **kwargs):
    return client.responses.create(model=MODEL, temperature=0, extra_body={"return_token_ids": True}, **kwargs)


def _continue_to_the_end(client, first) -> tuple[list[int], str, list]:
    """Continues ``first``'s answer (empty input) until it completes; its ids, text and the responses."""
    ids, text, chain = list(first.model_extra["token_ids"]), first.output_text, [first]
    while chain[-1].status != "completed":
        prev = chain[-1]
        nxt = _create(client, previous_response_id=prev.id, input=[], max_output_tokens=80)
        # The prompt is the previous prompt and answer, token for token (the cache covers it).
        assert nxt.model_extra["prompt_token_ids"] == prev.model_extra["prompt_token_ids"] + prev.model_extra[
            "token_ids"]
        assert nxt.usage.input_tokens_details.cached_tokens >= (nxt.usage.input_tokens - 1) // 16 * 16
        assert nxt.text.format.type == "json_schema"  # the format carries over
        ids += nxt.model_extra["token_ids"]
        text += nxt.output_text
        chain.append(nxt)
    return ids, text, chain


def test_cancelled_constrained_answer_continues_token_for_token(client, live_server):
    whole = _create(client, input="Describe a pet's owner as JSON.", max_output_tokens=80, text={"format": PET_FORMAT})
    assert whole.status == "completed"
    jsonschema.validate(json.loads(whole.output_text), SCHEMAS["nested"])
    expected = whole.model_extra["token_ids"]

    # Cut by max_output_tokens, then continued (twice) to the end.
    cut = _create(client, input="Describe a pet's owner as JSON.", max_output_tokens=4, text={"format": PET_FORMAT})
    assert cut.status == "incomplete" and cut.model_extra["token_ids"] == expected[:4]
    ids, text, chain = _continue_to_the_end(client, cut)
    assert ids == expected and text == whole.output_text and len(chain) >= 2

    # Cancelled mid-stream by id, then continued. A client that reads the stream late (the
    # suite's load) can send the cancel after the last token: then the stream is run again.
    for _ in range(3):
        deltas, response_id = 0, None
        with client.responses.create(model=MODEL, input="Describe a pet's owner as JSON.", max_output_tokens=80,
                                     temperature=0, text={"format": PET_FORMAT}, stream=True) as stream:
            for event in stream:
                if event.type == "response.created":
                    response_id = event.response.id
                elif event.type == "response.output_text.delta":
                    deltas += 1
                    if deltas == 3:
                        httpx.post(f"{live_server.base_url}/v1/responses/{response_id}/cancel", timeout=30)
        cancelled = client.responses.retrieve(response_id)
        if cancelled.status != "completed":
            break
    assert cancelled.status == "cancelled", "the answer finished before the cancel landed, three times"
    # retrieve has no return_token_ids: the partial answer's ids are the uninterrupted run's prefix
    partial = len(cancelled.output_text)
    assert whole.output_text.startswith(cancelled.output_text) and 0 < partial < len(whole.output_text)
    nxt = _create(client, previous_response_id=response_id, input=[], max_output_tokens=80)
    assert nxt.status == "completed"
    assert cancelled.output_text + nxt.output_text == whole.output_text
    done = len(nxt.model_extra["prompt_token_ids"]) - len(cut.model_extra["prompt_token_ids"])
    assert expected[:done] + nxt.model_extra["token_ids"] == expected  # token for token
    assert nxt.model_extra["prompt_token_ids"][-done:] == expected[:done]
    jsonschema.validate(json.loads(cancelled.output_text + nxt.output_text), SCHEMAS["nested"])

    # A completed answer is not continued in place; a new turn starts a new constrained answer.
    with pytest.raises(openai.BadRequestError) as info:
        _create(client, previous_response_id=nxt.id, input=[], max_output_tokens=5)
    assert info.value.body["param"] == "input"
    again = _create(client, previous_response_id=nxt.id, input="Another one.", max_output_tokens=80,
                    text={"format": PET_FORMAT})
    assert again.status in ("completed", "incomplete") and again.output_text.startswith("{")
