"""How fast each node computes, measured at start so the layer split can give a slow node
fewer layers.

``calibration_rate(threads, hidden)`` runs on a node (a Ray task pinned to it, with the
threads a stage there will have) a short burst of the work a stage does per layer: a
16-row float32 matmul against a (hidden x 4*hidden) matrix, repeated for about
:data:`CALIBRATION_S`, and returns the matmuls per second. It is a proxy for a layer's
forward, not the model's: it needs no weights on the node and takes the same time
whatever the model. Nodes are measured one after another, so that on machines that
share cores (namespace hosts) one node's burst does not slow another's, twice over,
keeping each node's best (a burst that met other work on the machine counts less). The
pipeline measures one node per address: nodes at one address share its CPUs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

CALIBRATION_S = 0.15
ROWS = 16


def calibration_rate(threads: int, hidden: int = 1024) -> float:
    """Runs on the node: layer-sized matmuls per second with ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    x = torch.randn(ROWS, hidden)
    w = torch.randn(hidden, 4 * hidden)
    torch.mm(x, w)  # warm: first-call allocation and thread start-up
    done, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < CALIBRATION_S:
        torch.mm(x, w)
        done += 1
    return done / elapsed


def measure_nodes(node_ids: Sequence[str], threads: int, timeout_s: float = 30.0) -> dict[str, float]:
    """Each node's calibration rate (Ray must be connected); a node that does not answer in
    time is left out (the split then treats it as the others)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(calibration_rate)
    rates: dict[str, float] = {}
    unanswered: set[str] = set()
    for _ in range(2):
        for node in dict.fromkeys(node_ids):
            if node in unanswered:
                continue
            ref = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(threads)
            ready, _ = ray.wait([ref], timeout=timeout_s)
            try:
                if not ready:
                    raise TimeoutError
                rates[node] = max(rates.get(node, 0.0), float(ray.get(ref)))
            except (TimeoutError, ray.exceptions.RayError):
                ray.cancel(ref, force=True)
                unanswered.add(node)
                rates.pop(node, None)
    return rates
