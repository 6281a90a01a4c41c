"""ReplicaSet: N engine replicas on a Ray cluster behind the EngineClient interface.

It implements :class:`~bargein.engine.client.EngineClient`, as the local
:class:`~bargein.engine.async_engine.AsyncEngine` does, so the server, ``Conversation`` and
the CLI use it unchanged.

The facade routes and dispatches; the rest is a file each: the head's records
(:mod:`.records`, one lock), the poller threads that bring deltas in and find lost or hung
replicas (:mod:`.poller`), the decision what becomes of a lost replica's request
(:mod:`.failover`, pure), the actor (:mod:`.actor`), starting the set (:mod:`.launch`)
and placing replicas and their weights (:mod:`.placement`).

A lost replica's requests resume on others from their tokens (only with no replica up do
they end in "error"). Constrained requests carry their constraint (compiled here first, to
refuse a bad one). Conversations are pinned to one replica; the head's copy of their
tokens re-opens a lost replica's conversations elsewhere, an answer in flight included
(opened holding the answer so far, which goes on with ``output_offset`` = its tokens).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from bargein.distributed.replicas.actor import ModelFacts, ReplicaBatch, ReplicaInfo, kill
from bargein.distributed.replicas.conversations import ReplicaConversations
from bargein.distributed.replicas.failover import End, as_sent, decide, translate
from bargein.distributed.replicas.options import ReplicaOptions
from bargein.distributed.replicas.poller import Poller, PollerHooks
from bargein.distributed.replicas.records import ConversationRecord, LiveRequest, RecordStore
from bargein.distributed.router import Route, Router, Tombstones
from bargein.engine.admission import Admitted, EngineError, admit, check_length
from bargein.engine.async_engine import EngineDeadError, stream_outputs
from bargein.engine.client import EngineInfo, ReplicaSetInfo
from bargein.engine.grammar import Grammars
from bargein.engine.messages import (
    RewindConversation,
)
from bargein.engine.outputs import OutputProcessor, RequestDelta, end_found_by_consumer
from bargein.engine.request import AbortResult, CancelReason, FinishReason, RequestOutput
from bargein.engine.request_ids import IdInUse
from bargein.engine.runner import RunnerHealth
from bargein.engine.sampling import SamplingParams
from bargein.engine.stats import EngineCounters, EngineStats, RequestInfo, StepRecord, merge_stats
from bargein.engine.streams import RequestStream

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError
except ModuleNotFoundError as exc:  # the optional extra is missing: launching says so in one line
    if exc.name != "ray" and not (exc.name or "").startswith("ray."):
        raise
    ray = None

log = logging.getLogger("bargein.distributed")
T = TypeVar("T")


class ReplicaSet(ReplicaConversations):
    """N replicas behind one AsyncEngine-like facade (see the module doc)."""

    def __init__(self, actors: list[Any], facts: ModelFacts, options: ReplicaOptions,
                 started: Sequence[float] | None = None):
        self.actors = actors
        self.options = options
        self.facts = facts
        self.counters = EngineCounters()  # filled from the replicas' batches (for /metrics)
        # Constraints are compiled and checked here (a 400 before any replica sees them);
        # each replica compiles its own for the matcher that runs with the request.
        self.grammars = Grammars(facts.tokenizer, facts.model_config.vocab_size, facts.eos_token_ids)
        self.router = Router(len(actors), facts.block_size, options.routing, options.max_imbalance,
                             options.queue_cost_tokens)
        self.tombstones = Tombstones()
        self.records = RecordStore()
        self._stopping = threading.Event()
        self._closed = False
        self.replica_stats: dict[int, EngineStats] = {}  # the last snapshot of each (per-replica metrics)
        self.lost: list[int] = [0] * len(actors)
        self.restarted: list[int] = [0] * len(actors)
        self.resubmitted = 0
        self.dropped_late = 0
        self.builds: Any = None  # launch_replicas' builders (their shipped weights stay referenced)
        self.builder_store: Any = None  # the actor restarted replicas read their builders from
        self.weights_shipped_bytes = 0  # the model put in the object store for nodes without its file
        self.nodes_without_file: tuple[str, ...] = ()
        hooks = PollerHooks(deliver=self._deliver, lose=self._lose, back=self._back,
                            busy=lambda i: bool(self.records.on_replica(i)))
        self.pollers = [Poller(i, actor, started_at, options.call_timeout_s, options.hang_timeout_s,
                               self._stopping, hooks).start()
                        for i, (actor, started_at) in enumerate(zip(actors, started or [0.0] * len(actors),
                                                                    strict=True))]

    # -- the EngineClient interface ------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.facts.tokenizer

    def describe(self) -> EngineInfo:
        f = self.facts
        return EngineInfo(f.model_name, f.max_model_len, f.model_config.vocab_size, f.eos_token_ids, f.block_size,
                          f.num_blocks, f.config.precision, pipeline_stages=0, replicas=len(self.actors))

    @property
    def model_name(self) -> str:
        return self.facts.model_name

    @property
    def num_replicas(self) -> int:
        return len(self.actors)

    def start(self) -> ReplicaSet:
        return self

    @property
    def is_alive(self) -> bool:
        """Accepting work: not shutting down, and at least one replica up (``/health``)."""
        return not self._stopping.is_set() and bool(self._up())

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               request_id: str | None = None, timeout: float | None = None,
               conversation_id: str | None = None, constraint_from: int | None = None) -> tuple[str, RequestStream]:
        """Routes and dispatches a request; returns its id and stream (call from a running loop).

        Admitted here (``admit``: EngineError), so a bad request is refused before any
        replica sees it; the replica queues the admitted request as it is.
        """
        if self._stopping.is_set():
            raise EngineDeadError("the engine is shutting down")
        f = self.facts
        admitted = admit(prompt, params, tokenizer=f.tokenizer, grammars=self.grammars,
                         vocab_size=f.model_config.vocab_size, max_model_len=f.max_model_len, timeout=timeout,
                         conversation_id=conversation_id, constraint_from=constraint_from)
        params, tokens = admitted.params, list(admitted.token_ids)
        request_id = request_id or self.new_request_id()
        stream = RequestStream(request_id, asyncio.get_running_loop(),
                               OutputProcessor(request_id, params, self.facts.tokenizer))
        with self.records.lock:
            try:
                self.records.ids.claim(request_id)
            except IdInUse:
                raise EngineError(f"request id {request_id!r} is in use") from None
            try:
                rec = self._route(request_id, tokens, params, timeout, stream, conversation_id, constraint_from)
            except BaseException:
                self.records.ids.forget(request_id)
                raise
            conversation = None if conversation_id is None else self.records.conversations[conversation_id]
            open_tokens = None
            if conversation is not None:
                if conversation.unopened:
                    open_tokens, conversation.unopened = list(conversation.tokens), False
                conversation.tokens += tokens
                rec.conversation_base = len(conversation.tokens)
            self.records.live[request_id] = rec
        self.actors[rec.replica].submit.remote(request_id, admitted, open_tokens=open_tokens)
        return request_id, stream

    def _route(self, request_id: str, tokens: list[int], params: SamplingParams, timeout: float | None,
               stream: RequestStream, conversation_id: str | None, constraint_from: int | None) -> LiveRequest:
        """Under the lock, for ``submit``: the request's record with its route (EngineError
        for a conversation that cannot take it, EngineDeadError when no replica is up)."""
        f = self.facts
        conversation = None if conversation_id is None else self.records.conversation(conversation_id)
        if conversation is not None:
            if any(r.conversation == conversation_id for r in self.records.live.values()):
                raise EngineError(f"conversation {conversation_id} is already generating")
            length = len(conversation.tokens) + len(tokens)
            if not conversation.tokens and not tokens:
                raise EngineError("the conversation is empty: prompt it first")
            check_length(length, f.max_model_len, "the conversation")  # the head's copy never runs ahead
            route = self.router.assign(conversation.replica, len(conversation.tokens) + len(tokens))
        else:
            route = self.router.choose(tokens, cache_salt=params.cache_salt, reserve_tokens=params.max_tokens or 0)
        if route is None:
            raise EngineDeadError("no replica is up")
        self.records.recent.pop(request_id, None)
        self.tombstones.discard(request_id)  # a reused id starts clean
        return LiveRequest(request_id, stream, tokens, params,
                           None if timeout is None else time.monotonic() + timeout, route, constraint_from,
                           conversation_id)

    async def next_output(self, stream: RequestStream) -> RequestOutput:
        processor = stream.processor
        while True:
            out = end_found_by_consumer(self, processor.process(await stream.next_delta()))
            if out is not None:
                return out

    async def stream(self, request_id: str, stream: RequestStream, *,
                     exit_reason: CancelReason = CancelReason.DISCONNECT) -> AsyncIterator[RequestOutput]:
        async for out in stream_outputs(self, request_id, stream, exit_reason):
            yield out

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, timeout: float | None = None,
                       exit_reason: CancelReason = CancelReason.DISCONNECT) -> AsyncIterator[RequestOutput]:
        request_id, stream = self.submit(prompt, params, request_id=request_id, timeout=timeout)
        async for out in self.stream(request_id, stream, exit_reason=exit_reason):
            yield out

    def abort(self, request_id: str, reason: CancelReason = CancelReason.USER, *,
              delivered: int | None = None) -> AbortResult:
        """Sends the cancel to the replica that runs the request, and only there (C6: never raises).

        The claim is made here at once (so the answer is known without a round trip);
        the id is tombstoned, so a failover that races this cancel drops its dispatch.
        """
        try:
            reason = CancelReason(reason)
            rec = self.records.live.get(request_id)
            if rec is None:
                done = self.records.recent.get(request_id)
                if done is None:
                    return AbortResult.NOT_FOUND
                if delivered is not None:  # the replica keeps only what the consumer was handed (C3)
                    self.actors[done.replica].abort.remote(request_id, reason, max(0, delivered - done.offset))
                    self._cut_resumed_conversation(done.replica, done.conversation, done.conversation_base + delivered,
                                                   delivered < done.offset)
                    conversation = self.records.conversations.get(done.conversation) if done.conversation else None
                    if conversation is not None:
                        del conversation.tokens[done.conversation_base + delivered:]
                return AbortResult.ALREADY_FINISHED
            claimed = self.records.ids.request_cancel(request_id, reason) == AbortResult.CANCELLED
            if claimed:
                self.tombstones.add(request_id)
            if delivered is not None:
                del rec.output[delivered:]
            if claimed or delivered is not None:
                replica_delivered = None if delivered is None else max(0, delivered - rec.offset)
                self.actors[rec.replica].abort.remote(request_id, reason, replica_delivered)
            return AbortResult.CANCELLED if claimed else AbortResult.ALREADY_FINISHED
        except Exception:
            log.exception("abort(%r) failed", request_id)
            return AbortResult.NOT_FOUND

    def finish(self, request_id: str, reason: FinishReason, *, delivered: int) -> CancelReason | None:
        """A stop string the consumer found: the owning replica ends the request at ``delivered``."""
        rec = self.records.live.get(request_id)
        if rec is None:
            return None
        cancelled = self.records.ids.claim_end(request_id)
        del rec.output[delivered:]
        self.actors[rec.replica].finish.remote(request_id, reason, max(0, delivered - rec.offset))
        return cancelled

    def abort_all(self, reason: CancelReason = CancelReason.USER) -> list[str]:
        return [rid for rid in list(self.records.live) if self.abort(rid, reason) == AbortResult.CANCELLED]

    def request_shutdown(self) -> None:
        self.abort_all(CancelReason.SHUTDOWN)

    def call_soon(self, fn: Callable[[], T]) -> Future:
        """Runs ``fn`` in a thread of its own (the merged views wait on Ray calls)."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=run, daemon=True).start()
        return future

    async def call(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.call_soon(fn))

    async def stats(self) -> EngineStats:
        return await asyncio.to_thread(self.merged_stats)

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Cancels every request (reason ``shutdown``), waits for their answers, stops the replicas."""
        self.abort_all(CancelReason.SHUTDOWN)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.records.live and loop.time() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stops polling, ends every stream still open, and kills the replicas; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        with self.records.lock:
            left = list(self.records.live.values())
            self.records.live.clear()
            for rec in left:
                self.records.ids.release(rec.request_id)
        for rec in left:
            rec.stream.push(RequestDelta(rec.request_id, finished=True, finish_reason=FinishReason.CANCELLED,
                                         cancel_reason=CancelReason.SHUTDOWN))
        for poller in self.pollers:
            poller.join()
        kill(self.actors if self.builder_store is None else [*self.actors, self.builder_store])

    # -- the merged views -------------------------------------------------------------
    def _up(self) -> list[int]:
        return [i for i in range(len(self.actors)) if self.router.is_up(i)]

    def _gather(self, method: str, timeout: float | None = None) -> dict[int, Any]:
        """``method`` on every replica that is up; a replica that fails to answer is left out."""
        up = self._up()
        refs = {i: getattr(self.actors[i], method).remote() for i in up}
        out = {}
        for i, ref in refs.items():
            try:
                out[i] = ray.get(ref, timeout=timeout or self.options.call_timeout_s)
            except (RayActorError, GetTimeoutError) as exc:
                log.warning("replica %d did not answer %s: %s", i, method, type(exc).__name__)
        return out

    def merged_stats(self) -> EngineStats:
        stats = self._gather("stats")
        self.replica_stats.update(stats)
        return merge_stats(list(stats.values()), self.facts.block_size)

    def list_requests(self) -> list[RequestInfo]:
        """Every replica's queued and running requests, oldest first, each as its client
        sent it: a request resumed after a loss shows its original prompt, its whole
        answer so far and its age since the client sent it, not the resubmission's."""
        now = time.monotonic()
        infos = [as_sent(self.records.live.get(info.request_id), info, now)
                 for part in self._gather("list_requests").values() for info in part]
        return sorted(infos, key=lambda info: -info.age_s)

    async def requests(self) -> list[RequestInfo]:
        return await asyncio.to_thread(self.list_requests)

    def live_request_ids(self) -> list[str]:
        return list(self.records.live)

    def health(self) -> RunnerHealth:
        """ok while every replica is up; "recovering" (requests still run on the others)
        while some are being restarted. None up: the set is not alive, which ``/health``
        reports as unavailable before asking this."""
        down = [i for i in range(len(self.actors)) if not self.router.is_up(i)]
        if not down:
            return RunnerHealth()
        return RunnerHealth("recovering", f"replica {', '.join(map(str, down))} lost, being restarted")

    async def check_block_accounting(self) -> None:
        """Contract C5 on every replica that is up (AssertionError names what is wrong)."""
        for i in self._up():
            await asyncio.wait_for(self.actors[i].check_block_accounting.remote(), self.options.call_timeout_s)

    async def steps_after(self, index: int) -> list[StepRecord]:
        """The head runs no steps: each replica keeps its own."""
        return []

    def replica_infos(self) -> dict[int, ReplicaInfo]:
        infos = self._gather("info")
        self.replica_stats.update({i: info.stats for i, info in infos.items()})
        return infos

    def cluster(self) -> ReplicaSetInfo:
        """Each replica's routing, load, cache and losses (asks every replica: off the loop)."""
        from bargein.distributed.replicas.cluster import describe

        return describe(self)

    def register_metrics(self, registry: Any) -> None:
        """Adds per-replica series (``replica`` label) to the server's Prometheus registry."""
        from bargein.distributed.replicas.metrics import ReplicaCollector

        registry.register(ReplicaCollector(self))

    def _deliver(self, index: int, batch: ReplicaBatch) -> None:
        counters = self.counters
        self.router.update_memory(index, batch.available_blocks)
        self.router.apply(index, batch.cache)  # before the deltas: a finished request's blocks are known
        with self.records.lock:
            counters.steps += len(batch.step_durations)
            counters.step_durations.extend(batch.step_durations)
            counters.cancel_latencies.extend(batch.cancel_latencies)
            counters.cancel_latency_steps.extend(batch.cancel_latency_steps)
            counters.cancel_samples += len(batch.cancel_latencies)
            for delta in batch.deltas:
                rec = self.records.live.get(delta.request_id)
                if rec is None or rec.replica != index:
                    continue  # a request that moved on (failover) or ended here already
                translate(rec, delta, claimed=self.records.claimed(rec.request_id))
                if delta.finished:
                    del self.records.live[rec.request_id]
                    self.records.remember(rec, index)
                    self._cut_resumed_conversation(index, rec.conversation, rec.conversation_base + len(rec.output),
                                                   len(rec.output) < rec.offset)
                    self.router.finished(rec.route)
                    counters.generated_tokens += len(rec.output)
                rec.stream.push(delta)

    def _cut_resumed_conversation(self, replica: int, conversation_id: str | None, length: int, short: bool) -> None:
        """A resumed conversation answer kept fewer tokens than its replica got in its
        prompt (a cancel handed the consumer less than was produced before the loss): the
        replica's conversation is cut to the head's copy (sent after the request's end,
        so the conversation is idle there, and before any later turn's submit)."""
        conversation = self.records.conversations.get(conversation_id) if conversation_id is not None else None
        if short and conversation is not None and conversation.replica == replica:
            self.actors[replica].conversation.remote(RewindConversation(conversation_id, length))

    # -- faults ------------------------------------------------------------------------
    def _lose(self, index: int, why: str) -> None:
        """Replica ``index`` is gone: its requests go to the others, from their tokens."""
        log.warning("replica %d lost (%s); resubmitting its requests", index, why)
        with self.records.lock:
            self.lost[index] += 1
            self.router.mark_down(index)
            orphans = [rec for rec in self.records.live.values() if rec.replica == index]
            for rec in orphans:
                self._resubmit(rec, f"replica {index} was lost ({why})")
            for conversation_id, conversation in self.records.conversations.items():
                if conversation.replica == index:
                    self._reopen(conversation_id, conversation)

    def _reopen(self, conversation_id: str, conversation: ConversationRecord) -> None:
        """Under the lock: a conversation whose replica was lost is opened again elsewhere
        from its tokens (its K/V is recomputed with its next answer)."""
        route = self.router.choose(conversation.tokens, count=False)
        if route is None:
            log.warning("conversation %s has no replica left; it fails at its next use", conversation_id)
            conversation.replica = -1
            return
        conversation.replica, conversation.unopened = route.replica, True  # opened there by its next call
        log.info("conversation %s moves to replica %d (%d tokens)", conversation_id, route.replica, len(conversation.tokens))

    def _resubmit(self, rec: LiveRequest, why: str) -> None:
        """Under the lock: dispatches ``rec`` again, or ends it (see :mod:`.failover`)."""
        conversation = self.records.conversations.get(rec.conversation) if rec.conversation else None
        ids = self.records.ids
        choice = decide(rec, None if conversation is None else conversation.tokens,
                        cancel=ids.cancel_claim(rec.request_id), stopped=ids.end_claimed(rec.request_id),
                        tombstoned=rec.request_id in self.tombstones, why=why, now=time.monotonic())
        route: Route | None = None
        if not isinstance(choice, End):
            route = self.router.choose(choice.tokens, cache_salt=rec.params.cache_salt,
                                        reserve_tokens=choice.reserve_tokens)
            if route is None:
                choice = End(FinishReason.ERROR, error=f"no replica is left to run it: {why}")
        if isinstance(choice, End):
            self.dropped_late += choice.dropped_late
            del self.records.live[rec.request_id]
            self.records.remember(rec, rec.replica)
            rec.stream.push(RequestDelta(rec.request_id, finished=True, finish_reason=choice.finish_reason,
                                         cancel_reason=choice.cancel_reason, error=choice.error))
            return
        assert route is not None
        rec.route, rec.offset, rec.resumes = route, choice.output_offset, rec.resumes + 1
        self.resubmitted += 1
        log.info("request %s resumes on replica %d after %d tokens", rec.request_id, route.replica,
                 choice.output_offset)
        actor = self.actors[route.replica]
        if rec.conversation is None:
            actor.submit.remote(rec.request_id, Admitted(tuple(choice.tokens), choice.params, choice.timeout,
                                                         None, choice.constraint_from, choice.output_offset))
            return
        # The conversation moves with its answer: opened there holding the answer so far
        # (by the submit itself: two actor calls are not ordered), the answer goes on as a
        # conversation request with no new prompt tokens.
        assert conversation is not None
        conversation.replica, conversation.unopened = route.replica, False
        log.info("conversation %s moves to replica %d with its answer (%d tokens)", rec.conversation,
                 route.replica, len(choice.tokens))
        actor.submit.remote(rec.request_id, Admitted((), choice.params, choice.timeout, rec.conversation,
                                                     choice.constraint_from, choice.output_offset),
                            open_tokens=choice.tokens)

    def _back(self, index: int) -> None:
        """Replica ``index`` was restarted by Ray: routed to again, with an empty prefix index."""
        with self.records.lock:
            self.restarted[index] += 1
            self.router.mark_up(index)
