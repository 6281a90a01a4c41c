"""The bargein app around an engine, in this test's event loop: no socket, no process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI

from bargein.engine.async_engine import AsyncEngine
from bargein.engine.engine import Engine
from bargein.server.app import create_app, finish_shutdown
from bargein.server.settings import ServerSettings


@asynccontextmanager
async def inprocess_app(core: Engine, *, timeout: float | None = None,
                        **settings: Any) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """``core`` served by ``create_app`` with ``ServerSettings(**settings)``, and a client
    that reaches it through httpx's ASGI transport (a body is collected whole before it is
    returned). The engine starts here and the app shuts down on leaving, as a server's does."""
    engine = AsyncEngine(core)
    app = create_app(engine, ServerSettings(**settings))
    ctx = app.state.ctx
    ctx.loop = asyncio.get_running_loop()
    engine.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tiny",
                                     **({} if timeout is None else {"timeout": timeout})) as client:
            yield app, client
    finally:
        await finish_shutdown(ctx)
