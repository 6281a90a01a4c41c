"""Grammars the grammar engine builds but cannot run are refused at compile time.

Each hostile case of the probe that found 500s mid-answer (issue 34) is compiled here with
a byte tokenizer: it must raise UnsupportedGrammar naming what failed, before any token
is sampled; a refusal is remembered; a build past its time budget is GrammarOverBudget;
and ordinary schemas (optional recursion included) still compile.
"""

from __future__ import annotations

import time

import pytest

from bargein.engine.constraint import Constraint
from bargein.engine.grammar import (
    MAX_CONSTRAINT_CHARS,
    GrammarOverBudget,
    Grammars,
    UnsupportedGrammar,
    grammar_text,
)
from tests.tiny_engine import EOS, ByteTokenizer


def _obj(**properties) -> dict:
    return {"type": "object", "properties": properties, "required": sorted(properties)}


HOSTILE = {
    "required recursion": ({"$defs": {"n": _obj(c={"$ref": "#/$defs/n"})}, "$ref": "#/$defs/n"},
                           "trial answer"),
    "nested repetition": (_obj(x={"type": "string", "pattern": "^(a{1000}){1000}$"}), "trial answer"),
    "2,500-way anyOf": (_obj(x={"anyOf": [_obj(**{f"k{i}": {"type": "null"}}) for i in range(2500)]}), "fuel exhausted"),
    "huge enum": (_obj(x={"enum": [f"value-{i:08d}-abcdefghijklmnop" for i in range(90_000)]}),
                  f"budget of {MAX_CONSTRAINT_CHARS:,}"),
    "integer past 64 bits": (_obj(x={"type": "integer", "maximum": 10**30}), "not JSON serializable"),
}
FINE = {
    "optional recursion": {"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"},
                                                                            "c": {"$ref": "#/$defs/n"}}}},
                           "$ref": "#/$defs/n"},
    "enum": _obj(kind={"enum": ["cat", "dog"]}),
    "pattern": _obj(code={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"}),
}


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(ByteTokenizer(), 260, {EOS})


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_schema_is_refused_before_any_token(grammars, name):
    schema, says = HOSTILE[name]
    constraint = Constraint.json_schema(schema)
    started = time.monotonic()
    with pytest.raises(UnsupportedGrammar) as info:
        grammars.compile(constraint, budget_s=30.0)
    assert says in str(info.value)
    took = time.monotonic() - started
    # Remembered: the same schema again is refused at once, with the same message.
    again = time.monotonic()
    with pytest.raises(UnsupportedGrammar) as second:
        grammars.compile(constraint, budget_s=30.0)
    assert str(second.value) == str(info.value)
    assert time.monotonic() - again < max(0.05, took / 2)
    with pytest.raises(UnsupportedGrammar):  # nor can a request's matcher be made from it
        grammars.matcher(constraint)


@pytest.mark.parametrize("name", sorted(FINE))
def test_ordinary_schemas_compile(grammars, name):
    grammars.compile(Constraint.json_schema(FINE[name]), budget_s=30.0)


def test_a_build_past_its_budget_is_over_budget(grammars):
    constraint = Constraint.json_schema(_obj(y={"type": "string", "pattern": "^[a-f]{2,9}$"}))
    with pytest.raises(GrammarOverBudget) as info:
        grammars.compile(constraint, budget_s=0.0)
    assert "time budget of 0 s" in str(info.value)


def test_schema_text_errors_are_unsupported_not_value_errors():
    with pytest.raises(UnsupportedGrammar, match="not JSON serializable"):
        grammar_text(Constraint.json_schema({"type": "integer", "minimum": -(10**30)}))
    with pytest.raises(UnsupportedGrammar):
        grammar_text(Constraint("json_schema", "[1, 2]"))
