"""bargein: an LLM inference engine where every generation can be stopped and continued exactly.

Public API::

    from bargein import Engine, AsyncEngine, SamplingParams

    engine = Engine.from_pretrained()            # the bundled SmolLM2-135M-Instruct
    [out] = engine.generate(["The capital of France is"], SamplingParams(max_tokens=16))
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from bargein.startup import collection_paused

# Names are imported on first use (PEP 562), so that `import bargein.cli` for a client
# command (ps, cancel, --help) does not pay for torch and the model code.
_EXPORTS = {
    "CacheConfig": "bargein.config", "EngineConfig": "bargein.config", "ModelConfig": "bargein.config",
    "SchedulerConfig": "bargein.config", "AsyncEngine": "bargein.engine.async_engine",
    "Conversation": "bargein.engine.conversation", "ConversationState": "bargein.engine.conversation",
    "Engine": "bargein.engine.engine", "EngineError": "bargein.engine.engine",
    "AbortResult": "bargein.engine.request", "CancelReason": "bargein.engine.request",
    "FinishReason": "bargein.engine.request", "RequestOutput": "bargein.engine.request",
    "Usage": "bargein.engine.request", "InvalidSamplingParams": "bargein.engine.sampling",
    "SamplingParams": "bargein.engine.sampling", "OutputCollector": "bargein.engine.outputs",
    "build_engine": "bargein.build",
}
__all__ = [
    "AbortResult", "AsyncEngine", "CacheConfig", "CancelReason", "Conversation", "ConversationState",
    "Engine", "EngineConfig", "EngineError", "FinishReason", "InvalidSamplingParams", "ModelConfig",
    "OutputCollector", "RequestOutput", "SamplingParams", "SchedulerConfig", "Usage", "build_engine",
]

if TYPE_CHECKING:
    from bargein.build import build_engine
    from bargein.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from bargein.engine.async_engine import AsyncEngine
    from bargein.engine.conversation import Conversation, ConversationState
    from bargein.engine.engine import Engine, EngineError
    from bargein.engine.outputs import OutputCollector
    from bargein.engine.request import AbortResult, CancelReason, FinishReason, RequestOutput, Usage
    from bargein.engine.sampling import InvalidSamplingParams, SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'bargein' has no attribute {name!r}")
    # The collector paused while the engine's modules import: they create a quarter of a
    # million objects after torch's million, and the full collections that triggers walk
    # torch's heap again and again (0.2 of the 0.35 s of `from bargein import Engine`).
    with collection_paused():
        value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
