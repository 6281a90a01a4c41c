"""Weights that may be held in blocks: joining them, and looking rows up from them.

A loaded weight is either a dense tensor or a :class:`~bargein.kernels.block_quant.BlockWeight`
(a GGUF's Q4_1/Q8_0 matrix as stored). The model fuses Q/K/V and gate/up by stacking rows,
which for blocks is stacking the rows of their parts (blocks run along a row); the token
embedding reads only the rows it looks up, widened to float32 there and then.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bargein.kernels.block_quant import BlockWeight

Weight = torch.Tensor | BlockWeight


def dense(weight: Weight) -> torch.Tensor:
    """The weight as a float tensor (a block-held one dequantized, exactly as the file's values)."""
    return weight.dequantize() if isinstance(weight, BlockWeight) else weight


def cat_rows(parts: Sequence[Weight]) -> Weight:
    """The parts stacked along rows: blocks stay blocks when all parts are blocks of one width."""
    first = parts[0]
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

    Held in blocks, the table costs its quantized bytes only; each forward dequantizes
    just the rows it looks up, to the same float32 values a dense table would hold.
    """

    def __init__(self, weight: Weight):
        super().__init__()
        self.blocks = weight if isinstance(weight, BlockWeight) else None
        self.weight = None if self.blocks is not None else nn.Parameter(weight, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            return select_rows(self.blocks, ids)
        return F.embedding(ids, self.weight)
