"""The model runner: a step plan in, logits of the sampled positions out.

It owns the KV cache tensors (one pair per layer) of the model stages it drives, and
turns the plan's plain data (token ids, positions, block tables) into the tensors and
:class:`~bargein.model.attention.AttentionMetadata` of one forward. It never decides
anything: block ids come from the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bargein.engine.plan import StepPlan
from bargein.model.attention import AttentionMetadata
from bargein.model.llama import LlamaStage


class ModelRunner:
    """Drives one or more consecutive model stages in this process."""

    def __init__(self, stages: Sequence[LlamaStage], num_blocks: int, block_size: int):
        if not stages or not stages[0].is_first or not stages[-1].is_last:
            raise ValueError("the stages must cover the model from its first layer to its last")
        self.stages = list(stages)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = [s.make_kv_caches(num_blocks, block_size) for s in self.stages]
        self.device = stages[0].device
        self.vocab_size = stages[-1].vocab_size

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Runs the plan's forward; returns float32 logits (len(plan.sampled), vocab)."""
        for caches in self.kv_caches:
            for src, dst in plan.block_copies:
                for cache in caches:
                    cache.copy_block(src, dst)
        if plan.is_empty:
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
        ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        for chunk in plan.chunks:
            ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.context_len))
            if chunk.sample:
                logits_indices.append(len(ids) - 1)
        meta = AttentionMetadata.build(
            block_tables=[list(c.block_table) for c in plan.chunks],
            query_lens=[len(c.token_ids) for c in plan.chunks],
            context_lens=[c.context_len for c in plan.chunks],
            block_size=self.block_size,
            device=self.device,
        )
        x = torch.tensor(ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        indices = torch.tensor(logits_indices, dtype=torch.int64, device=self.device)
        for stage, caches in zip(self.stages, self.kv_caches, strict=True):
            x = stage(x, pos, meta, caches, logits_indices=indices if stage.is_last else None)
        return x
