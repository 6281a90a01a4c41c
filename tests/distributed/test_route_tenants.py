"""Replica routing keeps tenants' prefix-cache namespaces apart (issue 34), written as the attack.

Tenant A's long document is cached on one replica. Tenant B sends the same tokens: if the
router matched them against A's blocks, B's request would be drawn to A's replica (a
timing side channel across replicas: B learns that someone holds this prompt, from where
and how fast it runs) and be priced as a hit it will never get (the engine reuses K/V only
within a namespace). The router must use the keys the engine itself reports, chained from
the namespace root, so the first test registers the blocks in a real block pool.

Pure data: the router and the block pool, no Ray, no model.
"""

from __future__ import annotations

from bargein.distributed.route_decision import Candidate, RoutingWeights, decide
from bargein.distributed.router import Router, block_hashes
from bargein.engine.block_keys import KeyChanges
from bargein.engine.blocks import BlockPool, BlockTable
from bargein.server.tenants import Tenant, prefix_namespace

BS = 16
DOCUMENT = [(7 * i + 3) % 5000 for i in range(64 * BS)]  # 1,024 tokens: worth several requests of queue
ALICE = prefix_namespace(Tenant("alice"), None, shared=False)
BOB = prefix_namespace(Tenant("bob"), None, shared=False)


def _cached_by_engine(tokens: list[int], cache_salt: str | None) -> KeyChanges:
    """The key changes a replica's pool reports after computing ``tokens`` in a namespace."""
    pool = BlockPool(num_blocks=len(tokens) // BS + 4, block_size=BS)
    pool.track_key_changes()
    table = BlockTable.in_namespace(cache_salt)
    pool.ensure_writable(table, 0, len(tokens))
    pool.register_full_blocks(table, tokens, len(tokens))
    return pool.drain_key_changes()


def _router_with_alice_document_on_replica_0() -> Router:
    router = Router(num_replicas=2, block_size=BS)
    router.apply(0, _cached_by_engine(DOCUMENT, ALICE))
    busy = router.choose([1, 2, 3] * 20, exclude=frozenset({1}))  # one live request there: it is not the least loaded
    assert busy is not None and busy.replica == 0
    return router


def test_the_router_matches_the_engine_keys_of_the_same_namespace_only():
    changes = _cached_by_engine(DOCUMENT, ALICE)
    assert set(changes.keys) == set(block_hashes(DOCUMENT, BS, ALICE))  # the router computes the engine's keys
    assert not set(changes.keys) & set(block_hashes(DOCUMENT, BS, BOB))
    assert not set(changes.keys) & set(block_hashes(DOCUMENT, BS))  # nor the common namespace's


def test_another_tenant_with_the_same_prompt_is_not_drawn_to_the_replica_holding_it():
    router = _router_with_alice_document_on_replica_0()
    question = DOCUMENT + [42, 43]

    alice = router.choose(question, cache_salt=ALICE)
    assert alice is not None and (alice.replica, alice.matched_tokens) == (0, len(DOCUMENT))  # her own cache draws her

    bob = router.choose(question, cache_salt=BOB)
    assert bob is not None and (bob.replica, bob.matched_tokens) == (1, 0)  # least loaded: nothing of hers shows
    anonymous = router.choose(question)
    assert anonymous is not None and anonymous.matched_tokens == 0


def test_every_guess_of_another_tenant_routes_alike():
    """The PIN probe across replicas: B varies a suffix of A's prompt; where each guess goes
    and what it is priced at does not depend on which guess is A's."""
    router = Router(num_replicas=2, block_size=BS)
    secret = DOCUMENT[:BS * 8]
    router.apply(0, _cached_by_engine(secret, ALICE))
    guesses = [secret[:-1] + [digit] for digit in range(10)] + [secret]
    routes = [router.choose(g, cache_salt=BOB, count=False) for g in guesses]
    assert {(r.replica, r.matched_tokens) for r in routes if r is not None} == {(0, 0)}
    assert len(routes) == len(guesses)


def test_the_pure_decision_sees_no_match_so_load_decides():
    """What ``decide`` is handed for the other tenant: no matched blocks anywhere."""
    router = Router(num_replicas=2, block_size=BS)
    router.apply(0, _cached_by_engine(DOCUMENT, ALICE))
    weights = RoutingWeights(BS)
    hashes = block_hashes(DOCUMENT, BS, BOB)
    held = router.held_keys(0)
    matched = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
    assert matched == 0
    decision = decide([Candidate(0, 1, matched), Candidate(1, 0, 0)], len(DOCUMENT), weights)
    assert (decision.replica, decision.reason) == (1, "least loaded")
