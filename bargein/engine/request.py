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


_FINISH_STATUS = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.CANCELLED: RequestStatus.FINISHED_CANCELLED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


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
    """A snapshot of a request, emitted after each step that changed it.

    ``token_ids`` and ``text`` are everything delivered so far; ``new_token_ids`` and
    ``delta_text`` what this output adds. The last output has ``finished`` set; after
    a cancel it has ``finish_reason == CANCELLED`` and ``cancel_reason`` says why.
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
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    cancel_reason: CancelReason | None = None
    error: str | None = None
    cached_tokens: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.sequence.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return self.sequence.num_tokens - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def finish(self, reason: FinishReason, *, cancel_reason: CancelReason | None = None,
               error: str | None = None) -> None:
        self.status = _FINISH_STATUS[reason]
        self.finish_reason = reason
        self.cancel_reason = cancel_reason
        self.error = error
        self.finish_time = time.monotonic()

    def usage(self) -> Usage:
        return Usage(self.prompt_len, self.num_output_tokens, self.cached_tokens)
