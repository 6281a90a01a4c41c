"""Structured outputs on the OpenAI API: ``response_format`` / ``text.format`` -> a Constraint.

``{"type": "text"}`` (or nothing) is unconstrained; ``{"type": "json_object"}`` is any
JSON object; ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
(chat completions, completions) or ``{"type": "json_schema", "name", "schema",
"strict"}`` (the Responses API's ``text.format``) is that schema. The output is then
constrained token by token by the engine's grammar (``bargein.engine.grammar``); a
schema feature the grammar engine cannot enforce is a 400 that names it, never an
unconstrained answer. ``strict`` is accepted either way: every schema is enforced.
"""

from __future__ import annotations

from typing import Any

from bargein.engine.constraint import Constraint
from bargein.engine.grammar import UnsupportedGrammar, check_constraint
from bargein.server.errors import APIError

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def response_format_constraint(value: dict[str, Any] | None, param: str = "response_format",
                               nested: bool = True) -> Constraint | None:
    """The constraint a ``response_format`` asks for; a 400 naming the first bad field.

    ``nested``: the schema sits in ``json_schema`` (chat, completions) rather than
    beside ``type`` (the Responses API's ``text.format``).
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError(400, f"{param} must be an object", param=param, code="invalid_value")
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise APIError(400, f"{param}.type must be one of {list(RESPONSE_FORMATS)}, got {kind!r}",
                       param=f"{param}.type", code="invalid_value")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    spec_param = f"{param}.json_schema" if nested else param
    spec = value.get("json_schema") if nested else value
    if not isinstance(spec, dict):
        raise APIError(400, f"{spec_param} must be an object with name and schema", param=spec_param,
                       code="invalid_value")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(400, f"{spec_param}.name must be a non-empty string", param=f"{spec_param}.name",
                       code="invalid_value")
    if not isinstance(spec.get("strict", False), bool | None):
        raise APIError(400, f"{spec_param}.strict must be a boolean", param=f"{spec_param}.strict",
                       code="invalid_value")
    schema = spec.get("schema", {})
    return schema_constraint(schema, f"{spec_param}.schema")


def schema_constraint(schema: Any, param: str) -> Constraint:
    """A JSON Schema as a constraint, checked: a 400 naming ``param`` and what is unsupported."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON Schema object", param=param, code="invalid_value")
    constraint = Constraint.json_schema(schema)
    check(constraint, param)
    return constraint


def check(constraint: Constraint, param: str) -> None:
    try:
        check_constraint(constraint)
    except UnsupportedGrammar as exc:
        raise APIError(400, f"{param} is not supported: {exc}", param=param, code="unsupported_schema") from None


async def compile_in_pool(ctx: Any, constraint: Constraint | None, param: str) -> None:
    """Compiles ``constraint`` in the tokenizer pool (the first one builds the grammar
    engine's token table, ~0.5 s), so submitting it never stalls the event loop."""
    if constraint is None:
        return
    grammars = ctx.engine.grammars
    try:
        await ctx.prompts.run(lambda: grammars.compile(constraint))
    except UnsupportedGrammar as exc:
        raise APIError(400, f"{param} is not supported: {exc}", param=param, code="unsupported_schema") from None
