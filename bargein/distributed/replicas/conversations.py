"""The replica set's conversations: each lives on one replica, which holds its K/V, and every
turn goes there. The head forwards each typed conversation message unchanged to that
replica and mirrors the conversation's tokens (prompts appended, answers as delivered,
forks, rewinds), so that a lost replica's conversations are opened again on another one.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from bargein.distributed.replicas.records import ConversationRecord, RecordStore
from bargein.distributed.router import Router
from bargein.engine.admission import EngineError
from bargein.engine.async_engine import EngineDeadError
from bargein.engine.messages import (
    AppendToConversation,
    CloseConversation,
    ConversationMessage,
    ForkConversation,
    OpenConversation,
    RewindConversation,
)


class ReplicaConversations:
    """Conversation operations of :class:`~bargein.distributed.replicas.facade.ReplicaSet`."""

    actors: list[Any]
    records: RecordStore
    router: Router

    def new_request_id(self) -> str:
        return f"req-{uuid.uuid4().hex[:16]}"

    # A conversation lives on one replica, which holds its K/V; every turn goes there. The
    # head mirrors its tokens (prompts appended, answers as delivered, forks, rewinds) so
    # that a lost replica's conversations are opened again on another one.
    def open_conversation(self, token_ids: Sequence[int] = ()) -> str:
        """Opens a conversation on the replica with the best prefix match (else the least
        loaded); returns its id at once (the replica opens it with the first call there)."""
        tokens = [int(t) for t in token_ids]
        conversation_id = self.new_request_id().replace("req-", "conv-")
        with self.records.lock:
            route = self.router.choose(tokens, count=False)
            if route is None:
                raise EngineDeadError("no replica is up")
            self.records.conversations[conversation_id] = ConversationRecord(route.replica, tokens)
        return conversation_id

    async def conversation(self, message: ConversationMessage) -> Any:
        """Forwards the message to the conversation's replica, as it is; keeps the head's copy."""
        cid = message.conversation_id
        match message:
            case OpenConversation():
                raise EngineError("open a conversation with open_conversation()")
            case CloseConversation():
                record = self.records.conversations.get(cid)
                if record is not None and record.replica >= 0 and not record.unopened:
                    await self._forward(message)
                self.records.conversations.pop(cid, None)
                return None
        answer = await self._forward(message)
        with self.records.lock:
            record = self.records.conversation(cid)
            match message:
                case AppendToConversation(_, token_ids):
                    record.tokens += token_ids
                case ForkConversation():  # on the same replica, sharing the K/V blocks
                    self.records.conversations[answer] = ConversationRecord(record.replica, list(record.tokens),
                                                                            unopened=False)
                case RewindConversation(_, num_tokens):
                    del record.tokens[num_tokens:]
        return answer

    async def _forward(self, message: ConversationMessage) -> Any:
        """``message`` on its conversation's replica, opened there first if it is not yet."""
        with self.records.lock:
            record = self.records.conversation(message.conversation_id)
            actor, opening = self.actors[record.replica], record.unopened
            tokens, record.unopened = tuple(record.tokens), False
        if opening:
            await actor.conversation.remote(OpenConversation(message.conversation_id, tokens))
        return await actor.conversation.remote(message)
