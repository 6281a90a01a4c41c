"""Request bodies (pydantic), as the OpenAI API and its usual extensions define them.

Types are checked here; ranges are checked once, by ``SamplingParams`` (whose errors name
the field). Unknown fields are ignored, as tools built for the OpenAI API send many.
Extensions beyond OpenAI: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``timeout`` (seconds, a
deadline after which the request is cancelled with reason ``deadline``) and ``speculative``
(false: this request opts out of the server's ``--speculative`` decoding).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


def _valid_unicode(value: Any) -> Any:
    """``value`` unchanged if every string in it (nested too) is valid Unicode, else ValueError.

    JSON may escape a lone surrogate (``"\\ud800"``); Python keeps it in a ``str`` that no
    tokenizer can encode, so it is refused here with the field's name (a 400), not later.
    """
    bad = _find_lone_surrogate(value, "")
    if bad is not None:
        where, index = bad
        inside = f" of the string at {where}" if where else ""
        raise ValueError(f"a lone UTF-16 surrogate at character {index}{inside} is not valid Unicode "
                         "(surrogate pairs are fine)")
    return value


def _find_lone_surrogate(value: Any, where: str) -> tuple[str, int] | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return where, exc.start
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _find_lone_surrogate(key, f"{where} (a key)") or _find_lone_surrogate(item, f"{where}[{key!r}]")
        if found is not None:
            return found
    return None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    #: Fields validated item by item later (off the event loop), whose 400 then names the
    #: item (``messages.0.content``): their strings are checked there, not here.
    unicode_checked_later: ClassVar[frozenset[str]] = frozenset()

    @field_validator("*")
    @classmethod
    def _unicode_only(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name in cls.unicode_checked_later:
            return value
        return _valid_unicode(value)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """Sampling fields shared by chat, completions and responses."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    timeout: float | None = Field(default=None, description="seconds until the request is cancelled")
    cache_salt: str | None = Field(default=None, max_length=256,
                                   description="a prefix-cache namespace: only requests with the same salt (and "
                                               "API key) reuse each other's cached prompt tokens")
    speculative: bool | None = Field(default=None, description="false: no speculative decoding for this request "
                                                               "(the answer is the same either way)")


class ChatMessage(BaseModel):
    """One message; extra keys (tool_calls, name, ...) pass through to the chat template."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None

    _unicode_only = field_validator("*")(_valid_unicode)

    @model_validator(mode="after")
    def _extras_unicode_only(self) -> ChatMessage:
        _valid_unicode(self.model_extra or {})
        return self


class ChatCompletionRequest(SamplingFields):
    # Plain objects here, each validated as a ChatMessage off the event loop (a body of many
    # messages would otherwise hold the loop for its whole validation).
    messages: list[dict[str, Any]] = Field(min_length=1, description="ChatMessage objects")
    unicode_checked_later: ClassVar[frozenset[str]] = frozenset({"messages"})
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    return_token_ids: bool = Field(default=False, description="extension: prompt_token_ids and token_ids "
                                   "in each choice (streamed: in its final chunk)")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="extension: the chat "
                                                        "template's variables, e.g. enable_thinking")
    reasoning_effort: str | None = Field(default=None, description="the thinking switch: 'none' off, "
                                         "'minimal', 'low', 'medium' or 'high' on")


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # none: 16, the OpenAI default for this endpoint
    n: int = 1
    logprobs: int | None = None
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    response_format: dict[str, Any] | None = None  # extension (as vLLM): structured output on completions


class ResponseRequest(SamplingFields):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    background: bool = False
    store: bool = True
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    tools: list[dict[str, Any]] | None = None  # function tools: {"type": "function", "name", "parameters", ...}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": "none" | "minimal" | ... | "high"}: the thinking switch
    return_token_ids: bool = False  # extension: prompt_token_ids and token_ids in the response object


class CancelRequest(_Body):
    request_id: str


class CancelManyRequest(_Body):
    all: bool = False
    ids: list[str] | None = None


StreamKind = Literal["chat", "completion"]
