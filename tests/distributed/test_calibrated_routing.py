"""Replicas weighed by their nodes' calibrated speed (Router.set_speeds, route_decision's
queues in time): new conversations go to replicas in proportion to their speed, a slow
machine gets fewer, equal machines (within the split's noise margin) stay even, and a
conversation's turns still stay home. Calibration results are injected: no Ray, no timing."""

from __future__ import annotations

from collections import Counter

import pytest

from bargein.distributed.route_decision import Candidate, Decision, RoutingWeights, decide
from bargein.distributed.router import Router, block_hashes
from bargein.engine.block_keys import KeyChanges

BS = 16
WEIGHTS = RoutingWeights(block_size=BS)
SYSTEM = list(range(1000, 1045))  # a shared system prompt: two full blocks and a bit


def _chat(n: int) -> list[int]:
    return SYSTEM + [2000 + 50 * n + k for k in range(20)]


def test_a_slow_replicas_requests_count_for_more_of_its_time() -> None:
    fast, slow = Candidate(0, load=0, matched_blocks=0), Candidate(1, load=0, matched_blocks=0, speed=0.4)
    assert decide([fast, slow], 60, WEIGHTS) == Decision(0, "least loaded")  # alone, the fast one is sooner
    busier = Candidate(0, load=1, matched_blocks=0)  # 2 requests' time there, 2.5 on the slow one
    assert decide([busier, slow], 60, WEIGHTS).replica == 0
    busiest = Candidate(0, load=2, matched_blocks=0)  # 3 there: the slow one's 2.5 is shorter
    assert decide([busiest, slow], 60, WEIGHTS).replica == 1
    # The imbalance cap is in the same time: 8 requests of the fast one's queue.
    home = Candidate(1, load=3, matched_blocks=3, continues=True, speed=0.4)  # (3 + 1) / 0.4 = 10
    assert decide([Candidate(0, 1, 0), home], 60, WEIGHTS) == Decision(0, "least loaded", 1, "load 3 vs 1")
    assert decide([Candidate(0, 2, 0), home], 60, WEIGHTS) == Decision(1, "conversation")


# Each new chat joins the shortest queue in time: the slow replica at 0.4 of the fastest
# speed takes its 1st, 2nd, 3rd, 4th chat when its queue (n / 0.4: 2.5, 5, 7.5, 10) is the
# shortest, the fast one the rest: 12 and 4 (16 / 1.4 = 11.4 and 4.6 in proportion).
@pytest.mark.parametrize(("rates", "expected"), [
    ([100.0, 40.0], [12, 4]),
    ([100.0, 20.0, 100.0], [8, 1, 7]),  # 0.2: its queue 5 ties the others' 5th (lower index first)
    ([100.0, 60.0], [8, 8]),  # within half of the fastest: noise, not weighed (as the layer split)
    ([100.0, None], [8, 8]),  # one not measured: none weighed
])
def test_sixteen_concurrent_new_chats_go_in_proportion_to_speed_and_their_turns_stay(rates, expected) -> None:
    router = Router(len(rates), BS)
    router.set_speeds(rates)
    routes = [router.choose(_chat(n), reserve_tokens=64) for n in range(16)]  # all live at once
    counts = Counter(r.replica for r in routes)
    assert [counts[i] for i in range(len(rates))] == expected
    for n, route in enumerate(routes):  # each replica computes and answers its chats, then ends them
        answer = [5000 + 50 * n + k for k in range(30)]
        router.apply(route.replica, KeyChanges(keys={h: True for h in block_hashes(_chat(n), BS)}))
        router.apply(route.replica, KeyChanges(keys={h: True for h in block_hashes(_chat(n) + answer, BS)}))
        router.finished(route)
    follow = [router.choose(_chat(n) + [5000 + 50 * n + k for k in range(30)] + [9000] * 12) for n in range(16)]
    assert [r.replica for r in follow] == [r.replica for r in routes]  # every next turn stays home


def test_the_weights_are_shown_and_refused_in_the_wrong_number() -> None:
    router = Router(2, BS)
    assert [(r["speed"], r["layers_per_s"]) for r in router.snapshot()] == [(1.0, None), (1.0, None)]
    router.set_speeds([250.0, 50.0])
    assert [(r["speed"], r["layers_per_s"]) for r in router.snapshot()] == [(1.0, 250.0), (0.2, 50.0)]
    with pytest.raises(ValueError, match="3 speeds were given for 2 replicas"):
        router.set_speeds([1.0, 2.0, 3.0])
    # The least-loaded policy weighs them too; round robin does not.
    least = Router(2, BS, policy="least_loaded")
    least.set_speeds([100.0, 25.0])
    assert Counter(least.choose(_chat(n)).replica for n in range(10)) == Counter({0: 8, 1: 2})


def test_a_node_measured_again_keeps_and_caches_its_best_rate(tmp_path) -> None:
    """What measure_nodes asks of a node that looked slow: measured again, the better of the
    two rates is its answer and its cached rate."""
    from bargein.distributed.calibrate import LayerShapes, node_rate

    shapes = LayerShapes(((64, 64),))
    best = 1e12  # above anything a measurement gives
    again = node_rate("10.0.0.11", 1, shapes, refresh=True, directory=str(tmp_path), at_least=best)
    assert again.layers_per_s == best and not again.cached
    assert node_rate("10.0.0.11", 1, shapes, directory=str(tmp_path)).layers_per_s == best  # cached


def test_bargein_cluster_shows_each_replicas_routing_weight() -> None:
    from bargein.cli.cluster import format_cluster

    router = Router(2, BS)
    router.set_speeds([100.0, 40.0])
    replicas = [{"index": i, **r, "lost": 0, "threads": 2} for i, r in enumerate(router.snapshot())]
    table = format_cluster({"replicas": replicas, "num_replicas": 2, "routing": "affine", "kv_blocks": 64})
    header, fast, slow = table.splitlines()[1:4]
    assert header.split()[3:5] == ["THREADS", "SPEED"]
    assert fast.split()[3:5] == ["2", "x1.00"] and slow.split()[3:5] == ["2", "x0.40"]
