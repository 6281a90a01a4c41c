"""The float-source rule's form (bargein/kernels/half_rows.py): which 16-bit type a float32
matrix is narrowed to, that a 16-bit tensor is viewed and never copied, and that a Linear or
a model built for ``fast`` holds a float weight as those rows, never as int8 blocks."""

from __future__ import annotations

import pytest
import torch

from bargein.kernels.ggml_types import GGMLQuantizationType as T
from bargein.kernels.half_rows import half_rows, is_half, narrowed_type
from bargein.kernels.native import load_native_kernels
from bargein.kernels.ops import KernelSet
from bargein.model.block_weights import fast_weight
from bargein.model.linear import Linear

KERNELS = load_native_kernels()


def _randn(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_a_float32_matrix_is_narrowed_losslessly_where_it_can_be() -> None:
    w = _randn(8, 40)
    assert narrowed_type(w.half().float()) == T.F16  # float16 values: F16, lossless
    bf = (w * 1e-4).bfloat16().float()  # bfloat16 values below float16's normal range
    assert not torch.equal(bf.half().float(), bf) and narrowed_type(bf) == T.BF16  # BF16, lossless
    assert narrowed_type(w) == T.F16  # neither: F16 within its range
    big = w.clone()
    big[3, 5] = 1e6  # beyond float16's range (and not a bfloat16 value): BF16 keeps the range
    big[0, 0] = 1.2345678
    assert narrowed_type(big) == T.BF16
    inf = w.clone()
    inf[1, 1] = float("inf")
    inf[0, 0] = 1.2345678
    assert narrowed_type(inf) == T.BF16


def test_narrowed_rows_hold_the_rounded_values() -> None:
    w = _randn(5, 37)
    held = half_rows(w)
    assert held.qtypes == {T.F16} and held.shape == (5, 37) and held.nbytes == 5 * 37 * 2
    assert torch.equal(held.dequantize(), w.half().float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_matrix_is_viewed_not_copied(dtype: torch.dtype) -> None:
    w = _randn(6, 24).to(dtype)
    held = half_rows(w)
    assert held.segments[0].data.data_ptr() == w.data_ptr()
    assert held.qtypes == {T.F16 if dtype == torch.float16 else T.BF16}
    assert torch.equal(held.dequantize(), w.float())


def test_what_is_not_a_float_matrix_is_refused() -> None:
    with pytest.raises(ValueError, match="matrix"):
        half_rows(torch.zeros(8))
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        half_rows(torch.zeros(2, 8, dtype=torch.int32))


def test_fast_weight_narrows_matmul_matrices_not_routing_rows_or_vectors() -> None:
    w = _randn(4, 32)
    assert is_half(fast_weight("layers.0.wq.weight", w))
    assert is_half(fast_weight("embed.weight", w))
    assert fast_weight("layers.0.router.weight", w) is w  # MoE routing: float32 logits, as stored
    assert fast_weight("layers.0.shared_gate.weight", w) is w
    norm = torch.ones(32)
    assert fast_weight("layers.0.attn_norm.weight", norm) is norm


@pytest.mark.skipif(KERNELS is None, reason="no C compiler here: fast runs as exact")
def test_a_fast_linear_over_a_dense_weight_reads_16_bit_rows_not_int8() -> None:
    w = _randn(48, 72)  # k = 72: not whole blocks of 32, which int8 blocks could not hold
    linear = Linear(w, kernels=KernelSet(KERNELS, fast=True))
    assert is_half(linear.quant) and linear.blocks is None and not linear.holds_dense
    x = _randn(3, 72, seed=1)
    want = x.double() @ w.half().double().t()
    got = linear(x)
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())  # float activations: no int8 error
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):  # a row's bits depend on neither its batch nor the thread count
            torch.set_num_threads(threads)
            assert torch.equal(linear(x[1:2]), got[1:2]) and torch.equal(linear(x), got), threads
    finally:
        torch.set_num_threads(before)
