"""Float-source weights as 16-bit rows: how a matrix stored in a float format is held.

The rule (one place, this module; see docs/families.md "Float-source weights"): a matrix
whose source is a float format (safetensors F32/F16/BF16, GGUF F32/F16/BF16) is never
re-quantized to int8 blocks. It is held as rows of 16-bit floats, a
:class:`~bargein.kernels.quant_weight.QuantWeight` of GGML type F16 or BF16, which
half_matmul.c multiplies by float32 activations in both precisions (one fixed fma chain,
the same bits for any row count, thread count and instruction set).

- An F16 or BF16 source stays as it is stored: :func:`half_rows` of such a tensor is a view
  of its bytes (usually of the mapped file), never widened, never copied. The loaders make
  these, in both precisions.
- A float32 source is narrowed once, in ``fast`` only (``exact`` computes in float32 from
  the stored values): to F16 where that is lossless, else BF16 where that is lossless (a
  BF16 source widened on its way here, e.g. shipped to a pipeline stage), else F16 where
  every value is finite and within float16's range, else BF16 (which keeps float32's range).
  :func:`narrowed_type` says which; the caller logs the memory it takes.

Quantized GGUF blocks (Q4_K, Q8_0, ...) are not float sources and keep their own kernels.
"""

from __future__ import annotations

import torch

from bargein.kernels.ggml_types import GGMLQuantizationType
from bargein.kernels.quant_weight import QuantWeight

F16 = GGMLQuantizationType.F16
BF16 = GGMLQuantizationType.BF16
HALF_DTYPES = {torch.float16: F16, torch.bfloat16: BF16}
_TORCH_DTYPE = {F16: torch.float16, BF16: torch.bfloat16}
F16_MAX = 65504.0  # the largest finite float16
# An MoE layer's routing rows (canonical name suffixes): float32 logits that choose experts,
# read as stored by the routing kernel, not a matmul's weight; the rule leaves them float32.
ROUTING_WEIGHTS = ("router.weight", "shared_gate.weight")


def narrowed_type(weight: torch.Tensor) -> GGMLQuantizationType:
    """The 16-bit type a float32 matrix is narrowed to (see the module docstring's order)."""
    as_f16 = weight.to(torch.float16)
    if torch.equal(as_f16.float(), weight):
        return F16
    if torch.equal(weight.to(torch.bfloat16).float(), weight):
        return BF16
    finite = bool(torch.isfinite(weight).all())
    return F16 if finite and float(weight.abs().max()) <= F16_MAX else BF16


def half_rows(weight: torch.Tensor) -> QuantWeight:
    """``weight`` (n, k), float16, bfloat16 or float32 on the CPU, as 16-bit rows.

    A float16 or bfloat16 tensor is viewed as it is (no copy where it is contiguous: a view
    of a mapped file stays one, read-only); a float32 one is narrowed to
    :func:`narrowed_type`'s type, a new tensor of half its bytes."""
    if weight.dim() != 2:
        raise ValueError(f"16-bit rows are a matrix's; got shape {tuple(weight.shape)}")
    if weight.dtype == torch.float32:
        weight = weight.to(_TORCH_DTYPE[narrowed_type(weight)])
    qtype = HALF_DTYPES.get(weight.dtype)
    if qtype is None:
        raise ValueError(f"16-bit rows are made from float16, bfloat16 or float32, not {weight.dtype}")
    n, k = weight.shape
    data = weight.contiguous().view(torch.uint8)  # (n, 2k): each row's values as the file stores them
    return QuantWeight.of(qtype, data, n, k)


def is_half(weight: object) -> bool:
    """Whether ``weight`` is held as 16-bit rows (a QuantWeight of F16/BF16 segments only)."""
    return isinstance(weight, QuantWeight) and weight.qtypes <= {F16, BF16}
