"""A weight matrix held as a GGUF file's own blocks, read in place by the kernels.

This is the one weight type the per-type kernels read (the contract between the loader,
which makes these from a memory-mapped file, the model, which holds them in its layers,
and the kernels, which multiply by them). A :class:`QuantWeight` W of shape (n, k) is
the concatenation, along rows, of one or more :class:`QuantSegment` s: a fused Q/K/V or
gate/up matrix is its parts' segments one after another, never a copy, and the parts
may be of different block types (Q4_K_M files mix Q4_K and Q6_K in one layer).

A segment's ``data`` is a uint8 tensor (stored rows, bytes per row) of whole blocks
along each row, exactly as the file stores them; it may be a read-only view of a mapped
file, so nothing may write to it. ``order`` names, for each row of the segment as the
model sees it, the stored row it reads: this is how the Q/K rows that llama.cpp's
converter permuted are put back without a second copy of the matrix.

Everything here is plain data plus reference arithmetic in PyTorch (dequantize, then
multiply), which defines the values; the native kernels (:mod:`bargein.kernels.ops`)
compute the same products without widening the weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bargein.kernels.dequant import DEQUANTIZERS
from bargein.kernels.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType

# The block types a QuantWeight may hold: those with a dequantizer (the reference).
QUANT_TYPES = frozenset(DEQUANTIZERS)


@dataclass(frozen=True)
class QuantSegment:
    """Rows of one stored tensor, in its block format. See the module docstring."""

    qtype: GGMLQuantizationType
    data: torch.Tensor  # uint8 (stored_rows, row_bytes); possibly a read-only view of a mapped file
    order: torch.Tensor | None = None  # int64 (rows,): row i reads stored row order[i]; None: row i

    def __post_init__(self) -> None:
        if self.qtype not in QUANT_TYPES:
            raise ValueError(f"no block kernels for GGML type {GGMLQuantizationType(self.qtype).name}")
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError("a segment's data is a uint8 (rows, row_bytes) tensor")
        if self.data.shape[1] % GGML_QUANT_SIZES[self.qtype][1]:
            raise ValueError("a segment's rows are whole blocks")
        if self.order is not None and (self.order.dtype != torch.int64 or self.order.dim() != 1):
            raise ValueError("a segment's order is an int64 vector")

    @property
    def rows(self) -> int:
        return self.data.shape[0] if self.order is None else self.order.shape[0]

    @property
    def k(self) -> int:
        values, nbytes = GGML_QUANT_SIZES[self.qtype]
        return self.data.shape[1] // nbytes * values

    def stored_rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The stored row indices of rows ``ids`` (all rows when None), as int64."""
        order = self.order if self.order is not None else torch.arange(self.data.shape[0])
        return order if ids is None else order.index_select(0, ids)

    def dequantize_rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` (all when None) as float32 (len, k): the reference values."""
        picked = self.data.index_select(0, self.stored_rows(ids))
        values, nbytes = GGML_QUANT_SIZES[self.qtype]
        blocks = picked.reshape(-1, nbytes)
        return DEQUANTIZERS[self.qtype](blocks).reshape(picked.shape[0], self.k)


@dataclass(frozen=True)
class QuantWeight:
    """W (n, k): its segments' rows, one segment after another."""

    segments: tuple[QuantSegment, ...]

    def __post_init__(self) -> None:
        if not self.segments or len({s.k for s in self.segments}) != 1:
            raise ValueError("a QuantWeight has at least one segment, all of one row width")

    @classmethod
    def of(cls, qtype: GGMLQuantizationType, data: torch.Tensor, n: int, k: int) -> QuantWeight:
        """A single-segment weight of ``n`` rows of ``k`` values over the blocks ``data``
        (any shape with the right byte count, e.g. a flat view of a tensor's bytes)."""
        values, nbytes = GGML_QUANT_SIZES[qtype]
        if k % values:
            raise ValueError(f"a row of {k} values is not whole {GGMLQuantizationType(qtype).name} blocks")
        return cls((QuantSegment(qtype, data.reshape(n, k // values * nbytes)),))

    @classmethod
    def cat_rows(cls, parts: Sequence[QuantWeight]) -> QuantWeight:
        """The parts stacked along rows (no bytes copied)."""
        return cls(tuple(segment for part in parts for segment in part.segments))

    def reorder_rows(self, order: torch.Tensor) -> QuantWeight:
        """The same matrix with row i read from row ``order[i]`` (a permutation of one
        single-segment weight, as the loader's Q/K un-permutation needs)."""
        if len(self.segments) != 1:
            raise ValueError("only a single-segment weight is reordered")
        segment = self.segments[0]
        return QuantWeight((QuantSegment(segment.qtype, segment.data, segment.stored_rows(order)),))

    @property
    def k(self) -> int:
        return self.segments[0].k

    @property
    def shape(self) -> tuple[int, int]:
        return sum(s.rows for s in self.segments), self.k

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this matrix reads (a segment's unread stored rows not counted)."""
        return sum(s.rows * s.data.shape[1] for s in self.segments)

    @property
    def qtypes(self) -> frozenset[GGMLQuantizationType]:
        return frozenset(s.qtype for s in self.segments)

    def dequantize(self) -> torch.Tensor:
        """The whole matrix as float32 (n, k): the file's values, as the reference reads them."""
        return torch.cat([s.dequantize_rows() for s in self.segments])

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64) as float32 (len(ids), k), e.g. an embedding lookup."""
        out = torch.empty(ids.shape[0], self.k)
        start = 0
        for segment in self.segments:
            inside = (ids >= start) & (ids < start + segment.rows)
            if bool(inside.any()):
                where = inside.nonzero().squeeze(1)
                out[where] = segment.dequantize_rows(ids.index_select(0, where) - start)
            start += segment.rows
        return out
