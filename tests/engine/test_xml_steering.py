"""Steering a forced tool call in Qwen3-Coder's XML to close within its token budget (issue 32).

The tracker is checked on its own; then runaway "models" (logits that favour writing more
text, more JSON structure, optional parameters, never a closing tag) walk real forced-call
grammars with the real masks: with a budget, every answer is a complete call holding its
required parameters; without one, the same walk runs away (so the test can fail); and a
scripted model that closes on its own is the same token for token with and without a
budget, as is a runaway one until the last ``needed + STEER_MARGIN`` tokens.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from bargein.engine.grammar import GrammarMasks, Grammars
from bargein.engine.json_steering import STEER_MARGIN, SteeringClasses
from bargein.engine.xml_steering import (
    CALL_END,
    FUNCTION_END,
    PARAMETER,
    VALUE_END,
    XmlCallTracker,
    XmlPhase,
)
from bargein.server import tool_syntax_xml
from bargein.server.tool_syntax import QWEN3_XML
from bargein.server.tools import tool_plan
from tests.tiny_engine import EOS, ByteTokenizer

NOTE = {"type": "object", "properties": {
    "title": {"type": "string"}, "tag": {"enum": ["work", "home"]}, "extra": {"type": "string"},
    "body": {"type": "string"}, "meta": {"type": "object"}, "count": {"type": "integer"}},
    "required": ["title", "body", "meta"]}
OPEN = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"], "additionalProperties": True}
TOOLS = [{"type": "function", "function": {"name": "note", "parameters": NOTE}},
         {"type": "function", "function": {"name": "say", "parameters": OPEN}}]
CALL = re.compile(r"<tool_call>\n<function=(\w+)>\n((?:<parameter=[^>\n]+>\n(?s:.*?)\n</parameter>\n)*)"
                  r"</function>\n</tool_call>")


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(ByteTokenizer(), 260, {EOS})


def constraint(choice):
    return tool_plan(TOOLS, choice, QWEN3_XML).constraint()


def test_the_tags_are_the_servers():
    assert PARAMETER.decode() == tool_syntax_xml.PARAMETER and FUNCTION_END.decode() == tool_syntax_xml.FUNCTION_END + "\n"
    assert VALUE_END.decode() == "\n" + tool_syntax_xml.PARAMETER_END + "\n"
    assert CALL_END.decode() == tool_syntax_xml.CLOSE
    assert constraint({"type": "function", "function": {"name": "note"}}).xml_call == (
        ("note", ("title", "body", "meta")),)


def test_tracker_follows_the_call():
    tracker = XmlCallTracker({"f": ("a", "b")})
    tracker.feed(b"<tool_call>\n")
    assert tracker.phase == XmlPhase.OUTSIDE
    tracker.feed(b"<function=f>\n")
    assert (tracker.phase, tracker.function, tracker.pending) == (XmlPhase.TAGS, "f", ["a", "b"])
    tracker.feed(b"<parameter=a>\nsome {text\n</param")  # a value that looks like JSON, a tag begun
    assert (tracker.phase, tracker.pending) == (XmlPhase.VALUE, ["b"])
    tracker.feed(b"x\n</parameter>\n")
    assert tracker.phase == XmlPhase.TAGS and tracker.tag == b""
    tracker.feed(b"<parameter=b>\n{\"k\":[1")
    assert tracker.json.stack == ["{", "["] and tracker.pending == []
    tracker.feed(b"]}\n</parameter>\n</function>\n")
    assert tracker.phase == XmlPhase.CLOSING


def test_steering_prefers_the_closing_text_then_the_next_required_tag():
    tokens = [bytes([i]) for i in range(256)] + [b"\n</parameter>\n", b"</function>"]
    classes = SteeringClasses(tokens, 9)
    tracker = XmlCallTracker({"f": ("a", "b")})
    tracker.feed(b"<tool_call>\n<function=f>\n<parameter=a>\nhello\n</")
    assert tracker.preferred(classes, 1000) == ()
    close = tracker.preferred(classes, 10)[0]
    expected = {ord("p")}  # the rest of "</parameter>\n" then "<parameter=b>\n"
    assert {i for i in range(len(tokens)) if close[i // 32] >> (i % 32) & 1} == expected
    tracker.feed(b"parameter>\n")
    close = tracker.preferred(classes, 10)[0]
    assert {i for i in range(len(tokens)) if close[i // 32] >> (i % 32) & 1} == {ord("<")}
    assert classes.token_count(b"\n</parameter>\n</function>") == 2


def _runaway(vocab: int, step: int) -> torch.Tensor:
    """Favours letters, JSON structure and optional parameters, never a closing tag."""
    logits = torch.zeros(1, vocab)
    for ch, score in (("a", 9.0 + step % 2), ("{", 8.8), ("[", 8.6), ('"', 8.4), ("p", 8.2), ("e", 8.0),
                      (",", 7.0), (":", 5.0), ("1", 4.0), ("<", 3.0)):
        logits[0, ord(ch)] = score
    logits[0, EOS] = -5.0
    return logits


def _walk(grammars, constraint, budget, steps, logits=_runaway) -> tuple[list[int], bool]:
    matcher = grammars.matcher(constraint, budget=budget)
    masks, out = GrammarMasks(), []
    for step in range(steps):
        token = int(torch.argmax(masks.apply(logits(260, step), [matcher])[0]))
        assert matcher.accept(token)
        out.append(token)
        if token == EOS:
            return out, True
    return out, False


def _check_call(tokens: list[int]) -> dict[str, str]:
    text = bytes(t for t in tokens if t < 256).decode()
    match = CALL.fullmatch(text)
    assert match, text
    params = dict(re.findall(r"<parameter=([^>\n]+)>\n((?s:.*?))\n</parameter>\n", match.group(2)))
    schema = NOTE if match.group(1) == "note" else OPEN
    assert set(schema["required"]) <= set(params), text
    if schema is NOTE:
        assert set(params) <= set(NOTE["properties"]), text
    return params


# The shortest call to "note" (empty texts, "{}") is 148 tokens, plus end of sequence.
@pytest.mark.parametrize("budget", [152, 170, 220, 400])
@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "note"}},
                                    {"type": "function", "function": {"name": "say"}}, "required"])
def test_runaway_call_closes_within_its_budget(grammars, choice, budget):
    tokens, ended = _walk(grammars, constraint(choice), budget, budget)
    assert ended, bytes(t for t in tokens if t < 256)
    _check_call(tokens)


def test_without_a_budget_the_same_walk_runs_away(grammars):
    tokens, ended = _walk(grammars, constraint({"type": "function", "function": {"name": "note"}}), None, 400)
    assert not ended


def test_steering_waits_for_the_margin(grammars):
    """A runaway walk is the unsteered one until steering's start: the last tokens of its budget."""
    forced = constraint({"type": "function", "function": {"name": "note"}})
    free, _ = _walk(grammars, forced, None, 300)
    steered, _ = _walk(grammars, forced, 300, 300)
    same = next(i for i, (a, b) in enumerate(zip(free, steered, strict=False)) if a != b)
    # Closing from a value of the first parameter: its tag, two required parameters, the call's end.
    assert 300 - same <= 14 + 2 * (len(b"<parameter=title>\n") + len(VALUE_END) + 1) + 24 + STEER_MARGIN + 2


def _scripted(script: bytes):
    """A model that writes ``script`` then ends (the grammar permitting)."""
    def logits(vocab: int, step: int) -> torch.Tensor:
        out = torch.zeros(1, vocab)
        out[0, script[step] if step < len(script) else EOS] = 10.0
        return out
    return logits


def test_an_early_end_is_unchanged(grammars):
    script = (b"<tool_call>\n<function=note>\n<parameter=title>\nHi\n</parameter>\n<parameter=body>\nText\n"
              b"</parameter>\n<parameter=meta>\n{}\n</parameter>\n</function>\n</tool_call>")
    forced = constraint({"type": "function", "function": {"name": "note"}})
    free, ended = _walk(grammars, forced, None, 300, _scripted(script))
    assert ended and bytes(free[:-1]) == script
    steered, _ = _walk(grammars, forced, len(free) + STEER_MARGIN + 40, 300, _scripted(script))
    assert steered == free


NOTE_HEAD = b"<tool_call>\n<function=note>\n<parameter=title>\nHi\n</parameter>\n"
STARTS = {  # a start the model writes, then it runs away: in a JSON value, an extra's name, an optional text
    "json_value": (NOTE_HEAD + b'<parameter=body>\nb\n</parameter>\n<parameter=meta>\n{"k":[{"a":["', "note"),
    "extra_name": (b"<tool_call>\n<function=say>\n<parameter=text>\nhi\n</parameter>\n<parameter=zz", "say"),
    "optional_text": (NOTE_HEAD + b"<parameter=extra>\n", "note"),
}


@pytest.mark.parametrize("budget", [190, 230, 300])
@pytest.mark.parametrize("start", sorted(STARTS))
def test_a_runaway_anywhere_in_the_call_closes(grammars, start, budget):
    script, name = STARTS[start]

    def logits(vocab: int, step: int) -> torch.Tensor:
        return _scripted(script)(vocab, step) if step < len(script) else _runaway(vocab, step)

    tokens, ended = _walk(grammars, constraint({"type": "function", "function": {"name": name}}), budget, budget,
                          logits)
    assert ended and bytes(tokens[:len(script)]) == script, bytes(t for t in tokens if t < 256)
    params = _check_call(tokens)
    if start == "json_value":
        assert json.loads(params["meta"])["k"][0]["a"][0].startswith("a")
    if start == "extra_name":
        assert any(key.startswith("zz") for key in params)
