"""Running the app on uvicorn, with a shutdown that answers in-flight requests.

uvicorn, on SIGINT/SIGTERM, stops accepting connections and then waits for the open
ones to close before the lifespan ends; a stream that never ends would hold it until
the graceful timeout. So the signal handler first has every request cancelled (reason
``shutdown``; the handler only sets a flag and schedules that on the event loop, taking
no lock the interrupted code may hold): each is answered with ``finish_reason: "cancelled"`` and its connection
closes, and the server exits promptly. A second SIGINT forces the exit.

Between the signal and uvicorn's own shutdown is the drain: the listening socket stays
open until every admitted request has been answered (at most ``shutdown_timeout``), and a
request that arrives meanwhile gets 503 with ``Retry-After`` from the middleware rather
than a refused connection. Connections use ``HeaderTimeoutProtocol`` (slow headers: 408).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import socket
import threading
import time
from collections.abc import Callable, Generator
from types import FrameType

import uvicorn
from fastapi import FastAPI

from bargein.server.app import request_shutdown
from bargein.server.middleware import Traffic
from bargein.server.protocol import HeaderTimeoutProtocol
from bargein.server.settings import ServerSettings

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class BargeinServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, *, on_exit_signal: Callable[[], None],
                 traffic: Traffic | None = None, drain_timeout: float = 0.0,
                 on_started: Callable[[], None] | None = None):
        super().__init__(config)
        self._on_exit_signal = on_exit_signal
        self._on_started = on_started
        self._traffic = traffic
        self._drain_timeout = drain_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self._drain()
        await super().shutdown(sockets=sockets)

    async def _drain(self) -> None:
        """Keeps listening (new requests: 503) until admitted requests are answered, or the timeout."""
        deadline = time.monotonic() + self._drain_timeout
        while self._traffic is not None and self._traffic.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self._on_started is not None:
            self._on_started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            self._on_exit_signal()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # Like uvicorn's, without re-raising the signal afterwards: a shutdown we handled
        # is a clean exit (status 0), not a death by signal.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_server(app: FastAPI, settings: ServerSettings, sock: socket.socket, *,
               on_started: Callable[[], None] | None = None) -> None:
    """Serves ``app`` on ``sock`` until SIGINT/SIGTERM; returns after a graceful shutdown.

    Freezing the heap that lives as long as the server (``gc.freeze``) is the caller's:
    the CLI does it while the collector is still paused from start-up."""
    level = settings.log_level.lower()
    protocol = functools.partial(HeaderTimeoutProtocol, header_timeout=settings.header_timeout)
    config = uvicorn.Config(app, log_level=level, access_log=level in ("debug", "trace"), lifespan="on",
                            http=protocol,  # type: ignore[arg-type]  # uvicorn takes a protocol factory
                            timeout_graceful_shutdown=max(1, round(settings.shutdown_timeout)))
    server = BargeinServer(config, on_exit_signal=lambda: request_shutdown(app), on_started=on_started,
                           traffic=app.state.traffic, drain_timeout=settings.shutdown_timeout)
    server.run(sockets=[sock])
