"""Parameter counts of a model from its config alone: all of them, and those one token
reads (a mixture of experts reads only its chosen experts' weights)."""

from __future__ import annotations

import math

from bargein.config import ModelConfig
from bargein.loader.names import expected_shape, expert_index, wanted_tensors


def parameter_counts(config: ModelConfig) -> tuple[int, int]:
    """(total, active per token): every canonical tensor's values (embedding and head
    included, a tied head once); active counts ``experts_per_token`` of each MoE layer's
    experts instead of all of them (equal to total for a dense model)."""
    total = unread = 0
    for name in wanted_tensors(config, 0, config.num_layers):
        values = math.prod(expected_shape(config, name) or (0,))
        total += values
        e = expert_index(name)
        if e is not None and config.moe is not None and e >= config.moe.experts_per_token:
            unread += values  # a token reads k experts' worth of each layer's experts
    return total, total - unread


def describe_parameters(config: ModelConfig) -> str:
    """``"2.01 B parameters, 0.41 B active per token"`` (the second part for an MoE only)."""
    total, active = parameter_counts(config)
    text = f"{_count(total)} parameters"
    return text + (f", {_count(active)} active per token" if config.moe is not None else "")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"
