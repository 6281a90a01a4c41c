"""ASGI middleware: what every request passes before any route runs, and the last word after.

Pure ASGI rather than ``BaseHTTPMiddleware``, which would wrap the receive channel and
hide the ``http.disconnect`` message that cancels a request when its client goes away.
In order, ``GuardMiddleware``:

- answers ``HEAD`` as ``GET`` without the body (FastAPI routes only the GET);
- refuses a request during the shutdown drain (503 with ``Retry-After``), so a client
  that connects while in-flight requests are being answered hears why instead of a
  refused connection (``serve.py`` keeps the socket open for the drain);
- refuses a foreign ``Host`` or a cross-site ``Origin`` (403; ``auth.AccessRule``);
- refuses ``Content-Length`` together with ``Transfer-Encoding`` (400: two framings of
  one body are the stuff of request smuggling);
- checks the API key (401) and records the request's tenant in ``scope["state"]``;
- reads the body up to ``max_body_bytes`` (413 beyond it, once the client has sent it),
  within ``body_timeout`` seconds in all (408 and the connection closed for a body that
  trickles in slower), and replays it to the app; after it, ``receive`` is the server's own, so disconnects reach
  the routes unchanged; a body not declared JSON is a 415;
- adds the security headers (``auth.SECURITY_HEADERS``: CSP, nosniff, no framing) to
  every response;
- answers any exception the app lets escape with one generic 500 and
  logs its traceback once. Not re-raising keeps uvicorn from logging it again and from
  closing the keep-alive connection, which stays usable for the next request.

Every refusal and the 500 are in the error shape of the request's API (OpenAI, Anthropic
or Ollama: ``error_shapes.error_family`` by path).

``Traffic`` counts the requests being answered, so the shutdown drain knows when every
request that arrived before it has its answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bargein.server.auth import BODY_METHODS, SECURITY_HEADERS, AccessRule
from bargein.server.errors import APIError, internal_error
from bargein.server.settings import ServerSettings
from bargein.server.tenants import Tenant

log = logging.getLogger("bargein.server")

# Paths the chat page's static mount never answers (the router does: 404/405 in JSON).
API_PREFIXES = ("/v1", "/api", "/tokenize", "/detokenize", "/metrics", "/debug", "/docs", "/redoc", "/openapi.json",
                "/health")


def is_api_path(path: str) -> bool:
    """Whether ``path`` is one of API_PREFIXES or below one, by whole path segments (the
    page's ``/api.js`` is not under Ollama's ``/api``)."""
    return any(path == prefix or path.startswith(prefix + "/") for prefix in API_PREFIXES)
DRAIN_RETRY_AFTER_S = 5  # what a client refused during the drain is told to wait


@dataclass
class Traffic:
    """Requests past the drain check and not yet answered (body still arriving included).

    Owned by the event loop; the shutdown drain waits for it to reach 0.
    """

    in_flight: int = 0


class GuardMiddleware:
    def __init__(self, app: ASGIApp, settings: ServerSettings, access: AccessRule, traffic: Traffic,
                 draining: Callable[[], bool]):
        self.app = app
        self.settings = settings
        self.access = access
        self.traffic = traffic
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # none today; one added later passes the same rule
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "HEAD":  # as GET, without the body: HTTP asks HEAD wherever GET works
            scope = {**scope, "method": "GET"}
            send = _without_body(send)
        send = _with_security_headers(send)
        headers = dict(scope["headers"])
        error = self.access.origin_error(headers)
        if error is None and self.draining():
            error = _draining_error()
        if error is not None:
            await _send_error(error, scope, receive, send)
            return
        started = _Started(send)
        self.traffic.in_flight += 1
        try:
            error = self._header_error(scope, headers)
            if error is None and scope["method"] in BODY_METHODS:
                body, error = await self._read_body(scope, receive)
                error = error or self.access.body_type_error(scope["method"], headers, bool(body))
                if error is None:
                    receive = _replay(body, receive)
            if error is not None:
                await _send_error(error, scope, receive, started)
            else:
                await self.app(scope, receive, started)
        except Exception:
            log.exception("unexpected error answering %s %s", scope["method"], scope["path"])
            if not started.response_started:
                await _send_error(internal_error(), scope, receive, started)
            # Else the response is cut short: uvicorn closes the connection, which is all
            # a client can be told once the status line is out.
        finally:
            self.traffic.in_flight -= 1

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket handshake under the same Host, Origin and key checks (refused: 403)."""
        headers = dict(scope["headers"])
        error = self.access.origin_error(headers) or self._header_error(scope, headers)
        if error is None:
            await self.app(scope, receive, send)
            return
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008, "reason": error.message[:120]})

    def _header_error(self, scope: Scope, headers: dict[bytes, bytes]) -> APIError | None:
        if b"content-length" in headers and b"transfer-encoding" in headers:
            return APIError(400, "a request may not carry both Content-Length and Transfer-Encoding",
                            code="conflicting_length_headers", headers={"Connection": "close"})
        tenant, error = self.access.tenant(scope.get("method", "GET"), scope["path"], headers)
        if tenant is not None:
            scope.setdefault("state", {})[TENANT_STATE] = tenant
        return error

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[bytes, APIError | None]:
        """The whole body, or the error to answer: 413 over the limit, 408 past the deadline.

        A body over the limit is still read to its end (and dropped) while the deadline
        allows: a client busy sending it reads no response, and closing on unread data
        resets the connection, so it would see a broken pipe instead of the 413. A body
        that cannot end in time gets its answer with the connection closed.
        """
        limit = self.settings.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        declared = int(length) if length is not None and length.isdigit() else None
        deadline = time.monotonic() + self.settings.body_timeout
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                if size > limit or (declared or 0) > limit:
                    return b"", _too_large(limit, close=True)
                return b"", APIError(
                    408, f"the request body did not arrive within {self.settings.body_timeout:g} s",
                    code="request_timeout", headers={"Connection": "close"})
            if message["type"] == "http.disconnect":
                return b"", None  # the app will see the disconnect when it reads
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= limit and (declared or 0) <= limit:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return (b"".join(chunks), None) if size <= limit else (b"", _too_large(limit, close=False))


def _too_large(limit: int, *, close: bool) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large",
                    headers={"Connection": "close"} if close else None)


def _draining_error() -> APIError:
    return APIError(503, "the server is shutting down; retry on another instance or later",
                    code="shutting_down", headers={"Retry-After": str(DRAIN_RETRY_AFTER_S), "Connection": "close"})


class _Started:
    """``send`` that remembers whether the response has started (then no 500 can follow)."""

    def __init__(self, send: Send):
        self._send = send
        self.response_started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.response_started = True
        await self._send(message)


def _without_body(send: Send) -> Send:
    async def head_send(message: Message) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return head_send


TENANT_STATE = "tenant"  # scope["state"] key: the request's Tenant, read by routes (context.tenant_of)


def scope_tenant(scope: Scope) -> Tenant:
    """The tenant the middleware found for this request."""
    return scope["state"][TENANT_STATE]


def _with_security_headers(send: Send) -> Send:
    async def secured_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            present = {name.lower() for name, _ in message.get("headers", [])}
            extra = [(n, v) for n, v in SECURITY_HEADERS if n not in present]
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return secured_send


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
    """A refusal in the error shape of the API the request's path belongs to (error_shapes.py)."""
    await error.response(scope["path"])(scope, receive, send)
