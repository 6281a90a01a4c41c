"""Steering a constrained JSON answer to close within its token budget.

The JSON state machine is checked on its own; then an adversarial "model" (logits that
favour opening new structure and long strings, as a runaway small model does) walks an
open grammar with the real masks: with a budget, every answer closes and parses before
the budget ends; without one, the same walk runs to the end unclosed (so the test can
fail); and answers that end early are not changed by steering at all.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bargein.engine.constraint import Constraint
from bargein.engine.grammar import GrammarMasks, Grammars
from bargein.engine.json_steering import JsonState, JsonTracker, SteeringClasses, steer
from tests.tiny_engine import EOS, ByteTokenizer

OPEN_SCHEMAS = {
    "json_object": Constraint.json_object(),
    "free_map": Constraint.json_schema({"type": "object", "properties": {"items": {"type": "array"}},
                                        "required": ["items"]}),
    "tool_call": Constraint("lark", 'start: "<call>" body "</call>"\nbody: %json {"type":"object",'
                                    '"x-guidance":{"whitespace_flexible":false}}\n'),
}


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(ByteTokenizer(), 260, {EOS})


@pytest.mark.parametrize(("text", "state", "depth"), [
    ("", JsonState.VALUE, 0), ('{', JsonState.KEY, 1), ('{"a', JsonState.KEY_STRING, 1),
    ('{"a"', JsonState.COLON, 1), ('{"a":', JsonState.VALUE, 1), ('{"a":[', JsonState.VALUE, 2),
    ('{"a":[1', JsonState.AFTER_VALUE, 2), ('{"a":[1,', JsonState.VALUE, 2), ('{"a":[1,"x\\"}', JsonState.STRING, 2),
    ('{"a":[1,"x\\"}"]', JsonState.AFTER_VALUE, 1), ('{"a":[1,"x\\"}"],', JsonState.KEY, 1),
    ('{"a":[]}', JsonState.DONE, 0), ('[]', JsonState.DONE, 0), ('{}', JsonState.DONE, 0),
])
def test_tracker_follows_compact_json(text, state, depth):
    tracker = JsonTracker.starting(outside=False)
    tracker.feed(text.encode())
    assert (tracker.state, len(tracker.stack)) == (state, depth)


def test_tracker_outside_waits_for_the_first_brace():
    tracker = JsonTracker.starting(outside=True)
    tracker.feed(b"<call>")
    assert tracker.state == JsonState.OUTSIDE
    tracker.feed(b'{"a":"}')
    assert tracker.state == JsonState.STRING and tracker.stack == ["{"]


def test_steer_intersects_or_leaves_the_grammar_alone():
    tokens = [b"a", b"}", b'"}', b"]", b"1", b"{"]
    classes = SteeringClasses(tokens, 1)
    row = np.array([0b111111], dtype=np.int32)
    steer(row, classes.for_state(JsonState.AFTER_VALUE))
    assert row[0] == 0b001010  # '}' and ']'
    row = np.array([0b000001], dtype=np.int32)  # the grammar allows only 'a': no closer
    steer(row, classes.for_state(JsonState.AFTER_VALUE))
    assert row[0] == 0b000001
    row = np.array([0b111111], dtype=np.int32)
    steer(row, classes.for_state(JsonState.STRING))
    assert row[0] == 0b000100  # '"}'
    row = np.array([0b110001], dtype=np.int32)  # in an array: ']' first, else a short value
    steer(row, classes.for_state(JsonState.VALUE, in_array=True))
    assert row[0] == 0b010000


def _runaway_logits(vocab: int, step: int) -> torch.Tensor:
    """Favours opening structure and letters (a model that never wants to stop)."""
    logits = torch.zeros(1, vocab)
    for ch, score in (("{", 9.0), ("[", 8.5), ('"', 8.0), (",", 7.0), ("a", 6.0 + (step % 3)), (":", 5.0),
                      ("b", 5.5)):
        logits[0, ord(ch)] = score
    logits[0, EOS] = -5.0
    return logits


def _walk(grammars: Grammars, constraint: Constraint, budget: int | None, steps: int) -> tuple[list[int], bool]:
    matcher = grammars.matcher(constraint, budget=budget)
    masks, out = GrammarMasks(), []
    for step in range(steps):
        logits = masks.apply(_runaway_logits(260, step), [matcher])
        token = int(torch.argmax(logits[0]))
        assert matcher.accept(token)
        out.append(token)
        if token == EOS:
            return out, True
    return out, False


@pytest.mark.parametrize("budget", [16, 30, 60, 120])
@pytest.mark.parametrize("name", sorted(OPEN_SCHEMAS))
def test_runaway_answer_closes_within_its_budget(grammars, name, budget):
    constraint = OPEN_SCHEMAS[name]
    tokens, ended = _walk(grammars, constraint, budget, budget)
    assert ended, f"{name} did not close within {budget} tokens: {bytes(t for t in tokens if t < 256)!r}"
    text = bytes(t for t in tokens if t < 256).decode()
    if name == "tool_call":
        assert text.startswith("<call>") and text.endswith("</call>")
        text = text[len("<call>"):-len("</call>")]
    assert isinstance(json.loads(text), dict)


def test_without_a_budget_the_same_walk_runs_away(grammars):
    tokens, ended = _walk(grammars, OPEN_SCHEMAS["json_object"], None, 120)
    assert not ended and tokens.count(ord("{")) > 5


def test_steering_leaves_an_early_end_unchanged(grammars):
    """An answer that closes well before its budget is the same with and without one."""
    schema = Constraint.json_schema({"type": "object", "properties": {"k": {"enum": ["ab", "cd"]}},
                                     "required": ["k"], "additionalProperties": False})
    free, ended = _walk(grammars, schema, None, 40)
    assert ended
    steered, _ = _walk(grammars, schema, len(free) + 20, 40)
    assert steered == free


def test_replay_counts_only_new_tokens_against_the_budget(grammars):
    """A continued answer (its start replayed) has the whole budget for its new tokens."""
    start = list(b'{"a":{"b":[')
    matcher = grammars.matcher(OPEN_SCHEMAS["json_object"], start, budget=100)
    assert matcher.generated == 0 and matcher.preferred == ()
    tight = grammars.matcher(OPEN_SCHEMAS["json_object"], start, budget=5)
    assert tight.preferred != ()  # three containers open: steering from the first token
