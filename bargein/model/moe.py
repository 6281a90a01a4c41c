"""Mixture-of-experts feed-forward layers (Qwen2/3-MoE, Mixtral; see :class:`~bargein.config.MoEConfig`).

A token's router logits choose its ``experts_per_token`` experts and their weights; the
layer's output is the weighted sum of those experts' SwiGLU MLPs (plus Qwen2-MoE's shared
expert, scaled by a sigmoid gate). Experts arrive as canonical weights
``layers.{i}.experts.{e}.w1/w3/w2.weight``: from a GGUF, QuantWeights over each expert's
slice of the stacked tensors in the mapped file (never copied, and never read for an
expert no token chooses), from a folder, dense tensors.

- ``exact``: in float32 PyTorch as transformers computes it: softmax over all experts, top
  k, renormalised where the family does; each chosen expert runs once on all its rows
  (``KernelSet.quant_linear`` for blocks), its weighted output added to theirs.
- ``fast``: routing, the experts grouped by expert and the weighted sum in two native calls
  (moe_matmul.c), with int8 activations against the experts' blocks; a token's output
  depends on its own row only, not on which rows share the step or which experts they
  chose. Dense experts (a folder's float weights) are 16-bit rows (F16 or BF16, float32 activations).
  Inside a fused stage (:mod:`bargein.model.fused_layers`) the same calls run from C
  (:meth:`MoEFeedForward.fused_description`), with the same bits.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bargein.config import MoEConfig
from bargein.kernels.half_rows import half_rows
from bargein.kernels.moe_native import ExpertTable
from bargein.kernels.native_structs import FastMoE, Q8Weight
from bargein.kernels.ops import KernelSet
from bargein.kernels.quant_weight import QuantWeight
from bargein.model.block_weights import Weight, cat_rows, dense
from bargein.model.linear import Linear

log = logging.getLogger(__name__)


class Expert(nn.Module):
    """One expert's SwiGLU MLP in ``exact``: ``w2(silu(w1 x) * w3 x)``, gate and up fused."""

    def __init__(self, w1: Weight, w3: Weight, w2: Weight, kernels: KernelSet):
        super().__init__()
        self.w13 = _linear(cat_rows([w1, w3]), kernels)
        self.w2 = _linear(w2, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


def _linear(weight: Weight, kernels: KernelSet) -> Linear:
    return Linear.from_quant(weight, kernels=kernels) if isinstance(weight, QuantWeight) \
        else Linear(dense(weight), kernels=kernels)


class MoEFeedForward(nn.Module):
    """An MoE layer's MLP over canonical weights under ``prefix`` (``layers.{i}``).

    ``shared`` is Qwen2-MoE's shared expert (a dense MLP the caller builds), or None.
    ``router`` (experts, hidden) is a view of ``route_matrix``, which holds the shared
    expert's gate as its last row where there is one: one native call computes both.
    """

    def __init__(self, moe: MoEConfig, take: Callable[[str], Weight], prefix: str, kernels: KernelSet,
                 shared: nn.Module | None = None):
        super().__init__()
        self.num_experts, self.topk, self.norm_topk_prob = moe.num_experts, moe.experts_per_token, moe.norm_topk_prob
        rows = [dense(take(f"{prefix}.router.weight")).float()]
        self.shared = shared
        if shared is not None:
            rows.append(dense(take(f"{prefix}.shared_gate.weight")).float())
        self.route_matrix = torch.cat(rows).contiguous()  # (experts [+ 1], hidden)
        self.router = self.route_matrix[:self.num_experts]
        self.shared_gate = self.route_matrix[self.num_experts:] if shared is not None else None
        experts = [tuple(take(f"{prefix}.experts.{e}.{w}.weight") for w in ("w1", "w3", "w2"))
                   for e in range(self.num_experts)]
        self.kernels = kernels
        self.table = self._native_table(experts) if kernels.fast else None
        self.experts = None if self.table is not None else nn.ModuleList(Expert(*w, kernels) for w in experts)

    def _native_table(self, experts: list[tuple[Weight, ...]]) -> ExpertTable | None:
        # a float-source expert is 16-bit rows (bargein.kernels.half_rows), never re-quantized to int8
        held = [[w if isinstance(w, QuantWeight) else half_rows(dense(w)) for w in ws] for ws in experts]
        if any(len(w.segments) != 1 for ws in held for w in ws):
            return None
        return ExpertTable(*([ws[i] for ws in held] for i in range(3)))  # type: ignore[misc]

    @property
    def experts_nbytes(self) -> int:
        """Bytes of all experts' weights as held (for the memory statement)."""
        if self.table is not None:
            return self.table.nbytes
        return sum(_held_bytes(lin) for e in self.experts for lin in (e.w13, e.w2))

    def fused_description(self, weight_of: Callable[[Linear], Q8Weight | None]) -> FastMoE | None:
        """This layer as the fused fast forward reads it (fast_forward.c's bargein_fast_moe_t),
        pointing into this module's router and expert table: the caller keeps the module
        alive while the description is used. ``weight_of`` describes a Linear's blocks (the
        shared expert's). None where the experts have no native table or the shared
        expert's linears are not held in blocks without a bias: the stage then runs per
        operation."""
        table = self.table
        if table is None:
            return None
        shared = Q8Weight(), Q8Weight()  # n == 0: none
        if self.shared is not None:
            w13, w2 = (self.shared.w13, self.shared.w2)
            held = weight_of(w13), weight_of(w2)
            if held[0] is None or held[1] is None or w13.bias is not None or w2.bias is not None \
                    or self.shared.activation != "silu" or held[0].k != table.hidden \
                    or (held[1].n, 2 * held[1].k) != (table.hidden, held[0].n):
                return None
            shared = held
        return FastMoE(router=self.route_matrix.data_ptr(), experts=self.num_experts,
                       rows_w=self.route_matrix.shape[0], topk=self.topk, norm=int(self.norm_topk_prob),
                       inter=table.inter, gate=ctypes.addressof(table.gate), up=ctypes.addressof(table.up),
                       down=ctypes.addressof(table.down), shared_w13=shared[0], shared_w2=shared[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is not None and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
            return self._fast(x.contiguous())
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():  # each chosen expert once, for all its rows
            rows, slots = torch.where(ids == e)
            # rows are distinct within one expert: a put, not index_add_ (whose parallel
            # kernel costs ~10 ms a call on a loaded 2-core machine)
            out.index_put_((rows,), out[rows] + self.experts[e](x[rows]) * weights[rows, slots, None])
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate.to(x.dtype))) * self.shared(x)
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``exact``'s routing, as transformers': (weights (T, k) in x's dtype, expert ids (T, k))."""
        probs = F.softmax(F.linear(x, self.router.to(x.dtype)), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.topk, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def chosen_experts(self, x: torch.Tensor) -> torch.Tensor:
        """The experts (T, k) each row of x (the layer's input, after its norm) chooses, as
        this layer's precision routes it."""
        if self.table is not None:
            return self.kernels.native.moe.route(x.contiguous(), self.route_matrix, self.num_experts, self.topk,
                                                 self.norm_topk_prob, torch.get_num_threads())[0]
        return self.route(x)[1]

    def _fast(self, x: torch.Tensor) -> torch.Tensor:
        native, threads = self.kernels.native, torch.get_num_threads()
        ids, weights, gate = native.moe.route(x, self.route_matrix, self.num_experts, self.topk,
                                              self.norm_topk_prob, threads)
        y = native.moe.experts(x, self.table, ids, weights, exact=False, num_threads=threads, isa=native.q8_isa)
        if self.shared is not None:
            y = y + gate.unsqueeze(1) * self.shared(x)
        return y


def _held_bytes(linear: Linear) -> int:
    if linear.quant is not None:
        return linear.quant.nbytes
    held = linear.weight if linear.weight is not None else linear.packed
    return 0 if held is None else held.numel() * held.element_size()
