"""The disk tier's index: which blocks the directory holds, in LRU order, under a byte bound.

The index lives in memory and is rebuilt from the directory at every start: block keys
are in the file names and the LRU order is the files' modification times (a hit
touches its file), so the rebuild lists the directory and stats each file, and never
opens one (10,000 blocks in well under a second). Files are checked when they are read,
not here.

At the rebuild, the tier owner (it holds the directory's lock) also removes what no
live server can use: temporary files a crash left mid-write, and block files named for
another fingerprint (another model, precision, layout or an older numerics version),
which are reported in one warning rather than one per file.

Thread-safe: the step thread asks what is present, the writer adds, the reader touches.
This module imports no torch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bargein.engine.block_keys import BlockHash
from bargein.engine.kv_disk.block_file import TMP_PREFIX, file_name, parse_name, remove_file

log = logging.getLogger("bargein.kv_disk")


@dataclass(frozen=True)
class RebuildReport:
    """What a start found: blocks and bytes indexed, files removed, and how long it took."""

    blocks: int
    bytes: int
    removed_partial: int  # temporary files of interrupted writes
    removed_foreign: int  # block files of another fingerprint
    evicted: int  # blocks over the byte bound (a smaller bound than last time)
    seconds: float


class DiskIndex:
    """Keys of the blocks on disk and their sizes, least recently used first, bounded in bytes."""

    def __init__(self, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError("the disk tier's size must be positive")
        self.max_bytes = max_bytes
        self._sizes: OrderedDict[BlockHash, int] = OrderedDict()  # front = evicted first
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def num_blocks(self) -> int:
        return len(self._sizes)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._sizes

    def lru_keys(self) -> list[BlockHash]:
        """Every key, least recently used first."""
        with self._lock:
            return list(self._sizes)

    def leading_present(self, keys: Sequence[BlockHash]) -> int:
        """How many of ``keys``, from the first, are all on disk."""
        n = 0
        for key in keys:
            if key not in self._sizes:
                break
            n += 1
        return n

    def add(self, key: BlockHash, size: int) -> tuple[bool, list[BlockHash]]:
        """Records a written block as most recently used; returns (kept, keys evicted to
        make room). A block larger than the whole bound is not kept; the caller deletes
        the files of the keys evicted (and of the block, if not kept)."""
        with self._lock:
            if size > self.max_bytes:
                return False, []
            old = self._sizes.pop(key, None)
            if old is not None:
                self._bytes -= old
        evicted = self.make_room(size) or []
        with self._lock:
            self._sizes[key] = size
            self._bytes += size
            return True, evicted

    def make_room(self, size: int) -> list[BlockHash] | None:
        """Forgets least recently used blocks until ``size`` more bytes fit; returns their
        keys (the caller deletes their files before writing the new one, so the bound holds
        on disk even if the process dies between the two), or None if ``size`` exceeds
        the whole bound."""
        with self._lock:
            if size > self.max_bytes:
                return None
            evicted = []
            while self._bytes + size > self.max_bytes:
                victim, victim_size = self._sizes.popitem(last=False)
                self._bytes -= victim_size
                evicted.append(victim)
            return evicted

    def touch(self, key: BlockHash) -> None:
        """Marks a block most recently used (a hit)."""
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)

    def remove(self, key: BlockHash) -> bool:
        """Forgets a block (deleted or found bad); False if it was not indexed."""
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is None:
                return False
            self._bytes -= size
            return True

    @classmethod
    def rebuild(cls, directory: Path, fingerprint_short: str, max_bytes: int) -> tuple[DiskIndex, RebuildReport]:
        """The index of ``directory``'s block files for this fingerprint, oldest first;
        removes interrupted writes, other fingerprints' files and what exceeds the bound."""
        start = time.perf_counter()
        found: list[tuple[int, BlockHash, int]] = []  # (mtime_ns, key, size)
        partial = foreign = 0
        with os.scandir(directory) as entries:
            for entry in entries:
                name = entry.name
                if name.startswith(TMP_PREFIX):
                    remove_file(entry.path)
                    partial += 1
                    continue
                parsed = parse_name(name)
                if parsed is None:
                    continue  # not ours: left alone
                key, short = parsed
                if short != fingerprint_short:
                    remove_file(entry.path)
                    foreign += 1
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime_ns, key, st.st_size))
        found.sort()
        index = cls(max_bytes)
        evicted = 0
        for _, key, size in found:
            kept, dropped = index.add(key, size)
            if not kept:
                dropped.append(key)
            for victim in dropped:
                remove_file(directory / file_name(victim, fingerprint_short))
            evicted += len(dropped)
        if partial or foreign:
            log.warning("kv disk: removed %d interrupted writes and %d blocks of another model or version from %s",
                        partial, foreign, directory)
        report = RebuildReport(index.num_blocks, index.num_bytes, partial, foreign, evicted,
                               time.perf_counter() - start)
        return index, report
