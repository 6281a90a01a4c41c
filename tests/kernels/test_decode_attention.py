"""The float16 attention's one-query path (attention_f16.c's attend_one, a decode): it walks
the keys a block at a time, four keys' scores at once, every head of its share reading a
block's rows together, and continues each output's chain from block to block. Whatever
the block size (one that is not a multiple of four, one token), a window that starts
inside a block, a soft cap, or how the threads share the heads out, a query alone gets the
bits it gets as one row of a prompt (the tile paths), and the float64 attention to float
rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bargein.kernels.native import load_native_kernels

KERNELS = load_native_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler here")


def case(num_heads: int, num_kv_heads: int, head_dim: int, length: int, block_size: int):
    """Random float16 caches, a shuffled block table, every position of one sequence as a query."""
    g = torch.Generator().manual_seed(block_size * 1000 + length)
    num_blocks = -(-length // block_size) + 2
    k_cache, v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).half()
                        for _ in range(2))
    table = torch.randperm(num_blocks, generator=g)[:-(-length // block_size)].reshape(1, -1)
    q = torch.randn(length, num_heads, head_dim, generator=g)
    return q, k_cache, v_cache, table, torch.zeros(length, dtype=torch.int64), torch.arange(1, length + 1)


def reference(q, kc, vc, table, n, scale, window, softcap):
    """Query at position n - 1 over its positions, in float64."""
    block_size, group = kc.shape[1], q.shape[0] // kc.shape[2]
    first = max(0, n - window) if window else 0
    slots = [int(table[0, p // block_size]) * block_size + p % block_size for p in range(first, n)]
    keys = kc.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1).transpose(0, 1)
    values = vc.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().unsqueeze(1) @ keys.transpose(1, 2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return (F.softmax(scores, dim=-1) @ values).squeeze(1)


@pytest.mark.parametrize(("block_size", "window", "softcap"), [(16, None, None), (7, None, 3.0), (1, None, None),
                                                                (7, 23, None), (16, 50, None)])
def test_a_decode_gets_the_bits_of_its_prompt_row_and_the_float64_answer(block_size, window, softcap):
    q, kc, vc, table, seq, ctx = case(9, 3, 64, 131, block_size)
    scale = 64 ** -0.5
    prompt = KERNELS.paged_attention_f16(q, kc, vc, table, seq, ctx, scale, 2, window=window, softcap=softcap)
    for n in (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 63, 100, 131):
        for threads in (1, 2, 4):
            alone = KERNELS.paged_attention_f16(q[n - 1:n].contiguous(), kc, vc, table, seq[:1].contiguous(),
                                                ctx[n - 1:n].contiguous(), scale, threads, window=window,
                                                softcap=softcap)
            assert torch.equal(alone[0], prompt[n - 1]), (n, threads)
        torch.testing.assert_close(prompt[n - 1].double(), reference(q[n - 1], kc, vc, table, n, scale, window, softcap),
                                   rtol=1e-4, atol=1e-5)


def test_decodes_of_several_sequences_get_the_bits_each_gets_alone():
    """A batch of decodes (one tile each, heads not split) and a head-dim of two 64-wide halves."""
    q, kc, vc, table, _, _ = case(4, 2, 128, 70, 16)
    lengths = torch.tensor([70, 1, 33, 64])
    queries = q[:4].contiguous()
    tables = table.repeat(4, 1)
    batch = KERNELS.paged_attention_f16(queries, kc, vc, tables, torch.arange(4), lengths, 0.1, 3)
    for i in range(4):
        alone = KERNELS.paged_attention_f16(queries[i:i + 1].contiguous(), kc, vc, tables, torch.tensor([i]),
                                            lengths[i:i + 1].contiguous(), 0.1, 2)
        assert torch.equal(alone[0], batch[i]), i
        torch.testing.assert_close(batch[i].double(), reference(queries[i], kc, vc, table, int(lengths[i]), 0.1,
                                                                None, None), rtol=1e-4, atol=1e-5)
