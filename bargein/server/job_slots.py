"""A job's slots: one engine request each, its outputs as the job reads them, and the
final outputs the server makes itself (a shutdown's forced end, a read that failed, a
request that never reached the engine).

A slot starts *unsubmitted* when its job waits in its tenant's queue (``tenant_gate.py``):
its outputs then begin once the job runner ``attach``-es the engine stream, or it is ended
before it ever ran (``end_unsubmitted``: cancelled while queued, or refused at submission).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from bargein.engine.client import EngineClient
from bargein.engine.request import CancelReason, FinishReason, RequestOutput, TokenLogprob, Usage
from bargein.engine.streams import RequestStream


class ForcedEnd:
    """Returned by a slot's ``get`` at shutdown: end this slot now with what was delivered."""


FORCED_END = ForcedEnd()
FORCED_SUFFIX = "(shutdown)"  # on the request_id of a final output made by force_finish


class SlotOutputs:
    """One engine request's outputs as the job reads them, plus a forced end at shutdown.

    ``get`` returns the next :class:`RequestOutput` (read through the engine stream's
    processor, O(new tokens)) or ``FORCED_END`` once ``force_end`` was called. A ``get``
    that is cancelled (a pump stopped, a ``wait_for`` ran out) loses nothing: the read in
    progress is kept and handed to the next ``get``. Before the slot is submitted
    (``stream`` None), ``get`` waits for ``attach`` or ``end_unsubmitted``.
    """

    def __init__(self, engine: EngineClient, stream: RequestStream | None = None):
        self._engine = engine
        self.stream = stream
        self.unsubmitted_end: RequestOutput | None = None  # its final output, if it ended before submission
        self._reading: asyncio.Future[RequestOutput] | None = None
        self._forced = asyncio.Event()
        self._settled = asyncio.Event()  # submitted, or ended before it
        if stream is not None:
            self._settled.set()

    @property
    def submitted(self) -> bool:
        return self.stream is not None

    @property
    def num_delivered(self) -> int:
        """Output tokens turned into outputs so far (what the client can have seen)."""
        return 0 if self.stream is None else self.stream.processor.num_delivered

    def attach(self, stream: RequestStream) -> None:
        """The slot's engine request was submitted: its outputs come from ``stream``."""
        self.stream = stream
        self._settled.set()

    def end_unsubmitted(self, final: RequestOutput) -> None:
        """Ends a slot that never reached the engine with ``final``."""
        self.unsubmitted_end = final
        self._settled.set()

    def force_end(self) -> None:
        self._forced.set()

    async def get(self) -> RequestOutput | ForcedEnd:
        while not self._settled.is_set() and not self._forced.is_set():
            await _first(self._settled, self._forced)
        if self._forced.is_set():
            return FORCED_END
        if self.stream is None:
            assert self.unsubmitted_end is not None
            return self.unsubmitted_end
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._engine.next_output(self.stream))
        forced = asyncio.ensure_future(self._forced.wait())
        try:
            await asyncio.wait({self._reading, forced}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            forced.cancel()
        if self._reading.done():
            reading, self._reading = self._reading, None
            return reading.result()
        return FORCED_END


async def _first(*events: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


@dataclass(frozen=True)
class Slot:
    """One engine request of a job: which prompt, which choice, and its output index."""

    engine_id: str
    queue: SlotOutputs
    index: int  # the choice index the client sees
    prompt_index: int


@dataclass
class Progress:
    """One slot's outputs so far: deltas accumulated, and the final output once it came."""

    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last_usage: Usage | None = None
    final: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.pieces.append(out.delta_text)
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs)
        self.last_usage = out.usage
        if out.finished:
            self.final = out

    @property
    def text(self) -> str:
        return self.final.text if self.final is not None else "".join(self.pieces)


FinalHook = Callable[[Slot, RequestOutput], None]


def unsubmitted_final(slot: Slot, prompt_tokens: int, reason: CancelReason | None,
                      error: str | None = None) -> RequestOutput:
    """The final output of a slot that never reached the engine: cancelled with ``reason``
    while queued, or (``reason`` None) an error at submission. Nothing was generated."""
    return RequestOutput(
        request_id=slot.engine_id, new_token_ids=(), token_ids=(), delta_text="", text="", finished=True,
        finish_reason=FinishReason.ERROR if reason is None else FinishReason.CANCELLED,
        usage=Usage(prompt_tokens, 0, 0), cancel_reason=reason, error=error)


def shutdown_final(slot: Slot, progress: Progress) -> RequestOutput:
    """The final output of a slot the engine did not end in time: what was delivered."""
    usage = progress.last_usage or Usage(0, 0, 0)
    return RequestOutput(
        request_id=slot.engine_id + FORCED_SUFFIX, new_token_ids=(), token_ids=tuple(progress.token_ids),
        delta_text="", text="".join(progress.pieces), finished=True, finish_reason=FinishReason.CANCELLED,
        usage=usage, cancel_reason=CancelReason.SHUTDOWN)


def failed_final(slot: Slot, progress: Progress, error: str) -> RequestOutput:
    """The final output of a slot whose outputs could not be read: an error, with what was delivered."""
    return RequestOutput(
        request_id=slot.engine_id + FORCED_SUFFIX, new_token_ids=(), token_ids=tuple(progress.token_ids),
        delta_text="", text="".join(progress.pieces), finished=True, finish_reason=FinishReason.ERROR,
        usage=progress.last_usage or Usage(0, 0, 0), error=f"reading the answer failed: {error}")


def is_forced(out: RequestOutput) -> bool:
    """Made by ``force_finish``, not the engine: its token ids are not known to be exact."""
    return out.request_id.endswith(FORCED_SUFFIX)
