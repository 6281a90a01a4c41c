"""The one serving path of chat completions, completions and responses.

A route validates its body and builds a :class:`Generation` (its id, prompts, params,
deadline) and a :class:`~bargein.server.openai_stream.Shape`; ``serve`` does the rest
for all of them: start the job, then stream it (``event_stream``) or collect it under a
disconnect watch, and close it however the response ends, so no request is left
running behind a client that went away.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from bargein.engine.request import CancelReason
from bargein.engine.sampling import SamplingParams
from bargein.server.context import ServerContext, tenant_of
from bargein.server.generation import ClientGone, FinalHook, Job, unless_disconnected
from bargein.server.keepalive import job_prompt_progress, with_keepalives
from bargein.server.openai_stream import Shape, collect, event_stream
from bargein.server.sse import EventStream
from bargein.server.tenants import ANONYMOUS, Tenant, prefix_namespace

CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, but logs do


@dataclass(frozen=True)
class Generation:
    """What a route asks of the engine, validated."""

    endpoint: str  # "chat" | "completions" | "responses": metrics and logs
    request_id: str  # the id the client sees
    received: float  # time.monotonic() when the request arrived
    prompts: list[list[int]]
    params: SamplingParams
    n: int = 1
    timeout: float | None = None
    stream: bool = False
    on_final: FinalHook | None = None  # sees every choice's final output (the prompt memory)
    constraint_from: int | None = None  # prompt token where a continued constrained answer began
    cache_salt: str | None = None  # the request's own prefix-cache namespace (vLLM's ``cache_salt``)
    tenant: Tenant = ANONYMOUS  # who asked: set by ``serve`` from the request


def start(ctx: ServerContext, gen: Generation) -> Job:
    """Starts the job under the tenant's name, its prompts in the tenant's prefix-cache
    namespace (plus the request's own salt) unless the server shares one cache."""
    namespace = prefix_namespace(gen.tenant, gen.cache_salt, shared=ctx.settings.shared_prefix_cache)
    params = gen.params if namespace is None else replace(gen.params, cache_salt=namespace)
    return ctx.jobs.start(gen.request_id, gen.endpoint, gen.prompts, params, n=gen.n, timeout=gen.timeout,
                          received=gen.received, on_final=gen.on_final, constraint_from=gen.constraint_from,
                          streamed=gen.stream, tenant=gen.tenant.name)


async def serve(request: Request, ctx: ServerContext, gen: Generation, shape: Shape,
                on_start: Callable[[], None] | None = None, media_type: str = "text/event-stream") -> Response:
    """Starts ``gen`` and answers it in ``shape``: a stream, or one body once finished.

    ``on_start`` runs once the job is accepted (a stored response becomes visible). The
    job belongs to the request's tenant, whatever ``gen`` says. ``media_type`` is the
    stream's (Ollama's NDJSON).
    """
    gen = replace(gen, tenant=tenant_of(request))
    job = start(ctx, gen)
    if on_start is not None:
        try:
            on_start()
        except BaseException:  # refused after all (a 409): nothing may stay running
            ctx.jobs.abandon(job, CancelReason.ERROR)
            raise
    headers = {"X-Request-Id": gen.request_id}

    def close(reason: CancelReason = CancelReason.DISCONNECT) -> None:
        ctx.jobs.abandon(job, reason)
        shape.closed(reason)

    if gen.stream:
        events = event_stream(ctx.jobs, job, shape)
        interval = ctx.settings.sse_keepalive_s
        if interval > 0 and media_type == "text/event-stream":  # comments are SSE's: NDJSON has none
            events = with_keepalives(events, interval,
                                     job_prompt_progress(ctx.engine, [slot.engine_id for slot in job.slots]))
        return EventStream(events, on_close=close, headers=headers, media_type=media_type, stalled=job.stalled)
    try:
        await unless_disconnected(request, collect(ctx.jobs, job, shape))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        close()
    return JSONResponse(shape.body(job), headers=headers)


def serve_in_background(ctx: ServerContext, gen: Generation, shape: Shape) -> Job:
    """Starts ``gen`` and runs it to its end in a task that outlives the HTTP request.

    Only a cancel or the server's shutdown stops it (reason ``shutdown``). ``gen.tenant``
    must be the requesting tenant (the route sets it).
    """
    job = start(ctx, gen)

    async def run() -> None:
        try:
            await collect(ctx.jobs, job, shape, CancelReason.SHUTDOWN)
        finally:
            ctx.jobs.abandon(job, CancelReason.SHUTDOWN)
            shape.closed(CancelReason.SHUTDOWN)

    task = asyncio.ensure_future(run())
    ctx.background_tasks.add(task)  # held, or the task could be garbage-collected mid-run
    task.add_done_callback(ctx.background_tasks.discard)
    return job
