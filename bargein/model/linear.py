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
int8 activations (see :mod:`bargein.kernels.ops`), so no float32 copy is kept beside it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bargein.kernels.block_quant import BlockWeight
from bargein.kernels.ops import TORCH_KERNELS, KernelSet


def _onednn_available(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` for x of shape (T, in_features)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True,
                 kernels: KernelSet = TORCH_KERNELS):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernels = kernels
        self.blocks: BlockWeight | None = kernels.block_form(weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.packed: torch.Tensor | None = None
        self.weight: nn.Parameter | None = nn.Parameter(weight, requires_grad=False)
        if kernels.fast and self.blocks is not None:
            self.weight = None  # the fast forward reads the blocks only, for any number of rows
        elif pack and _onednn_available(weight):
            self.packed = _try_pack(weight, self.bias)
            if self.packed is not None:
                self.weight = None  # the packed copy is all the forward needs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None and (y := self.kernels.block_linear(x, self.blocks)) is not None:
            return y if self.bias is None else y + self.bias
        if self.packed is not None and x.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
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
