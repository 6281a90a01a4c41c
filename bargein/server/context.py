"""ServerContext: the state one app instance owns, reachable from every route.

Built by ``create_app`` and kept on ``app.state``; there are no module-level globals, so
tests can run several apps side by side. The parts it holds get their dependencies
from it explicitly at construction (the job runner its engine, registry and metrics;
the prompt builder its tokenizer, pool and memory); none of them imports this module.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from typing import Annotated, Any

from fastapi import Depends, Request

from bargein.engine.client import EngineClient, EngineInfo
from bargein.server.generation import JobRunner
from bargein.server.metrics import ServerMetrics
from bargein.server.metrics_tenants import TenantSeries
from bargein.server.middleware import scope_tenant
from bargein.server.openai_format import system_fingerprint
from bargein.server.prompt_memory import PromptMemory
from bargein.server.prompts import PromptBuilder, max_token_bytes
from bargein.server.registry import RequestRegistry
from bargein.server.responses_store import ResponseStore
from bargein.server.settings import ServerSettings
from bargein.server.stalls import StallWatch
from bargein.server.tenant_gate import TenantLimits
from bargein.server.tenants import Tenant


def bargein_version() -> str:
    try:
        return metadata.version("bargein")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass
class ServerContext:
    engine: EngineClient
    settings: ServerSettings
    registry: RequestRegistry = field(default_factory=RequestRegistry)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # set on SIGINT/SIGTERM: new requests get 503
    shutdown_started: bool = False  # begin_shutdown ran (in-flight requests were cancelled)
    loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once the app started
    background_tasks: set[asyncio.Task] = field(default_factory=set)  # background responses
    stalls: StallWatch = field(default_factory=StallWatch)  # started with the debug endpoints
    jobs: JobRunner = field(init=False)
    responses: ResponseStore = field(init=False)
    memory: PromptMemory = field(init=False)
    pool: ThreadPoolExecutor = field(init=False)  # rendering and tokenizing, off the event loop
    prompts: PromptBuilder = field(init=False)
    fingerprint: str = field(init=False)
    model: EngineInfo = field(init=False)  # the engine client's describe(), once

    def __post_init__(self) -> None:
        s = self.settings
        core = self.model = self.engine.describe()
        self.metrics.tenants = TenantSeries(s.key_table().tenants, max_series=s.max_tenant_series,
                                            operators=s.operator_tenants)
        limits = TenantLimits(s.max_in_flight_per_tenant, s.max_queued_per_tenant)
        self.jobs = JobRunner(self.engine, self.registry, self.metrics, max_queue=s.max_queue,
                              tenant_limits=limits, draining=lambda: self.draining,
                              stream_buffer_tokens=s.stream_buffer_tokens, stall_timeout=s.stream_stall_timeout)
        self.responses = ResponseStore(s.max_stored_responses)
        self.memory = PromptMemory(s.continuation_memory_entries, s.continuation_memory_tokens)
        self.pool = ThreadPoolExecutor(s.tokenizer_threads, thread_name_prefix="bargein-tokenize")
        tokenizer = self.engine.tokenizer
        self.prompts = PromptBuilder(tokenizer, self.pool, self.memory, max_model_len=core.max_model_len,
                                     eos_token_ids=core.eos_token_ids, token_bytes_bound=max_token_bytes(tokenizer))
        self.fingerprint = system_fingerprint(bargein_version(), core.model_name, core.precision)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.model.model_name

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def head(self, request_id: str) -> dict[str, Any]:
        """The fields every response and chunk of a request starts with."""
        return {"id": request_id, "created": int(time.time()), "model": self.model_name,
                "system_fingerprint": self.fingerprint}


def get_ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


def tenant_of(request: Request) -> Tenant:
    """The tenant the access rule found for this request (its API key's; anonymous without keys)."""
    return scope_tenant(request.scope)


Ctx = Annotated[ServerContext, Depends(get_ctx)]  # a route parameter: ``ctx: Ctx``
Caller = Annotated[Tenant, Depends(tenant_of)]  # a route parameter: ``tenant: Caller``
