"""One request's stream from the engine thread to an asyncio consumer: coalescing, bounded.

The engine thread ``push``es deltas; the consumer awaits ``next_delta``. Deltas that
arrive before the consumer reads are merged into the one pending delta (O(new tokens)),
so a slow consumer never queues more than one item per request and never slows the step
loop: a push is a short critical section, plus at most one ``call_soon_threadsafe`` per
wake-up. The consumer runs the request's :class:`OutputProcessor`.

Backpressure (issue 34): a consumer may bound the tokens pushed and not yet read
(``limit_unread``). A push that reaches the bound returns True, and the engine's side then
pauses the request (``Scheduler.pause``: it keeps its blocks and is simply not scheduled);
the next read calls ``on_resume`` (given at creation), which resumes it. So a consumer that
stops reading stops the generation after about the bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

from bargein.engine.outputs import OutputProcessor, RequestDelta


class RequestStream:
    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, processor: OutputProcessor,
                 on_resume: Callable[[], object] | None = None):
        self.request_id = request_id
        self.processor = processor
        self._loop = loop
        self._lock = threading.Lock()  # engine thread vs consumer; never held across a wait
        self._pending: RequestDelta | None = None
        self._closed = False  # a finished delta was pushed: nothing more is accepted
        self._ready = asyncio.Event()
        self.engine_finished = False  # the engine's last delta was read (the request ended there)
        self._on_resume = on_resume
        self._max_unread: int | None = None  # tokens pushed and not read, at most (None: no bound)
        self._unread = 0
        self._paused = False  # a push reached the bound; the next read resumes

    def limit_unread(self, max_tokens: int) -> None:
        """Bounds the tokens pushed and not yet read (any thread); see the module doc."""
        if max_tokens < 1:
            raise ValueError("the unread bound must be at least one token")
        self._max_unread = max_tokens

    def push(self, delta: RequestDelta) -> bool:
        """Engine thread (or shutdown): hands a delta over, merging with one not yet read.

        Returns True when this push reached the unread bound: the request should pause
        until the consumer reads (then ``on_resume`` is called). Never for a last delta.
        """
        with self._lock:
            if self._closed:
                return False
            self._closed = delta.finished
            wake = self._pending is None
            if wake:
                self._pending = delta
            else:
                self._pending.merge(delta)
            self._unread += len(delta.new_token_ids)
            pause = (self._max_unread is not None and not delta.finished and not self._paused
                     and self._unread >= self._max_unread)
            self._paused = self._paused or pause
        if wake:
            with contextlib.suppress(RuntimeError):  # that event loop closed: nobody listens
                self._loop.call_soon_threadsafe(self._ready.set)
        return pause

    async def next_delta(self) -> RequestDelta:
        """Everything pushed since the last call, as one delta."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            with self._lock:
                delta, self._pending = self._pending, None
                resume, self._paused, self._unread = self._paused, False, 0
            if resume and self._on_resume is not None:
                self._on_resume()
            if delta is not None:
                self.engine_finished = delta.finished
                return delta
