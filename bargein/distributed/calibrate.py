"""How fast each node computes the model's layers, measured on the node at start (and
cached there), so that the layer split gives a slow node fewer layers.

The measurement (:func:`layer_rate`, run on the node by a Ray task pinned to it, with the
threads a stage there will have) times what a stage does for each layer of a decode step:
a ``ROWS``-row float32 matmul against each of the model's layer matrices, in the model's
shapes (:class:`LayerShapes`: Q, K, V, O and the MLP's three), repeated for about
:data:`CALIBRATION_S`; the answer is layers per second. A matrix wider than
:data:`MAX_TIMED_ROWS` output rows is timed on that many rows and its time scaled up (a
row's cost is its input width), and matrices of one shape (a mixture-of-experts layer's
experts) are timed once and counted for each, so an 8B model's node allocates tens of
megabytes, not a layer's gigabyte. It needs no weights on the node. It is a proxy for the stage's own
kernels (``fast`` reads quantized blocks): what it must get right is how nodes compare.

The rate is cached on the node (:func:`node_rate`), one JSON file per node and model,
under ``~/.cache/bargein/calibration`` (that node's home), keyed by the node's address,
the layer shapes, the threads, the CPUs the measuring process may use (its affinity and
its cgroup's CPU quota: :func:`~bargein.distributed.node_cpus.usable_cpus`) and torch's version: a node whose CPU limit
or threads change is measured afresh, and a cached rate is used for
:data:`CACHE_MAX_AGE_S` at most.

Nodes are measured one after another, so that on machines that share cores (namespace
hosts) one node's burst does not slow another's; each twice in a row, keeping the best
(a burst that met other work on the machine counts less). A node measured now that looks
under half as fast as the fastest (:data:`~bargein.distributed.split.SLOW_NODE`: what the
split and the router weigh down) is measured again, up to :data:`CONFIRM_ROUNDS` times,
keeping its best, and its cache keeps that best: a slow machine stays slow, while one
that merely met a busy moment (other programs, a loaded shared machine) is seen at its
speed (a cached rate is such a best already). The pipeline measures one node per
address: nodes at one address share its CPUs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from bargein.config import ModelConfig
from bargein.distributed.node_cpus import usable_cpus
from bargein.distributed.split import SLOW_NODE, layer_matrices
from bargein.loader.names import expected_shape

CALIBRATION_S = 0.15
ROWS = 16  # a decode step's rows: the work a node's share of a busy pipeline is
MAX_TIMED_ROWS = 2048
CACHE_MAX_AGE_S = 6 * 3600.0
CACHE_DIR = "~/.cache/bargein/calibration"
CONFIRM_ROUNDS = 3  # more measurements of a node that looks under SLOW_NODE of the fastest


@dataclass(frozen=True)
class LayerShapes:
    """The (output, input) sizes of one layer's matrices: what the calibration times."""

    matrices: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, config: ModelConfig) -> LayerShapes:
        """A middle layer's matrices (:func:`~bargein.distributed.split.layer_matrices`)."""
        layer = config.num_layers // 2
        shapes = (expected_shape(config, name) for name in layer_matrices(config, layer))
        return cls(tuple((s[0], s[1]) for s in shapes if s is not None and len(s) == 2))

    @property
    def key(self) -> str:
        return "-".join(f"{o}x{i}" for o, i in self.matrices)


@dataclass(frozen=True)
class NodeSpeed:
    """One node's measured speed."""

    layers_per_s: float  # the model's layers (their matrices, ROWS rows) per second
    cpus: float  # the CPUs the measuring process could use (affinity, cgroup quota)
    cached: bool  # read from the node's cache, not measured now


def layer_rate(threads: int, shapes: LayerShapes, seconds: float = CALIBRATION_S) -> float:
    """Runs on the node: the layers per second of ``shapes`` with ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    # One weight per distinct shape, its time counted once per matrix of that shape (a
    # mixture-of-experts layer's experts share one): memory stays that of a few matrices.
    timed = [(torch.randn(min(out, MAX_TIMED_ROWS), k), count * out / min(out, MAX_TIMED_ROWS))
             for (out, k), count in Counter(shapes.matrices).items()]
    inputs = {k: torch.randn(ROWS, k) for _, k in shapes.matrices}
    for w, _ in timed:  # warm: first-call allocation and thread start-up
        torch.mm(inputs[w.shape[1]], w.t())
    # Each matrix's time runs from the end of the previous one, so that no moment of the
    # burst goes uncounted: a CPU quota's stall (a throttled node) that begins between two
    # products still counts against the node.
    layer_s, layers = 0.0, 0
    started = last = time.perf_counter()
    while last - started < seconds or layers == 0:
        for w, scale in timed:
            torch.mm(inputs[w.shape[1]], w.t())
            now = time.perf_counter()
            layer_s += (now - last) * scale
            last = now
        layers += 1
    return layers / layer_s


def cache_key(address: str, threads: int, shapes: LayerShapes, cpus: float) -> str:
    import torch

    what = json.dumps([address, threads, shapes.key, round(cpus, 2), torch.__version__, ROWS])
    return hashlib.blake2b(what.encode(), digest_size=12).hexdigest()


def node_rate(address: str, threads: int, shapes: LayerShapes, refresh: bool = False,
              directory: str = CACHE_DIR, at_least: float = 0.0) -> NodeSpeed:
    """Runs on the node: its rate from its cache (see the module doc), else measured now
    and cached. ``refresh``: measure even where a cached rate is fresh; ``at_least``: a
    rate already measured, kept (and cached) if this measurement is lower."""
    cpus = usable_cpus()
    path = Path(os.path.expanduser(directory)) / f"{cache_key(address, threads, shapes, cpus)}.json"
    if not refresh:
        try:
            entry = json.loads(path.read_text())
            if time.time() - entry["measured_at"] < CACHE_MAX_AGE_S and entry["layers_per_s"] > 0:
                return NodeSpeed(float(entry["layers_per_s"]), cpus, cached=True)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none yet, or unreadable: measure
    rate = max(layer_rate(threads, shapes), layer_rate(threads, shapes), at_least)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"layers_per_s": rate, "measured_at": time.time(), "address": address,
                                       "threads": threads, "shapes": shapes.key, "cpus": cpus}))
        partial.replace(path)  # atomic: a reader sees a whole entry or none
    except OSError:
        pass  # a node without a writable home still answers
    return NodeSpeed(rate, cpus, cached=False)


def measure_nodes(nodes: Mapping[str, str], threads: Mapping[str, int], shapes: LayerShapes, *,
                  refresh: bool = False, timeout_s: float = 60.0) -> dict[str, NodeSpeed]:
    """Each node's speed (``nodes``: Ray node id -> its address; Ray must be connected)
    with the threads a stage or replica will have there (``threads``: node id -> threads;
    1 where left out), one node after another; a node that does not answer in time is
    left out (the split then weighs none by speed)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(node_rate)

    def measure(node: str, again: bool, at_least: float = 0.0) -> NodeSpeed | None:
        ref = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            nodes[node], threads.get(node, 1), shapes, again, CACHE_DIR, at_least)
        ready, _ = ray.wait([ref], timeout=timeout_s)
        try:
            if not ready:
                raise TimeoutError
            speed = ray.get(ref)
            return speed if math.isfinite(speed.layers_per_s) else None
        except (TimeoutError, ray.exceptions.RayError):
            ray.cancel(ref, force=True)
            return None

    speeds = {node: speed for node in nodes if (speed := measure(node, refresh)) is not None}
    for _ in range(CONFIRM_ROUNDS):  # a node that looks slow: measured again, keeping its best
        fastest = max((s.layers_per_s for s in speeds.values()), default=0.0)
        doubtful = [node for node, s in speeds.items() if not s.cached and s.layers_per_s < SLOW_NODE * fastest]
        if not doubtful:
            break
        for node in doubtful:
            again = measure(node, True, speeds[node].layers_per_s)
            if again is not None:
                speeds[node] = again
    return speeds
