"""The float16 attention's prompt path over contexts of several key chunks (attention_f16.c's
attend_prompt on x86, attention_prompt_x86.h: tiles of up to 64 queries, their (query,
head) rows of one KV head register-tiled, keys widened 48 at a time, each output's chain
continued from chunk to chunk): every query of a prompt tile gets the bits it gets alone (a decode: attend_one,
or attend_tile where the head size is not a multiple of 64), whatever the group size (rows
not a multiple of the register tiles), a sliding window that starts inside a chunk, a soft
cap, or the thread count (1 or 3, heads shared out where tiles are few); and the float64
attention to float rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bargein.kernels.native import load_native_kernels

KERNELS = load_native_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler here")


def case(num_heads: int, num_kv_heads: int, head_dim: int, seq_lens: list[int], block_size: int = 16):
    """Random float16 caches, shuffled block tables, and every position of each sequence as a query."""
    g = torch.Generator().manual_seed(head_dim + len(seq_lens))
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 1
    k_cache, v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).half()
                        for _ in range(2))
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in per_seq:
        tables.append(order[used:used + n] + [0] * (max(per_seq) - n))
        used += n
    seq = torch.tensor([i for i, n in enumerate(seq_lens) for _ in range(n)])
    ctx = torch.tensor([p + 1 for n in seq_lens for p in range(n)])
    q = torch.randn(len(seq), num_heads, head_dim, generator=g)
    return q, k_cache, v_cache, torch.tensor(tables), seq, ctx


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "softcap"),
                         [(9, 3, 64, None), (4, 2, 128, None), (32, 8, 64, None), (6, 2, 96, 2.0), (5, 5, 64, 3.0)])
@pytest.mark.parametrize("window", [None, 50])
def test_prompt_tiles_over_many_key_chunks_equal_each_query_alone(num_heads, num_kv_heads, head_dim, softcap, window):
    q, kc, vc, tables, seq, ctx = case(num_heads, num_kv_heads, head_dim, [150, 3, 70])
    scale = head_dim ** -0.5
    got = KERNELS.paged_attention_f16(q, kc, vc, tables, seq, ctx, scale, 3, window=window, softcap=softcap)
    one_thread = KERNELS.paged_attention_f16(q, kc, vc, tables, seq, ctx, scale, 1, window=window, softcap=softcap)
    assert torch.equal(one_thread, got)
    block_size, group = kc.shape[1], num_heads // num_kv_heads
    # 112: with a window of 50, its window starts at 63, the end of the first key chunk of
    # the tile of queries 64-127 (earliest position 15), beside query 113's at 64.
    for t in (0, 1, 47, 48, 49, 63, 64, 65, 96, 100, 112, 149, 150, 152, 153, 200, 222):
        alone = KERNELS.paged_attention_f16(q[t:t + 1].contiguous(), kc, vc, tables, seq[t:t + 1].contiguous(),
                                            ctx[t:t + 1].contiguous(), scale, 2, window=window, softcap=softcap)
        assert torch.equal(alone[0], got[t]), t
        # A short prompt (fewer tiles than threads: heads shared out, a group split between them).
        few = KERNELS.paged_attention_f16(q[t:t + 3].contiguous(), kc, vc, tables, seq[t:t + 3].contiguous(),
                                          ctx[t:t + 3].contiguous(), scale, 3, window=window, softcap=softcap)
        assert torch.equal(few, got[t:t + 3]), t
        n = int(ctx[t])
        first = max(0, n - window) if window else 0
        table = tables[seq[t]].tolist()
        slots = [table[p // block_size] * block_size + p % block_size for p in range(first, n)]
        keys = kc.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1).transpose(0, 1)
        values = vc.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q[t].double().unsqueeze(1) @ keys.transpose(1, 2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        want = (F.softmax(scores, dim=-1) @ values).squeeze(1)
        torch.testing.assert_close(got[t].double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_a_tile_whose_windows_start_more_than_a_key_chunk_apart_equals_each_query_alone(softcap):
    """Queries of one sequence need not be consecutive (the kernel takes any contexts): with a
    window, one tile's rows may start their windows beyond the key chunk another row is in;
    each row's values then still stop at the chunk's end (nothing read past it, nothing
    counted twice)."""
    q, kc, vc, tables, _, _ = case(4, 2, 64, [220])
    picks = [9, 99, 100, 149, 219]
    q = q[picks].contiguous()
    seq = torch.zeros(len(picks), dtype=torch.long)
    ctx = torch.tensor([p + 1 for p in picks])
    scale = 64 ** -0.5
    got = KERNELS.paged_attention_f16(q, kc, vc, tables, seq, ctx, scale, 1, window=50, softcap=softcap)
    for i in range(len(picks)):
        alone = KERNELS.paged_attention_f16(q[i:i + 1].contiguous(), kc, vc, tables, seq[i:i + 1].contiguous(),
                                            ctx[i:i + 1].contiguous(), scale, 1, window=50, softcap=softcap)
        assert torch.equal(alone[0], got[i]), picks[i]


@pytest.mark.parametrize("window", [None, 4000])
def test_a_long_context_takes_smaller_tiles_with_the_same_bits(window):
    """Past 16 MB of a thread's score rows (64 queries x a group of 8 x 8,300 positions here)
    the prompt path takes tiles of 32 queries (attention_f16.c's prompt_tile_for): a chunk of
    70 queries after 8,230 cached positions still gets each query's bits alone, on 1 and 3
    threads, across the tiles' edges at 32 and 64."""
    cached, new = 8230, 70
    q, kc, vc, tables, seq, ctx = case(8, 1, 64, [cached + new])
    q, seq, ctx = (t[cached:].contiguous() for t in (q, seq, ctx))
    scale = 64 ** -0.5
    got = KERNELS.paged_attention_f16(q, kc, vc, tables, seq, ctx, scale, 3, window=window)
    assert torch.equal(KERNELS.paged_attention_f16(q, kc, vc, tables, seq, ctx, scale, 1, window=window), got)
    for t in (0, 31, 32, 33, 63, 64, 69):
        alone = KERNELS.paged_attention_f16(q[t:t + 1].contiguous(), kc, vc, tables, seq[t:t + 1].contiguous(),
                                            ctx[t:t + 1].contiguous(), scale, 1, window=window)
        assert torch.equal(alone[0], got[t]), t


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "softcap"),
                         [(9, 3, 64, None), (32, 8, 64, None), (4, 2, 128, None), (8, 8, 64, None),
                          (6, 2, 96, 2.0), (5, 5, 64, 3.0)])
@pytest.mark.parametrize("window", [None, 50])
def test_an_avx2_build_gives_the_native_builds_bits(avx2_attention_kernels, num_heads, num_kv_heads, head_dim,
                                                    softcap, window):
    """The 256-bit prompt path (score steps of 3 rows x 4 keys, two rows' sums at once) as an
    AVX2-only machine builds it, against this machine's build (with AVX-512: its
    transposed 16-key steps; on an AVX2-only machine the same path): the same bits for every
    query, over row counts that leave 1 and 2 rows of a step, keys past the last whole four
    of a chunk, a window, a soft cap (the scalar scores), 1 and 3 threads."""
    q, kc, vc, tables, seq, ctx = case(num_heads, num_kv_heads, head_dim, [150, 3, 70])
    scale = head_dim ** -0.5
    want = KERNELS.paged_attention_f16(q, kc, vc, tables, seq, ctx, scale, 2, window=window, softcap=softcap)
    for threads in (1, 3):
        got = avx2_attention_kernels.paged_attention_f16(q, kc, vc, tables, seq, ctx, scale, threads, window=window,
                                                         softcap=softcap)
        assert torch.equal(got, want), threads
