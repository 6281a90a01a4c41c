"""A Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2/3, Gemma 2/3, Phi-3/4) over a layer range.

The families differ in a few named features (see :class:`~bargein.config.ModelConfig`):
per-head Q/K norms, norms after attention and MLP, GeGLU, scaled embeddings, soft-capped
scores and logits, sliding-window layers with their own RoPE base. Each is a field of the
config that the layers read; the loader names and lays out every family's tensors alike.

A :class:`LlamaStage` holds layers ``[start, end)`` of a model: the embedding only when
``start == 0``, the final norm and LM head only when ``end == num_layers``. A whole
model is the stage ``[0, num_layers)``; a pipeline is several stages, each taking the
previous one's hidden states.

Weights arrive in canonical names (see ``bargein.loader``) and are fused here, at
construction: Q, K and V into one matrix and gate/up into another, so that each layer
runs two large matmuls instead of five small ones. A weight may arrive dense or held in
blocks (:mod:`bargein.model.block_weights`): a QuantWeight (a GGUF's blocks of any type,
over the mapped file) stays one, fused parts as its segments, and is read by
``KernelSet.quant_linear``; no float32 copy of it exists in either precision. Beside a
BlockWeight (a block form found in a dense weight) only ``fp32_weights`` adds a float32
copy (see :meth:`Linear.from_blocks`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping, MutableMapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bargein.config import ModelConfig
from bargein.kernels.block_quant import BlockWeight
from bargein.kernels.ops import TORCH_KERNELS, KernelSet
from bargein.kernels.quant_weight import QuantWeight
from bargein.model.attention import (
    AttentionMetadata,
    KVCache,
    fast_paged_attention,
    paged_attention,
    windowed_paged_attention,
)
from bargein.model.block_weights import TokenEmbedding, Weight, cat_rows, dense
from bargein.model.fused_layers import FusedLayers
from bargein.model.linear import Linear
from bargein.model.moe import MoEFeedForward
from bargein.model.rope import RotaryEmbedding, apply_rotary

Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin for the forward's tokens
Take = Callable[[str], Weight]  # a canonical weight by name (see LlamaStage's ``consume``)


def _linear(weight: Weight, bias: torch.Tensor | None, kernels: KernelSet, fp32_weights: bool) -> Linear:
    if isinstance(weight, QuantWeight):
        return Linear.from_quant(weight, bias, kernels=kernels)
    if isinstance(weight, BlockWeight):
        return Linear.from_blocks(weight, bias, keep_fp32=fp32_weights, kernels=kernels)
    return Linear(weight, bias, kernels=kernels)


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
    def __init__(self, config: ModelConfig, take: Take, layer: int, kernels: KernelSet, fp32_weights: bool):
        super().__init__()
        prefix = f"layers.{layer}"
        self.kernels = kernels
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.window, self.softcap, self.scale = config.window(layer), config.attn_softcap, config.scale
        self.is_local = self.window is not None
        wqkv = cat_rows([take(f"{prefix}.wq.weight"), take(f"{prefix}.wk.weight"), take(f"{prefix}.wv.weight")])
        bqkv = None
        if config.attention_bias:
            bqkv = torch.cat([dense(take(f"{prefix}.{n}.bias")) for n in ("wq", "wk", "wv")])
        self.wqkv = _linear(wqkv, bqkv, kernels, fp32_weights)
        self.wo = _linear(take(f"{prefix}.wo.weight"), None, kernels, fp32_weights)
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # one RMS norm over each head's dimensions, before RoPE
            self.q_norm = RMSNorm(dense(take(f"{prefix}.q_norm.weight")), config.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(dense(take(f"{prefix}.k_norm.weight")), config.rms_norm_eps, kernels)

    @property
    def is_plain(self) -> bool:
        """Whether the scores are Llama's (no window, soft cap or scale of its own), which
        the batched decode path and CUDA graphs take; else the per-sequence windowed path."""
        return self.window is None and self.softcap is None and self.scale == self.head_dim ** -0.5

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv (T, (H + 2 KVH) D) with each head of q and k RMS-normed (rows of D: row-wise in fast)."""
        t, d = qkv.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        q = self.q_norm(qkv[:, :q_size].reshape(t * self.num_heads, d)).view(t, q_size)
        k = self.k_norm(qkv[:, q_size:q_size + kv_size].reshape(t * self.num_kv_heads, d)).view(t, kv_size)
        return torch.cat([q, k, qkv[:, q_size + kv_size:]], dim=-1)

    def forward(self, x: torch.Tensor, rotary: Rotary, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.wqkv(x)  # (T, q_size + 2 * kv_size)
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv)
        if self.kernels.fast:  # RoPE, the K/V write and attention in two native calls, token by token
            out = fast_paged_attention(qkv, *rotary, self.num_heads, cache, meta, self.kernels,
                                       window=self.window, softcap=self.softcap, scale=self.scale)
            return self.wo(out.view(t, q_size))
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(t, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, *rotary)
        if self.is_plain:
            out = paged_attention(q, k, v.contiguous(), cache, meta, self.kernels)  # (T, H, D)
        else:
            out = windowed_paged_attention(q, k, v.contiguous(), cache, meta, window=self.window,
                                           softcap=self.softcap, scale=self.scale)
        return self.wo(out.reshape(t, q_size))


class FeedForward(nn.Module):
    def __init__(self, take: Take, prefix: str, kernels: KernelSet, fp32_weights: bool, activation: str = "silu"):
        super().__init__()
        w13 = cat_rows([take(f"{prefix}.w1.weight"), take(f"{prefix}.w3.weight")])
        self.w13 = _linear(w13, None, kernels, fp32_weights)
        self.w2 = _linear(take(f"{prefix}.w2.weight"), None, kernels, fp32_weights)
        self.kernels = kernels
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w13(x)  # (T, 2 * intermediate)
        if self.activation == "gelu_tanh":  # GeGLU (Gemma)
            if (h := self.kernels.gelu_tanh_mul(gate_up)) is not None:
                return self.w2(h)
            gate, up = gate_up.chunk(2, dim=-1)
            return self.w2(F.gelu(gate, approximate="tanh") * up)
        if (h := self.kernels.silu_mul(gate_up)) is not None:
            return self.w2(h)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


def _mlp(config: ModelConfig, take: Take, layer: int, kernels: KernelSet, fp32_weights: bool) -> nn.Module:
    """Layer ``layer``'s MLP: dense, or a mixture of experts (with Qwen2-MoE's shared expert)."""
    prefix, moe = f"layers.{layer}", config.moe
    if moe is None or not moe.is_sparse(layer):
        return FeedForward(take, prefix, kernels, fp32_weights, config.activation)
    shared = (FeedForward(take, f"{prefix}.shared", kernels, fp32_weights)
              if moe.shared_expert_intermediate_size else None)
    return MoEFeedForward(moe, take, prefix, kernels, shared)


class TransformerBlock(nn.Module):
    """``h = x + attn(norm(x)); out = h + mlp(norm(h))``; with ``sandwich_norms`` (Gemma) the
    attention's and the MLP's outputs are normed too before they are added."""

    def __init__(self, config: ModelConfig, take: Take, layer: int, kernels: KernelSet, fp32_weights: bool):
        super().__init__()
        prefix = f"layers.{layer}"
        eps = config.rms_norm_eps
        self.attn_norm = RMSNorm(dense(take(f"{prefix}.attn_norm.weight")), eps, kernels)
        self.attention = Attention(config, take, layer, kernels, fp32_weights)
        self.ffn_norm = RMSNorm(dense(take(f"{prefix}.ffn_norm.weight")), eps, kernels)
        self.feed_forward = _mlp(config, take, layer, kernels, fp32_weights)
        self.post_attn_norm = self.post_ffn_norm = None
        if config.sandwich_norms:
            self.post_attn_norm = RMSNorm(dense(take(f"{prefix}.post_attn_norm.weight")), eps, kernels)
            self.post_ffn_norm = RMSNorm(dense(take(f"{prefix}.post_ffn_norm.weight")), eps, kernels)

    def forward(self, x: torch.Tensor, rotary: Rotary, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        a = self.attention(self.attn_norm(x), rotary, cache, meta)
        h = x + (a if self.post_attn_norm is None else self.post_attn_norm(a))
        f = self.feed_forward(self.ffn_norm(h))
        return h + (f if self.post_ffn_norm is None else self.post_ffn_norm(f))


class LlamaStage(nn.Module):
    """Layers ``[start, end)`` of a Llama-family model.

    ``forward`` takes token ids (T,) in the first stage and hidden states (T, hidden)
    in the others; it returns float32 logits for the rows named by ``logits_indices`` in
    the last stage, and hidden states in the others. ``kv_caches[j]`` is the cache of
    layer ``start + j``; the caller owns the caches and their block ids.

    ``kernels`` (resolved once by whoever builds the model, see
    :func:`bargein.kernels.ops.resolve_kernels`) picks native or PyTorch operations;
    the constructor itself never builds or loads a kernel library.

    ``weights`` may hold QuantWeights and BlockWeights (for a float32 CPU model only:
    nothing else reads them); ``fp32_weights`` also keeps a float32 copy of each
    BlockWeight (faster for many rows, 4-6x the memory; never of a QuantWeight). With ``consume``, each weight is popped from ``weights`` (then a
    MutableMapping) as it is used, so that the parts of a fused weight are freed as soon as
    the fused copy exists and the whole model never sits in memory twice.

    In the ``fast`` precision the layers run as one native call per forward
    (:class:`~bargein.model.fused_layers.FusedLayers`), bit for bit the per-operation path;
    ``fuse_layers=False`` keeps the per-operation path (the reference the fused one is
    tested against).
    """

    def __init__(self, config: ModelConfig, weights: Mapping[str, Weight],
                 layer_range: tuple[int, int] | None = None, max_positions: int | None = None,
                 kernels: KernelSet = TORCH_KERNELS, *, fp32_weights: bool = False, consume: bool = False,
                 fuse_layers: bool = True):
        super().__init__()
        start, end = layer_range or (0, config.num_layers)
        if not 0 <= start < end <= config.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is not within [0, {config.num_layers})")
        if consume and not isinstance(weights, MutableMapping):
            raise TypeError("consume=True needs a mutable mapping of weights")
        take: Take = weights.pop if consume else weights.__getitem__  # type: ignore[attr-defined]
        self.config, self.start, self.end = config, start, end
        self.is_first, self.is_last = start == 0, end == config.num_layers
        tied = self.is_last and config.tie_word_embeddings
        embed = take("embed.weight") if self.is_first or tied else None
        self.embed = TokenEmbedding(embed, kernels) if self.is_first else None
        self.layers = nn.ModuleList(TransformerBlock(config, take, i, kernels, fp32_weights)
                                    for i in range(start, end))
        self.norm = self.lm_head = None
        if self.is_last:
            self.norm = RMSNorm(dense(take("norm.weight")), config.rms_norm_eps, kernels)
            head = embed if tied else take("lm_head.weight")
            self.lm_head = _linear(head, None, kernels, fp32_weights)
        freq_factors = take("rope_freq_factors") if "rope_freq_factors" in weights else None
        positions = max_positions or config.max_position_embeddings
        self.rope = RotaryEmbedding(config, positions, freq_factors)
        # Sliding-window layers with a RoPE base of their own (Gemma 3) read these tables.
        self.local_rope = (RotaryEmbedding(config, positions, freq_factors, local=True)
                           if config.local_rope_theta is not None else None)
        self.kernels = kernels
        local = (self.local_rope.cos, self.local_rope.sin) if self.local_rope is not None else None
        self.fused = (FusedLayers.build(config, list(self.layers), (self.rope.cos, self.rope.sin), kernels.native,
                                        self.embed, (self.norm, self.lm_head) if self.is_last else None,
                                        local_rope=local, embed_scale=self.is_first and config.embed_scale)
                      if fuse_layers and kernels.fast and kernels.native is not None else None)
        self._after_next_forward: list[Callable[[], object]] = []
        self._in_forward = False
        self._last_forward_end = time.monotonic()

    def quiet_for(self, seconds: float) -> Callable[[], bool]:
        """A check, for another thread, of whether no forward of this stage has run for
        ``seconds`` (nor runs now); True once the stage is gone. It holds the stage weakly:
        a background job asking it keeps no model alive."""
        stage = weakref.ref(self)

        def quiet() -> bool:
            s = stage()
            return s is None or (not s._in_forward and time.monotonic() - s._last_forward_end >= seconds)

        return quiet

    def after_next_forward(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` once, when this stage's next forward has returned (the weights'
        private copy starts after the first, see bargein.loader.private_weights)."""
        self._after_next_forward.append(callback)

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
    def reads_decode_batch(self) -> bool:
        """Whether this stage's attention reads AttentionMetadata's decode batch: the
        ``fast`` precision attends token by token and never does, so it is not built."""
        return not self.kernels.fast

    @property
    def graph_safe(self) -> bool:
        """Whether a CUDA graph of a decode step replays correctly: the windowed attention
        path loops over sequences by their Python-side lengths, and an MoE layer over the
        experts its rows chose, which a graph would freeze."""
        return self.config.moe is None and all(layer.attention.is_plain for layer in self.layers)

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
                kv_caches: Sequence[KVCache], logits_indices: torch.Tensor | None = None,
                logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """``logits_out``: (N, vocab) float32 memory the fused head may write the logits into
        (and return) instead of a new tensor (``FusedLayers.__call__``); the per-operation
        path ignores it."""
        self._in_forward = True
        try:
            out = self._forward(inputs, positions, meta, kv_caches, logits_indices, logits_out)
        finally:
            self._in_forward, self._last_forward_end = False, time.monotonic()
        if self._after_next_forward:
            callbacks, self._after_next_forward = self._after_next_forward, []
            for callback in callbacks:
                callback()
        return out

    def _forward(self, inputs: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: Sequence[KVCache], logits_indices: torch.Tensor | None,
                 logits_out: torch.Tensor | None) -> torch.Tensor:
        fused = self.fused
        if fused is not None and inputs.device.type == "cpu":  # one native call
            x = self.embed(inputs) if self.is_first and not fused.has_embed else inputs
            x = fused(x, positions, meta, kv_caches, logits_indices, logits_out)
            if fused.has_head:
                return x  # the logits
        else:
            x = self.embed(inputs) if self.is_first else inputs  # (T, hidden)
            if self.is_first and self.config.embed_scale:  # Gemma: sqrt(hidden), rounded to the dtype
                x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
            rotary = self.rope.angles(positions, x.dtype)  # shared by every global layer
            local = self.local_rope.angles(positions, x.dtype) if self.local_rope is not None else rotary
            for layer, cache in zip(self.layers, kv_caches, strict=True):
                x = layer(x, local if layer.attention.is_local else rotary, cache, meta)
        if not self.is_last:
            return x
        if logits_indices is not None:
            x = x[logits_indices]
        logits = self.lm_head(self.norm(x)).float()  # (N, vocab)
        if self.config.final_softcap:
            logits = self.kernels.softcap(logits, self.config.final_softcap)
        return logits

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Memory one block of this stage's K/V takes, over all its layers."""
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return 2 * self.num_layers * block_size * self.config.num_kv_heads * self.config.head_dim * elem
