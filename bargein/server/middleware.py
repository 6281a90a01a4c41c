"""ASGI middleware: API key and body size, before any route runs.

Pure ASGI rather than ``BaseHTTPMiddleware``, which would wrap the receive channel and
hide the ``http.disconnect`` message that cancels a request when its client goes away.
The body is read here (up to the limit, 413 beyond it) and replayed to the app; after
it, ``receive`` is the server's own, so disconnects reach the routes unchanged.
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bargein.server.errors import APIError
from bargein.server.settings import ServerSettings

# The API and its self-description; the chat page's static files stay open so it can ask for the key.
_API_PREFIXES = ("/v1", "/metrics", "/debug", "/docs", "/redoc", "/openapi.json")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class GuardMiddleware:
    def __init__(self, app: ASGIApp, settings: ServerSettings):
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._auth_error(scope)
        if error is None and scope["method"] in _BODY_METHODS:
            body, error = await self._read_body(scope, receive)
            if error is None:
                receive = _replay(body, receive)
        if error is not None:
            await _send_error(error, scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _auth_error(self, scope: Scope) -> APIError | None:
        key = self.settings.api_key
        if not key or not _needs_auth(scope["path"], scope["method"]):
            return None
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1")
        token = given[7:].strip() if given[:7].lower() == "bearer " else headers.get(b"x-api-key", b"").decode("latin-1")
        if token and hmac.compare_digest(token.encode(), key.encode()):
            return None
        message = "invalid API key" if token else "missing API key: send 'Authorization: Bearer <key>'"
        return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[bytes, APIError | None]:
        limit = self.settings.max_body_bytes
        too_big = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return b"", too_big
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", None  # the app will see the disconnect when it reads
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return b"", too_big
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _needs_auth(path: str, method: str) -> bool:
    """Everything but /health and the web UI's static files (which hold no data)."""
    if path == "/health":
        return False
    return path.startswith(_API_PREFIXES) or method not in ("GET", "HEAD")


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    response = JSONResponse(error.body(), status_code=error.status, headers=error.headers)
    await response(scope, receive, send)
