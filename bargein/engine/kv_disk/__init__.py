"""A disk tier under the KV block pool: full blocks survive eviction and restarts.

One concept per module: ``fingerprint`` (what K/V depends on besides tokens),
``block_file`` (the on-disk format, atomic writes, checked reads), ``index`` (what the
directory holds, LRU under a byte bound, rebuilt at start), ``lock`` (one server per
directory), ``stats`` (counters), ``tier`` (the facade and its writer and reader
threads), ``payload`` (a block's K/V to bytes and back: the only module here that
imports torch, so it is not imported by this package).

The names below are imported on first use (PEP 562): every engine imports ``stats``
(its counters are in the engine's report), and the tier's modules, 6-8 ms of a start,
are for an engine with a disk tier.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "NUMERICS_VERSION": "fingerprint", "ModelFingerprint": "fingerprint", "BlockRecord": "block_file",
    "DirectoryBusy": "lock", "DiskTierStats": "stats", "DiskTier": "tier", "Loaded": "tier",
}
__all__ = ["NUMERICS_VERSION", "BlockRecord", "DirectoryBusy", "DiskTier", "DiskTierStats", "Loaded",
           "ModelFingerprint"]

if TYPE_CHECKING:
    from bargein.engine.kv_disk.block_file import BlockRecord
    from bargein.engine.kv_disk.fingerprint import NUMERICS_VERSION, ModelFingerprint
    from bargein.engine.kv_disk.lock import DirectoryBusy
    from bargein.engine.kv_disk.stats import DiskTierStats
    from bargein.engine.kv_disk.tier import DiskTier, Loaded


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
