"""A Messages body, validated and translated into what the serving path takes.

- ``system`` (a string or text blocks) becomes the first, ``system`` message;
- a user message's ``text`` blocks are its content; its ``tool_result`` blocks become
  ``tool`` messages (before the text, in their order), their content text;
- an assistant message's ``text`` blocks are its content, ``thinking`` blocks its
  ``reasoning_content`` (templates that keep thoughts render it), ``tool_use`` blocks its
  ``tool_calls`` (written back in the model's own call syntax, so a history that repeats
  an answer of this server renders that answer's text: token-exact);
- ``tools`` (``name``, ``description``, ``input_schema``) and ``tool_choice`` (``auto``,
  ``any``, ``tool`` by name, ``none``) are the OpenAI tools' plan: ``any`` and ``tool``
  constrain the answer to one call whose input follows the schema;
- ``thinking`` (``enabled`` / ``adaptive`` / ``disabled``) is the template's thinking
  switch; ``enabled`` needs ``budget_tokens``, validated as Anthropic does (at least
  ``MIN_THINKING_BUDGET``, less than ``max_tokens``) and enforced: the thought is cut at
  that many tokens, closed, and the answer goes on (``reasoning.budget_constraint``);
- ``output_config.format`` (``{"type": "json_schema", "schema": ...}``) constrains the
  answer to the schema, as ``response_format`` does; ``output_config.effort`` is ignored;
- a final assistant message is a prefill: the answer continues its text, in the same
  turn (``Conversation.prefill``); it must be text without trailing white space, as
  Anthropic requires.

Images, documents and server tools are refused with a 400 that names the block (this
server's models read text only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from bargein.engine.constraint import Constraint
from bargein.server.errors import APIError
from bargein.server.schemas import _Body
from bargein.server.structured import schema_constraint
from bargein.server.tools import ToolPlan, ToolSyntax, tool_plan

ROLES = ("user", "assistant")


class CountTokensRequest(_Body):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema": {...}}}
    timeout: float | None = Field(default=None, description="extension: seconds until the request is cancelled")


MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens


@dataclass(frozen=True)
class Conversation:
    """A Messages body's prompt side: template messages, the thinking switch, and whether
    the last message is an assistant's prefill that the answer continues."""

    messages: list[dict[str, Any]]
    thinking: bool | None  # None: the template's default
    prefill: bool = False


def conversation(body: CountTokensRequest) -> Conversation:
    """The body's messages as the template takes them; a 400 names the first bad block.
    Grows with the input: call it off the event loop."""
    messages = [{"role": "system", "content": _system_text(body.system)}] if body.system else []
    for i, message in enumerate(body.messages):
        messages += _message(i, message)
    prefill = body.messages[-1].get("role") == "assistant"
    if prefill:
        _check_prefill(len(body.messages) - 1, messages[-1])
        if not messages[-1]["content"]:  # an empty prefill: the answer is a new turn, as Anthropic reads it
            messages, prefill = messages[:-1], False
    return Conversation(messages, _thinking(body.thinking), prefill)


def _check_prefill(i: int, message: dict[str, Any]) -> None:
    where = f"messages.{i}"
    if message.get("tool_calls") or message.get("reasoning_content"):
        raise APIError(400, f"{where}: a final assistant message (a prefill) may hold only text blocks",
                       param=f"{where}.content", code="invalid_value")
    if message["content"] != message["content"].rstrip():
        raise APIError(400, f"{where}: final assistant content cannot end with trailing whitespace",
                       param=f"{where}.content", code="invalid_value")


def _system_text(system: str | list[dict[str, Any]]) -> str:
    return system if isinstance(system, str) else _texts(system, "system", allowed=("text",))[0]


def _message(i: int, message: dict[str, Any]) -> list[dict[str, Any]]:
    where = f"messages.{i}"
    role = message.get("role")
    if role not in ROLES:
        raise APIError(400, f"{where}.role must be 'user' or 'assistant', got {role!r}", param=f"{where}.role",
                       code="invalid_value")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content blocks",
                       param=f"{where}.content", code="invalid_value")
    if role == "user":
        tools = [_tool_result(f"{where}.content.{j}", b) for j, b in enumerate(content)
                 if isinstance(b, dict) and b.get("type") == "tool_result"]
        text, _ = _texts([b for b in content if not (isinstance(b, dict) and b.get("type") == "tool_result")],
                         f"{where}.content", allowed=("text",))
        return tools + ([{"role": "user", "content": text}] if text or not tools else [])
    text, blocks = _texts(content, f"{where}.content", allowed=("text", "thinking", "redacted_thinking", "tool_use"))
    out: dict[str, Any] = {"role": "assistant", "content": text}
    thoughts = "".join(b.get("thinking") or "" for b in blocks if b.get("type") == "thinking")
    if thoughts:
        out["reasoning_content"] = thoughts
    calls = [_tool_use(f"{where}.content.{j}", b) for j, b in enumerate(content) if b.get("type") == "tool_use"]
    if calls:
        out["tool_calls"] = calls
    return [out]


def _texts(blocks: list[Any], where: str, *, allowed: tuple[str, ...]) -> tuple[str, list[dict[str, Any]]]:
    """The text blocks' text joined, and the blocks; a 400 for a block of another kind."""
    parts = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise APIError(400, f"{where}.{j}: {kind!r} content blocks are not supported here (supported: "
                                f"{', '.join(allowed)})", param=f"{where}.{j}", code="unsupported_content")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise APIError(400, f"{where}.{j}.text must be a string", param=f"{where}.{j}.text",
                               code="invalid_value")
            parts.append(block["text"])
    return "".join(parts), blocks


def _tool_result(where: str, block: dict[str, Any]) -> dict[str, Any]:
    content = block.get("content", "")
    text = content if isinstance(content, str) else _texts(content, f"{where}.content", allowed=("text",))[0]
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text}


def _tool_use(where: str, block: dict[str, Any]) -> dict[str, Any]:
    name, arguments = block.get("name"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise APIError(400, f"{where} must have a string name and an object input", param=where,
                       code="invalid_value")
    return {"id": str(block.get("id", "")), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, separators=(",", ":"),
                                                               ensure_ascii=False)}}


def tool_plan_of(body: CountTokensRequest, syntax: ToolSyntax) -> ToolPlan:
    """``tools`` and ``tool_choice`` as the OpenAI tools' plan; the tools' schemas are
    checked, so call it where ``validation.check_structured`` runs it (off the loop)."""
    tools = []
    for i, tool in enumerate(body.tools or ()):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(400, f"tools.{i}: only client tools (name, description, input_schema) are supported, "
                                f"not {kind!r}", param=f"tools.{i}", code="unsupported_tool")
        tools.append({"type": "function", "function": {"name": tool.get("name"), "description": tool.get("description"),
                                                       "parameters": tool.get("input_schema")}})
    choice = body.tool_choice
    kind = choice.get("type") if choice is not None else None
    translated: str | dict[str, Any] | None
    if choice is None:
        translated = None
    elif kind in ("auto", "none"):
        translated = kind
    elif kind == "any":
        translated = "required"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        translated = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise APIError(400, "tool_choice must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                            "{\"type\": \"tool\", \"name\": ...}", param="tool_choice", code="invalid_value")
    return tool_plan(tools, translated, syntax)


def _thinking(thinking: dict[str, Any] | None) -> bool | None:
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise APIError(400, "thinking.type must be 'enabled', 'adaptive' or 'disabled'", param="thinking.type",
                       code="invalid_value")
    return kind != "disabled"


def thinking_budget(thinking: dict[str, Any] | None, max_tokens: int | None) -> int | None:
    """``thinking.budget_tokens`` checked as Anthropic checks it: an integer of at least
    ``MIN_THINKING_BUDGET`` when thinking is ``enabled``, less than ``max_tokens``."""
    if thinking is None or thinking.get("type") != "enabled":
        return None
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise APIError(400, "thinking.enabled.budget_tokens: Field required (an integer)",
                       param="thinking.budget_tokens", code="invalid_value")
    if budget < MIN_THINKING_BUDGET:
        raise APIError(400, f"thinking.enabled.budget_tokens: Input should be greater than or equal to "
                            f"{MIN_THINKING_BUDGET}", param="thinking.budget_tokens", code="invalid_value")
    if max_tokens is not None and max_tokens <= budget:
        raise APIError(400, "`max_tokens` must be greater than `thinking.budget_tokens`",
                       param="max_tokens", code="invalid_value")
    return budget


def output_constraint(body: MessagesRequest) -> Constraint | None:
    """The constraint ``output_config.format`` asks for (None: free text). Builds and
    checks the schema's grammar: call it where ``validation.check_structured`` runs it."""
    fmt = (body.output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise APIError(400, 'output_config.format must be {"type": "json_schema", "schema": {...}}',
                       param="output_config.format", code="invalid_value")
    return schema_constraint(fmt.get("schema"), "output_config.format.schema")
