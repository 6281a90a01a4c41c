"""Weights that are exactly block-quantized, found and held in their compact form.

A GGUF file's Q4_1 and Q8_0 weights arrive dequantized to float32, but every block of
32 values along a row still lies on a small lattice: ``scale * q + min`` with ``q`` in
0..15 (Q4_1 uses both ends), or ``scale * q`` with ``q`` in -127..127 (Q8_0 uses
``|q| = 127``). :func:`recover_blocks` finds that lattice again from each block's
extremes and keeps ``q`` in 4 or 8 bits, a fifth or a quarter of the float32
bytes, for the native matmul (``block_matmul.c`` beside this module) to read when a forward
has few rows and the weights' memory traffic is what costs.

Nothing is approximated: a weight is taken only if every block's values are rebuilt
from the lattice to float32 rounding; otherwise (a float32 or bf16 checkpoint, say)
the answer is None and the weight stays float32 only. Formats whose blocks need not
reach both ends of their range (Q4_0, the K-quants) are, as a rule, not recovered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

BLOCK = 32
_EPS = torch.finfo(torch.float32).eps
_CHUNK_VALUES = 1 << 20  # values per row chunk checked at a time


@dataclass(frozen=True)
class BlockWeight:
    """W (n, k) in blocks of 32 along k: ``W[j, 32b + i] = scales[j, b] * q + mins[j, b]``.

    4 bits: ``qs`` is uint8 (n, k/32, 16), byte i holding element i in its low nibble
    and element i + 16 in its high one; ``mins`` is float32 (n, k/32).
    8 bits: ``qs`` is int8 (n, k/32, 32) and there are no mins.
    """

    bits: int
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins) if t is not None)

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        if self.bits == 4:
            q = torch.cat([self.qs & 0x0F, self.qs >> 4], dim=-1).float()  # (n, k/32, 32)
            return (q * self.scales.unsqueeze(-1) + self.mins.unsqueeze(-1)).view(n, k)
        return (self.qs.float() * self.scales.unsqueeze(-1)).view(n, k)


def quantize_8bit(weight: torch.Tensor) -> BlockWeight | None:
    """``weight`` rounded to 8-bit blocks (llama.cpp's Q8_0: scale = max|w| / 127, one per 32
    values); None when its rows are not made of whole blocks. The model no longer uses it
    (``fast`` holds a float weight as 16-bit rows, bargein.kernels.half_rows): the kernel
    tests and benches make Q8 BlockWeights with it.

    Unlike :func:`recover_blocks` this approximates: each value moves by at most half its
    block's scale.
    """
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % BLOCK or weight.numel() == 0:
        return None
    blocks = weight.detach().reshape(weight.shape[0], -1, BLOCK)
    scales = blocks.abs().amax(-1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    q = (blocks / safe).round_().clamp_(-127, 127).to(torch.int8)
    return BlockWeight(8, q, scales.contiguous(), None)


def recover_blocks(weight: torch.Tensor) -> BlockWeight | None:
    """The 4-bit, else the 8-bit, block form of ``weight``, if it has one exactly; else None."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % BLOCK or weight.numel() == 0:
        return None
    blocks = weight.detach().reshape(weight.shape[0], -1, BLOCK)
    return _recover(blocks, _recover_4bit, 4) or _recover(blocks, _recover_8bit, 8)


_Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _recover(blocks: torch.Tensor, recover_rows: Callable[[torch.Tensor], _Parts | None],
             bits: int) -> BlockWeight | None:
    """Row chunk by row chunk (a few MB each, so that the passes stay in cache), giving
    up at the first chunk off the lattice: a float32 weight costs one chunk, not all."""
    rows = max(1, _CHUNK_VALUES // (blocks.shape[1] * BLOCK))
    parts = []
    for start in range(0, blocks.shape[0], rows):
        part = recover_rows(blocks[start:start + rows])
        if part is None:
            return None
        parts.append(part)
    qs, scales, mins = (None if p[0] is None else torch.cat(p) for p in zip(*parts, strict=True))
    return BlockWeight(bits, qs, scales, mins)


def _recover_4bit(blocks: torch.Tensor) -> _Parts | None:
    low, high = blocks.amin(-1), blocks.amax(-1)
    scales = (high - low) / 15
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    q = ((blocks - low.unsqueeze(-1)) / safe).round_().clamp_(0, 15)
    rebuilt = q * scales.unsqueeze(-1) + low.unsqueeze(-1)
    tolerance = 8 * _EPS * (low.abs() + 15 * scales).unsqueeze(-1) + 1e-30
    if not bool(((rebuilt - blocks).abs() <= tolerance).all()):
        return None
    q = q.to(torch.uint8)
    return (q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)), scales, low


def _recover_8bit(blocks: torch.Tensor) -> _Parts | None:
    scales = blocks.abs().amax(-1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    q = (blocks / safe).round_().clamp_(-127, 127)
    rebuilt = q * scales.unsqueeze(-1)
    tolerance = 8 * _EPS * 127 * scales.unsqueeze(-1) + 1e-30
    if not bool(((rebuilt - blocks).abs() <= tolerance).all()):
        return None
    return q.to(torch.int8), scales, None
