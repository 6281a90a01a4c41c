"""One engine replica, as it runs inside its Ray actor.

A replica is a whole :class:`~bargein.engine.engine.Engine` (its own model, KV cache and
scheduler) stepped by a thread inside an *async* Ray actor. The actor's event loop takes
the head's calls in the order the head made them (an async actor starts one caller's
calls in submission order, and these bodies never await before acting), so a cancel sent
after a dispatch always finds it.

Outputs leave in batches: the step thread appends each step's deltas to an outbox;
``poll`` (a long poll) returns everything since the last poll as one
:class:`ReplicaBatch`, deltas of one request merged. One Ray round trip carries every
request's tokens of one or more steps, never one object per token.

The replica keeps tombstones too: an abort for an id it has not seen (a dispatch that
raced a failover) is remembered, and a dispatch that arrives after it is dropped and
answered with a cancelled final delta.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from bargein.distributed.router import Tombstones
from bargein.distributed.worker_env import describe_wait_policy
from bargein.engine.admission import Admitted
from bargein.engine.block_keys import KeyChanges
from bargein.engine.engine import Engine, EngineError
from bargein.engine.messages import ConversationMessage, OpenConversation
from bargein.engine.outputs import RequestDelta, StepOutcome
from bargein.engine.request import AbortResult, CancelReason, FinishReason
from bargein.engine.runner import RunnerInfo
from bargein.engine.stats import EngineStats, RequestInfo

log = logging.getLogger("bargein.distributed")

@dataclass(frozen=True)
class WeightsOrigin:
    """Where a replica's weights came from: "file" (its node's copy), "head" (shipped),
    or "stages" (a pipeline: each stage says for itself in its ``/v1/cluster`` entry)."""

    source: str
    received_bytes: int = 0


class EngineBuilder(Protocol):
    """Builds a replica's engine on the replica's node (picklable: it travels there, and
    runs again when Ray restarts the replica). ``build`` returns the engine and where its
    weights came from (None: the builder does not know, e.g. :class:`BuildWith`)."""

    def build(self) -> tuple[Engine, WeightsOrigin | None]: ...


@dataclass(frozen=True)
class BuildWith:
    """An :class:`EngineBuilder` from a plain picklable function (tests, embedders)."""

    make: Callable[[], Engine]

    def build(self) -> tuple[Engine, WeightsOrigin | None]:
        return self.make(), None


@dataclass(frozen=True)
class ModelFacts:
    """What the head needs to know about the model the replicas serve (from replica 0)."""

    model_name: str
    tokenizer: Any
    model_config: Any
    config: Any  # the replica's EngineConfig
    max_model_len: int
    eos_token_ids: frozenset[int]
    block_size: int
    num_blocks: int


@dataclass
class ReplicaBatch:
    """Everything a replica produced since the last poll."""

    replica: int
    deltas: list[RequestDelta] = field(default_factory=list)
    steps: int = 0  # the replica's step count so far
    available_blocks: int = 0  # KV blocks an allocation could take after the last step
    step_durations: list[float] = field(default_factory=list)
    cancel_latencies: list[float] = field(default_factory=list)
    cancel_latency_steps: list[int] = field(default_factory=list)
    cache: KeyChanges = field(default_factory=KeyChanges)  # prefix-cache keys registered/evicted since


@dataclass
class ReplicaCounters:
    """What one replica was asked to do; read by tests and ``/v1/cluster``."""

    submitted: int = 0
    resumed: int = 0  # dispatches that continue an answer begun on a lost replica
    aborts: Counter = field(default_factory=Counter)  # abort calls received, by reason
    dropped_late: int = 0  # dispatches dropped because their cancel came first
    rejected: int = 0  # dispatches the engine refused
    polls: int = 0
    deltas_sent: int = 0


@dataclass(frozen=True)
class ReplicaInfo:
    """A replica's state for ``/v1/cluster``."""

    index: int
    node_id: str
    pid: int
    started: float  # time.time() when this incarnation started
    stats: EngineStats
    counters: ReplicaCounters
    evictions: int = 0  # cached KV blocks its pool evicted
    weights_from: str | None = None  # "file", "head" (shipped) or "stages" (a pipeline's, per stage)
    weights_received_bytes: int = 0
    pipeline: RunnerInfo | None = None  # a replica that is a pipeline: its stages
    threads: int = 1  # its compute threads (torch's intra-op threads, which the kernels share)
    wait_policy: str = ""  # how those threads wait between kernels ("GOMP_SPINCOUNT=100")


class ReplicaWorker:
    """The actor's body: an Engine, its step thread, an outbox and tombstones."""

    def __init__(self, index: int, build: EngineBuilder | str, threads: int = 1):
        torch.set_num_threads(threads)
        if isinstance(build, str):  # the name of the store that holds it (see launch.start_replicas)
            import ray

            build = ray.get(ray.get_actor(build).get.remote(index))
        self.index = index
        self.engine, self.weights_origin = build.build()
        self.engine.pool.track_key_changes()  # reported with each batch: the router's index follows it
        self.started = time.time()
        self.counters = ReplicaCounters()
        self._tombstones = Tombstones()
        self._outbox: dict[str, RequestDelta] = {}  # by request id, merged; dicts keep arrival order
        self._samples = ReplicaBatch(index, available_blocks=self.engine.pool.num_available)
        self._lock = threading.Lock()  # the step thread vs the actor's loop; never held across a wait
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self._stopping = threading.Event()
        self._cancel_seen = 0
        self._thread = threading.Thread(target=self._run, name=f"bargein-replica-{index}", daemon=True)
        self._thread.start()

    # -- the step thread ------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            try:
                engine.wait_for_work(timeout=0.1)
                if engine.has_work and not self._stopping.is_set():
                    self._emit(engine.step())
            except BaseException:  # the step loop must not vanish: a failed step fails its requests
                log.exception("replica %d: the step loop failed", self.index)
                time.sleep(0.05)

    def _emit(self, outcome: StepOutcome) -> None:
        counters = self.engine.counters
        with self._lock:
            for delta in outcome.deltas:
                pending = self._outbox.get(delta.request_id)
                if pending is None:
                    self._outbox[delta.request_id] = delta
                else:
                    pending.merge(delta)
            s = self._samples
            if counters.steps > s.steps:
                s.step_durations.append(counters.step_durations[-1])
            s.steps = counters.steps
            s.cache.merge(self.engine.pool.drain_key_changes())
            s.available_blocks = self.engine.pool.num_available
            new_cancels = counters.cancel_samples - self._cancel_seen
            if new_cancels > 0:
                s.cancel_latencies.extend(list(counters.cancel_latencies)[-new_cancels:])
                s.cancel_latency_steps.extend(list(counters.cancel_latency_steps)[-new_cancels:])
                self._cancel_seen = counters.cancel_samples
            wake = bool(self._outbox)
        if wake:
            self._wake()

    def _wake(self) -> None:
        loop, ready = self._loop, self._ready
        if loop is not None and ready is not None:
            with contextlib.suppress(RuntimeError):  # the actor's loop closed: nobody polls any more
                loop.call_soon_threadsafe(ready.set)

    def _push_final(self, request_id: str, reason: FinishReason, cancel_reason: CancelReason | None,
                    error: str | None = None) -> None:
        with self._lock:
            self._outbox[request_id] = RequestDelta(request_id, finished=True, finish_reason=reason,
                                                    cancel_reason=cancel_reason, error=error)
        self._wake()

    # -- the head's calls (the actor's event loop) -------------------------------------
    async def ping(self) -> float:
        """This incarnation's start time: a restarted replica answers a new one."""
        return self.started

    async def describe(self) -> ModelFacts:
        e = self.engine
        return ModelFacts(e.model_name, e.tokenizer, e.model_config, e.config, e.max_model_len,
                          frozenset(e.eos_token_ids), e.pool.block_size, e.pool.num_blocks)

    async def submit(self, request_id: str, admitted: Admitted, *,
                     open_tokens: Sequence[int] | None = None) -> None:
        """Queues a request the head admitted; a refusal or a cancel that came first ends
        it with a final delta.

        ``open_tokens``: first open the request's conversation here with these tokens (a
        conversation moving with its answer after a loss), in the engine's ordered inbox
        before the request (separate actor calls are not ordered on an async actor)."""
        conversation_id = admitted.conversation_id
        if open_tokens is not None and conversation_id is not None:
            self.engine.call_soon(functools.partial(
                self.engine.conversation, OpenConversation(conversation_id, tuple(open_tokens))))
        if request_id in self._tombstones:
            self._tombstones.discard(request_id)
            self.counters.dropped_late += 1
            self._push_final(request_id, FinishReason.CANCELLED, CancelReason.USER)
            return
        self.counters.submitted += 1
        self.counters.resumed += admitted.output_offset > 0
        try:
            self.engine.add_admitted(admitted, request_id=request_id)
        except (EngineError, ValueError) as exc:
            self.counters.rejected += 1
            self._push_final(request_id, FinishReason.ERROR, None, str(exc))

    async def abort(self, request_id: str, reason: CancelReason, delivered: int | None = None) -> AbortResult:
        self.counters.aborts[CancelReason(reason).value] += 1
        result = self.engine.abort(request_id, reason, delivered=delivered)
        if result == AbortResult.NOT_FOUND:
            self._tombstones.add(request_id)
        return result

    async def finish(self, request_id: str, reason: FinishReason, delivered: int) -> CancelReason | None:
        return self.engine.finish(request_id, reason, delivered=delivered)

    async def poll(self, timeout: float) -> ReplicaBatch:
        """Waits up to ``timeout`` s for output, then returns everything since the last poll."""
        if self._ready is None:
            self._loop, self._ready = asyncio.get_running_loop(), asyncio.Event()
        self.counters.polls += 1
        deadline = time.monotonic() + timeout
        while True:
            self._ready.clear()
            with self._lock:
                if self._outbox or self._samples.step_durations or self._samples.cache:
                    batch, self._samples = self._samples, self._idle_batch()
                    batch.deltas, self._outbox = list(self._outbox.values()), {}
                    self.counters.deltas_sent += len(batch.deltas)
                    return batch
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                with self._lock:
                    return self._idle_batch()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), remaining)

    def _idle_batch(self) -> ReplicaBatch:
        """A batch with no samples yet, carrying the current step count and KV room (lock held)."""
        return ReplicaBatch(self.index, steps=self._samples.steps, available_blocks=self._samples.available_blocks)

    async def _in_engine(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.engine.call_soon(fn))

    async def stats(self) -> EngineStats:
        return await self._in_engine(self.engine.stats)

    async def list_requests(self) -> list[RequestInfo]:
        return await self._in_engine(self.engine.list_requests)

    async def conversation(self, message: ConversationMessage) -> Any:
        """A conversation message, applied in the engine's ordered inbox; returns its answer."""
        return await self._in_engine(functools.partial(self.engine.conversation, message))

    async def registered_keys(self) -> set[bytes]:
        """The prefix cache's full-block keys now (to check the router's index against)."""
        return await self._in_engine(self.engine.pool.registered_keys)

    async def stage_steps_with(self, request_id: str) -> list[list[int]]:
        """A pipeline replica: for each stage, the plan steps it executed that held the request."""
        counters = await asyncio.to_thread(self.engine.runner.stage_counters)
        return [c.steps_with(request_id) for c in counters]

    async def live_request_ids(self) -> list[str]:
        return self.engine.live_request_ids()

    async def check_block_accounting(self) -> None:
        await self._in_engine(self.engine.check_block_accounting)

    async def info(self) -> ReplicaInfo:
        import ray

        stats = await self.stats()
        runner = await asyncio.to_thread(self.engine.runner.describe)  # a pipeline asks its stages
        return ReplicaInfo(self.index, ray.get_runtime_context().get_node_id(), os.getpid(), self.started, stats,
                           self.counters, evictions=self.engine.pool.evictions,
                           pipeline=runner if runner.pipeline is not None else None,
                           weights_from=None if self.weights_origin is None else self.weights_origin.source,
                           weights_received_bytes=0 if self.weights_origin is None
                           else self.weights_origin.received_bytes,
                           threads=torch.get_num_threads(), wait_policy=describe_wait_policy())

    async def shutdown(self, timeout: float = 10.0) -> int:
        """Cancels everything (reason ``shutdown``), waits for the engine to answer, stops stepping."""
        for request_id in self.engine.live_request_ids():
            self.engine.abort(request_id, CancelReason.SHUTDOWN)
        deadline = time.monotonic() + timeout
        while self.engine.live_request_ids() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        left = len(self.engine.live_request_ids())
        self._stopping.set()
        self.engine.wake()
        return left


def kill(actors: list[Any]) -> None:
    """Ends replica actors for good (no restart); ones already gone are skipped."""
    import ray

    for actor in actors:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(actor, no_restart=True)
