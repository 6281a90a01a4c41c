"""A tool call as the answer's parsers report it: the call so far, and the events of its stream.

Every syntax's parser (``tool_syntax.ToolCallParser`` for the JSON syntaxes,
``tool_syntax_xml.XmlToolCallParser`` for Qwen3-Coder's XML) reports the same events, so
every API's shape streams calls the same way whatever the model writes.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


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


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
