"""AsyncEngine: the Engine stepped by a background thread, with per-request streams.

The engine thread owns the Engine: it steps while there is work and sleeps on the
inbox otherwise. Outputs are handed to the asyncio loop that asked for them, one
``asyncio.Queue`` per request. The model's forward runs outside the event loop, so
the loop stays responsive and a cancel from any coroutine or thread lands at the
next step boundary.

A request is cancelled (contract C1-C2) when: its consuming task is cancelled or the
consumer stops iterating (reason ``disconnect`` by default), ``abort(request_id)`` is
called from anywhere (``user``), its deadline passes (``deadline``), or the engine
shuts down (``shutdown``). In every case the stream ends with an output whose
``finish_reason`` is ``"cancelled"`` for consumers still listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from bargein.engine.engine import Engine, EngineError
from bargein.engine.request import AbortResult, CancelReason, FinishReason, RequestOutput, Usage
from bargein.engine.sampling import SamplingParams
from bargein.engine.stats import EngineStats

log = logging.getLogger("bargein.engine")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shutdown or a crash); no new work is accepted."""


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._streams_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._error: BaseException | None = None

    @classmethod
    def from_pretrained(cls, ref: str | None = None, **kwargs: Any) -> AsyncEngine:
        return cls(Engine.from_pretrained(ref, **kwargs))

    # -- lifecycle ----------------------------------------------------------------
    def start(self) -> AsyncEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="bargein-engine", daemon=True)
            self._thread.start()
        return self

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Cancels every request with reason ``shutdown``, answers them, then stops the loop."""
        for request_id in self.engine.live_request_ids():
            self.engine.abort(request_id, CancelReason.SHUTDOWN)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.engine.live_request_ids() and loop.time() < deadline and self.is_alive:
            await asyncio.sleep(0.01)
        self._stopping.set()
        self.engine.wake()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, max(0.0, deadline - loop.time()))

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
                self._fail_all(f"the engine stopped: {exc}")
                return

    def _dispatch(self, outputs: Sequence[RequestOutput]) -> None:
        for out in outputs:
            with self._streams_lock:
                target = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
            if target is not None:
                loop, stream = target
                with contextlib.suppress(RuntimeError):  # that event loop closed: nobody listens
                    loop.call_soon_threadsafe(stream.put_nowait, out)

    def _fail_all(self, message: str) -> None:
        with self._streams_lock:
            streams, self._streams = self._streams, {}
        for rid, (loop, stream) in streams.items():
            out = RequestOutput(rid, (), (), "", "", True, FinishReason.ERROR, Usage(0, 0, 0), error=message)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stream.put_nowait, out)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error}")
        if self._stopping.is_set():
            raise EngineDeadError("the engine is shutting down")
        self.start()

    # -- requests -----------------------------------------------------------------
    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               request_id: str | None = None, timeout: float | None = None,
               session_id: str | None = None) -> tuple[str, asyncio.Queue[RequestOutput]]:
        """Queues a request and returns its id and output queue (call from a running loop)."""
        self._check_alive()
        request_id = request_id or self.engine.new_request_id()
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue()
        with self._streams_lock:
            if request_id in self._streams:
                raise EngineError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        try:
            self.engine.add_request(prompt, params, request_id=request_id, timeout=timeout, session_id=session_id)
        except BaseException:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            raise
        return request_id, stream

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, timeout: float | None = None,
                       session_id: str | None = None,
                       exit_reason: CancelReason = CancelReason.DISCONNECT) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs; the last one has ``finished`` set.

        If the consumer stops early (breaks out, or its task is cancelled) the request
        is cancelled with ``exit_reason``.
        """
        request_id, stream = self.submit(prompt, params, request_id=request_id, timeout=timeout,
                                         session_id=session_id)
        async for out in self.stream(request_id, stream, exit_reason=exit_reason):
            yield out

    async def stream(self, request_id: str, stream: asyncio.Queue[RequestOutput], *,
                     exit_reason: CancelReason = CancelReason.DISCONNECT) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                out = await stream.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.engine.abort(request_id, exit_reason)

    def abort(self, request_id: str, reason: CancelReason = CancelReason.USER) -> AbortResult:
        """Thread-safe, idempotent (C6); the stream then ends with a cancelled output."""
        return self.engine.abort(request_id, reason)

    def abort_all(self, reason: CancelReason = CancelReason.USER) -> list[str]:
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

    def conversation(self, token_ids: Sequence[int] = ()) -> Any:
        from bargein.engine.conversation import Conversation

        return Conversation.open(self, token_ids)

    def load_conversation(self, state: Any) -> Any:
        """A conversation from ``Conversation.save()``'s state or the file it wrote."""
        from bargein.engine.conversation import Conversation, load_state

        loaded = load_state(state)
        if loaded.model and loaded.model != self.engine.model_name:
            raise ValueError(f"the conversation was saved with model {loaded.model!r}, "
                             f"not {self.engine.model_name!r}")
        return Conversation.open(self, loaded.token_ids)
