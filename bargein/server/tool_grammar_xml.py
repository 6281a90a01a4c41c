"""The grammar of a forced tool call in Qwen3-Coder's XML (``tool_syntax_xml``), so that a
``required`` or named ``tool_choice`` is written in the model's own syntax, the one its
template renders and :class:`~bargein.server.tool_syntax_xml.XmlToolCallParser` reads::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Oslo
    </parameter>
    </function>
    </tool_call>

Parameters follow the schema's ``properties`` in their order, each required one once and
each optional one at most once; no other parameter unless the schema opens itself
(``json_schema.strict_objects``: ``additionalProperties`` and the like), when parameters
of other names may follow, with text values. A value is written as
``XmlToolCallParser`` coerces it back (``tool_syntax_xml.coerce``):

- a string (``"type": "string"``): the text as is, never holding ``</parameter>``, within
  ``minLength``/``maxLength`` and ``pattern``; a string ``enum`` or ``const``: one of its
  values, as is;
- any other type (numbers, booleans, null, objects, arrays, a schema with no type): its
  compact JSON, constrained by the schema (``%json``, the strict reading, the root's
  ``$defs`` carried along);
- a ``type`` list: any of its types, each written as above.

The call's tags are the syntax's (``ToolSyntax.forced_lark``: each as its token where it
is one token of the vocabulary).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from bargein.engine.grammar import JSON_OPTIONS
from bargein.server.json_schema import strict_objects
from bargein.server.tool_syntax_xml import FUNCTION, FUNCTION_END, PARAMETER, PARAMETER_END

VALUE_END = "\n" + PARAMETER_END + "\n"
_NO_END = r"~/(?s:.*)" + re.escape(PARAMETER_END).replace("/", r"\/") + r"(?s:.*)/"
_DEFS = ("$defs", "definitions")


def xml_call_grammar(tools: Sequence[tuple[str, dict[str, Any]]], open_marker: str, close_marker: str) -> str:
    """A Lark grammar (llguidance's dialect) for one call to one of ``tools`` (name,
    parameters schema), between ``open_marker`` and ``close_marker`` (Lark expressions:
    the call's tags, ``ToolSyntax.forced_lark``)."""
    rules = ["start: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, (name, parameters) in enumerate(tools):
        schema = strict_objects(parameters)
        head = _literal(f"\n{FUNCTION}{name}>\n")
        params, more = _parameters(i, schema)
        parts = [open_marker, head, params, _literal(FUNCTION_END + "\n"), close_marker]
        rules.append(f"call_{i}: " + " ".join(part for part in parts if part))
        rules += more
    return "\n".join(rules) + "\n"


def required_parameters(tools: Sequence[tuple[str, dict[str, Any]]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Per tool, the required parameters ``xml_call_grammar`` writes, in its order (for
    ``Constraint.xml_call``: the engine steers the call to close within its budget)."""
    out = []
    for name, parameters in tools:
        properties = parameters.get("properties") if isinstance(parameters.get("properties"), dict) else {}
        required = parameters.get("required") if isinstance(parameters.get("required"), list) else []
        out.append((name, tuple(key for key in properties if key in required)))
    return tuple(out)


def _parameters(i: int, schema: dict[str, Any]) -> tuple[str, list[str]]:
    """The parameters' expression of tool ``i`` and the rules it uses."""
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = set(schema.get("required") or ()) if isinstance(schema.get("required"), list) else set()
    defs = {key: schema[key] for key in _DEFS if isinstance(schema.get(key), dict)}
    parts, rules = [], []
    for j, (name, prop) in enumerate(properties.items()):
        rule = f"p_{i}_{j}"
        value, more = _value(f"v_{i}_{j}", prop, defs)
        rules.append(f"{rule}: {_literal(PARAMETER + name + '>' + chr(10))} {value}")
        rules += more
        parts.append(rule if name in required else f"{rule}?")
    if schema.get("additionalProperties", True) is not False or "patternProperties" in schema:
        rules += [f"extra_{i}: {_literal(PARAMETER)} NAME_{i} {_literal('>' + chr(10))} v_extra_{i}",
                  f"NAME_{i}: /[^>\\n]+/",
                  *_text_rules(f"v_extra_{i}", {})]
        parts.append(f"extra_{i}*")
    return " ".join(parts), rules


def _value(rule: str, schema: Any, defs: dict[str, Any]) -> tuple[str, list[str]]:
    """A parameter value's expression (its text, then the closing tag) and its rules."""
    if not isinstance(schema, dict):
        schema = {}
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds) if isinstance(kinds, list) else []
    if not kinds and isinstance(schema.get("enum"), list) and schema["enum"] \
            and all(isinstance(v, str) for v in schema["enum"]):
        kinds = ["string"]
    if not kinds and isinstance(schema.get("const"), str):
        kinds = ["string"]
    if "string" not in kinds:
        return f"{_json(schema, defs)} {_literal(VALUE_END)}", []
    others = [k for k in kinds if k != "string"]
    if others:  # a type list: the string as text, the other types as JSON
        rules = _text_rules(f"{rule}_s", schema)
        json_part = _json({**schema, "type": others}, defs)
        return f"({rule}_s | {json_part} {_literal(VALUE_END)})", rules
    return rule, _text_rules(rule, schema)


def _text_rules(rule: str, schema: dict[str, Any]) -> list[str]:
    """Rules for a string value written as text (then the closing tag)."""
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else None
    if isinstance(schema.get("const"), str):
        values = [schema["const"]]
    if values is not None:
        strings = [v for v in values if isinstance(v, str)] or [""]
        return [f"{rule}: ({' | '.join(_literal(v) for v in strings)}) {_literal(VALUE_END)}"]
    low = schema.get("minLength") if isinstance(schema.get("minLength"), int) else 0
    high = schema.get("maxLength") if isinstance(schema.get("maxLength"), int) else None
    body = "/(?s:.*)/" if low == 0 and high is None else f"/(?s:.{{{low},{'' if high is None else high}}})/"
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        body += " & /" + pattern.removeprefix("^").removesuffix("$").replace("/", "\\/") + "/"
    token = rule.upper() + "_TEXT"
    return [f"{rule}[suffix={_literal(VALUE_END)}]: {token}", f"{token}: {body} & {_NO_END}"]


def _json(schema: dict[str, Any], defs: dict[str, Any]) -> str:
    body = {**defs, **schema, "x-guidance": dict(JSON_OPTIONS)}
    return "%json " + json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
