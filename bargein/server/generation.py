"""Jobs: one HTTP request's engine work, from submission to the last output.

A job submits one engine request per (prompt, choice), registers them under the id
the client sees, and yields their outputs merged as ``(slot, output)``. Whatever way the
job ends (finished, the consumer stopped, the task cancelled by a disconnect or a
shutdown), every engine request that has not finished is aborted (``AsyncEngine.stream``
does that) and the job leaves the registry.

Non-streaming routes run their collection under ``until_disconnect``, so a client that
hangs up while its request is still queued or running cancels it at the next step
boundary, just as a streaming client does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request

from bargein.engine.request import CancelReason, FinishReason, RequestOutput
from bargein.engine.sampling import MAX_SEED, SamplingParams
from bargein.server.errors import REQUEST_ID, APIError, from_engine_exception

if TYPE_CHECKING:
    from bargein.server.app import ServerContext

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the answer was ready; its request was cancelled."""


@dataclass(frozen=True)
class Slot:
    """One engine request of a job: which prompt, which choice, and its output index."""

    engine_id: str
    queue: asyncio.Queue
    index: int  # the choice index the client sees
    prompt_index: int


@dataclass
class Job:
    request_id: str
    endpoint: str
    slots: list[Slot]
    received: float  # time.monotonic() when the HTTP request arrived
    finals: dict[int, RequestOutput] = field(default_factory=dict)  # by slot index
    closed: bool = False  # left the registry; its outcome is recorded

    @property
    def finished(self) -> bool:
        return len(self.finals) == len(self.slots)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def request_id_for(request: Request, prefix: str) -> str:
    """The id the client chose in ``X-Request-Id``, or a fresh one with ``prefix``."""
    chosen = request.headers.get("x-request-id")
    if chosen is None:
        request.state.request_id = new_id(prefix)
    elif REQUEST_ID.fullmatch(chosen):
        request.state.request_id = chosen
    else:
        raise APIError(400, "X-Request-Id must be 1-128 characters of letters, digits and ._:-",
                       param="X-Request-Id")
    return request.state.request_id


def effective_timeout(requested: float | None, server_timeout: float | None) -> float | None:
    """The tighter of the request's own ``timeout`` and the server's ``--request-timeout``."""
    if requested is not None and not requested > 0:
        raise APIError(400, f"timeout must be a positive number of seconds, got {requested}",
                       param="timeout", code="invalid_value")
    given = [t for t in (requested, server_timeout) if t is not None]
    return min(given) if given else None


class JobRunner:
    """Starts jobs on the engine and streams their outputs, with metrics and bookkeeping."""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    def check_capacity(self, request_id: str) -> None:
        """Refuses a new request when shutting down, over the queue limit or reusing a live id."""
        ctx = self.ctx
        if ctx.draining:
            ctx.metrics.rejected["shutting_down"] += 1
            raise APIError(503, "the server is shutting down", code="shutting_down")
        limit = ctx.settings.max_queue
        if limit is not None and len(ctx.registry) >= limit:
            ctx.metrics.rejected["queue_full"] += 1
            raise APIError(429, f"the server already has {len(ctx.registry)} requests in flight "
                                f"(--max-queue {limit}); retry later", code="queue_full",
                           headers={"Retry-After": "1"})
        if request_id in ctx.registry:
            raise APIError(409, f"request id {request_id!r} is already in use", param="X-Request-Id",
                           code="request_id_in_use")

    def start(self, request_id: str, endpoint: str, prompts: Sequence[Sequence[int]],
              params: SamplingParams, *, n: int = 1, timeout: float | None = None,
              received: float | None = None) -> Job:
        """Submits every (prompt, choice) to the engine and registers the job.

        Raises APIError; on failure nothing stays submitted.
        """
        self.check_capacity(request_id)
        total = len(prompts) * n
        slots: list[Slot] = []
        try:
            for p, prompt in enumerate(prompts):
                for j in range(n):
                    index = p * n + j
                    engine_id = request_id if total == 1 else f"{request_id}-{index}"
                    rid, queue = self.ctx.engine.submit(list(prompt), _choice_params(params, j, n),
                                                        request_id=engine_id, timeout=timeout)
                    slots.append(Slot(rid, queue, index, p))
        except Exception as exc:
            for slot in slots:
                self.ctx.engine.abort(slot.engine_id, CancelReason.ERROR)
            mapped = from_engine_exception(exc)
            if mapped is None:
                raise
            raise mapped from None
        self.ctx.registry.add(request_id, [s.engine_id for s in slots], endpoint)
        return Job(request_id, endpoint, slots, received or time.monotonic())

    async def outputs(self, job: Job, *, exit_reason: CancelReason = CancelReason.DISCONNECT
                      ) -> AsyncIterator[tuple[Slot, RequestOutput]]:
        """The job's outputs as they come; ends when every slot has finished.

        Stopping early (a break, a cancelled task) aborts the unfinished slots with
        ``exit_reason``.
        """
        metrics = self.ctx.metrics
        last_time: dict[int, float] = {}
        first_token_seen = False
        try:
            async for slot, out in self._merged(job, exit_reason):
                now = time.monotonic()
                if out.new_token_ids:
                    metrics.token_rate.add(len(out.new_token_ids), now)
                    if not first_token_seen:
                        first_token_seen = True
                        metrics.ttft.observe(now - job.received)
                    elif slot.index in last_time:
                        gap = (now - last_time[slot.index]) / len(out.new_token_ids)
                        metrics.itl.observe(gap)
                    last_time[slot.index] = now
                if out.finished:
                    job.finals[slot.index] = out
                yield slot, out
        finally:
            self._close(job, exit_reason)

    def abandon(self, job: Job, reason: CancelReason = CancelReason.DISCONNECT) -> None:
        """Closes a job whose outputs were not (all) consumed: aborts what still runs.

        The safety net behind every route: a response torn down before its body was
        iterated, or a collecting task cancelled before it started, leaves nothing
        running. A no-op for a job that finished normally.
        """
        if job.closed:
            return
        for slot in job.slots:
            if slot.index not in job.finals:
                self.ctx.engine.abort(slot.engine_id, reason)
        self._close(job, reason)

    def _close(self, job: Job, exit_reason: CancelReason) -> None:
        if job.closed:
            return
        job.closed = True
        self.ctx.registry.finish(job.request_id)
        self.ctx.metrics.record_outcome(job.endpoint, job_outcome(job, exit_reason))
        self.ctx.metrics.duration.observe(time.monotonic() - job.received)

    async def _merged(self, job: Job, exit_reason: CancelReason
                      ) -> AsyncIterator[tuple[Slot, RequestOutput]]:
        engine = self.ctx.engine
        if len(job.slots) == 1:
            slot = job.slots[0]
            async for out in engine.stream(slot.engine_id, slot.queue, exit_reason=exit_reason):
                yield slot, out
            return
        merged: asyncio.Queue[tuple[Slot, RequestOutput]] = asyncio.Queue()

        async def pump(slot: Slot) -> None:
            async for out in engine.stream(slot.engine_id, slot.queue, exit_reason=exit_reason):
                merged.put_nowait((slot, out))

        tasks = [asyncio.ensure_future(pump(slot)) for slot in job.slots]
        try:
            remaining = len(job.slots)
            while remaining:
                slot, out = await merged.get()
                if out.finished:
                    remaining -= 1
                yield slot, out
        finally:
            for task in tasks:
                task.cancel()  # a pump still waiting aborts its request with exit_reason

    async def collect(self, job: Job, *, exit_reason: CancelReason = CancelReason.DISCONNECT
                      ) -> list[tuple[Slot, list[RequestOutput]]]:
        """Every output of every slot, in slot order, once all have finished."""
        by_slot: dict[int, list[RequestOutput]] = {s.index: [] for s in job.slots}
        async for slot, out in self.outputs(job, exit_reason=exit_reason):
            by_slot[slot.index].append(out)
        return [(slot, by_slot[slot.index]) for slot in job.slots]


def job_outcome(job: Job, exit_reason: CancelReason) -> str:
    """``stop``, ``length``, ``error``, or ``cancelled:<reason>`` for metrics."""
    if not job.finished:
        return f"cancelled:{exit_reason.value}"
    finals = list(job.finals.values())
    for out in finals:
        if out.finish_reason == FinishReason.ERROR:
            return "error"
    for out in finals:
        if out.finish_reason == FinishReason.CANCELLED:
            return f"cancelled:{out.cancel_reason.value if out.cancel_reason else 'unknown'}"
    return finals[0].finish_reason.value if finals and finals[0].finish_reason else "unknown"


def _choice_params(params: SamplingParams, choice: int, n: int) -> SamplingParams:
    """One choice's params: n=1, and with a seed, a distinct one per choice (else all match)."""
    seed = params.seed
    if seed is not None and n > 1:
        seed = (seed + choice) % (MAX_SEED + 1)
    return replace(params, n=1, seed=seed)


async def until_disconnect(request: Request) -> None:
    """Returns when the client hangs up (the ASGI ``http.disconnect`` message)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits ``work``; if the client disconnects first, cancels it and raises ClientGone.

    Cancelling the work cancels its engine requests (reason ``disconnect``) at the next
    step boundary, whether they are running or still queued.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()
