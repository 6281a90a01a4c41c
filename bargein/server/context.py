"""ServerContext: the state one app instance owns, reachable from every route.

Built by ``create_app`` and kept on ``app.state``; there are no module-level globals, so
tests can run several apps side by side.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request

from bargein.engine.async_engine import AsyncEngine
from bargein.server.generation import JobRunner
from bargein.server.metrics import ServerMetrics
from bargein.server.registry import RequestRegistry
from bargein.server.responses_store import ResponseStore
from bargein.server.settings import ServerSettings


@dataclass
class ServerContext:
    engine: AsyncEngine
    settings: ServerSettings
    registry: RequestRegistry = field(default_factory=RequestRegistry)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # set on SIGINT/SIGTERM: new requests get 503
    background_tasks: set[asyncio.Task] = field(default_factory=set)  # background responses
    jobs: JobRunner = field(init=False)
    responses: ResponseStore = field(init=False)

    def __post_init__(self) -> None:
        self.jobs = JobRunner(self)
        self.responses = ResponseStore(self.settings.max_stored_responses)

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.engine.model_config.vocab_size


def get_ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


Ctx = Annotated[ServerContext, Depends(get_ctx)]  # a route parameter: ``ctx: Ctx``
