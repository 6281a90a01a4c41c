"""The head's records of the replica set, in one store with one lock.

- :class:`LiveRequest`: a request in flight: its owning replica (the router's route),
  prompt, params, deadline, the output tokens received so far and its outcome claim. A
  cancel (by id, disconnect, deadline on the head, shutdown) reads the owner here and
  goes to that replica only: no broadcast, no lookup that can miss.
- :class:`FinishedRequest`: a request that ended, remembered so a late cancel answers
  "already finished" and still cuts a conversation to what its consumer was handed.
- :class:`ConversationRecord`: a conversation pinned to the replica that holds its K/V,
  with the head's copy of its tokens, so a lost replica's conversations are opened
  again elsewhere.

The lock is held by the facade's and the pollers' short critical sections, never across
the wait of a Ray call.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from bargein.distributed.router import Route
from bargein.engine.engine import EngineError
from bargein.engine.request import CancelReason
from bargein.engine.sampling import SamplingParams
from bargein.engine.streams import RequestStream

RECENT_FINISHED = 4096  # finished ids remembered (an abort of one answers "already finished")
DONE = "done"  # a request's outcome claimed by its end (a stop string), not by a cancel


@dataclass
class LiveRequest:
    """A request in flight, as the head knows it."""

    request_id: str
    stream: RequestStream
    prompt: list[int]  # the original prompt (a conversation's turn: its new tokens only)
    params: SamplingParams
    deadline: float | None
    route: Route  # where it runs now (the router's record)
    constraint_from: int | None = None  # where a continued constrained answer began in the prompt
    conversation: str | None = None  # the conversation it extends
    conversation_base: int = 0  # the conversation's length where this answer begins
    arrival: float = field(default_factory=time.monotonic)
    output: list[int] = field(default_factory=list)  # tokens received (the whole answer)
    offset: int = 0  # output tokens the current replica got in its prompt (resumed)
    prompt_sent: bool = False  # the stream had the first delta (with prompt_token_ids)
    cached_tokens: int | None = None  # from the first replica's usage
    outcome: CancelReason | str | None = None  # claimed by a cancel or by the consumer's end (DONE)
    resumes: int = 0

    @property
    def replica(self) -> int:
        return self.route.replica


@dataclass(frozen=True)
class FinishedRequest:
    """A finished request (see the module doc)."""

    replica: int
    conversation: str | None = None
    conversation_base: int = 0
    offset: int = 0  # output tokens the last replica got in its prompt (a resumed request)


@dataclass
class ConversationRecord:
    """A conversation: the replica that holds its K/V, and its tokens as the head last knew them."""

    replica: int  # -1: lost with its replica, and no replica was left
    tokens: list[int]
    # Not yet opened on ``replica``: the next call there opens it first, in the same actor
    # call or awaited before it (two calls to an async actor are not ordered).
    unopened: bool = True


class RecordStore:
    """Live and recently finished requests and conversations, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.live: dict[str, LiveRequest] = {}
        self.recent: OrderedDict[str, FinishedRequest] = OrderedDict()
        self.conversations: dict[str, ConversationRecord] = {}

    def conversation(self, conversation_id: str) -> ConversationRecord:
        """The conversation's record, or EngineError: unknown, or lost with no replica left."""
        record = self.conversations.get(conversation_id)
        if record is None:
            raise EngineError(f"no conversation {conversation_id!r}")
        if record.replica < 0:
            raise EngineError(f"conversation {conversation_id!r} was lost with its replica and no replica is left")
        return record

    def remember(self, rec: LiveRequest, replica: int) -> None:
        """Under the lock: ``rec`` ended on ``replica``; its conversation (if any) holds its answer."""
        self.recent[rec.request_id] = FinishedRequest(replica, rec.conversation, rec.conversation_base, rec.offset)
        conversation = self.conversations.get(rec.conversation) if rec.conversation else None
        if conversation is not None:
            conversation.tokens[rec.conversation_base:] = rec.output
        while len(self.recent) > RECENT_FINISHED:
            self.recent.popitem(last=False)

    def on_replica(self, index: int) -> list[LiveRequest]:
        """The requests running on replica ``index``."""
        return [rec for rec in list(self.live.values()) if rec.replica == index]
