"""An unexpected exception in a route: a generic 500, one logged traceback, the connection kept.

The app is built in-process around a tiny engine, with one extra route that fails the way
an unforeseen bug would, and served by ``run_server``'s own uvicorn setup (header-timeout
protocol included) on a real socket, so keep-alive is real.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from bargein.engine.async_engine import AsyncEngine
from bargein.server import create_app
from bargein.server.listen import bind_socket
from bargein.server.serve import BargeinServer
from bargein.server.settings import ServerSettings
from tests.tiny_engine import tiny_engine

SECRET = "db password is hunter2"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    app = create_app(AsyncEngine(tiny_engine()), ServerSettings(port=0))

    @app.get("/v1/broken")
    async def broken() -> None:
        raise RuntimeError(SECRET)

    sock = bind_socket("127.0.0.1", 0)
    server = BargeinServer(uvicorn.Config(app, log_level="warning", lifespan="on"), on_exit_signal=lambda: None)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(30)


def test_500_is_generic_logged_once_and_keeps_the_connection(base_url, caplog):
    caplog.set_level(logging.INFO)
    with httpx.Client(timeout=30) as http:
        r = http.get(f"{base_url}/v1/broken")
        assert r.status_code == 500
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
        assert SECRET not in r.text and "RuntimeError" not in r.text
        assert r.headers.get("connection") != "close"
        peer = r.extensions["network_stream"].get_extra_info("socket").getsockname()
        ok = http.get(f"{base_url}/v1/models")  # the same keep-alive connection still answers
        assert ok.status_code == 200
        assert ok.extensions["network_stream"].get_extra_info("socket").getsockname() == peer
    tracebacks = [rec for rec in caplog.records if rec.exc_info and SECRET in str(rec.exc_info[1])]
    assert len(tracebacks) == 1, [rec.getMessage() for rec in caplog.records]


def test_500_on_a_raw_keep_alive_connection(base_url):
    port = int(base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /v1/broken HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while received.count(b"HTTP/1.1 ") < 2:
            chunk = s.recv(65536)
            assert chunk, received
            received += chunk
    assert received.startswith(b"HTTP/1.1 500 ") and b"HTTP/1.1 200 " in received
