"""A closed conversation's blocks are deleted from disk, exactly those that nothing else
holds: a prefix a one-shot request shared (a cached prefix) and blocks a fork still holds
stay; a closed block is not written back at shutdown; and a restored conversation's
close (after a restart) deletes the blocks it read back. Tiny random-weight model, CPU."""

from __future__ import annotations

import gc
from pathlib import Path

from bargein.engine.block_holders import BlockHolders
from bargein.engine.disk_cache import chain_keys
from bargein.engine.kv_disk.block_file import SUFFIX, parse_name
from bargein.engine.sampling import SamplingParams
from tests.engine.test_kv_disk_engine import BLOCK, conversation, disk_engine, turn
from tests.tiny_engine import prompt

SHORT = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def on_disk(directory: Path) -> set[bytes]:
    return {parse_name(p.name)[0] for p in directory.glob(f"*{SUFFIX}")}


def written(keys: list[bytes], tokens: list[int]) -> list[bytes]:
    """The keys of ``tokens``' registered blocks (the last token has no K/V yet)."""
    return keys[:(len(tokens) - 1) // BLOCK]


def test_closing_deletes_only_the_blocks_nothing_else_holds(tmp_path: Path) -> None:
    engine = disk_engine(tmp_path)
    system = prompt(8, 40)  # 2 blocks that a one-shot request computes first: a cached prefix
    turn(engine, system + [7], params=SHORT)
    gc.collect()  # the request's table is gone: its blocks are a cached prefix now
    c_id, c_tokens = conversation(engine, system + prompt(12, 41))  # 20 + 8 tokens: 6 blocks with K/V
    g_id, g_tokens = conversation(engine, system + prompt(12, 42))
    f_id = engine.fork_conversation(c_id)  # holds every block of c
    c_keys, g_keys = chain_keys(c_tokens, BLOCK), chain_keys(g_tokens, BLOCK)
    shared = c_keys[:2]
    assert shared == g_keys[:2]
    engine.disk.write_registered(10)
    assert engine.disk.tier.flush(10)
    assert on_disk(tmp_path) == set(written(c_keys, c_tokens)) | set(written(g_keys, g_tokens))

    engine.close_conversation(g_id)  # its own 4 blocks go; the shared prefix stays
    assert engine.disk.tier.flush(10)
    assert on_disk(tmp_path) == set(written(c_keys, c_tokens))
    assert engine.disk.stats().deleted == 4

    engine.close_conversation(c_id)  # the fork still holds every block
    assert engine.disk.tier.flush(10)
    assert on_disk(tmp_path) == set(written(c_keys, c_tokens))

    engine.close_conversation(f_id)  # the last holder: all but the cached prefix go
    assert engine.disk.tier.flush(10)
    assert on_disk(tmp_path) == set(shared)
    assert engine.disk.stats().deleted == 8
    engine.check_block_accounting()
    engine.close()  # the shutdown writes what is registered, but no closed block again
    assert on_disk(tmp_path) == set(shared)


def test_a_closed_conversation_evicted_later_is_not_written_again(tmp_path: Path) -> None:
    engine = disk_engine(tmp_path, num_blocks=16)
    conv, tokens = conversation(engine, prompt(21, 43))  # 29 tokens: 7 blocks with K/V
    keys = written(chain_keys(tokens, BLOCK), tokens)
    engine.close_conversation(conv)  # in memory only: nothing to delete, nothing written after
    for seed in range(44, 48):  # other prompts evict its cached blocks
        turn(engine, prompt(40, seed), params=SHORT)
    assert engine.pool.uncached_full_blocks(tokens, len(tokens)), "its blocks should have been evicted"
    engine.close()
    assert on_disk(tmp_path).isdisjoint(keys)
    assert on_disk(tmp_path)  # the other prompts' blocks were written


def test_a_restored_conversation_deletes_what_it_read_back(tmp_path: Path) -> None:
    before = disk_engine(tmp_path)
    _, tokens = conversation(before, prompt(21, 49))
    before.close()
    keys = written(chain_keys(tokens, BLOCK), tokens)
    assert on_disk(tmp_path) == set(keys)
    after = disk_engine(tmp_path)
    conv = after.open_conversation(tokens)  # as Conversation.load does
    out = turn(after, prompt(6, 50), conv)
    assert out.usage.cached_tokens == len(tokens) // BLOCK * BLOCK  # from disk
    whole = after.conversation_tokens(conv)
    after.close_conversation(conv)
    assert after.disk.tier.flush(10)
    assert on_disk(tmp_path) == set()
    after.close()
    assert on_disk(tmp_path) == set() and len(whole) > len(tokens)


def test_block_holders_follow_tables_by_identity() -> None:
    class Table:  # equal to each other, like two empty BlockTables: identity must decide
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = object.__hash__

    holders, a, b = BlockHolders(), Table(), Table()
    holders.note(b"k1", a)
    holders.note(b"k2", a)
    holders.note(b"k2", b)
    assert holders.close(b, [b"k1"]) == []  # not b's
    assert holders.close(a, [b"k1", b"k2"]) == [b"k1"] and holders.is_closed(b"k1")
    assert holders.close(b, [b"k2"]) == [b"k2"]
    holders.note(b"k1", b)  # taken again: no longer closed
    assert not holders.is_closed(b"k1")
    gone = Table()
    holders.note(b"k3", gone)
    del gone
    gc.collect()
    holders.note(b"k3", a)
    assert holders.close(a, [b"k3"]) == []  # a holder that is gone: a cached prefix stays
    assert holders.prune(lambda k: k == b"k3") == 2 and len(holders) == 1
