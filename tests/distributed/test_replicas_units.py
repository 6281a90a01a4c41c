"""Replica pieces that need no cluster: a resumed request's random stream, the router, tombstones."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from bargein.distributed.errors import PipelineSetupError
from bargein.distributed.replicas.placement import plan_stage_nodes
from bargein.distributed.router import PrefixIndex, Router, Tombstones, block_hashes
from bargein.engine.block_keys import KeyChanges
from bargein.engine.engine import EngineError
from bargein.engine.request import FinishReason
from bargein.engine.sampler import SamplingState
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


def _run_session(engine, session, new_tokens, params, output_offset=0):
    rid = engine.add_request(new_tokens, params, conversation_id=session, output_offset=output_offset)
    tokens, last = [], None
    while engine.has_work:
        for delta in engine.step().deltas:
            if delta.request_id == rid:
                tokens += delta.new_token_ids
                last = delta if delta.finished else last
    return tokens, last


def test_a_conversation_answer_resumed_with_output_offset_draws_the_same_sampled_tokens():
    """A conversation opened with prompt + the first k tokens of an answer, then a session
    request with no new tokens and output_offset=k, goes on with the uninterrupted answer's
    seeded tokens, and the conversation ends as prompt + whole answer. The answer so far
    may also come as the request's new prompt tokens. An offset past the conversation's
    end fails the request and leaves the conversation as it was; a negative one is refused."""
    engine = tiny_engine()
    params = SamplingParams(max_tokens=14, temperature=1.3, top_p=0.95, seed=4321, ignore_eos=True,
                            frequency_penalty=0.7, presence_penalty=0.3)
    session = engine.open_conversation(PROMPT)
    whole, _ = _run_session(engine, session, [], params)
    assert len(whole) == 14 and engine.conversation_tokens(session) == PROMPT + whole
    for k in (1, 6):
        moved = engine.open_conversation(PROMPT + whole[:k])
        rest, last = _run_session(engine, moved, [], replace(params, max_tokens=14 - k), output_offset=k)
        assert rest == whole[k:] and last.finish_reason == FinishReason.LENGTH
        assert engine.conversation_tokens(moved) == PROMPT + whole
        engine.close_conversation(moved)
    appended = engine.open_conversation(PROMPT[:3])
    rest, _ = _run_session(engine, appended, PROMPT[3:] + whole[:6], replace(params, max_tokens=8), output_offset=6)
    assert rest == whole[6:] and engine.conversation_tokens(appended) == PROMPT + whole
    # Past the end (the conversation's 8 tokens + 2 new ones): an error, nothing appended.
    short = engine.open_conversation(PROMPT)
    rest, last = _run_session(engine, short, [1, 2], params, output_offset=11)
    assert rest == [] and last.finish_reason == FinishReason.ERROR and "output_offset 11" in last.error
    assert engine.conversation_tokens(short) == PROMPT
    with pytest.raises(EngineError, match="output_offset"):
        engine.add_request([], params, conversation_id=short, output_offset=-1)
    engine.check_block_accounting()


def test_a_resumed_request_s_min_tokens_counts_its_own_output():
    """A resumed request's params carry the rest of min_tokens (the head subtracts what was
    produced): eos stays masked for that many of its own tokens, whatever its offset."""
    params = SamplingParams(max_tokens=10, min_tokens=3)
    state = SamplingState.create(params, PROMPT, eos_token_ids=[0], output_offset=5)
    for token in (11, 12, 13):
        assert state.masks_eos and state.token_index == 5 + len(state.output_token_ids)
        state.accept(token)
    assert not state.masks_eos


def test_prefix_index_follows_reported_keys_and_expected_prompts():
    index = PrefixIndex()
    tokens = list(range(12))
    hashes = block_hashes(tokens, 4)
    index.apply(KeyChanges(keys={h: True for h in hashes}))
    assert index.match(block_hashes(tokens + [99, 98, 97, 96], 4)) == 3
    assert index.match(block_hashes([0, 1, 2, 3, 7, 7, 7, 7], 4)) == 1
    assert index.match(block_hashes([1, 2, 3, 4], 4)) == 0
    index.apply(KeyChanges(keys={hashes[1]: False}))  # evicted: the match stops there
    assert index.match(hashes) == 1
    other = block_hashes([50, 51, 52, 53, 54, 55, 56, 57], 4)
    index.expect(other)  # dispatched there, not computed yet
    index.expect(other[:1])
    assert index.match(other) == 2
    index.unexpect(other)
    assert index.match(other) == 1
    index.unexpect(other[:1])
    assert index.match(other) == 0
    index.apply(KeyChanges(reset=True))
    assert index.match(hashes) == 0 and len(index) == 0


def test_a_replica_s_reported_key_changes_keep_the_index_equal_to_its_cache():
    """A small pool under churn (evictions, partial reuse, cancels, truncation by stop):
    the changes drained after every step, applied to an index, give exactly the set of
    keys the pool has registered, step after step."""
    engine = tiny_engine(num_blocks=12, block_size=4, max_num_seqs=3, max_num_batched_tokens=32)
    engine.pool.track_key_changes()
    index = PrefixIndex()
    rng = random.Random(5)
    bases = [[rng.randrange(1, 250) for _ in range(9)] for _ in range(3)]
    evictions_before = engine.pool.evictions
    for turn in range(24):
        prompt = rng.choice(bases) + [rng.randrange(1, 250) for _ in range(rng.randrange(0, 7))]
        rid = engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(1, 9), temperature=0,
                                                        ignore_eos=True))
        steps = 0
        while engine.has_work:
            engine.step()
            steps += 1
            if turn % 5 == 0 and steps == 2:
                engine.abort(rid)
            index.apply(engine.pool.drain_key_changes())
            assert index._held == set(engine.pool._hash_to_block)
    assert engine.pool.evictions > evictions_before  # the pool was small enough to evict
    engine.check_block_accounting()


def test_key_changes_merge_in_order():
    a, b = b"a" * 16, b"b" * 16
    changes = KeyChanges(keys={a: True})
    changes.merge(KeyChanges(keys={a: False, b: True}))
    assert changes.keys == {a: False, b: True} and not changes.reset
    changes.merge(KeyChanges(reset=True, keys={b: True}))
    assert changes.reset and changes.keys == {b: True}
    assert not KeyChanges()


def test_router_keeps_conversations_on_their_replica_and_moves_them_under_load():
    router = Router(num_replicas=2, block_size=4, max_imbalance=3)
    first = router.choose(list(range(10)))
    other = router.choose([200, 201, 202, 203, 204])  # no match: the least loaded (the other one)
    assert other.replica != first.replica and other.matched_tokens == 0
    # The replica computed and reported the prompt and answer; the request ended.
    router.apply(first.replica, KeyChanges(keys={h: True for h in block_hashes(list(range(10)) + [70, 71, 72], 4)}))
    router.finished(first)
    follow = router.choose(list(range(10)) + [70, 71, 72, 9, 9, 9])
    assert follow.replica == first.replica and follow.matched_tokens == 12
    for _ in range(3):  # load the conversation's replica
        router.choose([1000 + first.replica] * 4, exclude=frozenset({other.replica}))
    moved = router.choose(list(range(10)) + [70, 71, 72, 9, 9, 9])
    assert moved.replica == other.replica and moved.moved_from == first.replica
    router.mark_down(first.replica)
    assert router.choose(list(range(10))).replica == other.replica
    assert router.choose([1], exclude=frozenset({other.replica})) is None


def test_router_forgets_what_a_replica_evicted():
    router = Router(num_replicas=2, block_size=4)
    history = list(range(16))
    home = router.choose(history)
    router.apply(home.replica, KeyChanges(keys={h: True for h in block_hashes(history, 4)}))
    router.finished(home)
    assert router.choose(history, count=False).matched_tokens == 16
    router.apply(home.replica, KeyChanges(keys={block_hashes(history, 4)[0]: False}))  # evicted
    assert router.choose(history, count=False).matched_tokens == 0


def test_round_robin_ignores_the_cache():
    router = Router(num_replicas=3, block_size=4, policy="round_robin")
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
                          ):
        assert main(["serve", "--port", "0", *argv]) == 1
        assert message in capsys.readouterr().err


def test_a_conversation_moves_when_its_replica_lacks_kv_room():
    router = Router(num_replicas=2, block_size=4)
    history = list(range(20))
    first = router.choose(history)
    home = first.replica
    router.apply(home, KeyChanges(keys={h: True for h in block_hashes(history, 4)}))
    router.finished(first)
    away = 1 - home
    router.update_memory(home, 3)
    router.update_memory(away, 50)
    stays = router.choose(history + [1, 2, 3, 4], reserve_tokens=4)  # 2 new blocks: room enough
    assert stays.replica == home and stays.moved_from is None
    router.finished(stays)
    moved = router.choose(history + [1, 2, 3, 4], reserve_tokens=32)  # 9 blocks: only the other has them
    assert moved.replica == away and moved.moved_from == home and moved.matched_tokens == 0
    router.update_memory(away, 5)  # nobody has the room: it stays with its cache
    assert router.choose(history, reserve_tokens=64).replica == home


def _node(name: str, cpus: int, memory: int) -> dict:
    return {"NodeID": name, "Resources": {"CPU": cpus, "memory": memory}}


def test_stage_plan_fits_every_stage_on_a_cpu_and_spreads_each_replica():
    nodes = [_node("a", 2, 900), _node("b", 1, 500), _node("c", 1, 300)]
    plans = plan_stage_nodes(2, 2, nodes)
    assert plans == [("a", "b"), ("a", "c")]  # every replica's stages on distinct nodes, no CPU used twice
    assert plan_stage_nodes(1, 4, nodes) == [("a", "b", "c", "a")]  # more stages than nodes: spread, then share
    with pytest.raises(PipelineSetupError, match="3 replicas of 2 pipeline stages need 6 CPUs .* offer 4"):
        plan_stage_nodes(3, 2, nodes)
    with pytest.raises(PipelineSetupError, match="need 4 CPUs \\(2 per stage\\), .* offer 2"):
        plan_stage_nodes(1, 2, nodes, threads_per_stage=2)


def test_each_replica_gets_a_disk_tier_directory_of_its_own() -> None:
    from bargein.config import CacheConfig, EngineConfig
    from bargein.distributed.replicas.placement import ReplicaModel, with_own_kv_disk

    model = ReplicaModel("m.gguf", "gguf", (("m.gguf", 1),), EngineConfig(cache=CacheConfig(kv_disk_dir="/kv")),
                         None, None, "m")
    assert [with_own_kv_disk(model, i).config.cache.kv_disk_dir for i in range(2)] == ["/kv/replica-0",
                                                                                       "/kv/replica-1"]
    without = replace(model, config=EngineConfig())
    assert with_own_kv_disk(without, 1) is without
