"""Random but valid GGUF blocks of every type the native kernels read, written by the tests.

Random bytes make valid quants, scales and bit masks in every format; only the float16
fields need care: they are set to finite values of a sensible size (``2^-9`` to ``2^-5``,
either sign), so that products stay far from overflow and zero. No llama.cpp tool runs.
"""

from __future__ import annotations

import numpy as np
import torch

from bargein.kernels.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType
from bargein.kernels.quant_weight import QuantSegment, QuantWeight

T = GGMLQuantizationType
# Where each type keeps its float16 fields, in bytes from its block's start.
F16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q2_K: (80, 82),
    T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_NL: (0,), T.IQ4_XS: (0,),
}
TYPES = tuple(F16_FIELDS)


def random_blocks(qtype: GGMLQuantizationType, rows: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """uint8 (rows, row_bytes): ``rows`` rows of ``k`` values of ``qtype`` blocks."""
    values, nbytes = GGML_QUANT_SIZES[qtype]
    assert k % values == 0
    count = rows * (k // values)
    raw = rng.integers(0, 256, size=(count, nbytes), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        half = (rng.uniform(2.0 ** -9, 2.0 ** -5, size=count) * rng.choice([-1.0, 1.0], size=count)).astype(np.float16)
        raw[:, at:at + 2] = half.view(np.uint8).reshape(count, 2)
    return torch.from_numpy(raw.reshape(rows, k // values * nbytes))


def random_weight(qtype: GGMLQuantizationType, n: int, k: int, rng: np.random.Generator,
                  order: bool = False) -> QuantWeight:
    """A single-segment weight (n, k); with ``order``, rows read through a random permutation."""
    data = random_blocks(qtype, n, k, rng)
    perm = torch.from_numpy(rng.permutation(n)).to(torch.int64) if order else None
    return QuantWeight((QuantSegment(qtype, data, perm),))


def gguf_dequantize(segment: QuantSegment) -> np.ndarray:
    """The segment's rows (in its order) as gguf.quants dequantizes them: float32 (rows, k)."""
    from gguf.quants import dequantize

    data = segment.data.numpy()
    rows = dequantize(data, segment.qtype).reshape(data.shape[0], segment.k)
    return rows if segment.order is None else rows[segment.order.numpy()]
