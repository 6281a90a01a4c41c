"""uvicorn's h11 protocol with a header read timeout, against slow-header clients.

uvicorn times out only an idle keep-alive connection (``timeout_keep_alive``): once the
first byte of a request arrives, or for a fresh connection that sends nothing, nothing
limits how long the headers take, so a client trickling one header byte every few
seconds holds a connection (and its memory) forever. Here a timer runs from the moment
a connection is waiting for a request's headers (it opened, or the previous response was
sent and bytes arrived) until h11 has parsed them; if it fires first, the client gets a
408 in the OpenAI error shape and the connection is closed. The body's own timeout is in
``middleware.py`` (it needs the ASGI receive channel). Tied to uvicorn's ``H11Protocol``
internals (``cycle``, ``transport``), which ``tests/test_server_hardening.py`` exercises.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from bargein.server.errors import APIError


class HeaderTimeoutProtocol(H11Protocol):
    """``H11Protocol`` that answers 408 and closes when headers take over ``header_timeout`` s."""

    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        waiting = self._awaiting_headers()
        if waiting:
            self._arm()
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # h11 parsed a request's headers
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # a pipelined request's headers were already buffered and parsed

    def _awaiting_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._awaiting_headers():
            return
        error = APIError(408, f"the request headers did not arrive within {self.header_timeout:g} s",
                         code="request_timeout")
        body = json.dumps(error.body()).encode()
        head = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n")
        self.transport.write(head + body)
        self.transport.close()
