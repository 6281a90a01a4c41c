"""The cancellation contract on mixture-of-experts models (C3, C4, C5, C7; tests/data/moe).

A conversation is cancelled mid-answer, continued, forked and rewound; each answer must
equal, token for token, what an engine that never cancelled, forked or rewound (and has
no prefix cache) gives for the same tokens, in ``exact`` and in ``fast``: the experts a
token chooses, and so its answer, must not depend on which other rows shared its steps
or on whether its K/V came from a decode step or a continuation's prefill.
"""

from __future__ import annotations

import functools
import random

import pytest

from bargein.config import CacheConfig, EngineConfig, SchedulerConfig
from bargein.engine.engine import Engine
from bargein.engine.sampling import SamplingParams
from tests.model.moe_files import NAMES, model_path
from tests.tiny_engine import collector

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# Qwen3-MoE's renormalised top k, and Qwen2-MoE's plain top k with a shared expert (Mixtral's
# routing is Qwen3-MoE's; tests/model/test_moe_families.py covers its parity).
CONTRACT_NAMES = [n for n in NAMES if n != "mixtral"]


@functools.cache
def _engine(name: str, precision: str, prefix_caching: bool) -> Engine:
    # Prompt chunks of 5 tokens: prefills span steps and share them with other rows' decodes.
    config = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=prefix_caching),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=5),
                          precision=precision, max_model_len=64, device="cpu")
    return Engine.from_pretrained(model_path(name, "hf"), config, progress=False)


def _no_cancel(name: str, precision: str, tokens: list[int]) -> list[int]:
    (out,) = _engine(name, precision, False).generate([tokens], GREEDY)
    return list(out.token_ids)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def _run(engine: Engine, rid: str) -> list[int]:
    while True:
        for out in collector(engine).step():
            if out.request_id == rid and out.finished:
                return list(out.token_ids)


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("name", CONTRACT_NAMES)
def test_cancel_continue_fork_rewind_equal_no_cancel(name: str, precision: str) -> None:
    engine = _engine(name, precision, True)
    p = _tokens(9, seed=9)
    conv = engine.open_conversation()
    rid = collector(engine).add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                        conversation_id=conv)
    delivered: list[int] = []
    while len(delivered) < 3:
        for out in collector(engine).step():
            delivered += out.new_token_ids
    engine.abort(rid)
    collector(engine).step()
    assert engine.conversation_tokens(conv) == p + delivered  # C3
    held = engine.scheduler.conversation(conv).sequence.num_computed

    follow = _tokens(5, seed=100)
    before = engine.scheduler.num_computed_tokens
    rid = collector(engine).add_request(follow, GREEDY, conversation_id=conv)
    answer = _run(engine, rid)
    history = p + delivered + follow
    assert answer == _no_cancel(name, precision, history)  # C4
    assert engine.scheduler.num_computed_tokens - before == len(history) - held + len(answer) - 1  # C7

    fork = engine.fork_conversation(conv)
    extra = _tokens(4, seed=200)
    rid = collector(engine).add_request(extra, GREEDY, conversation_id=fork)
    assert _run(engine, rid) == _no_cancel(name, precision, history + answer + extra)

    kept = len(history) - 7
    engine.rewind_conversation(conv, kept)
    rid = collector(engine).add_request(extra, GREEDY, conversation_id=conv)
    assert _run(engine, rid) == _no_cancel(name, precision, history[:kept] + extra)

    for c in (conv, fork):
        engine.close_conversation(c)
    collector(engine).step()
    engine.check_block_accounting()  # C5
    assert engine.pool.num_referenced == 0

    tokens = history + answer + extra + _tokens(3, seed=300)  # a prefix hit on the closed fork's blocks
    (out,) = engine.generate([tokens], GREEDY)
    assert out.usage.cached_tokens > 8
    assert list(out.token_ids) == _no_cancel(name, precision, tokens)
