"""Which layers each pipeline stage holds: parsed by hand, or split by node memory.

Pure functions, no Ray: a split is a tuple of half-open layer ranges that cover
``[0, num_layers)`` in order, each non-empty.
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


def split_by_memory(num_layers: int, memories: Sequence[float]) -> LayerRanges:
    """Consecutive ranges, one per stage, with layers in proportion to each stage's memory
    (largest remainder; every stage gets at least one layer)."""
    n = len(memories)
    if n > num_layers:
        raise PipelineSetupError(f"{n} stages were asked for, but the model has only {num_layers} layers")
    total = float(sum(memories))
    if total <= 0:
        raise PipelineSetupError("the nodes report no memory to split the layers by")
    quotas = [num_layers * m / total for m in memories]
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


def stage_weight_bytes(config: ModelConfig, layer_range: tuple[int, int], element_size: int) -> int:
    """Bytes the stage's weights take once loaded at ``element_size`` bytes per value."""
    total = 0
    for name in wanted_tensors(config, *layer_range):
        shape = expected_shape(config, name) or ()
        total += math.prod(shape) * element_size
    return total


def _fmt(ranges: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{s}-{e}" for s, e in ranges)
