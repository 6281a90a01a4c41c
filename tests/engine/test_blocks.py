"""Block pool accounting, prefix cache, eviction order and copy on write (no torch)."""

from __future__ import annotations

import pytest

from bargein.engine.blocks import BlockPool, BlockTable, OutOfBlocks


def filled(pool: BlockPool, tokens: list[int]) -> BlockTable:
    """A table holding ``tokens``, computed and registered, as after a prompt step."""
    table = BlockTable()
    pool.ensure_writable(table, 0, len(tokens))
    pool.register_full_blocks(table, tokens, len(tokens))
    return table


def test_allocation_accounting_is_exact() -> None:
    pool = BlockPool(8, 4)
    table = filled(pool, list(range(10)))  # 3 blocks: 2 full + 1 partial
    assert (pool.num_free, pool.num_referenced, pool.num_cached) == (5, 3, 0)
    pool.check_invariants([table])
    pool.release(table)
    # The two full blocks stay cached for reuse; the partial one is free.
    assert (pool.num_free, pool.num_referenced, pool.num_cached) == (6, 0, 2)
    pool.check_invariants([])


def test_prefix_hit_reuses_blocks_and_counts() -> None:
    pool = BlockPool(8, 4)
    first = filled(pool, list(range(12)))
    ids = list(first.block_ids)
    pool.release(first)
    second = BlockTable()
    hit, copies = pool.match_prefix(second, list(range(10)) + [99, 98], max_tokens=11)
    # Two full blocks are shared; the third matches 2 tokens of 4: copied, not shared.
    assert hit == 10 and second.block_ids[:2] == ids[:2]
    assert copies == [(ids[2], second.block_ids[2])] and second.block_ids[2] not in ids
    assert pool.num_cached == 1 and pool.num_referenced == 3
    pool.check_invariants([second])


def test_prefix_hit_requires_the_whole_chain() -> None:
    pool = BlockPool(8, 4)
    pool.release(filled(pool, [1, 2, 3, 4, 5, 6, 7, 8]))
    table = BlockTable()
    # Same second block, different first block: no hit at all.
    assert pool.match_prefix(table, [0, 2, 3, 4, 5, 6, 7, 8], max_tokens=8) == (0, [])


def test_eviction_is_least_recently_released_and_tail_first() -> None:
    pool = BlockPool(4, 2)
    a = filled(pool, [1, 1, 2, 2])  # blocks a0, a1
    b = filled(pool, [3, 3, 4, 4])  # blocks b0, b1
    a_ids, b_ids = list(a.block_ids), list(b.block_ids)
    pool.release(a)
    pool.release(b)
    assert pool.num_free == 0 and pool.num_cached == 4
    fresh = BlockTable()
    pool.ensure_writable(fresh, 0, 2)  # needs one block: evicts a's tail first
    assert fresh.block_ids == [a_ids[1]]
    assert pool.evictions == 1
    t = BlockTable()
    assert pool.match_prefix(t, [1, 1, 2, 2], max_tokens=4) == (2, [])  # a's head survived
    assert t.block_ids == [a_ids[0]]
    pool.check_invariants([fresh, t])
    assert b_ids  # b untouched
    assert pool.num_cached == 2


def test_out_of_blocks_changes_nothing() -> None:
    pool = BlockPool(2, 4)
    held = filled(pool, [1, 2, 3, 4, 5])
    table = BlockTable()
    with pytest.raises(OutOfBlocks):
        pool.ensure_writable(table, 0, 5)
    assert table.block_ids == [] and pool.num_free == 0
    pool.check_invariants([held, table])


def test_fork_shares_blocks_and_copies_on_write() -> None:
    pool = BlockPool(8, 4)
    parent = filled(pool, [1, 2, 3, 4, 5, 6])  # full block + partial block
    child = pool.fork(parent)
    assert child.block_ids == parent.block_ids
    assert [pool.ref_count(b) for b in parent.block_ids] == [2, 2]
    # The child writes position 6, inside the shared partial block: it gets a copy.
    copies = pool.ensure_writable(child, 6, 7)
    assert copies == [(parent.block_ids[1], child.block_ids[1])]
    assert child.block_ids[0] == parent.block_ids[0] and child.block_ids[1] != parent.block_ids[1]
    # Now the parent owns its partial block alone and writes in place.
    assert pool.ensure_writable(parent, 6, 7) == []
    pool.check_invariants([parent, child])


def test_truncate_then_write_never_corrupts_a_cached_block() -> None:
    pool = BlockPool(8, 4)
    a = filled(pool, [1, 2, 3, 4, 5, 6, 7, 8])
    shared = BlockTable()
    pool.release(b := pool.fork(a))
    assert b.block_ids == []
    pool.match_prefix(shared, [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=8)  # another sequence holds both
    pool.truncate(a, 6)  # a keeps block 0 and half of block 1
    assert len(a.block_ids) == 2 and a.hashes == [a.hashes[0]]
    copies = pool.ensure_writable(a, 6, 8)  # block 1 is shared: copy, never overwrite
    assert len(copies) == 1 and copies[0][0] == shared.block_ids[1]
    pool.check_invariants([a, shared])
    # Once a rewound block is ours alone, writing it forgets its stale hash instead.
    pool.release(shared)
    c = filled(pool, [7, 7, 7, 7])
    pool.truncate(c, 2)
    assert pool.is_registered(c.block_ids[0])
    pool.ensure_writable(c, 2, 3)
    assert not pool.is_registered(c.block_ids[0])
    pool.check_invariants([a, c])


def test_duplicate_content_is_not_registered_twice() -> None:
    pool = BlockPool(8, 4)
    a = filled(pool, [5, 5, 5, 5])
    b = filled(pool, [5, 5, 5, 5])
    assert pool.is_registered(a.block_ids[0]) and not pool.is_registered(b.block_ids[0])
    pool.release(b)
    assert pool.num_free == 7  # b's unregistered copy is plain free
    pool.check_invariants([a])


def test_prefix_caching_can_be_disabled() -> None:
    pool = BlockPool(8, 4, enable_prefix_caching=False)
    pool.release(filled(pool, [1, 2, 3, 4]))
    assert pool.num_cached == 0 and pool.num_free == 8
    assert pool.match_prefix(BlockTable(), [1, 2, 3, 4, 5], max_tokens=4) == (0, [])


def test_a_released_partial_block_is_reused_at_token_granularity() -> None:
    pool = BlockPool(8, 4)
    tokens = [1, 2, 3, 4, 5, 6, 7]  # one full block, then 3 tokens, of which 2 computed
    table = filled(pool, tokens[:6])
    pool.release(table, tokens, num_computed=6)
    partial = [b for b in range(8) if pool.num_cached and not pool.is_registered(b) and pool.ref_count(b) == 0]
    assert pool.num_cached == 2  # the full block and the partial one
    pool.check_invariants([])
    again = BlockTable()
    hit, copies = pool.match_prefix(again, [1, 2, 3, 4, 5, 6, 9, 9], max_tokens=7)
    assert hit == 6 and len(copies) == 1
    src, dst = copies[0]
    assert src in partial and again.block_ids[1] == dst
    assert pool.ref_count(src) == 0 and pool.num_cached == 1  # the source stays cached for others
    pool.check_invariants([again])
    # A different head after the same parent matches nothing more than the full block.
    other = BlockTable()
    assert pool.match_prefix(other, [1, 2, 3, 4, 8, 8], max_tokens=5) == (4, [])


def test_keys_are_cryptographic_and_hits_are_checked_against_tokens(monkeypatch) -> None:
    from bargein.engine import blocks

    assert isinstance(blocks.chain_hash(None, [1, 2]), bytes) and len(blocks.chain_hash(None, [1, 2])) == 16
    assert blocks.chain_hash(None, [1, 2]) != blocks.chain_hash(None, [2, 1])
    monkeypatch.setattr(blocks, "chain_hash", lambda parent, tokens: b"collide")
    pool = BlockPool(8, 4)
    pool.release(filled(pool, [1, 2, 3, 4]))
    assert pool.match_prefix(BlockTable(), [5, 6, 7, 8, 9], max_tokens=4) == (0, [])
