"""Admission (``bargein.engine.admission.admit``): every check in one place, one message per
rule, and one tokenization of a text prompt whether it goes to one engine or to replicas.

The intended change this tests: a text prompt of a conversation's turn is encoded without
the tokenizer's special tokens everywhere (it is text inside the conversation, as
``Conversation.prompt`` always encoded it); before, ``Engine.add_request`` added them and the
replica set did not, so the same request tokenized differently on one machine and on replicas.
"""

from __future__ import annotations

import pytest

from bargein.engine.admission import EngineError, TooLong, admit, check_length, encode_prompt
from bargein.engine.constraint import Constraint
from bargein.engine.grammar import Grammars, UnsupportedGrammar
from bargein.engine.sampling import InvalidSamplingParams, SamplingParams
from tests.tiny_engine import EOS, ByteTokenizer, tiny_engine

BOS = 257


class BosTokenizer(ByteTokenizer):
    """Bytes, with a BOS in front when special tokens are asked for."""

    bos_token_id = BOS

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode())


def _admit(prompt, params=None, **kwargs):
    tok = BosTokenizer()
    return admit(prompt, params, tokenizer=tok, grammars=Grammars(tok, 260, frozenset({EOS})), vocab_size=260,
                 max_model_len=16, **kwargs)


def test_a_text_prompt_has_special_tokens_alone_and_none_in_a_conversation():
    assert _admit("hi").token_ids == (BOS, 104, 105)
    assert _admit("hi", conversation_id="conv-1").token_ids == (104, 105)
    assert encode_prompt(BosTokenizer(), "hi", in_conversation=True) == [104, 105]


def test_the_engine_and_the_replica_set_tokenize_a_conversation_turn_alike():
    engine = tiny_engine()
    engine.tokenizer = BosTokenizer()
    conv = engine.open_conversation([1, 2, 3])
    engine.add_request("hi", SamplingParams(max_tokens=1), conversation_id=conv)
    while engine.has_work:
        engine.step()
    # the replica set's head admits with the same function: (104, 105) appended, no BOS
    assert engine.conversation_tokens(conv)[:5] == [1, 2, 3, 104, 105]
    engine.check_block_accounting()


def test_one_message_per_rule():
    with pytest.raises(EngineError, match="the prompt is empty"):
        _admit([])
    with pytest.raises(EngineError, match=r"token id 300 is outside the vocabulary \(0..259\)"):
        _admit([1, 300])
    with pytest.raises(TooLong, match="the prompt is 16 tokens, but the context holds 16"):
        _admit([1] * 16)
    with pytest.raises(TooLong, match="the conversation is 20 tokens"):
        check_length(20, 16, "the conversation")
    with pytest.raises(EngineError, match="timeout must be a positive number of seconds"):
        _admit([1], timeout=0)
    with pytest.raises(EngineError, match="constraint_from needs a constraint"):
        _admit([1], constraint_from=0)
    with pytest.raises(EngineError, match=r"output_offset must be within the prompt \(0..1\)"):
        _admit([1], output_offset=2)
    with pytest.raises(InvalidSamplingParams):
        _admit([1], SamplingParams(logit_bias={999: 1.0}))
    with pytest.raises(UnsupportedGrammar):
        _admit([1], SamplingParams(constraint=Constraint.json_schema('{"type": "object", "uniqueItems": 3}')))


def test_an_empty_turn_of_a_conversation_is_admitted():
    admitted = _admit((), conversation_id="conv-1", output_offset=3)
    assert admitted.token_ids == () and admitted.conversation_id == "conv-1" and admitted.output_offset == 3
