"""bargein: an LLM inference engine where every generation can be stopped and continued exactly.

Public API::

    from bargein import Engine, AsyncEngine, SamplingParams

    engine = Engine.from_pretrained()            # the bundled SmolLM2-135M-Instruct
    [out] = engine.generate(["The capital of France is"], SamplingParams(max_tokens=16))
"""

import os

# Read once, when PyTorch loads its OpenMP runtime, so set here before the first torch
# import (a value the user set wins). Spinning OpenMP workers hold the cores between
# PyTorch ops, exactly when bargein's native kernels want them: on 2 cores, decoding 1
# and 8 sequences ran 1.5-2x faster with passive waiting (bench/README.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from bargein.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402 CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from bargein.engine.async_engine import AsyncEngine  # noqa: E402
from bargein.engine.conversation import Conversation, ConversationState  # noqa: E402
from bargein.engine.engine import Engine, EngineError  # noqa: E402
from bargein.engine.request import AbortResult, CancelReason, FinishReason, RequestOutput, Usage  # noqa: E402
from bargein.engine.sampling import InvalidSamplingParams, SamplingParams  # noqa: E402

__all__ = [
    "AbortResult", "AsyncEngine", "CacheConfig", "CancelReason", "Conversation", "ConversationState",
    "Engine", "EngineConfig", "EngineError", "FinishReason", "InvalidSamplingParams", "ModelConfig",
    "RequestOutput", "SamplingParams", "SchedulerConfig", "Usage",
]
