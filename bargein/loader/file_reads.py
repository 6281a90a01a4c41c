"""Tensors viewed from mapped files, read into other memory with a few system calls.

A weight loaded from a GGUF or safetensors file is a view of the file's shared mapping.
:func:`file_span` finds where its bytes lie in which file (this process's
``/proc/self/maps``: Linux only, ``None`` elsewhere or for memory that is not a file view).
:func:`plan_reads` turns many (span, destination) pairs into a few :class:`Read` s, each one
``preadv`` of a contiguous stretch of one file scattered into the destinations (the small
gaps between spans into a throwaway buffer), :func:`run_read` runs one, and
:func:`read_spans` plans and runs them all on a pool of threads.

Why not copy from the mapping: a thread copying tensor by tensor needs the GIL between
tensors, and at load another thread builds the tokenizer in a library that holds the GIL
for tenths of a second at a time; the copy's threads then wait on it (a 601 MiB copy took
0.26-0.42 s beside it, 0.12-0.16 s alone). One ``preadv`` per thread takes the GIL once.
Reading does not fault the file's pages into this process either: they stay in the page
cache, and the resident set holds only the destination.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import Executor
from dataclasses import dataclass, field

MAX_GAP = 1 << 20  # bytes between two spans read through rather than split into two reads
MAX_READ = 1 << 30  # bytes per preadv (Linux returns at most 2 GiB - 4 KiB from one call)
MAX_BUFFERS = 1000  # buffers per preadv (IOV_MAX is 1024 on Linux)


@dataclass(frozen=True)
class FileSpan:
    """``nbytes`` at byte ``offset`` of the file at ``path``."""

    path: str
    offset: int
    nbytes: int


@dataclass
class Read:
    """One preadv: from byte ``offset`` of ``path``, the file's bytes in order into ``buffers``
    (destinations and gap fillers; their lengths sum to the stretch read)."""

    path: str
    offset: int
    buffers: list[memoryview] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


def shared_file_maps() -> list[tuple[int, int, int, str, int]]:
    """(start, end, file offset, path, inode) of this process's shared file mappings; none off Linux."""
    if not sys.platform.startswith("linux"):
        return []
    maps = []
    try:
        with open("/proc/self/maps") as lines:
            for line in lines:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[1][3] == "s" and fields[5].startswith("/"):
                    lo, hi = fields[0].split("-")
                    maps.append((int(lo, 16), int(hi, 16), int(fields[2], 16), fields[5].rstrip("\n"),
                                 int(fields[4])))
    except (OSError, ValueError, IndexError):
        return []
    return maps


def file_span(address: int, nbytes: int, maps: list[tuple[int, int, int, str, int]]) -> FileSpan | None:
    """Where ``nbytes`` at ``address`` lie in a file, if inside one of ``maps`` (shared_file_maps)
    and the path still names the file mapped (same inode: not for a file deleted or replaced
    since, nor a path /proc/self/maps had to escape)."""
    for lo, hi, offset, path, inode in maps:
        if lo <= address and address + nbytes <= hi:
            try:
                same = os.stat(path).st_ino == inode
            except OSError:
                same = False
            return FileSpan(path, offset + address - lo, nbytes) if same else None
    return None


def plan_reads(pairs: list[tuple[FileSpan, memoryview]], parts: int, gap: memoryview) -> list[Read]:
    """Reads that fill every destination of ``pairs`` (a span and a writable byte view of the
    same length) with its span's bytes: per file, the spans in file order cut into about
    ``parts`` stretches of equal bytes (one per reading thread), a stretch split further where
    two spans lie over MAX_GAP apart, past MAX_READ bytes or MAX_BUFFERS buffers. Bytes
    between the spans of a read go to slices of ``gap`` (at least MAX_GAP long; shared by all
    reads, its contents meaningless). Largest reads first."""
    reads: list[Read] = []
    by_file: dict[str, list[tuple[FileSpan, memoryview]]] = {}
    for span, view in pairs:
        if view.nbytes != span.nbytes:
            raise ValueError(f"a destination of {view.nbytes} bytes for a span of {span.nbytes}")
        by_file.setdefault(span.path, []).append((span, view))
    total = sum(span.nbytes for span, _ in pairs)
    share = max(1, -(-total // max(1, parts)))
    for path, spans in by_file.items():
        spans.sort(key=lambda pair: pair[0].offset)
        read: Read | None = None
        end = size = 0  # the file offset where the current read's bytes end, and their count
        for span, view in spans:
            between = span.offset - end
            if (read is None or between < 0 or between > MAX_GAP or size >= share
                    or size + between + span.nbytes > MAX_READ or len(read.buffers) + 2 > MAX_BUFFERS):
                read, size = Read(path, span.offset), 0
                reads.append(read)
            elif between:
                read.buffers.append(gap[:between])
                size += between
            read.buffers.append(view)
            end, size = span.offset + span.nbytes, size + span.nbytes
    reads.sort(key=lambda r: -r.nbytes)
    return reads


def read_spans(pairs: list[tuple[FileSpan, memoryview]], pool: Executor, parts: int) -> None:
    """Fill every destination of ``pairs`` with its span's bytes: :func:`plan_reads` for
    ``parts`` threads, the reads run on ``pool``, one gap buffer shared by them all."""
    if pairs:
        list(pool.map(run_read, plan_reads(pairs, parts, memoryview(bytearray(MAX_GAP)))))


def run_read(read: Read) -> None:
    """Fill ``read``'s buffers from its file (positional reads: threads may run reads of the
    same file at once); a short read continues where it stopped. Raises OSError where the
    file ends early or cannot be read."""
    fd = os.open(read.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        buffers, offset = list(read.buffers), read.offset
        while buffers:
            done = os.preadv(fd, buffers, offset)
            if done <= 0:
                raise OSError(f"{read.path}: ends before byte {offset + sum(b.nbytes for b in buffers)}")
            offset += done
            while buffers and done >= buffers[0].nbytes:
                done -= buffers.pop(0).nbytes
            if done:
                buffers[0] = buffers[0][done:]
    finally:
        os.close(fd)
