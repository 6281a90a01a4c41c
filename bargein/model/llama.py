"""A Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2) over a layer range.

A :class:`LlamaStage` holds layers ``[start, end)`` of a model: the embedding only when
``start == 0``, the final norm and LM head only when ``end == num_layers``. A whole
model is the stage ``[0, num_layers)``; a pipeline is several stages, each taking the
previous one's hidden states.

Weights arrive in canonical names (see ``bargein.loader``) and are fused here, at
construction: Q, K and V into one matrix and gate/up into another, so that each layer
runs two large matmuls instead of five small ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bargein.config import ModelConfig
from bargein.kernels.ops import TORCH_KERNELS, KernelSet
from bargein.model.attention import (
    AttentionMetadata,
    KVCache,
    fast_paged_attention,
    paged_attention,
)
from bargein.model.linear import Linear
from bargein.model.rope import RotaryEmbedding, apply_rotary

Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin for the forward's tokens


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, kernels: KernelSet = TORCH_KERNELS):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.shape = (weight.shape[0],)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (y := self.kernels.rms_norm(x, self.weight, self.eps)) is not None:
            return y  # fast: each row by the same native code, whatever the batch
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        # Normalise in fp32 whatever the model's dtype, then scale, as the reference does.
        return self.weight * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, w: Mapping[str, torch.Tensor], prefix: str,
                 kernels: KernelSet):
        super().__init__()
        self.kernels = kernels
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        wqkv = torch.cat([w[f"{prefix}.wq.weight"], w[f"{prefix}.wk.weight"], w[f"{prefix}.wv.weight"]])
        bqkv = None
        if config.attention_bias:
            bqkv = torch.cat([w[f"{prefix}.wq.bias"], w[f"{prefix}.wk.bias"], w[f"{prefix}.wv.bias"]])
        self.wqkv = Linear(wqkv, bqkv, kernels=kernels)
        self.wo = Linear(w[f"{prefix}.wo.weight"], kernels=kernels)

    def forward(self, x: torch.Tensor, rotary: Rotary, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.wqkv(x)  # (T, q_size + 2 * kv_size)
        if self.kernels.fast:  # RoPE, the K/V write and attention in two native calls, token by token
            out = fast_paged_attention(qkv, *rotary, self.num_heads, cache, meta, self.kernels)
            return self.wo(out.view(t, q_size))
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(t, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, *rotary)
        out = paged_attention(q, k, v.contiguous(), cache, meta, self.kernels)  # (T, H, D)
        return self.wo(out.reshape(t, q_size))


class FeedForward(nn.Module):
    def __init__(self, w: Mapping[str, torch.Tensor], prefix: str, kernels: KernelSet):
        super().__init__()
        self.w13 = Linear(torch.cat([w[f"{prefix}.w1.weight"], w[f"{prefix}.w3.weight"]]), kernels=kernels)
        self.w2 = Linear(w[f"{prefix}.w2.weight"], kernels=kernels)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w13(x)  # (T, 2 * intermediate)
        if (h := self.kernels.silu_mul(gate_up)) is not None:
            return self.w2(h)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, w: Mapping[str, torch.Tensor], layer: int,
                 kernels: KernelSet):
        super().__init__()
        prefix = f"layers.{layer}"
        self.attn_norm = RMSNorm(w[f"{prefix}.attn_norm.weight"], config.rms_norm_eps, kernels)
        self.attention = Attention(config, w, prefix, kernels)
        self.ffn_norm = RMSNorm(w[f"{prefix}.ffn_norm.weight"], config.rms_norm_eps, kernels)
        self.feed_forward = FeedForward(w, prefix, kernels)

    def forward(self, x: torch.Tensor, rotary: Rotary, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        h = x + self.attention(self.attn_norm(x), rotary, cache, meta)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaStage(nn.Module):
    """Layers ``[start, end)`` of a Llama-family model.

    ``forward`` takes token ids (T,) in the first stage and hidden states (T, hidden)
    in the others; it returns float32 logits for the rows named by ``logits_indices`` in
    the last stage, and hidden states in the others. ``kv_caches[j]`` is the cache of
    layer ``start + j``; the caller owns the caches and their block ids.

    ``kernels`` (resolved once by whoever builds the model, see
    :func:`bargein.kernels.ops.resolve_kernels`) picks native or PyTorch operations;
    the constructor itself never builds or loads a kernel library.
    """

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor],
                 layer_range: tuple[int, int] | None = None, max_positions: int | None = None,
                 kernels: KernelSet = TORCH_KERNELS):
        super().__init__()
        start, end = layer_range or (0, config.num_layers)
        if not 0 <= start < end <= config.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is not within [0, {config.num_layers})")
        self.config, self.start, self.end = config, start, end
        self.is_first, self.is_last = start == 0, end == config.num_layers
        self.embed = nn.Parameter(weights["embed.weight"], requires_grad=False) if self.is_first else None
        self.layers = nn.ModuleList(TransformerBlock(config, weights, i, kernels) for i in range(start, end))
        self.norm = self.lm_head = None
        if self.is_last:
            self.norm = RMSNorm(weights["norm.weight"], config.rms_norm_eps, kernels)
            head = weights["embed.weight"] if config.tie_word_embeddings else weights["lm_head.weight"]
            self.lm_head = Linear(head, kernels=kernels)
        self.rope = RotaryEmbedding(config, max_positions or config.max_position_embeddings,
                                    weights.get("rope_freq_factors"))
        self.kernels = kernels

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].attn_norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].attn_norm.weight.device

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def kv_dtype(self) -> torch.dtype:
        """The K/V cache's dtype: float16 in the fast precision, the model's dtype otherwise."""
        return self.kernels.kv_dtype or self.dtype

    def make_kv_caches(self, num_blocks: int, block_size: int) -> list[KVCache]:
        device = self.device
        return [KVCache.empty(num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim,
                              self.kv_dtype, device) for _ in range(self.num_layers)]

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: Sequence[KVCache], logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        x = F.embedding(inputs, self.embed) if self.is_first else inputs  # (T, hidden)
        rotary = self.rope.angles(positions, x.dtype)  # shared by every layer
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rotary, cache, meta)
        if not self.is_last:
            return x
        if logits_indices is not None:
            x = x[logits_indices]
        return self.lm_head(self.norm(x)).float()  # (N, vocab)

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Memory one block of this stage's K/V takes, over all its layers."""
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return 2 * self.num_layers * block_size * self.config.num_kv_heads * self.config.head_dim * elem
