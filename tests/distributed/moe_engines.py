"""The MoE engine that ``test_moe_ray.py``'s replicas run, and its configuration.

:func:`build_replica` is pickled by reference and runs on each replica's node and on the
replica set's builder store: unpickling it imports this module, so it imports only what
the engine needs (the test module, with the recovery tests' server imports, cost each
such process over a second of CPU more on a loaded machine).
"""

from __future__ import annotations

from bargein.config import CacheConfig, EngineConfig, PipelineConfig, SchedulerConfig
from bargein.engine.engine import Engine
from tests.model.moe_files import model_path

MODEL = model_path("qwen3moe", "gguf")


def moe_config(resource: str | None = None) -> EngineConfig:
    """One process's engine; with ``resource``, a pipeline of two stages on the nodes that
    offer it, with short heartbeats and a long recovery timeout."""
    pipeline = None if resource is None else PipelineConfig(
        stages=2, node_resource=resource, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5, step_timeout_s=5.0,
        recovery_timeout_s=60.0)
    return EngineConfig(cache=CacheConfig(block_size=4, num_blocks=48),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
                        device="cpu", dtype="float32", pipeline=pipeline)


def build_replica() -> Engine:
    """Runs on each replica's node (pickled by reference): the MoE engine, one torch thread."""
    import torch

    torch.set_num_threads(1)
    return Engine.from_pretrained(MODEL, moe_config(), progress=False)
