"""Conversation: a token sequence that keeps its K/V between turns and survives any stop.

The library face of bargein, for programs that drive a model turn by turn::

    conv = Conversation.open(engine)
    await conv.prompt("<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n")
    async for out in conv.generate(SamplingParams(max_tokens=64)):
        print(out.delta_text, end="")
    conv.cancel()                      # from anywhere, at any moment

Contract (C3): ``await conv.tokens()`` is always exactly the prompts given plus the
tokens the caller was handed. After a cancel at any point (queued, mid-prompt,
mid-answer, or the consumer simply stopping) the conversation can at once be prompted,
generated, forked, rewound, saved or closed; K/V computed before the stop is kept, and
whatever is not computed yet is computed with the next prompt.

A Conversation is a handle on an engine's conversation and keeps no copy of its tokens:
the engine's scheduler holds them, and this class only sends the typed conversation
messages of :mod:`bargein.engine.messages` through an
:class:`~bargein.engine.client.EngineClient` (one engine, or replicas). An answer's
consumer tells the engine how many tokens it was handed when it stops early, and the
engine cuts the conversation to them.

A constrained answer (``params.constraint``) that was cancelled or cut by
``max_tokens`` is continued, not restarted, by the next ``generate`` with the same
constraint and no prompt in between: the engine replays the answer's tokens into a new
grammar matcher, so the result is one valid answer, token for token the one an
uninterrupted run gives (greedy). A prompt, a rewind or another constraint starts anew.

A Conversation is used from one asyncio task at a time; ``cancel`` may be called from
anywhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bargein.engine.admission import encode_prompt
from bargein.engine.client import EngineClient, EngineInfo
from bargein.engine.constraint import Constraint
from bargein.engine.messages import (
    AppendToConversation,
    CloseConversation,
    ConversationTokens,
    ForkConversation,
    RewindConversation,
)
from bargein.engine.request import CancelReason, FinishReason, RequestOutput
from bargein.engine.sampling import SamplingParams
from bargein.engine.streams import RequestStream

# 2: the model's fingerprint (its files' digest) and the disk tier's; 1 (no fingerprint,
# checked by model name only) still loads.
_STATE_VERSION = 2
_READABLE_VERSIONS = (1, 2)


class ConversationClosed(RuntimeError):
    pass


class ConversationBusy(RuntimeError):
    """generate() was called while an earlier answer is still being consumed."""


class ConversationFileMismatch(ValueError):
    """A saved conversation belongs to another model than the engine's: its token ids
    would mean other text there, so it is refused rather than continued."""


@dataclass(frozen=True)
class ConversationState:
    """What ``save`` captures: the tokens, and the model they belong to (its name, the
    digest of its files, and the disk tier's fingerprint when the engine had one).

    K/V is not saved: loading into an engine that still caches the prefix, in memory or
    on its disk tier, reuses it; otherwise the tokens are computed with the next prompt.
    """

    token_ids: tuple[int, ...]
    model: str
    model_fingerprint: str = ""  # EngineInfo.model_fingerprint ("": unknown)
    kv_fingerprint: str = ""  # EngineInfo.kv_fingerprint ("": no disk tier)

    def to_json(self) -> str:
        return json.dumps({"version": _STATE_VERSION, "model": self.model,
                           "model_fingerprint": self.model_fingerprint, "kv_fingerprint": self.kv_fingerprint,
                           "token_ids": list(self.token_ids)})

    @classmethod
    def from_json(cls, text: str) -> ConversationState:
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or "token_ids" not in data:
                raise ValueError("no token_ids")
            if data.get("version") not in _READABLE_VERSIONS:
                raise ValueError(f"format version {data.get('version')!r}; this bargein reads "
                                 f"{', '.join(map(str, _READABLE_VERSIONS))}")
            tokens = tuple(int(t) for t in data["token_ids"])
            return cls(tokens, str(data.get("model", "")), str(data.get("model_fingerprint", "")),
                       str(data.get("kv_fingerprint", "")))
        except (KeyError, TypeError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"not a usable bargein conversation file: {exc}") from None

    def check_model(self, info: EngineInfo) -> None:
        """Raises ConversationFileMismatch unless this state belongs to ``info``'s model:
        by the files' digest when both are known, else by the model's name."""
        if self.model_fingerprint and info.model_fingerprint:
            if self.model_fingerprint != info.model_fingerprint:
                raise ConversationFileMismatch(
                    f"the conversation was saved with another model ({self.model!r}, fingerprint "
                    f"{self.model_fingerprint[:16]}) than this engine's ({info.model_name!r}, fingerprint "
                    f"{info.model_fingerprint[:16]}): its token ids would be other text here")
        elif self.model and self.model != info.model_name:
            raise ConversationFileMismatch(f"the conversation was saved with model {self.model!r}, "
                                           f"not {info.model_name!r}")


@dataclass
class _Answer:
    request_id: str
    stream: RequestStream


@dataclass
class _ConstrainedAnswer:
    """The last answer, if constrained: where it began, and whether it may go on."""

    constraint: Constraint
    start: int | None = None  # the conversation's length when it began (its prompt_tokens)
    complete: bool = False  # ended with "stop": its grammar is done


class Conversation:
    def __init__(self, engine: EngineClient, conversation_id: str):
        self._engine = engine
        self.id = conversation_id
        self._answer: _Answer | None = None  # the last answer, until the engine has ended it
        self._closed = False
        self._constrained: _ConstrainedAnswer | None = None

    @classmethod
    def open(cls, engine: EngineClient, token_ids: Sequence[int] = ()) -> Conversation:
        """A new conversation holding ``token_ids`` (computed with the first answer)."""
        return cls(engine, engine.open_conversation(token_ids))

    @classmethod
    def load(cls, engine: EngineClient, state: ConversationState | str | os.PathLike) -> Conversation:
        """A conversation from ``save()``'s state or the file it wrote (K/V reused if still cached)."""
        loaded = load_state(state)
        loaded.check_model(engine.describe())
        return cls.open(engine, loaded.token_ids)

    # -- state --------------------------------------------------------------------
    async def tokens(self) -> list[int]:
        """Exactly the prompts given plus the tokens handed, as the engine holds them."""
        self._check_open()
        await self._settle()
        return await self._engine.conversation(ConversationTokens(self.id))

    @property
    def is_generating(self) -> bool:
        return self._answer is not None and not self._answer.stream.processor.finished

    def _check_open(self) -> None:
        if self._closed:
            raise ConversationClosed(f"conversation {self.id} is closed")

    # -- turns ----------------------------------------------------------------------
    async def prompt(self, text_or_tokens: str | Sequence[int]) -> list[int]:
        """Appends a prompt (text is tokenized as is, special tokens included); returns its tokens.

        Raises EngineError if the conversation would not fit the context.
        """
        self._check_open()
        if isinstance(text_or_tokens, str):
            new = encode_prompt(self._engine.tokenizer, text_or_tokens, in_conversation=True)
        else:
            new = [int(t) for t in text_or_tokens]
        await self._settle()
        await self._engine.conversation(AppendToConversation(self.id, tuple(new)))
        self._constrained = None
        return new

    async def generate(self, params: SamplingParams | None = None, *, timeout: float | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Streams an answer onto the conversation; stopping early cancels it (C3 holds)."""
        self._check_open()
        await self._settle()
        constraint = params.constraint if params is not None else None
        last = self._constrained
        resume = (constraint is not None and last is not None and last.constraint == constraint
                  and last.start is not None and not last.complete)
        rid, stream = self._engine.submit((), params, request_id=request_id, timeout=timeout, conversation_id=self.id,
                                          constraint_from=last.start if resume else None)
        self._answer = _Answer(rid, stream)
        if constraint is None:
            self._constrained = None
        elif not resume:
            self._constrained = _ConstrainedAnswer(constraint)
        async for out in self._engine.stream(rid, stream):
            if self._constrained is not None:
                if self._constrained.start is None:
                    self._constrained.start = out.usage.prompt_tokens
                self._constrained.complete = out.finish_reason == FinishReason.STOP
            yield out

    def cancel(self, reason: CancelReason = CancelReason.USER) -> bool:
        """Stops the answer being generated, if any; safe from any thread."""
        answer = self._answer
        if answer is None or answer.stream.processor.finished:
            return False
        self._engine.abort(answer.request_id, reason)
        return True

    async def _settle(self) -> None:
        """Waits until the engine has ended the last answer, first telling it (if the
        caller stopped consuming without closing the answer) how many tokens were handed."""
        answer, self._answer = self._answer, None
        if answer is None:
            return
        if not answer.stream.processor.finished:
            self._engine.abort(answer.request_id, CancelReason.DISCONNECT,
                               delivered=answer.stream.processor.num_delivered)
        while not answer.stream.engine_finished:
            await answer.stream.next_delta()

    # -- fork, rewind, save, close -------------------------------------------------
    async def fork(self) -> Conversation:
        """A new conversation with the same tokens, sharing K/V blocks (copy on write)."""
        self._check_open()
        await self._settle()
        return Conversation(self._engine, await self._engine.conversation(ForkConversation(self.id)))

    async def rewind(self, num_tokens: int) -> None:
        """Drops the last ``num_tokens`` tokens (their K/V too)."""
        held = len(await self.tokens())
        if not 0 <= num_tokens <= held:
            raise ValueError(f"cannot rewind {num_tokens} of {held} tokens")
        await self._engine.conversation(RewindConversation(self.id, held - num_tokens))
        self._constrained = None

    async def save(self, path: str | os.PathLike | None = None) -> ConversationState:
        """Captures the conversation; also writes it as JSON to ``path`` when given."""
        info = self._engine.describe()
        state = ConversationState(tuple(await self.tokens()), info.model_name, info.model_fingerprint,
                                  info.kv_fingerprint)
        if path is not None:
            Path(path).write_text(state.to_json())
        return state

    async def close(self) -> None:
        """Cancels any answer and releases the conversation's blocks (to the prefix cache)."""
        if self._closed:
            return
        await self._settle()
        self._closed = True
        await self._engine.conversation(CloseConversation(self.id))


def load_state(state_or_path: ConversationState | str | os.PathLike) -> ConversationState:
    if isinstance(state_or_path, ConversationState):
        return state_or_path
    return ConversationState.from_json(Path(state_or_path).read_text())
