"""Weights that may be held in blocks: joining them, and looking rows up from them.

A loaded weight is a dense tensor, a :class:`~bargein.kernels.quant_weight.QuantWeight`
(a GGUF's matrix as its file stores it, over the memory-mapped file, read by
``KernelSet.quant_linear``/``quant_embedding``) or a
:class:`~bargein.kernels.block_quant.BlockWeight` (the Q4/Q8 form found in a dense
weight). The model fuses Q/K/V and gate/up by stacking rows: QuantWeights stack as
segments (no copy, mixed types fine), BlockWeights by stacking their parts. The token
embedding reads only the rows it looks up.

:func:`fast_weight` is how ``fast`` holds a loaded float32 matrix: as 16-bit rows (the
float-source rule of :mod:`bargein.kernels.half_rows`), never re-quantized to int8.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bargein.kernels.block_quant import BlockWeight
from bargein.kernels.half_rows import ROUTING_WEIGHTS, half_rows
from bargein.kernels.ops import TORCH_KERNELS, KernelSet
from bargein.kernels.quant_weight import QuantWeight

Weight = torch.Tensor | BlockWeight | QuantWeight


def fast_weight(name: str, weight: Weight) -> Weight:
    """How ``fast`` holds the loaded weight ``name``: a float32 matrix that a matmul kernel
    reads (every 2-D weight but an MoE's routing rows) as 16-bit rows (:func:`half_rows`:
    F16, or BF16 where F16 cannot hold its values); anything else as it is."""
    if (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype == torch.float32
            and weight.device.type == "cpu" and not name.endswith(ROUTING_WEIGHTS)):
        return half_rows(weight)
    return weight


def dense(weight: Weight) -> torch.Tensor:
    """The weight as a float tensor (a block-held one dequantized, exactly as the file's values)."""
    return weight.dequantize() if isinstance(weight, BlockWeight | QuantWeight) else weight


def cat_rows(parts: Sequence[Weight]) -> Weight:
    """The parts stacked along rows: QuantWeights stay QuantWeights (their segments, no copy),
    blocks stay blocks when all parts are blocks of one width; anything else is dense."""
    first = parts[0]
    if all(isinstance(p, QuantWeight) for p in parts):
        return QuantWeight.cat_rows(parts)  # type: ignore[arg-type]
    if all(isinstance(p, BlockWeight) and p.bits == first.bits and p.shape[1] == first.shape[1] for p in parts):
        blocks: list[BlockWeight] = list(parts)  # type: ignore[arg-type]
        mins = None if first.mins is None else torch.cat([b.mins for b in blocks])  # type: ignore[misc]
        return BlockWeight(first.bits, torch.cat([b.qs for b in blocks]), torch.cat([b.scales for b in blocks]),
                           mins)
    return torch.cat([dense(p) for p in parts])


def select_rows(weight: BlockWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a block-held weight, dequantized: float32 (len(ids), k)."""
    mins = None if weight.mins is None else weight.mins.index_select(0, ids)
    picked = BlockWeight(weight.bits, weight.qs.index_select(0, ids), weight.scales.index_select(0, ids), mins)
    return picked.dequantize()


class TokenEmbedding(nn.Module):
    """Token ids (T,) -> rows of the embedding (T, hidden), from a dense table or from blocks.

    Held in blocks (``blocks``, a BlockWeight, or ``quant``, a QuantWeight), the table costs
    its quantized bytes only; each forward dequantizes just the rows it looks up, to the same
    float32 values a dense table would hold.
    """

    def __init__(self, weight: Weight, kernels: KernelSet = TORCH_KERNELS):
        super().__init__()
        self.kernels = kernels
        self.quant = weight if isinstance(weight, QuantWeight) else None
        self.blocks = weight if isinstance(weight, BlockWeight) else None
        held = self.quant is not None or self.blocks is not None
        self.weight = None if held else nn.Parameter(weight, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.kernels.quant_embedding(self.quant, ids)
        if self.blocks is not None:
            return select_rows(self.blocks, ids)
        return F.embedding(ids, self.weight)
