"""Decode-only steps replayed from CUDA graphs, captured once per batch and width bucket.

A decode step of a small model on a GPU is bound by launching kernels (hundreds per
forward), not by computing them. A CUDA graph records one forward's launches and
replays them with one call. A graph's shapes are fixed, so a step is padded: its
sequences up to the next batch size in ``batch_sizes`` and each block table up to the
next power of two of blocks. Padding rows write their K/V to a scratch block that no
sequence owns (``pad_block``, one block past the scheduler's pool) and attend only to
it, so they change nothing a real sequence reads.

Only steps in which every chunk is one token and is sampled (pure decode) replay a
graph; anything else (a prompt chunk, a batch larger than the largest size) answers
None and the runner runs it eagerly, the same forward without a graph.

All of a step's integers (token ids, positions, slots, context lengths, block tables)
go to the device in one host-to-device copy from a pinned buffer. On the CPU, or with
``capture=False``, the same padded forward runs eagerly (tests check it there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bargein.engine.plan import StepPlan
from bargein.model.attention import AttentionMetadata, KVCache
from bargein.model.llama import LlamaStage

_MIN_WIDTH = 8  # blocks: short contexts share one width bucket


@dataclass
class _Graph:
    """Static buffers of one (batch, width) bucket, and its graph once captured."""

    batch: int
    width: int
    staging: torch.Tensor  # host (4 * batch + batch * width,) int64, pinned on CUDA
    inputs: torch.Tensor  # the same on the device: ids, positions, slots, context lengths, tables
    meta: AttentionMetadata
    logits: torch.Tensor | None = None  # the forward's output (the graph's, once captured)
    graph: torch.cuda.CUDAGraph | None = None
    copied: torch.cuda.Event | None = None  # the last copy out of ``staging`` (CUDA)


class DecodeGraphs:
    """Runs pure-decode plans through per-bucket static buffers (and CUDA graphs)."""

    def __init__(self, stages: Sequence[LlamaStage], kv_caches: Sequence[Sequence[KVCache]], *,
                 pad_block: int, block_size: int, batch_sizes: Sequence[int], capture: bool):
        self.stages = list(stages)
        self.kv_caches = kv_caches
        self.pad_block = pad_block
        self.block_size = block_size
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.device = stages[0].device
        self.capture = capture and self.device.type == "cuda"
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = 0  # steps answered here (for tests and benchmarks)

    def bucket(self, plan: StepPlan) -> tuple[int, int] | None:
        """The (batch, width) a plan runs at, or None if it is not a pure decode that fits."""
        chunks = plan.chunks
        if not chunks or len(chunks) > self.batch_sizes[-1]:
            return None
        if any(len(c.token_ids) != 1 or not c.sample for c in chunks):
            return None
        needed = max(-(-c.context_len // self.block_size) for c in chunks)
        width = max(_MIN_WIDTH, 1 << (needed - 1).bit_length())
        batch = next(b for b in self.batch_sizes if b >= len(chunks))
        return batch, width

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor | None:
        """Float32 logits (len(plan.chunks), vocab) of a pure-decode plan; None if not one."""
        key = self.bucket(plan)
        if key is None:
            return None
        g = self.graphs.get(key) or self._make(*key)
        if g.copied is not None:
            g.copied.synchronize()  # the previous step's copy has left the pinned buffer
        self._fill(g, plan)
        g.inputs.copy_(g.staging, non_blocking=True)
        if self.device.type == "cuda":
            g.copied = g.copied or torch.cuda.Event()
            g.copied.record()
        if g.graph is not None:
            g.graph.replay()
            logits = g.logits
        else:
            logits = self._forward(g)
        self.replays += 1
        # A copy: the next replay overwrites the graph's output while the caller may hold it.
        return logits[:len(plan.chunks)].clone()

    def _fill(self, g: _Graph, plan: StepPlan) -> None:
        """Writes the plan's integers into the host buffer, padding rows at the scratch block."""
        b, w, bs, pad = g.batch, g.width, self.block_size, self.pad_block
        pad_rows = b - len(plan.chunks)
        ids = [c.token_ids[0] for c in plan.chunks] + [0] * pad_rows
        positions = [c.start_pos for c in plan.chunks] + [0] * pad_rows
        slots = [c.block_table[c.start_pos // bs] * bs + c.start_pos % bs for c in plan.chunks]
        ctx = [c.context_len for c in plan.chunks] + [1] * pad_rows
        tables: list[int] = []
        for c in plan.chunks:
            used = c.block_table[:-(-c.context_len // bs)]
            tables += used
            tables += [pad] * (w - len(used))
        flat = ids + positions + slots + [pad * bs] * pad_rows + ctx + tables + [pad] * (w * pad_rows)
        g.staging.copy_(torch.tensor(flat, dtype=torch.int64))

    def _make(self, batch: int, width: int) -> _Graph:
        size = 4 * batch + batch * width
        staging = torch.zeros(size, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        inputs = torch.zeros(size, dtype=torch.int64, device=self.device)
        _, _, slots, ctx, tables = _split(inputs, batch, width)
        slots.fill_(self.pad_block * self.block_size)  # warm-up and capture touch the scratch block only
        ctx.fill_(1)
        tables.fill_(self.pad_block)
        mask = torch.zeros((batch, 1, 1, width * self.block_size), dtype=torch.float32, device=self.device)
        index = torch.arange(batch, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=tables, query_lens=(1,) * batch, context_lens=(1,) * batch,
            decode_token_index=index, decode_block_tables=tables, decode_context_lens=ctx, decode_mask=mask,
            block_size=self.block_size)
        g = _Graph(batch, width, staging, inputs, meta)
        if self.capture:
            self._capture(g)
        self.graphs[(batch, width)] = g
        return g

    def _forward(self, g: _Graph) -> torch.Tensor:
        """The padded forward over the static buffers (what a graph records)."""
        ids, positions, _, ctx, _ = _split(g.inputs, g.batch, g.width)
        key_pos = torch.arange(g.width * self.block_size, device=self.device)
        visible = key_pos.unsqueeze(0) < ctx.unsqueeze(1)  # (B, W * block_size)
        g.meta.decode_mask.copy_(torch.where(visible, 0.0, float("-inf"))[:, None, None, :])
        x = ids
        for stage, caches in zip(self.stages, self.kv_caches, strict=True):
            x = stage(x, positions, g.meta, caches,
                      logits_indices=g.meta.decode_token_index if stage.is_last else None)
        return x

    def _capture(self, g: _Graph) -> None:
        # Warm up on a side stream first (lazy initialisation of cuBLAS and friends must
        # not happen during capture), as PyTorch's CUDA-graph notes advise.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(g)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (a server's, say) does not break this capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            g.logits = self._forward(g)
        g.graph = graph


def _split(buffer: torch.Tensor, batch: int, width: int) -> tuple[torch.Tensor, ...]:
    """Views of a step buffer: ids, positions, slots, context lengths (B,), tables (B, W)."""
    ids, positions, slots, ctx, tables = buffer.split([batch] * 4 + [batch * width])
    return ids, positions, slots, ctx, tables.view(batch, width)
