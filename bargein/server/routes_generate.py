"""``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` (also without ``/v1``).

Both generation endpoints stream (server-sent events) or not, through the one serving
path (``serving.serve``) and the one stream grammar (``openai_stream``). Every request
has an id, in the body's ``id`` and the ``X-Request-Id`` header (the client may choose it
by sending that header), by which it can be cancelled. A cancelled request ends with
``finish_reason: "cancelled"`` (and a ``cancel_reason``), its partial text and usage.

Chat prompts are token-exact over this server's recent answers: a history that repeats
one verbatim reuses its token ids (``prompts.PromptBuilder.chat``), so the prefix cache
hits on the whole previous prompt and answer, cancelled answers included.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import Response

from bargein.server.context import Ctx, ServerContext
from bargein.server.errors import APIError, not_found
from bargein.server.generation import request_id_for
from bargein.server.limits import check_limits
from bargein.server.openai_format import sampling_params
from bargein.server.openai_stream import ChatShape, CompletionShape
from bargein.server.reasoning import ReasoningFormat, thinking_for
from bargein.server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from bargein.server.serving import Generation, serve
from bargein.server.thinking_switch import effort_switch, thinking_kwargs
from bargein.server.tools import prompt_messages as tool_messages
from bargein.server.tools import tool_plan, tool_syntax_for
from bargein.server.validation import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_CHOICES,
    check_logprobs,
    check_n,
    check_structured,
    effective_timeout,
    resolve_max_tokens,
)

router = APIRouter()
_ROLES = {"system", "user", "assistant", "tool", "developer"}


def openai_route(router: APIRouter, method: str, path: str) -> Callable:
    """Registers a route at ``/v1{path}`` and, hidden from the schema, at ``{path}``."""
    def register(fn: Callable) -> Callable:
        router.add_api_route("/v1" + path, fn, methods=[method])
        router.add_api_route(path, fn, methods=[method], include_in_schema=False)
        return fn
    return register


# -- models ---------------------------------------------------------------------------------
def _model_card(ctx: ServerContext) -> dict[str, Any]:
    return {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "bargein",
            "max_model_len": ctx.max_model_len}


@openai_route(router, "GET", "/models")
async def list_models(ctx: Ctx) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(ctx)]}


@openai_route(router, "GET", "/models/{model_id:path}")
async def get_model(model_id: str, ctx: Ctx) -> dict[str, Any]:
    if model_id != ctx.model_name:
        raise not_found("model", model_id, param="model")
    return _model_card(ctx)


# -- chat -------------------------------------------------------------------------------------
def message_dicts(raw: list[dict[str, Any]], param: str = "messages") -> list[dict[str, Any]]:
    """Messages as the chat template takes them: text parts joined, ``developer`` as system.

    Each is validated as a ChatMessage here (400 naming ``messages.<i>.<field>``).
    """
    out = []
    for i, item in enumerate(raw):
        try:
            message = ChatMessage.model_validate(item)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in (param, i, *first["loc"]))
            raise APIError(400, f"{where}: {first['msg']}", param=where, code="invalid_value") from None
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


def _include_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


@openai_route(router, "POST", "/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, ctx: Ctx) -> Response:
    received = time.monotonic()
    request_id = request_id_for(request, "chatcmpl-")
    check_limits(body, ctx.settings)  # sizes first, before anything grows with the input
    # Validation in FIELD_ORDER (validation.py); the messages' walk grows with the input: off the loop.
    messages = await ctx.prompts.run(lambda: message_dicts(body.messages))
    check_n(body.n)
    template = ctx.tokenizer.chat_template
    constraint, plan = await check_structured(ctx, body.response_format,
                                              lambda: tool_plan(body.tools, body.tool_choice,
                                                                tool_syntax_for(template, ctx.tokenizer)))
    use_mct = body.max_completion_tokens is not None
    max_field = "max_completion_tokens" if use_mct else "max_tokens"
    max_tokens = resolve_max_tokens(body.max_completion_tokens if use_mct else body.max_tokens, max_field,
                                    ctx.settings, ctx.settings.default_max_tokens)
    check_logprobs(body.logprobs, body.top_logprobs)
    timeout = effective_timeout(body.timeout, ctx.settings.request_timeout)
    params = sampling_params(body, max_tokens=max_tokens, logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                             renames={"max_tokens": max_field, "logprobs": "top_logprobs"}, constraint=constraint)
    messages, template_tools = tool_messages(messages, plan, template)
    template_kwargs = chat_template_kwargs(body, template, body.reasoning_effort)
    prompt = await ctx.prompts.chat(messages, template_tools, template_kwargs=template_kwargs)
    gen = Generation("chat", request_id, received, [prompt.token_ids], params, n=body.n, timeout=timeout,
                     stream=body.stream, on_final=lambda slot, out: ctx.prompts.remember(prompt.text, out),
                     cache_salt=body.cache_salt)
    shape = ChatShape(ctx.head(request_id), ctx.tokenizer, logprobs=body.logprobs,
                      include_usage=_include_usage(body), token_ids=body.return_token_ids,
                      tool_names={t.name for t in plan.tools} if plan.offered else None, syntax=plan.syntax,
                      keeps_special=not params.skip_special_tokens,
                      thinking=thinking_for(template, prompt.text, ReasoningFormat(ctx.settings.reasoning_format),
                                            constrained=constraint is not None, tokenizer=ctx.tokenizer,
                                            prompt_ids=prompt.token_ids))
    return await serve(request, ctx, gen, shape)


_RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "self", "source"})


def chat_template_kwargs(body: ChatCompletionRequest | Any, template: str | None,
                         reasoning_effort: str | None = None) -> dict[str, Any]:
    """The template variables a chat request sets: ``chat_template_kwargs`` (as vLLM and
    llama.cpp take them), where the thinking switch is ``enable_thinking``; without it,
    OpenAI's ``reasoning_effort`` sets the switch (``reasoning.effort_switch``)."""
    kwargs = dict(body.chat_template_kwargs or {})
    enabled = kwargs.pop("enable_thinking", None)
    if enabled is not None and not isinstance(enabled, bool):
        raise APIError(400, "chat_template_kwargs.enable_thinking must be a boolean",
                       param="chat_template_kwargs.enable_thinking", code="invalid_value")
    if enabled is None:
        enabled = effort_switch(reasoning_effort)
    bad = [k for k in kwargs if k in _RESERVED_TEMPLATE_VARIABLES or not k.isidentifier()]
    if bad:
        raise APIError(400, f"chat_template_kwargs may not set {bad[0]!r} (names are identifiers, and not one of "
                            f"{sorted(_RESERVED_TEMPLATE_VARIABLES)})", param="chat_template_kwargs",
                       code="invalid_value")
    return {**kwargs, **thinking_kwargs(template, enabled)}


# -- completions ------------------------------------------------------------------------------
@openai_route(router, "POST", "/completions")
async def completions(body: CompletionRequest, request: Request, ctx: Ctx) -> Response:
    received = time.monotonic()
    request_id = request_id_for(request, "cmpl-")
    check_limits(body, ctx.settings)  # sizes first, before anything grows with the input
    if isinstance(body.prompt, list) and not body.prompt:
        raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
    check_n(body.n)
    constraint, _ = await check_structured(ctx, body.response_format, lambda: tool_plan(None, None))
    num_prompts = 1 if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else len(body.prompt)
    if num_prompts * body.n > MAX_CHOICES:
        raise APIError(400, f"prompts x n must be at most {MAX_CHOICES}", param="prompt", code="invalid_value")
    max_tokens = resolve_max_tokens(body.max_tokens, "max_tokens", ctx.settings, COMPLETIONS_DEFAULT_MAX_TOKENS)
    check_logprobs(body.logprobs is not None, body.logprobs, "logprobs")
    timeout = effective_timeout(body.timeout, ctx.settings.request_timeout)
    params = sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs, constraint=constraint)
    prompts = await ctx.prompts.completion(body.prompt, ctx.vocab_size)
    echoes = [await ctx.prompts.decode(p) if body.echo else "" for p in prompts]
    gen = Generation("completions", request_id, received, prompts, params, n=body.n, timeout=timeout,
                     stream=body.stream, cache_salt=body.cache_salt)
    shape = CompletionShape(ctx.head(request_id), ctx.tokenizer, echoes, logprobs=body.logprobs is not None,
                            include_usage=_include_usage(body), token_ids=body.return_token_ids)
    return await serve(request, ctx, gen, shape)
