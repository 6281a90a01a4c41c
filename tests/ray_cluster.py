"""One Ray cluster of simulated nodes for the whole test session (``ray_cluster``).

Three nodes on this machine with unequal memory (Ray's ``memory`` resource, which the
pipeline splits layers by), one CPU each, a small object store and no dashboard. Tests
that use it are skipped when Ray is not installed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class TwoHomes:
    """Two nodes added to the cluster, each with a home of its own: one holds the model
    file at ``~/models/tiny.gguf``, the other has an empty ``~/models``."""

    path: Path  # the model file, in the first node's home (also the test process's HOME)
    with_file: object  # Ray's node handles
    without_file: object
    resource: str  # a custom resource only these two nodes offer

    @property
    def nodes(self) -> tuple[object, object]:
        return self.with_file, self.without_file


def add_nodes_with_and_without_the_file(cluster, tmp_path: Path, monkeypatch, write_model: Callable[[Path], Path],
                                        resource_prefix: str) -> TwoHomes:
    """Adds two one-CPU nodes whose ``HOME`` differ (so ``~/models/tiny.gguf`` exists on
    one only), written by ``write_model(path)``; the test process takes the first home."""
    homes = tmp_path / "home-a", tmp_path / "home-b"
    for home in homes:
        (home / "models").mkdir(parents=True)
    path = write_model(homes[0] / "models" / "tiny.gguf")
    monkeypatch.setenv("HOME", str(homes[0]))  # the head's home
    resource = f"{resource_prefix}-{uuid.uuid4().hex[:8]}"
    with_file, without_file = (cluster.add_node(num_cpus=1, memory=300 * MB, object_store_memory=OBJECT_STORE_MB * MB,
                                                resources={resource: 1}, env_vars={"HOME": str(home)})
                               for home in homes)
    cluster.wait_for_nodes()
    return TwoHomes(path, with_file, without_file, resource)
