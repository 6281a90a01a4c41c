"""Stored Responses API objects, bounded (least recently used goes first).

A :class:`StoredResponse` keeps what a follow-up needs to continue token-exactly: the
messages its prompt was rendered from, its prompt token ids and its output token ids.
It is updated from the engine's outputs as they arrive, by whichever task consumes
them (a stream, a non-streaming wait, or a background task), and ``done`` is set once
its final status is known.

Each stored response belongs to the tenant that created it: ``get`` and ``pop`` with a
tenant see only that tenant's, so another tenant's id reads as unknown. An id is stored
once: ``put`` never replaces another object under the same id (``ResponseIdTaken``).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from bargein.engine.request import CancelReason, FinishReason, RequestOutput
from bargein.server.reasoning import AnswerEvent, AnswerParser
from bargein.server.tool_syntax_xml import XmlToolCallParser
from bargein.server.tools import CallStart, ToolCall, ToolCallParser

FINAL_STATUSES = frozenset({"completed", "incomplete", "cancelled", "failed"})


@dataclass
class StoredResponse:
    id: str
    model: str
    prompt_messages: list[dict[str, Any]]  # what the prompt was rendered from, instructions included
    conversation: list[dict[str, Any]]  # the same without the instructions (carried to follow-ups)
    prompt_token_ids: list[int]  # a continued answer's earlier part included (from answer_start on)
    instructions: str | None = None
    previous_response_id: str | None = None
    background: bool = False
    store: bool = True
    params: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, max_output_tokens
    metadata: dict[str, Any] = field(default_factory=dict)
    user: str | None = None
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})  # the request's text.format
    template_tools: list[dict[str, Any]] | None = None  # tools the chat template rendered itself
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # the template's switches (enable_thinking)
    reasoning_effort: str | None = None  # the request's reasoning.effort, echoed
    tools: list[dict[str, Any]] = field(default_factory=list)  # the request's tools and tool_choice, echoed
    tool_choice: Any = "auto"
    order: list[int | None] = field(default_factory=list)  # output items as they appeared: None message, i call i
    # The answer's text -> thoughts (a template that marks thinking: a reasoning item), content
    # and, with tools offered, function calls (reasoning.AnswerParser, built by the route).
    answer: AnswerParser = field(default_factory=lambda: AnswerParser(None, None))
    tokenizer: Any = field(default=None, repr=False)  # with thoughts: counts their tokens in usage
    reasoning: str = ""  # the thoughts so far (the reasoning item, first of the output when not empty)
    answer_start: int | None = None  # continuing an answer: where in prompt_token_ids that answer began
    return_token_ids: bool = False  # the extension: the exact prompt and output token ids in the object
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    usage: dict[str, Any] | None = None
    cancel_reason: CancelReason | None = None
    error: str | None = None
    incomplete_reason: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    tenant: str = ""  # the creator's Tenant name: only it reads, continues or cancels this response

    def _reasoning_tokens(self, final: RequestOutput) -> int:
        if self.answer.splitter is None or self.tokenizer is None:
            return 0
        return self.answer.thought_tokens(self.tokenizer, final.token_ids)

    @property
    def message_id(self) -> str:
        return "msg_" + self.id.removeprefix("resp_")

    @property
    def answer_token_ids(self) -> list[int]:
        """The whole answer: a continued answer's earlier part (in the prompt), then the output."""
        start = len(self.prompt_token_ids) if self.answer_start is None else self.answer_start
        return self.prompt_token_ids[start:] + self.output_token_ids

    @property
    def question_token_ids(self) -> list[int]:
        """The prompt up to where the answer began (the rendered conversation)."""
        return self.prompt_token_ids[:self.answer_start]

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATUSES

    @property
    def calls(self) -> ToolCallParser | XmlToolCallParser | None:
        """The answer's call parser (tools offered), or None."""
        return self.answer.tools

    def apply(self, out: RequestOutput) -> list[AnswerEvent]:
        """Takes in one engine output: deltas as they come, the cumulative fields at the end.
        Returns what it added, in order: thoughts, content text, and with tools offered the
        function calls' events."""
        events = self.answer.feed(out.delta_text, final=out.finished, token_ids=out.new_token_ids)
        self.reasoning = self.answer.reasoning
        if self.items_open_as_they_come:
            for event in events:
                if isinstance(event, CallStart):
                    self.order.append(event.call.index)
                elif isinstance(event, str) and None not in self.order:
                    self.order.append(None)
        plain = not self.items_open_as_they_come  # no thoughts, no tools: the text as it came
        self.text = out.text if plain and out.finished else self.answer.text
        if out.finished:
            self.output_token_ids = list(out.token_ids)
        else:
            self.output_token_ids.extend(out.new_token_ids)
        if self.status == "queued" and (out.new_token_ids or out.finished):
            self.status = "in_progress"
        if not out.finished:
            return events
        self.prompt_token_ids = list(out.prompt_token_ids) or self.prompt_token_ids
        u = out.usage
        # cache_write_tokens: the prompt tokens computed here, whose K/V the prefix cache keeps
        details = {"cached_tokens": u.cached_tokens, "cache_write_tokens": u.prompt_tokens - u.cached_tokens}
        self.usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": details,
                      "output_tokens": u.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(out)},
                      "total_tokens": u.total_tokens}
        if out.finish_reason == FinishReason.STOP:
            self.status = "completed"
        elif out.finish_reason == FinishReason.LENGTH:
            self.status, self.incomplete_reason = "incomplete", "max_output_tokens"
        elif out.finish_reason == FinishReason.CANCELLED:
            self.status, self.cancel_reason = "cancelled", out.cancel_reason or CancelReason.USER
        else:
            self.status, self.error = "failed", out.error or "generation failed"
        self.done.set()
        return events

    def fail(self, message: str) -> None:
        if not self.is_final:
            self.status, self.error = "failed", message
        self.done.set()

    def message_item(self) -> dict[str, Any]:
        status = {"completed": "completed", "in_progress": "in_progress", "queued": "in_progress"}
        return {"type": "message", "id": self.message_id, "status": status.get(self.status, "incomplete"),
                "role": "assistant",
                "content": [{"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}]}

    @property
    def items_open_as_they_come(self) -> bool:
        """Output items appear in ``order`` (tools offered, or thoughts first)."""
        return self.answer.tools is not None or self.answer.splitter is not None

    def reasoning_item(self) -> dict[str, Any]:
        done = self.is_final or bool(self.order)  # the thought ended: an answer began after it
        return {"type": "reasoning", "id": "rs_" + self.id.removeprefix("resp_"), "summary": [],
                "content": [{"type": "reasoning_text", "text": self.reasoning}],
                "status": "completed" if done else "in_progress"}

    def function_call_item(self, call: ToolCall) -> dict[str, Any]:
        status = "completed" if call.done else ("in_progress" if not self.is_final else "incomplete")
        return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
                "name": call.name, "arguments": call.arguments, "status": status}

    def output(self) -> list[dict[str, Any]]:
        """The output items: the reasoning item (when there were thoughts), then the
        message; with tools offered, the message (if the answer has text) and the function
        calls, in the order they appeared."""
        items = [self.reasoning_item()] if self.reasoning else []
        if not self.order:
            return items + ([self.message_item()] if self.text or self.is_final else [])
        assert self.calls is not None or self.order == [None]
        return items + [self.message_item() if i is None else self.function_call_item(self.calls.calls[i])
                        for i in self.order]

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "background": self.background, "model": self.model,
            "output": self.output(),
            "error": {"code": "server_error", "message": self.error} if self.error else None,
            "incomplete_details": _incomplete(self),
            "instructions": self.instructions, "previous_response_id": self.previous_response_id,
            "max_output_tokens": self.params.get("max_output_tokens"),
            "temperature": self.params.get("temperature"), "top_p": self.params.get("top_p"),
            "parallel_tool_calls": False, "tool_choice": self.tool_choice, "tools": self.tools, "truncation": "disabled",
            "text": {"format": self.text_format}, "store": self.store, "metadata": self.metadata,
            "user": self.user, "usage": self.usage, "reasoning": {"effort": self.reasoning_effort, "summary": None},
        }
        if self.cancel_reason is not None:
            body["cancel_reason"] = self.cancel_reason.value
        if self.return_token_ids:
            body["prompt_token_ids"], body["token_ids"] = list(self.prompt_token_ids), list(self.output_token_ids)
        return body


def _incomplete(r: StoredResponse) -> dict[str, str] | None:
    # A cancelled response says so in ``status`` (and why in ``cancel_reason``); OpenAI's
    # incomplete_details.reason knows only max_output_tokens and content_filter.
    return {"reason": r.incomplete_reason} if r.incomplete_reason else None


class ResponseIdTaken(Exception):
    """A response with this id is already stored."""


class ResponseStore:
    """Responses by id; at most ``capacity``, dropping the least recently used finished one."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._items

    def put(self, response: StoredResponse) -> None:
        """Stores ``response``; raises ResponseIdTaken if another one has its id."""
        if self._items.get(response.id, response) is not response:
            raise ResponseIdTaken(response.id)
        self._items[response.id] = response
        self._items.move_to_end(response.id)
        for key in list(self._items):
            if len(self._items) <= self.capacity:
                break
            if self._items[key].is_final:  # a live one stays until it finishes
                del self._items[key]

    def get(self, response_id: str, tenant: str | None = None) -> StoredResponse | None:
        """The response, if stored (and, with ``tenant``, that tenant's)."""
        response = self._items.get(response_id)
        if response is None or (tenant is not None and response.tenant != tenant):
            return None
        self._items.move_to_end(response_id)
        return response

    def pop(self, response_id: str, tenant: str | None = None) -> StoredResponse | None:
        if self.get(response_id, tenant) is None:
            return None
        return self._items.pop(response_id)
