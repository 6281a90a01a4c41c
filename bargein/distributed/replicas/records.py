"""The head's records of the replica set, in one store with one lock.

- :class:`LiveRequest`: a request in flight: its owning replica (the router's route),
  prompt, params, deadline and the output tokens received so far. A
  cancel (by id, disconnect, deadline on the head, shutdown) reads the owner here and
  goes to that replica only: no broadcast, no lookup that can miss.
- :class:`FinishedRequest`: a request that ended, remembered so a late cancel answers
  "already finished" and still cuts a conversation to what its consumer was handed.
- :class:`ConversationRecord`: a conversation pinned to the replica that holds its K/V,
  with the head's copy of its tokens, so a lost replica's conversations are opened
  again elsewhere.

Which ids are in use and how each request's outcome was claimed (by a cancel, or by the
end its consumer found) is the engine's own :class:`~bargein.engine.request_ids.RequestIds`
(``RecordStore.ids``): one claim-once memory, on one machine and on replicas alike.

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
from bargein.engine.request_ids import RequestIds
from bargein.engine.sampling import SamplingParams
from bargein.engine.streams import RequestStream

RECENT_FINISHED = 4096  # finished ids remembered (an abort of one answers "already finished")


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
    """Live and recently finished requests and conversations, under one lock; their ids'
    outcome claims in ``ids`` (lock-free, see the module doc)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.ids = RequestIds(memory=RECENT_FINISHED)
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
        """Under the lock: ``rec`` ended on ``replica`` (its final delta is being pushed; it
        is no longer live): its id may be used again; its conversation (if any) holds its answer."""
        self.ids.release(rec.request_id)
        self.recent[rec.request_id] = FinishedRequest(replica, rec.conversation, rec.conversation_base, rec.offset)
        conversation = self.conversations.get(rec.conversation) if rec.conversation else None
        if conversation is not None:
            conversation.tokens[rec.conversation_base:] = rec.output
        while len(self.recent) > RECENT_FINISHED:
            self.recent.popitem(last=False)

    def claimed(self, request_id: str) -> bool:
        """Whether the request's outcome is claimed (a cancel, or the end its consumer found):
        from then on its ``output`` is what was delivered, and later tokens are not kept."""
        return self.ids.cancel_claim(request_id) is not None or self.ids.end_claimed(request_id)

    def on_replica(self, index: int) -> list[LiveRequest]:
        """The requests running on replica ``index``."""
        return [rec for rec in list(self.live.values()) if rec.replica == index]
