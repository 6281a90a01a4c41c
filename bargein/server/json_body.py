"""Request bodies read by hand, for the routes whose errors are not in the OpenAI shape.

FastAPI's own body validation answers in the OpenAI error shape; the Anthropic and Ollama
routes read the body here instead, so that a bad body is an :class:`APIError` their own
error shape can carry (400 naming the first bad field).
"""

from __future__ import annotations

import json
from typing import TypeVar

import pydantic
from fastapi import Request

from bargein.server.errors import APIError

M = TypeVar("M", bound=pydantic.BaseModel)


async def read_body(request: Request, model: type[M]) -> M:
    """The body as ``model``; a 400 for invalid JSON or the first invalid field."""
    raw = await request.body()
    try:
        data = json.loads(raw) if raw else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_value")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        message = f"{where}: {first['msg']}" if where else str(first["msg"])
        raise APIError(400, message, param=where, code="invalid_value") from None
