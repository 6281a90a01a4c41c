"""bargein: an LLM inference engine where every generation can be stopped and continued exactly.

Public API::

    from bargein import Engine, AsyncEngine, SamplingParams

    engine = Engine.from_pretrained()            # the bundled SmolLM2-135M-Instruct
    [out] = engine.generate(["The capital of France is"], SamplingParams(max_tokens=16))
"""

from bargein.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from bargein.engine.async_engine import AsyncEngine
from bargein.engine.conversation import Conversation, ConversationState
from bargein.engine.engine import Engine, EngineError
from bargein.engine.outputs import OutputCollector
from bargein.engine.request import AbortResult, CancelReason, FinishReason, RequestOutput, Usage
from bargein.engine.sampling import InvalidSamplingParams, SamplingParams

__all__ = [
    "AbortResult", "AsyncEngine", "CacheConfig", "CancelReason", "Conversation", "ConversationState",
    "Engine", "EngineConfig", "EngineError", "FinishReason", "InvalidSamplingParams", "ModelConfig",
    "OutputCollector", "RequestOutput", "SamplingParams", "SchedulerConfig", "Usage",
]
