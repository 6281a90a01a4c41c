"""The fused fast forward (fast_forward.c) over layers whose weights are a GGUF file's
blocks: every type, mixed segments and row orders, the embedding and the LM head too,
give bit for bit what the per-operation path gives through KernelSet.quant_linear and
quant_embedding (the loader's layers call those; here the test sets ``quant`` on the
stage's layers and routes their forwards so)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from bargein.kernels.ops import resolve_kernels
from bargein.kernels.quant_weight import QuantWeight
from bargein.model.block_weights import TokenEmbedding
from bargein.model.fused_layers import FusedLayers
from bargein.model.linear import Linear
from bargein.model.llama import LlamaStage
from tests.gguf_blocks import T, random_weight
from tests.kernels.test_fused_forward import STEPS, assert_same_caches, run, weights
from tests.tiny_engine import TINY

FAST = resolve_kernels("cpu", precision="fast")
pytestmark = pytest.mark.skipif(not FAST.fast, reason="no native kernels here: fast runs as exact")
WIDE = dataclasses.replace(TINY, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64,
                           attention_bias=True)
# Per layer: (q, k, v, wo, w1, w3, w2); every type the kernels read appears.
LAYER_TYPES = [(T.Q4_K, T.Q4_K, T.Q6_K, T.Q5_K, T.Q4_0, T.IQ4_XS, T.Q6_K),
               (T.Q2_K, T.Q3_K, T.Q5_0, T.Q5_1, T.IQ4_NL, T.Q4_1, T.Q8_0)]


def as_quant(stage: LlamaStage, rng: np.random.Generator) -> None:
    """Every linear, the embedding and the head of ``stage`` read random GGUF blocks."""
    c = stage.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for layer, types in zip(stage.layers, LAYER_TYPES, strict=True):
        tq, tk, tv, to, t1, t3, t2 = types
        attention, ffn = layer.attention, layer.feed_forward
        attention.wqkv.quant = QuantWeight.cat_rows([random_weight(tq, q, c.hidden_size, rng, order=True),
                                                     random_weight(tk, kv, c.hidden_size, rng, order=True),
                                                     random_weight(tv, kv, c.hidden_size, rng)])
        attention.wo.quant = random_weight(to, c.hidden_size, q, rng)
        ffn.w13.quant = QuantWeight.cat_rows([random_weight(t1, c.intermediate_size, c.hidden_size, rng),
                                              random_weight(t3, c.intermediate_size, c.hidden_size, rng)])
        ffn.w2.quant = random_weight(t2, c.hidden_size, c.intermediate_size, rng)
    stage.embed.quant = random_weight(T.Q4_K, c.vocab_size, c.hidden_size, rng)
    stage.lm_head.quant = random_weight(T.Q6_K, c.vocab_size, c.hidden_size, rng)


@pytest.fixture
def quant_forwards(monkeypatch):
    """Linear and TokenEmbedding forwards that read ``quant`` where it is set, as the loader's do."""
    linear_forward, embed_forward = Linear.forward, TokenEmbedding.forward

    def linear(self, x):
        if getattr(self, "quant", None) is None:
            return linear_forward(self, x)
        y = self.kernels.quant_linear(x, self.quant)
        return y if self.bias is None else y + self.bias

    def embed(self, ids):
        if getattr(self, "quant", None) is None:
            return embed_forward(self, ids)
        return FAST.quant_embedding(self.quant, ids)

    monkeypatch.setattr(Linear, "forward", linear)
    monkeypatch.setattr(TokenEmbedding, "forward", embed)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_fused_layers_over_gguf_blocks_give_the_per_operation_bits(quant_forwards, num_threads):
    w = weights(WIDE, 0, "dense")
    per_op = LlamaStage(WIDE, w, kernels=FAST, fuse_layers=False)
    as_quant(per_op, np.random.default_rng(7))
    stage = LlamaStage(WIDE, w, kernels=FAST, fuse_layers=False)  # the same modules, fused below
    stage.load_state_dict(per_op.state_dict(), strict=False)
    stage.layers, stage.embed, stage.lm_head, stage.norm = per_op.layers, per_op.embed, per_op.lm_head, per_op.norm
    stage.fused = FusedLayers.build(WIDE, list(stage.layers), (stage.rope.cos, stage.rope.sin), FAST.native,
                                    stage.embed, (stage.norm, stage.lm_head))
    assert stage.fused is not None and stage.fused.has_embed and stage.fused.has_head
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        caches_fused, caches_per_op = stage.make_kv_caches(40, 4), per_op.make_kv_caches(40, 4)
        for steps in STEPS:
            got, want = run(stage, caches_fused, steps), run(per_op, caches_per_op, steps)
            assert torch.isfinite(want).all()
            assert torch.equal(got, want)
            assert_same_caches(caches_fused, caches_per_op)
    finally:
        torch.set_num_threads(previous)
