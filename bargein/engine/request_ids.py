"""Which request ids are in use, and how each ended: safe from any thread, lock-free.

This is the one memory of request ids (contract C6). Every operation is a single
atomic dict operation under the GIL (``setdefault``, ``pop``, assignment), so
``request_cancel`` may be called from any thread, an event loop or a signal handler:
it never takes a lock and never waits for the engine.

How an abort's answer is kept true: each request has one *outcome slot*, written once
by whoever gets there first (``dict.setdefault``). ``request_cancel`` tries to put its
cancel reason there; the engine thread, when a request ends for any reason, tries to
put "done" there. If the cancel won, the engine ends the request as cancelled
(dropping a token sampled in the same step); if the engine won, the abort answers
ALREADY_FINISHED. So an abort that answers CANCELLED always sees the request end with
``finish_reason == "cancelled"``.
"""

from __future__ import annotations

from collections import deque

from bargein.engine.request import AbortResult, CancelReason

_DONE = "done"


class IdInUse(ValueError):
    """A request id that a live request already has."""


class RequestIds:
    def __init__(self, memory: int = 10_000):
        self._memory = memory
        self._live: dict[str, object] = {}
        self._outcome: dict[str, object] = {}  # request id -> a CancelReason (cancel claimed) or _DONE
        self._retired: deque[str] = deque()  # finished ids, oldest first, for bounded memory

    # -- any thread -----------------------------------------------------------------
    def claim(self, request_id: str) -> None:
        """Marks an id in use; raises IdInUse if a live request has it. A finished id may be reused."""
        mine = object()
        if self._live.setdefault(request_id, mine) is not mine:
            raise IdInUse(f"request id {request_id!r} is already in use")
        self._outcome.pop(request_id, None)

    def request_cancel(self, request_id: str, reason: CancelReason) -> AbortResult:
        """Claims the request's outcome for a cancel, unless it already ended (see the module doc)."""
        if request_id not in self._live and request_id not in self._outcome:
            return AbortResult.NOT_FOUND
        got = self._outcome.setdefault(request_id, reason)
        if isinstance(got, CancelReason):
            return AbortResult.CANCELLED
        return AbortResult.ALREADY_FINISHED

    def cancel_claim(self, request_id: str) -> CancelReason | None:
        """The cancel reason that claimed this request, if any (a read; may be stale by a moment)."""
        got = self._outcome.get(request_id)
        return got if isinstance(got, CancelReason) else None

    def end_claimed(self, request_id: str) -> bool:
        """Whether an end (not a cancel) claimed this request's outcome (a read; may be stale by a moment)."""
        got = self._outcome.get(request_id)
        return got is not None and not isinstance(got, CancelReason)

    def claim_end(self, request_id: str) -> CancelReason | None:
        """Claims the outcome for an end found outside the engine (a consumer's stop
        string); returns the cancel reason if a cancel got there first."""
        got = self._outcome.setdefault(request_id, _DONE)
        return got if isinstance(got, CancelReason) else None

    def live(self) -> list[str]:
        return list(self._live)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._live

    # -- the engine thread --------------------------------------------------------------
    def settle(self, request_id: str) -> CancelReason | None:
        """A request is ending: returns the cancel reason if a cancel claimed it first.

        Afterwards every abort of this id answers ALREADY_FINISHED.
        """
        got = self._outcome.setdefault(request_id, _DONE)
        self._outcome[request_id] = _DONE
        return got if isinstance(got, CancelReason) else None

    def release(self, request_id: str) -> None:
        """A request ended and was reported: its id may be used again; its end is remembered."""
        self._outcome[request_id] = _DONE
        self._live.pop(request_id, None)
        self._retired.append(request_id)
        while len(self._retired) > self._memory:
            old = self._retired.popleft()
            if old not in self._live:
                self._outcome.pop(old, None)

    def forget(self, request_id: str) -> None:
        """Undoes a ``claim`` for a request that was never queued (refused before it was sent)."""
        self._live.pop(request_id, None)
