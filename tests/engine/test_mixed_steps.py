"""``max_mixed_prefill_tokens``: a step that carries decodes carries at most that many prompt
tokens, so a long prompt arriving beside running streams is prefilled in small chunks and
each stream still gets a token every step, in steps about as long as a decode step.
Counted in tokens and steps (the engine's own step records), never in ms."""

from __future__ import annotations

import math
import os

import pytest

from bargein.config import CacheConfig, EngineConfig, SchedulerConfig
from bargein.engine.device import build_model
from bargein.engine.engine import Engine
from bargein.engine.outputs import OutputCollector
from bargein.engine.sampling import SamplingParams
from tests.tiny_engine import (
    TINY,
    ByteTokenizer,
    prompt,
    reference_greedy,
    target_device,
    tiny_weights,
)

BUDGET = 64


def capped_engine(cap: int | None) -> Engine:
    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=128),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=BUDGET, max_mixed_prefill_tokens=cap),
        device=target_device(), dtype="float32",
        precision=os.environ.get("BARGEIN_TEST_PRECISION", "exact"))  # exact: compared with the dense reference
    model = build_model(TINY, dict(tiny_weights(0)), config, max_positions=TINY.max_position_embeddings)
    return Engine(model, ByteTokenizer(), config, model_name="tiny")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("cap", [8, 5])
def test_a_long_prompt_beside_decodes_comes_in_chunks_of_the_cap_and_no_stream_misses_a_step(cap):
    engine = capped_engine(cap)
    consumer = OutputCollector(engine)
    decoders = {consumer.add_request(prompt(5, seed=i), greedy(16)): prompt(5, seed=i) for i in range(3)}
    while engine.counters.generated_tokens < 3:  # every decoder has its first token
        consumer.step()
    long_prompt = prompt(50, seed=9)
    long_id = consumer.add_request(long_prompt, greedy(3))
    first_step = engine.counters.steps + 1
    tokens: dict[str, list[int]] = {rid: [] for rid in [*decoders, long_id]}
    long_first_token_step = None
    while long_first_token_step is None:
        for out in consumer.step():
            tokens[out.request_id] += list(out.new_token_ids)
            if out.request_id == long_id and out.new_token_ids:
                long_first_token_step = engine.counters.steps
        # Every step since the long prompt arrived gave each decoder exactly one token.
        assert all(len(tokens[rid]) == engine.counters.steps - first_step + 1 for rid in decoders), tokens
    steps = [s for s in engine.counters.recent_steps if s.index >= first_step]
    assert [s.tokens - s.decodes for s in steps[:-1]] == [cap] * (len(steps) - 1)  # the prompt, cap by cap
    assert steps[-1].tokens - steps[-1].decodes == 50 - cap * (len(steps) - 1)  # its rest, sampled
    assert long_first_token_step - first_step + 1 == math.ceil(50 / cap)
    while consumer.pending:
        for out in consumer.step():
            tokens[out.request_id] += list(out.new_token_ids)
    # Chunking changes no token: each answer is the dense reference's.
    for rid, p in decoders.items():
        assert tokens[rid] == reference_greedy(p, 16)[1:]
    assert tokens[long_id] == reference_greedy(long_prompt, 3)
    engine.check_block_accounting()


def test_without_decodes_a_prompt_takes_the_whole_budget():
    engine = capped_engine(8)
    consumer = OutputCollector(engine)
    long_prompt = prompt(50, seed=9)
    rid = consumer.add_request(long_prompt, greedy(2))
    out = [o for o in consumer.step() if o.request_id == rid]
    assert engine.counters.recent_steps[-1].tokens == 50  # one step: nothing was decoding
    assert out and list(out[0].new_token_ids) == reference_greedy(long_prompt, 1)


def test_prompts_wait_in_order_behind_a_capped_prompt_and_a_cached_one_passes():
    """Beside a decode, the first of two long prompts is prefilled cap by cap and the second
    waits its turn (holding no blocks); a prompt that is a cache hit but for its last token
    costs a decode's share and is not held behind them."""
    engine = capped_engine(8)
    consumer = OutputCollector(engine)
    cached = prompt(12, seed=4)
    consumer.add_request(cached, greedy(1))  # now in the prefix cache
    while consumer.pending:
        consumer.step()
    consumer.add_request(prompt(5, seed=1), greedy(30))
    while engine.counters.generated_tokens < 2:
        consumer.step()
    a = consumer.add_request(prompt(20, seed=2), greedy(1))
    b = consumer.add_request(prompt(20, seed=3), greedy(1))
    c = consumer.add_request(cached, greedy(1))
    added_at = engine.counters.steps
    firsts: dict[str, int] = {}
    while len(firsts) < 3:
        for out in consumer.step():
            if out.request_id in (a, b, c) and out.new_token_ids:
                firsts.setdefault(out.request_id, engine.counters.steps)
        last = engine.counters.recent_steps[-1]
        assert last.tokens - last.decodes <= 8, last
    assert firsts[c] == added_at + 1  # the cache hit: in the first step, past both prompts
    assert firsts[a] == added_at + 3  # 20 tokens, 8 a step
    assert firsts[b] == added_at + 5  # 4 of its tokens beside a's last 4, then 8, then 8
    while consumer.pending:
        consumer.step()
    engine.check_block_accounting()
    assert engine.pool.num_referenced == 0


def test_the_cap_must_be_positive():
    with pytest.raises(ValueError, match="max_mixed_prefill_tokens"):
        SchedulerConfig(max_mixed_prefill_tokens=0)
