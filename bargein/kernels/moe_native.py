"""The mixture-of-experts kernels (moe_matmul.c) through ctypes: routing, and the experts'
MLPs grouped by expert with the weighted sum (see the C file for the arithmetic and its
invariance). :class:`ExpertTable` describes a layer's experts to the C side once."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from bargein.kernels.native_structs import NativeKernelError, QuantMatrix, describe_quant
from bargein.kernels.quant_weight import QuantWeight

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class ExpertTable:
    """A layer's experts as the C side reads them: for each expert its gate, up (inter,
    hidden) and down (hidden, inter) QuantWeights, described once (the descriptors and the
    weights they point into live as long as this table)."""

    def __init__(self, gate: Sequence[QuantWeight], up: Sequence[QuantWeight], down: Sequence[QuantWeight]):
        if not gate or not len(gate) == len(up) == len(down):
            raise NativeKernelError("an expert table has the same number (> 0) of gate, up and down matrices")
        self.num_experts = len(gate)
        self.inter, self.hidden = gate[0].shape
        for g, u, d in zip(gate, up, down, strict=True):
            if g.shape != (self.inter, self.hidden) or u.shape != g.shape or d.shape != (self.hidden, self.inter):
                raise NativeKernelError("every expert's gate and up are (inter, hidden), its down (hidden, inter)")
        self._matrices: list[QuantMatrix] = []

        def pointers(weights: Sequence[QuantWeight]) -> ctypes.Array:
            described = [describe_quant(w) for w in weights]
            self._matrices += described
            return (_P * len(described))(*(ctypes.addressof(m.struct) for m in described))

        self.gate, self.up, self.down = pointers(gate), pointers(up), pointers(down)
        self.nbytes = sum(w.nbytes for ws in (gate, up, down) for w in ws)  # the experts' blocks


class MoEKernels:
    """The library's two MoE entry points."""

    def __init__(self, library: ctypes.CDLL):
        self._route = library.bargein_moe_route
        self._route.restype = _INT
        self._route.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _I64, _INT, _P, _P, _P, _INT]
        self._experts = library.bargein_moe_experts
        self._experts.restype = _INT
        self._experts.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _I64, _P, _P, _I64, _P, _INT, _INT, _INT]

    def route(self, x: torch.Tensor, router: torch.Tensor, num_experts: int, topk: int, norm: bool,
              num_threads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(ids (m, topk) int64, weights (m, topk) float32, gate (m,) or None) for x (m, hidden)
        and router (num_experts [+ 1], hidden), both contiguous float32; a last router row
        beyond the experts is the shared expert's gate, returned as its sigmoid."""
        _check(x, router.shape[1])
        if router.dtype != torch.float32 or not router.is_contiguous() or router.shape[0] not in (num_experts,
                                                                                                 num_experts + 1):
            raise NativeKernelError("the router is a contiguous float32 (experts [+ 1], hidden) matrix")
        m = x.shape[0]
        ids = torch.empty((m, topk), dtype=torch.int64)
        weights = torch.empty((m, topk), dtype=torch.float32)
        gate = torch.empty(m, dtype=torch.float32) if router.shape[0] > num_experts else None
        status = self._route(x.data_ptr(), m, x.shape[1], router.data_ptr(), num_experts, router.shape[0], topk,
                             int(norm), ids.data_ptr(), weights.data_ptr(), 0 if gate is None else gate.data_ptr(),
                             num_threads)
        if status:
            raise NativeKernelError("the MoE router could not allocate its scratch memory")
        return ids, weights, gate

    def experts(self, x: torch.Tensor, table: ExpertTable, ids: torch.Tensor, weights: torch.Tensor, *,
                exact: bool, num_threads: int, isa: int) -> torch.Tensor:
        """sum over s of weights[r, s] * expert ids[r, s]'s SwiGLU MLP of x[r], for x (m, hidden)."""
        _check(x, table.hidden)
        m, topk = ids.shape
        if ids.dtype != torch.int64 or weights.dtype != torch.float32 or weights.shape != ids.shape \
                or m != x.shape[0]:
            raise NativeKernelError("ids (m, topk) int64 and weights (m, topk) float32, one row per row of x")
        ids, weights = ids.contiguous(), weights.contiguous()
        y = torch.empty_like(x)
        status = self._experts(x.data_ptr(), m, table.hidden, table.inter, table.gate, table.up, table.down,
                               table.num_experts, ids.data_ptr(), weights.data_ptr(), topk, y.data_ptr(),
                               int(exact), num_threads, isa)
        if status == -6:
            raise NativeKernelError("an expert id lies outside the layer's experts")
        if status == -3:
            raise NativeKernelError("an expert's block type has no native kernels")
        if status:
            raise NativeKernelError("the MoE kernel could not allocate its scratch memory")
        return y


def _check(x: torch.Tensor, k: int) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or x.dim() != 2:
        raise NativeKernelError("x must be a contiguous 2-D float32 CPU tensor")
    if x.shape[1] != k:
        raise NativeKernelError(f"x has {x.shape[1]} columns; {k} are needed")
