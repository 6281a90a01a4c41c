"""Prefix-cache namespaces (``SamplingParams.cache_salt``): reuse only within a salt, at
token granularity as before, with outputs token for token equal to the reference (C4)
and every block accounted for (C5)."""

from __future__ import annotations

from dataclasses import replace

from bargein.engine.block_keys import chain_hash, namespace_root
from bargein.engine.blocks import BlockPool, BlockTable
from bargein.engine.sampling import SamplingParams
from tests.tiny_engine import prompt, reference_greedy, tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def _run(engine, tokens: list[int], salt: str | None):
    (out,) = engine.generate([tokens], replace(GREEDY, cache_salt=salt))
    return list(out.token_ids), out.usage.cached_tokens


def test_reuse_stays_within_a_salt_and_outputs_match_the_reference():
    engine = tiny_engine()
    tokens = prompt(14, 7)  # three full blocks of 4 and a partial one
    expected = reference_greedy(tokens, 5)
    assert _run(engine, tokens, "alice") == (expected, 0)
    assert _run(engine, tokens, "bob") == (expected, 0)  # alice's blocks are not bob's
    assert _run(engine, tokens, None) == (expected, 0)  # nor the common namespace's
    assert _run(engine, tokens, "alice") == (expected, len(tokens) - 1)
    # token granularity within the namespace: a longer prompt reuses the partial block too
    longer = tokens + expected[:2] + [9]
    assert _run(engine, longer, "alice") == (reference_greedy(longer, 5), len(tokens) + 2)  # its answer too
    assert _run(engine, longer, "carol") == (reference_greedy(longer, 5), 0)
    assert _run(engine, longer, "") == (reference_greedy(longer, 5), 0)  # "" is a salt, not None
    engine.check_block_accounting()
    assert engine.pool.num_referenced == 0


def test_a_namespace_root_chains_every_key():
    assert namespace_root(None) is None
    assert namespace_root("a") != namespace_root("b") and namespace_root("a") == namespace_root("a")
    pool = BlockPool(num_blocks=8, block_size=2)
    salted, common = BlockTable(root=namespace_root("a")), BlockTable()
    tokens = [1, 2, 3, 4, 5]
    for table in (salted, common):
        pool.ensure_writable(table, 0, len(tokens))
        pool.register_full_blocks(table, tokens, len(tokens))
    assert salted.hashes[0] == chain_hash(namespace_root("a"), tokens[:2]) != common.hashes[0]
    forked = pool.fork(salted)
    assert forked.root == salted.root
    pool.release(forked)
    wanted = pool.uncached_full_blocks(tokens, 4, root=namespace_root("z"))
    assert [w.parent for w in wanted][:1] == [namespace_root("z")]  # a disk tier looks up the same chain
    for table in (salted, common):
        pool.release(table, tokens, len(tokens))
    pool.check_invariants([])
