"""``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``.

Both generation endpoints stream (server-sent events) or not. Every request has an id,
in the body's ``id`` and the ``X-Request-Id`` header (the client may choose it by
sending that header), by which it can be cancelled. A cancelled request ends with
``finish_reason: "cancelled"`` (and a ``cancel_reason``), its partial text and usage; a
stream then sends the usage chunk when asked, and ``[DONE]``.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from bargein.engine.request import FinishReason
from bargein.loader import ChatTemplateError
from bargein.server.context import Ctx, ServerContext
from bargein.server.errors import APIError, error_body, not_found
from bargein.server.generation import (
    ClientGone,
    Job,
    effective_timeout,
    request_id_for,
    unless_disconnected,
)
from bargein.server.limits import check_limits
from bargein.server.openai_format import (
    cancel_fields,
    chat_logprobs,
    check_prompt_length,
    completion_logprobs,
    finish_reason,
    job_usage,
    sampling_params,
)
from bargein.server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from bargein.server.sse import DONE, EventStream, data_event

router = APIRouter()
MAX_CHOICES = 16
_ROLES = {"system", "user", "assistant", "tool", "developer"}
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, but logs do


# -- models ---------------------------------------------------------------------------------
def _model_card(ctx: ServerContext) -> dict[str, Any]:
    return {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "bargein",
            "max_model_len": ctx.max_model_len}


@router.get("/v1/models")
async def list_models(ctx: Ctx) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(ctx)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, ctx: Ctx) -> dict[str, Any]:
    if model_id != ctx.model_name:
        raise not_found("model", model_id, param="model")
    return _model_card(ctx)


# -- chat -------------------------------------------------------------------------------------
def message_dicts(messages: list[ChatMessage], param: str = "messages") -> list[dict[str, Any]]:
    """Messages as the chat template takes them: text parts joined, ``developer`` as system."""
    out = []
    for i, message in enumerate(messages):
        if message.role not in _ROLES:
            raise APIError(400, f"{param}[{i}].role must be one of {sorted(_ROLES)}, got {message.role!r}",
                           param=f"{param}.{i}.role", code="invalid_value")
        item = message.model_dump(exclude_none=True)
        item["role"] = "system" if message.role == "developer" else message.role
        item["content"] = content_text(message.content, f"{param}.{i}.content")
        out.append(item)
    return out


def content_text(content: str | list[dict[str, Any]] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise APIError(400, f"{param}: only text content is supported, got a {kind!r} part",
                           param=param, code="unsupported_content")
    return "".join(parts)


def render_chat(ctx: ServerContext, messages: list[dict[str, Any]], tools: Any = None,
                param: str = "messages") -> list[int]:
    try:
        text = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    except ChatTemplateError as exc:
        raise APIError(400, f"the chat template could not render the messages: {exc}", param=param) from None
    return ctx.tokenizer.encode(text, add_special_tokens=False)


async def _collect_unless_disconnected(request: Request, ctx: ServerContext, job: Any) -> list | None:
    """A non-streaming job's results, or None if the client went away first (then cancelled)."""
    try:
        return await unless_disconnected(request, ctx.jobs.collect(job))
    except ClientGone:
        return None
    finally:
        ctx.jobs.abandon(job)


def _check_n(n: int) -> None:
    if not 1 <= n <= MAX_CHOICES:
        raise APIError(400, f"n must be an integer in [1, {MAX_CHOICES}], got {n}", param="n", code="invalid_value")


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           ctx: Ctx) -> Response:
    received = time.monotonic()
    request_id = request_id_for(request, "chatcmpl-")
    check_limits(body, ctx.settings)
    _check_n(body.n)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs",
                       code="invalid_value")
    tokens = render_chat(ctx, message_dicts(body.messages), body.tools)
    check_prompt_length(len(tokens), ctx.max_model_len, "messages")
    use_mct = body.max_completion_tokens is not None
    params = sampling_params(
        body, max_tokens=body.max_completion_tokens if use_mct else body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        renames={"max_tokens": "max_completion_tokens" if use_mct else "max_tokens", "logprobs": "top_logprobs"})
    timeout = effective_timeout(body.timeout, ctx.settings.request_timeout)
    job = ctx.jobs.start(request_id, "chat", [tokens], params, n=body.n, timeout=timeout, received=received)
    headers = {"X-Request-Id": request_id}
    head = {"id": request_id, "created": int(time.time()), "model": ctx.model_name, "system_fingerprint": None}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(_chat_events(ctx, job, head, body.logprobs, include_usage),
                           on_close=lambda: ctx.jobs.abandon(job), headers=headers)
    results = await _collect_unless_disconnected(request, ctx, job)
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    choices = []
    for slot, outs in results:
        final = _final_or_raise(outs)
        logprobs = {"content": chat_logprobs(ctx.tokenizer, (lp for o in outs for lp in o.new_logprobs))}
        choices.append({"index": slot.index,
                        "message": {"role": "assistant", "content": final.text, "refusal": None},
                        "logprobs": logprobs if body.logprobs else None,
                        "finish_reason": finish_reason(final), **cancel_fields(final)})
    usage = job_usage((slot.prompt_index, outs[-1]) for slot, outs in results)
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": usage}, headers=headers)


async def _chat_events(ctx: ServerContext, job: Job, head: dict[str, Any], logprobs: bool, include_usage: bool):
    base = {**head, "object": "chat.completion.chunk"}
    for slot in job.slots:
        yield data_event({**base, "choices": [{"index": slot.index, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]})
    finals = []
    async for slot, out in ctx.jobs.outputs(job):
        if out.finished:
            finals.append((slot.prompt_index, out))
        if out.finish_reason == FinishReason.ERROR:
            yield data_event(error_body(out.error or "generation failed"))
            continue
        lps = chat_logprobs(ctx.tokenizer, out.new_logprobs) if logprobs and out.new_logprobs else None
        if not (out.delta_text or lps or out.finished):
            continue  # e.g. half of a multi-byte character: nothing to show yet
        choice = {"index": slot.index, "delta": {"content": out.delta_text} if out.delta_text else {},
                  "logprobs": {"content": lps} if lps else None,
                  "finish_reason": finish_reason(out) if out.finished else None, **cancel_fields(out)}
        yield data_event({**base, "choices": [choice]})
    if include_usage:
        yield data_event({**base, "choices": [], "usage": job_usage(finals)})
    yield DONE


def _final_or_raise(outs: list) -> Any:
    final = outs[-1]
    if final.finish_reason == FinishReason.ERROR:
        raise APIError(500, final.error or "generation failed", type="server_error", code="generation_failed")
    return final


# -- completions ------------------------------------------------------------------------------
def completion_prompts(ctx: ServerContext, prompt: Any) -> list[list[int]]:
    """Token lists for ``prompt``: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
    vocab = ctx.vocab_size
    prompts = []
    for item in items:
        tokens = ctx.tokenizer.encode(item) if isinstance(item, str) else list(item)
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})",
                           param="prompt", code="invalid_value")
        check_prompt_length(len(tokens), ctx.max_model_len, "prompt")
        prompts.append(tokens)
    return prompts


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, ctx: Ctx) -> Response:
    received = time.monotonic()
    request_id = request_id_for(request, "cmpl-")
    check_limits(body, ctx.settings)
    _check_n(body.n)
    prompts = completion_prompts(ctx, body.prompt)
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(400, f"prompts x n must be at most {MAX_CHOICES}", param="prompt", code="invalid_value")
    params = sampling_params(body, max_tokens=body.max_tokens, logprobs=body.logprobs)
    timeout = effective_timeout(body.timeout, ctx.settings.request_timeout)
    job = ctx.jobs.start(request_id, "completions", prompts, params, n=body.n, timeout=timeout, received=received)
    headers = {"X-Request-Id": request_id}
    head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": ctx.model_name,
            "system_fingerprint": None}
    echoes = [ctx.tokenizer.decode(p) if body.echo else "" for p in prompts]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _completion_events(ctx, job, head, echoes, body.logprobs is not None, include_usage)
        return EventStream(events, on_close=lambda: ctx.jobs.abandon(job), headers=headers)
    results = await _collect_unless_disconnected(request, ctx, job)
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    choices = []
    for slot, outs in results:
        final = _final_or_raise(outs)
        echo = echoes[slot.prompt_index]
        logprobs = completion_logprobs(ctx.tokenizer, [lp for o in outs for lp in o.new_logprobs], len(echo))
        choices.append({"index": slot.index, "text": echo + final.text,
                        "logprobs": logprobs if body.logprobs is not None else None,
                        "finish_reason": finish_reason(final), **cancel_fields(final)})
    usage = job_usage((slot.prompt_index, outs[-1]) for slot, outs in results)
    return JSONResponse({**head, "choices": choices, "usage": usage}, headers=headers)


async def _completion_events(ctx: ServerContext, job: Job, head: dict[str, Any], echoes: list[str],
                             logprobs: bool, include_usage: bool):
    finals = []
    offsets = {slot.index: len(echoes[slot.prompt_index]) for slot in job.slots}
    for slot in job.slots:
        if echoes[slot.prompt_index]:
            yield data_event({**head, "choices": [{"index": slot.index, "text": echoes[slot.prompt_index],
                                                   "logprobs": None, "finish_reason": None}]})
    async for slot, out in ctx.jobs.outputs(job):
        if out.finished:
            finals.append((slot.prompt_index, out))
        if out.finish_reason == FinishReason.ERROR:
            yield data_event(error_body(out.error or "generation failed"))
            continue
        lps = None
        if logprobs and out.new_logprobs:
            lps = completion_logprobs(ctx.tokenizer, out.new_logprobs, offsets[slot.index])
        offsets[slot.index] += len(out.delta_text)
        if not (out.delta_text or lps or out.finished):
            continue
        yield data_event({**head, "choices": [{"index": slot.index, "text": out.delta_text, "logprobs": lps,
                                               "finish_reason": finish_reason(out) if out.finished else None,
                                               **cancel_fields(out)}]})
    if include_usage:
        yield data_event({**head, "choices": [], "usage": job_usage(finals)})
    yield DONE
