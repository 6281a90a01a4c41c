"""This process's shared file mappings: which there are, where a tensor viewed from one lies
in its file, and its pages mapped in ahead of their first read.

A weight loaded from a GGUF or safetensors file is a view of the file's shared mapping.
:func:`shared_file_maps` lists those mappings (``/proc/self/maps``: Linux only, none
elsewhere); :func:`file_span` finds where a view's bytes lie in which file (``None`` for
memory that is not a file view, such as weights made private memory by
bargein.loader.private_weights); :func:`map_ahead` has the kernel map a mapping's pages
in before a forward touches them. :func:`map_whole_file` maps a model's file so that each 2
MB page of it can be mapped whole. The libc calls on mapped memory (:func:`libc`,
:func:`madvise`) go through ctypes, which releases the GIL for each.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

# madvise(2) advice values (Linux)
MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15
MADV_POPULATE_READ = 22  # Linux 5.14 and later; older kernels say EINVAL
MADV_POPULATE_WRITE = 23  # the same
MADV_COLLAPSE = 25  # Linux 6.1 and later

HUGE_PAGE = 2 << 20
PROT_NONE, PROT_READ, PROT_READ_WRITE = 0, 1, 3
MAP_SHARED_FIXED = 0x01 | 0x10
_MAP_PRIVATE_ANONYMOUS = 0x02 | 0x20
MAP_FAILED = ctypes.c_void_p(-1).value


@dataclass(frozen=True)
class FileSpan:
    """``nbytes`` at byte ``offset`` of the file at ``path`` (inode ``inode``)."""

    path: str
    offset: int
    nbytes: int
    inode: int = 0


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
            return FileSpan(path, offset + address - lo, nbytes, inode) if same else None
    return None


_LIBC: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    """This process's C library, with the memory calls' signatures set (madvise, mmap, munmap,
    mremap, sync_file_range); each call releases the GIL."""
    global _LIBC
    if _LIBC is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mremap.restype = ctypes.c_void_p
        lib.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        _LIBC = lib
    return _LIBC


def madvise(address: int, nbytes: int, advice: int) -> bool:
    """madvise(2) on ``nbytes`` from ``address`` (the GIL released for the call); True if it did."""
    return libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), ctypes.c_int(advice)) == 0


def map_whole_file(path: str | os.PathLike[str]) -> np.ndarray:
    """The whole file at ``path`` as a read-only uint8 array over one shared mapping, placed
    at a 2 MB boundary: each 2 MB page of the file then lies on a 2 MB page of the address
    space, so the kernel can map it whole (one page-table entry, no TLB miss per 4 KB). The
    kernel places large mappings of an ext4 or XFS file so itself, but not those of a file
    on a tmpfs mounted without huge pages (/dev/shm), whose pages
    bargein.loader.private_weights gathers onto 2 MB pages in place.

    Views of the array keep the mapping (numpy holds the buffer); it is unmapped when the
    last one goes. Off Linux, or where the placement is refused, the mapping is Python's
    ``mmap``, wherever it falls.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        placed = _placed_mapping(f.fileno(), size) if size and sys.platform.startswith("linux") else None
        if placed is None:
            return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
    buffer = (ctypes.c_ubyte * size).from_address(placed)
    unmap = weakref.finalize(buffer, libc().munmap, ctypes.c_void_p(placed), ctypes.c_size_t(size))
    unmap.atexit = False  # at exit the process ends with it: a daemon thread may still read it
    mapped = np.frombuffer(buffer, dtype=np.uint8)
    mapped.flags.writeable = False  # the pages are read-only: a write would fault
    return mapped


def _placed_mapping(fd: int, size: int) -> int | None:
    """The address of a read-only shared mapping of ``size`` bytes of ``fd`` at a 2 MB
    boundary (mapped over an inaccessible range placed there), or None where a step is
    refused."""
    try:
        start = staged_at_offset(0, size, prot=PROT_NONE)
    except OSError:
        return None
    if libc().mmap(ctypes.c_void_p(start), size, PROT_READ, MAP_SHARED_FIXED, fd, 0) != start:
        libc().munmap(ctypes.c_void_p(start), size)
        return None
    return start


def staged_at_offset(start: int, nbytes: int, *, prot: int = PROT_READ_WRITE) -> int:
    """A fresh anonymous private mapping of ``nbytes`` (``prot``) at the same offset within
    a 2 MB page as ``start``, so that a huge page inside it stays one when moved there (an
    address range reserved 2 MB longer, the rest of it given back)."""
    raw = libc().mmap(None, nbytes + HUGE_PAGE, prot, _MAP_PRIVATE_ANONYMOUS, -1, 0)
    if raw in (None, MAP_FAILED):
        raise os_error("mmap")
    stage = raw + (start - raw) % HUGE_PAGE
    if stage > raw:
        libc().munmap(ctypes.c_void_p(raw), stage - raw)
    end = stage + -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # past the mapping's last page
    libc().munmap(ctypes.c_void_p(end), raw + HUGE_PAGE - stage)  # the slack past it
    return stage


def os_error(what: str) -> OSError:
    """The OSError of the last failed libc call (its errno), naming ``what`` was called."""
    errno = ctypes.get_errno()
    return OSError(errno, f"{what}: {os.strerror(errno)}")


def map_ahead(mapped: np.ndarray, spans: Iterable[tuple[int, int]]) -> threading.Thread | None:
    """Starts mapping in the pages of ``spans`` ((offset, nbytes) into ``mapped``, a view of a
    whole file's read-only mapping) on a daemon thread, and returns it; None where there is
    nothing to do (no span, not Linux).

    A first forward over weights viewed from a file faults each of their pages into this
    process (page-cache pages, page-table entries only): ~2,600 faults for SmolLM2-135M's
    131 MB, ~10 ms of a 32-token first forward (54 against 44 ms with them mapped ahead).
    ``madvise(MADV_POPULATE_READ)`` maps a range in one call (reading what the page cache
    lacks), and ctypes releases the GIL for it, so the loader starts it as soon as it knows
    the ranges and the pages come in beside the tokenizer's build. The pages are the file's,
    as a fault would map them: what is resident and shared does not change, only when. Where the kernel refuses (before Linux
    5.14) the thread stops at the first range and the forward faults the pages in as before.
    The thread holds ``mapped`` (so the mapping) until it ends.
    """
    merged: list[list[int]] = []
    for offset, nbytes in sorted((o, n) for o, n in spans if n > 0):
        if merged and offset <= merged[-1][1] + mmap.PAGESIZE:  # touching, or a page apart
            merged[-1][1] = max(merged[-1][1], offset + nbytes)
        else:
            merged.append([offset, offset + nbytes])
    if not merged or not sys.platform.startswith("linux"):
        return None

    def run(held: np.ndarray = mapped) -> None:  # held: the mapping stays while its pages come in
        base = held.ctypes.data
        for start, end in merged:
            address = base + start
            head = address % mmap.PAGESIZE  # from the page it begins in
            if not madvise(address - head, end - start + head, MADV_POPULATE_READ):
                return

    thread = threading.Thread(target=run, name="bargein-map-ahead", daemon=True)
    thread.start()
    return thread
