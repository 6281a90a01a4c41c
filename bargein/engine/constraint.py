"""Constraint: what a constrained request's output must match (plain data, no torch).

Carried by ``SamplingParams.constraint``; the engine compiles it with the grammar engine
(:mod:`bargein.engine.grammar`). Hashable and compared by value (its text, and the
XML-call hint that goes with that text): the key of the compiled-grammar cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

ANY_JSON_OBJECT = '{"type":"object"}'


@dataclass(frozen=True)
class Constraint:
    """``kind`` ``json_schema``: ``text`` is a JSON Schema (key order kept: properties are
    generated in the order given). ``lark``: ``text`` is a Lark grammar in llguidance's
    dialect (``%json {...}`` embeds a schema), used for tool calls.

    ``xml_call``: set for a forced call in Qwen3-Coder's XML (``server/tool_grammar_xml``):
    per tool name, its required parameters in the order the grammar writes them, so that
    the engine can steer the call to close within its budget (``engine/xml_steering``)."""

    kind: Literal["json_schema", "lark"]
    text: str
    xml_call: tuple[tuple[str, tuple[str, ...]], ...] | None = None

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Constraint:
        text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_schema", ANY_JSON_OBJECT)
