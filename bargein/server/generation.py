"""Jobs: one HTTP request's engine work, from submission to the last output.

A job submits one engine request per (prompt, choice), registers them under the id the
client sees, and yields their outputs merged as ``(slot, output)``. Whatever way the job
ends (finished, the consumer stopped, the task cancelled by a disconnect or a shutdown),
every engine request that has not finished is aborted and the job leaves the registry.

Outputs follow the engine's contract: intermediate outputs carry deltas; the cumulative
``text``, ``token_ids`` and ``prompt_token_ids`` are read from the finished output only.
``Progress`` accumulates the deltas of each slot for whoever needs the text so far.

A job's ``on_final`` hook sees every slot's finished output, also when the consumer left
before it arrived (a disconnect): the runner then reads the rest of that slot's outputs
in the background. That is how the prompt memory learns of every answer, cancelled ones
included.

Backpressure (streamed jobs): the pumps move at most about ``stream_buffer_tokens`` into
the job's buffer ahead of its consumer, and each engine stream holds at most that many
unread (``RequestStream.limit_unread``; the engine pauses the request there). A consumer
that takes nothing for ``stall_timeout`` seconds while the buffer is full sets
``job.stalled``: its response ends, and the job is abandoned with reason ``disconnect``,
keeping exactly the tokens taken from the engine (C3).

Tenants (``tenant_gate.py``): a job whose tenant has its limit of requests in flight is
registered *queued*, its slots unsubmitted; it is handed to the engine when one of the
tenant's jobs closes, or ends cancelled without having run (a cancel while queued, the
server draining). ``abort`` is the cancel routes' way in, for both kinds.

Shutdown (``force_finish``): after the engine had its chance to answer every request,
any slot still without a final output gets one made here (cancelled, reason
``shutdown``), so no stream or collector is left waiting.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from fastapi import Request

from bargein.engine.client import EngineClient
from bargein.engine.request import AbortResult, CancelReason, FinishReason, RequestOutput
from bargein.engine.sampling import MAX_SEED, SamplingParams
from bargein.server.errors import REQUEST_ID, APIError, from_engine_exception
from bargein.server.job_slots import (
    FinalHook,
    ForcedEnd,
    Progress,
    Slot,
    SlotOutputs,
    failed_final,
    is_forced,
    shutdown_final,
    unsubmitted_final,
)
from bargein.server.metrics import ServerMetrics
from bargein.server.registry import RequestRegistry, RequestSummary, engine_id_for
from bargein.server.tenant_gate import NO_TENANT_LIMITS, TenantGate, TenantLimits

log = logging.getLogger("bargein.server")
T = TypeVar("T")
LATE_FINAL_WAIT_S = 60.0  # how long a left job's final outputs are awaited in the background


class ClientGone(Exception):
    """The client disconnected before the answer was ready; its request was cancelled."""


@dataclass(frozen=True)
class EngineWork:
    """What a job's slots submit: slot ``(p, j)`` runs ``prompts[p]`` as choice ``j`` of ``n``."""

    prompts: list[list[int]]
    params: SamplingParams
    n: int
    timeout: float | None
    constraint_from: int | None


@dataclass
class Job:
    request_id: str
    endpoint: str
    slots: list[Slot]
    received: float  # time.monotonic() when the HTTP request arrived
    on_final: FinalHook | None = None
    progress: dict[int, Progress] = field(default_factory=dict)  # by slot index
    merged: asyncio.Queue = field(default_factory=asyncio.Queue)  # (slot, output) from every slot
    pumps: list[asyncio.Task] = field(default_factory=list)  # slot queue -> merged, while consumed
    closed: bool = False  # left the registry; its outcome is recorded
    buffer_tokens: int | None = None  # streamed: tokens in ``merged`` at most before the pumps wait
    stall_timeout: float | None = None  # streamed: seconds the pumps wait for a read before ``stalled``
    buffered: int = 0  # tokens in ``merged``
    room: asyncio.Event = field(default_factory=asyncio.Event)  # set when the consumer took from ``merged``
    stalled: asyncio.Event = field(default_factory=asyncio.Event)  # its consumer stopped reading: end it
    tenant: str = ""  # who asked (the Tenant's name)
    work: EngineWork | None = None  # what its slots submit to the engine
    queued_at: float | None = None  # time.monotonic() when it joined its tenant's queue (None: it did not)
    admitted: float | None = None  # time.monotonic() when handed to the engine (after its tenant's queue)

    def __post_init__(self) -> None:
        self.progress = {slot.index: Progress() for slot in self.slots}

    @property
    def finals(self) -> dict[int, RequestOutput]:
        return {i: p.final for i, p in self.progress.items() if p.final is not None}

    @property
    def finished(self) -> bool:
        return all(p.final is not None for p in self.progress.values())


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


class JobRunner:
    """Starts jobs on the engine and streams their outputs, with metrics and bookkeeping.

    Dependencies are given, not looked up: the engine, the registry of live HTTP
    requests, the metrics, the queue limits (all tenants; each tenant's in flight and
    queued, ``tenant_gate.py``) and a ``draining`` check (shutdown began).
    """

    def __init__(self, engine: EngineClient, registry: RequestRegistry, metrics: ServerMetrics, *,
                 max_queue: int | None, draining: Callable[[], bool], tenant_limits: TenantLimits = NO_TENANT_LIMITS,
                 stream_buffer_tokens: int | None = None, stall_timeout: float | None = None):
        self.engine = engine
        self.stream_buffer_tokens = stream_buffer_tokens
        self.stall_timeout = stall_timeout
        self.registry = registry
        self.metrics = metrics
        self.max_queue = max_queue
        self.gate = TenantGate(tenant_limits)
        self._draining = draining
        self._open: dict[int, Job] = {}  # by id(job): jobs not yet closed
        self._waiting: dict[str, Job] = {}  # by request id: jobs queued behind their tenant's in-flight limit
        self._late: set[asyncio.Task] = set()

    def check_capacity(self, request_id: str, tenant: str = "") -> None:
        """Refuses a new request when shutting down, over the server's queue limit or
        reusing a live id. (The tenant's limits are the gate's, ``start``.)"""
        if self._draining():
            self.metrics.rejected["shutting_down"] += 1
            raise APIError(503, "the server is shutting down", code="shutting_down")
        limit = self.max_queue
        if limit is not None and len(self.registry) >= limit:
            self.metrics.reject(tenant, "queue_full")
            raise APIError(429, f"the server already has {len(self.registry)} requests in flight "
                                f"(--max-queue {limit}); retry later", code="queue_full",
                           headers={"Retry-After": "1"})
        if request_id in self.registry:
            raise APIError(409, f"request id {request_id!r} is already in use", param="X-Request-Id",
                           code="request_id_in_use")

    def start(self, request_id: str, endpoint: str, prompts: Sequence[Sequence[int]],
              params: SamplingParams, *, n: int = 1, timeout: float | None = None,
              received: float | None = None, on_final: FinalHook | None = None,
              constraint_from: int | None = None, streamed: bool = False, tenant: str = "") -> Job:
        """Submits every (prompt, choice) to the engine and registers the job under ``tenant``;
        or, when the tenant has its limit in flight, registers it queued (submitted when one
        of the tenant's requests ends, ``tenant_gate.py``).

        ``streamed``: its consumer is a client's stream, bounded (module doc, backpressure).
        Raises APIError (the tenant's 429 among them); on failure nothing stays submitted.
        """
        self.check_capacity(request_id, tenant)
        work = EngineWork([list(p) for p in prompts], params, n, timeout, constraint_from)
        slots = [Slot(engine_id_for(request_id, p * n + j), SlotOutputs(self.engine), p * n + j, p)
                 for p in range(len(prompts)) for j in range(n)]
        job = Job(request_id, endpoint, slots, received or time.monotonic(), on_final, tenant=tenant, work=work)
        if streamed and self.stream_buffer_tokens is not None:
            job.buffer_tokens, job.stall_timeout = self.stream_buffer_tokens, self.stall_timeout
        try:
            in_flight = self.gate.enter(tenant, request_id)
        except APIError as refusal:
            self.metrics.reject(tenant, refusal.code or "tenant_limit")
            raise
        if in_flight:
            try:
                self._submit(job)
            except BaseException:
                self._admit(self.gate.leave(tenant, request_id))
                raise
        else:
            self._waiting[request_id] = job
            job.queued_at = time.monotonic()
        self.registry.add(request_id, [s.engine_id for s in slots], endpoint, tenant)
        self._open[id(job)] = job
        return job

    def _submit(self, job: Job, waited: float = 0.0) -> None:
        """Hands the job's slots (those not ended while it waited) to the engine, their
        deadline less the ``waited`` seconds in the tenant's queue. Raises the mapped
        APIError; nothing of the job stays submitted then."""
        work = job.work
        assert work is not None
        timeout = None if work.timeout is None else work.timeout - waited
        if timeout is not None and timeout <= 0:
            self._end_waiting(job, CancelReason.DEADLINE)
            return
        try:
            for slot in job.slots:
                if slot.queue.unsubmitted_end is not None:
                    continue
                _, stream = self.engine.submit(work.prompts[slot.prompt_index],
                                               _choice_params(work.params, slot.index % work.n, work.n),
                                               request_id=slot.engine_id, timeout=timeout,
                                               constraint_from=work.constraint_from)
                if job.buffer_tokens is not None:
                    stream.limit_unread(job.buffer_tokens)
                slot.queue.attach(stream)
        except Exception as exc:
            for slot in job.slots:
                if slot.queue.submitted:
                    self.engine.abort(slot.engine_id, CancelReason.ERROR)
            mapped = from_engine_exception(exc)
            if mapped is None:
                raise
            raise mapped from None
        job.admitted = time.monotonic()
        self.metrics.tenants.queued_for(job.tenant, job.admitted - job.received)

    def _admit(self, request_ids: list[str]) -> None:
        """Queued jobs whose tenant has room in flight again: to the engine (while the
        server drains, ended as cancelled instead: nothing new starts)."""
        for request_id in request_ids:
            job = self._waiting.pop(request_id, None)
            if job is None:
                continue
            if self._draining():
                self._end_waiting(job, CancelReason.SHUTDOWN)
                continue
            try:
                self._submit(job, time.monotonic() - (job.queued_at or job.received))
            except Exception as exc:
                log.warning("%s could not start after waiting in its tenant's queue: %s", request_id, exc)
                message = exc.message if isinstance(exc, APIError) else f"{type(exc).__name__}: {exc}"
                self._end_waiting(job, None, message)

    def _end_waiting(self, job: Job, reason: CancelReason | None, error: str | None = None) -> None:
        for slot in job.slots:
            if not slot.queue.submitted and slot.queue.unsubmitted_end is None:
                prompt = job.work.prompts[slot.prompt_index] if job.work else ()
                slot.queue.end_unsubmitted(unsubmitted_final(slot, len(prompt), reason, error))

    def waiting(self, tenant: str) -> list[RequestSummary]:
        """``tenant``'s jobs waiting in its queue, as ``GET /v1/requests`` lists them."""
        now = time.monotonic()
        return [RequestSummary(job.request_id, "queued", sum(len(p) for p in job.work.prompts), 0, 0,
                               now - job.received, None)
                for job in self._waiting.values() if job.tenant == tenant and job.work is not None]

    def abort(self, engine_id: str, reason: CancelReason = CancelReason.USER) -> AbortResult:
        """Cancels one engine request of a job: in the engine, or, for a job still queued
        in its tenant's line, here (it ends without having run). The cancel routes' abort."""
        request_id = self.registry.owner(engine_id)
        job = self._waiting.get(request_id) if request_id is not None else None
        if job is None:
            return self.engine.abort(engine_id, reason)
        result = AbortResult.ALREADY_FINISHED
        for slot in job.slots:
            if slot.engine_id == engine_id and slot.queue.unsubmitted_end is None:
                prompt = job.work.prompts[slot.prompt_index] if job.work else ()
                slot.queue.end_unsubmitted(unsubmitted_final(slot, len(prompt), reason))
                result = AbortResult.CANCELLED
        if all(slot.queue.unsubmitted_end is not None for slot in job.slots):  # nothing left to run: out of the line
            del self._waiting[job.request_id]
            self.gate.leave(job.tenant, job.request_id)
        return result

    async def outputs(self, job: Job, *, exit_reason: CancelReason = CancelReason.DISCONNECT
                      ) -> AsyncIterator[tuple[Slot, RequestOutput]]:
        """The job's outputs as they come; ends when every slot has finished.

        Stopping early (a break, a cancelled task) aborts the unfinished slots with
        ``exit_reason``.
        """
        merged = job.merged
        job.pumps = [asyncio.ensure_future(_pump(job, slot, merged)) for slot in job.slots]
        last_time: dict[int, float] = {}
        first_token_seen = False
        try:
            remaining = len(job.slots)
            while remaining:
                slot, out = await merged.get()
                job.buffered -= len(out.new_token_ids)
                job.room.set()
                now = time.monotonic()
                if out.new_token_ids:
                    self.metrics.token_rate.add(len(out.new_token_ids), now)
                    if not first_token_seen:
                        first_token_seen = True
                        self.metrics.ttft.observe(now - job.received)
                    elif slot.index in last_time:
                        self.metrics.itl.observe((now - last_time[slot.index]) / len(out.new_token_ids))
                    last_time[slot.index] = now
                self._take(job, slot, out)
                if out.finished:
                    remaining -= 1
                yield slot, out
                if out.new_token_ids and out.emitted_at is not None:  # its events are sent by now
                    self.metrics.send_delay.observe(time.monotonic() - out.emitted_at)
        finally:
            self.abandon(job, exit_reason)

    @staticmethod
    def _take(job: Job, slot: Slot, out: RequestOutput) -> None:
        job.progress[slot.index].add(out)
        if out.finished and job.on_final is not None and not is_forced(out):
            job.on_final(slot, out)

    async def collect(self, job: Job, *, exit_reason: CancelReason = CancelReason.DISCONNECT) -> Job:
        """Runs the job to its end; its ``progress`` then holds every slot's final output."""
        async for _ in self.outputs(job, exit_reason=exit_reason):
            pass
        return job

    def abandon(self, job: Job, reason: CancelReason = CancelReason.DISCONNECT) -> None:
        """Closes a job whose outputs were not (all) consumed: aborts what still runs.

        The safety net behind every route: a response torn down before its body was
        iterated, or a collecting task cancelled before it started, leaves nothing
        running. A no-op for a job already closed.
        """
        if job.closed:
            return
        job.closed = True
        self._open.pop(id(job), None)
        for pump in job.pumps:  # stop reading the engine's queues here: _late_finals may go on
            pump.cancel()
        while not job.merged.empty():  # delivered by the engine but not read: still part of the answer
            self._take(job, *job.merged.get_nowait())
        unfinished = [slot for slot in job.slots if (final := job.progress[slot.index].final) is None
                      or is_forced(final)]
        for slot in unfinished:  # the engine keeps exactly what the client was handed (C3)
            if slot.queue.submitted:
                self.engine.abort(slot.engine_id, reason, delivered=slot.queue.num_delivered)
        self._waiting.pop(job.request_id, None)
        self._admit(self.gate.leave(job.tenant, job.request_id))
        self.registry.finish(job.request_id)
        outcome = job_outcome(job, reason)
        self.metrics.record_outcome(job.endpoint, outcome)
        self.metrics.duration.observe(time.monotonic() - job.received)
        self.metrics.tenants.finished(job.tenant, outcome, *job_tokens(job))
        unanswered = [slot for slot in unfinished if job.progress[slot.index].final is None and slot.queue.submitted]
        if unanswered and job.on_final is not None:
            task = asyncio.ensure_future(self._late_finals(job, unanswered))
            self._late.add(task)
            task.add_done_callback(self._late.discard)

    async def _late_finals(self, job: Job, slots: list[Slot]) -> None:
        """Reads left slots to their final output, for ``on_final`` (the prompt memory)."""
        for slot in slots:
            try:
                while True:
                    out = await asyncio.wait_for(slot.queue.get(), LATE_FINAL_WAIT_S)
                    if isinstance(out, ForcedEnd):
                        break
                    if out.finished:
                        assert job.on_final is not None
                        job.on_final(slot, out)
                        break
            except TimeoutError:
                log.warning("no final output for %s within %.0f s", slot.engine_id, LATE_FINAL_WAIT_S)

    def force_finish(self) -> int:
        """Ends every open job's unfinished slots now (shutdown, after the engine's chance).

        Returns how many slots were ended this way. Their final output is made here from
        what was delivered: ``finish_reason`` cancelled, ``cancel_reason`` shutdown.
        """
        ended = 0
        for job in list(self._open.values()):
            for slot in job.slots:
                if job.progress[slot.index].final is None:
                    slot.queue.force_end()
                    ended += 1
        for task in list(self._late):
            task.cancel()
        return ended


async def _pump(job: Job, slot: Slot, merged: asyncio.Queue) -> None:
    """Moves one slot's outputs into the job's merged queue, up to its final one; for a
    streamed job, only while the buffer has room (module doc, backpressure)."""
    while True:
        if not await _room_in_buffer(job):
            log.warning("%s: the client read nothing for %.0f s with %d tokens waiting; cancelling it (disconnect)",
                        job.request_id, job.stall_timeout or 0, job.buffered)
            job.stalled.set()
            return
        try:
            item = await slot.queue.get()
        except Exception as exc:  # reading the output failed: end the slot, never leave the job waiting
            log.exception("reading the outputs of %s failed", slot.engine_id)
            item = failed_final(slot, job.progress[slot.index], f"{type(exc).__name__}: {exc}")
        if isinstance(item, ForcedEnd):
            item = shutdown_final(slot, job.progress[slot.index])
        merged.put_nowait((slot, item))
        job.buffered += len(item.new_token_ids)
        if item.finished:
            return


async def _room_in_buffer(job: Job) -> bool:
    """Waits while the job's buffer is full; False if its consumer took nothing for the stall timeout."""
    if job.buffer_tokens is None:
        return True
    while job.buffered >= job.buffer_tokens:
        job.room.clear()
        try:
            await asyncio.wait_for(job.room.wait(), job.stall_timeout)
        except TimeoutError:
            return False
    return True


def job_tokens(job: Job) -> tuple[int, int]:
    """The job's (prompt, completion) tokens: each prompt once, every choice's answer."""
    prompt = completion = 0
    for slot in job.slots:
        usage = job.progress[slot.index].last_usage
        if usage is not None:
            completion += usage.completion_tokens
            prompt += usage.prompt_tokens if slot.index % (job.work.n if job.work else 1) == 0 else 0
    return prompt, completion


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
