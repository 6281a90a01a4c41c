"""The MoE kernels (moe_matmul.c): routing and the experts grouped by expert, against float64.

- routing: the chosen experts are float64's top k, the weights its softmax (renormalised
  or not), the shared expert's gate its sigmoid, to float32 rounding;
- experts, for every GGUF block type the dense path reads: ``exact`` is the float64
  product of gguf.quants' values to float32 rounding; ``fast`` is the float64 product of
  the int8-rounded activations (per block of 32) to the int8 path's error;
- a row's output is bit-identical alone, in a batch whose rows route to other experts, in
  one where every row shares one expert, and for every thread count;
- an expert's rows through the grouped path (passes of up to 8 rows, 1 to 12 rows, on
  every instruction-set path, its matrices in one segment or two) are bit for bit the
  dense matmuls (gguf_matmul.c's bargein_gguf_matmul) and the dense SwiGLU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bargein.kernels.moe_native import ExpertTable
from bargein.kernels.native import Q8_ISAS, load_native_kernels
from bargein.kernels.native_structs import NativeKernelError, describe_quant
from bargein.kernels.quant_weight import QuantWeight
from tests.gguf_blocks import TYPES, T, gguf_dequantize, random_weight
from tests.kernels.isa_params import isa_params
from tests.kernels.test_gguf_kernels import int8_activations

KERNELS = load_native_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler here; the torch path is tested")
HIDDEN, INTER, EXPERTS, TOPK = 256, 256, 4, 2


def _table(qtype: T, seed: int) -> tuple[ExpertTable, list[np.ndarray]]:
    """Random experts of one block type, and their float64 values [gate, up, down] per expert."""
    rng = np.random.default_rng(seed)
    mats = [[random_weight(qtype, INTER, HIDDEN, rng), random_weight(qtype, INTER, HIDDEN, rng),
             random_weight(qtype, HIDDEN, INTER, rng)] for _ in range(EXPERTS)]
    values = [[gguf_dequantize(w.segments[0]).astype(np.float64) for w in ws] for ws in mats]
    return ExpertTable(*([ws[i] for ws in mats] for i in range(3))), values


def _route_inputs(m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, HIDDEN, generator=g), torch.randn(EXPERTS + 1, HIDDEN, generator=g) * HIDDEN ** -0.5


def _silu(a: np.ndarray) -> np.ndarray:
    return a / (1 + np.exp(-a))


def _reference(x: np.ndarray, values: list[list[np.ndarray]], ids: np.ndarray, w: np.ndarray,
               fast: bool, qtype: T) -> np.ndarray:
    y = np.zeros_like(x, dtype=np.float64)
    for r in range(x.shape[0]):
        for s in range(ids.shape[1]):
            gate, up, down = values[ids[r, s]]
            xr = int8_activations(x[r:r + 1], qtype) if fast else x[r:r + 1].astype(np.float64)
            h = (_silu(xr @ gate.T) * (xr @ up.T)).astype(np.float32)
            hr = int8_activations(h, qtype) if fast else h.astype(np.float64)
            y[r] += w[r, s] * (hr @ down.T)[0]
    return y


@pytest.mark.parametrize("norm", [True, False], ids=["renormalised", "softmax"])
def test_route_is_float64_top_k(norm: bool) -> None:
    x, router = _route_inputs(37, seed=1)
    ids, weights, gate = KERNELS.moe.route(x, router.contiguous(), EXPERTS, TOPK, norm, 2)
    logits = x.double() @ router.double().T
    probs = torch.softmax(logits[:, :EXPERTS], dim=-1)
    want_w, want_ids = probs.topk(TOPK, dim=-1)
    if norm:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.double(), want_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gate.double(), torch.sigmoid(logits[:, EXPERTS]), rtol=1e-5, atol=1e-6)
    without_gate = KERNELS.moe.route(x, router[:EXPERTS].contiguous(), EXPERTS, TOPK, norm, 1)
    assert without_gate[2] is None and torch.equal(without_gate[0], ids)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_grouped_experts_against_float64(qtype: T) -> None:
    table, values = _table(qtype, seed=int(qtype))
    scale = 1 / max(np.abs(v).max() for ws in values for v in ws)  # keep activations O(1)
    x, router = _route_inputs(9, seed=int(qtype))
    x = x * float(scale) * 4
    ids, weights, _ = KERNELS.moe.route(x, router[:EXPERTS].contiguous(), EXPERTS, TOPK, True, 2)
    for exact in (True, False):
        got = KERNELS.moe.experts(x, table, ids, weights, exact=exact, num_threads=2, isa=KERNELS.q8_isa).double()
        want = _reference(x.numpy(), values, ids.numpy(), weights.double().numpy(), fast=not exact,
                          qtype=qtype)
        err = (got.numpy() - want).__abs__().max() / (np.abs(want).max() + 1e-30)
        assert err < (2e-5 if exact else 5e-3), (exact, err)


def test_a_rows_output_does_not_depend_on_the_batch_or_threads() -> None:
    table, _ = _table(T.Q4_K, seed=7)
    x, _ = _route_inputs(6, seed=7)
    row = x[:1]
    alone_ids = torch.tensor([[0, 1]])
    weights = torch.tensor([[0.7, 0.3]])
    alone = KERNELS.moe.experts(row, table, alone_ids, weights, exact=False, num_threads=1, isa=KERNELS.q8_isa)
    batches = {  # the other rows' experts: disjoint from row 0's, or all of them sharing expert 0
        "disjoint": torch.tensor([[0, 1]] + [[2, 3]] * 5),
        "shared": torch.tensor([[0, 1]] + [[0, e] for e in (1, 2, 3, 2, 3)]),
    }
    for name, ids in batches.items():
        w = torch.cat([weights, torch.full((5, 2), 0.5)])
        for threads in (1, 2, 3, 8):
            got = KERNELS.moe.experts(x, table, ids, w, exact=False, num_threads=threads, isa=KERNELS.q8_isa)
            assert torch.equal(got[:1], alone), (name, threads)


def test_every_rows_output_is_its_own_in_a_step_of_many_experts() -> None:
    """A step as a 48-expert model makes them, scaled down: 12 experts, top 4, 24 rows, one
    expert chosen by every row beside experts of one row (at 8 threads each expert's gate/up
    and down are split into several work items), so that a down item and a row's sum wait
    for items run on other threads (moe_matmul.c's one region): every row is bit for bit its
    output alone, for 1, 2, 3 and 8 threads, and again (an item that did not wait would race
    with the one it needs: the repeats give the race its chances)."""
    rng = np.random.default_rng(11)
    experts, topk, m = 12, 4, 24
    mats = [[random_weight(T.Q4_K, INTER, HIDDEN, rng), random_weight(T.Q4_K, INTER, HIDDEN, rng),
             random_weight(T.Q4_K, HIDDEN, INTER, rng)] for _ in range(experts)]
    table = ExpertTable(*([ws[i] for ws in mats] for i in range(3)))
    x, _ = _route_inputs(m, seed=11)
    g = torch.Generator().manual_seed(11)
    ids = torch.stack([torch.cat([torch.tensor([0]), 1 + torch.randperm(experts - 1, generator=g)[:topk - 1]])
                       for _ in range(m)])
    w = torch.softmax(torch.randn(m, topk, generator=g), dim=1)
    alone = torch.cat([KERNELS.moe.experts(x[r:r + 1], table, ids[r:r + 1], w[r:r + 1], exact=False, num_threads=1,
                                           isa=KERNELS.q8_isa) for r in range(m)])
    for threads in (1, 2, 3, 8) + (2, 8) * 20:
        got = KERNELS.moe.experts(x, table, ids, w, exact=False, num_threads=threads, isa=KERNELS.q8_isa)
        assert torch.equal(got, alone), threads


def test_an_expert_id_outside_the_layer_is_refused() -> None:
    table, _ = _table(T.Q8_0, seed=3)
    x, _ = _route_inputs(2, seed=3)
    with pytest.raises(NativeKernelError, match="outside"):
        KERNELS.moe.experts(x, table, torch.tensor([[0, 4], [1, 2]]), torch.ones(2, 2), exact=False,
                            num_threads=1, isa=KERNELS.q8_isa)


def _two_segments(weight: QuantWeight) -> QuantWeight:
    """The same matrix as two segments (its first 100 rows, then the rest) over the same blocks: a
    boundary inside a work item's column range."""
    data, qtype, n, k = weight.segments[0].data, weight.segments[0].qtype, *weight.shape
    return QuantWeight.cat_rows([QuantWeight.of(qtype, data[:100], 100, k), QuantWeight.of(qtype, data[100:], n - 100, k)])


@pytest.mark.parametrize("isa", isa_params(KERNELS))
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_an_experts_rows_are_the_dense_matmuls_bits(qtype: T, isa: str) -> None:
    """Every row count from 1 to 12 on one expert (all rows chose it, weight 1: y is its
    MLP's output unscaled) gives the dense path's bits: the VNNI K chain's passes of 5 to 8
    rows and the passes of 4, 2 or 1 row of the other paths and types alike."""
    rng = np.random.default_rng(int(qtype))
    gate, up, down = (random_weight(qtype, INTER, HIDDEN, rng), random_weight(qtype, INTER, HIDDEN, rng),
                      random_weight(qtype, HIDDEN, INTER, rng))
    tables = {"one segment": ExpertTable([gate], [up], [down]),
              "two segments": ExpertTable([_two_segments(gate)], [_two_segments(up)], [_two_segments(down)])}
    gate_up, down_q = describe_quant(QuantWeight.cat_rows([gate, up])), describe_quant(down)
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(5)) * 0.5
    isa_id = Q8_ISAS[isa]
    for m in range(1, 13):
        rows = x[:m].contiguous()
        want = KERNELS.quant_matmul(KERNELS.silu_mul(KERNELS.quant_matmul(rows, gate_up, 1), 1), down_q, 1)
        for name, table in tables.items():
            got = KERNELS.moe.experts(rows, table, torch.zeros(m, 1, dtype=torch.int64), torch.ones(m, 1),
                                      exact=False, num_threads=2, isa=isa_id)
            assert torch.equal(got, want), (m, name)
