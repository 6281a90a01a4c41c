"""Engines are built here, by one function for every kind: in this process, a pipeline of
stages on Ray, or engine replicas behind one head.

This module sits above ``bargein.distributed`` and below the server and the CLI, so that
``bargein.engine`` never imports ``bargein.distributed`` (nor anything above it): the engine
knows a :class:`~bargein.engine.runner.Runner`, never how one is started.

    engine = build_engine("model.gguf", EngineConfig())                       # this process
    engine = build_engine("model.gguf", EngineConfig(pipeline=PipelineConfig(stages=2)))
    replicas = build_replicas("model.gguf", EngineConfig(), "auto", 2)     # an EngineClient
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bargein.config import EngineConfig

if TYPE_CHECKING:
    from bargein.engine.engine import Engine


def build_engine(ref: str | None = None, config: EngineConfig | None = None, *, progress: bool = True) -> Engine:
    """The engine of a model reference (None: the bundled SmolLM2; a .gguf file; an HF folder).

    With ``config.pipeline`` set its runner drives stages on a Ray cluster (Ray is an
    optional extra, imported only then); otherwise the model runs in this process."""
    config = config or EngineConfig()
    if config.pipeline is None:
        from bargein.engine.engine import Engine

        return Engine.from_pretrained(ref, config, progress=progress)
    from bargein.distributed.engines import pipeline_engine

    return pipeline_engine(ref, config)


def build_replicas(ref: str, config: EngineConfig, address: str, num_replicas: int, options: Any = None, *,
                   ship: bool | None = None) -> Any:
    """``num_replicas`` whole engines (each a pipeline where ``config.pipeline`` is set) on
    the Ray cluster at ``address``, behind one replica set (see
    :func:`bargein.distributed.replicas.launch_replicas`)."""
    from bargein.distributed.replicas import launch_replicas

    return launch_replicas(ref, config, address, num_replicas, options, ship=ship)
