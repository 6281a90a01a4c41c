"""Ctrl-C while an answer streams: the first press cancels it, a second (or a backend that
does not stop within ``HARD_STOP_AFTER_S``) abandons it.

SIGINT goes through :class:`SigintRouter` (``loop.add_signal_handler``) while the event
loop owns the terminal, so no press lands as a stray ``KeyboardInterrupt`` half-way into
a turn.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

from bargein.cli.backends import AnswerError, AnswerResult

HARD_STOP_AFTER_S = 3.0


class SigintRouter:
    """SIGINT on the event loop, handed to whatever runs now; presses with no taker are dropped.

    Installed while the loop owns the terminal (a turn, a command, ``bargein run``); while
    it is installed Ctrl-C never raises ``KeyboardInterrupt``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.handler: Callable[[], None] | None = None

    def install(self) -> None:
        self.loop.add_signal_handler(signal.SIGINT, self._fire)

    def uninstall(self) -> None:
        self.handler = None
        self.loop.remove_signal_handler(signal.SIGINT)

    def _fire(self) -> None:
        if self.handler is not None:
            self.handler()


async def run_interruptible(make: Callable[[], Awaitable[AnswerResult]], cancel: Callable[[], None],
                            sigint: SigintRouter) -> tuple[AnswerResult | AnswerError | None, bool]:
    """Awaits ``make()`` with Ctrl-C calling ``cancel`` (and, if need be, abandoning the answer)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    presses = 0
    hard_stop: asyncio.TimerHandle | None = None

    def on_sigint() -> None:
        nonlocal presses, hard_stop
        presses += 1
        if presses == 1:
            cancel()
            hard_stop = loop.call_later(HARD_STOP_AFTER_S, task.cancel)
        else:
            task.cancel()

    sigint.handler = on_sigint
    try:
        return await make(), presses > 0
    except AnswerError as exc:
        return exc, presses > 0
    except asyncio.CancelledError:
        if not presses:
            raise
        task.uncancel()
        return None, True
    finally:
        sigint.handler = None
        if hard_stop is not None:
            hard_stop.cancel()


