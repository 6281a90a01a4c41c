"""Engine replicas on a Ray cluster behind one server, one concept per file.

- ``facade``: :class:`ReplicaSet`, what the server talks to (routing, dispatch, cancels,
  conversations, merged views);
- ``records``: the head's records of requests and conversations, one lock;
- ``poller``: one thread per replica, deltas in, lost and hung replicas found;
- ``failover``: the pure decision what becomes of a lost replica's request;
- ``actor``: the replica itself, a whole engine inside a Ray actor;
- ``launch``: starting the set, all or nothing; ``placement``: where replicas and their
  stages go, and the weights shipped to nodes without the file; ``slots``: each replica's
  node and threads from what the nodes offer; ``options``;
- ``metrics``: per-replica Prometheus series.

Ray is an optional extra: importing this package needs none (launching does).
"""

from __future__ import annotations

from bargein.distributed.replicas.actor import BuildWith, EngineBuilder
from bargein.distributed.replicas.facade import ReplicaSet
from bargein.distributed.replicas.launch import launch_replicas, start_replicas
from bargein.distributed.replicas.options import ReplicaOptions

__all__ = ["BuildWith", "EngineBuilder", "ReplicaOptions", "ReplicaSet", "launch_replicas", "start_replicas"]
