"""The budget a JSON Schema must fit, checked before the grammar engine sees it.

Each rule names a schema the grammar engine would take too long over, build wrong, or
run without end, and refuses it with a 400 that says which rule and the limit:

- at most ``MAX_SCHEMA_DEPTH`` levels of nested subschemas and ``MAX_SCHEMA_NODES``
  subschemas in all (a 5,000-way ``anyOf`` is over);
- numeric bounds (``minimum``, ``maximum``, the exclusive ones, ``multipleOf``) are finite
  numbers within +-2**53, where JSON numbers are exact (the grammar engine reads bounds as
  64-bit numbers: 1e30 would be silently clamped or fail mid-build);
- ``minLength``, ``minItems`` and ``minProperties`` are at most ``MAX_MIN_COUNT`` (an
  answer that must be longer than any token budget can never finish);
- a local ``$ref`` cycle must allow a finite instance: a recursion through required
  properties or non-empty arrays only (``{"c": {"c": ...}}`` forever) is refused, while a
  tree whose recursion is optional is fine.

The schema's size in characters and the time its grammar takes to build are budgeted by
the grammar engine's side (``engine.grammar``). Runs off the event loop (its cost grows
with the schema).
"""

from __future__ import annotations

import math
from typing import Any

from bargein.server.errors import APIError
from bargein.server.json_schema import subschemas

MAX_SCHEMA_DEPTH = 32
MAX_SCHEMA_NODES = 4096
MAX_MIN_COUNT = 4096
MAX_EXACT = 2**53
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_MIN_COUNTS = ("minLength", "minItems", "minProperties")


def check_schema(schema: Any, param: str) -> None:
    """Raises a 400 ``APIError`` (``param`` named) if ``schema`` breaks a rule above."""
    nodes = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            _refuse(param, f"it has more than {MAX_SCHEMA_NODES:,} subschemas, over this server's budget")
        if depth > MAX_SCHEMA_DEPTH:
            _refuse(param, f"it nests subschemas deeper than {MAX_SCHEMA_DEPTH} levels, over this server's budget")
        if isinstance(node, dict):
            _check_numbers(node, param)
            stack.extend((child, depth + 1) for _, child in subschemas(node))
    _check_finite(schema, param)


def _check_numbers(node: dict[str, Any], param: str) -> None:
    for key in _BOUNDS:
        if key not in node:
            continue
        value = node[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            _refuse(param, f"{key} must be a finite number, got {value!r}")
        if abs(value) > MAX_EXACT:
            _refuse(param, f"{key} is {value:g}; numeric bounds must be within +-2**53 ({MAX_EXACT:,})")
        if key == "multipleOf" and not value > 0:
            _refuse(param, f"multipleOf must be greater than 0, got {value!r}")
    for key in _MIN_COUNTS:
        value = node.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_MIN_COUNT:
            _refuse(param, f"{key} is {value:,}; at most {MAX_MIN_COUNT:,} is allowed (the answer could never end)")


def _check_finite(schema: Any, param: str) -> None:
    """Refuses a schema whose only instances are infinite (a required ``$ref`` cycle).

    A fixed point over the local ``$ref`` targets: a target is finite once some branch of
    it is finite given the targets already known finite; whatever is left unknown is
    infinite."""
    targets: dict[str, Any] = {}
    _collect_refs(schema, schema, targets, set())
    finite: set[str] = set()
    changed = True
    while changed:
        changed = False
        for ref, target in targets.items():
            if ref not in finite and _has_finite(target, targets, finite):
                finite.add(ref)
                changed = True
    if not _has_finite(schema, targets, finite):
        cycle = sorted(set(targets) - finite)
        raise APIError(400, f"{param} is not supported: $ref {cycle[0]!r} recurses through required properties "
                            "without end, so no finite JSON matches it (make the recursion optional)",
                       param=param, code="unsupported_schema")


def _collect_refs(root: Any, node: Any, targets: dict[str, Any], seen: set[int]) -> None:
    if not isinstance(node, dict) or id(node) in seen:
        return
    seen.add(id(node))
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in targets:
        target = _resolve(root, ref)
        if target is not None:
            targets[ref] = target
            _collect_refs(root, target, targets, seen)
    for _, child in subschemas(node):
        _collect_refs(root, child, targets, seen)


def _resolve(root: Any, ref: str) -> Any:
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None  # the grammar engine names a missing target itself
    return node


def _has_finite(node: Any, targets: dict[str, Any], finite: set[str]) -> bool:
    """Whether ``node`` has a finite instance, given the ``$ref`` targets known finite
    (other unsatisfiable schemas are the grammar engine's to report: taken as finite)."""
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and ref in targets and ref not in finite:
        return False
    for key in ("anyOf", "oneOf"):
        options = node.get(key)
        if isinstance(options, list) and options and not any(_has_finite(o, targets, finite) for o in options):
            return False
    options = node.get("allOf")
    if isinstance(options, list) and not all(_has_finite(o, targets, finite) for o in options):
        return False
    properties = node.get("properties")
    if isinstance(properties, dict):
        for name in node.get("required") or ():
            if isinstance(name, str) and name in properties and not _has_finite(properties[name], targets, finite):
                return False
    min_items = node.get("minItems")
    if isinstance(min_items, int) and min_items > 0:
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        needed = prefix[:min_items] + ([node["items"]] if len(prefix) < min_items and "items" in node else [])
        if not all(_has_finite(item, targets, finite) for item in needed):
            return False
    return True


def _refuse(param: str, why: str) -> None:
    raise APIError(400, f"{param} is over this server's schema limits: {why}", param=param,
                   code="unsupported_schema")
