"""Each pipeline stage's threads when ``--threads`` is not given: what its node offers,
shared among the stages placed there (bargein/distributed/stage_threads.py). Pure: the
nodes are ``ray.nodes()``-shaped entries and their measured CPUs are given."""

from __future__ import annotations

from bargein.config import PipelineConfig
from bargein.distributed.node_cpus import node_offer
from bargein.distributed.stage_threads import StageThreads, plan_stage_threads


def _node(node_id: str, cpus: float) -> dict:
    return {"NodeID": node_id, "Resources": {"CPU": cpus, "memory": 1 << 30}}


def test_a_node_offers_the_smaller_of_its_ray_cpus_and_what_its_processes_may_use() -> None:
    assert node_offer(_node("a", 8), {"a": 2.5}) == 2.5  # Ray declares more than a cgroup quota allows
    assert node_offer(_node("a", 2), {"a": 16}) == 2
    assert node_offer(_node("a", 4), {}) == 4  # not measured: its Ray CPUs


def test_each_stage_gets_its_own_nodes_offer_shared_among_the_stages_there() -> None:
    big, small, limited = _node("big", 8), _node("small", 2), _node("limited", 16)
    usable = {"big": 8, "small": 2, "limited": 3.5}  # limited: a cgroup quota of 3.5 CPUs
    assert plan_stage_threads([big, small, limited], usable) == [
        StageThreads(8, 8.0), StageThreads(2, 2.0), StageThreads(3, 3.0)]
    # Two stages on one node share it; a third stage elsewhere keeps its node's whole offer.
    assert plan_stage_threads([big, big, small], usable) == [StageThreads(4, 4.0)] * 2 + [StageThreads(2, 2.0)]
    # More stages than a node has CPUs: one thread each, and Ray CPUs they all fit in.
    assert plan_stage_threads([small] * 3, usable) == [StageThreads(1, 2 / 3)] * 3
    # A node that did not answer the measurement offers its Ray CPUs.
    assert plan_stage_threads([small, big], {}) == [StageThreads(2, 2.0), StageThreads(8, 8.0)]


def test_given_threads_are_every_stages_and_none_means_per_node() -> None:
    assert plan_stage_threads([_node("a", 8), _node("b", 1)], {"a": 8}, given=3) == [StageThreads(3, 3.0)] * 2
    assert PipelineConfig(threads_per_stage=None).threads_per_stage is None  # serve without --threads
    assert PipelineConfig().threads_per_stage == 1  # the Python API's default stays one thread
