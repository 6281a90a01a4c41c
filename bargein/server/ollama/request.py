"""Ollama request bodies, validated and translated into what the serving path takes.

- ``options``: ``num_predict`` (max tokens; -1 or absent: the server's default), ``temperature``,
  ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, ``repeat_penalty``,
  ``presence_penalty``, ``frequency_penalty``; the rest of Ollama's options (``num_ctx``,
  ``num_gpu``, ...) say how Ollama loads a model and are ignored here, as is ``keep_alive``.
  Unset options take bargein's defaults, not Ollama's.
- ``format``: ``"json"`` (any JSON object) or a JSON Schema, enforced by the grammar
  engine like ``response_format``.
- ``think``: the template's thinking switch (``true``, ``"low"``/``"medium"``/``"high"``
  switch it on, ``false`` off).
- chat ``messages``: ``role``, ``content``, an assistant's ``thinking`` and ``tool_calls``
  (``{"function": {"name", "arguments": {...}}}``), a tool result's ``tool_name``; images
  are refused (400).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from bargein.engine.constraint import Constraint
from bargein.engine.sampling import InvalidSamplingParams, SamplingParams
from bargein.server.errors import APIError
from bargein.server.schemas import _Body
from bargein.server.structured import schema_constraint

# Ollama's option names -> SamplingParams' (the sampling options this server applies).
OPTIONS = {"num_predict": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
           "min_p": "min_p", "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
ROLES = ("system", "user", "assistant", "tool")


class _OllamaBody(_Body):
    model: str | None = None
    stream: bool = True  # Ollama streams unless asked not to
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    think: bool | str | None = None
    keep_alive: str | int | float | None = None
    timeout: float | None = Field(default=None, description="extension: seconds until the request is cancelled")


class ChatRequest(_OllamaBody):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_OllamaBody):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    images: list[Any] | None = None
    context: list[int] | None = None  # a previous answer's ``context``: its prompt and answer tokens


class ShowRequest(_Body):
    model: str | None = None
    name: str | None = None  # older clients' spelling of ``model``


def format_constraint(value: str | dict[str, Any] | None) -> Constraint | None:
    if value is None or value == "":
        return None
    if value == "json":
        return Constraint.json_object()
    if isinstance(value, dict):
        return schema_constraint(value, "format")
    raise APIError(400, f"format must be \"json\" or a JSON Schema object, got {value!r}", param="format",
                   code="invalid_value")


def thinking_switch(think: bool | str | None) -> bool | None:
    if think is None or isinstance(think, bool):
        return think
    if think in ("low", "medium", "high"):
        return True
    raise APIError(400, f"think must be true, false, \"low\", \"medium\" or \"high\", got {think!r}", param="think",
                   code="invalid_value")


def sampling_params(body: _OllamaBody, *, default_max_tokens: int | None, limit: int | None,
                    constraint: Constraint | None) -> SamplingParams:
    """SamplingParams from ``options``; a 400 naming ``options.<name>``."""
    options = body.options or {}
    if not isinstance(options, dict):
        raise APIError(400, "options must be an object", param="options", code="invalid_value")
    kwargs: dict[str, Any] = {}
    for name, field in OPTIONS.items():
        value = options.get(name)
        if value is not None:
            kwargs[field] = value
    max_tokens = kwargs.pop("max_tokens", None)
    if max_tokens is not None and max_tokens < 0:  # -1: no limit, -2: fill the context
        max_tokens = None
    if max_tokens is not None and limit is not None and max_tokens > limit:
        raise APIError(400, f"options.num_predict is {max_tokens}, more than this server allows ({limit})",
                       param="options.num_predict", code="invalid_value")
    max_tokens = max_tokens if max_tokens is not None else (default_max_tokens or limit)
    if isinstance(kwargs.get("stop"), str):
        kwargs["stop"] = [kwargs["stop"]]
    try:
        return SamplingParams(max_tokens=max_tokens, constraint=constraint, **kwargs)
    except (InvalidSamplingParams, TypeError) as exc:
        field = getattr(exc, "field", None)
        name = next((k for k, v in OPTIONS.items() if v == field), field or "options")
        raise APIError(400, f"options.{name}: {exc}", param=f"options.{name}", code="invalid_value") from None


def chat_messages(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama's chat messages as the chat template takes them (OpenAI-style tool calls)."""
    out = []
    for i, message in enumerate(raw):
        where = f"messages.{i}"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise APIError(400, f"{where}.role must be one of {list(ROLES)}, got {role!r}", param=f"{where}.role",
                           code="invalid_value")
        if message.get("images"):
            raise APIError(400, f"{where}.images: images are not supported by this server",
                           param=f"{where}.images", code="unsupported_content")
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise APIError(400, f"{where}.content must be a string", param=f"{where}.content", code="invalid_value")
        item: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and message.get("thinking"):
            item["reasoning_content"] = str(message["thinking"])
        if role == "assistant" and message.get("tool_calls"):
            item["tool_calls"] = [_tool_call(f"{where}.tool_calls.{j}", c) for j, c in enumerate(message["tool_calls"])]
        if role == "tool" and message.get("tool_name"):
            item["name"] = str(message["tool_name"])
        out.append(item)
    return out


def _tool_call(where: str, call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"{where} must be {{\"function\": {{\"name\": ..., \"arguments\": {{...}}}}}}",
                       param=where, code="invalid_value")
    arguments = fn.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
    return {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
