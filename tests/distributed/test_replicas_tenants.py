"""Tenants' prefix-cache namespaces through a real replica set on Ray (issue 34).

``test_route_tenants.py`` checks the router alone against a block pool; this drives a
:class:`ReplicaSet` of two tiny-engine replicas on the shared simulated cluster, with the
namespaces the server gives tenants (``prefix_namespace``) as each request's
``cache_salt``. Alice and Bob send the same prompt, get the same greedy answer and then
continue with the same next turn, so their token sequences are identical and only the
namespace tells their cached blocks apart. The router is set to follow any cached
prefix whatever the queue (``queue_cost_tokens=0``) and each step is made to discriminate
with a phantom request counted on one replica (``Router.choose`` without a request behind
it, released with ``finished``): where a tenant's keys matched the other's blocks, the
request would go to the wrong replica, or report another's blocks as its own hit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

pytest.importorskip("ray")

from bargein.distributed.replicas import BuildWith, ReplicaOptions, ReplicaSet, start_replicas  # noqa: E402
from bargein.engine.engine import Engine  # noqa: E402
from bargein.engine.sampling import SamplingParams  # noqa: E402
from bargein.server.tenants import Tenant, prefix_namespace  # noqa: E402
from tests.tiny_engine import tiny_engine  # noqa: E402

BLOCK = 4
PROMPT = [(5 * i + 2) % 250 + 1 for i in range(8 * BLOCK)]  # 8 full blocks
NEXT_TURN = [17, 29, 31, 41, 43]
ALICE = prefix_namespace(Tenant("alice"), None, shared=False)
BOB = prefix_namespace(Tenant("bob"), None, shared=False)


def build_tenant_replica() -> Engine:
    """Runs on each replica's node (pickled by reference): the tiny engine, one torch thread."""
    torch.set_num_threads(1)
    return tiny_engine(num_blocks=64, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def replicas(ray_cluster) -> Iterator[ReplicaSet]:
    group = start_replicas(BuildWith(build_tenant_replica), 2,
                           ReplicaOptions(num_cpus=1, call_timeout_s=10.0, queue_cost_tokens=0))
    yield group
    group.close()


def greedy(salt: str | None, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, cache_salt=salt)


def answer(group: ReplicaSet, prompt: list[int], salt: str | None) -> tuple[int, int, list[int], int]:
    """(replica, router's matched tokens, answer tokens, cached_tokens) of one request."""
    async def main():
        rid, stream = group.submit(prompt, greedy(salt))
        route = group.records.live[rid].route
        tokens, out = [], None
        while out is None or not out.finished:
            out = await group.next_output(stream)
            tokens += out.new_token_ids
        return route.replica, route.matched_tokens, tokens, out.usage.cached_tokens

    return asyncio.run(main())


@contextmanager
def busier(group: ReplicaSet, replica: int) -> Iterator[None]:
    """One phantom live request counted on ``replica``: the other is the least loaded."""
    route = group.router.choose([1, 2, 3], exclude=frozenset({1 - replica}))
    assert route is not None and route.replica == replica
    try:
        yield
    finally:
        group.router.finished(route)


def full_blocks(num_tokens: int) -> int:
    return num_tokens // BLOCK * BLOCK


def test_tenants_with_the_same_prompt_are_routed_by_their_own_keys_and_turns_go_home(replicas):
    single = build_tenant_replica()  # the reference: the same weights in this process
    first = list(single.generate([PROMPT], greedy(None))[0].token_ids)
    history = PROMPT + first + NEXT_TURN
    second = list(single.generate([history], greedy(None))[0].token_ids)

    alice_home, matched, tokens, cached = answer(replicas, PROMPT, ALICE)
    assert (matched, tokens, cached) == (0, first, 0)
    bob_expected_home = 1 - alice_home

    # Bob's identical prompt: Alice's replica holds those tokens, but in her namespace. Made
    # the busier one, it must not draw him; nothing of hers is reused.
    with busier(replicas, alice_home):
        bob_home, matched, tokens, cached = answer(replicas, PROMPT, BOB)
    assert (bob_home, matched, tokens, cached) == (bob_expected_home, 0, first, 0)

    # Alice's second turn goes home even when home is the busier replica; Bob's replica holds
    # the very same tokens (his), which must not count for her. Her whole first turn but
    # its last token (sampled, never computed) is reused.
    computed = len(PROMPT) + len(first) - 1
    with busier(replicas, alice_home):
        replica, matched, tokens, cached = answer(replicas, history, ALICE)
    assert (replica, matched, tokens) == (alice_home, full_blocks(computed), second)
    assert len(PROMPT) <= cached <= computed

    # The same for Bob, towards his replica.
    with busier(replicas, bob_home):
        replica, matched, tokens, cached = answer(replicas, history, BOB)
    assert (replica, matched, tokens) == (bob_home, full_blocks(computed), second)
    assert len(PROMPT) <= cached <= computed

    # A request of no tenant's namespace (the common one) matches neither.
    with busier(replicas, alice_home):
        replica, matched, tokens, cached = answer(replicas, history, None)
    assert (replica, matched, tokens, cached) == (bob_home, 0, second, 0)

    # And a third tenant probing with Alice's exact history gets no hit anywhere.
    carol = prefix_namespace(Tenant("carol"), None, shared=False)
    _, matched, tokens, cached = answer(replicas, history, carol)
    assert (matched, tokens, cached) == (0, second, 0)
    asyncio.run(replicas.check_block_accounting())
