"""16-bit float weights (F16, BF16) read in place by half_matmul.c, against float64.

Weights are random finite halves written by the test. The rows widened natively are the
weights' values bit for bit (gguf.quants' too); a product is the stated eight-lane fma
chain (emulated here in float64, which is exact for these values' products) and within
float32 rounding of the float64 product; it gives the same bits for every row count,
thread count and instruction-set path (those this CPU lacks are skipped by name), in
both precisions, and beside block-type segments in one matrix.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bargein.kernels.ggml_types import GGMLQuantizationType as T
from bargein.kernels.native import load_native_kernels
from bargein.kernels.native_structs import describe_quant
from bargein.kernels.ops import KernelSet
from bargein.kernels.quant_weight import QUANT_TYPES, QuantSegment, QuantWeight
from tests.gguf_blocks import random_weight
from tests.kernels.isa_params import isa_params
from tests.kernels.stealing import assert_each_output_written_once, gguf_run

KERNELS = load_native_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler here; the reference path is tested")
EPS = float(np.finfo(np.float32).eps)
HALF_TYPES = (T.F16, T.BF16)
TYPE_IDS = [t.name for t in HALF_TYPES]
ROWS = [1, 2, 3, 5, 7, 13, 33]
ODD_K = 203  # not a multiple of 8: the padded last step


ISAS = isa_params(KERNELS)  # this architecture's paths only


def half_weight(qtype: T, n: int, k: int, seed: int, order: bool = False) -> QuantWeight:
    """Rows of random finite 16-bit floats of a layer's spread (and some exact zeros)."""
    rng = np.random.default_rng(seed)
    values = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    values[:, ::17] = 0.0
    stored = values.to(torch.float16 if qtype == T.F16 else torch.bfloat16)
    perm = torch.from_numpy(rng.permutation(n)).to(torch.int64) if order else None
    return QuantWeight((QuantSegment(qtype, stored.view(torch.uint8).reshape(n, 2 * k), perm),))


def values_of(weight: QuantWeight) -> np.ndarray:
    """The weight's values as float32, independently of bargein's dequantizers."""
    rows = []
    for s in weight.segments:
        dtype = torch.float16 if s.qtype == T.F16 else torch.bfloat16
        widened = s.data.contiguous().view(dtype).float()
        rows.append(widened if s.order is None else widened[s.order])
    return torch.cat(rows).numpy()


def stated_order(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """half_matmul.c's chain: eight lanes of fma over k padded to a multiple of 8, then
    ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). A float32 product is exact in
    float64, and each fma's sum is rounded once to float64 and once to float32: equal to
    one rounding unless the float64 sum lies on a float32 tie, which these values' do not."""
    m, k = x.shape
    pad = -k % 8
    xs = np.pad(x, ((0, 0), (0, pad))).astype(np.float64).reshape(m, 1, -1, 8)
    ws = np.pad(w, ((0, 0), (0, pad))).astype(np.float64).reshape(1, w.shape[0], -1, 8)
    lane = np.zeros((m, w.shape[0], 8), dtype=np.float32)
    for t in range(xs.shape[2]):
        lane = (xs[:, :, t] * ws[:, :, t] + lane.astype(np.float64)).astype(np.float32)
    return ((lane[..., 0] + lane[..., 4]) + (lane[..., 2] + lane[..., 6])) + \
        ((lane[..., 1] + lane[..., 5]) + (lane[..., 3] + lane[..., 7]))


def test_half_types_are_weights_the_kernels_read():
    assert set(HALF_TYPES) <= QUANT_TYPES


@pytest.mark.parametrize("qtype", HALF_TYPES, ids=TYPE_IDS)
def test_reference_values_are_gguf_values(qtype):
    from gguf.quants import dequantize

    weight = half_weight(qtype, 9, ODD_K, 1)
    segment = weight.segments[0]
    theirs = dequantize(segment.data.numpy(), qtype).reshape(9, ODD_K)
    assert np.array_equal(weight.dequantize().numpy().view(np.int32), theirs.view(np.int32))


@needs_kernels
@pytest.mark.parametrize("qtype", HALF_TYPES, ids=TYPE_IDS)
def test_native_rows_are_the_values(qtype):
    weight = QuantWeight.cat_rows([half_weight(qtype, 21, ODD_K, 2, order=True), half_weight(qtype, 4, ODD_K, 3)])
    ids = torch.tensor([24, 0, 7, 20, 21, 7, 3, 11, 1])
    for threads in (1, 3):
        rows = KERNELS.quant_rows(describe_quant(weight), ids, threads).numpy()
        assert np.array_equal(rows.view(np.int32), values_of(weight)[ids.numpy()].view(np.int32))


@needs_kernels
@pytest.mark.parametrize("qtype", HALF_TYPES, ids=TYPE_IDS)
def test_product_is_the_stated_chain(qtype):
    weight = half_weight(qtype, 37, ODD_K, 4)
    x = np.random.default_rng(5).standard_normal((5, ODD_K)).astype(np.float32)
    y = KERNELS.quant_matmul(torch.from_numpy(x), describe_quant(weight), 1, isa="c").numpy()
    assert np.array_equal(y.view(np.int32), stated_order(x, values_of(weight)).view(np.int32))


@needs_kernels
@pytest.mark.parametrize("qtype", HALF_TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("k", [ODD_K, 512])
def test_both_precisions_are_the_float64_product_to_float_rounding(qtype, k):
    weight = half_weight(qtype, 53, k, 6, order=True)
    w = values_of(weight).astype(np.float64)
    rng = np.random.default_rng(7)
    for fast in (False, True):
        kernels = KernelSet(KERNELS, fast=fast)
        for m in (1, 3, 33):  # exact: C for few rows, widened chunks and PyTorch's GEMM for many
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            ref = x.double().numpy() @ w.T
            bound = (k // 8 + 4) * EPS * (np.abs(x.double().numpy()) @ np.abs(w).T) + 1e-30
            y = kernels.quant_linear(x, weight).numpy()
            assert (np.abs(y - ref) <= bound).all(), (fast, m, np.abs(y - ref).max())


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", HALF_TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("k", [ODD_K, 576])
def test_bits_do_not_depend_on_rows_threads_or_path(qtype, isa, k):
    # 101 + 30 columns: several units of 48 and short column groups on every path
    weight = QuantWeight.cat_rows([half_weight(qtype, 101, k, 8, order=True), half_weight(qtype, 30, k, 9)])
    matrix = describe_quant(weight)
    x = torch.from_numpy(np.random.default_rng(10).standard_normal((max(ROWS), k)).astype(np.float32))
    base = KERNELS.quant_matmul(x, matrix, 1, isa="c")
    for m in ROWS:
        for threads in (1, 2, 3):
            for exact in (False, True):
                y = KERNELS.quant_matmul(x[:m].contiguous(), matrix, threads, exact=exact, isa=isa)
                assert torch.equal(y, base[:m]), (m, threads, exact)
    assert torch.equal(KERNELS.quant_matmul(x[5:6].contiguous(), matrix, 2, isa=isa), base[5:6])


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_half_segments_beside_block_segments(isa):
    """A fused matrix of F16, Q4_K and BF16 rows: each segment's columns are what it gives alone."""
    k = 512
    parts = [half_weight(T.F16, 20, k, 11), random_weight(T.Q4_K, 17, k, np.random.default_rng(12), order=True),
             half_weight(T.BF16, 9, k, 13, order=True)]
    weight = QuantWeight.cat_rows(parts)
    x = torch.from_numpy(np.random.default_rng(14).standard_normal((9, k)).astype(np.float32))
    for fast in (False, True):
        whole = KERNELS.quant_matmul(x, describe_quant(weight), 3, exact=not fast, isa=isa)
        start = 0
        for part in parts:
            alone = KERNELS.quant_matmul(x, describe_quant(part), 1, exact=not fast, isa=isa)
            assert torch.equal(whole[:, start:start + part.shape[0]], alone), (fast, part.qtypes)
            start += part.shape[0]
    ids = torch.tensor([45, 0, 20, 37, 19])
    assert torch.equal(KernelSet(KERNELS).quant_embedding(weight, ids), weight.dequantize()[ids])


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_threads_that_take_each_others_units_compute_every_unit_once(isa):
    """half_matmul.c's units (48 columns of a segment) are shares that threads steal from
    (parallel.h), as the block segments' tiles are: with 2-8 threads every output, NaN
    before the call, comes out written with one thread's bits, across F16, a Q4_K segment
    and BF16 rows in their own order."""
    k = 256
    weight = QuantWeight.cat_rows([half_weight(T.F16, 48 * 9 + 7, k, 21),
                                   random_weight(T.Q4_K, 16 * 5 + 3, k, np.random.default_rng(22)),
                                   half_weight(T.BF16, 48 * 6 + 1, k, 23, order=True)])
    matrix = describe_quant(weight)
    x = torch.from_numpy(np.random.default_rng(24).standard_normal((9, k)).astype(np.float32))
    for m in (1, 9):
        base = KERNELS.quant_matmul(x[:m].contiguous(), matrix, 1, isa="c")
        assert_each_output_written_once(gguf_run(KERNELS, x[:m], matrix, isa), base)

def test_without_native_kernels_the_reference_runs():
    weight = half_weight(T.BF16, 12, 64, 15)
    x = torch.randn(3, 64)
    assert torch.equal(KernelSet().quant_linear(x, weight), torch.nn.functional.linear(x, weight.dequantize()))
