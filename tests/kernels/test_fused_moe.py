"""The fused fast forward (fast_forward.c) runs mixture-of-experts layers (Qwen3-MoE,
Qwen2-MoE with its shared expert, Mixtral) and gives the per-operation path's logits and
K/V bit for bit (routing, the grouped experts, the weighted sum and the shared expert in C
compute what MoEFeedForward's fast path computes), over prompt chunks and decodes, at 1
and 2 threads, for whole models from both formats and for a stage of the last layer.

The models are the committed tiny MoE files (tests/data/moe): the folder's float32 experts
become Q8_0 blocks in ``fast``, the GGUF's are read as stored.
"""

from __future__ import annotations

import pytest
import torch

from bargein.config import ModelConfig
from bargein.kernels.ops import resolve_kernels
from bargein.model.moe import MoEFeedForward
from tests.kernels.fused_checks import (
    STEPS,
    assert_hidden_forwards_equal,
    assert_token_forwards_equal,
    fused_and_per_op,
    load_blocks,
)
from tests.model.moe_files import FORMATS, NAMES, model_path

FAST = resolve_kernels("cpu", precision="fast")
pytestmark = pytest.mark.skipif(not FAST.fast, reason="no native kernels here: fast runs as exact")


def _model(name: str, fmt: str) -> tuple[ModelConfig, dict]:
    return load_blocks(model_path(name, fmt))


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", NAMES)
def test_each_moe_family_fused_gives_the_per_operation_bits(name: str, fmt: str, num_threads: int) -> None:
    fused, per_op = fused_and_per_op(*_model(name, fmt), None, FAST)
    assert all(isinstance(layer.feed_forward, MoEFeedForward) for layer in fused.layers)
    assert (fused.layers[0].feed_forward.shared is not None) == (name == "qwen2moe")
    caches = assert_token_forwards_equal(fused, per_op, num_threads)
    assert caches[-1].k.abs().sum() > 0


def test_a_last_stage_of_moe_layers_from_hidden_states() -> None:
    config, weights = _model("qwen2moe", "gguf")
    assert_hidden_forwards_equal(*fused_and_per_op(config, weights, (1, config.num_layers), FAST), STEPS)


def test_a_router_changed_in_place_is_the_one_the_fused_call_reads() -> None:
    """The description points into the module's router (no copy): a test that forces the
    routing (test_moe_memory.py) writes it in place, and the fused call follows."""
    fused, per_op = fused_and_per_op(*_model("qwen3moe", "gguf"), None, FAST)
    for stage in (fused, per_op):
        for layer in stage.layers:
            layer.feed_forward.router.copy_(torch.randn(layer.feed_forward.router.shape,
                                                        generator=torch.Generator().manual_seed(7)))
    assert_token_forwards_equal(fused, per_op, 1)
