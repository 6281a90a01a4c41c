"""AsyncEngine: the Engine stepped by a background thread, with per-request streams.

The engine thread owns the Engine: it steps while there is work and sleeps on the
inbox otherwise. Each step's deltas go to the requests' :class:`RequestStream`
(coalescing: one pending item per request at most); the consumer's coroutine turns
them into :class:`RequestOutput` (text, stop strings, logprobs) off the engine thread.
The model's forward runs outside the event loop, so the loop stays responsive and a
cancel from any coroutine or thread lands at the next step boundary.

It implements :class:`~bargein.engine.client.EngineClient`, the interface the server,
``Conversation`` and the CLI use. Conversations: ``open_conversation`` and the typed
messages of :mod:`bargein.engine.messages` (``conversation(message)``), answers with
``submit(..., conversation_id=...)``; every one goes through the engine's ordered inbox,
so they apply in the order they were sent.

A request is cancelled (contract C1-C2) when: its consuming task is cancelled or the
consumer stops iterating (reason ``disconnect`` by default), ``abort(request_id)`` is
called from anywhere (``user``), its deadline passes (``deadline``), or the engine
shuts down (``shutdown``). In every case the stream ends with an output whose
``finish_reason`` is ``"cancelled"`` for consumers still listening.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from bargein.engine.client import EngineInfo
from bargein.engine.engine import Engine
from bargein.engine.grammar import Grammars
from bargein.engine.kv_disk.fingerprint import files_digest, identity_files
from bargein.engine.messages import ConversationMessage, OpenConversation
from bargein.engine.outputs import OutputProcessor, RequestDelta, StepOutcome, end_found_by_consumer
from bargein.engine.request import AbortResult, CancelReason, FinishReason, RequestOutput
from bargein.engine.runner import RunnerHealth, RunnerInfo
from bargein.engine.sampling import SamplingParams
from bargein.engine.stats import EngineCounters, EngineStats, RequestInfo, StepRecord
from bargein.engine.streams import RequestStream

log = logging.getLogger("bargein.engine")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shutdown or a crash); no new work is accepted."""


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        # Request id -> its stream. Written by submit (any loop) and by the engine thread
        # (removal on finish); single dict operations, atomic under the GIL.
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self._fingerprints: tuple[str, str] | None = None  # (model files, disk tier), once known

    @classmethod
    def from_pretrained(cls, ref: str | None = None, **kwargs: object) -> AsyncEngine:
        return cls(Engine.from_pretrained(ref, **kwargs))  # type: ignore[arg-type]

    @property
    def grammars(self) -> Grammars:
        return self.engine.grammars

    @property
    def counters(self) -> EngineCounters:
        return self.engine.counters

    def describe(self) -> EngineInfo:
        e = self.engine
        pipe = e.config.pipeline
        model_fp, kv_fp = self._model_fingerprints()
        return EngineInfo(e.model_name, e.max_model_len, e.model_config.vocab_size, frozenset(e.eos_token_ids),
                          e.pool.block_size, e.pool.num_blocks, e.config.precision,
                          pipeline_stages=0 if pipe is None else pipe.stages,
                          model_fingerprint=model_fp, kv_fingerprint=kv_fp)

    def _model_fingerprints(self) -> tuple[str, str]:
        """The model files' digest and the disk tier's fingerprint ("" where unknown),
        computed once (the files' digest reads about 1 MiB of samples per model file)."""
        if self._fingerprints is None:
            e = self.engine
            if e.disk is not None:
                fp = e.disk.tier.fingerprint
                self._fingerprints = (fp.files_digest, fp.digest.hex())
            else:
                identity = e.model_identity
                self._fingerprints = ("" if identity is None else files_digest(identity_files(identity)), "")
        return self._fingerprints

    def new_request_id(self) -> str:
        return self.engine.new_request_id()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    # -- lifecycle ----------------------------------------------------------------
    def start(self) -> AsyncEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="bargein-engine", daemon=True)
            self._thread.start()
        return self

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Cancels every request with reason ``shutdown``, answers them, then stops the loop.

        Every stream still open when the loop stops (or when ``timeout`` runs out, e.g.
        because a forward hangs) gets a final cancelled output: nobody is left waiting.
        """
        self.abort_all(CancelReason.SHUTDOWN)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.engine.live_request_ids() and loop.time() < deadline and self.is_alive:
            await asyncio.sleep(0.01)
        self._stopping.set()
        self.engine.wake()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, max(0.0, deadline - loop.time()))
        if self._thread is None or not self._thread.is_alive():  # the loop stopped: the pool is ours
            await asyncio.to_thread(self.engine.close_kv_disk)
        self._end_streams(FinishReason.CANCELLED, cancel_reason=CancelReason.SHUTDOWN,
                          error="the engine shut down")

    def request_shutdown(self) -> None:
        """Asks every request to stop (reason ``shutdown``); lock-free, safe in a signal handler."""
        self.abort_all(CancelReason.SHUTDOWN)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.engine.wait_for_work(timeout=0.1)
                if self._stopping.is_set():
                    break
                if self.engine.has_work:
                    self._dispatch(self.engine.step())
            except BaseException as exc:  # the loop must report, not vanish silently
                log.exception("engine loop crashed")
                self._error = exc
                self._end_streams(FinishReason.ERROR, error=f"the engine stopped: {exc}")
                return

    def _dispatch(self, outcome: StepOutcome) -> None:
        for delta in outcome.deltas:
            stream = self._streams.pop(delta.request_id, None) if delta.finished else \
                self._streams.get(delta.request_id)
            if stream is not None and stream.push(delta):
                # Its consumer stopped reading (streams.py): not scheduled until it reads again.
                self.engine.scheduler.pause(delta.request_id)

    def _resume(self, request_id: str) -> None:
        """A paused request's consumer read again (any thread): resume it between steps."""
        self.engine.call_soon(functools.partial(self.engine.scheduler.resume, request_id))

    def _end_streams(self, reason: FinishReason, *, cancel_reason: CancelReason | None = None,
                     error: str | None = None) -> None:
        """Gives every open stream a final delta (the loop stopped or crashed)."""
        for rid in list(self._streams):
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.push(RequestDelta(rid, finished=True, finish_reason=reason,
                                         cancel_reason=cancel_reason,
                                         error=None if reason == FinishReason.CANCELLED else error))

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error}")
        if self._stopping.is_set():
            raise EngineDeadError("the engine is shutting down")
        self.start()

    # -- requests -----------------------------------------------------------------
    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               request_id: str | None = None, timeout: float | None = None,
               conversation_id: str | None = None, constraint_from: int | None = None) -> tuple[str, RequestStream]:
        """Queues a request and returns its id and stream (call from a running loop).

        Read the stream with ``stream(request_id, stream)``. Raises EngineError for a bad
        request or an id in use.
        """
        self._check_alive()
        params = params or SamplingParams()
        request_id = request_id or self.engine.new_request_id()
        stream = RequestStream(request_id, asyncio.get_running_loop(),
                               OutputProcessor(request_id, params, self.engine.tokenizer),
                               on_resume=functools.partial(self._resume, request_id))
        # add_request claims (and checks) the id, then registers the stream, then queues
        # the request: no other live request has the id, and no delta precedes the stream.
        self.engine.add_request(prompt, params, request_id=request_id, timeout=timeout, conversation_id=conversation_id,
                                on_claimed=lambda rid: self._streams.__setitem__(rid, stream),
                                constraint_from=constraint_from)
        return request_id, stream

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, timeout: float | None = None,
                       conversation_id: str | None = None,
                       exit_reason: CancelReason = CancelReason.DISCONNECT) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs; the last one has ``finished`` set.

        If the consumer stops early (breaks out, or its task is cancelled) the request
        is cancelled with ``exit_reason``, and its sequence keeps only the tokens the
        consumer was handed.
        """
        request_id, stream = self.submit(prompt, params, request_id=request_id, timeout=timeout,
                                         conversation_id=conversation_id)
        async for out in self.stream(request_id, stream, exit_reason=exit_reason):
            yield out

    async def stream(self, request_id: str, stream: RequestStream, *,
                     exit_reason: CancelReason = CancelReason.DISCONNECT) -> AsyncIterator[RequestOutput]:
        """A submitted request's outputs (RequestOutput contract: deltas, cumulative at the end)."""
        async for out in stream_outputs(self, request_id, stream, exit_reason):
            yield out

    async def next_output(self, stream: RequestStream) -> RequestOutput:
        """The next output of a submitted request, read through its stream's processor.

        For consumers that manage the request's end themselves (the server's jobs): it
        never aborts. A stop string the processor finds ends the request through the
        scheduler here, so the output it returns is then the final one.
        """
        processor = stream.processor
        while True:
            out = end_found_by_consumer(self.engine, processor.process(await stream.next_delta()))
            if out is not None:
                return out

    def abort(self, request_id: str, reason: CancelReason = CancelReason.USER, *,
              delivered: int | None = None) -> AbortResult:
        """Thread-safe, lock-free, idempotent (C6); the stream then ends with a cancelled output.

        With ``delivered``, the request's sequence keeps only that many output tokens
        (what its consumer was handed), even if it already finished.
        """
        return self.engine.abort(request_id, reason, delivered=delivered)

    def abort_all(self, reason: CancelReason = CancelReason.USER) -> list[str]:
        """Cancels every live request; lock-free (safe in a signal handler)."""
        cancelled = []
        for request_id in self.engine.live_request_ids():
            if self.engine.abort(request_id, reason) == AbortResult.CANCELLED:
                cancelled.append(request_id)
        return cancelled

    def call_soon(self, fn: Callable[[], T]) -> Future:
        """Queues ``fn`` for the engine thread, in order with everything sent after it."""
        self._check_alive()
        return self.engine.call_soon(fn)

    async def call(self, fn: Callable[[], T]) -> T:
        """Runs ``fn`` in the engine thread between steps and returns its result."""
        return await asyncio.wrap_future(self.call_soon(fn))

    async def stats(self) -> EngineStats:
        return await self.call(self.engine.stats)

    def finish(self, request_id: str, reason: FinishReason, *, delivered: int) -> CancelReason | None:
        """Ends a request for a reason its consumer found (a stop string), keeping ``delivered``."""
        return self.engine.finish(request_id, reason, delivered=delivered)

    # -- conversations ------------------------------------------------------------------
    def open_conversation(self, token_ids: Sequence[int] = ()) -> str:
        """Opens a conversation; returns its id at once. The open is queued in the ordered
        inbox, so everything sent for this conversation afterwards sees it."""
        conversation_id = self.engine.new_request_id().replace("req-", "conv-")
        self.call_soon(functools.partial(self.engine.conversation,
                                         OpenConversation(conversation_id, tuple(int(t) for t in token_ids))))
        return conversation_id

    async def conversation(self, message: ConversationMessage) -> Any:
        """Applies a conversation message on the engine thread; returns its answer."""
        return await self.call(functools.partial(self.engine.conversation, message))

    # -- reports --------------------------------------------------------------------------
    async def requests(self) -> list[RequestInfo]:
        return await self.call(self.engine.list_requests)

    def live_request_ids(self) -> list[str]:
        return self.engine.live_request_ids()

    def health(self) -> RunnerHealth:
        return self.engine.runner_health()

    def cluster(self) -> RunnerInfo:
        """The runner's stages (a pipeline asks them: call off the loop)."""
        return self.engine.runner.describe()

    async def check_block_accounting(self) -> None:
        await self.call(self.engine.check_block_accounting)

    async def steps_after(self, index: int) -> list[StepRecord]:
        return await self.call(functools.partial(self.engine.steps_after, index))

    def register_metrics(self, registry: Any) -> None:
        """Nothing beyond the server's own series: one engine."""


async def stream_outputs(owner: Any, request_id: str, stream: RequestStream,
                         exit_reason: CancelReason) -> AsyncIterator[RequestOutput]:
    """Yields ``owner.next_output(stream)`` until the request finishes; a consumer that
    leaves first aborts it with ``exit_reason`` and ``delivered=`` what it was handed, so
    the sequence keeps exactly those tokens (C3). ``owner``: an EngineClient."""
    finished = False
    try:
        while True:
            out = await owner.next_output(stream)
            finished = out.finished
            yield out
            if finished:
                return
    finally:
        if not finished:
            owner.abort(request_id, exit_reason, delivered=stream.processor.num_delivered)
