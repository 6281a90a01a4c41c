"""The tiny-engine replicas that ``test_replicas.py`` runs on the shared cluster.

Functions here are pickled by reference and run on each replica's node, and on the
replica set's builder store: unpickling one imports this module, so it imports only what
the engine needs (the test module, with its server and client imports, cost each such
process about a second of CPU more on a loaded machine).
"""

from __future__ import annotations

import threading

import torch

from bargein.engine.engine import Engine
from tests.tiny_engine import tiny_engine


def build_replica_engine() -> Engine:
    """Runs on each replica's node (pickled by reference): the tiny engine, one torch thread,
    whose forward hangs for a request named ``hang-*`` once it has 3 tokens (not resumed)."""
    torch.set_num_threads(1)
    engine = tiny_engine(num_blocks=96, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    engine.runner = _HangingRunner(engine)
    return engine


class _HangingRunner:
    """The engine's runner, except that a plan with a ``hang-*`` request at 3 output tokens
    (not a resumed one) never returns: a hung forward, while the actor still answers."""

    def __init__(self, engine: Engine):
        self._engine, self._inner, self._plan = engine, engine.runner, None

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def submit(self, plan) -> None:
        self._plan = plan
        self._inner.submit(plan)

    def collect(self):
        for chunk in self._plan.sampled:
            req = self._engine.scheduler.requests.get(chunk.request_id)
            if chunk.request_id.startswith("hang-") and req is not None and req.output_offset == 0 \
                    and req.num_output_tokens >= 3:
                threading.Event().wait()
        return self._inner.collect()
