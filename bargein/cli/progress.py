"""Prompt-reading progress for ``bargein chat``: ``[reading the prompt: 512/2000 tokens (25%)]``.

While an answer has produced no token yet, :class:`PromptProgress` asks the backend how far
the prompt is read (``prompt_computed`` of ``prompt_tokens``, as ``GET /v1/requests`` and
``Engine.list_requests`` report it) and keeps one status line on stderr up to date. The
line is erased before the first piece of the answer is printed, so the answer's text is
never mixed with it. A line appears only for a long read: after ``DELAY_S`` and while at
least ``MIN_REMAINING`` prompt tokens are still to be read, so an ordinary turn (a short
new message on a cached conversation) never flickers a status line.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TextIO, TypeVar

T = TypeVar("T")

# (prompt_computed, prompt_tokens) of the request in flight, or None when it is not listed.
Probe = Callable[[], Awaitable[tuple[int, int] | None]]
POLL_S = 0.25
DELAY_S = 0.3
MIN_REMAINING = 256  # tokens; fewer are read in well under a second on a CPU


def progress_text(computed: int, total: int) -> str:
    return f"[reading the prompt: {computed}/{total} tokens ({100 * computed // max(total, 1)}%)]"


class PromptProgress:
    def __init__(self, probe: Probe, out: TextIO, interval_s: float = POLL_S, delay_s: float = DELAY_S,
                 min_remaining: int = MIN_REMAINING):
        self.probe = probe
        self.out = out
        self.interval_s = interval_s
        self.delay_s = delay_s
        self.min_remaining = min_remaining
        self.shown: list[str] = []  # every line drawn, for tests and for erasing
        self._width = 0
        self._done = False

    async def run(self) -> None:
        """Polls until :meth:`finish`; errors of the probe are ignored (the answer reports its own)."""
        await asyncio.sleep(self.delay_s)
        while not self._done:
            with contextlib.suppress(Exception):
                reading = await self.probe()
                if not self._done and reading is not None and self._worth_showing(*reading):
                    self._draw(progress_text(*reading))
            await asyncio.sleep(self.interval_s)

    def _worth_showing(self, computed: int, total: int) -> bool:
        # Once drawn, the line follows the read to its end; before, only a long read shows.
        return 0 <= computed < total and (self._width > 0 or total - computed >= self.min_remaining)

    def finish(self) -> None:
        """Stops drawing and erases the line (call before printing the answer's first text)."""
        self._done = True
        if self._width:
            self.out.write("\r" + " " * self._width + "\r")
            self.out.flush()
            self._width = 0

    def _draw(self, text: str) -> None:
        self.shown.append(text)
        self.out.write("\r" + text.ljust(self._width))
        self.out.flush()
        self._width = max(self._width, len(text))


async def with_progress(answer: Callable[[Callable[[], None]], Awaitable[T]], probe: Probe, out: TextIO,
                        **options: float) -> T:
    """Runs ``answer(first_text)`` with progress shown until ``first_text()`` is called or it ends.

    ``options`` are PromptProgress's ``interval_s``, ``delay_s`` and ``min_remaining``."""
    progress = PromptProgress(probe, out, **options)
    task = asyncio.ensure_future(progress.run())
    try:
        return await answer(progress.finish)
    finally:
        progress.finish()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
