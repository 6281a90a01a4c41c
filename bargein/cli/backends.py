"""The two backends that answer ``bargein chat`` and ``bargein run``.

- :class:`LocalBackend` drives an engine :class:`~bargein.engine.conversation.Conversation`.
  Each turn renders the whole history with the model's chat template and prompts the
  conversation with only the text beyond what its tokens already hold, so the K/V of
  earlier turns, a partial answer included, is reused and never recomputed. After a stop
  the template's closing tokens (``<|im_end|>\\n``) are simply part of the next suffix.
- :class:`RemoteBackend` streams ``/v1/chat/completions`` from a server with the full
  history and an ``X-Request-Id`` of its own, which it cancels on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from bargein.cli.client import BargeinClient, ClientError, StreamEvent
from bargein.engine.continuation import KnownText, continue_text

if TYPE_CHECKING:  # the engine (torch) loads only for local chat
    from bargein.engine.client import EngineClient


@dataclass(frozen=True)
class GenerationSettings:
    max_tokens: int | None = 512
    temperature: float = 0.7
    json_schema: str | None = None  # a JSON Schema (text) the answer must match


@dataclass(frozen=True)
class AnswerResult:
    """One answer: its text, why it ended, and what it cost."""

    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    completion_tokens: int
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None
    decode_s: float | None = None  # first token to last

    @property
    def tokens_per_s(self) -> float | None:
        if not self.decode_s or self.completion_tokens < 2:
            return None
        return (self.completion_tokens - 1) / self.decode_s


class AnswerError(Exception):
    """An answer could not be produced (bad request, context full, server error); one line."""


OnDelta = Callable[[str], None]


class Backend(Protocol):
    model_name: str
    where: str

    async def answer(self, messages: list[dict[str, str]], settings: GenerationSettings,
                     on_delta: OnDelta) -> AnswerResult: ...
    async def answer_raw(self, prompt: str, settings: GenerationSettings, on_delta: OnDelta) -> AnswerResult: ...
    def cancel(self) -> None: ...
    async def sync(self, messages: list[dict[str, str]]) -> None: ...
    def num_tokens(self) -> int | None: ...
    async def state(self) -> dict[str, Any]: ...
    async def prompt_progress(self) -> tuple[int, int] | None: ...
    async def restore(self, data: dict[str, Any]) -> None: ...
    async def close(self) -> None: ...


class _Timer:
    """Time to first token and decode time of one answer."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None

    def token(self) -> None:
        now = time.monotonic()
        self.first = self.first or now
        self.last = now

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.started

    @property
    def decode_s(self) -> float | None:
        return None if self.first is None or self.last is None else self.last - self.first


# -- local: the engine's conversation API ----------------------------------------------------
class LocalBackend:
    """One engine Conversation that follows the REPL's history token-exactly."""

    def __init__(self, client: EngineClient):
        self.ae = client
        self.tokenizer = client.tokenizer
        self.model_name = client.describe().model_name
        self.where = "locally"
        from bargein.engine.conversation import (
            Conversation,  # the engine (torch) loads only for local chat
        )

        self.conv = Conversation.open(client)
        self._stop = False
        self._num_tokens = 0  # as of the last turn, for the status line

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        from bargein.loader import LoaderError

        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except LoaderError as exc:
            raise AnswerError(f"the chat template failed: {exc} (use `bargein run --raw` for a model without one)") from None

    async def _align(self, text: str) -> str:
        """Rewinds the conversation to its longest prefix that ``text`` starts with; returns the rest.

        Usually nothing is rewound: the tokens are the history so far, and the rest is the
        new turn. After /rewind, /reset or /system the tokens that no longer match go.
        The match is the one continuation function, with the conversation as the known text.
        """
        tokens = tuple(await self.conv.tokens())
        self._num_tokens = len(tokens)

        def decode(ids: Sequence[int]) -> str:
            return self.tokenizer.decode(list(ids), skip_special_tokens=False)

        known = KnownText("", (), tokens, decode(tokens))
        cont = continue_text(text, [known], encode=lambda _: [], decode=decode)
        if cont.reused < len(tokens):
            await self.conv.rewind(len(tokens) - cont.reused)
            self._num_tokens = cont.reused
        return cont.rest_text

    async def answer(self, messages: list[dict[str, str]], settings: GenerationSettings,
                     on_delta: OnDelta) -> AnswerResult:
        suffix = await self._align(self._render(messages, add_generation_prompt=True))
        await self.conv.prompt(self.tokenizer.encode(suffix, add_special_tokens=False))
        return await self._generate(settings, on_delta)

    async def answer_raw(self, prompt: str, settings: GenerationSettings, on_delta: OnDelta) -> AnswerResult:
        await self.conv.prompt(self.tokenizer.encode(prompt))  # with the BOS the model expects, if any
        return await self._generate(settings, on_delta)

    async def _generate(self, settings: GenerationSettings, on_delta: OnDelta) -> AnswerResult:
        from bargein import EngineError, SamplingParams

        self._stop = False
        from bargein.engine.constraint import Constraint

        constraint = Constraint.json_schema(settings.json_schema) if settings.json_schema else None
        params = SamplingParams(max_tokens=settings.max_tokens, temperature=settings.temperature,
                                constraint=constraint)
        timer, last = _Timer(), None
        try:
            async for out in self.conv.generate(params):
                if self._stop:  # a Ctrl-C that came before the request existed
                    self.conv.cancel()
                if out.new_token_ids:
                    timer.token()
                if out.delta_text:
                    on_delta(out.delta_text)
                last = out
        except EngineError as exc:
            raise AnswerError(str(exc)) from None
        self._num_tokens = len(await self.conv.tokens())
        if last is None or last.finish_reason is None or last.finish_reason.value == "error":
            raise AnswerError(last.error if last is not None and last.error else "the engine failed the request")
        return AnswerResult(last.text, last.finish_reason.value, last.usage.completion_tokens,
                            last.usage.prompt_tokens, last.usage.cached_tokens, timer.ttft_s, timer.decode_s)

    def cancel(self) -> None:
        self._stop = True
        self.conv.cancel()

    async def sync(self, messages: list[dict[str, str]]) -> None:
        await self._align(self._render(messages, add_generation_prompt=False))

    def num_tokens(self) -> int | None:
        return self._num_tokens

    async def prompt_progress(self) -> tuple[int, int] | None:
        """(computed, total) prompt tokens of this conversation's request in flight, if any."""
        for info in await self.ae.requests():
            if info.session_id == self.conv.id:
                return info.prompt_computed, info.prompt_tokens
        return None

    async def state(self) -> dict[str, Any]:
        saved = await self.conv.save()
        return {"token_ids": list(saved.token_ids), "model_fingerprint": saved.model_fingerprint,
                "kv_fingerprint": saved.kv_fingerprint}

    async def restore(self, data: dict[str, Any]) -> None:
        """Continues from a saved file's tokens (their K/V is reused if still cached)."""
        from bargein.engine.conversation import Conversation, ConversationState

        if "token_ids" in data:
            state = ConversationState(tuple(int(t) for t in data["token_ids"]), str(data.get("model", "")),
                                      str(data.get("model_fingerprint", "")))
            conv = Conversation.load(self.ae, state)  # ConversationFileMismatch (a ValueError): another model's
        else:  # saved against a server: the tokens are computed with the next message
            conv = Conversation.open(self.ae)
        old, self.conv = self.conv, conv
        await old.close()
        self._num_tokens = len(await conv.tokens())

    async def close(self) -> None:
        await self.conv.close()
        await self.ae.shutdown(timeout=5.0)


# -- remote: a bargein server ------------------------------------------------------------------
def _response_format(settings: GenerationSettings) -> dict[str, Any]:
    if settings.json_schema is None:
        return {}
    schema = json.loads(settings.json_schema)
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}}


class RemoteBackend:
    """The history sent in full to ``/v1/chat/completions``; the server's prefix cache reuses K/V."""

    def __init__(self, client: BargeinClient, model_name: str):
        self.client = client
        self.model_name = model_name
        self.where = f"at {client.base_url}"
        self._request_id: str | None = None
        self._last_total: int | None = None
        self._pending_cancel: asyncio.Task | None = None

    async def answer(self, messages: list[dict[str, str]], settings: GenerationSettings,
                     on_delta: OnDelta) -> AnswerResult:
        rid = self._new_id()
        events = self.client.stream_chat(messages, request_id=rid, max_tokens=settings.max_tokens,
                                         temperature=settings.temperature, **_response_format(settings))
        return await self._consume(events, on_delta)

    async def answer_raw(self, prompt: str, settings: GenerationSettings, on_delta: OnDelta) -> AnswerResult:
        rid = self._new_id()
        events = self.client.stream_completion(prompt, request_id=rid, max_tokens=settings.max_tokens,
                                               temperature=settings.temperature, **_response_format(settings))
        return await self._consume(events, on_delta)

    def _new_id(self) -> str:
        self._request_id = f"cli-{uuid.uuid4().hex[:16]}"
        return self._request_id

    async def _consume(self, events: AsyncIterator[StreamEvent], on_delta: OnDelta) -> AnswerResult:
        timer, parts, finish, usage = _Timer(), [], None, {}
        try:
            async for event in events:
                if event.delta:
                    timer.token()
                    parts.append(event.delta)
                    on_delta(event.delta)
                finish = event.finish_reason or finish
                usage = event.usage or usage
        except ClientError as exc:
            raise AnswerError(str(exc)) from None
        finally:
            self._request_id = None
        if finish is None:
            raise AnswerError("the server ended the answer without a finish reason")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if usage:
            self._last_total = usage.get("total_tokens")
        completion = usage.get("completion_tokens", len(parts))
        return AnswerResult("".join(parts), finish, completion, usage.get("prompt_tokens"), cached,
                            timer.ttft_s, timer.decode_s)

    def cancel(self) -> None:
        if self._request_id is not None:
            self._pending_cancel = asyncio.ensure_future(self.client.acancel(self._request_id))

    async def sync(self, messages: list[dict[str, str]]) -> None:
        """Nothing to do: the server holds no state between answers."""

    def num_tokens(self) -> int | None:
        return self._last_total

    async def prompt_progress(self) -> tuple[int, int] | None:
        rid = self._request_id
        return None if rid is None else await self.client.aprompt_progress(rid)

    async def state(self) -> dict[str, Any]:
        return {}

    async def restore(self, data: dict[str, Any]) -> None:
        self._last_total = None

    async def close(self) -> None:
        if self._pending_cancel is not None:
            await self._pending_cancel


