"""The cancellation contract for every family (C3, C4, C5, C7), with cancels inside and
beyond the sliding window of the families that have one (8 tokens, tests/data/families).

A conversation is cancelled mid-answer, continued, forked and rewound across the window;
each answer must equal, token for token, what an engine that never cancelled, forked or
rewound (and has no prefix cache) gives for the same tokens, in ``exact`` and in ``fast``;
a continuation computes only tokens without K/V; when all is closed no block is held.
"""

from __future__ import annotations

import functools
import random

import pytest

from bargein.config import CacheConfig, EngineConfig, SchedulerConfig
from bargein.engine.engine import Engine
from bargein.engine.sampling import SamplingParams
from tests.model.family_files import NAMES, model_path, spec
from tests.tiny_engine import collector

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@functools.cache
def _engine(name: str, precision: str, prefix_caching: bool) -> Engine:
    # Prompt chunks of 5 tokens: a prefill crosses the window's edge mid-chunk and over steps.
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


# A cancel at 6 tokens (inside an 8-token window) and at 16 (beyond it) where the family's
# file has a window; one cancel (at 16) where it has none, for whom the two are alike.
CASES = [pytest.param(name, prompt_len, id=f"{name}-{where if spec(name).window else 'no-window'}")
         for name in NAMES for prompt_len, where in ((3, "inside-window"), (13, "beyond-window"))
         if spec(name).window or prompt_len == 13]


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize(("name", "prompt_len"), CASES)
def test_cancel_continue_fork_rewind_equal_no_cancel(name: str, precision: str, prompt_len: int) -> None:
    engine = _engine(name, precision, True)
    p = _tokens(prompt_len, seed=prompt_len)
    conv = engine.open_conversation()
    rid = collector(engine).add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                        conversation_id=conv)
    delivered: list[int] = []
    while len(delivered) < 3:  # cancelled at 6 tokens (inside an 8-token window) or at 16 (beyond it)
        for out in collector(engine).step():
            delivered += out.new_token_ids
    engine.abort(rid)
    collector(engine).step()
    assert engine.conversation_tokens(conv) == p + delivered  # C3
    held = engine.scheduler.conversation(conv).sequence.num_computed

    follow = _tokens(5, seed=100 + prompt_len)
    before = engine.scheduler.num_computed_tokens
    rid = collector(engine).add_request(follow, GREEDY, conversation_id=conv)
    answer = _run(engine, rid)
    history = p + delivered + follow
    assert answer == _no_cancel(name, precision, history)  # C4
    total = len(history)
    assert engine.scheduler.num_computed_tokens - before == total - held + len(answer) - 1  # C7: only new tokens

    fork = engine.fork_conversation(conv)
    extra = _tokens(4, seed=200 + prompt_len)
    rid = collector(engine).add_request(extra, GREEDY, conversation_id=fork)
    assert _run(engine, rid) == _no_cancel(name, precision, history + answer + extra)

    kept = len(history) - 10  # back across the window's worth of tokens
    engine.rewind_conversation(conv, kept)
    rid = collector(engine).add_request(extra, GREEDY, conversation_id=conv)
    assert _run(engine, rid) == _no_cancel(name, precision, history[:kept] + extra)

    for c in (conv, fork):
        engine.close_conversation(c)
    collector(engine).step()
    engine.check_block_accounting()  # C5
    assert engine.pool.num_referenced == 0

    # A prefix hit longer than the window (the closed fork's blocks, now in the prefix cache).
    tokens = history + answer + extra + _tokens(3, seed=300)
    (out,) = engine.generate([tokens], GREEDY)
    assert out.usage.cached_tokens > 8
    assert list(out.token_ids) == _no_cancel(name, precision, tokens)
