"""Structured outputs that finish, on the bundled model (issue 32, item 5).

- Forced tool calls with five committed schemas (optional properties, enums, nesting,
  arrays), none of which says ``additionalProperties``: the arguments hold only declared
  properties (the strict reading) and every answer ends ``tool_calls``.
- ``json_object`` on ten committed prompts, greedy and sampled, within 120 tokens: every
  answer parses as a JSON object and ends ``stop`` (steering closes it before the budget).
- A ``json_schema`` without ``name``, and llama.cpp's ``json_object`` + ``schema``, are
  accepted and enforced; an invalid schema there is a 400.

Requests of one check go out together (one batch), so the module takes seconds.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from bargein.server.json_schema import strict_objects

# Ten answers of up to 120 tokens in one batch: seconds on a quiet machine, minutes on a loaded one.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("check_kv"), pytest.mark.timeout(900)]
MODEL = "SmolLM2-135M-Instruct"
CITY = {"type": "string", "maxLength": 20}
TOOL_SCHEMAS = {
    "get_weather": ({"type": "object", "properties": {"city": CITY, "unit": {"enum": ["celsius", "fahrenheit"]}},
                     "required": ["city"]}, "What is the weather in Oslo?"),
    "book_table": ({"type": "object", "properties": {"restaurant": CITY, "people": {"type": "integer", "minimum": 1,
                                                                                    "maximum": 12},
                                                     "time": {"type": "string"}, "notes": {"type": "string"}},
                    "required": ["restaurant", "people"]}, "Book a table for four at Luigi's at 8pm."),
    "set_alarm": ({"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                                    "minute": {"type": "integer", "minimum": 0, "maximum": 59},
                                                    "repeat": {"enum": ["never", "daily", "weekdays"]},
                                                    "label": {"type": "string"}},
                   "required": ["hour"]}, "Wake me at 6:30 every weekday."),
    "send_email": ({"type": "object", "properties": {
        "to": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "subject": {"type": "string"}, "body": {"type": "string"},
        "priority": {"enum": ["low", "normal", "high"]}}, "required": ["to", "subject"]},
        "Email bob@example.com that the meeting moved to Friday."),
    "add_contact": ({"type": "object", "properties": {
        "name": {"type": "string"}, "phone": {"type": "string"},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": CITY,
                                                     "country": {"enum": ["NO", "SE", "DK", "FI"]}},
                    "required": ["city"]}}, "required": ["name"]},
        "Save Kari Nordmann, 555-1234, who lives in Bergen, Norway."),
}
JSON_PROMPTS = [
    "Describe a cat as JSON.",
    "Give me a JSON object with your favourite book, its author and the year it came out.",
    "List three fruits and their colours in JSON.",
    "Return a JSON object describing the weather in Paris today.",
    "Make up a user profile (name, age, hobbies) as JSON.",
    "Answer in JSON: what are the planets of the solar system?",
    "Write a recipe for pancakes as a JSON object.",
    "Give a JSON summary of the French Revolution with dates and key people.",
    "Output a JSON object that describes a car, with nested engine details.",
    "Represent a small company's org chart as nested JSON.",
]


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _together(fn, items) -> list:
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": name.replace("_", " "),
                                             "parameters": TOOL_SCHEMAS[name][0]}}


GREEDY, SAMPLED = {"temperature": 0}, {"temperature": 1.0, "seed": 3}


def test_forced_tool_calls_hold_only_declared_properties_and_finish(client):
    tools = [_tool(name) for name in TOOL_SCHEMAS]
    asks = [(name, sampling) for sampling in (GREEDY, SAMPLED) for name in TOOL_SCHEMAS]

    def call(ask: tuple[str, dict]):
        name, sampling = ask
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": TOOL_SCHEMAS[name][1]}], tools=tools,
            tool_choice={"type": "function", "function": {"name": name}}, max_tokens=100, **sampling)

    # The ten asks share their first ~550 tokens (the tools); sent together on a cold cache,
    # each would compute them. One answer of a token first puts them in the prefix cache.
    warm = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello."}], tools=tools,
                                          max_tokens=1, temperature=0)
    assert warm.usage.prompt_tokens > 500, warm.usage  # the tools are in the prompt
    completions = _together(call, asks)
    assert all(c.usage.prompt_tokens_details.cached_tokens > 500 for c in completions), [c.usage for c in completions]
    for (name, sampling), completion in zip(asks, completions, strict=True):
        [choice] = completion.choices
        assert choice.finish_reason == "tool_calls", (name, sampling, choice)
        [tool_call] = choice.message.tool_calls
        assert tool_call.function.name == name
        arguments = json.loads(tool_call.function.arguments)
        declared = TOOL_SCHEMAS[name][0]["properties"]
        assert set(arguments) <= set(declared), (name, arguments)
        jsonschema.validate(arguments, strict_objects(TOOL_SCHEMAS[name][0]))  # nested objects too


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_json_object_parses_within_120_tokens(client, sampling):
    asks = [(prompt, sampling) for prompt in JSON_PROMPTS]

    def ask(item: tuple[str, dict]):
        prompt, sampling = item
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                              response_format={"type": "json_object"}, max_tokens=120, **sampling)

    for (prompt, sampling), completion in zip(asks, _together(ask, asks), strict=True):
        [choice] = completion.choices
        assert choice.finish_reason == "stop", (prompt, sampling, choice.message.content)
        assert isinstance(json.loads(choice.message.content), dict), prompt
        assert completion.usage.completion_tokens <= 120


PET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                        "kind": {"enum": ["cat", "dog"]}}, "required": ["name", "kind"]}


def test_schema_without_name_and_llama_cpp_schema_extension(client, live_server):
    formats = [{"type": "json_schema", "json_schema": {"schema": PET}},  # no name
               {"type": "json_object", "schema": PET}]  # llama.cpp's extension

    def ask(fmt: dict):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A pet as JSON."}],
                                              response_format=fmt, max_tokens=60, temperature=0)

    for completion in _together(ask, formats):
        [choice] = completion.choices
        assert choice.finish_reason == "stop"
        pet = json.loads(choice.message.content)
        jsonschema.validate(pet, strict_objects(PET))
    bad = {"type": "json_object", "schema": {"type": "object", "properties": {"x": {"type": "strin"}}}}
    r = httpx.post(f"{live_server.base_url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "response_format": bad, "max_tokens": 5})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format.schema"
    r = httpx.post(f"{live_server.base_url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                         "response_format": {"type": "json_object", "schema": "not a schema"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.schema"
