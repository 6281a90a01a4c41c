"""One request's stream from the engine thread to an asyncio consumer: coalescing, bounded.

The engine thread ``push``es deltas; the consumer awaits ``next_delta``. Deltas that
arrive before the consumer reads are merged into the one pending delta (O(new tokens)),
so a slow consumer never queues more than one item per request and never slows the step
loop: a push is a short critical section, plus at most one ``call_soon_threadsafe`` per
wake-up. The consumer runs the request's :class:`OutputProcessor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from bargein.engine.outputs import OutputProcessor, RequestDelta


class RequestStream:
    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, processor: OutputProcessor):
        self.request_id = request_id
        self.processor = processor
        self._loop = loop
        self._lock = threading.Lock()  # engine thread vs consumer; never held across a wait
        self._pending: RequestDelta | None = None
        self._closed = False  # a finished delta was pushed: nothing more is accepted
        self._ready = asyncio.Event()
        self.engine_finished = False  # the engine's last delta was read (the request ended there)

    def push(self, delta: RequestDelta) -> None:
        """Engine thread (or shutdown): hands a delta over, merging with one not yet read."""
        with self._lock:
            if self._closed:
                return
            self._closed = delta.finished
            wake = self._pending is None
            if wake:
                self._pending = delta
            else:
                self._pending.merge(delta)
        if wake:
            with contextlib.suppress(RuntimeError):  # that event loop closed: nobody listens
                self._loop.call_soon_threadsafe(self._ready.set)

    async def next_delta(self) -> RequestDelta:
        """Everything pushed since the last call, as one delta."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            with self._lock:
                delta, self._pending = self._pending, None
            if delta is not None:
                self.engine_finished = delta.finished
                return delta
