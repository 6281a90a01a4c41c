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

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from bargein.engine.constraint import Constraint
from bargein.engine.grammar import JSON_OPTIONS
from bargein.server.errors import APIError
from bargein.server.json_schema import strict_objects
from bargein.server.structured import schema_constraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def call_schema(self) -> dict[str, Any]:
        """``{"name": <this>, "arguments": <parameters>}``, in that order; the arguments
        allow only declared properties unless the schema opens itself (``strict_objects``)."""
        return {"type": "object", "properties": {"name": {"const": self.name}, "arguments": strict_objects(self.parameters)},
                "required": ["name", "arguments"], "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    """What the request's tools mean for this answer."""

    tools: tuple[Tool, ...]
    choice: str  # "none" | "auto" | "required" | "function"
    forced: str | None = None  # the named function

    @property
    def offered(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def constraint(self) -> Constraint | None:
        """The grammar for ``required`` and a named function: one call, arguments per schema."""
        if self.choice == "required":
            schema = {"anyOf": [t.call_schema() for t in self.tools]}
        elif self.choice == "function":
            schema = next(t for t in self.tools if t.name == self.forced).call_schema()
        else:
            return None
        # Compact JSON, as in response_format: one spelling, which the history re-renders.
        body = json.dumps({**schema, "x-guidance": dict(JSON_OPTIONS)}, separators=(",", ":"))
        return Constraint("lark", f'start: "{OPEN}" call "{CLOSE}"\ncall: %json {body}\n')


def tool_plan(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> ToolPlan:
    """Validates ``tools`` and ``tool_choice``; a 400 names the first bad field."""
    parsed = tuple(_tool(i, t) for i, t in enumerate(tools or ()))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise APIError(400, "tools must have distinct function names", param="tools", code="invalid_value")
    choice = tool_choice if tool_choice is not None else ("auto" if parsed else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}",
                           param="tool_choice", code="invalid_value")
        if choice == "required" and not parsed:
            raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice", code="invalid_value")
        return ToolPlan(parsed, choice)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(400, 'tool_choice must be {"type": "function", "function": {"name": ...}}',
                       param="tool_choice", code="invalid_value")
    if name not in names:
        raise APIError(400, f"tool_choice names function {name!r}, which is not in tools", param="tool_choice",
                       code="invalid_value")
    return ToolPlan(parsed, "function", name)


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
    out = [_with_calls_in_content(m) for m in messages]
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


def _with_calls_in_content(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    text = message.get("content") or ""
    for call in calls:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = fn.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments if arguments is not None else {}, separators=(",", ":"))
        text += f'{OPEN}{{"name":{json.dumps(fn.get("name", ""))},"arguments":{arguments}}}{CLOSE}'
    return {**message, "content": text}


@dataclass
class ToolCall:
    index: int
    name: str
    arguments: str  # the JSON text as the model wrote it (so far, while the call streams)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    done: bool = False  # its closing tag arrived

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallStart:
    """A call begins: its id and name are known, its arguments not yet."""

    call: ToolCall


@dataclass(frozen=True)
class ArgumentsDelta:
    """The next piece of call ``index``'s arguments text, as generated."""

    index: int
    text: str


@dataclass(frozen=True)
class CallEnd:
    """Call ``index``'s closing tag arrived: its arguments are complete."""

    index: int


ToolEvent = str | CallStart | ArgumentsDelta | CallEnd  # a str is content text

# The head of a call written name first: from it on, the call streams. Anything else
# (arguments first, an unknown name) is held until the closing tag and judged whole.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


class ToolCallParser:
    """Splits an answer's text, delta by delta, into content and tool calls, in order.

    A call written ``<tool_call>{"name":"f","arguments":...`` with a known ``f`` starts
    as soon as that head has arrived (:class:`CallStart`), its arguments follow as they
    are generated (:class:`ArgumentsDelta`, verbatim, up to the end of the arguments
    value), and :class:`CallEnd` comes with the closing tag. Once started, a call stays a
    call: an answer cut inside it (``length``, a cancel) keeps it with the arguments so
    far. Text that only looks like a call (an unknown name, no closing tag, not JSON) is
    content. The result does not depend on how the text is split into deltas, so a
    stream and a non-streamed body of the same answer agree.
    """

    def __init__(self, names: set[str]):
        self.names = names
        self.calls: list[ToolCall] = []
        self.content: list[str] = []
        self._held = ""  # text that may still become (or is inside) a call
        self._state = "content"  # content | head (after OPEN) | arguments | tail (after the arguments)
        self._scan = _ValueScanner()

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolEvent]]:
        """The content and the events ``text`` completes (content included, in order);
        ``final`` flushes what is held."""
        buf, events = self._held + text, []
        while True:
            if self._state == "content":
                at = buf.find(OPEN)
                if at < 0:
                    keep = 0 if final else _partial_suffix(buf, OPEN)
                    events.append(buf[:len(buf) - keep])
                    buf = buf[len(buf) - keep:]
                    break
                events.append(buf[:at])
                buf, self._state = buf[at:], "head"
            if self._state == "head":
                call = self._start(buf[len(OPEN):])
                if call is not None:
                    head = _HEAD.match(buf, len(OPEN))
                    assert head is not None
                    events.append(CallStart(call))
                    buf, self._state, self._scan = buf[head.end():], "arguments", _ValueScanner()
                    continue
                end = buf.find(CLOSE)
                if end < 0:
                    if final:
                        events.append(buf)
                        buf = ""
                    break
                whole = buf[:end + len(CLOSE)]
                call = self._parse(whole[len(OPEN):-len(CLOSE)])
                if call is None:
                    events.append(whole)
                else:
                    self.calls.append(call)
                    events += [CallStart(ToolCall(call.index, call.name, "", call.id)),
                               ArgumentsDelta(call.index, call.arguments), CallEnd(call.index)]
                    call.done = True
                buf, self._state = buf[len(whole):], "content"
                continue
            call = self.calls[-1]
            if self._state == "arguments":
                used = self._scan.feed(buf)
                piece = buf[:used]
                if not call.arguments:
                    piece = piece.lstrip()
                if piece:
                    call.arguments += piece
                    events.append(ArgumentsDelta(call.index, piece))
                buf = buf[used:]
                if not self._scan.ended:
                    break
                self._state = "tail"
            end = buf.find(CLOSE)  # the tail: the closing brace, then the tag
            if end < 0:
                break
            buf, self._state, call.done = buf[end + len(CLOSE):], "content", True
            events.append(CallEnd(call.index))
        self._held = buf
        events = [e for e in events if e != ""]
        content = "".join(e for e in events if isinstance(e, str))
        self.content.append(content)
        return content, events

    def _start(self, after_open: str) -> ToolCall | None:
        """The call whose head ``after_open`` begins with, if that head is complete and
        names a known function."""
        head = _HEAD.match(after_open)
        if head is None:
            return None
        try:
            name = json.loads(head.group(1))
        except json.JSONDecodeError:
            return None
        if name not in self.names:
            return None
        call = ToolCall(len(self.calls), name, "")
        self.calls.append(call)
        return call

    def _parse(self, body: str) -> ToolCall | None:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names or not isinstance(
                value.get("arguments"), dict):
            return None
        return ToolCall(len(self.calls), value["name"], _raw_arguments(body, value["arguments"]))

    @property
    def text(self) -> str:
        return "".join(self.content)


class _ValueScanner:
    """Finds where one JSON value ends in text that arrives in pieces (strings and
    nesting aware; a bare scalar ends before ``,``, ``}`` or white space)."""

    def __init__(self) -> None:
        self.depth = 0
        self.started = False
        self.in_string = False
        self.escape = False
        self.ended = False

    def feed(self, text: str) -> int:
        """How many characters of ``text`` belong to the value (all, unless it ends in it)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return self._end(i + 1)
                continue
            if not self.started:
                if ch.isspace():
                    continue
                self.started = True
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                if self.depth == 0:  # a bare scalar ended at the enclosing object's brace
                    return self._end(i)
                self.depth -= 1
                if self.depth == 0:
                    return self._end(i + 1)
            elif self.depth == 0 and (ch == "," or ch.isspace()):
                return self._end(i)
        return len(text)

    def _end(self, used: int) -> int:
        self.ended = True
        return used


def _raw_arguments(body: str, arguments: dict[str, Any]) -> str:
    """The arguments object's text as written (re-rendering it would change numbers' spelling)."""
    key = body.find('"arguments"')
    start = body.find(":", key) + 1 if key >= 0 else -1
    if start > 0:
        decoder = json.JSONDecoder()
        rest = body[start:]
        offset = len(rest) - len(rest.lstrip())
        try:
            _, end = decoder.raw_decode(rest, offset)
            return rest[offset:end]
        except json.JSONDecodeError:
            pass
    return json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
