"""The shape of every answer, streamed or not, produced in one place.

The stream grammar, the same for every endpoint (``event_stream`` drives it; a
:class:`Shape` only says how each part looks for its endpoint):

1. an opening per choice: chat ``{"delta": {"role": "assistant", "content": ""}}``,
   completions ``{"text": ""}`` (or the echoed prompt), Responses ``response.created``,
   ``response.in_progress``, ``output_item.added``, ``content_part.added``;
2. content: one chunk per output that adds text (or logprobs), ``finish_reason: null``;
3. one final chunk per choice with an empty delta (``{}``, ``"text": ""``) and
   ``finish_reason``, plus ``cancel_reason`` when cancelled. It never carries content:
   whatever text an engine's final output still adds goes out in a content chunk
   before it. Responses: ``output_text.done``, ``content_part.done``, ``output_item.done``;
4. the usage chunk (``choices: []``) when ``stream_options.include_usage``;
5. ``data: [DONE]`` (Responses: ``response.completed`` / ``incomplete`` / ``failed``).

A failed choice sends an error event in the OpenAI error shape instead of its final
chunk. Non-streaming bodies come from the same shapes (``body``), from the outputs the
job accumulated, so the two forms always agree.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol

from bargein.engine.request import CancelReason, FinishReason, RequestOutput
from bargein.server.errors import APIError, error_body
from bargein.server.generation import Job, JobRunner, Slot
from bargein.server.openai_format import (
    cancel_fields,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    job_usage,
)
from bargein.server.reasoning import (
    AnswerEvent,
    AnswerParser,
    ReasoningDelta,
    Thinking,
    parse_answer,
)
from bargein.server.responses_store import StoredResponse
from bargein.server.sse import DONE, data_event, named_event
from bargein.server.tools import (
    ArgumentsDelta,
    CallEnd,
    CallStart,
    ToolCall,
    ToolSyntax,
)


class Shape(Protocol):
    """How one endpoint's answer looks; ``event_stream`` decides what comes when."""

    def observe(self, slot: Slot, out: RequestOutput) -> None: ...
    def opening(self, slots: list[Slot]) -> Iterable[str]: ...
    def content(self, slot: Slot, out: RequestOutput) -> Iterable[str]: ...
    def final(self, slot: Slot, out: RequestOutput) -> Iterable[str]: ...
    def error(self, slot: Slot, out: RequestOutput) -> Iterable[str]: ...
    def closing(self, usage: dict[str, Any]) -> Iterable[str]: ...
    def body(self, job: Job) -> dict[str, Any]: ...
    def closed(self, reason: CancelReason) -> None: ...


async def event_stream(runner: JobRunner, job: Job, shape: Shape) -> AsyncIterator[str]:
    """The one stream grammar (module docstring), for any endpoint's shape."""
    for event in shape.opening(job.slots):
        yield event
    async for slot, out in runner.outputs(job):
        shape.observe(slot, out)
        if out.finish_reason == FinishReason.ERROR:
            for event in shape.error(slot, out):
                yield event
            continue
        for event in shape.content(slot, out):
            yield event
        if out.finished:
            for event in shape.final(slot, out):
                yield event
    for event in shape.closing(usage_of(job)):
        yield event


async def collect(runner: JobRunner, job: Job, shape: Shape,
                  exit_reason: CancelReason = CancelReason.DISCONNECT) -> Job:
    """Runs a job to its end for a non-streaming answer, showing every output to ``shape``.

    If the collecting task is cancelled, the job's unfinished requests are cancelled
    with ``exit_reason``.
    """
    async for slot, out in runner.outputs(job, exit_reason=exit_reason):
        shape.observe(slot, out)
    return job


def usage_of(job: Job) -> dict[str, Any]:
    return job_usage((slot.prompt_index, job.progress[slot.index].final) for slot in job.slots
                     if job.progress[slot.index].final is not None)


def final_or_raise(job: Job, slot: Slot) -> RequestOutput:
    final = job.progress[slot.index].final
    if final is None or final.finish_reason == FinishReason.ERROR:
        message = (final.error if final is not None else None) or "generation failed"
        raise APIError(500, message, type="server_error", code="generation_failed")
    return final


def token_id_fields(final: RequestOutput) -> dict[str, list[int]]:
    """The ``return_token_ids`` extension: the exact prompt and answer token ids (on the
    final chunk of a stream, and in each choice of a body)."""
    return {"prompt_token_ids": list(final.prompt_token_ids), "token_ids": list(final.token_ids)}


class ChatShape:
    """``chat.completion`` and ``chat.completion.chunk``.

    With ``tool_names`` (tools offered), each choice's text goes through a
    :class:`ToolCallParser`: calls come out as ``tool_calls`` (streamed as OpenAI does:
    a delta with the call's index, id, type and name and empty arguments, then deltas
    with argument pieces as they are generated) and an answer that made a call and
    ended by itself has ``finish_reason: "tool_calls"``.

    With ``thinking`` (a template that marks thoughts, ``--reasoning-format separate``),
    thoughts come out as ``reasoning_content``: deltas of their own, and the message's field.
    """

    def __init__(self, head: dict[str, Any], tokenizer: Any, *, logprobs: bool, include_usage: bool,
                 token_ids: bool = False, tool_names: set[str] | None = None, thinking: Thinking | None = None,
                 syntax: ToolSyntax | None = None, keeps_special: bool = False):
        self.head = head  # id, created, model, system_fingerprint
        self.keeps_special = keeps_special  # the text holds special tokens' (skip_special_tokens false)
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.token_ids = token_ids  # the return_token_ids extension (non-streamed bodies)
        self.tool_names = tool_names
        self.thinking = thinking
        self.syntax = syntax
        self.parsers: dict[int, AnswerParser] = {}  # per choice, streamed
        self.reasoning_tokens: dict[int, int] = {}  # per finished choice, with thinking split

    def _finish_reason(self, out: RequestOutput, parser: AnswerParser | None) -> str | None:
        if parser is not None and parser.calls and out.finish_reason == FinishReason.STOP:
            return "tool_calls"
        return finish_reason(out)

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        usage = {"usage": None} if self.include_usage else {}
        return data_event({**self.head, "object": "chat.completion.chunk", "choices": choices, **usage, **extra})

    def observe(self, slot: Slot, out: RequestOutput) -> None:
        pass

    def opening(self, slots: list[Slot]) -> Iterable[str]:
        for slot in slots:
            yield self._chunk([{"index": slot.index, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}])

    def content(self, slot: Slot, out: RequestOutput) -> Iterable[str]:
        lps = chat_logprobs(self.tokenizer, out.new_logprobs) if self.logprobs and out.new_logprobs else None
        if self.tool_names is None and self.thinking is None:
            if out.delta_text or lps:
                yield self._delta(slot, {"content": out.delta_text}, lps)
            return
        parser = self.parsers.setdefault(slot.index, AnswerParser(self.thinking, self.tool_names, self.syntax,
                                                                          self.tokenizer, self.keeps_special))
        events = parser.feed(out.delta_text, final=out.finished, token_ids=out.new_token_ids)
        if lps and not any(isinstance(e, str | ReasoningDelta) for e in events):
            yield self._delta(slot, {"content": ""}, lps)
        for event in events:
            if isinstance(event, str):
                yield self._delta(slot, {"content": event}, lps)
                lps = None  # this output's logprobs go with its first content piece
            elif isinstance(event, ReasoningDelta):
                yield self._delta(slot, {"reasoning_content": event.text}, lps)
                lps = None
            elif isinstance(event, CallStart):
                call = event.call
                yield self._delta(slot, {"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                                         "function": {"name": call.name, "arguments": ""}}]})
            elif isinstance(event, ArgumentsDelta):
                yield self._delta(slot, {"tool_calls": [{"index": event.index,
                                                         "function": {"arguments": event.text}}]})

    def _delta(self, slot: Slot, delta: dict[str, Any], lps: list[dict[str, Any]] | None = None) -> str:
        return self._chunk([{"index": slot.index, "delta": delta, "logprobs": {"content": lps} if lps else None,
                             "finish_reason": None}])

    def _count_reasoning(self, index: int, out: RequestOutput, parser: AnswerParser | None) -> None:
        if self.thinking is not None:
            self.reasoning_tokens[index] = parser.thought_tokens(self.tokenizer, out.token_ids) if parser else 0

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """With thinking split, usage says how many output tokens were thoughts."""
        if self.thinking is None:
            return usage
        return {**usage, "completion_tokens_details": {"reasoning_tokens": sum(self.reasoning_tokens.values())}}

    def final(self, slot: Slot, out: RequestOutput) -> Iterable[str]:
        self._count_reasoning(slot.index, out, self.parsers.get(slot.index))
        yield self._chunk([{"index": slot.index, "delta": {}, "logprobs": None,
                            "finish_reason": self._finish_reason(out, self.parsers.get(slot.index)),
                            **cancel_fields(out), **(token_id_fields(out) if self.token_ids else {})}])

    def error(self, slot: Slot, out: RequestOutput) -> Iterable[str]:
        yield data_event(error_body(out.error or "generation failed"))

    def closing(self, usage: dict[str, Any]) -> Iterable[str]:
        if self.include_usage:
            yield data_event({**self.head, "object": "chat.completion.chunk", "choices": [],
                              "usage": self._usage(usage)})
        yield DONE

    def body(self, job: Job) -> dict[str, Any]:
        choices = []
        for slot in job.slots:
            final = final_or_raise(job, slot)
            progress = job.progress[slot.index]
            logprobs = {"content": chat_logprobs(self.tokenizer, progress.logprobs)} if self.logprobs else None
            message: dict[str, Any] = {"role": "assistant", "content": final.text, "refusal": None}
            parser = None
            if self.tool_names is not None or self.thinking is not None:
                parser = parse_answer(final.text, self.thinking, self.tool_names, self.syntax, self.tokenizer,
                                      final.token_ids, self.keeps_special)
                message["content"] = parser.text
                if self.thinking is not None:
                    message["reasoning_content"] = parser.reasoning or None
                if parser.calls:
                    message["content"] = parser.text or None
                    message["tool_calls"] = [call.to_dict() for call in parser.calls]
            self._count_reasoning(slot.index, final, parser)
            choices.append({"index": slot.index, "message": message, "logprobs": logprobs,
                            "finish_reason": self._finish_reason(final, parser), **cancel_fields(final),
                            **(token_id_fields(final) if self.token_ids else {})})
        return {**self.head, "object": "chat.completion", "choices": choices, "usage": self._usage(usage_of(job))}

    def closed(self, reason: CancelReason) -> None:
        pass


class CompletionShape:
    """``text_completion``, streamed and not; ``echoes`` holds each prompt's echoed text."""

    def __init__(self, head: dict[str, Any], tokenizer: Any, echoes: list[str], *, logprobs: bool,
                 include_usage: bool, token_ids: bool = False):
        self.head = {**head, "object": "text_completion"}
        self.token_ids = token_ids
        self.tokenizer = tokenizer
        self.echoes = echoes
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.offsets: dict[int, int] = {}  # text length so far, per choice (logprobs' text_offset)

    def _chunk(self, choices: list[dict[str, Any]]) -> str:
        usage = {"usage": None} if self.include_usage else {}
        return data_event({**self.head, "choices": choices, **usage})

    def observe(self, slot: Slot, out: RequestOutput) -> None:
        pass

    def opening(self, slots: list[Slot]) -> Iterable[str]:
        for slot in slots:
            echo = self.echoes[slot.prompt_index]
            self.offsets[slot.index] = len(echo)
            yield self._chunk([{"index": slot.index, "text": echo, "logprobs": None, "finish_reason": None}])

    def content(self, slot: Slot, out: RequestOutput) -> Iterable[str]:
        lps = None
        if self.logprobs and out.new_logprobs:
            lps = completion_logprobs(self.tokenizer, out.new_logprobs, self.offsets[slot.index])
        self.offsets[slot.index] += len(out.delta_text)
        if out.delta_text or lps:
            yield self._chunk([{"index": slot.index, "text": out.delta_text, "logprobs": lps,
                                "finish_reason": None}])

    def final(self, slot: Slot, out: RequestOutput) -> Iterable[str]:
        yield self._chunk([{"index": slot.index, "text": "", "logprobs": None,
                            "finish_reason": finish_reason(out), **cancel_fields(out),
                            **(token_id_fields(out) if self.token_ids else {})}])

    def error(self, slot: Slot, out: RequestOutput) -> Iterable[str]:
        yield data_event(error_body(out.error or "generation failed"))

    def closing(self, usage: dict[str, Any]) -> Iterable[str]:
        if self.include_usage:
            yield data_event({**self.head, "choices": [], "usage": usage})
        yield DONE

    def body(self, job: Job) -> dict[str, Any]:
        choices = []
        for slot in job.slots:
            final = final_or_raise(job, slot)
            echo = self.echoes[slot.prompt_index]
            logprobs = None
            if self.logprobs:
                logprobs = completion_logprobs(self.tokenizer, job.progress[slot.index].logprobs, len(echo))
            choices.append({"index": slot.index, "text": echo + final.text, "logprobs": logprobs,
                            "finish_reason": finish_reason(final), **cancel_fields(final),
                            **(token_id_fields(final) if self.token_ids else {})})
        return {**self.head, "choices": choices, "usage": usage_of(job)}

    def closed(self, reason: CancelReason) -> None:
        pass


class ResponsesShape:
    """The Responses API: one stored response, updated by every output; its events.

    Without tools the one output item, the message, opens with the response. With tools
    offered (``stored.calls``), items open as they appear: the message with the answer's
    first text, each function call once its name is written (``output_item.added``),
    whose arguments then stream as ``response.function_call_arguments.delta`` and end
    with ``.done`` and ``output_item.done`` at its closing tag. With thoughts split
    (``stored.thoughts``), items open as they appear too: first the reasoning item, its
    text streamed as ``response.reasoning_text.delta``, closed when the answer begins.
    """

    def __init__(self, stored: StoredResponse):
        self.stored = stored
        self.seq = 0
        self.events: list[AnswerEvent] = []  # what the last output added (stored.apply)
        self.message_open = False
        self.reasoning_open = False

    def _event(self, kind: str, **payload: Any) -> str:
        self.seq += 1
        return named_event(kind, {"type": kind, "sequence_number": self.seq - 1, **payload})

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.stored.message_id, "output_index": self._index(None)}

    def _index(self, item: int | None) -> int:
        if not self.stored.items_open_as_they_come:
            return 0
        return (1 if self.stored.reasoning else 0) + self.stored.order.index(item)

    def observe(self, slot: Slot, out: RequestOutput) -> None:
        self.events = self.stored.apply(out)

    def opening(self, slots: list[Slot]) -> Iterable[str]:
        stored = self.stored
        stored.status = "in_progress"
        yield self._event("response.created", response=stored.to_dict())
        yield self._event("response.in_progress", response=stored.to_dict())
        if not stored.items_open_as_they_come:
            yield from self._open_message()

    def _reasoning_where(self) -> dict[str, Any]:
        return {"item_id": self.stored.reasoning_item()["id"], "output_index": 0, "content_index": 0}

    def _close_reasoning(self) -> Iterable[str]:
        if self.reasoning_open:
            self.reasoning_open = False
            yield self._event("response.reasoning_text.done", **self._reasoning_where(), text=self.stored.reasoning)
            yield self._event("response.output_item.done", output_index=0, item=self.stored.reasoning_item())

    def _open_message(self) -> Iterable[str]:
        self.message_open = True
        item = {**self.stored.message_item(), "status": "in_progress", "content": []}
        yield self._event("response.output_item.added", output_index=self._index(None), item=item)
        yield self._event("response.content_part.added", **self._where(), content_index=0,
                          part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def content(self, slot: Slot, out: RequestOutput) -> Iterable[str]:
        calls = self.stored.calls
        for event in self.events:
            if isinstance(event, ReasoningDelta):
                if not self.reasoning_open:
                    self.reasoning_open = True
                    item = {**self.stored.reasoning_item(), "status": "in_progress", "content": []}
                    yield self._event("response.output_item.added", output_index=0, item=item)
                yield self._event("response.reasoning_text.delta", **self._reasoning_where(), delta=event.text)
                continue
            yield from self._close_reasoning()
            if isinstance(event, str):
                if not self.message_open:
                    yield from self._open_message()
                yield self._event("response.output_text.delta", **self._where(), content_index=0, delta=event,
                                  logprobs=[])
            elif isinstance(event, CallStart):
                item = {**self.stored.function_call_item(event.call), "arguments": "", "status": "in_progress"}
                yield self._event("response.output_item.added", output_index=self._index(event.call.index),
                                  item=item)
            elif isinstance(event, ArgumentsDelta):
                call = calls.calls[event.index]
                yield self._event("response.function_call_arguments.delta", **self._call_where(call),
                                  delta=event.text)
            elif isinstance(event, CallEnd):
                yield from self._close_call(calls.calls[event.index])

    def _call_where(self, call: ToolCall) -> dict[str, Any]:
        return {"item_id": self.stored.function_call_item(call)["id"], "output_index": self._index(call.index)}

    def _close_call(self, call: ToolCall) -> Iterable[str]:
        item = self.stored.function_call_item(call)
        yield self._event("response.function_call_arguments.done", **self._call_where(call), name=call.name,
                          arguments=call.arguments)
        yield self._event("response.output_item.done", output_index=self._index(call.index), item=item)

    def final(self, slot: Slot, out: RequestOutput) -> Iterable[str]:
        stored = self.stored
        yield from self._close_reasoning()
        if stored.items_open_as_they_come:
            for call in stored.calls.calls if stored.calls is not None else ():
                if not call.done:  # cut inside its arguments (length, cancel): closed as incomplete
                    yield from self._close_call(call)
            if not stored.order:  # no text and no call: the (empty) message, as without tools
                stored.order.append(None)
            if None not in stored.order:
                return
            if not self.message_open:
                yield from self._open_message()
        item = stored.message_item()
        yield self._event("response.output_text.done", **self._where(), content_index=0, text=stored.text,
                          logprobs=[])
        yield self._event("response.content_part.done", **self._where(), content_index=0, part=item["content"][0])
        yield self._event("response.output_item.done", output_index=self._index(None), item=item)

    def error(self, slot: Slot, out: RequestOutput) -> Iterable[str]:
        return ()  # the failure is in the stored response, sent with response.failed

    def closing(self, usage: dict[str, Any]) -> Iterable[str]:
        terminal = {"completed": "response.completed", "failed": "response.failed"}.get(self.stored.status,
                                                                                        "response.incomplete")
        yield self._event(terminal, response=self.stored.to_dict())

    def body(self, job: Job) -> dict[str, Any]:
        return self.stored.to_dict()

    def closed(self, reason: CancelReason) -> None:
        """A response whose job ended without a final output is cancelled for ``reason``."""
        if not self.stored.is_final:
            self.stored.status, self.stored.cancel_reason = "cancelled", reason
            self.stored.done.set()
