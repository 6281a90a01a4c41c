"""Blocks given back outside a sliding window (issue 25, item 3): the pool's side, no torch.

Window 8, blocks of 4: a sequence with ``c`` tokens of K/V holds blocks from the one
holding position ``c - 8 - 4`` on (its next query, at ``c - 1`` or later, reads from
``c - 8``; one block of slack keeps the K/V through a short cut).
"""

from __future__ import annotations

import dataclasses

import pytest

from bargein.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from bargein.engine.block_window import (
    blocks_outside_window,
    holds_window_after_cut,
    longest_context,
    longest_window_hit,
    max_chunk_tokens,
    max_positions,
)
from bargein.engine.blocks import BlockPool, BlockTable, OutOfBlocks
from bargein.engine.scheduler import Scheduler

W, BS = 8, 4


def grown(pool: BlockPool, tokens: list[int], *, step: int = 1) -> BlockTable:
    """A table grown ``step`` tokens at a time, as decode steps grow it, dropping as it goes."""
    table = BlockTable()
    for c in range(step, len(tokens) + 1, step):
        pool.ensure_writable(table, c - step, c)
        pool.register_full_blocks(table, tokens, c)
        pool.drop_outside_window(table, c)
        held = -(-c // BS) - max(0, c - W - BS) // BS
        assert (table.num_dropped, len(table.block_ids)) == (max(0, c - W - BS) // BS, held), c
        pool.check_invariants([table])
    return table


def test_the_rule_keeps_what_a_query_at_c_minus_1_reads() -> None:
    for c in range(64):
        dropped = blocks_outside_window(c, W, BS)
        assert dropped * BS <= max(0, c - W - BS)  # position c - W, read by a query at c - 1, is held,
        assert (dropped + 1) * BS > c - W - BS  # and a block before it, and nothing more
    assert holds_window_after_cut(0, 3, W, BS)
    assert holds_window_after_cut(2, 16, W, BS) and not holds_window_after_cut(2, 15, W, BS)


def test_a_growing_sequence_holds_the_window_and_at_most_two_blocks_more() -> None:
    pool = BlockPool(8, BS, enable_prefix_caching=False, window=W)
    table = grown(pool, list(range(60)))
    assert table.num_dropped == 12 and table.num_blocks == 15 and len(table.block_ids) == 3
    assert pool.num_free == 5 and pool.dropped_blocks == 12  # without a prefix cache, dropped is free
    assert table.forward_ids() == (table.block_ids[0],) * 12 + tuple(table.block_ids)
    pool.release(table)
    assert pool.num_free == 8 and table.num_dropped == 0
    pool.check_invariants([])


def test_dropped_registered_blocks_stay_in_the_prefix_cache() -> None:
    pool = BlockPool(32, BS, window=W)
    tokens = list(range(100, 130))
    table = grown(pool, tokens, step=3)
    assert pool.num_cached == table.num_dropped == 4  # registered, released, evictable
    pool.release(table, tokens, len(tokens))
    again = BlockTable()
    hit, copies = pool.match_prefix(again, tokens + [7], max_tokens=30)
    # The whole chain is still cached: a hit of all 30 tokens (the partial block copied),
    # of which the blocks before position 18 are dropped again at once.
    assert hit == 30 and len(copies) == 1
    assert again.num_dropped == 4 and len(again.block_ids) == 4
    pool.check_invariants([again])


def test_a_hit_longer_than_the_window_survives_the_eviction_of_blocks_before_it() -> None:
    pool = BlockPool(6, BS, window=W)
    tokens = list(range(40))
    table = grown(pool, tokens[:24], step=4)  # blocks 0-2 dropped (cached), 3-5 held
    other = BlockTable()
    pool.ensure_writable(other, 0, 4)  # no block is free: evicts block 0, the oldest
    assert pool.evictions == 1
    pool.release(table, tokens, 24)
    probe = BlockTable()
    hit, copies = pool.match_prefix(probe, tokens[:24], max_tokens=23)
    # 5 full blocks (20 tokens) need only blocks 2-4; block 5's first 3 tokens are copied.
    assert hit == 23 and len(copies) == 1
    assert probe.num_dropped == 2 and len(probe.hashes) == 5 and len(probe.block_ids) == 4
    pool.check_invariants([probe, other])
    no_window = BlockPool(4, BS)
    assert no_window.match_prefix(BlockTable(), tokens, 23) == (0, [])


def test_the_longest_hit_needs_only_the_blocks_its_window_reaches() -> None:
    # Window 8, blocks of 4: a hit of k blocks needs blocks from (4k - 12) // 4 on.
    assert longest_window_hit([True] * 6, None, BS) == (6, 0)
    assert longest_window_hit([True, False, True, True], None, BS) == (1, 0)
    assert longest_window_hit([False, False, True, True, True, True], W, BS) == (6, 3)
    assert longest_window_hit([True, True, True, False, True, True, True], W, BS) == (7, 4)  # 7 need 4-6
    assert longest_window_hit([True, True, True, True, False, True], W, BS) == (4, 1)  # 5 and 6 need block 4
    assert longest_window_hit([False, True, True, True, True, False], W, BS) == (5, 2)
    assert longest_window_hit([False], W, BS) == (0, 0)


def test_fork_shares_the_held_blocks_and_the_dropped_count() -> None:
    pool = BlockPool(16, BS, window=W)
    tokens = list(range(21))
    table = grown(pool, tokens)
    fork = pool.fork(table)
    assert (fork.num_dropped, fork.block_ids, fork.hashes) == (table.num_dropped, table.block_ids, table.hashes)
    assert all(pool.ref_count(b) == 2 for b in table.block_ids)
    copies = pool.ensure_writable(fork, 21, 22)  # the shared last block is copied before a write
    assert len(copies) == 1 and fork.block_ids[-1] != table.block_ids[-1]
    pool.check_invariants([table, fork])


def test_a_cut_inside_the_window_truncates_and_one_across_it_is_refused() -> None:
    pool = BlockPool(16, BS, window=W)
    tokens = list(range(30))
    table = grown(pool, tokens)  # 30 computed: blocks 0-3 (positions 0-15) dropped
    assert table.num_dropped == 4
    assert pool.keeps_window(table, 24) and not pool.keeps_window(table, 23)
    pool.truncate(table, 24)
    assert table.num_blocks == 6 and len(table.hashes) == 6
    with pytest.raises(ValueError, match="outside the window"):
        pool.truncate(table, 23)
    pool.check_invariants([table])


def test_no_window_keeps_every_block() -> None:
    pool = BlockPool(16, BS)
    table = BlockTable()
    tokens = list(range(40))
    pool.ensure_writable(table, 0, 40)
    pool.register_full_blocks(table, tokens, 40)
    assert pool.drop_outside_window(table, 40) == 0 and table.num_dropped == 0
    assert pool.keeps_window(table, 1)
    with pytest.raises(ValueError, match="window"):
        BlockPool(4, BS, window=0)


def _grows_in_chunks(num_blocks: int, chunk: int, first: int, length: int = 120) -> bool:
    """Whether one sequence alone grows to ``length`` tokens in a pool of ``num_blocks``,
    computing ``first`` tokens, then ``chunk`` at a time (dropping after each, as the
    scheduler does); False at the first chunk the pool cannot hold."""
    pool, table, tokens = BlockPool(num_blocks, BS, window=W), BlockTable(), list(range(length))
    c = 0
    while c < length:
        n = min(first if c == 0 else chunk, length - c)
        try:
            pool.ensure_writable(table, c, c + n)
        except OutOfBlocks:
            return False
        c += n
        pool.register_full_blocks(table, tokens, c)
        pool.drop_outside_window(table, c)
        pool.check_invariants([table])
    return True


@pytest.mark.parametrize("num_blocks", [4, 6, 9])
def test_a_chunk_of_max_chunk_tokens_always_fits_and_one_more_token_does_not(num_blocks: int) -> None:
    """The bound is exact: every phase of a sequence (its first chunk of 1..n tokens) fits
    chunks of ``max_chunk_tokens`` in the pool alone, and chunks one token longer overflow
    it at some phase."""
    n = max_chunk_tokens(num_blocks, W, BS)
    assert n == (num_blocks - 2) * BS - W + 1 >= 1
    assert all(_grows_in_chunks(num_blocks, n, first) for first in range(1, n + 1))
    assert not all(_grows_in_chunks(num_blocks, n + 1, first) for first in range(1, n + 2))


def test_an_all_local_pool_bounds_chunks_not_the_context() -> None:
    assert longest_context(4, BS, W) is None  # a window (8) and a chunk of 1 fit 4 blocks of 4
    assert longest_context(3, BS, W) == 12  # a window and one token do not: the pool bounds it
    assert longest_context(5, BS, None) == 20  # some layer global: every block is kept
    pool = BlockPool(6, BS, window=W)
    assert (pool.max_sequence_tokens, pool.max_chunk_tokens) == (None, 9)
    pool = BlockPool(6, BS)
    assert (pool.max_sequence_tokens, pool.max_chunk_tokens) == (24, None)
    for window, num_blocks, expected in ((W, 6, 512), (W, 3, 12), (None, 6, 24)):
        scheduler = Scheduler(SchedulerConfig(), BlockPool(num_blocks, BS, window=window), 512, frozenset())
        assert scheduler.max_model_len == expected


def test_the_rope_tables_cover_an_all_local_models_context() -> None:
    """``max_positions``: what the loader builds the RoPE tables for (a counted pool bounds
    them only where it bounds the context)."""
    local = ModelConfig(vocab_size=16, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=W,
                        local_layers=(0, 1))
    mixed = dataclasses.replace(local, local_layers=(0,))
    counted = EngineConfig(cache=CacheConfig(block_size=BS, num_blocks=6))
    assert max_positions(counted, local) == 512
    assert max_positions(counted, mixed) == 24
    assert max_positions(EngineConfig(cache=CacheConfig(block_size=BS, num_blocks=6), max_model_len=100), local) == 100
    assert max_positions(EngineConfig(), mixed) == 512
