"""Conversations: sequences that outlive their requests, with their blocks, so the next turn
computes only the new tokens. Their operations, split from the scheduler and the engine
that own them (engine thread):

- :class:`SchedulerConversations` (the scheduler's part): open, append, start an answer
  onto one, fork (blocks shared, copy on write), truncate, close (its answer cancelled, its
  blocks released to the prefix cache);
- :class:`EngineConversations` (the engine's part): ``conversation(message)`` applies the
  typed messages of :mod:`bargein.engine.messages`, which the engine clients forward
  unchanged (through the inbox, across Ray).

This module imports no torch.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bargein.engine.admission import EngineError
from bargein.engine.messages import (
    AppendToConversation,
    CloseConversation,
    ConversationMessage,
    ConversationTokens,
    ForkConversation,
    OpenConversation,
    RewindConversation,
)
from bargein.engine.request import CancelReason, FinishReason, Request, Sequence

if TYPE_CHECKING:
    from bargein.engine.blocks import BlockPool
    from bargein.engine.disk_cache import DiskCache
    from bargein.engine.scheduler import Scheduler


class ConversationGenerating(Exception):
    """A conversation was changed while a request is generating on it."""


class UnknownConversation(KeyError):
    """No conversation with that id (never opened, or closed)."""

    def __str__(self) -> str:
        return f"no conversation {self.args[0]!r} (it was never opened, or is closed)"


@dataclass
class HeldConversation:
    """A conversation's sequence between requests. ``active`` is the request on it, if any.

    ``last_request`` (id, prompt length) names the request that generated last, so a
    consumer's late "I was handed n tokens" can still cut the sequence to them.
    """

    sequence: Sequence
    active: Request | None = None
    last_used: float = 0.0
    last_request: tuple[str, int] | None = None


class SchedulerConversations:
    """The scheduler's conversation operations (mixed into :class:`Scheduler`)."""

    conversations: dict[str, HeldConversation]
    pool: BlockPool

    def _cut_idle_conversation(self, request_id: str, delivered: int) -> None:
        for conversation in self.conversations.values():
            if conversation.active is None and conversation.last_request and conversation.last_request[0] == request_id:
                self._cut(conversation.sequence, conversation.last_request[1] + delivered)
                return

    # -- conversations ----------------------------------------------------
    def open_conversation(self, seq_id: str, token_ids: Iterable[int] = ()) -> Sequence:
        if seq_id in self.conversations:
            raise ValueError(f"conversation {seq_id!r} already exists")
        seq = Sequence(seq_id, list(token_ids))
        if seq.token_ids:
            self.check_length(seq.num_tokens, "the conversation")
        self.conversations[seq_id] = HeldConversation(seq, last_used=time.monotonic())
        return seq

    def conversation(self, seq_id: str) -> HeldConversation:
        try:
            return self.conversations[seq_id]
        except KeyError:
            raise UnknownConversation(seq_id) from None

    def idle_conversation(self, seq_id: str) -> HeldConversation:
        conversation = self.conversation(seq_id)
        if conversation.active is not None:
            raise ConversationGenerating(f"conversation {seq_id!r} is generating (request {conversation.active.request_id!r})")
        return conversation

    def append_to_conversation(self, seq_id: str, token_ids: Iterable[int]) -> None:
        """Appends prompt tokens to an idle conversation (computed with its next request)."""
        seq = self.idle_conversation(seq_id).sequence
        new = [int(t) for t in token_ids]
        self.check_length(seq.num_tokens + len(new), "the conversation")
        seq.token_ids.extend(new)

    def start_conversation_request(self, request: Request, new_tokens: Iterable[int] = ()) -> None:
        """Appends ``new_tokens`` to the request's (idle) conversation and queues the request,
        which generates onto the conversation's sequence. Raises, changing nothing, if it can't."""
        conversation = self.idle_conversation(request.sequence.seq_id)
        seq = conversation.sequence
        new = [int(t) for t in new_tokens]
        if not seq.token_ids and not new:
            raise ValueError("the conversation is empty: prompt it first")
        self.check_length(seq.num_tokens + len(new), "the conversation")
        seq.token_ids.extend(new)
        request.sequence = seq
        request.prompt_len = seq.num_tokens
        self.add(request)
        conversation.active = request

    def fork_conversation(self, seq_id: str, new_id: str) -> Sequence:
        """A new conversation with the same tokens, sharing every block (copy on write)."""
        src = self.idle_conversation(seq_id).sequence
        if new_id in self.conversations:
            raise ValueError(f"conversation {new_id!r} already exists")
        seq = Sequence(new_id, list(src.token_ids), src.num_computed, self.pool.fork(src.block_table))
        self.conversations[new_id] = HeldConversation(seq, last_used=time.monotonic())
        return seq

    def rewind_conversation(self, seq_id: str, num_tokens: int) -> None:
        """Keeps the first ``num_tokens`` tokens (and their K/V) of an idle conversation."""
        seq = self.idle_conversation(seq_id).sequence
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"cannot keep {num_tokens} of {seq.num_tokens} tokens")
        self._cut(seq, num_tokens)

    def close_conversation(self, seq_id: str) -> None:
        """Ends the conversation's request (cancelled, reported in the step's outcome) and
        releases its blocks (to the prefix cache). Unknown ids are ignored."""
        conversation = self.conversations.get(seq_id)
        if conversation is None:
            return
        if conversation.active is not None:
            req = conversation.active
            self._pending_finish.pop(req.request_id, None)
            # Ended now even if its plan is in flight: update() skips requests it no longer knows.
            self._finish(req, FinishReason.CANCELLED, cancel_reason=CancelReason.USER)
        seq = conversation.sequence
        self.pool.release(seq.block_table, seq.token_ids, seq.num_computed)
        del self.conversations[seq_id]



class EngineConversations:
    """The engine's conversation operations (mixed into :class:`~bargein.engine.engine.Engine`)."""

    scheduler: Scheduler
    disk: DiskCache | None

    def conversation(self, message: ConversationMessage) -> Any:
        """Applies a conversation message (see :mod:`bargein.engine.messages`); returns its answer."""
        match message:
            case OpenConversation(conversation_id, token_ids):
                return self.open_conversation(token_ids, conversation_id)
            case AppendToConversation(conversation_id, token_ids):
                return self.append_to_conversation(conversation_id, token_ids)
            case ConversationTokens(conversation_id):
                return self.conversation_tokens(conversation_id)
            case ForkConversation(conversation_id):
                return self.fork_conversation(conversation_id)
            case RewindConversation(conversation_id, num_tokens):
                return self.rewind_conversation(conversation_id, num_tokens)
            case CloseConversation(conversation_id):
                return self.close_conversation(conversation_id)
        raise TypeError(f"not a conversation message: {message!r}")

    def open_conversation(self, token_ids: Iterable[int] = (), conversation_id: str | None = None) -> str:
        conversation_id = conversation_id or f"conv-{uuid.uuid4().hex[:16]}"
        with _as_engine_error():
            self.scheduler.open_conversation(conversation_id, token_ids)
        return conversation_id

    def conversation_tokens(self, conversation_id: str) -> list[int]:
        return list(self.scheduler.conversation(conversation_id).sequence.token_ids)

    def append_to_conversation(self, conversation_id: str, token_ids: Seq[int]) -> None:
        with _as_engine_error():
            self.scheduler.append_to_conversation(conversation_id, token_ids)

    def fork_conversation(self, conversation_id: str) -> str:
        new_id = f"conv-{uuid.uuid4().hex[:16]}"
        self.scheduler.fork_conversation(conversation_id, new_id)
        return new_id

    def rewind_conversation(self, conversation_id: str, num_tokens: int) -> None:
        self.scheduler.rewind_conversation(conversation_id, num_tokens)

    def close_conversation(self, conversation_id: str) -> None:
        """Closes a conversation, cancelling its request if one is generating (its last
        delta comes in the next step's outcome, with everything else that finished). With
        a disk tier, the blocks only it held are deleted from disk too."""
        held = self.scheduler.conversations.get(conversation_id)
        disk = self.disk
        if held is not None and disk is not None:
            seqs = [r.sequence for r in self.scheduler.requests.values() if r.sequence is not held.sequence]
            seqs += [c.sequence for c in self.scheduler.conversations.values() if c is not held]
            others = [(s.token_ids, s.block_table.root) for s in seqs]
            disk.forget_closed(held.sequence.block_table, held.sequence.token_ids, others)
        self.scheduler.close_conversation(conversation_id)


class _as_engine_error:
    """Turns a scheduler's refusal (ValueError: too long, already exists) into EngineError."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> bool:
        if isinstance(exc, ValueError) and not isinstance(exc, EngineError):
            raise EngineError(str(exc)) from None
        return False
