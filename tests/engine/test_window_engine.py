"""Blocks given back outside a sliding window, in an engine (issue 25, item 3).

A tiny model whose every layer attends within a window of 8 (as Mistral's), blocks of 4.
Its engine gives back the blocks no query reads again; the reference is the same model
in an engine that keeps every block (``pool.window = None``). Answers must be equal token
for token, the pool's blocks counted at every step, and the cancellation contract must
hold after blocks were dropped: a cancelled conversation continues, forks and rewinds
(within the window and across it: a rewind across it recomputes from the tokens, hitting
the prefix cache where the dropped blocks went) exactly as the reference.
"""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest

from bargein.config import CacheConfig, EngineConfig, SchedulerConfig
from bargein.engine.device import build_model
from bargein.engine.engine import Engine
from bargein.engine.sampling import SamplingParams
from tests.tiny_engine import TINY, ByteTokenizer, collector, step_until_delivered, tiny_weights

W, BS = 8, 4
WINDOWED = dataclasses.replace(TINY, sliding_window=W, local_layers=tuple(range(TINY.num_layers)))


@functools.cache
def _engine(precision: str, prefix_caching: bool, keep_all: bool, num_blocks: int = 64,
            batched_tokens: int = 5) -> Engine:
    # Prompt chunks of 5 tokens: prefills span steps and share them with other rows' decodes.
    config = EngineConfig(cache=CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=batched_tokens),
                          precision=precision, device="cpu", dtype="float32")
    model = build_model(WINDOWED, dict(tiny_weights(0)), config, max_positions=WINDOWED.max_position_embeddings)
    engine = Engine(model, ByteTokenizer(), config, model_name="windowed")
    assert engine.pool.window == W
    if keep_all:
        engine.pool.window = None  # the reference: every block kept, as before issue 25 item 3
    return engine


def _reference(precision: str, tokens: list[int], n: int) -> list[int]:
    """Greedy ``n`` tokens after ``tokens`` from the engine that keeps every block."""
    return list(_reference_run(precision, tuple(tokens), n))


@functools.cache
def _reference_run(precision: str, tokens: tuple[int, ...], n: int) -> tuple[int, ...]:
    (out,) = _engine(precision, False, True).generate([list(tokens)], SamplingParams(temperature=0, max_tokens=n,
                                                                                     ignore_eos=True))
    return tuple(out.token_ids)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def _run(engine: Engine, rid: str) -> list[int]:
    while True:
        for out in collector(engine).step():
            if out.request_id == rid and out.finished:
                return list(out.token_ids)


def test_the_pool_holds_only_the_window_at_every_step() -> None:
    """Without a prefix cache a dropped block is free at once: count the free blocks after
    every step, against the reference's, which grow with the sequence."""
    ours, ref = _engine("exact", False, False, 16), _engine("exact", False, True, 16)
    prompt, params = _tokens(6, seed=1), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    answers = []
    for engine in (ours, ref):
        rid = collector(engine).add_request(prompt, params)
        held_at_most = 0
        while True:
            outs = collector(engine).step()
            if any(o.request_id == rid and o.finished for o in outs):
                answers.append(list(next(o for o in outs if o.request_id == rid).token_ids))
                break
            seq = engine.scheduler.requests[rid].sequence
            c = seq.num_computed
            dropped = max(0, c - W - BS) // BS if engine is ours else 0
            assert seq.block_table.num_dropped == dropped
            assert engine.pool.num_free == 16 - (-(-c // BS) - dropped), c  # exactly the blocks [c - W - BS, c) span
            held_at_most = max(held_at_most, engine.pool.num_referenced)
            engine.check_block_accounting()
        assert engine.pool.num_free == 16
        assert held_at_most == (W // BS + 2 if engine is ours else 9)  # K/V of 34 tokens at most: 9 blocks
    assert answers[0] == answers[1]


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_a_batch_longer_than_the_window_equals_keeping_every_block(precision: str) -> None:
    """Freed blocks are taken again at once by the batch's other rows (the free list is a
    stack), so a read of a dropped block would read another row's K/V."""
    engine = _engine(precision, False, False)
    prompts = [_tokens(3, seed=2), _tokens(13, seed=3), _tokens(22, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    before = engine.pool.dropped_blocks
    outs = engine.generate(prompts, params)
    assert engine.pool.dropped_blocks - before >= 3 + 5 + 7  # (3 + 24 - 12) // 4 ... (22 + 24 - 12) // 4
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.token_ids) == _reference(precision, prompt, 24)
    engine.check_block_accounting()
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_cancel_continue_fork_rewind_after_blocks_were_dropped(precision: str) -> None:
    engine = _engine(precision, True, False)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    p = _tokens(9, seed=9)
    conv = engine.open_conversation()
    rid = collector(engine).add_request(p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                                        conversation_id=conv)
    delivered = step_until_delivered(engine, 14)
    engine.abort(rid)
    collector(engine).step()
    assert engine.conversation_tokens(conv) == p + delivered  # C3
    seq = engine.scheduler.conversation(conv).sequence
    held = seq.num_computed
    assert seq.block_table.num_dropped == max(0, held - W - BS) // BS >= 2

    follow = _tokens(5, seed=100)
    before = engine.scheduler.num_computed_tokens
    rid = collector(engine).add_request(follow, greedy, conversation_id=conv)
    answer = _run(engine, rid)
    history = p + delivered + follow
    assert answer == _reference(precision, history, 6)  # C4
    assert engine.scheduler.num_computed_tokens - before == len(history) - held + len(answer) - 1  # C7

    fork = engine.fork_conversation(conv)
    extra = _tokens(4, seed=200)
    rid = collector(engine).add_request(extra, greedy, conversation_id=fork)
    assert _run(engine, rid) == _reference(precision, history + answer + extra, 6)

    # A rewind that stays clear of the dropped blocks keeps the K/V.
    kept = len(history) + len(answer) - 3
    engine.rewind_conversation(conv, kept)
    assert seq.num_computed == kept and seq.block_table.num_dropped > 0
    rid = collector(engine).add_request(extra, greedy, conversation_id=conv)
    assert _run(engine, rid) == _reference(precision, (history + answer)[:kept] + extra, 6)

    # One across the window recomputes from the tokens: the dropped blocks are in the prefix cache.
    kept = 10
    tokens = engine.conversation_tokens(conv)[:kept]
    engine.rewind_conversation(conv, kept)
    assert seq.num_computed == 0 and seq.block_table.num_blocks == 0
    before = engine.scheduler.num_computed_tokens
    rid = collector(engine).add_request(extra, greedy, conversation_id=conv)
    assert _run(engine, rid) == _reference(precision, tokens + extra, 6)
    assert engine.scheduler.num_computed_tokens - before < kept + len(extra) + 6 - 1  # a prefix hit

    for c in (conv, fork):
        engine.close_conversation(c)
    collector(engine).step()
    engine.check_block_accounting()  # C5
    assert engine.pool.num_referenced == 0

    # A prefix hit longer than the window, on the closed fork's chain.
    tokens = history + answer + extra + _tokens(3, seed=300)
    (out,) = engine.generate([tokens], greedy)
    assert out.usage.cached_tokens > 2 * W
    assert list(out.token_ids) == _reference(precision, tokens, 6)


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_a_conversation_longer_than_the_pool(precision: str) -> None:
    """An all-local model's context is not bounded by the pool: 6 blocks of 4 (24 tokens)
    hold a conversation of 150. Prompt chunks are cut to the pool's ``max_chunk_tokens``
    (9: a window of 8 plus 9 tokens always fit 6 blocks) although a step may carry 64; the
    pool is counted at every step; the answers, a cancel and its continuation equal an
    engine that keeps every block and computes the same chunks (a step of 9 tokens)."""
    engine = _engine(precision, True, False, num_blocks=6, batched_tokens=64)
    assert engine.pool.max_chunk_tokens == 9 and engine.max_model_len == WINDOWED.max_position_embeddings
    reference = _engine(precision, False, True, num_blocks=64, batched_tokens=9)
    prompt = _tokens(60, seed=11)
    conv = engine.open_conversation()
    rid = collector(engine).add_request(prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                                        conversation_id=conv)
    chunks: list[int] = []  # the size of every chunk the runner computes
    submit = engine.runner.submit
    engine.runner.submit = lambda plan: (chunks.extend(len(c.token_ids) for c in plan.chunks), submit(plan))[1]
    delivered: list[int] = []
    try:
        while len(delivered) < 40:
            for out in collector(engine).step():
                assert not out.finished, out  # not ended for want of blocks
                delivered += out.new_token_ids
            engine.check_block_accounting()
            seq = engine.scheduler.requests[rid].sequence
            c, dropped = seq.num_computed, max(0, seq.num_computed - W - BS) // BS
            # to the block: it holds exactly the blocks from c - W - BS on, never more than the pool
            assert (seq.block_table.num_dropped, engine.pool.num_referenced) == (dropped, -(-c // BS) - dropped)
            assert engine.pool.num_referenced <= 6
    finally:
        engine.runner.submit = submit
    engine.abort(rid)
    collector(engine).step()
    assert max(chunks) == 9  # the pool's cap, not the step's 64
    (want,) = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert delivered == list(want.token_ids)
    assert engine.conversation_tokens(conv) == prompt + delivered  # C3

    follow = _tokens(40, seed=12)
    rid = collector(engine).add_request(follow, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                        conversation_id=conv)
    answer = _run(engine, rid)
    (want,) = reference.generate([prompt + delivered + follow], SamplingParams(temperature=0, max_tokens=10,
                                                                               ignore_eos=True))
    assert answer == list(want.token_ids)  # C4, 150 tokens through a pool of 24 slots
    engine.close_conversation(conv)
    collector(engine).step()
    engine.check_block_accounting()
    assert engine.pool.num_referenced == 0
