"""Ollama's answers: NDJSON lines as the answer streams, or one object at its end.

Every line is one JSON object and a newline. ``/api/chat`` lines carry ``message``
(``role``, ``content``, and ``thinking`` / ``tool_calls`` when there are some),
``/api/generate`` lines ``response`` (and ``thinking``). Tool calls go out whole, in the
line where the call's end arrives, as Ollama sends them (``{"function": {"name",
"arguments": {...}}}``). The last line has ``done: true``, ``done_reason`` (``stop``,
``length``, or ``cancelled`` with ``cancel_reason`` for a stopped answer: an extension)
and the counts and durations (nanoseconds) Ollama reports; ``/api/generate``'s also has
``context``, the prompt and answer token ids, which a next request may send back to
continue from them exactly. A failure is a line ``{"error": "..."}``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from bargein.engine.request import CancelReason, FinishReason, RequestOutput
from bargein.server.generation import Job, Slot
from bargein.server.openai_format import cancel_fields
from bargein.server.openai_stream import final_or_raise
from bargein.server.reasoning import AnswerParser, ReasoningDelta, Thinking, parse_answer
from bargein.server.tools import CallEnd, ToolCall, ToolSyntax

NDJSON = "application/x-ndjson"


def line(payload: dict[str, Any]) -> str:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False) + "\n"


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def tool_call(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments) if call.arguments else {}
    except json.JSONDecodeError:  # cut short (num_predict, a cancel): what was written, unparsed
        arguments = {"_partial_json": call.arguments}
    return {"function": {"name": call.name, "arguments": arguments}}


class OllamaShape:
    """One ``/api/chat`` (``chat``) or ``/api/generate`` answer, streamed or as one object."""

    def __init__(self, model: str, *, chat: bool, received: float, thinking: Thinking | None,
                 tool_names: set[str] | None, syntax: ToolSyntax, tokenizer: Any = None):
        self.model = model
        self.chat = chat
        self.received = received
        self.thinking = thinking
        self.tool_names = tool_names
        self.syntax = syntax
        self.tokenizer = tokenizer  # tells control-token markers from their text (control_markers)
        self.parser = AnswerParser(thinking, tool_names, syntax, tokenizer)
        self.first_output: float | None = None  # when the prompt had been read

    def _line(self, text: str = "", thought: str = "", calls: list[ToolCall] = (), **extra: Any) -> str:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thought:
                message["thinking"] = thought
            if calls:
                message["tool_calls"] = [tool_call(c) for c in calls]
            return line({"model": self.model, "created_at": now_iso(), "message": message, **extra})
        thinking = {"thinking": thought} if thought else {}
        return line({"model": self.model, "created_at": now_iso(), "response": text, **thinking, **extra})

    def observe(self, slot: Slot, out: RequestOutput) -> None:
        if self.first_output is None:
            self.first_output = time.monotonic()

    def opening(self, slots: list[Slot]) -> Iterable[str]:
        return ()

    def content(self, slot: Slot, out: RequestOutput) -> Iterable[str]:
        for event in self.parser.feed(out.delta_text, final=out.finished, token_ids=out.new_token_ids):
            if isinstance(event, str):
                yield self._line(event, done=False)
            elif isinstance(event, ReasoningDelta):
                yield self._line(thought=event.text, done=False)
            elif isinstance(event, CallEnd):
                yield self._line(calls=[self.parser.calls[event.index]], done=False)

    def final(self, slot: Slot, out: RequestOutput) -> Iterable[str]:
        cut = [call for call in self.parser.calls if not call.done]  # cut short: they go with the last line
        yield self._line(calls=cut, **self._done(out))

    def _done(self, out: RequestOutput) -> dict[str, Any]:
        now = time.monotonic()
        first = self.first_output or now
        reason = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(out.finish_reason, "cancelled")
        done: dict[str, Any] = {
            "done": True, "done_reason": reason, **cancel_fields(out),
            "total_duration": _ns(now - self.received), "load_duration": 0,
            "prompt_eval_count": out.usage.prompt_tokens - out.usage.cached_tokens,
            "prompt_eval_duration": _ns(first - self.received),
            "eval_count": out.usage.completion_tokens, "eval_duration": _ns(now - first)}
        if not self.chat:
            done["context"] = [*out.prompt_token_ids, *out.token_ids]
        return done

    def error(self, slot: Slot, out: RequestOutput) -> Iterable[str]:
        yield line({"error": out.error or "generation failed"})

    def closing(self, usage: dict[str, Any]) -> Iterable[str]:
        return ()

    def body(self, job: Job) -> dict[str, Any]:
        [slot] = job.slots
        final = final_or_raise(job, slot)
        parsed = parse_answer(final.text, self.thinking, self.tool_names, self.syntax, self.tokenizer, final.token_ids)
        return json.loads(self._line(parsed.text, parsed.reasoning, parsed.calls, **self._done(final)))

    def closed(self, reason: CancelReason) -> None:
        pass


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))
