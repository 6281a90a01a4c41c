"""What a plan tells stages that hold the K/V elsewhere (a pipeline's) to do with their
blocks and their own disk tiers, in order, before its forward (``StepPlan.kv_disk``).

An in-process engine moves K/V between its caches and its tier itself, between steps.
A pipeline's head cannot: each stage holds its own layers' K/V and its own tier. So the
head's view of the stages' tiers (``distributed/stage_tiers.py``) records these
operations, and the next plan carries them to every stage, which applies them before it
touches any block (``distributed/stage_disk.py``). Riding the plan orders them with the
plans exactly as the head's pool ordered them: a block evicted by a schedule is copied
out before the forward that writes its id again, and blocks read back are in place
before the forward that attends to them, whatever the transport.

- :class:`~bargein.engine.block_keys.SpillCandidate`: copy ``block_id``'s K/V out now and
  queue it for the stage's writer as ``block``.
- :class:`InstallLoad`: write the blocks that load ``ticket`` read (and every stage read
  whole) into these block ids; the load's other blocks are forgotten.
- :class:`DeleteBlocks`: delete these blocks' files (a closed conversation's).

This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from bargein.engine.block_keys import BlockHash, SpillCandidate


@dataclass(frozen=True)
class InstallLoad:
    """The K/V read for load ``ticket`` goes into these ids: ``placed`` is (key, block id)
    in chain order, possibly empty (the request went away: the load is only forgotten)."""

    ticket: str
    placed: tuple[tuple[BlockHash, int], ...]


@dataclass(frozen=True)
class DeleteBlocks:
    """These blocks' files are deleted (after any write of them queued before)."""

    keys: tuple[BlockHash, ...]


KVDiskOp = SpillCandidate | InstallLoad | DeleteBlocks
