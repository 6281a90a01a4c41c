"""The `fast` precision's native kernels against float64 references, and their invariance.

Every kernel here must give row r (or query t) the same bits whatever else shares the
call and however many threads run it; the int8 matmul must also give the same bits on
each instruction-set path (AVX-512 VNNI, AVX2, plain C) that this machine runs. Paths a
machine lacks are skipped, by name, so a run says which were checked.
"""

from __future__ import annotations

import itertools
import logging
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bargein.kernels import ops
from bargein.kernels.block_quant import BLOCK, BlockWeight, quantize_8bit, recover_blocks
from bargein.kernels.native import Q8_ISAS, NativeKernelError, NativeKernels, load_native_kernels
from bargein.kernels.ops import resolve_kernels
from tests.kernels.isa_params import isa_params

KERNELS = load_native_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler here; the fallback is tested below")
THREADS = [1, 2, 3]


ISAS = isa_params(KERNELS)  # this architecture's paths only


def q4_weight(n: int, k: int, g: torch.Generator) -> BlockWeight:
    """A Q4_1-like weight: every block spans its 16 levels, so recover_blocks finds it."""
    q = torch.randint(0, 16, (n, k // BLOCK, BLOCK), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    scale = torch.rand(n, k // BLOCK, 1, generator=g) * 0.1 + 1e-3
    low = (torch.rand(n, k // BLOCK, 1, generator=g) - 0.7) * 0.5
    blocks = recover_blocks((q * scale + low).view(n, k))
    assert blocks is not None and blocks.bits == 4
    return blocks


def q8_weight(n: int, k: int, g: torch.Generator) -> BlockWeight:
    blocks = quantize_8bit(torch.randn(n, k, generator=g) * 0.05)
    assert blocks is not None and blocks.bits == 8
    return blocks


WEIGHTS = {"q4": q4_weight, "q8": q8_weight}


def activation_error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|x @ W.T - y| when each x is moved by at most half its block's int8 step: (m, n)."""
    m, k = x.shape
    step = x.double().abs().view(m, k // BLOCK, BLOCK).amax(-1, keepdim=True) / 127  # (m, nb, 1)
    half_step = (step / 2).expand(m, k // BLOCK, BLOCK).reshape(m, k)
    return half_step @ w.double().abs().T


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 32, 1), (3, 64, 5), (8, 576, 33), (9, 96, 17), (20, 1536, 8)])
@pytest.mark.parametrize("threads", THREADS)
def test_int8_matmul_is_within_its_quantization_bound_of_float64(isa: str, kind: str, m: int, k: int, n: int,
                                                                 threads: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    weight = WEIGHTS[kind](n, k, g)
    x = torch.randn(m, k, generator=g) * 3
    if m > 1:
        x[-1, :BLOCK] = 0  # an all-zero block: scale 0, no division by it
    w = weight.dequantize()
    want = x.double() @ w.double().T
    got = KERNELS.q8_block_matmul(x, weight, threads, isa)
    # The activations' rounding, plus float32 accumulation over k terms.
    bound = activation_error_bound(x, w) + 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6
    assert ((got.double() - want).abs() <= bound).all()
    # and far from vacuous: int8 keeps about 1/254 of each block's range
    assert (got.double() - want).abs().max() < 0.01 * (x.double().abs() @ w.double().abs().T).max()


@needs_kernels
@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize(("n", "k"), [(45, 576), (13, 96), (8, 32)])  # partial column groups, an odd block count
def test_int8_matmul_rows_threads_and_instruction_sets_agree_bit_for_bit(kind: str, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(7)
    weight = WEIGHTS[kind](n, k, g)
    x = torch.randn(21, k, generator=g)
    isas = [name for name in Q8_ISAS if KERNELS.q8_isa_available(name)]
    results = [KERNELS.q8_block_matmul(x, weight, t, isa) for isa in isas for t in THREADS]
    for other in results[1:]:
        assert torch.equal(other, results[0])
    for r in (0, 5, 6, 7, 8, 20):  # alone, and at every place within the row groups (2 for AVX2, 6 for VNNI)
        for isa in isas:
            for t in THREADS:
                alone = KERNELS.q8_block_matmul(x[r:r + 1].contiguous(), weight, t, isa)
                assert torch.equal(alone[0], results[0][r])
    for start, stop in ((3, 12), (5, 6), (8, 21)):
        part = KERNELS.q8_block_matmul(x[start:stop].contiguous(), weight, 2)
        assert torch.equal(part, results[0][start:stop])


def _round_f32(value: Fraction) -> float:
    """``value`` rounded once to the nearest float32 (ties to even), as an fma rounds."""
    guess = np.float32(float(value))  # within one float32 step: float() may round once already
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    best = min(candidates, key=lambda c: (abs(Fraction(float(c)) - value), int(c.view(np.int32)) & 1))
    return float(best)


def _fma_f32(a: float, b: float, c: float) -> float:
    return _round_f32(Fraction(a) * Fraction(b) + Fraction(c))


def spec_q8_matmul(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """quant_matmul.c's documented arithmetic, step by step, each fma rounded exactly once."""
    f32 = np.float32
    m, k = x.shape
    n, nb = weight.shape[0], k // BLOCK
    if weight.bits == 4:
        q = torch.cat([weight.qs & 0x0F, weight.qs >> 4], dim=-1).long()
    else:
        q = weight.qs.long()
    y = torch.empty(m, n)
    for r in range(m):
        xq, xd, xs = [], [], []
        for b in range(nb):
            block = x[r, b * BLOCK:(b + 1) * BLOCK].numpy()
            d = f32(np.abs(block).max()) / f32(127)
            inv = f32(1) / d if d > 0 else f32(0)
            v = np.clip(np.rint(block * inv), -127, 127).astype(np.int64)
            xq.append(torch.from_numpy(v))
            xd.append(d)
            xs.append(d * f32(int(v.sum())))
        for j in range(n):
            acc = 0.0
            for b in range(nb):
                dot = int((q[j, b] * xq[b]).sum())
                acc = _fma_f32(float(dot), float(f32(weight.scales[j, b].item()) * xd[b]), acc)
                if weight.bits == 4:
                    acc = _fma_f32(weight.mins[j, b].item(), float(xs[b]), acc)
            y[r, j] = acc
    return y


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_int8_matmul_follows_its_documented_arithmetic_to_the_bit(isa: str, kind: str) -> None:
    """The order of operations quant_matmul.c states (one fma chain per output, blocks in
    order, the min term after each block), which other kernels calling it may rely on."""
    g = torch.Generator().manual_seed(5)
    weight = WEIGHTS[kind](10, 96, g)
    x = torch.randn(17, 96, generator=g) * 2  # 17 rows: VNNI's many-row path too
    x[1, 32:64] = 0
    x[2, :8] = torch.tensor([0.5, -0.5, 1.5, 2.5, -2.5, 127.0, -127.0, 63.5])  # x / d exactly half-way cases
    assert torch.equal(KERNELS.q8_block_matmul(x, weight, 2, isa), spec_q8_matmul(x, weight))


@needs_kernels
def test_int8_matmul_refuses_what_is_outside_its_contract() -> None:
    weight = q8_weight(4, 64, torch.Generator().manual_seed(0))
    with pytest.raises(NativeKernelError, match="64 are needed"):
        KERNELS.q8_block_matmul(torch.zeros(2, 32), weight, 1)
    with pytest.raises(NativeKernelError, match="float32"):
        KERNELS.q8_block_matmul(torch.zeros(2, 64, dtype=torch.float64), weight, 1)


@needs_kernels
def test_a_forced_instruction_set_the_cpu_lacks_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setenv("BARGEIN_Q8_ISA", "sse9")
    with pytest.raises(NativeKernelError, match="BARGEIN_Q8_ISA='sse9'"):
        NativeKernels(KERNELS._library, KERNELS.path)
    monkeypatch.setenv("BARGEIN_Q8_ISA", "c")
    assert NativeKernels(KERNELS._library, KERNELS.path).q8_isa == Q8_ISAS["c"]


def test_quantize_8bit_moves_each_value_by_at_most_half_a_step() -> None:
    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(1))
    w[2, 32:64] = 0
    blocks = quantize_8bit(w)
    step = w.abs().view(6, 3, BLOCK).amax(-1, keepdim=True) / 127
    err = (blocks.dequantize() - w).view(6, 3, BLOCK).abs()
    assert (err <= step / 2 * (1 + 1e-5) + 1e-12).all()
    assert torch.equal(blocks.dequantize()[2, 32:64], torch.zeros(32))
    assert quantize_8bit(torch.zeros(3, 40)) is None  # not whole blocks


@needs_kernels
@pytest.mark.parametrize("n", [7, 64, 576])
@pytest.mark.parametrize("threads", THREADS)
def test_rms_norm_matches_float64_and_each_row_stands_alone(n: int, threads: int) -> None:
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(19, n, generator=g) * 4, torch.randn(n, generator=g)
    want = F.rms_norm(x.double(), (n,), w.double(), 1e-5)
    got = KERNELS.rms_norm(x, w, 1e-5, threads)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    for r in (0, 18):
        assert torch.equal(KERNELS.rms_norm(x[r:r + 1].contiguous(), w, 1e-5, 1)[0], got[r])


@needs_kernels
@pytest.mark.parametrize("n", [5, 64, 1536])
@pytest.mark.parametrize("threads", THREADS)
def test_silu_mul_matches_float64_and_each_row_stands_alone(n: int, threads: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(17, 2 * n, generator=g) * 6
    x[0, :4] = torch.tensor([0.0, -90.0, 90.0, -1e-30])  # the exponential's ends
    gate, up = x.double().chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = KERNELS.silu_mul(x, threads)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)
    for r in (0, 16):
        assert torch.equal(KERNELS.silu_mul(x[r:r + 1].contiguous(), 1)[0], got[r])


def f16_case(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, seq_lens: list[int], seed: int):
    """Caches with scattered blocks, and every position of every sequence as a query."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=g).half() for _ in range(2))
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(per_seq)
    tables, used = [], 0
    for n in per_seq:
        tables.append(order[used:used + n] + [0] * (width - n))
        used += n
    seq = [i for i, n in enumerate(seq_lens) for _ in range(n)]
    ctx = [p + 1 for n in seq_lens for p in range(n)]
    q = torch.randn(len(seq), num_heads, head_dim, generator=g) * 2
    as_long = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return q, k_cache, v_cache, as_long(tables), as_long(seq), as_long(ctx)


@needs_kernels
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 128), (4, 2, 16), (6, 2, 12), (4, 4, 8)])
@pytest.mark.parametrize("threads", THREADS)
def test_f16_attention_matches_float64_and_each_query_stands_alone(num_heads: int, num_kv_heads: int,
                                                                   head_dim: int, threads: int) -> None:
    q, kc, vc, tables, seq, ctx = f16_case(num_heads, num_kv_heads, head_dim, 4, [13, 1, 30], seed=head_dim)
    got = KERNELS.paged_attention_f16(q, kc, vc, tables, seq, ctx, head_dim ** -0.5, threads)
    block_size, group = kc.shape[1], num_heads // num_kv_heads
    for t in range(q.shape[0]):
        table, n = tables[seq[t]].tolist(), int(ctx[t])
        slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
        keys = kc.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, n, D)
        values = vc.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1).transpose(0, 1)
        want = F.scaled_dot_product_attention(q[t].double().unsqueeze(1), keys, values).squeeze(1)
        assert torch.allclose(got[t].double(), want, rtol=1e-4, atol=1e-5)
    # A query alone gets the bits it got among all, also where its heads are shared out
    # among the threads (fewer queries than threads).
    for t, alone_threads in itertools.product((0, 12, 13, q.shape[0] - 1), sorted({1, threads})):
        alone = KERNELS.paged_attention_f16(q[t:t + 1].contiguous(), kc, vc, tables, seq[t:t + 1].contiguous(),
                                            ctx[t:t + 1].contiguous(), head_dim ** -0.5, alone_threads)
        assert torch.equal(alone[0], got[t])


def test_fast_without_native_kernels_runs_exact_and_says_so(monkeypatch, caplog) -> None:
    monkeypatch.setattr(ops, "load_native_kernels", lambda: None)
    with caplog.at_level(logging.WARNING, logger="bargein.kernels.ops"):
        kernels = resolve_kernels("cpu", precision="fast")
    assert kernels.native is None and not kernels.fast and kernels.precision == "exact"
    assert [r.getMessage() for r in caplog.records] == [
        "precision 'fast' needs the native CPU kernels and a float32 model, but the native kernels are "
        "unavailable (see above); running 'exact'"]
    monkeypatch.undo()
    if KERNELS is not None:
        assert resolve_kernels("cpu", precision="fast").fast
        assert not resolve_kernels("cpu", precision="fast", dtype=torch.bfloat16).fast
        assert not resolve_kernels("cpu", precision="fast", native=False).fast
    with pytest.raises(ValueError, match="precision must be one of exact, fast"):
        resolve_kernels("cpu", precision="quick")


@needs_kernels
@pytest.mark.parametrize("threads", THREADS)
def test_rope_store_rotates_as_torch_does_and_writes_float16_as_torch_rounds(threads: int) -> None:
    from bargein.model.rope import apply_rotary

    g = torch.Generator().manual_seed(3)
    t, h, kvh, d = 37, 6, 2, 16
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g) * 3
    qkv[0, -1] = 70000.0  # past float16's range: inf, as torch rounds it
    angles = torch.rand(t, 1, d, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    slots = torch.randperm(60, generator=g)[:t]
    k_cache, v_cache = (torch.zeros(15, 4, kvh, d, dtype=torch.float16) for _ in range(2))
    q = KERNELS.rope_store_f16(qkv, cos.view(t, d), sin.view(t, d), slots, k_cache, v_cache, h, threads)
    q_want, k_want = apply_rotary(qkv[:, :h * d].view(t, h, d), qkv[:, h * d:(h + kvh) * d].view(t, kvh, d), cos, sin)
    assert torch.equal(q, q_want)
    assert torch.equal(k_cache.view(-1, kvh, d)[slots], k_want.half())
    assert torch.equal(v_cache.view(-1, kvh, d)[slots], qkv[:, (h + kvh) * d:].view(t, kvh, d).half())
    with pytest.raises(NativeKernelError, match="outside the cache"):
        KERNELS.rope_store_f16(qkv[:1].contiguous(), cos[:1].view(1, d), sin[:1].view(1, d), torch.tensor([60]),
                               k_cache, v_cache, h, 1)


@needs_kernels
def test_a_portable_build_without_vector_extensions_agrees(portable_kernels) -> None:
    """The library built with no -march (as on a CPU without AVX): the int8 matmul gives the
    same bits, the other fast kernels the same values to float rounding, and the portable
    half conversions round as torch does."""
    portable = portable_kernels
    assert [n for n in Q8_ISAS if portable.q8_isa_available(n)] == [n for n in Q8_ISAS if KERNELS.q8_isa_available(n)]
    g = torch.Generator().manual_seed(11)
    for weight in (q4_weight(19, 96, g), q8_weight(9, 64, g)):
        x = torch.randn(5, weight.shape[1], generator=g)
        assert torch.equal(portable.q8_block_matmul(x, weight, 2, "c"), KERNELS.q8_block_matmul(x, weight, 2))
    x, w = torch.randn(6, 40, generator=g), torch.randn(40, generator=g)
    assert torch.allclose(portable.rms_norm(x, w, 1e-6, 1), KERNELS.rms_norm(x, w, 1e-6, 1), rtol=1e-6, atol=1e-6)
    gu = torch.randn(6, 48, generator=g) * 8
    assert torch.allclose(portable.silu_mul(gu, 1), KERNELS.silu_mul(gu, 1), rtol=1e-6, atol=1e-6)
    t, h, kvh, d = 9, 4, 2, 16
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g) * 2
    qkv[0, h * d:h * d + 6] = torch.tensor([70000.0, 65519.0, 65520.0, 3e-8, -2.9e-8, 1e-5])  # the edges of float16
    cos, sin = torch.rand(t, d, generator=g), torch.rand(t, d, generator=g)
    caches = [[torch.zeros(4, 4, kvh, d, dtype=torch.float16) for _ in range(2)] for _ in range(2)]
    slots = torch.arange(t)
    outs = [kern.rope_store_f16(qkv, cos, sin, slots, kc, vc, h, 1) for kern, (kc, vc) in zip((portable, KERNELS), caches,
                                                                                             strict=True)]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    tables, seq, ctx = torch.tensor([[0, 1, 2]]), torch.zeros(t, dtype=torch.int64), torch.arange(1, t + 1)
    got = [kern.paged_attention_f16(outs[0], kc, vc, tables, seq, ctx, d ** -0.5, 1)
           for kern, (kc, vc) in zip((portable, KERNELS), caches, strict=True)]
    assert torch.allclose(got[0], got[1], rtol=1e-5, atol=1e-6)
