"""Which layers each pipeline stage holds: parsed by hand, or split by node memory and speed.

Pure functions, no Ray, no file reads: a split is a tuple of half-open layer ranges
that cover ``[0, num_layers)`` in order, each non-empty.

The automatic split gives each stage work in proportion to its node's memory (the
measure of a node's size Ray reports) times its node's speed factor (:func:`speed_factors`:
1 for a node within :data:`SLOW_NODE` of the fastest, its relative speed below that, so
only a clearly slower machine gets fewer layers and measurement noise between equal
machines changes nothing), and the last stage's work includes the LM head:
a (vocabulary x hidden) matmul per sampled row. A matrix costs the bytes the stage
reads for it per row (:class:`MatrixWidths`: a GGUF's Q4_1 and Q8_0 blocks in ``fast``,
dense values otherwise). For the bundled SmolLM2-135M (30 layers; layer matrices Q4_1
at 0.625 bytes a value, the tied head Q8_0 at 1.0625) the head is worth 10.2 layers in
``fast`` and 6.0 in ``exact``, which reads float32 copies of every matrix. Measured
(2 stages of 1 thread, ``fast``, one machine; each stage's compute per plan, ms, stage
0 / stage 1): layers 0-18 / 18-30 (the head counted as 6 layers) took 3.77 / 5.17 at
1 stream and 26.4 / 33.2 at 32; 0-20 / 20-30 (as 10.2) took 4.07 / 4.37 and 28.6 / 28.5;
0-21 / 21-30 took 4.22 / 4.56 and 30.4 / 28.7. Split by layer count alone, two equal
nodes (earlier, float32 weights) measured 37 and 52 ms per 16-row step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bargein.config import ModelConfig
from bargein.distributed.errors import PipelineSetupError
from bargein.loader.names import expected_shape, wanted_tensors

LayerRanges = tuple[tuple[int, int], ...]




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


SLOW_NODE = 1 / 2  # a node measured slower than this share of the fastest gets fewer layers


def speed_factors(rates: Sequence[float]) -> list[float]:
    """Each node's weight for its measured rate (see the module doc); no rates: all 1."""
    fastest = max(rates, default=0.0)
    if fastest <= 0:
        return [1.0] * len(rates)
    return [1.0 if r / fastest >= SLOW_NODE else max(r / fastest, 0.01) for r in rates]


def split_reason(addresses: Sequence[str], memories: Sequence[float], rates: Sequence[float] | None) -> str:
    """One line saying what the automatic split weighed: each stage's node, its memory share
    and, where measured (``rates``: the calibration's layers per second), its speed and
    the factor :func:`speed_factors` made of it."""
    factors = speed_factors(rates) if rates is not None else None
    parts = []
    for i, (address, memory) in enumerate(zip(addresses, memories, strict=True)):
        part = f"{address} {memory / 2**20:.0f} MiB"
        if rates is not None and factors is not None:
            part += f" {rates[i]:.0f} layers/s x{factors[i]:.2f}"
        parts.append(part)
    what = "memory and measured speed" if rates is not None else "memory"
    return f"by {what}: " + ", ".join(parts)


# A layer's work besides its matrices (attention, norms, RoPE, the K/V write) as a share of
# its matrices' cost. First measured on SmolLM2 with float32 weights (16 decode rows, 1
# thread: a layer 2.56 ms, the LM head 15.2 ms, 6 layers' worth where its multiply-adds
# are 8). Checked again in ``fast`` (the module docstring's runs): a layer's matrices read
# 2.2 MB of Q4_1 blocks, the head 30.1 MB of Q8_0, 13.6 times as much; over 4/3 that is
# 10.2 layers, and 0-20 / 20-30 was the balanced split at 1 and at 32 streams.
_LAYER_OTHER_WORK = 1 / 3

# A layer's matrices (canonical suffixes, see bargein.loader.names).
LAYER_MATRICES = ("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight")


@dataclass(frozen=True)
class MatrixWidths:
    """Bytes per value of each weight matrix as a stage reads it: the matrix's cost in the split.

    ``stored``: canonical name (``layers.{i}.wq.weight``, ``embed.weight``, ...) -> bytes
    per value of the matrices a stage computes from as the file stores them (a GGUF's
    Q4_1 blocks: 0.625, Q8_0: 1.0625). Every other matrix is read dense, ``dense`` bytes
    a value; with ``stored`` empty only the matrices' sizes matter (multiply-adds).
    """

    stored: Mapping[str, float] = field(default_factory=dict)
    dense: float = 4.0

    def of(self, name: str) -> float:
        return self.stored.get(name, self.dense)


def layer_matrices(config: ModelConfig, layer: int) -> tuple[str, ...]:
    """Layer ``layer``'s matrices (canonical names): Q, K, V, O and the MLP's three, or for a
    mixture-of-experts layer its router, every expert's three and a shared expert's: an MoE
    layer is weighed by all its bytes, as its memory is (the experts dominate it)."""
    if config.moe is None or not config.moe.is_sparse(layer):
        return tuple(f"layers.{layer}.{m}" for m in LAYER_MATRICES)
    prefix = f"layers.{layer}."
    return tuple(n for n in wanted_tensors(config, layer, layer + 1)
                 if n.startswith(prefix) and len(expected_shape(config, n) or ()) == 2)


def head_layers(config: ModelConfig, widths: MatrixWidths = MatrixWidths()) -> float:
    """The LM head's work per row in layers' worth: the bytes the stage reads for it over
    those of an average layer's matrices (:func:`layer_matrices`),
    times 1 + ``_LAYER_OTHER_WORK`` for the rest of a layer's work. The head is
    ``embed.weight`` when tied to the embedding, else ``lm_head.weight``."""
    layer_bytes = sum(math.prod(expected_shape(config, m) or ()) * widths.of(m)
                      for i in range(config.num_layers) for m in layer_matrices(config, i)) / config.num_layers
    head = "embed.weight" if config.tie_word_embeddings else "lm_head.weight"
    head_bytes = config.vocab_size * config.hidden_size * widths.of(head)
    return head_bytes / (layer_bytes * (1 + _LAYER_OTHER_WORK))


def stage_weight_bytes(config: ModelConfig, layer_range: tuple[int, int], element_size: int) -> int:
    """Bytes the stage's weights take once loaded at ``element_size`` bytes per value."""
    total = 0
    for name in wanted_tensors(config, *layer_range):
        shape = expected_shape(config, name) or ()
        total += math.prod(shape) * element_size
    return total


def _fmt(ranges: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{s}-{e}" for s, e in ranges)
