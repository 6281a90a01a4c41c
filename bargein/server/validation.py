"""Request fields checked in one documented order; the first wrong field is the one named.

Types are checked first, by the pydantic schemas (a wrong type is a 400 naming its
field). Then, for every generation endpoint, in this order (``FIELD_ORDER``):

1. the prompt: ``messages`` (roles, content parts) / ``prompt`` / ``input``;
2. ``n``;
3. ``response_format`` (Responses: ``text.format``): ``type`` one of ``text``,
   ``json_object``, ``json_schema``; then ``json_schema.name`` (optional),
   ``json_schema.strict``, ``json_schema.schema`` (the schema limits of
   ``schema_limits``, then what the grammar engine cannot enforce is named); then
   ``tools`` and ``tool_choice`` (see ``server/tools.py``); then the answer's grammar is
   built (time budget: ``structured.SCHEMA_BUDGET_S``). Step 3 runs off the event loop;
4. ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens`` (at least 1, at most
   the server's ``--max-tokens-limit``);
5. ``logprobs``, ``top_logprobs``;
6. ``timeout``;
7. the sampling fields, in ``SamplingParams``' order: ``min_tokens``, ``temperature``,
   ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``presence_penalty``,
   ``frequency_penalty``, ``logit_bias``, ``stop``, ``stop_token_ids``, ``seed``;
8. the prompt's length in tokens (``context_length_exceeded``), once it is tokenized.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bargein.engine.constraint import Constraint
from bargein.engine.sampling import MAX_LOGPROBS
from bargein.server.errors import APIError
from bargein.server.settings import ServerSettings
from bargein.server.structured import prepare_constraint, response_format_constraint, schema_param
from bargein.server.tools import ToolPlan

FIELD_ORDER = ("messages|prompt|input", "n", "response_format", "max_tokens", "logprobs", "timeout",
               "sampling", "context_length")
MAX_CHOICES = 16
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def check_n(n: int) -> None:
    if not 1 <= n <= MAX_CHOICES:
        raise APIError(400, f"n must be an integer in [1, {MAX_CHOICES}], got {n}", param="n", code="invalid_value")


def check_response_format(value: dict[str, Any] | None, param: str = "response_format",
                          nested: bool = True) -> Constraint | None:
    """The constraint ``response_format`` asks for (None: plain text); a 400 names the first
    bad field. Its cost grows with the schema: off the event loop (``check_structured``)."""
    return response_format_constraint(value, param, nested)


async def check_structured(ctx: Any, response_format: dict[str, Any] | None, make_plan: Callable[[], ToolPlan],
                           param: str = "response_format", nested: bool = True, *,
                           read_format: Callable[[], Constraint | None] | None = None,
                           schema_at: str | None = None) -> tuple[Constraint | None, ToolPlan]:
    """Step 3 of ``FIELD_ORDER``: ``response_format`` (``param``), then the tools
    (``make_plan`` validates them); the answer's constraint (the format's, or the forced
    tool call's) compiled. All of it off the event loop, within the schema budget
    (``structured.prepare_constraint``).

    Other APIs spell the format their own way (Anthropic's ``output_config.format``,
    Ollama's ``format``): ``read_format`` then reads it instead of ``response_format``,
    and ``schema_at`` is where its schema sits (what a refusal of the grammar names)."""
    def work() -> tuple[Constraint | None, str, ToolPlan]:
        if read_format is None:
            constraint = check_response_format(response_format, param, nested)
            where_schema = schema_param(response_format, param, nested)
        else:
            constraint, where_schema = read_format(), schema_at or param
        plan = make_plan()
        if plan.constraint() is None:
            return constraint, where_schema, plan
        if constraint is not None:
            raise APIError(400, f"{param} cannot be combined with a required or named tool_choice",
                           param="tool_choice", code="invalid_value")
        called = [i for i, t in enumerate(plan.tools) if plan.choice == "required" or t.name == plan.forced]
        where = f"tools.{called[0]}.function.parameters" if len(called) == 1 else "tools"
        return plan.constraint(), where, plan

    return await prepare_constraint(ctx, work)


def resolve_max_tokens(requested: int | None, field: str, settings: ServerSettings,
                       default: int | None) -> int | None:
    """The max tokens to generate: the request's, else ``default``; capped by the limit.

    A request above ``--max-tokens-limit`` is refused (400 naming ``field``) rather than
    silently cut; a request that gives none gets the limit when it is lower than
    ``default`` (or when there is no default).
    """
    limit = settings.max_tokens_limit
    if requested is not None:
        if requested < 1:
            raise APIError(400, f"{field} must be at least 1, got {requested}", param=field, code="invalid_value")
        if limit is not None and requested > limit:
            raise APIError(400, f"{field} must be at most {limit} on this server (--max-tokens-limit), "
                                f"got {requested}", param=field, code="invalid_value")
        return requested
    if limit is not None and (default is None or default > limit):
        return limit
    return default


def check_logprobs(logprobs: bool, top_logprobs: int | None, param: str = "top_logprobs") -> None:
    if top_logprobs is not None and not logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param=param, code="invalid_value")
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"{param} must be an integer in [0, {MAX_LOGPROBS}], got {top_logprobs}", param=param,
                       code="invalid_value")


def effective_timeout(requested: float | None, server_timeout: float | None) -> float | None:
    """The tighter of the request's own ``timeout`` and the server's ``--request-timeout``."""
    if requested is not None and not requested > 0:
        raise APIError(400, f"timeout must be a positive number of seconds, got {requested}",
                       param="timeout", code="invalid_value")
    given = [t for t in (requested, server_timeout) if t is not None]
    return min(given) if given else None
