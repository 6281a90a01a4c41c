"""Errors in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}, "request_id"}``."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from bargein.server.errors import APIError

# HTTP status -> Anthropic's error type (their documented table; 503 has none: overloaded).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 409: "invalid_request_error",
               413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error")


def error_payload(message: str, status: int, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type(status), "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def error_response(exc: APIError, request_id: str | None) -> JSONResponse:
    headers = dict(exc.headers or {})
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    return JSONResponse(error_payload(exc.message, exc.status, request_id), status_code=exc.status,
                        headers=headers)
