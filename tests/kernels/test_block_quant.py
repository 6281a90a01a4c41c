"""Block-quantized weights: exact recovery, the native block matmul, and the Linear that
switches to it for small batches."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bargein.config import CacheConfig, EngineConfig
from bargein.engine.engine import Engine
from bargein.engine.sampling import SamplingParams
from bargein.kernels.block_quant import recover_blocks
from bargein.kernels.native import NativeKernelError, load_native_kernels
from bargein.kernels.ops import BLOCK_KERNEL_MAX_ROWS, KernelSet
from bargein.model.linear import Linear
from tests.tiny_models import TinySpec, quantized_reference, tiny_weights, write_gguf

KERNELS = load_native_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler here")


def lattice_4bit(n: int, k: int, seed: int) -> torch.Tensor:
    """Q4_1-like: every block of 32 is scale * q + min with q in 0..15, both ends used."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 3], q[..., 17] = 0, 15
    scale = torch.rand(n, k // 32, 1, generator=g) * 0.05
    low = torch.randn(n, k // 32, 1, generator=g) * 0.1
    return (q * scale + low).view(n, k)


def lattice_8bit(n: int, k: int, seed: int) -> torch.Tensor:
    """Q8_0-like: every block of 32 is scale * q with q in -127..127, |q| = 127 used."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 5] = -127
    return (q * torch.rand(n, k // 32, 1, generator=g) * 0.01).view(n, k)


def test_recovers_4bit_and_8bit_lattices_exactly() -> None:
    w4, w8 = lattice_4bit(40, 96, 0), lattice_8bit(40, 96, 1)
    b4, b8 = recover_blocks(w4), recover_blocks(w8)
    assert b4 is not None and b4.bits == 4 and b4.qs.dtype == torch.uint8 and b4.qs.shape == (40, 3, 16)
    assert b8 is not None and b8.bits == 8 and b8.qs.dtype == torch.int8 and b8.mins is None
    torch.testing.assert_close(b4.dequantize(), w4, rtol=0, atol=1e-6)
    torch.testing.assert_close(b8.dequantize(), w8, rtol=0, atol=1e-6)
    assert b4.nbytes == 40 * 3 * (16 + 4 + 4) and b8.nbytes == 40 * 3 * (32 + 4)


def test_constant_blocks_recover_with_zero_scale() -> None:
    w = torch.full((4, 64), 0.25)
    w[1] = 0.0
    blocks = recover_blocks(w)
    assert blocks is not None and blocks.bits == 4
    assert torch.equal(blocks.dequantize(), w)


def test_anything_off_the_lattice_stays_float32() -> None:
    assert recover_blocks(torch.randn(16, 64)) is None  # a float32 checkpoint
    w = lattice_4bit(16, 64, 2)
    w[7, 40] += 1e-3  # one value off its block's lattice
    assert recover_blocks(w) is None
    assert recover_blocks(lattice_4bit(16, 64, 3)[:, :48]) is None  # k not a multiple of 32
    assert recover_blocks(lattice_4bit(16, 64, 3).bfloat16()) is None  # only float32 is read


@pytest.mark.parametrize(("tensor_type", "bits"), [("Q4_1", 4), ("Q8_0", 8), ("Q4_0", None), ("F32", None)])
def test_which_gguf_types_are_recovered(tensor_type: str, bits: int | None) -> None:
    """Q4_1 and Q8_0 sit on the lattices; Q4_0 (q - 8, top level often unused) does not."""
    weights = quantized_reference(tiny_weights(TinySpec()), tensor_type)
    blocks = recover_blocks(weights["layers.0.w1.weight"])
    assert (blocks.bits if blocks else None) == bits


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 12])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_block_matmul_matches_float64(bits: int, rows: int, threads: int) -> None:
    w = lattice_4bit(70, 160, rows) if bits == 4 else lattice_8bit(70, 160, rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(threads))
    got = KERNELS.block_matmul(x, recover_blocks(w), threads)
    torch.testing.assert_close(got, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_block_matmul_refuses_bad_inputs() -> None:
    blocks = recover_blocks(lattice_4bit(8, 64, 0))
    with pytest.raises(NativeKernelError, match="columns"):
        KERNELS.block_matmul(torch.randn(2, 32), blocks, 1)
    with pytest.raises(NativeKernelError, match="float32"):
        KERNELS.block_matmul(torch.randn(2, 64).double(), blocks, 1)


@needs_kernels
def test_concurrent_callers_each_get_their_own_answer() -> None:
    """The kernels' thread pool serves calls from several Python threads one at a time."""
    cases = [(lattice_4bit(50, 96, i), torch.randn(3, 96, generator=torch.Generator().manual_seed(i)))
             for i in range(4)]
    errors: list[str] = []

    def hammer(i: int) -> None:
        w, x = cases[i]
        blocks, want = recover_blocks(w), (x.double() @ w.double().T).float()
        for _ in range(50):
            if not torch.allclose(KERNELS.block_matmul(x, blocks, 2), want, rtol=1e-5, atol=1e-5):
                errors.append(f"thread {i}")

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)


@needs_kernels
def test_linear_uses_blocks_for_few_rows_and_packed_float32_for_many() -> None:
    w, bias = lattice_4bit(48, 64, 9), torch.randn(48)
    layer = Linear(w, bias, kernels=KernelSet(KERNELS))
    assert layer.blocks is not None
    calls = []
    real = KERNELS.block_matmul

    class Spy:
        def block_matmul(self, *args):
            calls.append(args[0].shape[0])
            return real(*args)

    layer.kernels = KernelSet(Spy())
    for rows in (1, BLOCK_KERNEL_MAX_ROWS, BLOCK_KERNEL_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    assert calls == [1, BLOCK_KERNEL_MAX_ROWS]
    assert Linear(torch.randn(48, 64), kernels=KernelSet(KERNELS)).blocks is None
    assert Linear(w).blocks is None  # no kernels, no block copy


@needs_kernels
def test_engine_answers_are_the_same_with_and_without_native_kernels(tmp_path: Path) -> None:
    """A Q4_1 tiny model: greedy decoding of a batch, native kernels on and off."""
    spec = TinySpec()
    path = write_gguf(tmp_path / "tiny-q4_1.gguf", spec, tiny_weights(spec), tensor_type="Q4_1")
    cache = CacheConfig(block_size=4, num_blocks=64)
    native = Engine.from_pretrained(str(path), EngineConfig(cache=cache, precision="exact"), progress=False)
    plain = Engine.from_pretrained(str(path), EngineConfig(cache=cache, native_kernels=False, precision="exact"), progress=False)
    assert native.runner.stages[0].layers[0].feed_forward.w13.quant is not None  # the file's blocks
    assert plain.runner.stages[0].layers[0].feed_forward.w13.quant is None  # widened at load
    prompts = [[5, 17, 42], [99, 3, 250, 7, 61], [8]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [o.token_ids for o in native.generate(prompts, params)]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert got == want
    native.check_block_accounting()
