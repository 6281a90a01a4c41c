"""A real HTTP server on loopback around the tiny random-weight engine, in a thread.

For tests that need real sockets (Host headers, streams, a fuzzer against a URL) but not
a real model: it starts in about a second. The tokenizer is bytes with a minimal chat
template (``test_server_inprocess.ChatByteTokenizer``), so every endpoint runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI
from starlette.routing import Mount

from bargein.engine.async_engine import AsyncEngine
from bargein.server.app import create_app
from bargein.server.listen import bind_socket
from bargein.server.settings import ServerSettings
from tests.server.test_server_inprocess import ChatByteTokenizer
from tests.tiny_engine import tiny_engine

START_TIMEOUT_S = 60.0


class TinyServer:
    """``base_url`` and the app's context (``ctx``) of a running tiny server.

    ``step_delay_s`` slows every engine step down by that much (0 by default), so a test
    can keep requests in flight for as long as it looks at them, without blocking the
    engine thread (listing and cancelling still work between steps).
    """

    def __init__(self, app, port: int):
        self.app = app
        self.ctx = app.state.ctx
        self.base_url = f"http://127.0.0.1:{port}"
        self.step_delay_s = 0.0

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine has nothing running or waiting (so block accounting can be read)."""
        deadline = time.monotonic() + timeout
        while self.ctx.engine.live_request_ids() or len(self.ctx.registry):
            assert time.monotonic() < deadline, "the tiny server did not become idle"
            time.sleep(0.02)


@contextmanager
def tiny_live_server(tokenizer=None, **settings) -> Iterator[TinyServer]:
    """Serves the tiny engine with ``ServerSettings(**settings)`` until the block ends
    (``tokenizer``: another byte tokenizer, a chat template of its own)."""
    core = tiny_engine(num_blocks=256)
    core.tokenizer = tokenizer or ChatByteTokenizer()
    sock = bind_socket("127.0.0.1", 0)  # a port of its own at once: parallel test workers never race for one
    port = sock.getsockname()[1]
    app = create_app(AsyncEngine(core), ServerSettings(port=port, **settings))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="tiny-live-server", daemon=True)
    thread.start()
    live = TinyServer(app, port)
    execute = core.runner.execute

    def slowed_execute(plan):
        if live.step_delay_s:
            time.sleep(live.step_delay_s)
        return execute(plan)

    core.runner.execute = slowed_execute
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the tiny server did not start"
        time.sleep(0.02)
    try:
        yield live
    finally:
        server.should_exit = True
        thread.join(30)


def auth(key: str | None, **more: str) -> dict[str, str]:
    """Headers with ``key`` as the bearer token (none for None), plus ``more``."""
    headers = {name.replace("_", "-"): value for name, value in more.items()}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def api_routes(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every route in the app's table but the chat page's static mount.

    Included routers (FastAPI keeps them as one entry each) are walked into; any other
    kind of entry fails the test rather than being skipped unseen."""
    found: list[tuple[str, str]] = []

    def walk(routes, prefix: str) -> None:
        for route in routes:
            if isinstance(route, Mount):
                assert route.path == "", f"a mount other than the chat page's: {route.path}"
            elif hasattr(route, "original_router"):  # an included APIRouter
                walk(route.original_router.routes, prefix + getattr(route.include_context, "prefix", ""))
            else:
                assert isinstance(route.methods, set | frozenset) and route.path.startswith("/"), route
                found.extend((m, prefix + route.path) for m in sorted(route.methods - {"HEAD"}))

    walk(app.routes, "")
    return found
