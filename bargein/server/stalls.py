"""Stalls of the server process as they happen: event-loop lag and garbage-collector pauses.

A stream's token waits for the event loop to pass it on, so a loop that falls behind
(a handler that runs long, a collector pause that stops every thread) shows as a gap
in every stream at once. ``StallWatch`` records both with ``time.monotonic()`` stamps,
so a benchmark on the same machine can line them up with what its streams saw
(``/debug/stalls``); only stalls over ``threshold_s`` are kept, in bounded deques.

The loop's lag is a ticker's overshoot: it sleeps ``tick_s`` and notes how much later
than asked it woke. Collector pauses come from ``gc.callbacks``, which the collector
calls in whatever thread it runs in (the engine's too); a deque's ``append`` is atomic.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections import deque
from typing import Any

HISTORY = 4096


class StallWatch:
    def __init__(self, tick_s: float = 0.02, threshold_s: float = 0.01):
        self.tick_s = tick_s
        self.threshold_s = threshold_s
        self.loop_lags: deque[tuple[float, float]] = deque(maxlen=HISTORY)  # (woke at, lag s)
        self.gc_pauses: deque[tuple[float, float, int]] = deque(maxlen=HISTORY)  # (ended at, s, generation)
        self._gc_started: float | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Starts the ticker on the running loop and hooks the collector."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._tick())
            gc.callbacks.append(self._on_gc)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
            gc.callbacks.remove(self._on_gc)

    async def _tick(self) -> None:
        while True:
            asked = time.monotonic() + self.tick_s
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            if now - asked > self.threshold_s:
                self.loop_lags.append((now, now - asked))

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        now = time.monotonic()
        if phase == "start":
            self._gc_started = now
        elif self._gc_started is not None:
            if now - self._gc_started > self.threshold_s:
                self.gc_pauses.append((now, now - self._gc_started, info.get("generation", -1)))
            self._gc_started = None

    def since(self, after: float) -> dict[str, list]:
        """Stalls that ended after ``after`` (a ``time.monotonic()`` value)."""
        return {"loop_lags": [list(x) for x in list(self.loop_lags) if x[0] > after],
                "gc_pauses": [list(x) for x in list(self.gc_pauses) if x[0] > after]}
