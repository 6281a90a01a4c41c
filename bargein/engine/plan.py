"""The plain-data plan the scheduler hands to the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass

from bargein.engine.kv_disk.stage_ops import KVDiskOp


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens of one sequence to compute in this step.

    ``token_ids`` sit at positions ``start_pos ...``; their K/V go into the blocks of
    ``block_table``. When ``sample`` is set the chunk ends the sequence's known tokens
    and the runner returns logits for its last position.

    ``draft_token_ids`` (speculative decoding; only on a sampling chunk): guesses of the
    tokens that follow, computed after ``token_ids`` at positions ``context_len ...`` in
    the same forward; the runner then returns ``1 + len(draft_token_ids)`` logits rows for
    the chunk (its last token's, then each guess's). They are not the sequence's tokens:
    the scheduler keeps only the K/V of those the target confirms (``update``).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool
    draft_token_ids: tuple[int, ...] = ()

    @property
    def context_len(self) -> int:
        """Positions the sequence's own tokens reach after this chunk (guesses not counted)."""
        return self.start_pos + len(self.token_ids)

    @property
    def query_ids(self) -> tuple[int, ...]:
        """Every token the forward computes for this chunk: its tokens, then its guesses."""
        return self.token_ids + self.draft_token_ids if self.draft_token_ids else self.token_ids

    @property
    def num_logits(self) -> int:
        """Logits rows the runner returns for this chunk."""
        return 1 + len(self.draft_token_ids) if self.sample else 0


@dataclass(frozen=True)
class StepPlan:
    """One forward: chunks in order, and block copies to make before it (copy on write).

    ``kv_disk``: for stages that hold the K/V elsewhere (a pipeline's), the disk tier's
    operations to apply before anything else (``kv_disk/stage_ops.py``); always empty
    for the in-process runner, whose engine does them itself between steps."""

    step: int
    chunks: tuple[ScheduledChunk, ...]
    block_copies: tuple[tuple[int, int], ...] = ()
    kv_disk: tuple[KVDiskOp, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens the forward computes, guesses included."""
        return sum(len(c.token_ids) + len(c.draft_token_ids) for c in self.chunks)

    @property
    def has_drafts(self) -> bool:
        return any(c.draft_token_ids for c in self.chunks)

    @property
    def sampled(self) -> tuple[ScheduledChunk, ...]:
        return tuple(c for c in self.chunks if c.sample)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
