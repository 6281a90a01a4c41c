"""A disk tier over K/V caches in this process: the :class:`DiskTier` plus the copies
between its payloads and the caches (``payload.py``). The in-process engine's tier, and
each pipeline stage's own (``distributed/stage_disk.py``). Imports torch (payload)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from bargein.engine.block_keys import BlockHash, SpillCandidate
from bargein.engine.kv_disk.block_file import BlockRecord
from bargein.engine.kv_disk.fingerprint import ModelFingerprint
from bargein.engine.kv_disk.payload import KVPair, extract_blocks, write_block
from bargein.engine.kv_disk.tier import DiskTier, Loaded


class LocalKVTier(DiskTier):
    """A :class:`DiskTier` whose blocks are the block ids of ``caches`` (one (k, v) pair per
    layer, every layer this process holds), implementing ``kv_tier.KVTier``."""

    def __init__(self, directory: str | os.PathLike[str], fingerprint: ModelFingerprint, max_bytes: int, *,
                 caches: Sequence[KVPair], **kwargs: object):
        self.caches = list(caches)
        super().__init__(directory, fingerprint, max_bytes, **kwargs)  # type: ignore[arg-type]

    def spill_blocks(self, candidates: Sequence[SpillCandidate], timeout: float = 0.0) -> int:
        """Copies the candidates not on disk yet out of the caches (now: the step thread,
        before their ids are written again) and queues them; returns how many were queued."""
        fresh = [c for c in candidates if c.block.key not in self]
        payloads = extract_blocks(self.caches, [c.block_id for c in fresh])
        queued = 0
        for c, payload in zip(fresh, payloads, strict=True):
            b = c.block
            queued += self.spill(BlockRecord(b.key, b.parent, b.tokens, payload), timeout)
        return queued

    def install(self, loaded: Loaded, placed: Sequence[tuple[BlockHash, int]]) -> None:
        """Writes the loaded blocks' payloads into the ids they were adopted as."""
        payloads = {r.key: r.payload for r in loaded.records}
        for key, block_id in placed:
            write_block(self.caches, block_id, payloads[key])
