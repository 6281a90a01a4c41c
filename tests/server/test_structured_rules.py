"""The schema rules, as pure functions: the strict reading and the schema limits.

``strict_objects`` closes objects that declare properties (nested, in arrays, anyOf,
``$defs``), leaves open what opens itself or declares nothing, leaves ``allOf`` branches
alone, and never changes its input. ``check_schema`` refuses each limit with a 400 that
names it, and accepts what is inside them (optional recursion included).
"""

from __future__ import annotations

import copy

import jsonschema
import pytest

from bargein.server.errors import APIError
from bargein.server.json_schema import strict_objects
from bargein.server.schema_limits import MAX_SCHEMA_DEPTH, check_schema
from bargein.server.structured import response_format_constraint

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"},
    "pets": {"type": "array", "items": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}}},
    "home": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/address"}]},
    "extra": {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
    "free": {"type": "object"},
    "tags": {"type": "object", "patternProperties": {"^t": {"type": "string"}}, "properties": {"x": {}}},
}, "$defs": {"address": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_strict_objects_closes_declared_objects_only():
    original = copy.deepcopy(PERSON)
    strict = strict_objects(PERSON)
    assert original == PERSON  # the input is not changed
    validator = jsonschema.Draft202012Validator(strict)
    assert validator.is_valid({"name": "a", "pets": [{"kind": "cat"}], "home": {"city": "Oslo"},
                               "extra": {"a": 1, "b": 2}, "free": {"anything": [1]}, "tags": {"t1": "x"}})
    for bad in ({"name": "a", "age": 3}, {"pets": [{"kind": "cat", "age": 2}]}, {"home": {"city": "x", "zip": 1}}):
        assert not validator.is_valid(bad), bad
    assert validator.is_valid({"extra": {"b": 1}, "tags": {"t2": "y"}})  # opened explicitly: untouched


def test_strict_objects_leaves_all_of_branches_alone():
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    assert jsonschema.Draft202012Validator(strict_objects(schema)).is_valid({"a": 1, "b": 2})


@pytest.mark.parametrize(("schema", "says"), [
    ({"type": "integer", "minimum": 1e30}, "within +-2**53"),
    ({"type": "integer", "maximum": -(10**20)}, "within +-2**53"),
    ({"type": "number", "multipleOf": 0}, "greater than 0"),
    ({"type": "number", "minimum": True}, "finite number"),
    ({"type": "string", "minLength": 10**6}, "at most 4,096"),
    ({"type": "array", "minItems": 5000, "items": {"type": "null"}}, "at most 4,096"),
    ({"anyOf": [{"const": i} for i in range(5000)]}, "more than 4,096 subschemas"),
    ({"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
      "$ref": "#/$defs/n"}, "recurses through required properties"),
    ({"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}}, "$ref": "#/$defs/n"},
     "recurses through required properties"),
    ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}]}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
      "$ref": "#/$defs/a"}, "recurses through required properties"),
])
def test_check_schema_refuses_each_limit(schema, says):
    with pytest.raises(APIError) as info:
        check_schema(schema, "response_format.json_schema.schema")
    assert info.value.status == 400 and says in info.value.message
    assert info.value.param == "response_format.json_schema.schema"


def test_deep_nesting_is_refused_at_the_limit():
    node: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH - 1):
        node = {"type": "object", "properties": {"a": node}}
    check_schema(node, "p")  # exactly at the limit
    with pytest.raises(APIError, match="deeper than 32"):
        check_schema({"type": "array", "items": node}, "p")


@pytest.mark.parametrize("schema", [
    {"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"}, "c": {"$ref": "#/$defs/n"}}}},
     "$ref": "#/$defs/n"},
    {"$defs": {"n": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                                                  "required": ["c"]}]}}, "$ref": "#/$defs/n"},
    {"type": "array", "items": {"$ref": "#"}},
    {"type": "integer", "minimum": -(2**53), "maximum": 2**53},
])
def test_check_schema_accepts_finite_recursion_and_exact_bounds(schema):
    check_schema(schema, "p")


def test_response_format_shapes():
    pet = {"type": "object", "properties": {"name": {"type": "string"}}}
    no_name = response_format_constraint({"type": "json_schema", "json_schema": {"schema": pet}})
    extension = response_format_constraint({"type": "json_object", "schema": pet})
    assert no_name == extension and '"additionalProperties":false' in no_name.text
    with pytest.raises(APIError) as info:
        response_format_constraint({"type": "json_schema", "json_schema": {"name": "", "schema": pet}})
    assert info.value.param == "response_format.json_schema.name"
    with pytest.raises(APIError) as info:
        response_format_constraint({"type": "json_object", "schema": [1]})
    assert info.value.param == "response_format.schema"
