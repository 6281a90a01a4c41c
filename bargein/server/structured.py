"""Structured outputs on the OpenAI API: ``response_format`` / ``text.format`` -> a Constraint.

Formats:

- ``{"type": "text"}`` (or nothing): unconstrained;
- ``{"type": "json_object"}``: any JSON object; with llama.cpp's extension
  ``{"type": "json_object", "schema": {...}}``, that schema;
- ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (chat
  completions, completions) or ``{"type": "json_schema", "name", "schema", "strict"}``
  (the Responses API's ``text.format``): that schema. ``name`` is optional (as in vLLM
  and llama.cpp); ``strict`` is accepted either way: every schema is enforced.

Rules (the same for tool arguments, ``server/tools.py``): an object that declares
``properties`` allows only those unless it opens itself (``additionalProperties``,
``patternProperties``; ``json_schema.strict_objects``), as xgrammar-based servers read
schemas by default. The output is then constrained token by token by the engine's grammar
(``bargein.engine.grammar``), which also steers it to close before ``max_tokens``.

Nothing here runs on the event loop: :func:`prepare_constraint` runs the whole check
(the schema limits of ``schema_limits``, the grammar build, its trial answers) in the
grammar engine's own threads, under a size budget and a time budget
(``SCHEMA_BUDGET_S``). Every schema the grammar engine cannot honour is a 400 that names
why, before any token is sampled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from bargein.engine.constraint import Constraint
from bargein.engine.grammar import GrammarOverBudget, UnsupportedGrammar, check_constraint
from bargein.server.errors import APIError
from bargein.server.json_schema import strict_objects
from bargein.server.schema_limits import check_schema

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
SCHEMA_BUDGET_S = 2.0  # the grammar build and its trial answers, per constraint
_CEILING_S = 4 * SCHEMA_BUDGET_S + 10.0  # a queued build's whole wait: never a hang
T = TypeVar("T")


def response_format_constraint(value: dict[str, Any] | None, param: str = "response_format",
                               nested: bool = True) -> Constraint | None:
    """The constraint a ``response_format`` asks for; a 400 naming the first bad field.

    ``nested``: the schema sits in ``json_schema`` (chat, completions) rather than
    beside ``type`` (the Responses API's ``text.format``). Call it off the event loop.
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
        if value.get("schema") is None:
            return Constraint.json_object()
        return schema_constraint(value["schema"], f"{param}.schema")  # llama.cpp's extension
    spec_param = f"{param}.json_schema" if nested else param
    spec = value.get("json_schema") if nested else value
    if not isinstance(spec, dict):
        raise APIError(400, f"{spec_param} must be an object with a schema", param=spec_param,
                       code="invalid_value")
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or not name):
        raise APIError(400, f"{spec_param}.name must be a non-empty string", param=f"{spec_param}.name",
                       code="invalid_value")
    if not isinstance(spec.get("strict", False), bool | None):
        raise APIError(400, f"{spec_param}.strict must be a boolean", param=f"{spec_param}.strict",
                       code="invalid_value")
    schema = spec.get("schema", {})
    return schema_constraint(schema, f"{spec_param}.schema")


def schema_param(value: Any, param: str = "response_format", nested: bool = True) -> str:
    """Where a ``response_format``'s schema sits: the param a refusal of its grammar names."""
    if isinstance(value, dict) and value.get("type") == "json_schema":
        return f"{param}.json_schema.schema" if nested else f"{param}.schema"
    if isinstance(value, dict) and value.get("schema") is not None:
        return f"{param}.schema"
    return param


def schema_constraint(schema: Any, param: str) -> Constraint:
    """A JSON Schema as a constraint under the strict reading, checked: a 400 naming
    ``param`` and what is unsupported (call it off the event loop)."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON Schema object", param=param, code="invalid_value")
    check_schema(schema, param)
    try:
        constraint = Constraint.json_schema(strict_objects(schema))
    except (RecursionError, ValueError) as exc:  # data nested past the JSON encoder's depth; NaN
        raise APIError(400, f"{param} cannot be written as JSON: {exc}", param=param, code="invalid_value") from None
    check(constraint, param)
    return constraint


def check(constraint: Constraint, param: str) -> None:
    """The grammar engine's own check (no tokenizer), as a 400 naming ``param``."""
    try:
        check_constraint(constraint)
    except UnsupportedGrammar as exc:
        raise _refusal(exc, param) from None


async def prepare_constraint(ctx: Any, work: Callable[[], tuple[Constraint | None, str, T]]) -> tuple[
        Constraint | None, T]:
    """Runs ``work`` (the request's format and tools checks: the constraint, the param it
    comes from, and anything else the route needs) and compiles its constraint, in the
    grammar engine's threads, within ``SCHEMA_BUDGET_S`` of build time."""
    grammars = ctx.engine.grammars

    def job() -> tuple[Constraint | None, T]:
        constraint, param, extra = work()
        if constraint is not None:
            try:
                grammars.compile(constraint, SCHEMA_BUDGET_S)
            except UnsupportedGrammar as exc:
                raise _refusal(exc, param) from None
        return constraint, extra

    future = asyncio.get_running_loop().run_in_executor(grammars.executor, job)
    try:
        return await asyncio.wait_for(future, _CEILING_S)
    except TimeoutError:
        raise APIError(400, f"the request's schema took longer than {_CEILING_S:g} s to check (this server "
                            f"gives each schema {SCHEMA_BUDGET_S:g} s of build time; the builds ahead of it "
                            "are still running): send a smaller schema or retry", param="response_format",
                       code="schema_too_complex") from None


async def compile_in_pool(ctx: Any, constraint: Constraint | None, param: str) -> None:
    """Compiles an already checked ``constraint`` off the event loop, within the budget."""
    if constraint is not None:
        await prepare_constraint(ctx, lambda: (constraint, param, None))


def _refusal(exc: UnsupportedGrammar, param: str) -> APIError:
    if isinstance(exc, GrammarOverBudget):
        return APIError(400, f"{param} is too complex: {exc}", param=param, code="schema_too_complex")
    return APIError(400, f"{param} is not supported: {exc}", param=param, code="unsupported_schema")
