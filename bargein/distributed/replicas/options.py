"""How replicas are placed and kept: Ray resources, restarts, deadlines, routing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaOptions:
    """How replicas are placed and kept: Ray resources, restarts, deadlines."""

    num_cpus: float = 1.0
    threads: int | None = 1  # each replica's compute threads; None: per node (replicas/slots.py)
    max_restarts: int = -1  # Ray re-creates a lost replica (forever by default)
    call_timeout_s: float = 10.0  # a poll (or ping) not answered by then: the replica is lost
    start_timeout_s: float = 300.0  # loading the model on every replica
    hang_timeout_s: float = 60.0  # busy, yet no step finished for that long: the replica is hung
    routing: str = "affine"
    max_imbalance: int = 8
    queue_cost_tokens: int = 256  # what a cached prefix must be worth to join a longer queue (route_decision)
    stages_per_replica: int = 1  # each replica a pipeline of this many stages (recorded for /v1/cluster)
    resources: dict[str, float] | None = None  # custom Ray resources each replica takes (placement)
    on_head_node: bool = False  # run the replicas on this process's node (pipeline heads; stages go out)
