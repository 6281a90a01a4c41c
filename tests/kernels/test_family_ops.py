"""The native operations the newer families add to the ``fast`` path (GeGLU, soft cap, and
attention with a sliding window, soft-capped scores and a scale of its own): each against
a float64 PyTorch reference, and each row's bits independent of the rows beside it and of
the thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bargein.kernels.native import load_native_kernels
from bargein.model.attention import AttentionMetadata, KVCache, _window_attention

KERNELS = load_native_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler here")


def _rows(m: int, n: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(m, n, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("n", [7, 64, 200])
def test_gelu_tanh_mul_matches_the_reference_row_by_row(n: int) -> None:
    x = _rows(37, 2 * n, seed=n)
    gate, up = x.double().chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    got = KERNELS.gelu_tanh_mul(x, 2)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    for threads in (1, 3):  # one row alone, or among others at any thread count: the same bits
        assert torch.equal(KERNELS.gelu_tanh_mul(x[5:6].contiguous(), threads), got[5:6])
        assert torch.equal(KERNELS.gelu_tanh_mul(x, threads), got)


def test_softcap_matches_the_reference_and_is_row_invariant() -> None:
    x = _rows(19, 320, seed=1, scale=40.0)
    got = KERNELS.softcap(x, 30.0, 2)
    torch.testing.assert_close(got.double(), torch.tanh(x.double() / 30.0) * 30.0, atol=1e-5, rtol=1e-5)
    assert got.abs().max() < 30.0
    assert torch.equal(KERNELS.softcap(x[3:4].contiguous(), 30.0, 1), got[3:4])


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between float32 tensors (ordered bit patterns)."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int32).long()
        return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)
    return (ordered(got) - ordered(want)).abs()


def test_the_kernels_tanh_is_within_two_ulp_everywhere_and_exact_at_its_limits() -> None:
    # Every float32 in [0.5, 16) and a fine grid elsewhere; a cap of 1 makes softcap tanh itself.
    dense = torch.arange(0x3F000000, 0x41800000, 7, dtype=torch.int32).view(torch.float32)
    grid = torch.cat([dense, torch.linspace(-0.5, 0.5, 200_001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-42])])
    x = torch.cat([grid, -dense]).reshape(1, -1).contiguous()
    got = KERNELS.softcap(x, 1.0, 2)
    want = torch.tanh(x.double()).float()
    assert _ulps(got, want).max().item() <= 2
    special = torch.tensor([[float("inf"), -float("inf"), float("nan"), 9.1, -9.1, 1e30]])
    out = KERNELS.softcap(special, 1.0, 1)[0].tolist()
    assert out[:2] == [1.0, -1.0] and out[2] != out[2] and out[3:] == [1.0, -1.0, 1.0]
    assert torch.equal(KERNELS.softcap(torch.tensor([[-0.0]]), 1.0, 1).view(torch.int32),
                       torch.tensor([[-0.0]]).view(torch.int32))  # the sign of zero is kept


def test_the_vector_bodies_give_the_scalar_tails_bits() -> None:
    """GeGLU and the soft cap over whole eights (AVX2 / NEON bodies) against the same values
    each alone in a row of one (the scalar tail): the same bits, over every branch of the tanh
    (the polynomial, the exp, the saturated ends, NaN, signed zeros)."""
    values = torch.cat([_rows(1, 4096, seed=5).view(-1), torch.linspace(-12.0, 12.0, 4001),
                        torch.tensor([0.0, -0.0, 0.624999, 0.625, 9.099999, 9.1, 1e-30, 3e38, -3e38, float("inf"),
                                      -float("inf"), float("nan")])])
    n = values.numel() // 8 * 8
    wide = values[:n].reshape(1, -1).contiguous()
    for cap in (1.0, 30.0):
        assert torch.equal(KERNELS.softcap(wide, cap, 1).view(torch.int32).view(-1),
                           KERNELS.softcap(wide.reshape(-1, 1).contiguous(), cap, 1).view(torch.int32).view(-1))
    up = _rows(1, n, seed=6)
    rows = torch.cat([wide, up], dim=1)
    alone = torch.stack([wide.view(-1), up.view(-1)], dim=1).contiguous()  # n rows of one gate and one up
    assert torch.equal(KERNELS.gelu_tanh_mul(rows, 2).view(torch.int32).view(-1),
                       KERNELS.gelu_tanh_mul(alone, 2).view(torch.int32).view(-1))


def _case(head_dim: int, ctx: int, block_size: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads = 4, 2
    blocks = -(-ctx // block_size)
    num_blocks = blocks + 3
    k = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)).half()
    v = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)).half()
    table = torch.randperm(num_blocks, generator=g)[:blocks].tolist()
    q = torch.randn(ctx, heads, head_dim, generator=g) * 2
    return q, KVCache(k, v), table


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize(("window", "softcap"), [(8, None), (None, 5.0), (5, 5.0), (100, None)])
def test_attention_with_a_window_and_a_soft_cap_matches_the_reference(head_dim: int, window: int | None,
                                                                      softcap: float | None) -> None:
    ctx, bs = 30, 4
    q, cache, table = _case(head_dim, ctx, bs, seed=head_dim)
    scale = 0.3
    want = _window_attention(q.double(), KVCache(cache.k.double(), cache.v.double()), torch.tensor(table), ctx,
                             window, softcap, scale)
    meta = AttentionMetadata.build(block_tables=[table], query_lens=[ctx], context_lens=[ctx], block_size=bs,
                                   decode_batch=False)
    args = (cache.k, cache.v, meta.block_tables, meta.token_seq, meta.token_context, scale)
    got = KERNELS.paged_attention_f16(q, *args, 2, window=window, softcap=softcap)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    # Each query alone (a decode, through the one-query path where head_dim allows) gives the same bits.
    for i in (0, 7, 8, ctx - 1):
        alone = AttentionMetadata.build(block_tables=[table], query_lens=[1], context_lens=[i + 1], block_size=bs,
                                        decode_batch=False)
        one = KERNELS.paged_attention_f16(q[i:i + 1].contiguous(), cache.k, cache.v, alone.block_tables,
                                          alone.token_seq, alone.token_context, scale, 3, window=window,
                                          softcap=softcap)
        assert torch.equal(one, got[i:i + 1])


def test_a_windowed_query_reads_no_block_before_its_window() -> None:
    """Blocks wholly before the window may hold anything (here NaN): the result is unchanged."""
    ctx, bs, window = 24, 4, 8
    q, cache, table = _case(16, ctx, bs, seed=3)
    meta = AttentionMetadata.build(block_tables=[table], query_lens=[1], context_lens=[ctx], block_size=bs,
                                   decode_batch=False)
    call = (q[-1:].contiguous(), cache.k, cache.v, meta.block_tables, meta.token_seq, meta.token_context, 0.25, 1)
    before = KERNELS.paged_attention_f16(*call, window=window)
    for b in table[: (ctx - window) // bs]:  # positions 0..15: outside the last query's window
        cache.k[b] = float("nan")
        cache.v[b] = float("nan")
    assert torch.equal(KERNELS.paged_attention_f16(*call, window=window), before)
