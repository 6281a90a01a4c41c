"""One Ray cluster of simulated nodes for the whole test session (``ray_cluster``).

Three nodes on this machine with unequal memory (Ray's ``memory`` resource, which the
pipeline splits layers by), one CPU each, a small object store and no dashboard. Tests
that use it are skipped when Ray is not installed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ray_starts import one_at_a_time
from tests.started import count

MB = 1024**2
NODE_MEMORY_MB = (600, 400, 200)  # head node first
OBJECT_STORE_MB = 80


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[object]:
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    head, *others = NODE_MEMORY_MB
    with one_at_a_time():  # not beside another Ray instance's start (tests/ray_starts.py)
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "memory": head * MB, "object_store_memory": OBJECT_STORE_MB * MB,
            "include_dashboard": False})
        for memory in others:
            cluster.add_node(num_cpus=1, memory=memory * MB, object_store_memory=OBJECT_STORE_MB * MB)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
    count("Ray clusters")
    count("Ray nodes", len(NODE_MEMORY_MB))
    add_node = cluster.add_node

    def counted_add_node(**kwargs):  # every node a test adds, counted, and started alone
        count("Ray nodes")
        with one_at_a_time():
            return add_node(**kwargs)

    cluster.add_node = counted_add_node
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@dataclass(frozen=True)
class TwoHomes:
    """Two nodes added to the cluster, each with a home of its own: ``~/models/tiny.gguf``
    exists in the first one's (once :meth:`write` put it there), the second's ``~/models``
    stays empty."""

    homes: tuple[Path, Path]
    with_file: object  # Ray's node handles
    without_file: object
    resource: str  # a custom resource only these two nodes offer

    @property
    def nodes(self) -> tuple[object, object]:
        return self.with_file, self.without_file

    @property
    def path(self) -> Path:
        """The model file, in the first node's home (also the test process's HOME, see :meth:`enter`)."""
        return self.homes[0] / "models" / "tiny.gguf"

    def write(self, write_model: Callable[[Path], Path]) -> Path:
        """Puts a model at :attr:`path` with ``write_model(path)``, as a new file (a test
        before may have written another there)."""
        self.path.unlink(missing_ok=True)
        return write_model(self.path)

    def enter(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The test process takes the first node's home (as the head's)."""
        monkeypatch.setenv("HOME", str(self.homes[0]))


@contextmanager
def nodes_with_and_without_the_file(cluster, root: Path, resource_prefix: str) -> Iterator[TwoHomes]:
    """Adds two one-CPU nodes whose ``HOME`` differ, under ``root``, and removes them at the
    end. Adding a node costs seconds (a raylet, and worker processes that import torch), so
    the tests of a module share one pair."""
    homes = root / "home-a", root / "home-b"
    for home in homes:
        (home / "models").mkdir(parents=True)
    resource = f"{resource_prefix}-{uuid.uuid4().hex[:8]}"
    with_file, without_file = (cluster.add_node(num_cpus=1, memory=300 * MB, object_store_memory=OBJECT_STORE_MB * MB,
                                                resources={resource: 1}, env_vars={"HOME": str(home)})
                               for home in homes)
    cluster.wait_for_nodes()
    try:
        yield TwoHomes(homes, with_file, without_file, resource)
    finally:
        for node in (with_file, without_file):  # gracefully: Ray forgets them at once (killed: ~15 s later)
            cluster.remove_node(node, allow_graceful=True)
