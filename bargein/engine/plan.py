"""The plain-data plan the scheduler hands to the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens of one sequence to compute in this step.

    ``token_ids`` sit at positions ``start_pos ...``; their K/V go into the blocks of
    ``block_table``. When ``sample`` is set the chunk ends the sequence's known tokens
    and the runner returns logits for its last position.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    """One forward: chunks in order, and block copies to make before it (copy on write)."""

    step: int
    chunks: tuple[ScheduledChunk, ...]
    block_copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def sampled(self) -> tuple[ScheduledChunk, ...]:
        return tuple(c for c in self.chunks if c.sample)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
