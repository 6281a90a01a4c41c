"""Tool calls in each model family's own syntax, parsed from the answer's text as it streams.

The syntax is chosen from the chat template's conventions (:func:`tool_syntax_for`):

- ``hermes``: ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, one tag per
  call, text allowed between them: Hermes, SmolLM2 (whose template is given the syntax in
  a system section), Qwen2.5 and Qwen3 (the same tags, the JSON on its own line);
- ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``, a list after the
  marker, to the answer's end;
- ``llama3``: Llama 3.1-3.3's JSON calls, ``{"name": "f", "parameters": {...}}`` as the
  whole answer (several joined by ``;``), optionally after ``<|python_tag|>``;
- ``qwen3_xml``: Qwen3-Coder's ``<tool_call><function=f><parameter=p>value</parameter>
  </function></tool_call>``, parameters coerced to their schema's types
  (``tool_syntax_xml``).

:func:`call_parser` gives the syntax's parser. :class:`ToolCallParser` (the JSON
syntaxes) turns the answer's text deltas into content and calls: a call's
id and name as soon as its head is written, then its arguments piece by piece as they
are generated, then its end. Text that only looks like a call is content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from bargein.server.control_markers import marker_token_id
from bargein.server.tool_events import (
    ArgumentsDelta,
    CallEnd,
    CallStart,
    ToolCall,
    ToolEvent,
    partial_suffix,
)
from bargein.server.tool_syntax_xml import XmlToolCallParser, write_xml

__all__ = ["HERMES", "LLAMA3", "MISTRAL", "QWEN3_XML", "ArgumentsDelta", "CallEnd", "CallStart", "ToolCall",
           "ToolCallParser", "ToolEvent", "ToolSyntax", "XmlToolCallParser", "call_parser", "tool_syntax_for"]


@dataclass(frozen=True)
class ToolSyntax:
    """How one family writes tool calls."""

    name: str  # "hermes" | "mistral" | "llama3" | "qwen3_xml"
    open: str  # the marker before a call (hermes) or before the calls (mistral, llama3)
    close: str | None  # the marker after each call; None: JSON objects to the answer's end
    arguments_key: str = "arguments"
    bare_start: bool = False  # an answer that begins with a call's JSON needs no marker (llama3)
    # The offered tools' parameter schemas by name (``tools.tool_plan`` binds them): the XML
    # syntax coerces parameter values to their types.
    schemas: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    # The model's tokenizer (``tool_syntax_for`` binds it): a forced call writes each marker
    # that is one token of its vocabulary as that token (``open_token``, ``close_token``).
    tokenizer: Any = field(default=None, compare=False, hash=False, repr=False)

    @property
    def open_token(self) -> int | None:
        """The id of ``open`` where it is one token (Qwen's <tool_call>, Mistral's special
        [TOOL_CALLS]); encoded only when a forced call asks, never per request."""
        return marker_token_id(self.tokenizer, self.open)

    @property
    def close_token(self) -> int | None:
        return marker_token_id(self.tokenizer, self.close)

    def write(self, calls: list[tuple[str, str]]) -> str:
        """Calls ``(name, arguments JSON)`` written in this syntax (compact, arguments verbatim)."""
        if self.name == "qwen3_xml":
            return write_xml(calls)
        bodies = [f'{{"name":{json.dumps(name)},"{self.arguments_key}":{arguments}}}' for name, arguments in calls]
        if self.close is not None:
            return "".join(f"{self.open}{body}{self.close}" for body in bodies)
        return f"{self.open}[{','.join(bodies)}]" if self.name == "mistral" else ";".join(bodies)

    def forced_frame(self) -> tuple[str, str]:
        """The text around one forced call's JSON (``tool_choice`` required or named)."""
        if self.close is not None:
            return self.open, self.close
        return (self.open + "[", "]") if self.name == "mistral" else ("", "")

    def forced_lark(self) -> tuple[str, str]:
        """``forced_frame`` as Lark expressions: text as literals, the markers as their
        tokens where each is one token (``open_token``, ``close_token``)."""
        before, after = self.forced_frame()
        head = tail = ""
        open_token, close_token = self.open_token, self.close_token
        if open_token is not None and before.startswith(self.open):
            head, before = f"<[{open_token}]>", before[len(self.open):]
        if close_token is not None and self.close and after.endswith(self.close):
            after, tail = after[:-len(self.close)], f"<[{close_token}]>"
        return (" ".join(p for p in (head, _lark_literal(before)) if p),
                " ".join(p for p in (_lark_literal(after), tail) if p))


def _lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if text else ""


HERMES = ToolSyntax("hermes", "<tool_call>", "</tool_call>")
MISTRAL = ToolSyntax("mistral", "[TOOL_CALLS]", None)
LLAMA3 = ToolSyntax("llama3", "<|python_tag|>", None, arguments_key="parameters", bare_start=True)
QWEN3_XML = ToolSyntax("qwen3_xml", "<tool_call>", "</tool_call>")  # a forced call: its XML (tool_grammar_xml)
SYNTAXES = {s.name: s for s in (HERMES, MISTRAL, LLAMA3, QWEN3_XML)}


def tool_syntax_for(template: str | None, tokenizer: Any = None) -> ToolSyntax:
    """The syntax the chat template's model is trained on (Hermes when the template says
    none); given the ``tokenizer``, bound to it (``ToolSyntax.open_token``)."""
    syntax = _family(template or "")
    return syntax if tokenizer is None else replace(syntax, tokenizer=tokenizer)


def _family(source: str) -> ToolSyntax:
    if "<function=" in source and "<parameter=" in source:
        return QWEN3_XML
    if "[TOOL_CALLS]" in source:
        return MISTRAL
    if "<|python_tag|>" in source or ("ipython" in source and '"parameters"' in source):
        return LLAMA3
    return HERMES


def _head(key: str) -> re.Pattern[str]:
    """The head of a call written name first: from it on, the call streams."""
    return re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"' + key + r'"\s*:\s*')


_SEPARATORS = " \t\r\n[,;"  # between the calls of a JSON list or a ``;``-joined run


class ToolCallParser:
    """Splits an answer's text, delta by delta, into content and tool calls, in order.

    A call whose head (``{"name": "f", "arguments":`` in the syntax's spelling) names a
    known ``f`` starts as soon as that head has arrived (:class:`CallStart`), its
    arguments follow as they are generated (:class:`ArgumentsDelta`, verbatim, up to the
    end of the arguments value), and :class:`CallEnd` comes with the end of the call
    (the closing tag, or the JSON object's brace). Once started, a call stays a call: an
    answer cut inside it (``length``, a cancel) keeps it with the arguments so far. Any
    other head (arguments first, an unknown name) is held until the call's end and judged
    whole; text that only looks like a call is content. The result does not depend on how
    the text is split into deltas, so a stream and a non-streamed body agree.
    """

    def __init__(self, names: set[str], syntax: ToolSyntax | None = None):
        self.names = names
        self.syntax = syntax or HERMES
        self.calls: list[ToolCall] = []
        self.content: list[str] = []
        self._head = _head(self.syntax.arguments_key)
        self._held = ""  # text that may still become (or is inside) a call
        self._state = "content"  # content | head (after the marker) | arguments | tail (after the arguments)
        self._marker = ""  # the marker that opened the JSON calls, written back if they are none
        self._begun = False  # some text of the answer went out (a bare call can no longer start)
        self._scan = _ValueScanner()

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolEvent]]:
        """The content and the events ``text`` completes (content included, in order);
        ``final`` flushes what is held."""
        buf, events = self._held + text, []
        while True:
            if self._state == "content":
                buf, more = self._content(buf, events, final)
                if not more:
                    break
            if self._state == "head":
                buf, more = (self._tagged_head(buf, events, final) if self.syntax.close is not None
                             else self._json_head(buf, events, final))
                if not more:
                    break
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
            end_tag = self.syntax.close if self.syntax.close is not None else "}"
            end = buf.find(end_tag)  # the tail: the call object's rest, then the tag or its brace
            if end < 0:
                break
            buf, self._state, call.done = buf[end + len(end_tag):], "head" if self.syntax.close is None else "content", True
            events.append(CallEnd(call.index))
        self._held = buf
        events = [e for e in events if e != ""]
        content = "".join(e for e in events if isinstance(e, str))
        self.content.append(content)
        return content, events

    def _content(self, buf: str, events: list[ToolEvent], final: bool) -> tuple[str, bool]:
        """Content up to the next call's marker; True when one was found (state ``head``)."""
        syntax = self.syntax
        if syntax.bare_start and not self._begun:
            stripped = buf.lstrip()
            if stripped.startswith("{"):
                self._begun, self._marker, self._state = True, buf[:len(buf) - len(stripped)], "head"
                return stripped, True
            if not stripped and not final:
                return buf, False  # only spaces yet: a bare call may still begin
            self._begun = bool(stripped) or final
        at = buf.find(syntax.open)
        if at < 0:
            keep = 0 if final else partial_suffix(buf, syntax.open)
            self._emit(events, buf[:len(buf) - keep])
            return buf[len(buf) - keep:], False
        self._emit(events, buf[:at])
        self._begun, self._state = True, "head"
        if syntax.close is None:
            self._marker = syntax.open
            return buf[at + len(syntax.open):], True
        return buf[at:], True

    def _emit(self, events: list[ToolEvent], text: str) -> None:
        if text:
            self._begun = True
            events.append(text)

    def _tagged_head(self, buf: str, events: list[ToolEvent], final: bool) -> tuple[str, bool]:
        """After an opening tag (``buf`` starts with it): a streaming call, a whole one, or content."""
        open_, close = self.syntax.open, self.syntax.close
        assert close is not None
        call = self._start(buf[len(open_):])
        if call is not None:
            head = self._head.match(buf, len(open_))
            assert head is not None
            events.append(CallStart(call))
            self._state, self._scan = "arguments", _ValueScanner()
            return buf[head.end():], True
        end = buf.find(close)
        if end < 0:
            if final:
                events.append(buf)
                buf = ""
            return buf, False
        whole = buf[:end + len(close)]
        self._judge_whole(whole[len(open_):-len(close)], whole, events)
        self._state = "content"
        return buf[len(whole):], True

    def _json_head(self, buf: str, events: list[ToolEvent], final: bool) -> tuple[str, bool]:
        """Between JSON calls: the next call's head, the end of the list, or content again."""
        rest = buf.lstrip(_SEPARATORS)
        if rest.startswith("]"):
            self._state, self._marker = "content", ""
            return rest[1:], True
        call = self._start(rest) if rest.startswith("{") else None
        if call is not None:
            head = self._head.match(rest)
            assert head is not None
            events.append(CallStart(call))
            self._state, self._scan, self._marker = "arguments", _ValueScanner(), ""
            return rest[head.end():], True
        if rest and not rest.startswith("{"):  # not a call: the text (and an unused marker) is content
            events.append(self._marker + buf)
            self._state, self._marker = "content", ""
            return "", False
        if not final:
            return buf, False  # a head still arriving (or one judged whole at the end)
        whole = rest.rstrip().removesuffix("]")  # a list's end after a call judged whole
        if whole:
            self._judge_whole(whole, self._marker + buf, events)
        self._state, self._marker = "content", ""
        return "", False

    def _judge_whole(self, body: str, written: str, events: list[ToolEvent]) -> None:
        call = self._parse(body)
        if call is None:
            events.append(written)
            return
        self.calls.append(call)
        events += [CallStart(ToolCall(call.index, call.name, "", call.id)), ArgumentsDelta(call.index, call.arguments),
                   CallEnd(call.index)]
        call.done = True

    def _start(self, after_open: str) -> ToolCall | None:
        """The call whose head ``after_open`` begins with, if that head is complete and
        names a known function."""
        head = self._head.match(after_open)
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
        return json_call(body, self.names, self.syntax.arguments_key, len(self.calls))

    @property
    def text(self) -> str:
        return "".join(self.content)


def json_call(body: str, names: set[str] | Mapping[str, Any], key: str, index: int) -> ToolCall | None:
    """A call written whole as JSON (``{"name": ..., <key>: {...}}``) naming a known tool, or None."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names or not isinstance(value.get(key), dict):
        return None
    return ToolCall(index, value["name"], _raw_arguments(body, value[key], key))


def call_parser(names: set[str], syntax: ToolSyntax | None = None) -> ToolCallParser | XmlToolCallParser:
    """The parser of ``syntax``'s calls to the tools ``names`` (both report the same events)."""
    syntax = syntax or HERMES
    if syntax.name == QWEN3_XML.name:
        schemas = {name: syntax.schemas.get(name, {}) for name in names}
        return XmlToolCallParser(schemas, lambda body, index: json_call(body, names, syntax.arguments_key, index),
                                 syntax.open, syntax.close or "")
    return ToolCallParser(names, syntax)


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


def _raw_arguments(body: str, arguments: dict[str, Any], name: str = "arguments") -> str:
    """The arguments object's text as written (re-rendering it would change numbers' spelling)."""
    key = body.find(f'"{name}"')
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
