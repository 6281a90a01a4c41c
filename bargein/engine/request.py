"""Requests and what the engine reports about them.

A :class:`Sequence` is a token list with its K/V bookkeeping: the first
``num_computed`` tokens have K/V in the blocks of ``block_table``; the rest are pending.
One accounting covers prompt, chunked prompt, prefix hit and decode: every step
computes some of the pending tokens.

A :class:`Request` asks for tokens to be generated onto a sequence. A plain request
owns a sequence of its own; a conversation's request borrows the conversation's
sequence, which outlives it (with its blocks) for the next turn.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from bargein.engine.blocks import BlockTable
from bargein.engine.sampling import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every status from FINISHED_STOPPED on is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_CANCELLED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


class CancelReason(enum.StrEnum):
    """Why a request was cancelled; kept apart in outputs, logs and metrics."""

    USER = "user"
    DISCONNECT = "disconnect"
    DEADLINE = "deadline"
    SHUTDOWN = "shutdown"
    ERROR = "error"


class RequestEvent(enum.Enum):
    """What can happen to a request; the scheduler's one transition function applies it."""

    SCHEDULE = "schedule"  # admitted into a step (first time, or again after a preemption)
    PREEMPT = "preempt"  # blocks taken back; recomputed later from its tokens
    STOP = "stop"  # a stop token or a stop string (found by the consumer)
    LENGTH = "length"  # max_tokens or the context is full
    CANCEL = "cancel"  # user, disconnect, deadline, shutdown
    FAIL = "fail"  # refused at admission, KV cache too small, the forward failed


_W, _R, _P = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED
_ENDS = {
    RequestEvent.CANCEL: RequestStatus.FINISHED_CANCELLED,
    RequestEvent.FAIL: RequestStatus.FINISHED_ERROR,
}

#: The whole lifecycle: ``TRANSITIONS[status][event]`` is the status an event leads to.
#: A pair missing from the table is a bug, and ``transition`` raises on it. Finished
#: statuses have no entry: nothing happens to a finished request.
TRANSITIONS: dict[RequestStatus, dict[RequestEvent, RequestStatus]] = {
    _W: {RequestEvent.SCHEDULE: _R, **_ENDS},
    _R: {RequestEvent.PREEMPT: _P, RequestEvent.STOP: RequestStatus.FINISHED_STOPPED,
         RequestEvent.LENGTH: RequestStatus.FINISHED_LENGTH, **_ENDS},
    # A preempted request has delivered tokens, so a stop string found late by the
    # consumer can still end it with "stop".
    _P: {RequestEvent.SCHEDULE: _R, RequestEvent.STOP: RequestStatus.FINISHED_STOPPED, **_ENDS},
}

FINISH_EVENTS = {
    FinishReason.STOP: RequestEvent.STOP,
    FinishReason.LENGTH: RequestEvent.LENGTH,
    FinishReason.CANCELLED: RequestEvent.CANCEL,
    FinishReason.ERROR: RequestEvent.FAIL,
}


class IllegalTransition(RuntimeError):
    """A status change the table does not allow (a bug in the scheduler)."""


class AbortResult(enum.StrEnum):
    """What ``abort`` found (contract C6)."""

    CANCELLED = "cancelled"
    NOT_FOUND = "not_found"
    ALREADY_FINISHED = "already_finished"


@dataclass
class Sequence:
    """Tokens and K/V bookkeeping; owned by the scheduler."""

    seq_id: str
    token_ids: list[int]
    num_computed: int = 0
    block_table: BlockTable = field(default_factory=BlockTable)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose K/V was reused rather than computed

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class RequestOutput:
    """What a consumer gets for a request, made on the consumer's side from engine deltas.

    Every output carries what it adds: ``new_token_ids``, ``delta_text``,
    ``new_logprobs``, and the cumulative ``usage`` counts. The cumulative ``token_ids``,
    ``text`` and ``prompt_token_ids`` are filled on the last output only (``finished``
    set); on earlier ones they are empty, so no output copies the answer so far. After
    a cancel the last output has ``finish_reason == CANCELLED`` and ``cancel_reason``
    says why.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    delta_text: str
    text: str
    finished: bool
    finish_reason: FinishReason | None
    usage: Usage
    cancel_reason: CancelReason | None = None
    error: str | None = None
    new_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    emitted_at: float | None = field(default=None, compare=False)  # its delta's time.monotonic() on the engine thread (its oldest token's)


@dataclass
class Request:
    """A generation request; its state changes only in the scheduler's thread."""

    request_id: str
    sequence: Sequence
    params: SamplingParams
    prompt_len: int  # tokens of the sequence before generation began
    new_prompt_tokens: int  # of those, how many this request appended (the rest were already there)
    owns_sequence: bool = True
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # time.monotonic() value
    constraint_from: int | None = None  # conversation token where a resumed constrained answer began
    output_offset: int = 0  # the prompt's last tokens that are earlier output (a resumed request)
    _status: RequestStatus = RequestStatus.WAITING  # written by ``transition`` alone
    finish_reason: FinishReason | None = None
    cancel_reason: CancelReason | None = None
    error: str | None = None
    cached_tokens: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    # Engine-side bookkeeping, all owned by the scheduler's thread:
    sampling: Any = None  # the sampler's per-request state (a SamplingState), made at admission
    num_reported: int = 0  # output tokens already sent to the consumer in deltas
    prompt_reported: bool = False  # the first delta (which carries prompt_token_ids) was sent
    cancel_requested_at: float | None = None  # for cancel latency
    cancel_requested_step: int | None = None

    @property
    def status(self) -> RequestStatus:
        """Read-only: only :func:`transition` (called by the scheduler) changes it."""
        return self._status

    @property
    def output_token_ids(self) -> list[int]:
        return self.sequence.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return self.sequence.num_tokens - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def usage(self) -> Usage:
        return Usage(self.prompt_len, self.num_output_tokens, self.cached_tokens)


def transition(req: Request, event: RequestEvent) -> tuple[RequestStatus, RequestStatus]:
    """The one place a request's status changes; returns (old, new).

    Called by the scheduler only. Raises IllegalTransition for a pair not in
    ``TRANSITIONS``, so a lifecycle bug shows up where it happens.
    """
    old = req._status
    new = TRANSITIONS.get(old, {}).get(event)
    if new is None:
        raise IllegalTransition(f"request {req.request_id!r}: {event.value} is not allowed when {old.name}")
    req._status = new
    if new.is_finished:
        req.finish_time = time.monotonic()
    return old, new
