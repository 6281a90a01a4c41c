"""Replica pieces that need no cluster: a resumed request's random stream, the router, tombstones."""

from __future__ import annotations

from dataclasses import replace

from bargein.distributed.router import PrefixIndex, Router, Tombstones, block_hashes
from bargein.engine.sampling import SamplingParams
from tests.tiny_engine import tiny_engine

PROMPT = [5, 17, 42, 99, 3, 8, 120, 64]


def _run(engine, prompt, params, output_offset=0):
    rid = engine.add_request(prompt, params, output_offset=output_offset)
    tokens = []
    while engine.has_work:
        for delta in engine.step().deltas:
            if delta.request_id == rid:
                tokens += delta.new_token_ids
    return tokens


def test_a_request_resumed_from_its_tokens_draws_the_same_sampled_tokens():
    """Prompt + the first k output tokens with output_offset=k continues token for token
    (seeded sampling with penalties: the random stream's index and the penalties count
    the resumed output as output)."""
    engine = tiny_engine()
    params = SamplingParams(max_tokens=16, temperature=1.3, top_p=0.95, seed=1234, ignore_eos=True,
                            frequency_penalty=0.7, presence_penalty=0.3)
    whole = _run(engine, PROMPT, params)
    assert len(whole) == 16
    for k in (1, 7):
        rest = _run(engine, PROMPT + whole[:k], replace(params, max_tokens=16 - k), output_offset=k)
        assert rest == whole[k:]
    # Without the offset the stream restarts at index 0: a different answer (what the offset is for).
    assert _run(engine, PROMPT + whole[:7], replace(params, max_tokens=9)) != whole[7:]
    engine.check_block_accounting()


def test_prefix_index_matches_leading_blocks_and_forgets_least_recently_used():
    index = PrefixIndex(capacity_blocks=3)
    tokens = list(range(12))
    index.insert(block_hashes(tokens, 4))
    assert index.match(block_hashes(tokens + [99, 98, 97, 96], 4)) == 3
    assert index.match(block_hashes([0, 1, 2, 3, 7, 7, 7, 7], 4)) == 1
    assert index.match(block_hashes([1, 2, 3, 4], 4)) == 0
    index.insert(block_hashes([50, 51, 52, 53], 4))  # over capacity: the least recent block goes,
    assert len(index) == 3  # and a sequence's last block is its least recent
    assert index.match(block_hashes(tokens, 4)) == 2


def test_router_keeps_conversations_on_their_replica_and_moves_them_under_load():
    router = Router(num_replicas=2, block_size=4, capacity_blocks=100, max_imbalance=3)
    first = router.choose(list(range(10)))
    other = router.choose([200, 201, 202, 203, 204])  # no match: the least loaded (the other one)
    assert other.replica != first.replica and other.matched_tokens == 0
    router.finished(first.replica, list(range(10)) + [70, 71, 72])
    follow = router.choose(list(range(10)) + [70, 71, 72, 9, 9, 9])
    assert follow.replica == first.replica and follow.matched_tokens == 12
    for _ in range(3):  # load the conversation's replica
        router.choose([1000 + first.replica] * 4, exclude=frozenset({other.replica}))
    moved = router.choose(list(range(10)) + [70, 71, 72, 9, 9, 9])
    assert moved.replica == other.replica and moved.moved_from == first.replica
    router.mark_down(first.replica)
    assert router.choose(list(range(10))).replica == other.replica
    assert router.choose([1], exclude=frozenset({other.replica})) is None


def test_round_robin_ignores_the_cache():
    router = Router(num_replicas=3, block_size=4, capacity_blocks=100, policy="round_robin")
    assert [router.choose(list(range(8))).replica for _ in range(4)] == [0, 1, 2, 0]


def test_tombstones_expire():
    stones = Tombstones(ttl_s=0.0)
    stones.add("a")
    assert "a" not in stones
    stones = Tombstones(ttl_s=60)
    stones.add("a")
    assert "a" in stones and "b" not in stones
    stones.discard("a")
    assert "a" not in stones


def test_serve_refuses_replica_flags_that_cannot_work(capsys):
    from bargein.cli import main

    for argv, message in ((["--replicas", "2"], "--replicas needs a Ray cluster"),
                          (["--ray", "local", "--replicas", "0"], "--replicas must be at least 1"),
                          (["--ray", "local", "--replicas", "2", "--pipeline-stages", "2"], "not supported yet")):
        assert main(["serve", "--port", "0", *argv]) == 1
        assert message in capsys.readouterr().err


def test_a_conversation_moves_when_its_replica_lacks_kv_room():
    router = Router(num_replicas=2, block_size=4, capacity_blocks=100)
    history = list(range(20))
    home = router.choose(history).replica
    router.finished(home, history)
    away = 1 - home
    router.update_memory(home, 3)
    router.update_memory(away, 50)
    stays = router.choose(history + [1, 2, 3, 4], reserve_tokens=4)  # 2 new blocks: room enough
    assert stays.replica == home and stays.moved_from is None
    router.finished(home, history)
    moved = router.choose(history + [1, 2, 3, 4], reserve_tokens=32)  # 9 blocks: only the other has them
    assert moved.replica == away and moved.moved_from == home and moved.matched_tokens == 0
    router.update_memory(away, 5)  # nobody has the room: it stays with its cache
    assert router.choose(history, reserve_tokens=64).replica == home
