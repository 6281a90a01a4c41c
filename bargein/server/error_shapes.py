"""Errors in each client family's own shape, chosen by the route's path.

The server speaks three APIs, and each one's clients parse errors their own way:

- OpenAI (every route not named below)::

      {"error": {"message": "...", "type": "invalid_request_error", "param": "...", "code": "..."}}

- Anthropic (``/v1/messages`` and below)::

      {"type": "error", "error": {"type": "authentication_error", "message": "..."}, "request_id": "..."}

  with Anthropic's error type for the status (``ANTHROPIC_TYPES``), so the official SDK
  raises its typed error (``AuthenticationError``, ``RateLimitError`` ...) with the message;
- Ollama (``/api`` and below): ``{"error": "..."}``, which the ``ollama`` client raises as
  ``ResponseError`` with the message and the status.

:func:`error_family` is the one hook that picks the shape; every error the server
answers goes through it, whoever finds the error: the middleware (Host, key, body size,
the shutdown drain, a 500), the exception handlers and the routes. The status and headers
are the same in every shape; only the body differs.
"""

from __future__ import annotations

import enum
from typing import Any

ANTHROPIC_PREFIX = "/v1/messages"
OLLAMA_PREFIX = "/api"

# HTTP status -> Anthropic's error type (their documented table; their 529 "overloaded" is
# what this server answers as 503, its drain and a dead engine, so 503 maps to it too).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                   409: "invalid_request_error", 413: "request_too_large", 415: "invalid_request_error",
                   422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
                   529: "overloaded_error"}


class ErrorFamily(enum.StrEnum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"
    OLLAMA = "ollama"


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def error_family(path: str) -> ErrorFamily:
    """Whose error shape a request to ``path`` is answered in (by whole path segments:
    the chat page's ``/api.js`` is not Ollama's)."""
    if _under(path, ANTHROPIC_PREFIX):
        return ErrorFamily.ANTHROPIC
    if _under(path, OLLAMA_PREFIX):
        return ErrorFamily.OLLAMA
    return ErrorFamily.OPENAI


def anthropic_type(status: int) -> str:
    return ANTHROPIC_TYPES.get(status, "api_error")


def anthropic_payload(message: str, status: int, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {"type": anthropic_type(status), "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def openai_payload(message: str, *, type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_payload(family: ErrorFamily, status: int, message: str, *, type: str, param: str | None = None,
                  code: str | None = None, request_id: str | None = None) -> dict[str, Any]:
    """One error's body in ``family``'s shape (``type``, ``param`` and ``code`` are the
    OpenAI shape's; the others carry what their clients read)."""
    if family == ErrorFamily.ANTHROPIC:
        return anthropic_payload(message, status, request_id)
    if family == ErrorFamily.OLLAMA:
        return {"error": message}
    return openai_payload(message, type=type, param=param, code=code)
