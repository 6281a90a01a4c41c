"""The fast precision's fused layer call (bargein/kernels/fast_forward.c) against the
per-operation path it replaces: the same logits and the same K/V, bit for bit, for any
mix of prompt chunks and decodes, at 1 and 2 threads, on 4- and 8-bit weights, with and
without q/k/v biases, with a tied or separate LM head, an embedding held dense or in
4-/8-bit blocks, for any logits rows, and for a pipeline stage in the middle of the model."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from bargein.config import ModelConfig
from bargein.kernels.block_quant import BlockWeight, quantize_8bit
from bargein.kernels.ops import resolve_kernels
from bargein.model.attention import AttentionMetadata
from bargein.model.llama import LlamaStage
from tests.kernels.fused_checks import (
    BLOCK,
    NUM_BLOCKS,
    STEPS,
    TABLES,
    A,
    assert_hidden_forwards_equal,
    assert_same_caches,
    assert_token_forwards_equal,
    fused_and_per_op,
    run,
)
from tests.tiny_engine import TINY, tiny_weights

FAST = resolve_kernels("cpu", precision="fast")
pytestmark = pytest.mark.skipif(not FAST.fast, reason="no native kernels here: fast runs as exact")
BIASED = dataclasses.replace(TINY, num_layers=3, attention_bias=True)
TIED = dataclasses.replace(TINY, tie_word_embeddings=True)


def q4_blocks(rows: int, cols: int, seed: int) -> BlockWeight:
    """A random weight held as Q4_1 blocks (scales and mins float32)."""
    g = torch.Generator().manual_seed(seed)
    qs = torch.randint(0, 256, (rows, cols // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.rand(rows, cols // 32, generator=g) * 0.02
    return BlockWeight(4, qs, scales, -8 * scales + 0.001 * torch.randn(rows, cols // 32, generator=g))


def weights(config: ModelConfig, seed: int, embed: str) -> dict[str, torch.Tensor | BlockWeight]:
    """Random weights: the embedding dense, "q4" or "q8"; layer 0's linears held in Q4_1
    blocks, the others dense (fast quantizes them to 8-bit blocks); q/k/v biases where the
    config has them."""
    g = torch.Generator().manual_seed(seed)
    h, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    shapes = {"wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q), "w1": (f, h), "w3": (f, h), "w2": (h, f)}
    table = torch.randn(config.vocab_size, h, generator=g)
    held = {"dense": table, "q4": q4_blocks(config.vocab_size, h, seed), "q8": quantize_8bit(table)}[embed]
    w: dict[str, torch.Tensor | BlockWeight] = {"embed.weight": held,
                                                "norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                                                "lm_head.weight": torch.randn(config.vocab_size, h, generator=g) / 8}
    for i in range(config.num_layers):
        w[f"layers.{i}.attn_norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        w[f"layers.{i}.ffn_norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        for name, (n, k) in shapes.items():
            w[f"layers.{i}.{name}.weight"] = (q4_blocks(n, k, seed * 100 + i * 10 + len(w)) if i == 0
                                              else torch.randn(n, k, generator=g) / k ** 0.5)
        if config.attention_bias:
            for name in ("wq", "wk", "wv"):
                w[f"layers.{i}.{name}.bias"] = 0.1 * torch.randn(shapes[name][0], generator=g)
    return w


def stage_pair(config: ModelConfig, layer_range: tuple[int, int] | None = None,
               embed: str = "q4") -> tuple[LlamaStage, LlamaStage]:
    """The same random weights as a fused stage and a per-operation one."""
    return fused_and_per_op(config, weights(config, 0, embed), layer_range, FAST)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize(("config", "embed"), [(TINY, "q4"), (BIASED, "q8"), (TIED, "dense")],
                         ids=["llama-q4-embed", "qkv-bias-q8-embed", "tied-head-dense-embed"])
def test_the_fused_layers_give_the_per_operation_bits(config: ModelConfig, embed: str, num_threads: int) -> None:
    caches = assert_token_forwards_equal(*stage_pair(config, embed=embed), num_threads)
    assert caches[0].k.abs().sum() > 0  # something was written


@pytest.mark.parametrize("rows", ["last", "scattered", "none", None])
def test_the_fused_head_computes_the_rows_asked_for(rows: str | None) -> None:
    """Where the head asks for some rows only, the last layer's attention and MLP run on
    those alone (fast_forward.c's rows_t): the logits of every row asked for, in any order
    and twice over, and every layer's K/V (which the next forwards read) keep their bits."""
    fused, per_op = stage_pair(TINY)
    caches_fused, caches_per_op = fused.make_kv_caches(40, BLOCK), per_op.make_kv_caches(40, BLOCK)
    for steps in STEPS:
        got, want = run(fused, caches_fused, steps, rows=rows), run(per_op, caches_per_op, steps, rows=rows)
        total = sum(len(n) for _, n, _ in steps)
        expected = {"last": len(steps), "scattered": 3, "none": 0, None: total}[rows]
        assert got.shape == (expected, TINY.vocab_size)
        assert torch.equal(got, want)
        assert_same_caches(caches_fused, caches_per_op)


def test_a_middle_stage_is_fused_and_leaves_its_input_alone() -> None:
    config = dataclasses.replace(BIASED, num_layers=4)
    fused, per_op = stage_pair(config, (1, 3))
    assert not fused.is_first and not fused.is_last
    assert_hidden_forwards_equal(fused, per_op, STEPS[:4])


def test_other_caches_are_bound_when_a_forward_brings_them() -> None:
    fused, per_op = stage_pair(TINY)
    first, second, reference = (fused.make_kv_caches(40, BLOCK), fused.make_kv_caches(40, BLOCK),
                                per_op.make_kv_caches(40, BLOCK))
    want = run(per_op, reference, STEPS[2])
    assert torch.equal(run(fused, first, STEPS[2]), want)
    assert torch.equal(run(fused, second, STEPS[2]), want)
    assert_same_caches(first, reference)
    assert_same_caches(second, reference)


def test_a_slot_outside_the_cache_is_refused_before_anything_is_written() -> None:
    fused, _ = stage_pair(TINY)
    caches = fused.make_kv_caches(2, BLOCK)  # 8 slots; table 0's block 3 lies past them
    meta = AttentionMetadata.build(block_tables=[[0, 3]], query_lens=[6], context_lens=[6], block_size=BLOCK)
    with pytest.raises(RuntimeError, match="slot lies outside the cache"):
        fused(torch.tensor(A[:6]), torch.arange(6), meta, caches)
    assert all(c.k.abs().sum() == 0 and c.v.abs().sum() == 0 for c in caches)


def test_the_calls_buffers_are_kept_and_grown_to_the_largest_call() -> None:
    """One workspace per fused stage, reused by every call that fits in it (a prompt
    chunk's buffers are not mapped, faulted and zeroed anew each time), grown by a larger
    one; the bits stay the per-operation path's whatever the last call left in it."""
    fused, per_op = stage_pair(TINY)
    caches_fused, caches_per_op = fused.make_kv_caches(NUM_BLOCKS, BLOCK), per_op.make_kv_caches(NUM_BLOCKS, BLOCK)
    held = []
    for steps in STEPS:  # rows 1, 3, 21, 11, 28, 1
        assert torch.equal(run(fused, caches_fused, steps), run(per_op, caches_per_op, steps))
        workspace = fused.fused._workspace
        held.append((workspace.data_ptr(), workspace.numel()))
    native, shape = fused.fused.native, fused.fused._shape
    assert [n for _, n in held] == [native.fast_workspace_floats(shape, rows) for rows in (1, 3, 21, 21, 28, 28)]
    assert held[2][0] == held[3][0] and held[4][0] == held[5][0]  # the same memory, not a new allocation


def test_a_workspace_smaller_than_the_call_needs_is_refused_before_anything_is_written(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fused, _ = stage_pair(TINY)
    native = fused.fused.native
    needed = native.fast_workspace_floats
    monkeypatch.setattr(native, "fast_workspace_floats", lambda shape, rows: needed(shape, rows) - 1)
    caches = fused.make_kv_caches(NUM_BLOCKS, BLOCK)
    meta = AttentionMetadata.build(block_tables=[TABLES[0]], query_lens=[6], context_lens=[6], block_size=BLOCK)
    with pytest.raises(RuntimeError, match="workspace is smaller"):
        fused(torch.tensor(A[:6]), torch.arange(6), meta, caches)
    assert all(c.k.abs().sum() == 0 and c.v.abs().sum() == 0 for c in caches)


def test_positions_past_the_rope_tables_and_rows_past_the_forward_are_refused() -> None:
    fused, _ = stage_pair(TINY)
    caches = fused.make_kv_caches(40, BLOCK)
    far = TINY.max_position_embeddings
    meta = AttentionMetadata.build(block_tables=[TABLES[0]], query_lens=[1], context_lens=[1], block_size=BLOCK)
    with pytest.raises(RuntimeError, match="position lies outside the RoPE tables"):
        fused(torch.tensor([1]), torch.tensor([far]), meta, caches)
    with pytest.raises(RuntimeError, match="logits row is not a row of the forward"):
        fused(torch.tensor([1]), torch.tensor([0]), meta, caches, torch.tensor([1]))
    with pytest.raises(RuntimeError, match="token id is not in the vocabulary"):
        fused(torch.tensor([TINY.vocab_size]), torch.tensor([0]), meta, caches)
    assert all(c.k.abs().sum() == 0 for c in caches)


def test_a_model_that_does_not_fit_the_fused_call_runs_per_operation() -> None:
    exact = LlamaStage(TINY, dict(tiny_weights(0)), kernels=resolve_kernels("cpu", precision="exact"))
    assert exact.fused is None


def test_two_threads_sharing_a_stage_each_get_their_own_caches_bits() -> None:
    """Two engines may share one model: each call's caches and rows are its own."""
    fused, per_op = stage_pair(TINY)
    reference = per_op.make_kv_caches(40, BLOCK)
    want = [run(per_op, reference, steps) for steps in STEPS]
    results: dict[int, list[torch.Tensor]] = {}
    caches = {i: fused.make_kv_caches(40, BLOCK) for i in range(2)}

    def worker(i: int) -> None:
        results[i] = [run(fused, caches[i], steps) for steps in STEPS for _ in range(3)][::3]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert all(torch.equal(g, w) for g, w in zip(results[i], want, strict=True))
        assert_same_caches(caches[i], reference)
