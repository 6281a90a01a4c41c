"""Ollama's API: ``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version``.

The server has one model; the body's ``model`` is accepted whatever it says, and the
model lists name the one served. Generation goes through the one serving path
(``serving.serve``), so a client that drops the connection cancels its answer at the
next step boundary, streamed or not, as everywhere else; a cancel by id (``X-Request-Id``)
and deadlines work too. Chat prompts use the prompt memory (a history that repeats an
answer continues from its exact tokens); ``/api/generate`` continues exactly from a
previous answer's ``context``. Errors are Ollama's ``{"error": "..."}`` (``error_shapes.py``, by path). The routes follow
Ollama's API, not this server's OpenAPI description, so they are left out of it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from bargein.engine.constraint import Constraint
from bargein.loader import ChatTemplateError
from bargein.server.chat_text import RenderedChat, render_chat
from bargein.server.context import Ctx, ServerContext, bargein_version
from bargein.server.errors import APIError
from bargein.server.generation import request_id_for
from bargein.server.json_body import read_body
from bargein.server.limits import check_limits
from bargein.server.ollama.request import (
    ChatRequest,
    GenerateRequest,
    ShowRequest,
    chat_messages,
    format_constraint,
    sampling_params,
    thinking_switch,
)
from bargein.server.ollama.shape import NDJSON, OllamaShape, now_iso
from bargein.server.prompts import check_prompt_length
from bargein.server.reasoning import ReasoningFormat, thinking_for
from bargein.server.serving import Generation, serve
from bargein.server.thinking_switch import thinking_kwargs
from bargein.server.tools import ToolPlan, prompt_messages, tool_plan, tool_syntax_for
from bargein.server.validation import check_structured, effective_timeout

router = APIRouter()
OLLAMA_API_VERSION = "0.12.0"  # the Ollama release whose API shapes these routes follow


@router.post("/api/chat", include_in_schema=False)
async def chat(request: Request, ctx: Ctx) -> Response:
    return await _chat(request, ctx)


@router.post("/api/generate", include_in_schema=False)
async def generate(request: Request, ctx: Ctx) -> Response:
    return await _generate(request, ctx)


def _check_limits(ctx: ServerContext, body: ChatRequest | GenerateRequest) -> None:
    stop = (body.options or {}).get("stop") if isinstance(body.options, dict) else None
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    check_limits(SimpleNamespace(messages=getattr(body, "messages", None), stop=[s for s in stops if isinstance(s, str)]),
                 ctx.settings)


def _loaded(ctx: ServerContext, chat: bool) -> JSONResponse:
    """Ollama's answer to an empty request: the model is loaded (it always is here)."""
    key = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return JSONResponse({"model": ctx.model_name, "created_at": now_iso(), **key, "done": True,
                         "done_reason": "load"})


async def _chat(request: Request, ctx: ServerContext) -> Response:
    received = time.monotonic()
    request_id = request_id_for(request, "chat-")
    body = await read_body(request, ChatRequest)
    if not body.messages:
        return _loaded(ctx, chat=True)
    _check_limits(ctx, body)
    template = ctx.tokenizer.chat_template
    messages = await ctx.prompts.run(lambda: chat_messages(body.messages))  # grows with the input: off the loop
    constraint, plan = await _structured(ctx, body, lambda: tool_plan(body.tools, None, tool_syntax_for(template, ctx.tokenizer)))
    params = sampling_params(body, default_max_tokens=ctx.settings.default_max_tokens,
                             limit=ctx.settings.max_tokens_limit, constraint=constraint)
    messages, template_tools = await ctx.prompts.run(lambda: prompt_messages(messages, plan, template))
    prompt = await ctx.prompts.chat(messages, template_tools,
                                    template_kwargs=thinking_kwargs(template, thinking_switch(body.think)))
    gen = Generation("ollama_chat", request_id, received, [prompt.token_ids], params,
                     timeout=effective_timeout(body.timeout, ctx.settings.request_timeout), stream=body.stream,
                     on_final=lambda slot, out: ctx.prompts.remember(prompt.text, out))
    shape = OllamaShape(ctx.model_name, chat=True, received=received,
                        thinking=thinking_for(template, prompt.text, ReasoningFormat(ctx.settings.reasoning_format),
                                              constrained=constraint is not None, tokenizer=ctx.tokenizer,
                                              prompt_ids=prompt.token_ids),
                        tool_names={t.name for t in plan.tools} if plan.offered else None, syntax=plan.syntax,
                        tokenizer=ctx.tokenizer)
    return await serve(request, ctx, gen, shape, media_type=NDJSON)


async def _generate(request: Request, ctx: ServerContext) -> Response:
    received = time.monotonic()
    request_id = request_id_for(request, "gen-")
    body = await read_body(request, GenerateRequest)
    for field in ("suffix", "template", "images"):
        if getattr(body, field):
            raise APIError(400, f"{field} is not supported by this server", param=field, code="unsupported_field")
    if not body.prompt and not body.context:
        return _loaded(ctx, chat=False)
    _check_limits(ctx, body)
    template = ctx.tokenizer.chat_template
    constraint, _ = await _structured(ctx, body, lambda: tool_plan(None, None))
    params = sampling_params(body, default_max_tokens=ctx.settings.default_max_tokens,
                             limit=ctx.settings.max_tokens_limit, constraint=constraint)
    context = list(body.context or ())
    bad = [t for t in context if not 0 <= t < ctx.vocab_size]
    if bad:
        raise APIError(400, f"context token id {bad[0]} is outside the vocabulary [0, {ctx.vocab_size})",
                       param="context", code="invalid_value")
    prompt_text, thinking = body.prompt, None
    if body.raw:
        ids = await ctx.prompts.run(lambda: ctx.tokenizer.encode(body.prompt, add_special_tokens=not context))
    else:
        ctx.prompts.check_bytes([body.prompt, body.system or ""], "prompt")
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": body.prompt}]
        kwargs = thinking_kwargs(template, thinking_switch(body.think))
        rendered = await ctx.prompts.run(lambda: _render(ctx, messages, kwargs))
        prompt_text = rendered.text
        # The prompt and system text as the user wrote them: only the template's text becomes control tokens.
        ids = await ctx.prompts.run(lambda: rendered.encoder(ctx.tokenizer)(prompt_text))
        thinking = thinking_for(template, prompt_text, ReasoningFormat(ctx.settings.reasoning_format),
                                constrained=constraint is not None, tokenizer=ctx.tokenizer, prompt_ids=ids)
    tokens = context + ids
    check_prompt_length(len(tokens), ctx.max_model_len, "prompt")
    gen = Generation("ollama_generate", request_id, received, [tokens], params,
                     timeout=effective_timeout(body.timeout, ctx.settings.request_timeout), stream=body.stream)
    shape = OllamaShape(ctx.model_name, chat=False, received=received, thinking=thinking, tool_names=None,
                        syntax=tool_syntax_for(template), tokenizer=ctx.tokenizer)
    return await serve(request, ctx, gen, shape, media_type=NDJSON)


async def _structured(ctx: ServerContext, body: ChatRequest | GenerateRequest,
                      make_plan: Callable[[], ToolPlan]) -> tuple[Constraint | None, ToolPlan]:
    """``format`` and the tools, checked and compiled as the OpenAI routes do: off the event
    loop, within the schema budget, with the same 400s."""
    return await check_structured(ctx, None, make_plan, param="format", read_format=lambda: format_constraint(body.format))


def _render(ctx: ServerContext, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> RenderedChat:
    try:
        return render_chat(ctx.tokenizer, messages, None, "prompt", kwargs)
    except ChatTemplateError as exc:
        raise APIError(400, f"the chat template could not render the prompt: {exc}; send raw: true",
                       param="prompt") from None


# -- the model lists ------------------------------------------------------------------------
def _details(ctx: ServerContext) -> dict[str, Any]:
    return {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
            "parameter_size": "", "quantization_level": ctx.model.precision}


def _entry(ctx: ServerContext) -> dict[str, Any]:
    digest = hashlib.sha256(f"{ctx.model_name}\n{ctx.fingerprint}".encode()).hexdigest()
    return {"name": ctx.model_name, "model": ctx.model_name, "modified_at": _iso(ctx.created), "size": 0,
            "digest": digest, "details": _details(ctx)}


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")


@router.get("/api/tags", include_in_schema=False)
async def tags(ctx: Ctx) -> dict[str, Any]:
    return {"models": [_entry(ctx)]}


@router.get("/api/ps", include_in_schema=False)
async def ps(ctx: Ctx) -> dict[str, Any]:
    """The loaded model: always the one served, loaded for as long as the server runs."""
    return {"models": [{**_entry(ctx), "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0,
                        "context_length": ctx.max_model_len}]}


@router.get("/api/version", include_in_schema=False)
async def version() -> dict[str, Any]:
    return {"version": OLLAMA_API_VERSION, "bargein": bargein_version()}


@router.post("/api/show", include_in_schema=False)
async def show(request: Request, ctx: Ctx) -> Response:
    await read_body(request, ShowRequest)
    template = ctx.tokenizer.chat_template or ""
    capabilities = ["completion", "tools"]
    if thinking_for(template, "", ReasoningFormat.SEPARATE) is not None:
        capabilities.append("thinking")
    return JSONResponse({"modelfile": "", "parameters": "", "template": template, "details": _details(ctx),
                         "model_info": {"general.architecture": "llama", "general.name": ctx.model_name,
                                        "llama.context_length": ctx.max_model_len,
                                        "general.vocab_size": ctx.vocab_size},
                         "capabilities": capabilities, "modified_at": _iso(ctx.created)})
