"""Draft-model speculation: a small model of the same vocabulary guesses greedily.

The draft model runs in this process beside the target, with its own paged K/V: its own
:class:`~bargein.engine.blocks.BlockPool` (no prefix cache) and its own
:class:`~bargein.engine.runner.ModelRunner`. Per request it remembers the tokens whose
K/V its cache holds. Each ``propose`` first rolls that back to the longest prefix the
request's tokens still share (guesses the target rejected, or an answer cut by a cancel,
are dropped: their slots are past the kept tokens and are written again before they are
read), then computes the rest of the request's tokens and k-1 guesses more, one forward
per guess for all requests together. The guesses are only ever hints: any draft model,
even a random one, leaves every answer unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from bargein.config import EngineConfig
from bargein.engine.blocks import BlockPool, BlockTable, OutOfBlocks
from bargein.engine.plan import ScheduledChunk, StepPlan
from bargein.engine.runner import ModelRunner
from bargein.engine.speculative.proposer import DraftRequest
from bargein.model.llama import LlamaStage


@dataclass
class _DraftSequence:
    """The tokens whose K/V the draft's cache holds for one request, and their blocks."""

    token_ids: list[int] = field(default_factory=list)
    table: BlockTable = field(default_factory=BlockTable)


def _shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix (list slices compare at C speed)."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo


class DraftModelProposer:
    """A :class:`~bargein.engine.speculative.proposer.Proposer` over a draft model."""

    def __init__(self, stages: LlamaStage | Sequence[LlamaStage], *, kv_tokens: int, block_size: int,
                 target_vocab_size: int):
        stages = [stages] if isinstance(stages, LlamaStage) else list(stages)
        vocab = stages[-1].vocab_size
        if vocab != target_vocab_size:
            raise ValueError(f"the draft model's vocabulary has {vocab} tokens and the model's {target_vocab_size}: "
                             "a draft model must share the model's tokenizer")
        num_blocks = -(-kv_tokens // block_size)
        self.runner = ModelRunner(stages, num_blocks, block_size)
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching=False)
        self.max_len = min(stages[0].config.max_position_embeddings, num_blocks * block_size)
        self._sequences: dict[str, _DraftSequence] = {}
        self._step = 0

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]:
        chunks: dict[str, ScheduledChunk] = {}
        for r in requests:
            chunk = self._first_chunk(r)
            if chunk is not None:
                chunks[r.request_id] = chunk
        guesses: dict[str, list[int]] = {rid: [] for rid in chunks}
        want = {r.request_id: r.k for r in requests}
        while chunks:
            self._step += 1
            plan = StepPlan(self._step, tuple(chunks.values()))
            tokens = self.runner.execute(plan).argmax(dim=-1).tolist()
            following: dict[str, ScheduledChunk] = {}
            for (rid, chunk), token in zip(chunks.items(), tokens, strict=True):
                seq = self._sequences[rid]
                seq.token_ids.extend(chunk.token_ids)  # their K/V is in the cache now
                guesses[rid].append(token)
                if len(guesses[rid]) < want[rid]:
                    following[rid] = ScheduledChunk(rid, (token,), chunk.context_len, tuple(seq.table.block_ids), True)
            chunks = following
        return {rid: tuple(g) for rid, g in guesses.items()}

    def _first_chunk(self, r: DraftRequest) -> ScheduledChunk | None:
        """Rolls the request's draft K/V back to what its tokens still share, and makes room
        for the rest and k-1 guesses; None (and no K/V kept) if the draft cannot."""
        seq = self._sequences.setdefault(r.request_id, _DraftSequence())
        keep = min(_shared_prefix(seq.token_ids, r.token_ids), len(r.token_ids) - 1)
        del seq.token_ids[keep:]
        self.pool.truncate(seq.table, keep)
        end = len(r.token_ids) + r.k - 1  # positions the guesses but the last are computed at
        try:
            if end > self.max_len:
                raise OutOfBlocks
            self.pool.ensure_writable(seq.table, keep, end)
        except OutOfBlocks:
            self.forget(r.request_id)
            return None
        return ScheduledChunk(r.request_id, tuple(r.token_ids[keep:]), keep, tuple(seq.table.block_ids), True)

    def forget(self, request_id: str) -> None:
        seq = self._sequences.pop(request_id, None)
        if seq is not None:
            self.pool.release(seq.table)


def load_draft_model(path: str | os.PathLike[str], config: EngineConfig) -> list[LlamaStage]:
    """The draft model at ``path`` (a .gguf file or an HF folder), built like the model."""
    from bargein.engine.device import build_model, one_torch_thread, resolve_device, resolve_dtype
    from bargein.loader import close_model_files, load_config, load_weights, resolve_model_ref

    source = resolve_model_ref(str(path))
    model_config = load_config(source)
    device = resolve_device(config.device)
    with one_torch_thread():
        weights = load_weights(source, model_config, dtype=resolve_dtype(config.dtype, device), device=device,
                               progress=False, blocks=device.type == "cpu")
        model = build_model(model_config, weights, config, max_positions=model_config.max_position_embeddings,
                            private_copy=True)
        close_model_files()
    return [model]
