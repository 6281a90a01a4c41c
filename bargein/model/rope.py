"""Rotary position embeddings in the Hugging Face "rotate half" layout.

The loader normalises GGUF's interleaved Q/K layout to this one, so the model has a
single RoPE convention and ``forward`` never checks where a checkpoint came from.
"""

from __future__ import annotations

import math

import torch

from bargein.config import ModelConfig, RopeScaling


def inverse_frequencies(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """The (head_dim // 2,) inverse frequencies, with Llama 3 scaling where configured.

    ``freq_factors`` (GGUF ``rope_freqs``) divides the frequencies' wavelengths, which is
    how llama.cpp stores Llama 3.1 scaling when the metadata does not describe it.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if config.rope_scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, config.rope_scaling)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float64)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3's piecewise scaling: long wavelengths slowed by ``factor``, short ones kept."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables, indexed by absolute position."""

    def __init__(self, config: ModelConfig, max_positions: int, freq_factors: torch.Tensor | None = None):
        super().__init__()
        inv_freq = inverse_frequencies(config, freq_factors)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # (P, head_dim/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (P, head_dim)
        self.register_buffer("cos", emb.cos().to(torch.float32), persistent=False)
        self.register_buffer("sin", emb.sin().to(torch.float32), persistent=False)

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (T, 1, D) for tokens at ``positions`` (T,); computed once per forward."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q (T, H, D) and k (T, KVH, D) by angles from :meth:`RotaryEmbedding.angles`."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
