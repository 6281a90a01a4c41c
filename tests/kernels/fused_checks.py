"""The comparison of the fused fast forward (fast_forward.c) with the per-operation path,
shared by the fused tests: forwards over three sequences' block tables, mixing prompt
chunks and decodes; logits and K/V compared bit for bit."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from bargein.config import ModelConfig
from bargein.kernels.block_quant import BlockWeight
from bargein.kernels.ops import KernelSet
from bargein.loader import load_config, load_weights, resolve_model_ref
from bargein.model.attention import AttentionMetadata, KVCache
from bargein.model.llama import LlamaStage

BLOCK = 4
NUM_BLOCKS = 40


@functools.cache
def load_blocks(path: str | Path) -> tuple[ModelConfig, dict]:
    """A model file's config and its weights as the fused forward takes them (blocks), loaded
    once per path for the module's cases."""
    source = resolve_model_ref(path)
    config = load_config(source)
    return config, dict(load_weights(source, config, blocks=True, progress=False))


def token_stream(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Forwards over three sequences' tables: (seq, tokens, already cached) per sequence, in turn;
# prompt chunks, decodes and both mixed in one forward, with 1, 3 and many rows.
TABLES = {0: list(range(0, 12)), 1: list(range(12, 24)), 2: list(range(24, 36))}
A, B, C = token_stream(1, 40), token_stream(2, 33), token_stream(3, 9)
STEPS = [
    [(0, A[:1], 0)],                                  # one row
    [(0, A[1:4], 1)],                                 # three rows, one chunk
    [(1, B[:20], 0), (0, A[4:5], 4)],                 # a long chunk beside a decode
    [(0, A[5:6], 5), (1, B[20:21], 20), (2, C, 0)],   # two decodes and a whole prompt
    [(2, [7], 9), (0, A[6:30], 6), (1, B[21:24], 21)],
    [(0, A[30:31], 30)],
]


def run(stage: LlamaStage, caches: list[KVCache], steps: list[tuple[int, list[int], int]],
        inputs: torch.Tensor | None = None, rows: str | None = "all") -> torch.Tensor:
    """One forward; logits of every row, of each sequence's last row ("last"), of the last
    row, the first and the last again ("scattered"), of none ("none") or of all rows by
    default (None: the stage's own default)."""
    ids = torch.tensor([t for _, new, _ in steps for t in new])
    positions = torch.tensor([done + i for _, new, done in steps for i in range(len(new))])
    meta = AttentionMetadata.build(block_tables=[TABLES[s] for s, _, _ in steps],
                                   query_lens=[len(new) for _, new, _ in steps],
                                   context_lens=[done + len(new) for _, new, done in steps], block_size=BLOCK)
    x = ids if inputs is None else inputs
    ends = torch.tensor([len(new) for _, new, _ in steps]).cumsum(0) - 1
    scattered = torch.tensor([len(ids) - 1, 0, len(ids) - 1])  # out of order, one row twice
    indices = {"all": torch.arange(len(ids)), "last": ends, "scattered": scattered,
               "none": torch.zeros(0, dtype=torch.int64), None: None}[rows]
    return stage(x, positions, meta, caches, indices if stage.is_last else None)


def assert_same_caches(a: list[KVCache], b: list[KVCache]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.k.dtype == torch.float16 and torch.equal(x.k, y.k) and torch.equal(x.v, y.v)


def fused_and_per_op(config: ModelConfig, weights: dict[str, torch.Tensor | BlockWeight],
                     layer_range: tuple[int, int] | None, kernels: KernelSet) -> tuple[LlamaStage, LlamaStage]:
    """The same weights as a fused stage and a per-operation one; the fused one holds the
    embedding exactly where it is the first stage and the head where it is the last."""
    fused = LlamaStage(config, weights, layer_range, kernels=kernels)
    per_op = LlamaStage(config, weights, layer_range, kernels=kernels, fuse_layers=False)
    assert fused.fused is not None and per_op.fused is None
    assert fused.fused.has_head == fused.is_last and fused.fused.has_embed == fused.is_first
    return fused, per_op


def assert_token_forwards_equal(fused: LlamaStage, per_op: LlamaStage, num_threads: int) -> list[KVCache]:
    """Every forward of :data:`STEPS` from token ids at ``num_threads`` torch threads: the
    same logits and K/V after each; the fused stage's caches."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        caches_fused, caches_per_op = fused.make_kv_caches(NUM_BLOCKS, BLOCK), per_op.make_kv_caches(NUM_BLOCKS, BLOCK)
        for steps in STEPS:
            got, want = run(fused, caches_fused, steps), run(per_op, caches_per_op, steps)
            assert torch.equal(got, want), steps
            assert_same_caches(caches_fused, caches_per_op)
    finally:
        torch.set_num_threads(before)
    return caches_fused


def assert_hidden_forwards_equal(fused: LlamaStage, per_op: LlamaStage, steps_list: list[list]) -> None:
    """A middle stage's forwards from seeded hidden states: the same outputs and K/V, and
    the input left as it was."""
    hidden_size = fused.config.hidden_size
    caches_fused, caches_per_op = fused.make_kv_caches(NUM_BLOCKS, BLOCK), per_op.make_kv_caches(NUM_BLOCKS, BLOCK)
    for n, steps in enumerate(steps_list):
        hidden = torch.randn(sum(len(new) for _, new, _ in steps), hidden_size,
                             generator=torch.Generator().manual_seed(n))
        kept = hidden.clone()
        got, want = run(fused, caches_fused, steps, hidden), run(per_op, caches_per_op, steps, hidden)
        assert torch.equal(got, want) and torch.equal(hidden, kept)
        assert_same_caches(caches_fused, caches_per_op)
