"""The fused fast forward (fast_forward.c) runs every family's layers: per-head Q/K norms
(Qwen3, Gemma 3), post-norms, GeGLU, scaled embeddings, soft caps and query scale (Gemma 2),
local layers with their own RoPE base and window (Gemma 3, Mistral), partial rotary (Phi-3),
and gives the per-operation path's logits and K/V bit for bit, over prompt chunks and
decodes past the sliding window (8), at 1 and 2 threads, for whole models and a middle stage.

The models are the committed tiny family files (tests/data/families), both formats: the
folder's float32 weights become 8-bit blocks in ``fast``, the GGUF's are read as stored.
"""

from __future__ import annotations

import dataclasses

import pytest

from bargein.config import ModelConfig
from bargein.kernels.ops import resolve_kernels
from bargein.model.llama import LlamaStage
from tests.kernels.fused_checks import (
    STEPS,
    assert_hidden_forwards_equal,
    assert_token_forwards_equal,
    fused_and_per_op,
    load_blocks,
)
from tests.model.family_files import FORMATS, NAMES, model_path

FAST = resolve_kernels("cpu", precision="fast")
pytestmark = pytest.mark.skipif(not FAST.fast, reason="no native kernels here: fast runs as exact")


def _model(name: str, fmt: str) -> tuple[ModelConfig, dict]:
    return load_blocks(model_path(name, fmt))


def _pair(name: str, fmt: str, layer_range: tuple[int, int] | None = None,
          **changes: object) -> tuple[LlamaStage, LlamaStage]:
    config, weights = _model(name, fmt)
    return fused_and_per_op(dataclasses.replace(config, **changes), weights, layer_range, FAST)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", NAMES)
def test_each_family_fused_gives_the_per_operation_bits(name: str, fmt: str, num_threads: int) -> None:
    caches = assert_token_forwards_equal(*_pair(name, fmt), num_threads)
    assert caches[-1].k.abs().sum() > 0


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_a_gemma_middle_stage_across_local_and_global_layers(name: str) -> None:
    """Layers [1, 6) of Gemma 3 hold four local layers and its global one (Gemma 2 alternates):
    no embedding scale in a stage that is not the first, each layer's own RoPE and window;
    a query scale other than head_dim^-0.5 (the 27B models')."""
    config, _ = _model(name, "gguf")
    fused, per_op = _pair(name, "gguf", (1, config.num_layers), query_scale=0.2)
    assert {layer.attention.is_local for layer in fused.layers} == {True, False}
    assert_hidden_forwards_equal(fused, per_op, STEPS)
