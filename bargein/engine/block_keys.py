"""Block keys, and the plain data that carries them out of the block pool: ``chain_hash``
names a full block by its tokens and its parent's key; ``KeyChanges`` tells a replica
set's router which keys a pool registered or dropped; ``ChainBlock`` and
``SpillCandidate`` are what a disk tier below the pool writes and reads back.

This module imports no torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

BlockHash = bytes


def namespace_root(cache_salt: str | None) -> BlockHash | None:
    """The key a namespace's first block chains from: None (the common namespace) without
    a salt. Every key of a salted sequence descends from its root, so its blocks (full and
    partial) are found only by sequences with the same salt."""
    if cache_salt is None:
        return None
    return hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), digest_size=16,
                           person=b"bargein-salt").digest()


def chain_hash(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """The key naming a full block of ``tokens`` that follows a block keyed ``parent``.

    BLAKE2b over the parent key and the tokens (fixed-width, so no two token lists
    encode alike): collisions are out of reach, unlike Python's ``hash``.
    """
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass
class KeyChanges:
    """Full-block keys registered or dropped since the last drain, net (key -> registered
    now). ``reset``: every key was dropped first (``forget_contents``). A replica reports
    these with its outputs, so the head's prefix index follows its cache exactly."""

    reset: bool = False
    keys: dict[BlockHash, bool] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.reset or bool(self.keys)

    def merge(self, later: KeyChanges) -> None:
        """Folds in the changes that came after these."""
        if later.reset:
            self.reset, self.keys = True, {}
        self.keys.update(later.keys)


@dataclass(frozen=True)
class ChainBlock:
    """A full block of a token sequence, by identity: its chained key, its parent's key
    (None for the first block) and its tokens."""

    key: BlockHash
    parent: BlockHash | None
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class SpillCandidate:
    """A full registered block whose contents the pool just dropped. ``block_id`` still
    holds its K/V until the next forward (or copy) writes it: the caller copies it out
    before handing the step's plan to the runner."""

    block: ChainBlock
    block_id: int
