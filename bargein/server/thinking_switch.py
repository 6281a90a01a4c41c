"""The thinking switches clients send, and Anthropic's thinking budget.

The chat template's switch is ``enable_thinking``; every API's own switch maps onto it
(``thinking_kwargs``): chat completions' ``chat_template_kwargs.enable_thinking`` or
OpenAI's ``reasoning_effort`` (``effort_switch``), the Messages API's ``thinking.type``,
Ollama's ``think``. The template's switch has no levels, so every level only turns
thinking on. Anthropic's ``thinking.budget_tokens`` is enforced by a grammar
(``budget_constraint``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from bargein.engine.constraint import Constraint
from bargein.loader.chat_template import has_thinking_switch
from bargein.server.control_markers import marker_token_id
from bargein.server.errors import APIError
from bargein.server.reasoning import Thinking


def budget_constraint(thinking: Thinking, budget: int, tokenizer: Any = None) -> Constraint:
    """A grammar that caps the answer's thought at ``budget`` tokens (Anthropic's
    ``thinking.budget_tokens``): the thought runs until the model closes it or the budget
    is spent, then the closing marker is written for it and the answer goes on, free.

    A thought the prompt opened (``starts_inside``) begins at once; otherwise the answer
    may open one first (or answer without thinking). The markers are text to the grammar:
    forced, the closing one is tokenized as the tokenizer writes it (one token where the
    vocabulary has one), so the parsers read it as the model's own; given the ``tokenizer``,
    a marker that is one token (Qwen's ``</think>``, Mistral's special ``[/THINK]``) is
    written as that token (``control_markers.marker_token_id``)."""
    lines = [f"thought[max_tokens={budget}]: THOUGHT",
             f"THOUGHT: /(?s:.*)/ & ~/(?s:.*){_regex(thinking.close)}(?s:.*)/", "answer: ANSWER"]
    close = _marker(tokenizer, thinking.close)
    if thinking.starts_inside:
        lines = [f"start: thought {close} answer", *lines, "ANSWER: /(?s:.*)/"]
    else:  # an answer without a thought must not begin with one
        lines = [f"start: answer | WS {_marker(tokenizer, thinking.open)} thought {close} answer", *lines, "WS: /\\s*/",
                 f"ANSWER: /(?s:.*)/ & ~/\\s*{_regex(thinking.open)}(?s:.*)/"]
    return Constraint("lark", "\n".join(lines) + "\n")


def _marker(tokenizer: Any, text: str) -> str:
    """``text`` in a Lark rule: its token where it is one token, else a literal."""
    token = marker_token_id(tokenizer, text)
    return json.dumps(text) if token is None else f"<[{token}]>"


def _regex(text: str) -> str:
    """``text`` as a literal inside a Lark /regex/."""
    return re.escape(text).replace("/", "\\/")


REASONING_EFFORTS = {"none": False, "minimal": True, "low": True, "medium": True, "high": True}


def effort_switch(effort: str | None, param: str = "reasoning_effort") -> bool | None:
    """OpenAI's ``reasoning_effort`` as the thinking switch: ``none`` off, any other level
    on (the template's switch has no levels); None leaves the template's default."""
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise APIError(400, f"{param} must be one of {list(REASONING_EFFORTS)}, got {effort!r}", param=param,
                       code="invalid_value")
    return REASONING_EFFORTS[effort]


def thinking_kwargs(template: str | None, enabled: bool | None) -> dict[str, bool]:
    """The template variables for a client's thinking switch (None: the template's default)."""
    if enabled is None or not has_thinking_switch(template):
        return {}
    return {"enable_thinking": enabled}
