"""Typed messages into the engine's ordered inbox.

New requests, cancels and calls from other threads go through one FIFO queue, drained
by the engine's own thread at step boundaries, so none is lost or applied twice, and a
cancel sent after an add is always applied after it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from bargein.engine.request import CancelReason, FinishReason, Request


@dataclass(frozen=True)
class AddRequest:
    request: Request
    conversation_id: str | None = None  # generate onto this conversation's sequence
    new_token_ids: tuple[int, ...] = ()  # appended to the conversation's sequence first


@dataclass(frozen=True)
class AbortRequest:
    """Cancel a request; with ``delivered``, also keep only that many of its output tokens
    (the consumer walked away after being handed them)."""

    request_id: str
    reason: CancelReason
    requested_at: float  # time.monotonic(), for cancel latency
    delivered: int | None = None


@dataclass(frozen=True)
class FinishRequest:
    """End a request for a reason the consumer found (a stop string), keeping ``delivered``
    output tokens."""

    request_id: str
    reason: FinishReason
    delivered: int


@dataclass(frozen=True)
class Wake:
    """Nothing to do: ends a wait for work (e.g. the step loop is being stopped)."""


@dataclass(frozen=True)
class CallInEngine:
    """Runs ``fn`` in the engine's thread between steps; its result or error goes to ``future``."""

    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)


EngineMessage = AddRequest | AbortRequest | FinishRequest | CallInEngine | Wake


# -- conversation operations ------------------------------------------------------------
# One message per operation: the engine client (AsyncEngine, the replica set and its
# actors) forwards a message unchanged, through the inbox and across Ray, to the engine
# thread, which applies it (``Engine.conversation``). A conversation's answers are
# requests submitted with its id; what is here changes or reads it between answers.
@dataclass(frozen=True)
class OpenConversation:
    """Open a conversation holding ``token_ids`` (computed with its first answer)."""

    conversation_id: str
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class AppendToConversation:
    """Append prompt tokens (computed with the next answer); EngineError if too long."""

    conversation_id: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ConversationTokens:
    """Read the conversation's tokens: its prompts plus the tokens handed of its answers."""

    conversation_id: str


@dataclass(frozen=True)
class ForkConversation:
    """Open a new conversation with the same tokens, sharing K/V blocks (copy on write);
    answers the new id."""

    conversation_id: str


@dataclass(frozen=True)
class RewindConversation:
    """Keep the first ``num_tokens`` tokens (and their K/V)."""

    conversation_id: str
    num_tokens: int


@dataclass(frozen=True)
class CloseConversation:
    """Cancel its answer, if any, and release its blocks (to the prefix cache)."""

    conversation_id: str


ConversationMessage = (OpenConversation | AppendToConversation | ConversationTokens | ForkConversation | RewindConversation
                       | CloseConversation)
