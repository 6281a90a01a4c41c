"""ReplicaSet: N engine replicas on a Ray cluster behind the AsyncEngine interface.

The server takes it in place of its local :class:`~bargein.engine.async_engine.AsyncEngine`
(``submit``, ``next_output``, ``abort``, ``abort_all``, ``stats``, ``call``,
``shutdown``, and ``.engine`` for the model's facts), so every route, the job runner and
the prompt memory work unchanged.

Head-side state, one owner each:

- the :class:`~bargein.distributed.router.Router` (where K/V lives, load, hit counts);
- one :class:`_Live` record per request in flight: its owning replica, prompt, params,
  deadline, the output tokens received so far and its outcome claim. A cancel (by id,
  disconnect, deadline on the head, shutdown) reads the owner there and goes to that
  replica only: no broadcast, no lookup that can miss;
- one poller thread per replica: a long ``poll`` returns a batch of deltas (one Ray call
  for every request's tokens of one or more steps), which it pushes into the requests'
  streams. Detokenizing and stop strings run on the consumer's side, as on one machine.

A replica is lost when its poll raises (the actor or its node died) or does not answer
within ``call_timeout_s``. Its requests are resubmitted to other replicas from their
tokens: the prompt plus the output received, with ``output_offset`` set so the sampler
keeps counting token indices where it was (greedy and seeded-sampled answers continue
identically), ``max_tokens``/``min_tokens`` reduced by what was produced and the rest of
the deadline. Only when no replica is up do they end with ``finish_reason`` "error". The
poller then pings until Ray has restarted the actor (``max_restarts``) and adds the
replica back with an empty prefix index.

Constrained requests carry their constraint to the replica (the head compiles it first,
to refuse a bad one); a resumed one gets ``constraint_from`` so the replica's matcher
replays the answer so far. Conversation handles (engine sessions) are pinned to one
replica; the head keeps a copy of each one's tokens so that a lost replica's
conversations are opened again elsewhere. An answer in flight there resumes too: its
conversation is opened holding the answer so far, and the answer is resubmitted as a
session request with no new prompt tokens and ``output_offset`` = the tokens produced,
so it continues with the same tokens and the conversation ends as prompt + whole answer.
``launch_replicas`` is the set-up: whole-model replicas (weights shipped to nodes
without the file) or replicas that are pipelines (stages planned over the cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from bargein.distributed.replicas import (
    EngineBuilder,
    ModelFacts,
    ReplicaBatch,
    ReplicaInfo,
    ReplicaWorker,
)
from bargein.distributed.router import Route, Router, Tombstones
from bargein.distributed.split import PipelineSetupError
from bargein.engine.async_engine import EngineDeadError, stream_outputs
from bargein.engine.engine import EngineError
from bargein.engine.grammar import Grammars
from bargein.engine.outputs import OutputProcessor, RequestDelta, end_found_by_consumer
from bargein.engine.request import AbortResult, CancelReason, FinishReason, RequestOutput, Usage
from bargein.engine.runner import RunnerHealth
from bargein.engine.sampling import SamplingParams
from bargein.engine.stats import EngineCounters, EngineStats, RequestInfo
from bargein.engine.streams import RequestStream

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError
except ModuleNotFoundError as exc:  # the optional extra is missing: launch() says so in one line
    if exc.name != "ray" and not (exc.name or "").startswith("ray."):
        raise
    ray = None

log = logging.getLogger("bargein.distributed")
T = TypeVar("T")

POLL_S = 0.5  # a poll's long wait when nothing happens
RECENT_FINISHED = 4096  # finished ids remembered (an abort of one answers "already finished")
_DONE = "done"  # a request's outcome claimed by its end (a stop string), not by a cancel


@dataclass(frozen=True)
class ReplicaOptions:
    """How replicas are placed and kept: Ray resources, restarts, deadlines."""

    num_cpus: float = 1.0
    threads: int = 1
    max_restarts: int = -1  # Ray re-creates a lost replica (forever by default)
    call_timeout_s: float = 10.0  # a poll (or ping) not answered by then: the replica is lost
    start_timeout_s: float = 300.0  # loading the model on every replica
    hang_timeout_s: float = 60.0  # busy, yet no step finished for that long: the replica is hung
    routing: str = "affine"
    max_imbalance: int = 8
    stages_per_replica: int = 1  # each replica a pipeline of this many stages (recorded for /v1/cluster)
    resources: dict[str, float] | None = None  # custom Ray resources each replica takes (placement)
    on_head_node: bool = False  # run the replicas on this process's node (pipeline heads; stages go out)


@dataclass
class _Live:
    """A request in flight, as the head knows it."""

    request_id: str
    stream: RequestStream
    prompt: list[int]  # the original prompt (a conversation's turn: its new tokens only)
    params: SamplingParams
    deadline: float | None
    route: Route  # where it runs now (the router's record)
    constraint_from: int | None = None  # where a continued constrained answer began in the prompt
    session: str | None = None  # the conversation handle it extends
    session_base: int = 0  # the conversation's length where this answer begins
    arrival: float = field(default_factory=time.monotonic)
    output: list[int] = field(default_factory=list)  # tokens received (the whole answer)
    offset: int = 0  # output tokens the current replica got in its prompt (resumed)
    prompt_sent: bool = False  # the stream had the first delta (with prompt_token_ids)
    cached_tokens: int | None = None  # from the first replica's usage
    outcome: CancelReason | str | None = None  # claimed by a cancel or by the consumer's end
    resumes: int = 0

    @property
    def replica(self) -> int:
        return self.route.replica


@dataclass(frozen=True)
class _Finished:
    """A finished request, remembered so a late cancel answers "already finished" and
    still cuts a conversation to what its consumer was handed."""

    replica: int
    session: str | None = None
    session_base: int = 0
    offset: int = 0  # output tokens the last replica got in its prompt (a resumed request)


@dataclass
class _Session:
    """A conversation handle: the replica that holds its K/V, and its tokens as the head
    last knew them (so a lost replica's conversations are re-opened elsewhere)."""

    replica: int
    tokens: list[int]
    # Not yet opened on ``replica``: the next call there opens it first, in the same actor
    # call or awaited before it (two calls to an async actor are not ordered).
    unopened: bool = True


@dataclass
class _Progress:
    """A poller's view of whether its replica's engine is still stepping."""

    steps: int = -1
    since: float = field(default_factory=time.monotonic)

    def stalled(self, steps: int, busy: bool, timeout_s: float) -> bool:
        now = time.monotonic()
        if steps != self.steps or not busy:
            self.steps, self.since = steps, now
            return False
        return now - self.since > timeout_s


class HeadView:
    """What the server reads as ``engine.engine``: the model's facts and the merged views."""

    supports_partial_block_reuse = True

    def __init__(self, replicas: ReplicaSet, facts: ModelFacts):
        self._set = replicas
        self.tokenizer = facts.tokenizer
        self.model_name = facts.model_name
        self.model_config = facts.model_config
        self.config = facts.config
        self.max_model_len = facts.max_model_len
        self.eos_token_ids = facts.eos_token_ids
        self.supports_partial_block_reuse = facts.supports_partial_block_reuse
        self.counters = EngineCounters()  # filled from the replicas' batches (for /metrics)
        self.runner = self  # ``runner.cluster_info`` is what /v1/cluster reads
        # The server compiles and checks constraints here (a 400 before any replica sees
        # them); each replica compiles its own for the matcher that runs with the request.
        self.grammars = Grammars(facts.tokenizer, facts.model_config.vocab_size, facts.eos_token_ids)

    def finish(self, request_id: str, reason: FinishReason, *, delivered: int) -> CancelReason | None:
        return self._set.finish(request_id, reason, delivered=delivered)

    def live_request_ids(self) -> list[str]:
        return list(self._set._live)

    def list_requests(self) -> list[RequestInfo]:
        return self._set.list_requests()

    def check_block_accounting(self) -> None:
        self._set.check_block_accounting()

    def stats(self) -> EngineStats:
        return self._set.merged_stats()

    def cluster_info(self) -> dict[str, Any]:
        return self._set.cluster_info()

    def runner_health(self) -> RunnerHealth:
        """``/health``: ok while every replica is up; "recovering" (requests still run on
        the others) while some are being restarted. None up: the set is not alive, which
        ``/health`` reports as unavailable before asking this."""
        down = [i for i in range(len(self._set.actors)) if not self._set.router.is_up(i)]
        if not down:
            return RunnerHealth()
        return RunnerHealth("recovering", f"replica {', '.join(map(str, down))} lost, being restarted")

    def new_request_id(self) -> str:
        import uuid

        return f"req-{uuid.uuid4().hex[:16]}"


class ReplicaSet:
    """N replicas behind one AsyncEngine-like facade (see the module doc)."""

    def __init__(self, actors: list[Any], facts: ModelFacts, options: ReplicaOptions,
                 started: Sequence[float] | None = None):
        self.actors = actors
        self._incarnation = list(started or [0.0] * len(actors))  # each replica's start time
        self.options = options
        self.facts = facts
        self.engine = HeadView(self, facts)
        self.router = Router(len(actors), facts.block_size, options.routing, options.max_imbalance)
        self.tombstones = Tombstones()
        self._live: dict[str, _Live] = {}
        self._recent: OrderedDict[str, _Finished] = OrderedDict()
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.RLock()  # records vs pollers; never held across a Ray call's wait
        self._stopping = threading.Event()
        self._closed = False
        self.replica_stats: dict[int, EngineStats] = {}  # the last snapshot of each (per-replica metrics)
        self.lost: list[int] = [0] * len(actors)
        self.restarted: list[int] = [0] * len(actors)
        self.resubmitted = 0
        self.dropped_late = 0
        self.builds: Any = None  # launch_replicas' builders (their shipped weights stay referenced)
        self.weights_shipped_bytes = 0  # the model put in the object store for nodes without its file
        self.nodes_without_file: tuple[str, ...] = ()
        self._pollers = [threading.Thread(target=self._poll_loop, args=(i,), name=f"bargein-poll-{i}", daemon=True)
                         for i in range(len(actors))]
        for t in self._pollers:
            t.start()

    # -- set-up ---------------------------------------------------------------------
    @classmethod
    def launch(cls, build: EngineBuilder | Sequence[EngineBuilder], num_replicas: int,
               options: ReplicaOptions | None = None) -> ReplicaSet:
        """Starts ``num_replicas`` actors (Ray must be connected) and waits until all have loaded.

        ``build``: one builder for every replica, or one per replica (pipelines whose
        stages go to different nodes). All or nothing: on any failure the actors started
        (and, owned by them, their stages) are killed and PipelineSetupError says why in
        one line.
        """
        options = options or ReplicaOptions()
        if ray is None:
            raise PipelineSetupError("Ray is not installed: pip install 'bargein[ray]'")
        if num_replicas < 1:
            raise PipelineSetupError("--replicas must be at least 1")
        builds = list(build) if isinstance(build, Sequence) else [build] * num_replicas
        if len(builds) != num_replicas:
            raise ValueError(f"{len(builds)} builders were given for {num_replicas} replicas")
        cpus = ray.cluster_resources().get("CPU", 0)
        if options.num_cpus * num_replicas > cpus:
            raise PipelineSetupError(f"{num_replicas} replicas need {options.num_cpus * num_replicas:g} CPUs "
                                     f"({options.num_cpus:g} each), but the cluster has {cpus:g}")
        placement: dict[str, Any] = {}
        if options.resources:
            placement["resources"] = dict(options.resources)
        if options.on_head_node:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            placement["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False)
        actor_class = ray.remote(num_cpus=options.num_cpus, max_restarts=options.max_restarts,
                                 max_task_retries=0, max_concurrency=64, **placement)(ReplicaWorker)
        actors = [actor_class.remote(i, b, options.threads) for i, b in enumerate(builds)]
        try:
            pings = [a.ping.remote() for a in actors]
            ready, _ = ray.wait(pings, num_returns=num_replicas, timeout=options.start_timeout_s)
            if len(ready) < num_replicas:
                raise PipelineSetupError(f"only {len(ready)} of {num_replicas} replicas started within "
                                         f"{options.start_timeout_s:.0f} s (too few CPUs or too little memory "
                                         f"on the cluster?)")
            started = ray.get(pings)
            facts = ray.get(actors[0].describe.remote())
        except PipelineSetupError:
            _kill(actors)
            raise
        except Exception as exc:
            _kill(actors)
            raise PipelineSetupError(f"a replica failed to start: {_cause(exc)}") from None
        return cls(actors, facts, options, started)

    # -- the AsyncEngine interface ------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.facts.tokenizer

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
               session_id: str | None = None, constraint_from: int | None = None) -> tuple[str, RequestStream]:
        """Routes and dispatches a request; returns its id and stream (call from a running loop).

        The checks a replica would make on arrival are made here first (EngineError), so
        a bad request is refused before any replica sees it.
        """
        if self._stopping.is_set():
            raise EngineDeadError("the engine is shutting down")
        params = params or SamplingParams()
        tokens = self._check(prompt, params, timeout, session=session_id is not None)
        if constraint_from is not None and (params.constraint is None or constraint_from < 0):
            raise EngineError("constraint_from needs a constraint and a token index >= 0")
        request_id = request_id or self.engine.new_request_id()
        stream = RequestStream(request_id, asyncio.get_running_loop(),
                               OutputProcessor(request_id, params, self.facts.tokenizer))
        with self._lock:
            if request_id in self._live:
                raise EngineError(f"request id {request_id!r} is in use")
            session = None if session_id is None else self._session(session_id)
            if session is not None:
                if any(r.session == session_id for r in self._live.values()):
                    raise EngineError(f"conversation {session_id} is already generating")
                length = len(session.tokens) + len(tokens)
                if not session.tokens and not tokens:
                    raise EngineError("the conversation is empty: prompt it first")
                if length >= self.facts.max_model_len:  # checked here so the head's copy never runs ahead
                    raise EngineError(f"the conversation is {length} tokens, but the context holds "
                                      f"{self.facts.max_model_len} (room is needed for at least one "
                                      f"generated token)")
                route = self.router.assign(session.replica, len(session.tokens) + len(tokens))
            else:
                route = self.router.choose(tokens, reserve_tokens=params.max_tokens or 0)
            if route is None:
                raise EngineDeadError("no replica is up")
            self._recent.pop(request_id, None)
            self.tombstones.discard(request_id)  # a reused id starts clean
            rec = _Live(request_id, stream, tokens, params, None if timeout is None else time.monotonic() + timeout,
                        route, constraint_from, session_id)
            open_tokens = None
            if session is not None:
                if session.unopened:
                    open_tokens, session.unopened = list(session.tokens), False
                session.tokens += tokens
                rec.session_base = len(session.tokens)
            self._live[request_id] = rec
        self.actors[route.replica].submit.remote(request_id, tokens, params, timeout, 0, session_id=session_id,
                                                 constraint_from=constraint_from, open_tokens=open_tokens)
        return request_id, stream

    def _check(self, prompt: str | Sequence[int], params: SamplingParams, timeout: float | None, *,
               session: bool = False) -> list[int]:
        facts = self.facts
        params.validate_for_vocab(facts.model_config.vocab_size)
        if params.constraint is not None:
            self.engine.grammars.compile(params.constraint)  # UnsupportedGrammar, as one engine raises it
        tokens = facts.tokenizer.encode(prompt, add_special_tokens=not session) if isinstance(prompt, str) \
            else [int(t) for t in prompt]
        if not tokens and not session:
            raise EngineError("the prompt is empty")
        bad = [t for t in tokens if not 0 <= t < facts.model_config.vocab_size]
        if bad:
            raise EngineError(f"token id {bad[0]} is outside the vocabulary (0..{facts.model_config.vocab_size - 1})")
        if len(tokens) >= facts.max_model_len:
            raise EngineError(f"the prompt is {len(tokens)} tokens, but the context holds {facts.max_model_len} "
                              f"(room is needed for at least one generated token)")
        if timeout is not None and not timeout > 0:
            raise EngineError("timeout must be a positive number of seconds")
        return tokens

    async def next_output(self, stream: RequestStream) -> RequestOutput:
        processor = stream.processor
        while True:
            out = end_found_by_consumer(self.engine, processor.process(await stream.next_delta()))
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

    # -- conversation handles (engine sessions) -------------------------------------------
    # A conversation lives on one replica, which holds its K/V; every turn goes there. The
    # head mirrors its tokens (prompts appended, answers as delivered, forks, rewinds) so
    # that a lost replica's conversations are opened again on another one.
    def _session(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise EngineError(f"no conversation {session_id!r}")
        if session.replica < 0:
            raise EngineError(f"conversation {session_id!r} was lost with its replica and no replica is left")
        return session

    def open_session(self, token_ids: Sequence[int] = ()) -> str:
        """Opens a conversation on the replica with the best prefix match (else the least
        loaded); returns its id at once (the replica opens it with the first call there)."""
        tokens = [int(t) for t in token_ids]
        session_id = self.engine.new_request_id().replace("req-", "conv-")
        with self._lock:
            route = self.router.choose(tokens, count=False)
            if route is None:
                raise EngineDeadError("no replica is up")
            self._sessions[session_id] = _Session(route.replica, tokens)
        return session_id

    async def _on_session(self, session_id: str, method: str, *args: Any) -> Any:
        with self._lock:
            session = self._session(session_id)
            actor, opening = self.actors[session.replica], session.unopened
            tokens, session.unopened = list(session.tokens), False
        if opening:
            await actor.open_session.remote(tokens, session_id)
        return await getattr(actor, method).remote(session_id, *args)

    async def append_session(self, session_id: str, token_ids: Sequence[int]) -> None:
        tokens = [int(t) for t in token_ids]
        await self._on_session(session_id, "append_session", tokens)
        self._session(session_id).tokens += tokens

    async def session_tokens(self, session_id: str) -> list[int]:
        """The tokens as the replica holds them (the head's mirror is for failover only)."""
        return await self._on_session(session_id, "session_tokens")

    async def fork_session(self, session_id: str) -> str:
        """A new conversation on the same replica, sharing the K/V blocks (copy on write)."""
        new_id = await self._on_session(session_id, "fork_session")
        with self._lock:
            parent = self._session(session_id)
            self._sessions[new_id] = _Session(parent.replica, list(parent.tokens), unopened=False)
        return new_id

    async def truncate_session(self, session_id: str, num_tokens: int) -> None:
        await self._on_session(session_id, "truncate_session", num_tokens)
        del self._session(session_id).tokens[num_tokens:]

    async def close_session(self, session_id: str) -> None:
        session = self._sessions.get(session_id)
        if session is not None and session.replica >= 0 and not session.unopened:
            await self._on_session(session_id, "close_session")
        self._sessions.pop(session_id, None)

    def abort(self, request_id: str, reason: CancelReason = CancelReason.USER, *,
              delivered: int | None = None) -> AbortResult:
        """Sends the cancel to the replica that runs the request, and only there (C6: never raises).

        The claim is made here at once (so the answer is known without a round trip);
        the id is tombstoned, so a failover that races this cancel drops its dispatch.
        """
        try:
            reason = CancelReason(reason)
            rec = self._live.get(request_id)
            if rec is None:
                done = self._recent.get(request_id)
                if done is None:
                    return AbortResult.NOT_FOUND
                if delivered is not None:  # the replica keeps only what the consumer was handed (C3)
                    self.actors[done.replica].abort.remote(request_id, reason, max(0, delivered - done.offset))
                    self._cut_resumed_conversation(done.replica, done.session, done.session_base + delivered,
                                                   delivered < done.offset)
                    session = self._sessions.get(done.session) if done.session else None
                    if session is not None:
                        del session.tokens[done.session_base + delivered:]
                return AbortResult.ALREADY_FINISHED
            if rec.outcome is None:
                rec.outcome = reason
            claimed = isinstance(rec.outcome, CancelReason)
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
        rec = self._live.get(request_id)
        if rec is None:
            return None
        if rec.outcome is None:
            rec.outcome = _DONE
        del rec.output[delivered:]
        self.actors[rec.replica].finish.remote(request_id, reason, max(0, delivered - rec.offset))
        return rec.outcome if isinstance(rec.outcome, CancelReason) else None

    def abort_all(self, reason: CancelReason = CancelReason.USER) -> list[str]:
        return [rid for rid in list(self._live) if self.abort(rid, reason) == AbortResult.CANCELLED]

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
        while self._live and loop.time() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stops polling, ends every stream still open, and kills the replicas; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        with self._lock:
            left = list(self._live.values())
            self._live.clear()
        for rec in left:
            rec.stream.push(RequestDelta(rec.request_id, finished=True, finish_reason=FinishReason.CANCELLED,
                                         cancel_reason=CancelReason.SHUTDOWN))
        for t in self._pollers:
            t.join(timeout=2 * POLL_S + 1)
        _kill(self.actors)

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
        infos = [self._as_sent(info) for part in self._gather("list_requests").values() for info in part]
        return sorted(infos, key=lambda info: -info.age_s)

    def _as_sent(self, info: RequestInfo) -> RequestInfo:
        rec = self._live.get(info.request_id)
        if rec is None or not rec.resumes:
            return info
        prompt = len(rec.prompt)
        return replace(info, prompt_tokens=prompt, prompt_computed=min(info.prompt_computed, prompt),
                       completion_tokens=rec.offset + info.completion_tokens,
                       age_s=time.monotonic() - rec.arrival)

    def check_block_accounting(self) -> None:
        for i in self._up():
            ray.get(self.actors[i].check_block_accounting.remote(), timeout=self.options.call_timeout_s)

    def replica_infos(self) -> dict[int, ReplicaInfo]:
        infos = self._gather("info")
        self.replica_stats.update({i: info.stats for i, info in infos.items()})
        return infos

    def cluster_info(self) -> dict[str, Any]:
        infos = self.replica_infos()
        routing = self.router.snapshot()
        replicas = []
        for i in range(len(self.actors)):
            info = infos.get(i)
            entry: dict[str, Any] = {"index": i, **routing[i], "lost": self.lost[i], "restarted": self.restarted[i]}
            if info is not None:
                s = info.stats
                computed = s.computed_tokens + s.prefix_cache_hit_tokens
                entry.update(node_id=info.node_id, pid=info.pid, running=s.running, waiting=s.waiting,
                             kv_blocks_total=s.kv_blocks_total, kv_blocks_free=s.kv_blocks_free,
                             prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
                             cache_hit_rate=round(s.prefix_cache_hit_tokens / computed, 4) if computed else 0.0,
                             steps=s.steps, generated_tokens=s.generated_tokens,
                             submitted=info.counters.submitted, resumed=info.counters.resumed,
                             aborts=dict(info.counters.aborts), dropped_late=info.counters.dropped_late,
                             evictions=info.evictions, weights_from=info.weights_from,
                             weights_received_bytes=info.weights_received_bytes)
                if info.pipeline is not None:
                    entry.update(stages=info.pipeline["stages"], pipeline_health=info.pipeline.get("health"))
            replicas.append(entry)
        return {"object": "cluster", "pipeline": False, "replicas": replicas, "num_replicas": len(self.actors),
                "stages_per_replica": self.options.stages_per_replica,
                "routing": self.options.routing, "kv_blocks": self.facts.num_blocks,
                "resubmitted": self.resubmitted, "dropped_late": self.dropped_late,
                "weights_shipped_bytes": self.weights_shipped_bytes,
                "nodes_without_file": list(self.nodes_without_file)}

    def register_metrics(self, registry: Any) -> None:
        """Adds per-replica series (``replica`` label) to the server's Prometheus registry."""
        from bargein.distributed.replica_metrics import ReplicaCollector

        registry.register(ReplicaCollector(self))

    # -- pollers (one thread per replica) -----------------------------------------------
    def _poll_loop(self, index: int) -> None:
        actor = self.actors[index]
        timeout = POLL_S + self.options.call_timeout_s
        progress = _Progress()
        while not self._stopping.is_set():
            try:
                batch = ray.get(actor.poll.remote(POLL_S), timeout=timeout)
            except (RayActorError, GetTimeoutError) as exc:
                if self._stopping.is_set():
                    return
                if isinstance(exc, GetTimeoutError):  # the actor stopped answering: have Ray replace it
                    ray.kill(actor, no_restart=False)
                self._lose(index, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}")
                self._await_restart(index)
                progress = _Progress()
                continue
            except Exception:
                log.exception("replica %d: polling failed", index)
                time.sleep(POLL_S)
                continue
            self._deliver(index, batch)
            busy = any(rec.replica == index for rec in list(self._live.values()))
            if progress.stalled(batch.steps, busy, self.options.hang_timeout_s):
                # Its actor answers, but its engine has not finished a step for that long
                # while it holds requests: a hung forward. Replace it like a lost one.
                ray.kill(actor, no_restart=False)
                self._lose(index, f"no step finished in {self.options.hang_timeout_s:g} s")
                self._await_restart(index)
                progress = _Progress()

    def _deliver(self, index: int, batch: ReplicaBatch) -> None:
        counters = self.engine.counters
        self.router.update_memory(index, batch.available_blocks)
        self.router.apply(index, batch.cache)  # before the deltas: a finished request's blocks are known
        with self._lock:
            counters.steps += len(batch.step_durations)
            counters.step_durations.extend(batch.step_durations)
            counters.cancel_latencies.extend(batch.cancel_latencies)
            counters.cancel_latency_steps.extend(batch.cancel_latency_steps)
            counters.cancel_samples += len(batch.cancel_latencies)
            for delta in batch.deltas:
                rec = self._live.get(delta.request_id)
                if rec is None or rec.replica != index:
                    continue  # a request that moved on (failover) or ended here already
                self._translate(rec, delta)
                if delta.finished:
                    del self._live[rec.request_id]
                    self._remember(rec, index)
                    self._cut_resumed_conversation(index, rec.session, rec.session_base + len(rec.output),
                                                   len(rec.output) < rec.offset)
                    self.router.finished(rec.route)
                    counters.generated_tokens += len(rec.output)
                rec.stream.push(delta)

    @staticmethod
    def _translate(rec: _Live, delta: RequestDelta) -> None:
        """Makes a resumed replica's delta read as the original request's."""
        if rec.outcome is None:  # after a cancel or a stop, ``output`` is what was delivered
            rec.output.extend(delta.new_token_ids)
        if delta.prompt_token_ids is not None:
            if rec.prompt_sent:
                delta.prompt_token_ids = None
            rec.prompt_sent = True
        if delta.usage is not None:
            if rec.cached_tokens is None:
                rec.cached_tokens = delta.usage.cached_tokens
            if rec.resumes:  # a conversation's prompt is all of it, as its first replica counted
                prompt_tokens = rec.session_base if rec.session is not None else len(rec.prompt)
                delta.usage = Usage(prompt_tokens, rec.offset + delta.usage.completion_tokens, rec.cached_tokens)

    def _remember(self, rec: _Live, replica: int) -> None:
        """Under the lock: ``rec`` ended on ``replica``; its conversation (if any) holds its answer."""
        self._recent[rec.request_id] = _Finished(replica, rec.session, rec.session_base, rec.offset)
        session = self._sessions.get(rec.session) if rec.session else None
        if session is not None:
            session.tokens[rec.session_base:] = rec.output
        while len(self._recent) > RECENT_FINISHED:
            self._recent.popitem(last=False)

    def _cut_resumed_conversation(self, replica: int, session_id: str | None, length: int, short: bool) -> None:
        """A resumed conversation answer kept fewer tokens than its replica got in its
        prompt (a cancel handed the consumer less than was produced before the loss): the
        replica's conversation is cut to the head's copy (sent after the request's end,
        so the conversation is idle there, and before any later turn's submit)."""
        session = self._sessions.get(session_id) if session_id is not None else None
        if short and session is not None and session.replica == replica:
            self.actors[replica].truncate_session.remote(session_id, length)

    # -- faults ------------------------------------------------------------------------
    def _lose(self, index: int, why: str) -> None:
        """Replica ``index`` is gone: its requests go to the others, from their tokens."""
        log.warning("replica %d lost (%s); resubmitting its requests", index, why)
        with self._lock:
            self.lost[index] += 1
            self.router.mark_down(index)
            orphans = [rec for rec in self._live.values() if rec.replica == index]
            for rec in orphans:
                self._resubmit(rec, f"replica {index} was lost ({why})")
            for session_id, session in self._sessions.items():
                if session.replica == index:
                    self._reopen(session_id, session)

    def _reopen(self, session_id: str, session: _Session) -> None:
        """Under the lock: a conversation whose replica was lost is opened again elsewhere
        from its tokens (its K/V is recomputed with its next answer)."""
        route = self.router.choose(session.tokens, count=False)
        if route is None:
            log.warning("conversation %s has no replica left; it fails at its next use", session_id)
            session.replica = -1
            return
        session.replica, session.unopened = route.replica, True  # opened there by its next call
        log.info("conversation %s moves to replica %d (%d tokens)", session_id, route.replica, len(session.tokens))

    def _resubmit(self, rec: _Live, why: str) -> None:
        """Under the lock: dispatches ``rec`` again, or ends it (cancelled, done, expired, nowhere to go)."""
        params = rec.params
        produced = len(rec.output)
        end: RequestDelta | None = None
        if isinstance(rec.outcome, CancelReason) or rec.request_id in self.tombstones:
            self.dropped_late += 1
            end = RequestDelta(rec.request_id, finished=True, finish_reason=FinishReason.CANCELLED,
                               cancel_reason=rec.outcome if isinstance(rec.outcome, CancelReason) else CancelReason.USER)
        elif rec.outcome == _DONE or (params.max_tokens is not None and produced >= params.max_tokens):
            reason = FinishReason.STOP if rec.outcome == _DONE else FinishReason.LENGTH
            end = RequestDelta(rec.request_id, finished=True, finish_reason=reason)
        elif rec.deadline is not None and rec.deadline <= time.monotonic():
            end = RequestDelta(rec.request_id, finished=True, finish_reason=FinishReason.CANCELLED,
                               cancel_reason=CancelReason.DEADLINE)
        elif rec.session is not None and rec.session not in self._sessions:
            end = RequestDelta(rec.request_id, finished=True, finish_reason=FinishReason.ERROR,
                               error=f"{why}; its conversation was closed")
        if end is None:
            # A conversation's answer resumes from the conversation: its tokens before the
            # answer (the head's copy) plus the answer so far.
            tokens = (self._sessions[rec.session].tokens[:rec.session_base] if rec.session is not None
                      else rec.prompt) + rec.output
            route: Route | None = self.router.choose(tokens, reserve_tokens=max(0, (params.max_tokens or 0) - produced))
            if route is None:
                end = RequestDelta(rec.request_id, finished=True, finish_reason=FinishReason.ERROR,
                                   error=f"no replica is left to run it: {why}")
        if end is not None:
            del self._live[rec.request_id]
            self._remember(rec, rec.replica)
            rec.stream.push(end)
            return
        assert route is not None
        rec.route, rec.offset, rec.resumes = route, produced, rec.resumes + 1
        self.resubmitted += 1
        resumed = replace(params, max_tokens=None if params.max_tokens is None else params.max_tokens - produced,
                          min_tokens=max(0, params.min_tokens - produced))
        timeout = None if rec.deadline is None else rec.deadline - time.monotonic()
        log.info("request %s resumes on replica %d after %d tokens", rec.request_id, route.replica, produced)
        # A constrained answer's matcher replays the answer so far (from where it began).
        begins = rec.session_base if rec.session is not None else len(rec.prompt)
        constraint_from = None if params.constraint is None else \
            (begins if rec.constraint_from is None else rec.constraint_from)
        actor = self.actors[route.replica]
        if rec.session is None:
            actor.submit.remote(rec.request_id, tokens, resumed, timeout, produced, constraint_from=constraint_from)
            return
        # The conversation moves with its answer: opened there holding the answer so far
        # (by the submit itself: two actor calls are not ordered), the answer goes on as a
        # session request with no new prompt tokens.
        session = self._sessions[rec.session]
        session.replica, session.unopened = route.replica, False
        log.info("conversation %s moves to replica %d with its answer (%d tokens)", rec.session, route.replica,
                 len(tokens))
        actor.submit.remote(rec.request_id, [], resumed, timeout, produced, session_id=rec.session,
                            constraint_from=constraint_from, open_tokens=tokens)

    def _await_restart(self, index: int) -> None:
        """Pings the lost replica until Ray has restarted it (a new incarnation answers),
        then routes to it again."""
        actor = self.actors[index]
        while not self._stopping.is_set():
            try:
                started = ray.get(actor.ping.remote(), timeout=self.options.call_timeout_s)
            except (RayActorError, GetTimeoutError):
                time.sleep(POLL_S)
                continue
            except Exception:
                log.exception("replica %d: ping failed", index)
                time.sleep(POLL_S)
                continue
            if started == self._incarnation[index]:  # the old one, not yet gone (a hung one being killed)
                time.sleep(POLL_S)
                continue
            self._incarnation[index] = started
            with self._lock:
                self.restarted[index] += 1
                self.router.mark_up(index)
            log.info("replica %d is back", index)
            return


def merge_stats(parts: Sequence[EngineStats], block_size: int) -> EngineStats:
    """The replicas' snapshots as one: counts and gauges summed."""
    def total(name: str) -> int:
        return sum(getattr(s, name) for s in parts)

    def tally(name: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in parts:
            for k, v in getattr(s, name).items():
                out[k] = out.get(k, 0) + v
        return out

    numeric = ("kv_blocks_total", "kv_blocks_free", "kv_blocks_cached", "kv_blocks_used", "running", "waiting",
               "conversations", "steps", "prefix_cache_hit_tokens", "prefix_cache_hit_blocks",
               "prefix_cache_query_blocks", "computed_tokens", "generated_tokens", "preemptions")
    return EngineStats(block_size=block_size, finished=tally("finished"), cancelled=tally("cancelled"),
                       **{name: total(name) for name in numeric})


def _cause(exc: BaseException) -> str:
    """The last line of a replica's failure that says something (Ray wraps the cause)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _kill(actors: list[Any]) -> None:
    for actor in actors:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(actor, no_restart=True)


def launch_replicas(ref: str, config: Any, address: str, num_replicas: int,
                    options: ReplicaOptions | None = None, *, ship: bool | None = None) -> ReplicaSet:
    """Connects to Ray and starts ``num_replicas`` replicas of the model at ``ref``.

    Whole-model replicas go where Ray finds a CPU (``options.resources`` narrows it); a
    node without the model file gets the weights the head shipped (see
    :mod:`~bargein.distributed.replica_build`). With ``config.pipeline`` set, each
    replica is a pipeline: its head on this node, its stages on the nodes planned for it
    so that all N x M stages fit (PipelineSetupError, one line, when they do not).
    """
    from bargein.distributed.pipeline import connect
    from bargein.distributed.replica_build import plan_stage_nodes, replica_model, with_stage_nodes

    options = options or ReplicaOptions()
    pipe = config.pipeline
    connect(address, num_replicas * (pipe.stages if pipe else 1))
    wanted = dict(options.resources or {})
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0
             and all(n["Resources"].get(k, 0) >= v for k, v in wanted.items())]
    if not nodes:
        raise PipelineSetupError("the Ray cluster has no live node with a CPU" +
                                 (f" offering {', '.join(wanted)}" if wanted else ""))
    builds: EngineBuilder | list[EngineBuilder]
    if pipe is not None:
        stage_nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0
                       and (pipe.node_resource is None or n["Resources"].get(pipe.node_resource, 0) > 0)]
        plans = plan_stage_nodes(num_replicas, pipe.stages, stage_nodes, pipe.threads_per_stage)
        model, shipping = replica_model(ref, config, nodes)
        builds = [with_stage_nodes(model, plan) for plan in plans]
        options = replace(options, num_cpus=0, on_head_node=True, stages_per_replica=pipe.stages)
    else:
        builds, shipping = replica_model(ref, config, nodes, ship=ship)
    group = ReplicaSet.launch(builds, num_replicas, options)
    group.builds = builds  # holds the shipped weights' reference: a restarted replica fetches them again
    group.weights_shipped_bytes = shipping.shipped_bytes
    group.nodes_without_file = shipping.nodes_without_file
    return group
