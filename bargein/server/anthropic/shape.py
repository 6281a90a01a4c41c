"""A Messages answer's shape: the stream's events and the message body, from one parse.

The stream, as Anthropic sends it::

    message_start   {"message": {id, type, role, content: [], model, stop_reason: null, usage}}
    ping
    content_block_start / content_block_delta* / content_block_stop    per block, in order
    message_delta   {"delta": {stop_reason, stop_sequence}, "usage": {...}}
    message_stop

``message_start`` goes out with the first output, once the prompt is read, so its usage
already says how many input tokens came from the cache. Blocks open as the answer's text
makes them: ``thinking`` (``thinking_delta``, then a ``signature_delta``), ``text``
(``text_delta``), ``tool_use`` (``input_json_delta`` pieces as the call's input is
generated). A failure is an ``error`` event in Anthropic's error shape.

``stop_reason``: ``end_turn`` (the model ended its turn), ``stop_sequence`` (with the one
that matched), ``max_tokens``, ``tool_use`` (a call was made and the answer ended by
itself), and ``cancelled`` for an answer that was stopped (a cancel by id, a disconnect,
a deadline, the server's shutdown), with the reason in ``cancel_reason``: an extension, as
``finish_reason: "cancelled"`` is on the OpenAI API. Usage counts as Anthropic does:
``input_tokens`` the prompt tokens computed, ``cache_read_input_tokens`` those whose K/V
was reused, ``output_tokens`` the answer's.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from bargein.engine.request import CancelReason, FinishReason, RequestOutput, Usage
from bargein.server.error_shapes import anthropic_payload
from bargein.server.generation import Job, Slot
from bargein.server.openai_format import cancel_fields
from bargein.server.openai_stream import final_or_raise
from bargein.server.reasoning import (
    AnswerEvent,
    AnswerParser,
    ReasoningDelta,
    Thinking,
    parse_answer,
)
from bargein.server.sse import named_event
from bargein.server.tools import ArgumentsDelta, CallEnd, CallStart, ToolCall, ToolSyntax

STOP_TAIL_TOKENS = 300  # tokens decoded to find which stop sequence matched (one is at most 256 characters)


def usage_fields(usage: Usage) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens, "output_tokens": usage.completion_tokens}


def signature(thought: str) -> str:
    """The thinking block's ``signature``: a digest of its text (clients send it back; unchecked)."""
    return hashlib.sha256(thought.encode("utf-8", "surrogatepass")).hexdigest()


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class MessagesShape:
    """One Messages answer (``n`` is always 1), streamed or as a body."""

    def __init__(self, message_id: str, model: str, tokenizer: Any, *, eos_token_ids: frozenset[int],
                 stop_sequences: Sequence[str], thinking: Thinking | None, tool_names: set[str] | None,
                 syntax: ToolSyntax):
        self.message_id = message_id
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.stop_sequences = tuple(stop_sequences)
        self.thinking = thinking
        self.tool_names = tool_names
        self.syntax = syntax
        self.parser = AnswerParser(thinking, tool_names, syntax, tokenizer)
        self.started = False
        self.block: str | None = None  # the open block's kind
        self.index = -1  # the open (or last) block's index
        self.thought = ""  # the open thinking block's text, for its signature
        self.tool_ids: dict[int, str] = {}  # call index -> tool_use id

    # -- the stream ---------------------------------------------------------------------
    def observe(self, slot: Slot, out: RequestOutput) -> None:
        pass

    def opening(self, slots: list[Slot]) -> Iterable[str]:
        return ()

    def _start(self, usage: Usage) -> Iterable[str]:
        if not self.started:
            self.started = True
            message = {**self._message([]), "usage": {**usage_fields(usage), "output_tokens": 0}}
            yield named_event("message_start", {"type": "message_start", "message": message})
            yield named_event("ping", {"type": "ping"})

    def content(self, slot: Slot, out: RequestOutput) -> Iterable[str]:
        yield from self._start(out.usage)
        for event in self.parser.feed(out.delta_text, final=out.finished, token_ids=out.new_token_ids):
            yield from self._event(event)

    def _event(self, event: AnswerEvent) -> Iterable[str]:
        if isinstance(event, ReasoningDelta):
            yield from self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.thought += event.text
            yield self._delta({"type": "thinking_delta", "thinking": event.text})
        elif isinstance(event, str):
            yield from self._open("text", {"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": event})
        elif isinstance(event, CallStart):
            self.tool_ids[event.call.index] = tool_use_id()
            yield from self._close()
            yield from self._open("tool_use", {"type": "tool_use", "id": self.tool_ids[event.call.index],
                                               "name": event.call.name, "input": {}})
        elif isinstance(event, ArgumentsDelta):
            yield self._delta({"type": "input_json_delta", "partial_json": event.text})
        elif isinstance(event, CallEnd):
            yield from self._close()

    def _open(self, kind: str, block: dict[str, Any]) -> Iterable[str]:
        if self.block == kind:
            return
        yield from self._close()
        self.block, self.index = kind, self.index + 1
        yield named_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> str:
        return named_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _close(self) -> Iterable[str]:
        if self.block is None:
            return
        if self.block == "thinking":
            yield self._delta({"type": "signature_delta", "signature": signature(self.thought)})
            self.thought = ""
        yield named_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.block = None

    def final(self, slot: Slot, out: RequestOutput) -> Iterable[str]:
        yield from self._start(out.usage)
        yield from self._close()
        reason, sequence = self.stop_reason(out, bool(self.parser.calls))
        yield named_event("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": reason, "stop_sequence": sequence,
                                                      **cancel_fields(out)},
                                            "usage": usage_fields(out.usage)})

    def error(self, slot: Slot, out: RequestOutput) -> Iterable[str]:
        yield named_event("error", anthropic_payload(out.error or "generation failed", 500))

    def closing(self, usage: dict[str, Any]) -> Iterable[str]:
        if self.started:
            yield named_event("message_stop", {"type": "message_stop"})

    def closed(self, reason: CancelReason) -> None:
        pass

    # -- the body -------------------------------------------------------------------------
    def body(self, job: Job) -> dict[str, Any]:
        [slot] = job.slots
        final = final_or_raise(job, slot)
        parsed = parse_answer(final.text, self.thinking, self.tool_names, self.syntax, self.tokenizer, final.token_ids)
        reason, sequence = self.stop_reason(final, bool(parsed.calls))
        return {**self._message(self.blocks(parsed)), "stop_reason": reason, "stop_sequence": sequence,
                **cancel_fields(final), "usage": usage_fields(final.usage)}

    def blocks(self, parsed: AnswerParser) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = []
        if parsed.reasoning:
            blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": signature(parsed.reasoning)})
        if parsed.text or not (blocks or parsed.calls):
            blocks.append({"type": "text", "text": parsed.text})
        blocks += [self._tool_use(call) for call in parsed.calls]
        return blocks

    @staticmethod
    def _tool_use(call: ToolCall) -> dict[str, Any]:
        try:
            arguments = json.loads(call.arguments) if call.arguments else {}
        except json.JSONDecodeError:  # cut short (max_tokens, a cancel): what was written, unparsed
            arguments = {"_partial_json": call.arguments}
        return {"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": arguments}

    def _message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": None, "stop_sequence": None}

    def stop_reason(self, out: RequestOutput, called: bool) -> tuple[str, str | None]:
        """Anthropic's ``stop_reason`` and ``stop_sequence`` for a final output."""
        if out.finish_reason == FinishReason.CANCELLED:
            return "cancelled", None
        if out.finish_reason == FinishReason.LENGTH:
            return "max_tokens", None
        if called:
            return "tool_use", None
        if not self.stop_sequences or (out.token_ids and out.token_ids[-1] in self.eos_token_ids):
            return "end_turn", None
        return "stop_sequence", self._matched(out.token_ids)

    def _matched(self, token_ids: Sequence[int]) -> str | None:
        """The stop sequence that ended the answer: the one ending latest in its last tokens."""
        tail = self.tokenizer.decode(list(token_ids[-STOP_TAIL_TOKENS:]), skip_special_tokens=False)
        found = [(tail.rfind(s) + len(s), -i, s) for i, s in enumerate(self.stop_sequences) if s in tail]
        return max(found)[2] if found else None
