"""Weights that may be held in blocks: joining them, and looking rows up from them.

A loaded weight is a dense tensor, a :class:`~bargein.kernels.quant_weight.QuantWeight`
(a GGUF's matrix as its file stores it, over the memory-mapped file) or a
:class:`~bargein.kernels.block_quant.BlockWeight` (the Q4_1/Q8_0 form that today's
native ``block_matmul``/``fast_forward`` read). The model fuses Q/K/V and gate/up by
stacking rows: QuantWeights stack as segments (no copy, mixed types fine), BlockWeights
by stacking their parts. The token embedding reads only the rows it looks up.

Bridge (until the per-type kernels read QuantWeights in ``fast_forward.c`` and
``block_matmul``'s place): :func:`bridged` turns a QuantWeight made only of Q4_1 or only
of Q8_0 blocks into the BlockWeight those kernels read, so the bundled model computes
exactly as before (a private copy of its blocks, as before). Every other type stays a
QuantWeight and is read through ``KernelSet.quant_linear``/``quant_embedding``. Removing
:data:`BRIDGED_TYPES` (the kernels' side landed) removes the bridge.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bargein.kernels.block_quant import BLOCK, BlockWeight
from bargein.kernels.ggml_types import GGMLQuantizationType
from bargein.kernels.ops import TORCH_KERNELS, KernelSet
from bargein.kernels.quant_weight import QuantWeight

Weight = torch.Tensor | BlockWeight | QuantWeight

# The QuantWeight types handed to the BlockWeight kernels (see the module docstring): bits
# of the BlockWeight, and the bytes of a block's header (f16 d, and m for Q4_1).
BRIDGED_TYPES = {GGMLQuantizationType.Q4_1: (4, 4), GGMLQuantizationType.Q8_0: (8, 2)}


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


def bridged(weight: Weight, kernels: KernelSet) -> Weight:
    """``weight`` as the BlockWeight today's native kernels read, where it is a QuantWeight of
    one bridged type and those kernels are there (see the module docstring); else itself."""
    if not isinstance(weight, QuantWeight) or kernels.native is None or len(weight.qtypes) != 1:
        return weight
    (qtype,) = weight.qtypes
    if qtype not in BRIDGED_TYPES:
        return weight
    bits, header = BRIDGED_TYPES[qtype]
    n, k = weight.shape
    # Rows in the model's order (a Q/K segment's order applied), blocks of 32 along each.
    data = torch.cat([s.data.index_select(0, s.stored_rows()) if s.order is not None else s.data
                      for s in weight.segments]).view(n, k // BLOCK, -1)
    scales = data[..., 0:2].contiguous().view(torch.float16).float().view(n, k // BLOCK)
    if bits == 4:
        mins = data[..., 2:4].contiguous().view(torch.float16).float().view(n, k // BLOCK)
        return BlockWeight(4, data[..., header:].contiguous(), scales, mins)
    return BlockWeight(8, data[..., header:].contiguous().view(torch.int8), scales, None)


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
