"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages API).

A message is served like a chat completion (``serving.serve``: one job, a stream or a
body, closed however the response ends), so every cancel route works on it: a client
that disconnects, ``POST /v1/requests/{id}/cancel`` with the message's id (``msg_...``,
also in ``X-Request-Id``), a deadline (``--request-timeout`` or the body's ``timeout``
extension) and the server's shutdown; the answer then ends with ``stop_reason:
"cancelled"``. The prompt goes through the prompt memory, so a next turn that repeats
this answer continues from its exact token ids, and its usage reports the reused tokens
as ``cache_read_input_tokens``. Errors are in Anthropic's shape (``error_shapes.py``, by path). The routes
follow Anthropic's API, not this server's OpenAPI description, so they are left out of it.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from bargein.engine.sampling import InvalidSamplingParams, SamplingParams
from bargein.server.anthropic.request import (
    Conversation,
    CountTokensRequest,
    MessagesRequest,
    conversation,
    output_constraint,
    thinking_budget,
    tool_plan_of,
)
from bargein.server.anthropic.shape import MessagesShape
from bargein.server.context import Ctx, ServerContext
from bargein.server.errors import APIError
from bargein.server.generation import request_id_for
from bargein.server.json_body import read_body
from bargein.server.limits import check_limits
from bargein.server.prompts import ChatPrompt
from bargein.server.reasoning import ReasoningFormat, thinking_for
from bargein.server.serving import Generation, serve
from bargein.server.structured import compile_in_pool
from bargein.server.thinking_switch import budget_constraint, thinking_kwargs
from bargein.server.tools import ToolPlan, prompt_messages, tool_syntax_for
from bargein.server.validation import check_structured, effective_timeout, resolve_max_tokens

router = APIRouter()


@router.post("/v1/messages", include_in_schema=False)
async def messages(request: Request, ctx: Ctx) -> Response:
    return await _messages(request, ctx)


@router.post("/v1/messages/count_tokens", include_in_schema=False)
async def count_tokens(request: Request, ctx: Ctx) -> Response:
    body = await read_body(request, CountTokensRequest)
    conv = await ctx.prompts.run(lambda: conversation(body))
    _, plan = await check_structured(ctx, None, lambda: tool_plan_of(body, tool_syntax_for(ctx.tokenizer.chat_template)),
                                     param="output_config.format", read_format=lambda: None)
    prompt = await _prompt(ctx, conv, plan)
    return JSONResponse({"input_tokens": len(prompt.token_ids)})


async def _prompt(ctx: ServerContext, conv: Conversation, plan: ToolPlan) -> ChatPrompt:
    """The conversation's prompt with the plan's tools (rendered and tokenized in the pool)."""
    template = ctx.tokenizer.chat_template
    rendered, template_tools = await ctx.prompts.run(lambda: prompt_messages(conv.messages, plan, template))
    return await ctx.prompts.chat(rendered, template_tools, template_kwargs=thinking_kwargs(template, conv.thinking),
                                  continue_final=conv.prefill)


async def _messages(request: Request, ctx: ServerContext) -> Response:
    received = time.monotonic()
    request_id = request_id_for(request, "msg_")
    body = await read_body(request, MessagesRequest)
    check_limits(SimpleNamespace(messages=body.messages, stop=body.stop_sequences), ctx.settings)
    conv = await ctx.prompts.run(lambda: conversation(body))  # grows with the input: off the loop
    template = ctx.tokenizer.chat_template
    # The format and the tools' schemas: checked and compiled off the loop, within the schema budget.
    syntax = tool_syntax_for(template, ctx.tokenizer)
    constraint, plan = await check_structured(ctx, None, lambda: tool_plan_of(body, syntax),
                                              param="output_config.format", read_format=lambda: output_constraint(body),
                                              schema_at="output_config.format.schema")
    max_tokens = resolve_max_tokens(body.max_tokens, "max_tokens", ctx.settings, None)
    budget = thinking_budget(body.thinking, max_tokens)
    timeout = effective_timeout(body.timeout, ctx.settings.request_timeout)
    prompt = await _prompt(ctx, conv, plan)
    thinking = thinking_for(template, prompt.text, ReasoningFormat(ctx.settings.reasoning_format),
                            constrained=constraint is not None, tokenizer=ctx.tokenizer, prompt_ids=prompt.token_ids)
    if budget is not None and thinking is not None:  # (an answer constrained from its start has no thought)
        constraint = budget_constraint(thinking, budget, ctx.tokenizer)
        await compile_in_pool(ctx, constraint, "thinking.budget_tokens")
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                                top_p=1.0 if body.top_p is None else body.top_p,
                                top_k=body.top_k,
                                stop=list(body.stop_sequences or ()), constraint=constraint)
    except InvalidSamplingParams as exc:
        raise APIError(400, str(exc).replace(exc.field, _FIELDS.get(exc.field, exc.field), 1),
                       param=_FIELDS.get(exc.field, exc.field), code="invalid_value") from None
    gen = Generation("messages", request_id, received, [prompt.token_ids], params, timeout=timeout,
                     stream=body.stream, on_final=lambda slot, out: ctx.prompts.remember(prompt.text, out))
    shape = MessagesShape(request_id, ctx.model_name, ctx.tokenizer, eos_token_ids=ctx.model.eos_token_ids,
                          stop_sequences=body.stop_sequences or (),
                          thinking=thinking,
                          tool_names={t.name for t in plan.tools} if plan.offered else None,
                          syntax=plan.syntax)
    return await serve(request, ctx, gen, shape)


_FIELDS = {"stop": "stop_sequences"}  # SamplingParams' names -> the Messages API's
