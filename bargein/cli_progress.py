"""Prompt-reading progress for ``bargein chat``: ``[reading the prompt: 512/2000 tokens (25%)]``.

While an answer has produced no token yet, :class:`PromptProgress` asks the backend how far
the prompt is read (``prompt_computed`` of ``prompt_tokens``, as ``GET /v1/requests`` and
``Engine.list_requests`` report it) and keeps one status line on stderr up to date. The
line is erased before the first piece of the answer is printed, so the answer's text is
never mixed with it. Short prompts, read in one step, never show a line at all.
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


def progress_text(computed: int, total: int) -> str:
    return f"[reading the prompt: {computed}/{total} tokens ({100 * computed // max(total, 1)}%)]"


class PromptProgress:
    def __init__(self, probe: Probe, out: TextIO, interval_s: float = POLL_S):
        self.probe = probe
        self.out = out
        self.interval_s = interval_s
        self.shown: list[str] = []  # every line drawn, for tests and for erasing
        self._width = 0
        self._done = False

    async def run(self) -> None:
        """Polls until :meth:`finish`; errors of the probe are ignored (the answer reports its own)."""
        while not self._done:
            with contextlib.suppress(Exception):
                reading = await self.probe()
                if not self._done and reading is not None and 0 <= reading[0] < reading[1]:
                    self._draw(progress_text(*reading))
            await asyncio.sleep(self.interval_s)

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
                        interval_s: float = POLL_S) -> T:
    """Runs ``answer(first_text)`` with progress shown until ``first_text()`` is called or it ends."""
    progress = PromptProgress(probe, out, interval_s)
    task = asyncio.ensure_future(progress.run())
    try:
        return await answer(progress.finish)
    finally:
        progress.finish()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
