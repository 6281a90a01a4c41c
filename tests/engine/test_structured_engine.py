"""Grammar-constrained decoding in the engine: masks, end of sequence, limits, cancel + continue.

A tiny random-weight model generates junk, so every check here is about the constraint:
the output parses and validates with ``jsonschema`` (or ends with ``length`` and is a
prefix the grammar accepts), end of sequence comes only where the grammar is complete,
and a cancelled constrained answer continued through a Conversation equals the
uninterrupted run token for token.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch

from bargein.engine.async_engine import AsyncEngine
from bargein.engine.constraint import Constraint
from bargein.engine.conversation import Conversation
from bargein.engine.grammar import GrammarMasks, Grammars, UnsupportedGrammar, check_constraint
from bargein.engine.request import FinishReason
from bargein.engine.sampling import InvalidSamplingParams, SamplingParams
from tests.tiny_engine import EOS, ByteTokenizer, tiny_engine

SHORT_STRING = {"type": "string", "maxLength": 6}
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "who": {"type": "object", "properties": {"name": SHORT_STRING}, "required": ["name"],
                "additionalProperties": False}}, "required": ["who"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 9}, "maxItems": 3}},
              "required": ["xs"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "bird"]}}, "required": ["kind"],
             "additionalProperties": False},
    "bounded": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 20}},
                "required": ["n"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}},
                 "required": ["a"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def _check(out, schema: dict, grammars: Grammars, constraint: Constraint) -> None:
    """Valid output, or a `length` end whose tokens the grammar still accepts."""
    if out.finish_reason == FinishReason.STOP:
        assert out.token_ids[-1] == EOS
        jsonschema.validate(json.loads(out.text), schema)
    else:
        assert out.finish_reason == FinishReason.LENGTH
        assert EOS not in out.token_ids
        grammars.matcher(constraint, out.token_ids)  # raises if not a valid prefix


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schemas_greedy_and_sampled(engine, name):
    schema = SCHEMAS[name]
    c = Constraint.json_schema(schema)
    params = [SamplingParams(max_tokens=40, temperature=0, constraint=c)]
    params += [SamplingParams(max_tokens=40, temperature=1.0, seed=seed, constraint=c) for seed in range(3)]
    outs = engine.generate([[1, 2, 3]] * len(params), params)
    for out in outs:
        _check(out, schema, engine.grammars, c)
    assert any(out.finish_reason == FinishReason.STOP for out in outs)


def test_json_object_mixed_with_unconstrained_rows(engine):
    c = Constraint.json_object()
    params = [SamplingParams(max_tokens=30, temperature=0, constraint=c), SamplingParams(max_tokens=30, temperature=0)]
    constrained, free = engine.generate([[5, 6], [5, 6]], params)
    alone = engine.generate([[5, 6]], SamplingParams(max_tokens=30, temperature=0))[0]
    assert free.token_ids == alone.token_ids  # a constrained neighbour changes nothing for other rows
    assert constrained.text.startswith("{")
    _check(constrained, {"type": "object"}, engine.grammars, c)


def test_eos_only_where_grammar_is_complete(engine):
    # The tiny model's unconstrained favourite is not EOS; a complete tiny grammar forces it.
    c = Constraint.json_schema({"enum": [1]})
    out = engine.generate([[7, 8, 9]], SamplingParams(max_tokens=10, temperature=0, constraint=c))[0]
    assert out.token_ids == (ord("1"), EOS) and out.finish_reason == FinishReason.STOP


def test_stop_string_and_max_tokens_with_grammar(engine):
    schema = SCHEMAS["enum"]
    c = Constraint.json_schema(schema)
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=40, temperature=0, constraint=c, stop=['":']))[0]
    assert out.finish_reason == FinishReason.STOP and out.text == '{"kind'
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, constraint=c))[0]
    assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 3
    engine.grammars.matcher(c, out.token_ids)


def test_unsupported_schema_names_the_feature(engine):
    c = Constraint.json_schema({"type": "object", "properties": {"x": {"not": {"type": "string"}}}})
    with pytest.raises(UnsupportedGrammar, match='"not"'):
        check_constraint(c)
    with pytest.raises(UnsupportedGrammar, match='"not"'):
        engine.add_request([1, 2], SamplingParams(constraint=c))
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(min_tokens=2, constraint=Constraint.json_object())
    assert info.value.field == "min_tokens"


def test_compiled_once_per_constraint():
    grammars = Grammars(ByteTokenizer(), 260, {EOS})
    c = Constraint.json_schema(SCHEMAS["enum"])
    grammars.compile(c)
    template = grammars._compiled[c]
    grammars.compile(Constraint.json_schema(json.dumps(SCHEMAS["enum"], separators=(",", ":"))))
    assert grammars._compiled[c] is template and len(grammars._compiled) == 1


def test_replay_rejects_tokens_outside_the_grammar():
    grammars = Grammars(ByteTokenizer(), 260, {EOS})
    with pytest.raises(UnsupportedGrammar, match="token 0"):
        grammars.matcher(Constraint.json_object(), [ord("x")])


def test_masks_forbid_exactly_what_the_grammar_forbids():
    # Logits wider than the grammar's vocabulary (as when a model pads its embedding):
    # the extra columns are forbidden in constrained rows, untouched in the free row.
    grammars = Grammars(ByteTokenizer(), 264, {EOS})
    c = Constraint.json_schema(SCHEMAS["enum"])
    at_start, mid_word = grammars.matcher(c), grammars.matcher(c, [ord(ch) for ch in '{"kind":"'])
    logits = torch.randn(3, 264)
    masked = GrammarMasks().apply(logits, [at_start, None, mid_word])
    for row, matcher in ((0, at_start), (2, mid_word)):
        allowed = {t for t in range(260) if matcher._m.deep_copy().consume_token(t)}
        assert {t for t in range(264) if masked[row, t] > float("-inf")} == allowed
        assert torch.equal(masked[row, sorted(allowed)], logits[row, sorted(allowed)])
    assert {t for t in range(264) if masked[2, t] > float("-inf")} == {ord(ch) for ch in "cdb"}
    assert torch.equal(masked[1], logits[1])
    masked_all = GrammarMasks().apply(logits[[0, 2]], [at_start, mid_word])  # every row constrained
    assert torch.equal(masked_all, masked[[0, 2]])


CUT_TRIES = 20


@pytest.mark.parametrize("cut", [1, 4, 9])
def test_cancelled_constrained_answer_continues_token_for_token(cut):
    """Cancel after `cut` tokens, generate again on the conversation: one answer, equal
    to the uninterrupted run's, and valid."""
    schema = SCHEMAS["nested"]
    c = Constraint.json_schema(schema)
    params = SamplingParams(max_tokens=60, temperature=0, constraint=c)
    prompt = [10, 20, 30, 40]

    async def run():
        engine = AsyncEngine(tiny_engine()).start()
        try:
            whole = Conversation.open(engine, prompt)
            full = [t for out in [o async for o in whole.generate(params)] for t in out.new_token_ids]

            for _ in range(CUT_TRIES):
                conv = Conversation.open(engine, prompt)
                got: list[int] = []
                async for out in conv.generate(params):
                    got += out.new_token_ids
                    if len(got) >= cut:
                        break  # the consumer stops: the engine keeps exactly what it handed
                if out.finish_reason is None:
                    break
                # A consumer descheduled while the engine ran on (a loaded machine) is handed
                # the steps it missed in one output; this one held the answer's end, so there
                # was no cut to continue from: try again.
                await conv.close()
            assert out.finish_reason is None and len(got) < len(full), "never cut mid-answer"
            async for out in conv.generate(params):
                got += out.new_token_ids
            tokens = await conv.tokens()
            # A prompt in between starts a new answer instead.
            await conv.prompt([1])
            fresh = [t for out in [o async for o in conv.generate(params)] for t in out.new_token_ids]
            return full, got, tokens, fresh
        finally:
            await engine.shutdown()

    full, got, tokens, fresh = asyncio.run(run())
    assert got == full and tokens == prompt + full
    assert full[-1] == EOS
    jsonschema.validate(json.loads(bytes(full[:-1]).decode()), schema)
    assert fresh[-1] == EOS and json.loads(bytes(fresh[:-1]).decode()) is not None


def test_constraint_from_continues_an_answer_held_in_the_prompt(engine):
    """Without a session (the server's continuation): the answer so far is the prompt's
    tail, replayed into the grammar from ``constraint_from``; the rest equals the
    uninterrupted run's, and a wrong start is an error of that request alone."""
    from bargein.engine.outputs import OutputCollector

    c = Constraint.json_schema(SCHEMAS["nested"])
    params = SamplingParams(max_tokens=60, temperature=0, constraint=c)
    prompt = [10, 20, 30, 40]
    whole = engine.generate([prompt], params)[0]
    assert whole.finish_reason == FinishReason.STOP
    for cut in (1, 5):
        collector = OutputCollector(engine)
        rid = collector.add_request(prompt + list(whole.token_ids[:cut]), params, constraint_from=len(prompt))
        rest = []
        while collector.pending:
            rest += [o for o in collector.step() if o.request_id == rid and o.finished]
        assert list(whole.token_ids[:cut]) + list(rest[0].token_ids) == list(whole.token_ids)
    collector = OutputCollector(engine)
    rid = collector.add_request(prompt + list(whole.token_ids[:3]), params, constraint_from=1)  # 20 is no JSON
    finals = []
    while collector.pending:
        finals += [o for o in collector.step() if o.request_id == rid and o.finished]
    assert finals[0].finish_reason == FinishReason.ERROR and "token 0" in finals[0].error
