"""A plain dense Llama forward with no cache, written independently of bargein.model.

It is the oracle the paged model is checked against: full causal attention over the
whole sequence, separate Q/K/V and gate/up matmuls, GQA by repeating K/V heads.
"""

from __future__ import annotations

import torch

from bargein.config import ModelConfig
from bargein.model.rope import inverse_frequencies


def random_weights(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Canonical-named random weights, scaled so activations stay in a sane range."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    w = {"embed.weight": rnd(config.vocab_size, h, scale=0.5), "norm.weight": 1 + rnd(h)}
    if not config.tie_word_embeddings:
        w["lm_head.weight"] = rnd(config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"layers.{i}"
        w |= {
            f"{p}.attn_norm.weight": 1 + rnd(h), f"{p}.ffn_norm.weight": 1 + rnd(h),
            f"{p}.wq.weight": rnd(config.num_heads * config.head_dim, h),
            f"{p}.wk.weight": rnd(kv, h), f"{p}.wv.weight": rnd(kv, h),
            f"{p}.wo.weight": rnd(h, config.num_heads * config.head_dim),
            f"{p}.w1.weight": rnd(config.intermediate_size, h), f"{p}.w3.weight": rnd(config.intermediate_size, h),
            f"{p}.w2.weight": rnd(h, config.intermediate_size),
        }
        if config.attention_bias:
            w |= {f"{p}.wq.bias": rnd(config.num_heads * config.head_dim, scale=0.5),
                  f"{p}.wk.bias": rnd(kv, scale=0.5), f"{p}.wv.bias": rnd(kv, scale=0.5)}
    return w


def dense_logits(config: ModelConfig, w: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """Logits (T, vocab) for every position of one sequence, in float64."""
    w = {k: v.double() for k, v in w.items()}
    t = len(tokens)
    x = w["embed.weight"][torch.tensor(tokens)]
    inv_freq, _ = inverse_frequencies(config, w.get("rope_freq_factors"))
    angles = torch.outer(torch.arange(t, dtype=torch.float64), inv_freq)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(a: torch.Tensor) -> torch.Tensor:  # (heads, T, D)
        half = a.shape[-1] // 2
        rotated = torch.cat([-a[..., half:], a[..., :half]], -1)
        return a * cos + rotated * sin

    def norm(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * a / torch.sqrt(a.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)

    def lin(a: torch.Tensor, name: str) -> torch.Tensor:
        out = a @ w[f"{name}.weight"].T
        return out + w[f"{name}.bias"] if f"{name}.bias" in w else out

    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
    for i in range(config.num_layers):
        p = f"layers.{i}"
        a = norm(x, w[f"{p}.attn_norm.weight"])
        q = lin(a, f"{p}.wq").view(t, config.num_heads, config.head_dim).transpose(0, 1)
        k = lin(a, f"{p}.wk").view(t, config.num_kv_heads, config.head_dim).transpose(0, 1)
        v = lin(a, f"{p}.wv").view(t, config.num_kv_heads, config.head_dim).transpose(0, 1)
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(config.q_per_kv, 0)
        v = v.repeat_interleave(config.q_per_kv, 0)
        scores = (q @ k.transpose(1, 2)) / config.head_dim**0.5
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, -1)
        x = x + attn @ w[f"{p}.wo.weight"].T
        m = norm(x, w[f"{p}.ffn_norm.weight"])
        x = x + (torch.nn.functional.silu(lin(m, f"{p}.w1")) * lin(m, f"{p}.w3")) @ w[f"{p}.w2.weight"].T
    head = w["embed.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
    return norm(x, w["norm.weight"]) @ head.T
