"""The disk tier through the Python Engine API: a conversation survives a restart (the
next turn's cached tokens come from disk, and its greedy tokens equal an engine that
never restarted), blocks evicted from a small pool come back from disk (also behind a
prefix still in memory), and a bad file
only costs a recompute. Tiny random-weight models, on the CPU."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from bargein.config import CacheConfig, EngineConfig, SchedulerConfig
from bargein.engine.block_keys import chain_hash
from bargein.engine.device import build_model
from bargein.engine.engine import Engine
from bargein.engine.kv_disk.block_file import SUFFIX
from bargein.engine.sampling import SamplingParams
from tests.tiny_engine import TINY, ByteTokenizer, collector, prompt, reference_greedy, tiny_weights

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BLOCK = 4


def disk_engine(directory: Path | None, *, num_blocks: int = 64, precision: str = "exact",
                identity: str = "tiny-seed-0") -> Engine:
    config = EngineConfig(
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks,
                          kv_disk_dir=None if directory is None else str(directory), kv_disk_bytes=1 << 30),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        device="cpu", dtype="float32", cuda_graphs=False, precision=precision)
    model = build_model(TINY, dict(tiny_weights(0)), config, max_positions=TINY.max_position_embeddings)
    return Engine(model, ByteTokenizer(), config, model_name="tiny", model_identity=identity)


def turn(engine: Engine, tokens: list[int], conv: str | None = None, params: SamplingParams = GREEDY):
    rid = collector(engine).add_request(tokens, params, conversation_id=conv)
    while True:
        for out in collector(engine).step():
            if out.request_id == rid and out.finished:
                return out


def conversation(engine: Engine, first: list[int]) -> tuple[str, list[int]]:
    """A conversation with one answered turn: its id and its tokens (prompt + answer)."""
    conv = engine.open_conversation()
    turn(engine, first, conv)
    return conv, engine.conversation_tokens(conv)


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_a_conversation_continues_from_disk_after_a_restart(tmp_path: Path, precision: str) -> None:
    first, second = prompt(21, 1), prompt(6, 2)
    before = disk_engine(tmp_path, precision=precision)
    _, tokens = conversation(before, first)  # 21 + 8 = 29 tokens: 7 full blocks, 1 token past them
    before.close()  # shutdown: every full block is written
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 7

    after = disk_engine(tmp_path, precision=precision)  # a restart over the same directory
    assert after.disk is not None and after.disk.tier.rebuild.blocks == 7
    conv = after.open_conversation(tokens)  # as Conversation.load does
    computed = after.scheduler.num_computed_tokens
    out = turn(after, second, conv)
    # Every full block comes from disk; the last, partly filled block is recomputed (only
    # full blocks are registered, so only they are written).
    assert out.usage.cached_tokens == 28 == len(tokens) // BLOCK * BLOCK
    assert after.scheduler.num_computed_tokens - computed == len(tokens) + len(second) - 28 + GREEDY.max_tokens - 1
    stats = after.stats().kv_disk
    assert stats is not None and (stats.blocks, stats.hits, stats.misses, stats.skipped_files) == (7, 7, 0, 0)

    never = disk_engine(None, precision=precision)  # never restarted, no disk tier
    ref_conv, ref_tokens = conversation(never, first)
    assert ref_tokens == tokens
    ref = turn(never, second, ref_conv)
    assert ref.usage.cached_tokens == len(tokens) - 1  # in memory, the partial block too
    assert list(out.token_ids) == list(ref.token_ids)
    if precision == "exact":
        assert list(out.token_ids) == reference_greedy(tokens + second, GREEDY.max_tokens)
    for engine in (after, never):
        engine.close_conversation(conv if engine is after else ref_conv)
        engine.check_block_accounting()
        assert engine.pool.num_referenced == 0
        engine.close()


def test_blocks_evicted_from_a_small_pool_come_back_from_disk(tmp_path: Path) -> None:
    engine = disk_engine(tmp_path, num_blocks=16)
    shared = prompt(32, 3)  # 8 full blocks
    first = turn(engine, shared + [1], params=SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    for seed in range(4, 8):  # other prompts push the shared prefix out of memory
        turn(engine, prompt(40, seed), params=SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert engine.pool.uncached_full_blocks(shared + [2], 32), "the prefix should have been evicted"
    engine.disk.tier.flush(10)
    again = turn(engine, shared + [2])
    assert again.usage.cached_tokens == 32
    assert engine.disk.stats().hits >= 8 and engine.disk.loaded_blocks >= 8
    assert list(again.token_ids) == reference_greedy(shared + [2], GREEDY.max_tokens)
    assert first.usage.cached_tokens == 0
    engine.check_block_accounting()
    engine.close()


def test_a_prefix_half_in_memory_half_on_disk_is_reused_whole(tmp_path: Path) -> None:
    """The pool evicts a sequence's last blocks first: its head stays in memory, its tail
    goes to disk. Reading the tail back must not evict the head it continues (adopting
    makes the memory prefix most recently used first), so every full block is reused."""
    engine = disk_engine(tmp_path, num_blocks=24)
    shared = prompt(40, 3)  # 10 full blocks
    once = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    turn(engine, shared + [1], params=once)
    turn(engine, prompt(56, 4), params=once)  # 15 blocks: pushes out part of the shared prefix
    left = engine.pool.uncached_full_blocks(shared + [2], 40)
    assert 0 < len(left) < 10, "the prefix's tail should have left memory, its head stayed"
    engine.disk.tier.flush(10)
    again = turn(engine, shared + [2])
    assert again.usage.cached_tokens == 40 and engine.disk.loaded_blocks == len(left)
    assert list(again.token_ids) == reference_greedy(shared + [2], GREEDY.max_tokens)
    engine.check_block_accounting()
    engine.close()


def test_a_bad_file_costs_a_recompute_never_a_wrong_token(tmp_path: Path, caplog) -> None:
    first, second = prompt(21, 11), prompt(6, 12)
    before = disk_engine(tmp_path)
    _, tokens = conversation(before, first)
    before.close()
    keys, parent = [], None
    for i in range(len(tokens) // BLOCK):
        parent = chain_hash(parent, tuple(tokens[i * BLOCK:(i + 1) * BLOCK]))
        keys.append(parent)
    (victim,) = tmp_path.glob(f"{keys[3].hex()}.*{SUFFIX}")
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF  # a flipped payload byte in block 3: the checksum catches it
    victim.write_bytes(bytes(data))
    after = disk_engine(tmp_path)
    conv = after.open_conversation(tokens)
    with caplog.at_level("WARNING", "bargein.kv_disk"):
        out = turn(after, second, conv)
    assert out.usage.cached_tokens == 3 * BLOCK  # blocks 0-2 from disk, the rest recomputed
    assert after.disk.stats().skipped_files == 1 and not victim.exists()
    assert [r.getMessage() for r in caplog.records if victim.name in r.getMessage()] != []
    assert len(caplog.records) == 1
    assert list(out.token_ids) == reference_greedy(tokens + second, GREEDY.max_tokens)
    after.close_conversation(conv)
    after.check_block_accounting()
    after.close()


def test_another_model_never_reads_these_blocks(tmp_path: Path) -> None:
    first, second = prompt(21, 21), prompt(6, 22)
    before = disk_engine(tmp_path)
    _, tokens = conversation(before, first)
    before.close()
    other = disk_engine(tmp_path, identity="tiny-seed-0-but-retrained")
    assert other.disk.tier.rebuild.removed_foreign == 7 and other.disk.tier.rebuild.blocks == 0
    conv = other.open_conversation(tokens)
    out = turn(other, second, conv)
    assert out.usage.cached_tokens == 0
    other.close()


def test_a_second_engine_on_the_same_directory_runs_without_the_tier(tmp_path: Path, caplog) -> None:
    owner = disk_engine(tmp_path)
    with caplog.at_level("WARNING", "bargein.kv_disk"):
        second = disk_engine(tmp_path)
    assert owner.disk is not None and second.disk is None
    assert any("in use by another bargein server" in r.getMessage() for r in caplog.records)
    assert list(turn(second, prompt(9, 30)).token_ids) == reference_greedy(prompt(9, 30), GREEDY.max_tokens)
    second.close()
    owner.close()
    assert os.listdir(tmp_path) == ["bargein-kv-disk.lock"]


def test_a_cancelled_prefill_is_continued_from_disk_after_a_restart(tmp_path: Path) -> None:
    """The llama.cpp#22160 loop: a client times out during a long prefill and retries. What
    the cancelled prefill computed is kept, through a restart, so the retry continues it."""
    long_prompt = prompt(200, 40)
    before = disk_engine(tmp_path)  # 64 tokens a step: the prompt takes 4 steps
    rid = collector(before).add_request(long_prompt, GREEDY)
    collector(before).step()
    collector(before).step()  # 128 tokens computed
    before.abort(rid)
    while collector(before).pending:
        collector(before).step()
    assert before.scheduler.num_computed_tokens == 128
    before.close()
    after = disk_engine(tmp_path)
    out = turn(after, long_prompt)
    assert out.usage.cached_tokens == 128
    assert list(out.token_ids) == reference_greedy(long_prompt, GREEDY.max_tokens)
    after.check_block_accounting()
    after.close()


def test_conversation_save_and_load_hit_the_disk_after_an_async_engine_shutdown(tmp_path: Path) -> None:
    """Through AsyncEngine and Conversation: shutdown writes the blocks; a new engine
    loading the saved conversation continues from disk, with the same greedy answer."""
    from bargein.engine.async_engine import AsyncEngine
    from bargein.engine.conversation import Conversation

    first, second = prompt(22, 51), prompt(5, 52)
    saved = tmp_path / "conversation.json"

    async def answer(conv: Conversation, tokens: list[int]):
        await conv.prompt(tokens)
        final = None
        async for out in conv.generate(GREEDY):
            final = out
        return final

    async def before_restart() -> None:
        ae = AsyncEngine(disk_engine(tmp_path / "kv")).start()
        conv = Conversation.open(ae)
        await answer(conv, first)
        await conv.save(saved)
        await ae.shutdown()  # the loop stops, then every full block is written

    async def after_restart():
        ae = AsyncEngine(disk_engine(tmp_path / "kv")).start()
        conv = Conversation.load(ae, saved)
        out = await answer(conv, second)
        tokens = await conv.tokens()
        await conv.close()
        await ae.shutdown()
        return out, tokens

    asyncio.run(before_restart())
    assert len(list((tmp_path / "kv").glob(f"*{SUFFIX}"))) == (len(first) + GREEDY.max_tokens - 1) // BLOCK
    out, tokens = asyncio.run(after_restart())
    history = len(first) + GREEDY.max_tokens
    assert out.usage.cached_tokens == (history - 1) // BLOCK * BLOCK == 28
    assert list(out.token_ids) == reference_greedy(tokens[:history + len(second)], GREEDY.max_tokens)
