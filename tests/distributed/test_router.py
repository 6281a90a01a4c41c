"""The router's decision (route_decision.decide) and the Router that feeds it, without Ray:
chats that share only a system prompt spread by load, a conversation's turns stay on the
replica that generated its answers, requests sharing a long document gather where it is
cached, and load or memory move a conversation."""

from __future__ import annotations

from collections import Counter

import pytest

from bargein.distributed.route_decision import Candidate, Decision, RoutingWeights, decide
from bargein.distributed.router import Router, block_hashes
from bargein.engine.block_keys import KeyChanges

BS = 16
WEIGHTS = RoutingWeights(block_size=BS, queue_cost_tokens=256, max_imbalance=8)
SYSTEM = list(range(1000, 1045))  # a chat template's system prompt: 45 tokens, two full blocks and a bit


def test_a_shared_prefix_worth_less_than_one_request_of_queue_goes_to_the_least_loaded():
    shared = [Candidate(0, load=1, matched_blocks=2), Candidate(1, load=0, matched_blocks=0)]
    assert decide(shared, 60, WEIGHTS) == Decision(1, "least loaded")
    # Equal load: the cache decides.
    assert decide([Candidate(0, 0, 0), Candidate(1, 0, 2)], 60, WEIGHTS) == Decision(1, "prefix")


def test_a_long_document_outweighs_a_queue_up_to_its_worth_and_the_imbalance_cap():
    doc = 3000 // BS  # 187 blocks: 2,992 tokens, worth 11 requests of queue
    assert decide([Candidate(0, 5, doc), Candidate(1, 0, 0)], 3100, WEIGHTS) == Decision(0, "prefix")
    assert decide([Candidate(0, 7, doc), Candidate(1, 0, 0)], 3100, WEIGHTS).replica == 0
    assert decide([Candidate(0, 8, doc), Candidate(1, 0, 0)], 3100, WEIGHTS) == Decision(1, "least loaded")
    small = 600 // BS  # 37 blocks, 592 tokens: worth two requests of queue, not three
    assert decide([Candidate(0, 2, small), Candidate(1, 0, 0)], 700, WEIGHTS).replica == 0
    assert decide([Candidate(0, 3, small), Candidate(1, 0, 0)], 700, WEIGHTS).replica == 1


def test_a_conversation_stays_until_the_imbalance_cap_or_a_lack_of_memory():
    home = Candidate(0, load=7, matched_blocks=3, continues=True)
    assert decide([home, Candidate(1, 0, 2)], 60, WEIGHTS) == Decision(0, "conversation")
    loaded = Candidate(0, load=8, matched_blocks=3, continues=True)
    assert decide([loaded, Candidate(1, 0, 2)], 60, WEIGHTS) == Decision(1, "least loaded", 0, "load 8 vs 0")
    cramped = Candidate(0, load=0, matched_blocks=3, continues=True, available_blocks=2)
    moved = decide([cramped, Candidate(1, 1, 0, available_blocks=50)], 60, WEIGHTS, reserve_tokens=64)
    assert moved.replica == 1 and moved.moved_from == 0 and moved.why_moved.startswith("memory: 2 KV blocks")
    # Nobody has the room: it stays with its cache.
    assert decide([cramped, Candidate(1, 1, 0, available_blocks=3)], 60, WEIGHTS, 64).replica == 0


def test_ties_go_to_the_lower_index_and_an_empty_choice_is_refused():
    assert decide([Candidate(2, 0, 0), Candidate(1, 0, 0)], 10, WEIGHTS).replica == 1
    with pytest.raises(ValueError, match="no replica"):
        decide([], 10, WEIGHTS)
    with pytest.raises(ValueError, match="out of range"):
        RoutingWeights(block_size=0)


def _chat(n: int) -> list[int]:
    return SYSTEM + [2000 + 50 * n + k for k in range(20)]


def _answer(n: int) -> list[int]:
    return [5000 + 50 * n + k for k in range(30)]


def _run_prefill(router: Router, route, tokens: list[int]) -> None:
    """The replica registers the prompt's full blocks while the request is live."""
    router.apply(route.replica, KeyChanges(keys={h: True for h in block_hashes(tokens, BS)}))


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_sixteen_concurrent_chats_sharing_a_system_prompt_spread_and_their_next_turns_stay(num_replicas):
    router = Router(num_replicas, BS)
    routes = [router.choose(_chat(n), reserve_tokens=64) for n in range(16)]  # all live at once
    counts = Counter(r.replica for r in routes)
    even = 16 / num_replicas
    assert len(counts) == num_replicas and max(counts.values()) <= 1.5 * even, counts
    for n, route in enumerate(routes):  # each replica computes its prompts, then the answers, then ends them
        _run_prefill(router, route, _chat(n))
    for n, route in enumerate(routes):
        router.apply(route.replica, KeyChanges(keys={h: True for h in block_hashes(_chat(n) + _answer(n), BS)}))
        router.finished(route)
    # Second turns, all at once: each to the replica that generated its first answer.
    follow = [router.choose(_chat(n) + _answer(n) + [9000 + n] * 12, reserve_tokens=64) for n in range(16)]
    assert [r.replica for r in follow] == [r.replica for r in routes]
    assert all(r.moved_from is None and r.matched_tokens >= len(_chat(n)) // BS * BS
               for n, r in enumerate(follow))
    assert max(Counter(r.replica for r in follow).values()) <= 1.5 * even


def test_requests_sharing_a_long_document_go_to_the_replica_that_holds_it():
    router = Router(3, BS)
    document = list(range(20000, 23000))  # 3,000 tokens
    first = router.choose(document + [1, 2, 3])
    _run_prefill(router, first, document + [1, 2, 3])
    router.finished(first)
    chats = [router.choose(_chat(n)) for n in range(6)]  # other traffic, spread over all three
    assert len({r.replica for r in chats}) == 3
    about_it = [router.choose(document + [7, n]) for n in range(5)]  # live together
    assert {r.replica for r in about_it} == {first.replica}
    assert all(r.matched_tokens == len(document) // BS * BS for r in about_it)
    assert router.choose(_chat(99)).replica != first.replica  # the queue it gathered sends chats elsewhere


def test_generated_blocks_mark_a_continuation_prompt_blocks_do_not():
    router = Router(2, BS)
    prompt = _chat(0)
    route = router.choose(prompt)
    _run_prefill(router, route, prompt)
    router.finished(route)
    # The same prompt again, or another chat sharing its blocks: a prefix, not a conversation.
    again = router.choose(prompt + [1] * 20)
    assert again.replica == route.replica  # equal load: the cache decides
    router.finished(again)
    busy = router.choose([7] * 40, exclude=frozenset({1 - route.replica}))  # one request of queue there
    assert router.choose(prompt + [2] * 20).replica != route.replica  # 32 cached tokens < one request
    router.finished(busy)
    # Its answer registered there: the next turn continues it and stays despite the queue.
    router.apply(route.replica, KeyChanges(keys={h: True for h in block_hashes(prompt + _answer(0), BS)}))
    router.choose([8] * 40, exclude=frozenset({1 - route.replica}))
    turn = router.choose(prompt + _answer(0) + [3] * 5)
    assert turn.replica == route.replica and turn.moved_from is None
