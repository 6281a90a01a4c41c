"""Set-ups that several modules of the Ray unit share (tests/workers.py runs those
modules on one worker, one after another, with one Ray cluster)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def replica_set(ray_cluster) -> Iterator[object]:
    """2 tiny-engine replicas (one CPU, one torch thread each; a ``hang-*`` request hangs
    its replica's forward, see tests/distributed/replica_engines.py) behind one
    :class:`ReplicaSet`, for test_replicas.py and test_replicas_tenants.py: starting a set
    is two processes that import torch. Tests leave it whole (a killed replica is restarted
    by Ray and waited for).

    queue_cost_tokens=0: a shared prefix of a block or two draws requests to where it is
    cached whatever the queue, so the failover tests can gather their requests on one
    replica (the load-aware rule is tested in test_router.py and on the namespace hosts)."""
    from bargein.distributed.replicas import BuildWith, ReplicaOptions, start_replicas
    from tests.distributed.replica_engines import build_replica_engine

    group = start_replicas(BuildWith(build_replica_engine), 2,
                           ReplicaOptions(num_cpus=1, call_timeout_s=5.0, hang_timeout_s=4.0, queue_cost_tokens=0))
    yield group
    group.close()
