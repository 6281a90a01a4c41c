"""Where whole-model replicas go and with how many threads when serve has no --threads
(distributed/replicas/slots.py): per node, from what it offers. Pure, no Ray."""

from __future__ import annotations

import pytest

from bargein.distributed.errors import PipelineSetupError
from bargein.distributed.replicas.slots import ReplicaSlot, plan_replica_slots


def _node(node_id: str, cpus: float, memory: float = 1.0) -> dict:
    return {"NodeID": node_id, "Resources": {"CPU": cpus, "memory": memory}}


def test_each_replica_gets_its_nodes_offer_shared_among_the_replicas_there() -> None:
    # Two hosts that declare 4 Ray CPUs but whose processes may use 2: one replica each, 2 threads.
    nodes = [_node("a", 4, memory=2), _node("b", 4)]
    assert plan_replica_slots(2, nodes, {"a": 2.0, "b": 2.0}) == [ReplicaSlot("a", 2, 2.0), ReplicaSlot("b", 2, 2.0)]
    # A big machine and a small one: replicas go where each gets the most; threads shared.
    nodes = [_node("big", 16), _node("small", 4)]
    assert plan_replica_slots(3, nodes, {"big": 8.0, "small": 2.0}) == [ReplicaSlot("big", 4, 4.0)] * 2 + [
        ReplicaSlot("small", 2, 2.0)]
    # A node limited to a third of a CPU (a cgroup quota) still runs one thread; one not measured offers its Ray CPUs.
    assert plan_replica_slots(1, [_node("slow", 4)], {"slow": 0.3}) == [ReplicaSlot("slow", 1, 1.0)]
    assert plan_replica_slots(2, [_node("a", 6)], {}) == [ReplicaSlot("a", 3, 3.0)] * 2


def test_a_node_takes_no_more_replicas_than_its_ray_cpus() -> None:
    nodes = [_node("one", 1), _node("many", 8)]
    # "one" offers min(1 Ray CPU, 64 usable); "many" min(8, 2), shared by its two replicas.
    assert plan_replica_slots(3, nodes, {"one": 64.0, "many": 2.0}) == [ReplicaSlot("one", 1, 1.0)] + [
        ReplicaSlot("many", 1, 1.0)] * 2
    with pytest.raises(PipelineSetupError, match="3 replicas need a CPU each, but the cluster's 1 nodes offer 2"):
        plan_replica_slots(3, [_node("a", 2)], {})
