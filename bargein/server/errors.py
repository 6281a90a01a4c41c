"""Errors from one place, in the shape of the API a request belongs to.

An error on the OpenAI routes looks like OpenAI's::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

and on the Anthropic and Ollama routes like theirs (``error_shapes.py`` picks the shape by
path). Routes raise :class:`APIError`; ``install_error_handlers`` turns it, FastAPI's
validation errors and the engine's typed errors into that shape. Any other exception is answered by
``GuardMiddleware`` with ``internal_error()``: a 500 whose body names no internals, one
logged traceback, and a connection that stays usable. A failure in one request never
reaches the engine loop or other requests.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from bargein.engine.async_engine import EngineDeadError
from bargein.engine.engine import EngineError
from bargein.engine.sampling import InvalidSamplingParams
from bargein.loader import ChatTemplateError
from bargein.loader.tokenizer import UnencodableTextError
from bargein.server.error_shapes import ErrorFamily, error_family, error_payload, openai_payload

REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")  # what a client may choose as X-Request-Id

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
          409: "conflict_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """An error answered to the client with ``status`` in the OpenAI error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers

    def body(self, family: ErrorFamily = ErrorFamily.OPENAI, request_id: str | None = None) -> dict[str, Any]:
        return error_payload(family, self.status, self.message, type=self.type, param=self.param, code=self.code,
                             request_id=request_id)

    def response(self, path: str = "", request_id: str | None = None) -> JSONResponse:
        """The answer to a request for ``path``, in its API's error shape."""
        return JSONResponse(self.body(error_family(path), request_id), status_code=self.status,
                            headers=self.headers)


def error_body(message: str, *, type: str = "server_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """An error in the OpenAI shape (a stream's error event on the OpenAI routes)."""
    return openai_payload(message, type=type, param=param, code=code)


def from_engine_exception(exc: Exception) -> APIError | None:
    """The APIError for an exception the engine or loader raises about a request, if any."""
    if isinstance(exc, InvalidSamplingParams):
        return APIError(400, str(exc), param=exc.field, code="invalid_value")
    if isinstance(exc, ChatTemplateError):
        return APIError(400, f"the chat template could not render the messages: {exc}", param="messages")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, EngineError):
        return APIError(400, str(exc))
    if isinstance(exc, UnencodableTextError):
        return APIError(400, str(exc), code="invalid_value")
    return None


_ENGINE_EXCEPTIONS = (InvalidSamplingParams, ChatTemplateError, EngineDeadError, EngineError,
                      UnencodableTextError)


def not_found(what: str, ident: str, *, param: str | None = None) -> APIError:
    return APIError(404, f"no {what} with id {ident!r}", param=param, code="not_found")


def _validation_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def _request_id(request: Request) -> str | None:
    """The request's id: the one a route assigned, else the client's (when well formed)."""
    request_id = getattr(request.state, "request_id", None) or request.headers.get("x-request-id")
    return request_id if request_id and REQUEST_ID.fullmatch(request_id) else None


def answer(request: Request, error: APIError) -> JSONResponse:
    """``error`` answered to ``request``: in its API's shape, with its id echoed."""
    request_id = _request_id(request)
    response = error.response(request.url.path, request_id)
    if request_id is not None:
        response.headers["X-Request-Id"] = request_id
    return response


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = _validation_param(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        else:
            message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return answer(request, APIError(400, message, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path}; use {allowed or 'another method'}"
        return answer(request, APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    async def _mapped(request: Request, exc: Exception) -> JSONResponse:
        mapped = from_engine_exception(exc)
        if mapped is None:  # not one of ours after all: the catch-all in middleware.py answers 500
            raise exc
        return answer(request, mapped)

    # By type, so Starlette's ExceptionMiddleware answers them and nothing is re-raised;
    # anything else reaches GuardMiddleware, which answers 500 (see internal_error).
    for exc_type in _ENGINE_EXCEPTIONS:
        app.add_exception_handler(exc_type, _mapped)


def internal_error() -> APIError:
    """The one 500 a client sees: no exception text, no internals (the log has the traceback)."""
    return APIError(500, "the server failed to answer this request; the error is logged",
                    code="internal_error", type="server_error")
