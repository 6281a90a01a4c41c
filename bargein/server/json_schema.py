"""JSON Schema as the server reads it: where the subschemas are, and the strict reading.

:func:`subschemas` lists a schema node's direct subschemas (by keyword, not by walking
every value: ``enum`` and ``const`` hold data, not schemas).

:func:`strict_objects` is the reading xgrammar-based servers apply by default: an object
schema that declares ``properties`` allows only those, unless it says otherwise with
``additionalProperties``, ``patternProperties`` or ``unevaluatedProperties``. An object
with no ``properties`` (``{"type": "object"}``, ``json_object``) stays open. Branches of
an ``allOf`` are left as they are: they describe one object together, and closing each
would forbid the others' properties.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Keywords whose value is one schema, a list of schemas, or a name -> schema map.
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPENING = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def subschemas(node: Any) -> Iterator[tuple[str, Any]]:
    """``(keyword, subschema)`` for each direct subschema of ``node`` (dicts and booleans)."""
    if not isinstance(node, dict):
        return
    for key in _ONE:
        value = node.get(key)
        if isinstance(value, dict | bool):
            yield key, value
        elif key == "items" and isinstance(value, list):  # the old tuple form of prefixItems
            yield from ((key, v) for v in value)
    for key in _LIST:
        value = node.get(key)
        if isinstance(value, list):
            yield from ((key, v) for v in value)
    for key in _MAP:
        value = node.get(key)
        if isinstance(value, dict):
            yield from ((key, v) for v in value.values())


def strict_objects(schema: Any) -> Any:
    """A copy of ``schema`` where every object that declares ``properties`` and does not
    open itself allows no other property (module docstring); the input is not changed."""
    return _strict(schema, in_all_of=False)


def _strict(node: Any, in_all_of: bool) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _ONE:
        if isinstance(node.get(key), dict):
            out[key] = _strict(node[key], False)
        elif key == "items" and isinstance(node.get(key), list):
            out[key] = [_strict(v, False) for v in node[key]]
    for key in _LIST:
        if isinstance(node.get(key), list):
            out[key] = [_strict(v, key == "allOf") for v in node[key]]
    for key in _MAP:
        if isinstance(node.get(key), dict):
            out[key] = {name: _strict(v, False) for name, v in node[key].items()}
    if isinstance(node.get("properties"), dict) and not in_all_of and "allOf" not in node \
            and not any(k in node for k in _OPENING):
        out["additionalProperties"] = False
    return out
