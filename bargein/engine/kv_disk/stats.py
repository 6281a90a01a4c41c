"""The disk tier's counters and the snapshot ``DiskTier.stats()`` reports (plain data)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DiskTierStats:
    """A point-in-time view of the disk tier, for ``stats()``, ``/metrics`` and ``/v1/cache``.

    ``hits``/``misses`` count blocks asked for by loads (found whole and matching, or
    not); ``skipped_files`` the bad files found and deleted (also at reads); latencies
    are per block, in seconds.
    """

    blocks: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    writes: int
    dropped_writes: int  # spills refused because the write queue was full
    deleted: int
    skipped_files: int
    queued_writes: int
    read_seconds_mean: float
    read_seconds_max: float
    write_seconds_mean: float
    write_seconds_max: float
    rebuild_seconds: float


def merge_disk_stats(parts: Sequence[DiskTierStats]) -> DiskTierStats | None:
    """Several tiers' snapshots (a replica set's, one tier per replica) as one: counts and
    sizes summed, maxima the largest, mean latencies weighted by the blocks read (hits) and
    written; None when no part has a tier."""
    if not parts:
        return None

    def total(name: str) -> int:
        return sum(getattr(p, name) for p in parts)

    def weighted(name: str, weight: str) -> float:
        n = total(weight)
        return sum(getattr(p, name) * getattr(p, weight) for p in parts) / n if n else 0.0

    counts = ("blocks", "bytes", "max_bytes", "hits", "misses", "writes", "dropped_writes", "deleted",
              "skipped_files", "queued_writes")
    return DiskTierStats(**{name: total(name) for name in counts},
                         read_seconds_mean=weighted("read_seconds_mean", "hits"),
                         read_seconds_max=max(p.read_seconds_max for p in parts),
                         write_seconds_mean=weighted("write_seconds_mean", "writes"),
                         write_seconds_max=max(p.write_seconds_max for p in parts),
                         rebuild_seconds=max(p.rebuild_seconds for p in parts))


class Latency:
    """Count, sum and max of durations, updated from one thread, read from any."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.max = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        self.max = max(self.max, seconds)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


@dataclass
class Counters:
    """The tier's running counts; ``lock`` guards the ones two threads update."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    dropped_writes: int = 0
    deleted: int = 0
    skipped_files: int = 0

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.read = Latency()
        self.write = Latency()
