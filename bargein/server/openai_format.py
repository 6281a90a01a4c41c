"""Translation between OpenAI fields and the engine: sampling params in, usage and logprobs out."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from bargein.engine.constraint import Constraint
from bargein.engine.request import CancelReason, FinishReason, RequestOutput, TokenLogprob
from bargein.engine.sampling import InvalidSamplingParams, SamplingParams
from bargein.server.errors import APIError
from bargein.server.schemas import SamplingFields

_PASSTHROUGH = ("top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
                "speculative")


def sampling_params(body: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    renames: Mapping[str, str] | None = None, constraint: Constraint | None = None
                    ) -> SamplingParams:
    """SamplingParams from a request body; an invalid value is a 400 naming the field.

    ``renames`` maps SamplingParams field names to the body's (``max_tokens`` ->
    ``max_completion_tokens``), so the error names what the client sent.
    """
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "logprobs": logprobs,
                              "temperature": 1.0 if body.temperature is None else body.temperature}
    for name in _PASSTHROUGH:
        value = getattr(body, name)
        if value is not None:
            kwargs[name] = value
    if body.stop is not None:
        kwargs["stop"] = body.stop
    if body.logit_bias:
        kwargs["logit_bias"] = body.logit_bias
    if constraint is not None:
        kwargs["constraint"] = constraint
    try:
        return SamplingParams(**kwargs)
    except InvalidSamplingParams as exc:
        param = (renames or {}).get(exc.field, exc.field)
        raise APIError(400, str(exc).replace(exc.field, param, 1), param=param, code="invalid_value") from None


def system_fingerprint(version: str, model_name: str, precision: str) -> str:
    """``fp_`` + 10 hex digits, stable for a bargein version, model and precision."""
    digest = hashlib.sha256(f"bargein {version}\n{model_name}\n{precision}".encode()).hexdigest()
    return f"fp_{digest[:10]}"


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason.value if out.finish_reason is not None else None


def cancel_fields(out: RequestOutput) -> dict[str, str]:
    """The ``cancel_reason`` extension on a cancelled choice (user, disconnect, deadline, shutdown)."""
    if out.finish_reason == FinishReason.CANCELLED:
        return {"cancel_reason": (out.cancel_reason or CancelReason.USER).value}
    return {}


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def job_usage(finals: Iterable[tuple[int, RequestOutput]]) -> dict[str, Any]:
    """Usage of a job's final outputs, given as (prompt_index, output): each prompt counts once."""
    prompt = cached = completion = 0
    seen: set[int] = set()
    for prompt_index, out in finals:
        completion += out.usage.completion_tokens
        if prompt_index not in seen:
            seen.add(prompt_index)
            prompt += out.usage.prompt_tokens
            cached += out.usage.cached_tokens
    return usage_dict(prompt, completion, cached)


def token_text(tokenizer: Any, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token_id, skip_special_tokens=False)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer: Any, logprobs: Iterable[TokenLogprob]) -> list[dict[str, Any]]:
    """The chat API's ``logprobs.content`` entries."""
    entries = []
    for lp in logprobs:
        text, raw = token_text(tokenizer, lp.token_id)
        top = []
        for token_id, value in lp.top:
            alt_text, alt_raw = token_text(tokenizer, token_id)
            top.append({"token": alt_text, "logprob": value, "bytes": alt_raw})
        entries.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return entries


def completion_logprobs(tokenizer: Any, logprobs: Iterable[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """The completions API's ``logprobs`` object; ``offset`` is the text length before these tokens."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in logprobs:
        text, _ = token_text(tokenizer, lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({token_text(tokenizer, t)[0]: v for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
