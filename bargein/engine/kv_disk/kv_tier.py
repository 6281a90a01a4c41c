"""The engine's side of a disk tier: what ``engine/disk_cache.py`` asks of the K/V store
below its block pool, wherever that K/V lives.

Two kinds implement :class:`KVTier`: one tier over this process's caches
(``local_tier.LocalKVTier``: a :class:`~bargein.engine.kv_disk.tier.DiskTier` that copies
payloads out of and into the runner's caches itself), and a pipeline's stages, each with
a tier of its own for its layers (``distributed/stage_tiers.StageTiers``: the head keeps
the keys, the stages the K/V and the files). A runner whose K/V lives elsewhere opens
its kind through :class:`KVTierHost`.

Every method runs on the engine's thread, between steps, and never waits on a disk.
This module imports no torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from bargein.config import CacheConfig
from bargein.engine.block_keys import BlockHash, ChainBlock, SpillCandidate

if TYPE_CHECKING:  # in signatures only: every engine imports this module, the tier's only one with a disk tier
    from bargein.engine.kv_disk.fingerprint import ModelFingerprint
    from bargein.engine.kv_disk.index import RebuildReport
    from bargein.engine.kv_disk.stats import DiskTierStats
    from bargein.engine.kv_disk.tier import Loaded


class KVTier(Protocol):
    """Full blocks' K/V kept on disk, keyed by chained hash, for one model fingerprint.

    ``spill_blocks`` copies each candidate's K/V out of its block id before the next
    forward writes that id, and queues it for writing (False: dropped). ``present`` says
    how many leading keys of a chain are on disk (every part of it). ``load`` reads a
    chain in the background; ``drain_loaded`` hands back finished loads, whose leading
    blocks every part read whole and matching; ``install`` puts a finished load's blocks
    into the block ids the pool adopted them as (before the next forward), or forgets it
    (``placed`` empty). ``delete`` removes blocks' files; ``close`` writes what is queued
    within ``timeout`` seconds, then lets the directory go (True: nothing was dropped).
    """

    fingerprint: ModelFingerprint

    @property
    def rebuild(self) -> RebuildReport: ...

    @property
    def num_blocks(self) -> int: ...

    def __contains__(self, key: BlockHash) -> bool: ...

    def present(self, keys: Sequence[BlockHash]) -> int: ...

    def spill_blocks(self, candidates: Sequence[SpillCandidate], timeout: float = 0.0) -> int: ...

    def load(self, ticket: Hashable, wanted: Sequence[ChainBlock]) -> None: ...

    def drain_loaded(self) -> list[Loaded]: ...

    def install(self, loaded: Loaded, placed: Sequence[tuple[BlockHash, int]]) -> None: ...

    def delete(self, keys: Iterable[BlockHash]) -> None: ...

    def close(self, timeout: float | None = 10.0) -> bool: ...

    def stats(self) -> DiskTierStats: ...


@runtime_checkable
class KVTierHost(Protocol):
    """A runner whose K/V lives elsewhere and that opens the disk tier for it (a pipeline)."""

    def open_kv_tier(self, cache: CacheConfig, model_identity: str | os.PathLike[str],
                     on_loaded: Callable[[], object]) -> KVTier | None:
        """The tier per ``cache.kv_disk_dir``, or None (after one warning) when it cannot
        be used; ``on_loaded`` is called from any thread when a load finishes."""
        ...
