"""Which layers each pipeline stage holds: parsed by hand, or split by node memory.

Pure functions, no Ray: a split is a tuple of half-open layer ranges that cover
``[0, num_layers)`` in order, each non-empty.

The automatic split gives each stage work in proportion to its node's memory (the
measure of a node's size Ray reports), and the last stage's work includes the LM head:
a (vocabulary x hidden) matmul per sampled row, worth 6 of SmolLM2's 30 layers. Split
by layer count alone, two equal nodes measured 37 and 52 ms per 16-row step, and the
first stage idled a third of the time waiting for the second.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from bargein.config import ModelConfig
from bargein.loader.names import expected_shape, wanted_tensors

LayerRanges = tuple[tuple[int, int], ...]


class PipelineSetupError(Exception):
    """A pipeline that cannot be set up as asked; the message says why in one line."""


def parse_stage_layers(text: str) -> LayerRanges:
    """``"0-10,10-20,20-30"`` -> ((0, 10), (10, 20), (20, 30)); ranges are half-open."""
    ranges = []
    for part in text.split(","):
        start, sep, end = part.strip().partition("-")
        if not sep or not start.strip().isdigit() or not end.strip().isdigit():
            raise PipelineSetupError(f"--stage-layers: {part.strip()!r} is not a range like 0-10")
        ranges.append((int(start), int(end)))
    return tuple(ranges)


def check_split(ranges: Sequence[tuple[int, int]], num_layers: int) -> LayerRanges:
    """Returns ``ranges`` if they cover ``[0, num_layers)`` in order without gaps or overlaps."""
    expected = 0
    for start, end in ranges:
        if start != expected or end <= start:
            raise PipelineSetupError(
                f"the stage layers {_fmt(ranges)} do not cover the model's {num_layers} layers in order "
                f"(a stage must start at layer {expected} and hold at least one layer)")
        expected = end
    if expected != num_layers:
        raise PipelineSetupError(f"the stage layers {_fmt(ranges)} end at layer {expected}, "
                                 f"but the model has {num_layers} layers")
    return tuple((s, e) for s, e in ranges)


def split_by_memory(num_layers: int, memories: Sequence[float], head_layers: float = 0.0) -> LayerRanges:
    """Consecutive ranges, one per stage, with each stage's work in proportion to its
    memory: its layers, plus ``head_layers`` layers' worth for the last stage (the LM
    head, see :func:`head_layers`). Largest remainder; every stage gets at least one layer."""
    n = len(memories)
    if n > num_layers:
        raise PipelineSetupError(f"{n} stages were asked for, but the model has only {num_layers} layers")
    total = float(sum(memories))
    if total <= 0:
        raise PipelineSetupError("the nodes report no memory to split the layers by")
    work = num_layers + head_layers
    quotas = [work * m / total for m in memories]
    quotas[-1] -= head_layers
    counts = [max(1, math.floor(q)) for q in quotas]
    while sum(counts) > num_layers:  # the minimum of one pushed us over: take from the most over quota
        i = max((i for i in range(n) if counts[i] > 1), key=lambda i: counts[i] - quotas[i])
        counts[i] -= 1
    while sum(counts) < num_layers:
        i = max(range(n), key=lambda i: quotas[i] - counts[i])
        counts[i] += 1
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return tuple(ranges)


# A layer's work besides its matrices (attention, norms, RoPE, the K/V write) as a share of
# its matrices' multiply-adds: measured on SmolLM2 at 16 decode rows and 1 thread, a layer
# took 2.56 ms and the LM head 15.2 ms, 6 layers' worth where its multiply-adds are 8.
_LAYER_OTHER_WORK = 1 / 3


def head_layers(config: ModelConfig) -> float:
    """The LM head's work per row in layers' worth: its multiply-adds over one layer's
    (Q, K, V, O and the three feed-forward matrices, plus the rest of a layer's work)."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layer = (h * (2 * q + 2 * kv) + 3 * h * config.intermediate_size) * (1 + _LAYER_OTHER_WORK)
    return config.vocab_size * h / layer


def stage_weight_bytes(config: ModelConfig, layer_range: tuple[int, int], element_size: int) -> int:
    """Bytes the stage's weights take once loaded at ``element_size`` bytes per value."""
    total = 0
    for name in wanted_tensors(config, *layer_range):
        shape = expected_shape(config, name) or ()
        total += math.prod(shape) * element_size
    return total


def _fmt(ranges: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{s}-{e}" for s, e in ranges)
