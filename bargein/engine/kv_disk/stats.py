"""The disk tier's counters and the snapshot ``DiskTier.stats()`` reports (plain data)."""

from __future__ import annotations

import threading
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
