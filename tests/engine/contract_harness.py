"""The cancellation contract (C3, C4, C5, C7) on one model file, for the test modules of
model files (test_family_contract.py, test_moe_contract.py), each with its own files.

A conversation is cancelled mid-answer, continued, forked and rewound; each answer must
equal, token for token, what an engine that never cancelled, forked or rewound (and has
no prefix cache) gives for the same tokens; a continuation computes only tokens without
K/V; when all is closed no block is held; a later prompt hits the closed fork's blocks.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass

from bargein.config import CacheConfig, EngineConfig, SchedulerConfig
from bargein.engine.engine import Engine
from bargein.engine.sampling import SamplingParams
from tests.tiny_engine import collector, step_until_delivered

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def run(engine: Engine, rid: str) -> list[int]:
    """Steps ``engine`` until request ``rid`` finishes; its tokens."""
    while True:
        for out in collector(engine).step():
            if out.request_id == rid and out.finished:
                return list(out.token_ids)


class ContractHarness:
    """The engines of one set of model files: ``model_path(name, "hf")`` is a model's folder.

    Prompts are read in chunks of 5 tokens, so a prefill spans steps, shares them with
    other rows' decodes and (where the model has a sliding window of 8) crosses the
    window's edge mid-chunk. Engines are built once per (name, precision, prefix caching)."""

    def __init__(self, model_path: Callable[[str, str], str]) -> None:
        self.model_path = model_path
        self.engine = functools.cache(self._build)

    def _build(self, name: str, precision: str, prefix_caching: bool) -> Engine:
        config = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=prefix_caching),
                              scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=5),
                              precision=precision, max_model_len=64, device="cpu")
        return Engine.from_pretrained(self.model_path(name, "hf"), config, progress=False)

    def no_cancel(self, name: str, precision: str, prompt: list[int]) -> list[int]:
        """The greedy answer of an engine without a prefix cache that never cancelled."""
        (out,) = self.engine(name, precision, False).generate([prompt], GREEDY)
        return list(out.token_ids)


@dataclass(frozen=True)
class Turns:
    """The tokens of one check: a prompt of ``prompt_len`` tokens (seeded by its length),
    the follow-up and fork prompts seeded ``100 + seed_offset`` and ``200 + seed_offset``,
    and a rewind ``rewind_back`` tokens back from the end of the continued history."""

    prompt_len: int
    seed_offset: int
    rewind_back: int


def check_cancel_continue_fork_rewind(harness: ContractHarness, name: str, precision: str, turns: Turns) -> None:
    engine = harness.engine(name, precision, True)
    p = tokens(turns.prompt_len, seed=turns.prompt_len)
    conv = engine.open_conversation()
    rid = collector(engine).add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                        conversation_id=conv)
    delivered = step_until_delivered(engine, 3)
    engine.abort(rid)
    collector(engine).step()
    assert engine.conversation_tokens(conv) == p + delivered  # C3
    held = engine.scheduler.conversation(conv).sequence.num_computed

    follow = tokens(5, seed=100 + turns.seed_offset)
    before = engine.scheduler.num_computed_tokens
    rid = collector(engine).add_request(follow, GREEDY, conversation_id=conv)
    answer = run(engine, rid)
    history = p + delivered + follow
    assert answer == harness.no_cancel(name, precision, history)  # C4
    assert engine.scheduler.num_computed_tokens - before == len(history) - held + len(answer) - 1  # C7: only new tokens

    fork = engine.fork_conversation(conv)
    extra = tokens(4, seed=200 + turns.seed_offset)
    rid = collector(engine).add_request(extra, GREEDY, conversation_id=fork)
    assert run(engine, rid) == harness.no_cancel(name, precision, history + answer + extra)

    kept = len(history) - turns.rewind_back
    engine.rewind_conversation(conv, kept)
    rid = collector(engine).add_request(extra, GREEDY, conversation_id=conv)
    assert run(engine, rid) == harness.no_cancel(name, precision, history[:kept] + extra)

    for c in (conv, fork):
        engine.close_conversation(c)
    collector(engine).step()
    engine.check_block_accounting()  # C5
    assert engine.pool.num_referenced == 0

    # A prefix hit on the closed fork's blocks (now in the prefix cache), longer than a window of 8.
    prompt = history + answer + extra + tokens(3, seed=300)
    (out,) = engine.generate([prompt], GREEDY)
    assert out.usage.cached_tokens > 8
    assert list(out.token_ids) == harness.no_cancel(name, precision, prompt)
