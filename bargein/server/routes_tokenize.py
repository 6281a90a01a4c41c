"""``POST /tokenize`` and ``POST /detokenize``, in both conventions clients use.

- llama.cpp: ``{"content": "...", "add_special": false, "with_pieces": false}`` ->
  ``{"tokens": [...]}`` (with pieces: ``[{"id", "piece"}]``); ``{"tokens": [...]}`` ->
  ``{"content": "..."}``.
- vLLM: ``{"prompt": "...", "add_special_tokens": true}`` or ``{"messages": [...],
  "add_generation_prompt": true, "tools": [...]}`` -> ``{"tokens", "count",
  "max_model_len"}``; ``{"tokens": [...]}`` -> ``{"prompt": "..."}``.

Messages are tokenized exactly as ``/v1/chat/completions`` would send them to the
engine, through the prompt memory: a history that repeats one of this server's answers
shows that answer's own token ids, so a client can check that a cached prefix lines up.
Both forms also answer at ``/v1/tokenize`` and ``/v1/detokenize``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import model_validator

from bargein.server.context import Ctx
from bargein.server.errors import APIError
from bargein.server.openai_format import token_text
from bargein.server.routes_generate import chat_template_kwargs, message_dicts
from bargein.server.schemas import _Body
from bargein.server.tools import prompt_messages, tool_plan, tool_syntax_for

router = APIRouter()


class TokenizeRequest(_Body):
    content: str | None = None  # llama.cpp
    add_special: bool = False
    with_pieces: bool = False
    prompt: str | None = None  # vLLM
    add_special_tokens: bool = True
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        given = [name for name in ("content", "prompt", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of content, prompt or messages")
        return self


class DetokenizeRequest(_Body):
    tokens: list[int]


@router.post("/tokenize")
@router.post("/v1/tokenize", include_in_schema=False)
async def tokenize(body: TokenizeRequest, ctx: Ctx) -> dict[str, Any]:
    tokenizer = ctx.tokenizer
    if body.content is not None:
        ctx.prompts.check_bytes([body.content], "content")
        ids = await ctx.prompts.run(lambda: tokenizer.encode(body.content, add_special_tokens=body.add_special))
        if body.with_pieces:
            return {"tokens": [{"id": t, "piece": token_text(tokenizer, t)[0]} for t in ids]}
        return {"tokens": ids}
    if body.prompt is not None:
        ctx.prompts.check_bytes([body.prompt], "prompt")
        ids = await ctx.prompts.run(lambda: tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    else:
        ids = await _chat_tokens(body, ctx)
    return {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}


async def _chat_tokens(body: TokenizeRequest, ctx: Ctx) -> list[int]:
    if not body.add_generation_prompt:
        raise APIError(400, "add_generation_prompt: false is not supported: messages are tokenized as a chat "
                            "request's prompt", param="add_generation_prompt", code="invalid_value")
    template = ctx.tokenizer.chat_template
    plan = tool_plan(body.tools, None, tool_syntax_for(template))
    messages = await ctx.prompts.run(lambda: message_dicts(body.messages or []))
    messages, template_tools = prompt_messages(messages, plan, template)
    prompt = await ctx.prompts.chat(messages, template_tools, template_kwargs=chat_template_kwargs(body, template))
    return prompt.token_ids


@router.post("/detokenize")
@router.post("/v1/detokenize", include_in_schema=False)
async def detokenize(body: DetokenizeRequest, ctx: Ctx) -> dict[str, Any]:
    bad = [t for t in body.tokens if not 0 <= t < ctx.vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {ctx.vocab_size})", param="tokens",
                       code="invalid_value")
    text = await ctx.prompts.decode(body.tokens, skip_special_tokens=False)
    return {"content": text, "prompt": text}
