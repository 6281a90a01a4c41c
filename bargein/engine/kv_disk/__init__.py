"""A disk tier under the KV block pool: full blocks survive eviction and restarts.

One concept per module: ``fingerprint`` (what K/V depends on besides tokens),
``block_file`` (the on-disk format, atomic writes, checked reads), ``index`` (what the
directory holds, LRU under a byte bound, rebuilt at start), ``lock`` (one server per
directory), ``stats`` (counters), ``tier`` (the facade and its writer and reader
threads), ``payload`` (a block's K/V to bytes and back: the only module here that
imports torch, so it is not imported by this package).
"""

from __future__ import annotations

from bargein.engine.kv_disk.block_file import BlockRecord
from bargein.engine.kv_disk.fingerprint import NUMERICS_VERSION, ModelFingerprint
from bargein.engine.kv_disk.lock import DirectoryBusy
from bargein.engine.kv_disk.stats import DiskTierStats
from bargein.engine.kv_disk.tier import DiskTier, Loaded

__all__ = ["NUMERICS_VERSION", "BlockRecord", "DirectoryBusy", "DiskTier", "DiskTierStats", "Loaded",
           "ModelFingerprint"]
