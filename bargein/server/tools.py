"""Tool calls on chat completions: ``tools`` + ``tool_choice`` in, ``tool_calls`` out.

The tool-call syntax is the one SmolLM2 and Hermes-style models are trained on: a call
is ``<tool_call>{"name":"f","arguments":{...}}</tool_call>`` in the answer's text.

- Prompt: when the chat template renders ``tools`` itself, it gets them; otherwise (the
  bundled SmolLM2 template ignores them) a system section lists the tools and the
  syntax. An assistant message's ``tool_calls`` are written back into its content in the
  same syntax (compact JSON, arguments verbatim), so a history that repeats an answer
  renders the answer's own text and stays token-exact; ``role: "tool"`` messages go
  through the template as they are.
- ``tool_choice``: ``none`` (the tools are listed, but the answer is not parsed), ``auto`` (the model may call; its
  text is parsed), ``required`` (exactly one call to one of the tools) or a named
  function (exactly one call to it). The last two constrain the answer with a grammar:
  the call syntax around the function's parameter schema.
- Output: :class:`ToolCallParser` turns the answer's text deltas into content and
  calls: a call's id and name as soon as its head is written, then its arguments piece
  by piece as they are generated; text that only looks like a call is content.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, replace
from typing import Any

from bargein.engine.constraint import Constraint
from bargein.engine.grammar import JSON_OPTIONS
from bargein.server.errors import APIError
from bargein.server.json_schema import strict_objects
from bargein.server.structured import schema_constraint
from bargein.server.tool_grammar_xml import required_parameters, xml_call_grammar
from bargein.server.tool_syntax import (
    HERMES,
    QWEN3_XML,
    ArgumentsDelta,
    CallEnd,
    CallStart,
    ToolCall,
    ToolCallParser,
    ToolEvent,
    ToolSyntax,
    tool_syntax_for,
)

OPEN, CLOSE = HERMES.open, HERMES.close
__all__ = ["ArgumentsDelta", "CallEnd", "CallStart", "Tool", "ToolCall", "ToolCallParser", "ToolEvent", "ToolPlan",
           "ToolSyntax", "prompt_messages", "tool_plan", "tool_syntax_for"]
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def call_schema(self, key: str = "arguments") -> dict[str, Any]:
        """``{"name": <this>, <key>: <parameters>}``, in that order (``key``: the syntax's); the
        arguments allow only declared properties unless the schema opens itself (``strict_objects``)."""
        return {"type": "object", "properties": {"name": {"const": self.name}, key: strict_objects(self.parameters)},
                "required": ["name", key], "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    """What the request's tools mean for this answer."""

    tools: tuple[Tool, ...]
    choice: str  # "none" | "auto" | "required" | "function"
    forced: str | None = None  # the named function
    syntax: ToolSyntax = HERMES  # how the model writes calls (tool_syntax.tool_syntax_for its template)

    @property
    def offered(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def constraint(self) -> Constraint | None:
        """The grammar for ``required`` and a named function: one call, arguments per schema."""
        key = self.syntax.arguments_key
        if self.choice == "required":
            schema = {"anyOf": [t.call_schema(key) for t in self.tools]}
        elif self.choice == "function":
            schema = next(t for t in self.tools if t.name == self.forced).call_schema(key)
        else:
            return None
        before, after = self.syntax.forced_lark()
        if self.syntax.name == QWEN3_XML.name:  # the model's own XML, not JSON inside the tags
            called = [(t.name, t.parameters) for t in self.tools if self.choice == "required" or t.name == self.forced]
            return Constraint("lark", xml_call_grammar(called, before, after), xml_call=required_parameters(called))
        # Compact JSON, as in response_format: one spelling, which the history re-renders.
        body = json.dumps({**schema, "x-guidance": dict(JSON_OPTIONS)}, separators=(",", ":"))
        outer = " ".join(part for part in (before, "call", after) if part)
        return Constraint("lark", f"start: {outer}\ncall: %json {body}\n")


def tool_plan(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
              syntax: ToolSyntax = HERMES) -> ToolPlan:
    """Validates ``tools`` and ``tool_choice``; a 400 names the first bad field."""
    parsed = tuple(_tool(i, t) for i, t in enumerate(tools or ()))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise APIError(400, "tools must have distinct function names", param="tools", code="invalid_value")
    syntax = replace(syntax, schemas={t.name: t.parameters for t in parsed})  # the XML syntax coerces by them
    choice = tool_choice if tool_choice is not None else ("auto" if parsed else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}",
                           param="tool_choice", code="invalid_value")
        if choice == "required" and not parsed:
            raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice", code="invalid_value")
        return ToolPlan(parsed, choice, syntax=syntax)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(400, 'tool_choice must be {"type": "function", "function": {"name": ...}}',
                       param="tool_choice", code="invalid_value")
    if name not in names:
        raise APIError(400, f"tool_choice names function {name!r}, which is not in tools", param="tool_choice",
                       code="invalid_value")
    return ToolPlan(parsed, "function", name, syntax=syntax)


def _tool(i: int, raw: Any) -> Tool:
    param = f"tools.{i}"
    fn = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or raw.get("type", "function") != "function" or not isinstance(fn, dict):
        raise APIError(400, f"{param} must be {{\"type\": \"function\", \"function\": {{...}}}}", param=param,
                       code="invalid_value")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise APIError(400, f"{param}.function.name must be 1-64 letters, digits, _ or -", param=f"{param}.function.name",
                       code="invalid_value")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise APIError(400, f"{param}.function.parameters must be a JSON Schema object",
                       param=f"{param}.function.parameters", code="invalid_value")
    schema_constraint(parameters, f"{param}.function.parameters")  # the schema limits and the grammar engine's check
    return Tool(name, str(fn.get("description") or ""), parameters)


def system_section(tools: tuple[Tool, ...]) -> str:
    listed = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                                  ensure_ascii=False) for t in tools)
    return ("You may call these functions:\n<tools>\n" + listed + "\n</tools>\n"
            f'To call one, answer with {OPEN}{{"name":<function name>,"arguments":<arguments object>}}{CLOSE}')


def prompt_messages(messages: list[dict[str, Any]], plan: ToolPlan, template: str | None
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (and ``tools`` for the template) to render for this plan."""
    renders_calls = template is not None and "tool_calls" in template
    out = [_calls_for_template(m) if renders_calls else _with_calls_in_content(m, plan.syntax) for m in messages]
    if not plan.tools:  # with tool_choice "none" the tools are still shown: the prompt stays the same
        return out, None
    raw_tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                    "parameters": t.parameters}} for t in plan.tools]
    if template is not None and "tools" in template:
        return out, raw_tools
    section = system_section(plan.tools)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}"}
    else:
        out.insert(0, {"role": "system", "content": section})
    return out, None


def _calls_for_template(message: dict[str, Any]) -> dict[str, Any]:
    """For a template that renders ``tool_calls`` itself: arguments as objects, as such
    templates take them (``tool_call.arguments | tojson``); text arguments that are not
    JSON stay text."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    out = []
    for call in calls:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = fn.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        out.append({**call, "function": {**fn, "arguments": arguments}})
    return {**message, "tool_calls": out}


def _with_calls_in_content(message: dict[str, Any], syntax: ToolSyntax) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` written back into its text, as the model wrote
    them (for a template that does not render them: the bundled SmolLM2's)."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    written = []
    for call in calls:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = fn.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments if arguments is not None else {}, separators=(",", ":"))
        written.append((str(fn.get("name", "")), arguments))
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": (message.get("content") or "") + syntax.write(written)}


