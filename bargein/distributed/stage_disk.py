"""One pipeline stage's own disk tier, inside its actor (``stage.py`` holds it).

A stage holds the K/V of its layers for every block id of the head's pool, so it keeps
those layers' blocks on disk itself, in ``DIR/stage-<start>-<end>`` on its own node
(``disk_cache.stage_tier_directory``), under a fingerprint that names its layer range
(``stage_fingerprint``): a stage never reads another range's K/V, even from a mixed-up
directory. The head (``stage_tiers.py``) keeps the keys and decides; the stage moves
bytes:

- ``read(ticket, wanted)`` (the actor's disk thread, beside the plans): reads the chain
  from its tier up to the first block missing or bad and keeps the records under the
  ticket; answers how many it read. The head uses the smallest answer of all stages: a
  block is used only if every stage has it.
- ``apply(ops)``: the operations a plan carried (``kv_disk/stage_ops.py``), run on the
  plan's thread before its block copies and forward: spills copy K/V out of the caches
  and queue it for the writer, installs write a load's records into their block ids and
  forget the load, deletions are queued. At shutdown and for deletions while the
  pipeline is idle the head calls ``apply`` directly.

Every part of the tier (the index rebuilt at start, the directory's lock, checked reads,
atomic writes, the writer thread, the LRU under this stage's share of the size bound) is
the in-process engine's ``LocalKVTier``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bargein.engine.block_keys import BlockHash, ChainBlock, SpillCandidate
from bargein.engine.kv_disk.block_file import BlockRecord, file_size
from bargein.engine.kv_disk.fingerprint import ModelFingerprint
from bargein.engine.kv_disk.index import RebuildReport
from bargein.engine.kv_disk.local_tier import LocalKVTier
from bargein.engine.kv_disk.payload import KVPair, block_nbytes
from bargein.engine.kv_disk.stage_ops import DeleteBlocks, InstallLoad, KVDiskOp
from bargein.engine.kv_disk.stats import DiskTierStats
from bargein.engine.kv_disk.tier import Loaded


@dataclass(frozen=True)
class StageTierOpened:
    """What a stage's tier holds at start, for the head: its fingerprint, the rebuild's
    report, its keys (least recently used first) and how many blocks its bound holds."""

    fingerprint: ModelFingerprint
    rebuild: RebuildReport
    keys: tuple[BlockHash, ...]
    capacity_blocks: int


@dataclass(frozen=True)
class StageTierBusy:
    """A stage's answer when another process holds its directory's lock: who (the message
    of ``DirectoryBusy``: the directory and the holder's pid on the stage's node)."""

    reason: str


class StageDisk:
    """A stage's tier over its caches, and the loads it read for the head (see module doc)."""

    def __init__(self, directory: Path, fingerprint: ModelFingerprint, caches: Sequence[KVPair], blocks: int):
        """Opens the tier, bounded to ``blocks`` of this stage's files (every stage gets the
        same number, its share of ``--kv-disk-size``). Raises DirectoryBusy if another
        process owns the directory."""
        self.file_bytes = file_size(fingerprint.block_size, block_nbytes(caches))
        self.tier = LocalKVTier(directory, fingerprint, max(1, blocks) * self.file_bytes, caches=caches)
        self._staged: dict[str, tuple[BlockRecord, ...]] = {}  # ticket -> records read, until installed
        self._lock = threading.Lock()

    def opened(self) -> StageTierOpened:
        index = self.tier.index
        return StageTierOpened(self.tier.fingerprint, self.tier.rebuild, tuple(index.lru_keys()),
                               index.max_bytes // self.file_bytes)

    def read(self, ticket: str, wanted: Sequence[ChainBlock]) -> int:
        """Reads ``wanted`` and keeps what it read for ``ticket``; returns how many blocks."""
        records = self.tier.read_chain(wanted)
        with self._lock:
            self._staged[ticket] = records
        return len(records)

    def apply(self, ops: Sequence[KVDiskOp], timeout: float = 0.0) -> None:
        """Applies ``ops`` in order; a spill waits at most until ``timeout`` seconds from now
        for room in the writer's queue (0 on a plan's path: a full queue drops it)."""
        deadline = time.monotonic() + timeout
        for op in ops:
            if isinstance(op, SpillCandidate):
                self.tier.spill_blocks([op], max(0.0, deadline - time.monotonic()))
            elif isinstance(op, InstallLoad):
                with self._lock:
                    records = self._staged.pop(op.ticket, ())
                # A load this stage did not read (it was re-created since) is never placed:
                # the head places only what every stage read, and forgot the rest on the loss.
                if records:
                    self.tier.install(Loaded(op.ticket, len(records), records), op.placed)
            elif isinstance(op, DeleteBlocks):
                self.tier.delete(op.keys)

    def close(self, ops: Sequence[KVDiskOp], timeout: float) -> bool:
        """Applies the last ``ops`` (shutdown's spills), writes within ``timeout`` seconds,
        releases the directory; True if nothing was dropped."""
        deadline = time.monotonic() + timeout
        self.apply(ops, timeout)
        with self._lock:
            self._staged.clear()
        return self.tier.close(max(0.0, deadline - time.monotonic()))

    def stats(self) -> DiskTierStats:
        return self.tier.stats()
