"""The disk tier: full KV blocks kept in a directory, written and read on threads of its own.

The engine's step thread only ever queues work here and reads answers back; it never
waits on the disk:

- ``spill(record)`` queues a block leaving memory for the writer thread. The queue is
  bounded in blocks: when it is full the block is dropped and counted (it is recomputed
  if ever needed again), so a slow disk costs cache hits, never step time.
- ``present(keys)`` says, from the in-memory index, how many leading blocks of a chain
  the directory holds.
- ``load(ticket, wanted)`` queues a read for the reader thread, which reads the blocks in
  order, checks each file (``block_file.read_block``: key, fingerprint, checksum, tokens)
  and stops at the first one missing or bad; ``drain_loaded()`` hands back what it read,
  per ticket, and ``on_loaded`` (if given) is called from the reader thread to wake the
  engine.
- ``delete(keys)`` queues deletions (a closed conversation's blocks); they are unbounded
  and ordered after earlier writes, so a deleted block is never left behind by a write
  still queued.

``flush(timeout)`` waits for the queued writes (shutdown); ``close(timeout)`` flushes, drops
what is still queued after the time limit (a block is written whole or not at all), stops
the threads and gives the directory's lock back.

One server owns a directory (``lock.DirectoryLock``); ``DiskTier.open`` returns None, after
one warning, when another does. The directory is made private (0700) and every file is
0600: the files hold the conversations' tokens.

This module imports no torch: the caller turns K/V into payload bytes (``payload.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bargein.engine.block_keys import BlockHash, ChainBlock
from bargein.engine.kv_disk.block_file import (
    BlockRecord,
    Skipped,
    encode,
    file_name,
    read_block,
    remove_file,
    write_file,
)
from bargein.engine.kv_disk.fingerprint import ModelFingerprint
from bargein.engine.kv_disk.index import DiskIndex, RebuildReport
from bargein.engine.kv_disk.lock import DirectoryBusy, DirectoryLock
from bargein.engine.kv_disk.stats import Counters, DiskTierStats

log = logging.getLogger("bargein.kv_disk")

DEFAULT_MAX_QUEUED_WRITES = 256


@dataclass(frozen=True)
class Loaded:
    """A finished load: the leading ``records`` of the ``wanted`` blocks that were read back
    whole and matching, in chain order (fewer than wanted: the rest is recomputed)."""

    ticket: Hashable
    wanted: int
    records: tuple[BlockRecord, ...]


@dataclass(frozen=True)
class _Write:
    record: BlockRecord


@dataclass(frozen=True)
class _Delete:
    keys: tuple[BlockHash, ...]


class DiskTier:
    """A directory of KV blocks for one model fingerprint, bounded to ``max_bytes``.

    Raises :class:`DirectoryBusy` if another process owns ``directory`` (``open`` turns
    that into None and a warning).
    """

    def __init__(self, directory: str | os.PathLike[str], fingerprint: ModelFingerprint, max_bytes: int, *,
                 max_queued_writes: int = DEFAULT_MAX_QUEUED_WRITES,
                 on_loaded: Callable[[], object] | None = None):
        self.directory = Path(directory).expanduser()
        self.fingerprint = fingerprint
        self._fp, self._short = fingerprint.digest, fingerprint.short
        self.max_queued_writes = max_queued_writes
        self._on_loaded = on_loaded
        _make_private_directory(self.directory)
        self._dir_lock = DirectoryLock(self.directory)
        try:
            self.index, self.rebuild_report = DiskIndex.rebuild(self.directory, self._short, max_bytes)
        except BaseException:
            self._dir_lock.release()
            raise
        self.counters = Counters()
        self._cond = threading.Condition()  # guards the writer's queue
        self._ops: deque[_Write | _Delete] = deque()
        self._queued: set[BlockHash] = set()  # keys with a write queued or being written
        self._busy = False
        self._closing = False
        self._write_error_logged = False
        self._load_cond = threading.Condition()  # guards loads and their answers
        self._loads: deque[tuple[Hashable, tuple[ChainBlock, ...]]] = deque()
        self._loaded: list[Loaded] = []
        self._writer = threading.Thread(target=self._write_loop, name="bargein-kv-disk-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="bargein-kv-disk-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    @classmethod
    def open(cls, directory: str | os.PathLike[str], fingerprint: ModelFingerprint, max_bytes: int,
             **kwargs: object) -> DiskTier | None:
        """A tier over ``directory``, or None (after one warning) if another server owns it."""
        try:
            return cls(directory, fingerprint, max_bytes, **kwargs)  # type: ignore[arg-type]
        except DirectoryBusy as exc:
            log.warning("kv disk: %s; running without the disk tier", exc)
            return None

    @property
    def rebuild(self) -> RebuildReport:
        return self.rebuild_report

    @property
    def num_blocks(self) -> int:
        return self.index.num_blocks

    # -- the step thread's side: queue work, read answers, never wait on the disk ------
    def __contains__(self, key: BlockHash) -> bool:
        return key in self.index

    def present(self, keys: Sequence[BlockHash]) -> int:
        """How many of ``keys``, from the first, the directory holds (by the index)."""
        return self.index.leading_present(keys)

    def spill(self, record: BlockRecord, timeout: float = 0.0) -> bool:
        """Queues a block for writing; False if it was dropped (the queue stayed full for
        ``timeout`` seconds: 0 on the step path, which never waits; or closing). A block
        already on disk or queued is not written again (True)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if record.key in self._queued or record.key in self.index:
                return not self._closing
            while not self._closing and len(self._queued) >= self.max_queued_writes:
                left = deadline - time.monotonic()
                if left <= 0:
                    with self.counters.lock:
                        self.counters.dropped_writes += 1
                    return False
                self._cond.wait(left)
            if self._closing:
                return False
            self._queued.add(record.key)
            self._ops.append(_Write(record))
            self._cond.notify_all()
            return True

    def delete(self, keys: Iterable[BlockHash]) -> None:
        """Queues the deletion of these blocks' files (after any write of them queued before)."""
        keys = tuple(keys)
        if not keys:
            return
        with self._cond:
            self._ops.append(_Delete(keys))
            self._cond.notify_all()

    def load(self, ticket: Hashable, wanted: Sequence[ChainBlock]) -> None:
        """Queues a read of ``wanted`` (a chain, in order); its answer comes from ``drain_loaded``."""
        with self._load_cond:
            self._loads.append((ticket, tuple(wanted)))
            self._load_cond.notify_all()

    def cancel_load(self, ticket: Hashable) -> None:
        """Forgets a queued load that has not started (a cancelled request); idempotent."""
        with self._load_cond:
            self._loads = deque(item for item in self._loads if item[0] != ticket)

    def drain_loaded(self) -> list[Loaded]:
        """The loads finished since the last drain."""
        with self._load_cond:
            done, self._loaded = self._loaded, []
            return done

    # -- shutdown ----------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every queued write and deletion is done (at most ``timeout``
        seconds), then makes the directory's entries durable. True if nothing was left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._ops or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        _fsync_directory(self.directory)
        return True

    def close(self, timeout: float | None = 10.0) -> bool:
        """Flushes for at most ``timeout`` seconds, drops what is still queued, stops the
        threads and releases the directory. Idempotent; True if everything was written."""
        if not self._dir_lock.held:
            return True
        flushed = self.flush(timeout)
        with self._cond:
            self._closing = True
            dropped = sum(isinstance(op, _Write) for op in self._ops)
            self._ops.clear()
            self._cond.notify_all()
        with self._load_cond:
            self._loads.clear()
            self._load_cond.notify_all()
        self._writer.join()  # it finishes the file it is writing, if any: whole or not at all
        self._reader.join()
        if dropped:
            log.warning("kv disk: %d blocks were not written before the time limit", dropped)
            with self.counters.lock:
                self.counters.dropped_writes += dropped
        self._dir_lock.release()
        return flushed

    def stats(self) -> DiskTierStats:
        c = self.counters
        with self._cond:
            queued = len(self._queued)
        return DiskTierStats(
            blocks=self.index.num_blocks, bytes=self.index.num_bytes, max_bytes=self.index.max_bytes,
            hits=c.hits, misses=c.misses, writes=c.writes, dropped_writes=c.dropped_writes, deleted=c.deleted,
            skipped_files=c.skipped_files, queued_writes=queued,
            read_seconds_mean=c.read.mean, read_seconds_max=c.read.max,
            write_seconds_mean=c.write.mean, write_seconds_max=c.write.max,
            rebuild_seconds=self.rebuild_report.seconds)

    # -- the writer thread -------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._ops and not self._closing:
                    self._cond.wait()
                if not self._ops:
                    return  # closing, nothing left
                op = self._ops.popleft()
                self._busy = True
            try:
                if isinstance(op, _Write):
                    self._write(op.record)
                else:
                    self._delete(op.keys)
            except OSError as exc:  # a full disk, a removed directory: the block is simply not kept
                with self.counters.lock:
                    self.counters.dropped_writes += isinstance(op, _Write)
                if not self._write_error_logged:
                    self._write_error_logged = True
                    log.warning("kv disk: writing to %s failed (%s); blocks that fail are not kept",
                                self.directory, exc)
            finally:
                with self._cond:
                    self._busy = False
                    if isinstance(op, _Write):
                        self._queued.discard(op.record.key)
                    self._cond.notify_all()

    def _write(self, record: BlockRecord) -> None:
        if record.key in self.index:
            return
        start = time.perf_counter()
        data = encode(record, self._fp)
        evicted = self.index.make_room(len(data))
        if evicted is None:  # larger than the whole bound: not kept
            return
        for key in evicted:  # before the new file exists: the bound holds on disk across a kill -9
            self._unlink(key)
        write_file(self.directory, record.key, data, self._short)
        self.index.add(record.key, len(data))
        with self.counters.lock:
            self.counters.writes += 1
            self.counters.write.add(time.perf_counter() - start)

    def _delete(self, keys: tuple[BlockHash, ...]) -> None:
        n = 0
        for key in keys:
            if self.index.remove(key):
                self._unlink(key)
                n += 1
        with self.counters.lock:
            self.counters.deleted += n

    def _unlink(self, key: BlockHash) -> None:
        remove_file(self.directory / file_name(key, self._short))

    # -- the reader thread -------------------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            with self._load_cond:
                while not self._loads and not self._closing:
                    self._load_cond.wait()
                if self._closing:
                    return
                ticket, wanted = self._loads.popleft()
            records = self.read_chain(wanted)
            with self._load_cond:
                self._loaded.append(Loaded(ticket, len(wanted), records))
            if self._on_loaded is not None:
                self._on_loaded()

    def read_chain(self, wanted: Sequence[ChainBlock]) -> tuple[BlockRecord, ...]:
        """Reads ``wanted`` (a chain, in order) on the caller's thread (the reader's, or a
        pipeline stage's disk thread) up to the first block missing or bad; counts hits."""
        records: list[BlockRecord] = []
        for block in wanted:
            if self._closing or block.key not in self.index:
                break
            start = time.perf_counter()
            found = read_block(self.directory, block.key, self._fp, self._short, block.tokens)
            if isinstance(found, Skipped):
                self.index.remove(block.key)
                with self.counters.lock:
                    self.counters.skipped_files += 1
                break
            if found is None or found.parent != block.parent:
                break
            records.append(found)
            self.counters.read.add(time.perf_counter() - start)
        for record in reversed(records):  # the head most recently used: the LRU drops tails first
            self.index.touch(record.key)
            _touch(self.directory / file_name(record.key, self._short))  # the LRU order survives a restart
        with self.counters.lock:
            self.counters.hits += len(records)
            self.counters.misses += len(wanted) - len(records)
        return tuple(records)


def _make_private_directory(path: Path) -> None:
    """Creates ``path`` (0700) or narrows it to 0700; refuses another user's directory."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user: the disk tier keeps private data")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def _fsync_directory(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)
