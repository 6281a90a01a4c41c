"""One Ray cluster of simulated nodes for the whole test session (``ray_cluster``).

Three nodes on this machine with unequal memory (Ray's ``memory`` resource, which the
pipeline splits layers by), one CPU each, a small object store and no dashboard. Tests
that use it are skipped when Ray is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

MB = 1024**2
NODE_MEMORY_MB = (600, 400, 200)  # head node first
OBJECT_STORE_MB = 80


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[object]:
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    head, *others = NODE_MEMORY_MB
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "memory": head * MB, "object_store_memory": OBJECT_STORE_MB * MB,
        "include_dashboard": False})
    for memory in others:
        cluster.add_node(num_cpus=1, memory=memory * MB, object_store_memory=OBJECT_STORE_MB * MB)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
