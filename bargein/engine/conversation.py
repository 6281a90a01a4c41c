"""Conversation: a token sequence that keeps its K/V between turns and survives any stop.

The library face of bargein, for programs that drive a model turn by turn::

    conv = engine.conversation()
    conv.prompt("<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n")
    async for out in conv.generate(SamplingParams(max_tokens=64)):
        print(out.delta_text, end="")
    conv.cancel()                      # from anywhere, at any moment

Contract (C3): ``conv.tokens`` is always exactly the prompts given plus the tokens the
caller was handed. After a cancel at any point (queued, mid-prompt, mid-answer, or the
consumer simply stopping) the conversation can at once be prompted, generated, forked,
rewound, saved or closed; K/V computed before the stop is kept, and whatever is not
computed yet is computed with the next prompt.

A Conversation is used from one asyncio task at a time; ``cancel`` may be called from
anywhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bargein.engine.request import CancelReason, RequestOutput
from bargein.engine.sampling import SamplingParams

if TYPE_CHECKING:
    import asyncio

    from bargein.engine.async_engine import AsyncEngine

_STATE_VERSION = 1


class ConversationClosed(RuntimeError):
    pass


class ConversationBusy(RuntimeError):
    """generate() was called while an earlier answer is still being consumed."""


@dataclass(frozen=True)
class ConversationState:
    """What ``save`` captures: the tokens, and the model they belong to.

    K/V is not saved: loading into an engine that still caches the prefix reuses it;
    otherwise the tokens are computed with the next prompt.
    """

    token_ids: tuple[int, ...]
    model: str

    def to_json(self) -> str:
        return json.dumps({"version": _STATE_VERSION, "model": self.model, "token_ids": list(self.token_ids)})

    @classmethod
    def from_json(cls, text: str) -> ConversationState:
        try:
            data = json.loads(text)
            if data.get("version") != _STATE_VERSION:
                raise ValueError(f"unsupported conversation file version {data.get('version')!r}")
            tokens = tuple(int(t) for t in data["token_ids"])
            return cls(tokens, str(data.get("model", "")))
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a bargein conversation file: {exc}") from None


@dataclass
class _ActiveAnswer:
    request_id: str
    stream: asyncio.Queue[RequestOutput]
    handed: int = 0  # tokens handed to the caller
    finished: bool = False


class Conversation:
    def __init__(self, engine: AsyncEngine, session_id: str, token_ids: Sequence[int]):
        self._engine = engine
        self.id = session_id
        self._tokens = list(token_ids)  # what the session holds plus what is pending
        self._pending: list[int] = []  # prompted, not yet sent to the engine
        self._active: _ActiveAnswer | None = None
        self._closed = False

    @classmethod
    def open(cls, engine: AsyncEngine, token_ids: Sequence[int] = ()) -> Conversation:
        core = engine.engine
        session_id = f"conv-{os.urandom(8).hex()}"
        tokens = [int(t) for t in token_ids]
        # Ordered inbox: this runs before anything the conversation sends later.
        engine.call_soon(lambda: core.open_session(tokens, session_id))
        return cls(engine, session_id, tokens)

    # -- state --------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    @property
    def pending_tokens(self) -> list[int]:
        """Prompted tokens not yet sent to the engine (they go with the next generate)."""
        return list(self._pending)

    @property
    def is_generating(self) -> bool:
        return self._active is not None and not self._active.finished

    def _check_open(self) -> None:
        if self._closed:
            raise ConversationClosed(f"conversation {self.id} is closed")

    # -- turns ----------------------------------------------------------------------
    def prompt(self, text_or_tokens: str | Sequence[int]) -> list[int]:
        """Appends a prompt (text is tokenized as is, special tokens included); returns its tokens."""
        self._check_open()
        if isinstance(text_or_tokens, str):
            new = self._engine.engine.tokenizer.encode(text_or_tokens, add_special_tokens=False)
        else:
            new = [int(t) for t in text_or_tokens]
        self._pending.extend(new)
        self._tokens.extend(new)
        return new

    async def generate(self, params: SamplingParams | None = None, *, timeout: float | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Streams an answer onto the conversation; stopping early cancels it (C3 holds)."""
        self._check_open()
        await self._settle()
        new, self._pending = self._pending, []
        try:
            rid, stream = self._engine.submit(new, params, request_id=request_id, timeout=timeout, session_id=self.id)
        except BaseException:
            self._pending = new + self._pending
            raise
        active = self._active = _ActiveAnswer(rid, stream)
        try:
            while True:
                out = await stream.get()
                active.finished = out.finished
                self._tokens.extend(out.new_token_ids)
                active.handed += len(out.new_token_ids)
                yield out
                if out.finished:
                    return
        finally:
            if not active.finished:
                self._engine.abort(rid, CancelReason.DISCONNECT)

    def cancel(self, reason: CancelReason = CancelReason.USER) -> bool:
        """Stops the answer being generated, if any; safe from any thread."""
        active = self._active
        if active is None or active.finished:
            return False
        self._engine.abort(active.request_id, reason)
        return True

    async def _settle(self) -> None:
        """Waits out an answer the caller stopped consuming, then trims what it was not handed."""
        active = self._active
        if active is None:
            return
        self._active = None
        if not active.finished:
            self._engine.abort(active.request_id, CancelReason.DISCONNECT)
            while not (await active.stream.get()).finished:
                pass
        expected = self._tokens[:len(self._tokens) - len(self._pending)]
        core = self._engine.engine

        def reconcile() -> list[int]:
            held = core.session_tokens(self.id)
            if len(held) > len(expected):  # sampled but never handed to the caller
                core.truncate_session(self.id, len(expected))
                held = held[:len(expected)]
            return held

        held = await self._engine.call(reconcile)
        if held != expected[:len(held)]:
            raise RuntimeError(f"conversation {self.id} diverged from its engine session")
        # A refused request never reached the session: its prompt is pending again.
        self._pending = expected[len(held):] + self._pending

    async def _sync(self) -> None:
        """Sends pending prompt tokens to the engine, after settling any answer."""
        await self._settle()
        if self._pending:
            new, self._pending = self._pending, []
            core = self._engine.engine
            await self._engine.call(lambda: core.append_session_tokens(self.id, new))

    # -- fork, rewind, save, close -------------------------------------------------
    async def fork(self) -> Conversation:
        """A new conversation with the same tokens, sharing K/V blocks (copy on write)."""
        self._check_open()
        await self._sync()
        core = self._engine.engine
        new_id = await self._engine.call(lambda: core.fork_session(self.id))
        return Conversation(self._engine, new_id, self._tokens)

    async def rewind(self, num_tokens: int) -> None:
        """Drops the last ``num_tokens`` tokens (their K/V too)."""
        self._check_open()
        if not 0 <= num_tokens <= len(self._tokens):
            raise ValueError(f"cannot rewind {num_tokens} of {len(self._tokens)} tokens")
        await self._sync()
        keep = len(self._tokens) - num_tokens
        core = self._engine.engine
        await self._engine.call(lambda: core.truncate_session(self.id, keep))
        del self._tokens[keep:]

    async def save(self, path: str | os.PathLike | None = None) -> ConversationState:
        """Captures the conversation; also writes it as JSON to ``path`` when given."""
        self._check_open()
        await self._settle()
        state = ConversationState(tuple(self._tokens), self._engine.engine.model_name)
        if path is not None:
            Path(path).write_text(state.to_json())
        return state

    async def close(self) -> None:
        """Cancels any answer and releases the conversation's blocks (to the prefix cache)."""
        if self._closed:
            return
        await self._settle()
        self._closed = True
        core = self._engine.engine
        await self._engine.call(lambda: core.close_session(self.id))


def load_state(state_or_path: ConversationState | str | os.PathLike) -> ConversationState:
    if isinstance(state_or_path, ConversationState):
        return state_or_path
    return ConversationState.from_json(Path(state_or_path).read_text())
