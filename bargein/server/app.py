"""``create_app(engine, settings)``: the FastAPI application around one
:class:`~bargein.engine.client.EngineClient` (an AsyncEngine, or a ``ReplicaSet``: N engine
replicas on Ray behind the same interface).

Shutdown in two phases. On SIGINT/SIGTERM, ``request_shutdown`` (the signal handler's
part) only sets the draining flag and schedules ``begin_shutdown`` on the event loop: a
signal handler must not take a lock that the interrupted code may hold. ``begin_shutdown``
(before uvicorn waits for open connections) cancels every in-flight request with reason
``shutdown``, so each is answered (a stream gets its cancelled chunk and ``[DONE]``) and
its connection can close; if the engine has not answered one within 90% of the shutdown
timeout (a step that does not end), the server ends it itself with what was delivered
(``JobRunner.force_finish``), so no stream or collector is left hanging. The lifespan's
exit then does the same for anything left and stops the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.routing import Match, Mount
from starlette.types import Scope

from bargein.engine.client import EngineClient
from bargein.engine.request import CancelReason
from bargein.server import (
    routes_generate,
    routes_ops,
    routes_requests,
    routes_responses,
    routes_tokenize,
)
from bargein.server.anthropic import routes as anthropic_routes
from bargein.server.auth import AccessRule, static_paths
from bargein.server.context import ServerContext
from bargein.server.errors import install_error_handlers
from bargein.server.middleware import API_PREFIXES, GuardMiddleware, Traffic
from bargein.server.ollama import routes as ollama_routes
from bargein.server.settings import ServerSettings

log = logging.getLogger("bargein.server")
STATIC_DIR = Path(__file__).parent / "static"
FORCE_FINISH_AT = 0.9  # of the shutdown timeout: when the server ends what the engine has not


def create_app(engine: EngineClient, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    ctx = ServerContext(engine, settings)
    engine.register_metrics(ctx.metrics.registry)  # replicas: per-replica series

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.loop = asyncio.get_running_loop()
        engine.start()
        if settings.debug_endpoints:
            ctx.stalls.start()
        yield
        ctx.stalls.stop()
        await finish_shutdown(ctx)

    app = FastAPI(title="bargein", summary="An OpenAI-compatible server where every request can be stopped.",
                  lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)
    for module in (routes_generate, routes_responses, routes_requests, routes_ops):
        app.include_router(module.router)
    # The clients people already use: Anthropic Messages, Ollama, /tokenize (issue 32).
    for module in (anthropic_routes, ollama_routes, routes_tokenize):
        app.include_router(module.router)
    if settings.debug_endpoints:
        app.include_router(routes_ops.debug_router)
    if (STATIC_DIR / "index.html").is_file():
        app.router.routes.append(_UIMount("/", StaticFiles(directory=STATIC_DIR, html=True), name="ui"))
    app.state.traffic = Traffic()
    app.state.access = access_rule(settings)
    app.add_middleware(GuardMiddleware, settings=settings, access=app.state.access, traffic=app.state.traffic,
                       draining=lambda: ctx.draining)
    return app


def access_rule(settings: ServerSettings) -> AccessRule:
    """The one access rule (auth.py): every path needs a key but /health and the page's files."""
    return AccessRule(settings.key_table(), static_paths(STATIC_DIR), settings.allowed_hosts)


def request_shutdown(app: FastAPI) -> None:
    """The signal handler's part: sets a flag and schedules ``begin_shutdown``; takes no lock."""
    ctx: ServerContext = app.state.ctx
    ctx.draining = True
    if ctx.loop is not None:
        ctx.loop.call_soon_threadsafe(begin_shutdown, ctx)


def begin_shutdown(ctx: ServerContext) -> None:
    """Refuses new requests and cancels in-flight ones (reason ``shutdown``). On the loop."""
    ctx.draining = True
    if ctx.shutdown_started:
        return
    ctx.shutdown_started = True
    cancelled = ctx.engine.abort_all(CancelReason.SHUTDOWN)
    log.info("shutting down: cancelled %d in-flight request(s)", len(cancelled))
    asyncio.get_running_loop().call_later(FORCE_FINISH_AT * ctx.settings.shutdown_timeout, _force_finish, ctx)


def _force_finish(ctx: ServerContext) -> None:
    ended = ctx.jobs.force_finish()
    if ended:
        log.warning("shutdown: ended %d request(s) the engine did not answer in time", ended)


async def finish_shutdown(ctx: ServerContext) -> None:
    begin_shutdown(ctx)
    timeout = ctx.settings.shutdown_timeout
    if ctx.background_tasks:
        await asyncio.wait(set(ctx.background_tasks), timeout=timeout)
    await ctx.engine.shutdown(timeout=timeout)
    _force_finish(ctx)
    ctx.pool.shutdown(wait=False, cancel_futures=True)


class _UIMount(Mount):
    """The web UI's files at ``/``, except under the API's prefixes.

    A mount at ``/`` fully matches every path, so ``GET /v1/chat/completions`` would be
    the static files' 404; without it the router finds the POST route's partial match
    and answers 405 with ``Allow``, and an unknown API path is the router's JSON 404.
    """

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] == "http" and scope["path"].startswith((*API_PREFIXES, "/health")):
            return Match.NONE, {}
        return super().matches(scope)
