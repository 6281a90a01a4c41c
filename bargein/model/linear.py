"""Linear layers with the fastest kernel this build of torch offers for the weights' device.

On the CPU in float32, oneDNN can pre-pack a weight into its blocked layout once, at
load time; the packed matmul is 15-60% faster than ``F.linear`` for the small batches of
decoding (measured on 2 AVX2 cores: 32 x 576 -> 3072 in 1.0 ms instead of 1.5 ms, and
the 49152-row LM head at batch 32 in 19 ms instead of 47 ms). The pack is an internal
torch operator, so it is probed once against ``F.linear`` and used only if present and
exact to float32 rounding; everywhere else (CUDA, bf16, other builds) ``F.linear`` runs.

Given the native kernels, a weight that is exactly block-quantized (the GGUF's Q4/Q8
weights, see :mod:`bargein.kernels.block_quant`) is also kept in that compact form, and
forwards of at most :data:`~bargein.kernels.ops.BLOCK_KERNEL_MAX_ROWS` rows read it instead: decoding a few
sequences is bound by reading the weights, which are then 3.6-5.3x fewer bytes (measured
on 2 AVX2 cores over every linear of SmolLM2-135M, against the packed float32 matmul:
2.5x as fast at 1 row, 1.7x at 8, 1.16x at 12, even at 16 and 0.72x at 32 rows).

In the ``fast`` precision every forward, of any number of rows, reads the block form with
int8 activations (see :mod:`bargein.kernels.ops`), so no float32 copy is kept beside it; a
dense weight without an exact block form is a float source, held as 16-bit rows
(:func:`~bargein.kernels.half_rows.half_rows`, read by ``KernelSet.quant_linear`` against
float32 activations), never re-quantized to int8.
In ``exact``, a layer built :meth:`Linear.from_blocks` (a GGUF's stored blocks) holds no
float32 copy unless asked to (``keep_fp32``, off by default): every forward, of any number
of rows, reads the blocks with float32 activations, and the weights take their quantized
size in memory instead of 4 bytes a value.

A layer built :meth:`Linear.from_quant` holds a GGUF matrix of any block type as the file
stores it (a :class:`~bargein.kernels.quant_weight.QuantWeight`, usually a view of the
mapped file) and nothing else, in both precisions: ``KernelSet.quant_linear`` reads it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bargein.kernels.block_quant import BlockWeight
from bargein.kernels.half_rows import half_rows
from bargein.kernels.ops import TORCH_KERNELS, KernelSet
from bargein.kernels.quant_weight import QuantWeight


def _onednn_available(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` for x of shape (T, in_features)."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None, *, pack: bool = True,
                 kernels: KernelSet = TORCH_KERNELS, blocks: BlockWeight | None = None,
                 quant: QuantWeight | None = None):
        """``weight`` dense (its block form is looked for, given native kernels), or None
        with ``blocks`` or ``quant`` given: see :meth:`from_blocks`, :meth:`from_quant`."""
        super().__init__()
        if weight is None and quant is None and (blocks is None or kernels.native is None):
            raise ValueError("a Linear without a dense weight needs blocks and the native kernels to read them")
        held = weight if weight is not None else quant if quant is not None else blocks
        self.out_features, self.in_features = held.shape
        self.kernels = kernels
        self.quant = quant
        self.blocks: BlockWeight | None = (blocks if blocks is not None or weight is None
                                           else kernels.block_form(weight))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.packed: torch.Tensor | None = None
        self.weight: nn.Parameter | None = None if weight is None else nn.Parameter(weight, requires_grad=False)
        if kernels.fast and self.blocks is None and self.quant is None and weight is not None \
                and weight.device.type == "cpu" and weight.dim() == 2:
            self.quant = half_rows(weight)  # a float source: 16-bit rows, never int8 (the one rule)
        if kernels.fast and (self.blocks is not None or self.quant is not None):
            self.weight = None  # the fast forward reads the blocks or rows only, for any number of rows
        elif weight is not None and pack and _onednn_available(weight):
            self.packed = _try_pack(weight, self.bias)
            if self.packed is not None:
                self.weight = None  # the packed copy is all the forward needs

    @classmethod
    def from_blocks(cls, blocks: BlockWeight, bias: torch.Tensor | None = None, *, keep_fp32: bool,
                    kernels: KernelSet) -> Linear:
        """A layer over a block-held weight (float32 CPU model).

        Without ``keep_fp32`` the blocks are all it holds, and every forward reads them
        through the native block matmul. With ``keep_fp32``, or without native kernels
        (nothing could read the blocks), the weight is dequantized once, here, and held
        as a dense layer would hold it; the blocks are kept beside it only where the
        native kernels read them for few rows.
        """
        if (keep_fp32 and not kernels.fast) or kernels.native is None:
            return cls(blocks.dequantize(), bias, kernels=kernels,
                       blocks=blocks if kernels.native is not None else None)
        return cls(None, bias, kernels=kernels, blocks=blocks)

    @classmethod
    def from_quant(cls, weight: QuantWeight, bias: torch.Tensor | None = None, *, kernels: KernelSet) -> Linear:
        """A layer over a file's blocks of any type (float32 CPU model): the QuantWeight is all
        it holds, in both precisions; every forward reads it through ``kernels.quant_linear``."""
        return cls(None, bias, kernels=kernels, quant=weight)

    @property
    def holds_dense(self) -> bool:
        """Whether a float32 (plain or packed) copy of the weight is held."""
        return self.weight is not None or self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            y = self.kernels.quant_linear(x, self.quant)
            return y if self.bias is None else y + self.bias
        if self.blocks is not None and (y := self.kernels.block_linear(x, self.blocks)) is not None:
            return y if self.bias is None else y + self.bias
        if self.packed is not None and x.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.weight is None and self.packed is None and self.kernels.native is not None:
            # Blocks only: they are read for any number of rows.
            y = self.kernels.native.block_matmul(x.contiguous(), self.blocks, torch.get_num_threads())
            return y if self.bias is None else y + self.bias
        if self.weight is None:
            raise RuntimeError("this layer holds its weight for float32 CPU inputs only")
        return F.linear(x, self.weight, self.bias)


def _try_pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The oneDNN-packed weight, or None if this torch cannot pack it exactly."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
        want = F.linear(probe, weight, bias)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    tolerance = 1e-4 * (1 + want.abs().max().item())
    return packed if (got - want).abs().max().item() <= tolerance else None
