"""Engines whose runner is a pipeline of stages on Ray: built here, beside the runner, so
that ``bargein.engine`` never imports ``bargein.distributed``."""

from __future__ import annotations

from bargein.config import EngineConfig
from bargein.engine.engine import Engine


def pipeline_engine(ref: str | None, config: EngineConfig) -> Engine:
    """An Engine over a :class:`~bargein.distributed.pipeline.PipelineRunner` for
    ``config.pipeline``; a ``"~/..."`` reference is looked up in each node's own home."""
    from bargein.distributed.pipeline import PipelineRunner
    from bargein.loader import load_config, load_tokenizer, resolve_model_ref

    assert config.pipeline is not None, "pipeline_engine needs EngineConfig.pipeline"
    source = resolve_model_ref(ref)
    model_config = load_config(source, sliding_window=config.sliding_window)
    node_path = str(ref) if ref is not None and str(ref).startswith("~") else None
    runner = PipelineRunner.start(source, model_config, config, node_path=node_path)
    return Engine(runner, load_tokenizer(source), config, model_name=source.name, model_identity=str(source.path))


def any_engine(ref: str | None, config: EngineConfig, *, progress: bool = True) -> Engine:
    """A pipeline engine where ``config.pipeline`` is set, else one in this process."""
    if config.pipeline is not None:
        return pipeline_engine(ref, config)
    return Engine.from_pretrained(ref, config, progress=progress)
