"""Rotary position embeddings in the Hugging Face "rotate half" layout.

The loader normalises GGUF's interleaved Q/K layout to this one, so the model has a
single RoPE convention and ``forward`` never checks where a checkpoint came from.

Partial rotary (``ModelConfig.rotary_dim`` r < head_dim D, Phi-4-mini): the loader also
reorders each head of Q and K to [rotated first half (r/2), passed first half, rotated
second half (r/2), passed second half], so that "rotate half" over the whole head pairs
the same dimensions the model pairs; the tables here then hold cos 1 and sin 0 for the
passed dimensions, which leaves them exactly as they were. The attention's dot products
are unchanged by one permutation applied to both Q and K.
"""

from __future__ import annotations

import math

import torch

from bargein.config import ModelConfig, RopeScaling


def inverse_frequencies(config: ModelConfig, freq_factors: torch.Tensor | None = None, *,
                        local: bool = False, max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """The (rotary_dim // 2,) inverse frequencies and the factor cos and sin are multiplied by.

    ``freq_factors`` (GGUF ``rope_freqs``) divides the frequencies' wavelengths, which is
    how llama.cpp stores Llama 3.1 scaling when the metadata does not describe it.
    ``local``: the frequencies of a sliding-window layer, with ``local_rope_theta`` and no
    scaling (Gemma 3). ``max_positions``: the context served, which picks LongRoPE's
    long factors where it exceeds the original context (as llama.cpp picks them).
    """
    dim = config.rotary_dim or config.head_dim
    theta = config.local_rope_theta if local and config.local_rope_theta is not None else config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    inv_freq = 1.0 / (theta ** exponents)
    scaling = None if local and config.local_rope_theta is not None else config.rope_scaling
    attention_factor = 1.0
    if scaling is not None:
        if scaling.kind == "llama3":
            inv_freq = _llama3_scaled(inv_freq, scaling)
        elif scaling.kind == "linear":
            inv_freq = inv_freq / scaling.factor
        elif scaling.kind == "yarn":
            inv_freq, attention_factor = _yarn(inv_freq, scaling, dim, theta)
        else:
            inv_freq, attention_factor = _longrope(theta, exponents, scaling, config,
                                                   max_positions or config.max_position_embeddings)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float64)
    return inv_freq, attention_factor


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


def _yarn(inv_freq: torch.Tensor, s: RopeScaling, dim: int, theta: float) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context
    are interpolated (divided by ``factor``), more than ``beta_fast`` times kept, a linear
    ramp between; cos and sin grow by 0.1 ln(factor) + 1."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the frequency as it is), 0: interpolate
    scaled = inv_freq / s.factor * (1 - keep) + inv_freq * keep
    factor = s.attention_factor if s.attention_factor is not None else (
        0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0)
    return scaled, factor


def _longrope(theta: float, exponents: torch.Tensor, s: RopeScaling, config: ModelConfig,
              max_positions: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3/4): each frequency divided by its own factor, the long ones where the
    served context is longer than the original; cos and sin grow by
    sqrt(1 + ln(factor) / ln(original context)), factor = context / original context."""
    original = s.original_max_position_embeddings
    factors = s.long_factor if max_positions > original else s.short_factor
    if len(factors) != exponents.numel():
        raise ValueError(f"LongRoPE needs {exponents.numel()} factors per list; got {len(factors)}")
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float64) * theta ** exponents)
    if s.attention_factor is not None:
        return inv_freq, s.attention_factor
    factor = config.max_position_embeddings / original
    return inv_freq, math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0


def rotary_tables(config: ModelConfig, max_positions: int, freq_factors: torch.Tensor | None = None, *,
                  local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (max_positions, head_dim) float32 in the model's layout (see the module docstring)."""
    inv_freq, attention_factor = inverse_frequencies(config, freq_factors, local=local, max_positions=max_positions)
    passed = (config.head_dim - inv_freq.numel() * 2) // 2
    t = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)  # (P, rotary_dim / 2)
    cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
    if passed:
        ones, zeros = torch.ones(max_positions, passed, dtype=torch.float64), torch.zeros(max_positions, passed,
                                                                                          dtype=torch.float64)
        cos, sin = torch.cat([cos, ones], dim=-1), torch.cat([sin, zeros], dim=-1)
    return torch.cat([cos, cos], dim=-1).to(torch.float32), torch.cat([sin, sin], dim=-1).to(torch.float32)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables, indexed by absolute position."""

    def __init__(self, config: ModelConfig, max_positions: int, freq_factors: torch.Tensor | None = None, *,
                 local: bool = False):
        super().__init__()
        cos, sin = rotary_tables(config, max_positions, freq_factors, local=local)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

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
