"""Qwen3-Coder's XML tool calls, parsed from the answer's text as it streams::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Oslo
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A call's arguments come out as the JSON object the other syntaxes give (``{"city":
"Oslo", "days": 3}``): each parameter's text (one newline around it dropped, as the
template writes it) is coerced to the type its tool's schema declares (``coerce``):
integers, numbers, booleans, null, objects and arrays from their JSON spelling, strings as
written; a value that does not read as its type, or a parameter the schema does not
declare, stays a string.

:class:`XmlToolCallParser` reports the events of ``tool_events``: the call's start once
``<function=NAME>`` names a known tool, each parameter as one arguments piece once its
closing tag arrives, the object's end at ``</function>``, the call's end at the closing
tag. Inside ``<tool_call>`` the model may write a JSON call instead (Qwen3's own syntax):
it is judged whole at the closing tag. A forced call is written in the XML
(``tool_grammar_xml``). Text that
only looks like a call is content. The result does not depend on how the text is split.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from bargein.server.tool_events import (
    ArgumentsDelta,
    CallEnd,
    CallStart,
    ToolCall,
    ToolEvent,
    partial_suffix,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def write_xml(calls: list[tuple[str, str]]) -> str:
    """Calls ``(name, arguments JSON)`` in Qwen3-Coder's layout (strings as written, other
    values as compact JSON); arguments that are not a JSON object are one ``arguments``
    parameter."""
    out = []
    for name, arguments in calls:
        try:
            values = json.loads(arguments)
        except json.JSONDecodeError:
            values = {"arguments": arguments}
        if not isinstance(values, dict):
            values = {"arguments": values}
        params = "".join(f"{PARAMETER}{key}>\n{_spelled(value)}\n{PARAMETER_END}\n" for key, value in values.items())
        out.append(f"{OPEN}\n{FUNCTION}{name}>\n{params}{FUNCTION_END}\n{CLOSE}")
    return "\n".join(out)


def _spelled(value: Any) -> str:
    return value if isinstance(value, str) else _compact(value)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def coerce(text: str, schema: Any) -> Any:
    """A parameter's text as the type ``schema`` declares (a string when it declares none,
    or when the text does not read as any type it allows)."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or ())
    if not kinds and isinstance(schema, dict) and "enum" in schema:
        kinds = sorted({_json_kind(v) for v in schema["enum"]})
    for kind in kinds:
        if kind == "string":
            return text
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            continue
        if _json_kind(value) == kind or (kind == "number" and _json_kind(value) == "integer"):
            return value
    return text


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "string")


def _value(raw: str) -> str:
    """A parameter's text without the one newline the layout puts on each side."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


class XmlToolCallParser:
    """Splits an answer's text, delta by delta, into content and XML tool calls, in order.

    ``schemas``: each known tool's parameters schema, by name (the types to coerce to).
    ``judge_json(body, index)``: a JSON call body inside the tags as a ToolCall, or None.
    """

    def __init__(self, schemas: Mapping[str, Any], judge_json: Any, open_tag: str = OPEN, close_tag: str = CLOSE):
        self.open, self.close = open_tag, close_tag  # the call's tags (control_markers may tag them)
        self.schemas = schemas
        self.judge_json = judge_json
        self.calls: list[ToolCall] = []
        self.content: list[str] = []
        self._held = ""
        self._state = "content"  # content | head (after <tool_call>) | params | tail (after </function>)
        self._written = 0  # parameters written into the open call's arguments

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolEvent]]:
        """The content and the events ``text`` completes; ``final`` flushes what is held."""
        buf, events = self._held + text, []
        while True:
            step = getattr(self, "_" + self._state)
            buf, more = step(buf, events, final)
            if not more:
                break
        self._held = buf
        content = "".join(e for e in events if isinstance(e, str))
        self.content.append(content)
        return content, [e for e in events if e != ""]

    @property
    def text(self) -> str:
        return "".join(self.content)

    def _content(self, buf: str, events: list[ToolEvent], final: bool) -> tuple[str, bool]:
        at = buf.find(self.open)
        if at < 0:
            keep = 0 if final else partial_suffix(buf, self.open)
            events.append(buf[:len(buf) - keep])
            return buf[len(buf) - keep:], False
        events.append(buf[:at])
        self._state = "head"
        return buf[at:], True

    def _head(self, buf: str, events: list[ToolEvent], final: bool) -> tuple[str, bool]:
        """``buf`` starts with ``<tool_call>``: an XML call that streams, or a body judged whole."""
        rest = buf[len(self.open):].lstrip()
        if rest.startswith(FUNCTION) and ">" in rest:
            name = rest[len(FUNCTION):rest.index(">")]
            if name in self.schemas:
                call = ToolCall(len(self.calls), name, "")
                self.calls.append(call)
                events.append(CallStart(call))
                self._state, self._written = "params", 0
                return rest[rest.index(">") + 1:], True
        elif not final and (not rest or FUNCTION.startswith(rest[:len(FUNCTION)])) and ">" not in rest:
            return buf, False  # the head is still arriving
        end = buf.find(self.close)
        if end < 0:  # something else: held until the closing tag, then judged whole
            if final:
                events.append(buf)
                return "", False
            return buf, False
        whole = buf[:end + len(self.close)]
        self._judge_whole(whole[len(self.open):-len(self.close)], whole, events)
        self._state = "content"
        return buf[len(whole):], True

    def _params(self, buf: str, events: list[ToolEvent], final: bool) -> tuple[str, bool]:
        call = self.calls[-1]
        rest = buf.lstrip()
        if rest.startswith(FUNCTION_END):
            self._piece(call, "}" if self._written else "{}", events)
            self._state = "tail"
            return rest[len(FUNCTION_END):], True
        if rest.startswith(PARAMETER):
            head_end, end = rest.find(">"), rest.find(PARAMETER_END)
            if head_end >= 0 and end > head_end:
                name = rest[len(PARAMETER):head_end]
                schema = ((self.schemas.get(call.name) or {}).get("properties") or {}).get(name)
                value = coerce(_value(rest[head_end + 1:end]), schema)
                self._piece(call, ("," if self._written else "{") + _compact(name) + ":" + _compact(value), events)
                self._written += 1
                return rest[end + len(PARAMETER_END):], True
        elif rest and not FUNCTION_END.startswith(rest[:len(FUNCTION_END)]) \
                and not PARAMETER.startswith(rest[:len(PARAMETER)]):
            at = rest.find("<", 1)  # stray text between parameters: not part of the arguments
            return (rest[at:], True) if at >= 0 else ("", False)
        if final:  # cut inside the call: it stays a call, with the parameters that were complete
            return "", False
        return buf, False

    def _tail(self, buf: str, events: list[ToolEvent], final: bool) -> tuple[str, bool]:
        end = buf.find(self.close)
        if end < 0 and not final:
            return buf, False
        call = self.calls[-1]
        call.done = True
        events.append(CallEnd(call.index))
        self._state = "content"
        return (buf[end + len(self.close):], True) if end >= 0 else ("", False)

    def _piece(self, call: ToolCall, text: str, events: list[ToolEvent]) -> None:
        call.arguments += text
        events.append(ArgumentsDelta(call.index, text))

    def _judge_whole(self, body: str, written: str, events: list[ToolEvent]) -> None:
        call = self.judge_json(body.strip(), len(self.calls))  # an XML head would have streamed
        if call is None:
            events.append(written)
            return
        self.calls.append(call)
        call.done = True
        events += [CallStart(ToolCall(call.index, call.name, "", call.id)), ArgumentsDelta(call.index, call.arguments),
                   CallEnd(call.index)]
