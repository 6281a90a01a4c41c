"""The `fast` precision on a tiny model: a token's logits and K/V do not depend on what
shares its forward or on the thread count, bit for bit; and it stays close to `exact`."""

from __future__ import annotations

import pytest
import torch

from bargein.config import CacheConfig, EngineConfig
from bargein.engine.device import build_model
from bargein.kernels.half_rows import is_half
from bargein.model.attention import AttentionMetadata, KVCache
from bargein.model.llama import LlamaStage
from tests.tiny_engine import TINY, tiny_weights
from tests.torch_threads import torch_threads

KERNELS_FAST = build_model(TINY, dict(tiny_weights(0)), EngineConfig(precision="fast")).kernels.fast
pytestmark = pytest.mark.skipif(not KERNELS_FAST, reason="no native kernels here: fast runs as exact")
BLOCK = 4


def model(precision: str) -> LlamaStage:
    config = EngineConfig(precision=precision, cache=CacheConfig(block_size=BLOCK, num_blocks=64))
    return build_model(TINY, dict(tiny_weights(0)), config, max_positions=TINY.max_position_embeddings)


def forward(stage: LlamaStage, caches: list[KVCache], steps: list[tuple[int, list[int], int]],
            tables: dict[int, list[int]]) -> list[torch.Tensor]:
    """One forward over several sequences: (seq, new tokens, tokens already cached) each;
    returns each sequence's logits rows."""
    ids = torch.tensor([t for _, new, _ in steps for t in new])
    positions = torch.tensor([done + i for _, new, done in steps for i in range(len(new))])
    meta = AttentionMetadata.build(block_tables=[tables[s] for s, _, _ in steps],
                                   query_lens=[len(new) for _, new, _ in steps],
                                   context_lens=[done + len(new) for _, new, done in steps], block_size=BLOCK)
    logits = stage(ids, positions, meta, caches, torch.arange(len(ids)))
    return list(logits.split([len(new) for _, new, _ in steps]))


def token_stream(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_one_prefill_equals_decoding_token_by_token_in_logits_and_kv() -> None:
    """What a decode step writes is what a prefill of the same tokens writes (C4 exactly)."""
    stage, tokens, table = model("fast"), token_stream(1, 23), {0: list(range(6))}
    whole = stage.make_kv_caches(8, BLOCK)
    (full,) = forward(stage, whole, [(0, tokens, 0)], table)
    stepwise = stage.make_kv_caches(8, BLOCK)
    rows = forward(stage, stepwise, [(0, tokens[:9], 0)], table)
    rows += [forward(stage, stepwise, [(0, [t], 9 + i)], table)[0] for i, t in enumerate(tokens[9:])]
    assert torch.equal(torch.cat(rows), full)
    for a, b in zip(whole, stepwise, strict=True):
        assert a.k.dtype == torch.float16 and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_a_sequence_gets_the_same_bits_alone_or_batched_at_any_thread_count(num_threads: int) -> None:
    stage = model("fast")
    a, b, c = token_stream(2, 17), token_stream(3, 30), token_stream(4, 5)
    tables = {0: list(range(0, 8)), 1: list(range(8, 17)), 2: list(range(17, 25))}
    with torch_threads(1):
        alone = stage.make_kv_caches(32, BLOCK)
        (a_prefill,) = forward(stage, alone, [(0, a[:16], 0)], tables)
        (a_decode,) = forward(stage, alone, [(0, a[16:], 16)], tables)
    with torch_threads(num_threads):
        mixed = stage.make_kv_caches(32, BLOCK)
        forward(stage, mixed, [(1, b[:20], 0)], tables)
        # a's prompt beside another's prompt chunk and a third's whole prompt
        _, a_mixed, _ = forward(stage, mixed, [(1, b[20:], 20), (0, a[:16], 0), (2, c, 0)], tables)
        # a's decode beside a decode and a prompt chunk
        _, a_mixed_decode, _ = forward(stage, mixed, [(2, [7], 5), (0, a[16:], 16), (1, [9, 8, 7], 30)], tables)
    assert torch.equal(a_mixed, a_prefill) and torch.equal(a_mixed_decode, a_decode)
    for x, y in zip(alone, mixed, strict=True):
        for cache_a, cache_m in ((x.k, y.k), (x.v, y.v)):
            assert torch.equal(cache_a[:5], cache_m[:5])  # a's 17 tokens: blocks 0-4


def test_fast_stays_close_to_exact_and_holds_its_float32_weights_as_16_bit_rows() -> None:
    exact, fast = model("exact"), model("fast")
    tokens, table = token_stream(5, 40), {0: list(range(10))}
    (want,) = forward(exact, exact.make_kv_caches(12, BLOCK), [(0, tokens, 0)], table)
    (got,) = forward(fast, fast.make_kv_caches(12, BLOCK), [(0, tokens, 0)], table)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    linears = [fast.lm_head] + [m for layer in fast.layers for m in (layer.attention.wqkv, layer.attention.wo,
                                                                     layer.feed_forward.w13, layer.feed_forward.w2)]
    # float-source weights: 16-bit rows (half_matmul.c), no float32 copy and no int8 re-quantization
    assert all(is_half(lin.quant) and lin.blocks is None and not lin.holds_dense for lin in linears)
    assert fast.kv_bytes_per_block(BLOCK) * 2 == exact.kv_bytes_per_block(BLOCK)  # float16 K/V
