"""A file mapping's pages brought onto 2 MB pages of the page cache, in place.

A decode step reads every weight once per token, so one stream runs at the speed the
weights stream from memory, and on 4 KB pages a TLB miss every 4 KB costs that stream a
fifth of its speed (bargein.loader.private_weights). Linux's page cache holds a file in
large folios where its filesystem supports them (ext4 since Linux 6.16, XFS earlier): a
2 MB folio at a 2 MB offset of the file, mapped at an address of the same offset within a
2 MB page (the kernel places large file mappings so), is mapped by one page-table entry
like an anonymous huge page ("FilePmdMapped" in /proc/self/smaps). A file read from disk
comes in on such folios; one written on this machine (downloaded, quantized) stays on the
4 KB pages of its writes until the kernel drops them. llama1b.Q4_K_M (636 MB) decoded one
stream at 53-54 tok/s from its file's 2 MB pages against 45 from its 4 KB pages and 49
from a private copy on 4 KB pages (2-core Zen 4 VM, 2026-12-07, docs/benchmarks.md).

:func:`refill` moves one range of such a mapping onto fresh 2 MB page-cache pages without
a moment where its addresses read anything but the file's bytes: a private copy of the
range is moved over it (so this process no longer maps the file's small pages), the page
cache drops those pages (``POSIX_FADV_DONTNEED``: only pages no process maps, so never
another process's), a fresh view of the file's range at the same offset within a 2 MB page
is filled from the file (``MADV_HUGEPAGE`` then ``MADV_POPULATE_READ``: read-ahead in 2 MB
folios), and that view is moved over the copy. It costs one read of the range from the
disk. Whether the kernel gave 2 MB pages is only seen in /proc/self/smaps
(:func:`file_huge_bytes`), per mapping, not per range; so callers refill a few ranges
first and look (bargein.loader.private_weights).

A file on a file system that keeps files in memory only (tmpfs, ramfs:
:func:`memory_file_system`) has no disk to be read again from: its pages are the file, the
page cache cannot drop them, and a private copy would hold the weights in memory twice.
:func:`collapse` gathers a tmpfs file's small pages onto 2 MB pages in place instead
(``MADV_COLLAPSE``), which needs the mapping at a 2 MB boundary of the address space
(bargein.loader.file_maps.map_whole_file): the kernel does not place a mapping of a file
on a tmpfs mounted without huge pages (/dev/shm) so itself. llama1b.Q4_K_M in /dev/shm
decoded one stream at 32.2 tok/s from its 4 KB pages against 37.9 from the same file on
2 MB pages (a tmpfs mounted with ``huge=always``) and 37.3 from ext4's page cache (2-core
Zen 4 VM, medians of five alternated processes, 2026-12-07).

Linux only; elsewhere nothing here is called.
"""

from __future__ import annotations

import ctypes
import os

from bargein.loader.file_maps import (
    HUGE_PAGE,
    MADV_COLLAPSE,
    MADV_HUGEPAGE,
    MADV_POPULATE_READ,
    MADV_POPULATE_WRITE,
    MAP_SHARED_FIXED,
    PROT_READ,
    libc,
    madvise,
    os_error,
    staged_at_offset,
)

_MREMAP_MAYMOVE_FIXED = 1 | 2
_SYNC_WAIT_WRITE_WAIT = 1 | 2 | 4  # sync_file_range: wait for, start, then wait for the range's writeback


def move_over(stage: int, start: int, nbytes: int) -> None:
    """Move the mapping at ``stage`` over ``start`` (``mremap``: the pages go, not their
    bytes; what ``start`` mapped before is unmapped in the same call). On failure the stage
    is unmapped and OSError raised; ``start`` maps what it did."""
    moved = libc().mremap(ctypes.c_void_p(stage), nbytes, nbytes, _MREMAP_MAYMOVE_FIXED, ctypes.c_void_p(start))
    if moved != start:
        error = os_error("mremap")
        libc().munmap(ctypes.c_void_p(stage), nbytes)
        raise error


def remap(start: int, nbytes: int, fd: int, file_offset: int) -> None:
    """Map ``nbytes`` at ``start`` (whole pages of a read-only shared mapping of ``fd`` from
    ``file_offset``) afresh from the page cache: a fresh view at the same offset within a 2 MB
    page, advised huge and populated, moved over the range. Where the page cache holds 2 MB
    folios there they are mapped on 2 MB pages; what it lacks is read from the file, in 2 MB
    folios where the kernel makes them. Raises OSError where a step is refused; the range then
    maps what it did."""
    view = staged_at_offset(start, nbytes, prot=PROT_READ)
    if libc().mmap(ctypes.c_void_p(view), nbytes, PROT_READ, MAP_SHARED_FIXED, fd, file_offset) != view:
        error = os_error("mmap")
        libc().munmap(ctypes.c_void_p(view), nbytes)
        raise error
    madvise(view, nbytes, MADV_HUGEPAGE)
    madvise(view, nbytes, MADV_POPULATE_READ)
    move_over(view, start, nbytes)


def refill(start: int, nbytes: int, fd: int, file_offset: int) -> None:
    """:func:`remap` after the range's pages were dropped from the page cache, so that they
    are read again from the file, on 2 MB pages where the kernel gives them; see the module
    docstring. The addresses read the same bytes throughout. Raises OSError where a step is
    refused; the range then maps the file's pages or a private copy of them."""
    copy = staged_at_offset(start, nbytes)
    madvise(copy, nbytes, MADV_POPULATE_WRITE)  # faulted in at once, not a trap per page
    ctypes.memmove(copy, start, nbytes)  # the GIL released
    move_over(copy, start, nbytes)  # this process no longer maps the file's pages there
    # Written back first: the page cache keeps dirty pages (a file written in the last
    # seconds, say just downloaded), and DONTNEED would leave them all in place.
    libc().sync_file_range(fd, file_offset, nbytes, _SYNC_WAIT_WRITE_WAIT)
    os.posix_fadvise(fd, file_offset, nbytes, os.POSIX_FADV_DONTNEED)
    remap(start, nbytes, fd, file_offset)


def collapse(start: int, nbytes: int) -> None:
    """Gathers the pages of a tmpfs file's mapping in ``[start, start + nbytes)`` onto 2 MB
    pages in place (``MADV_COLLAPSE``, Linux 6.1 and later, whatever the mount's huge pages
    setting unless shmem_enabled is ``deny``): each whole 2 MB page of the range, at a 2 MB
    offset of the file, is copied into one huge page that replaces the small ones in the file
    itself (for every process on it; the memory the file takes stays the same) and is mapped
    whole here. The addresses read the same bytes throughout: a read of a page being moved
    waits for it. Raises OSError where the kernel refuses; what was gathered stays so."""
    if not madvise(start, nbytes, MADV_COLLAPSE):
        raise os_error("madvise(MADV_COLLAPSE)")


# The file systems whose files live in memory only: their pages are the file itself.
MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs"})
# smaps' fields of a mapping's pages mapped on 2 MB pages: a file's page cache, and a
# tmpfs file's pages (shared memory, counted apart)
PMD_MAPPED_FIELDS = ("FilePmdMapped:", "ShmemPmdMapped:")


def mount_type(device: int, mountinfo: str) -> str | None:
    """The file system type of the mount of ``device`` (st_dev) in ``mountinfo`` (the text
    of /proc/self/mountinfo: field 3 major:minor, the type first after " - "), or None."""
    wanted = f"{os.major(device)}:{os.minor(device)}"
    for line in mountinfo.splitlines():
        fields, _, rest = line.partition(" - ")
        numbers = fields.split()
        if len(numbers) > 2 and numbers[2] == wanted and rest.split():
            return rest.split()[0]
    return None


def memory_file_system(path: str) -> str | None:
    """The type of the file system holding ``path`` where it keeps files in memory only
    (:data:`MEMORY_FILE_SYSTEMS`), else None (also where the file or /proc cannot be read)."""
    try:
        device = os.stat(path).st_dev
        with open("/proc/self/mountinfo") as mounts:
            kind = mount_type(device, mounts.read())
    except OSError:
        return None
    return kind if kind in MEMORY_FILE_SYSTEMS else None


def file_huge_bytes(inodes: set[int]) -> int:
    """Bytes of this process's mappings of the files ``inodes`` mapped on 2 MB pages
    (FilePmdMapped, and ShmemPmdMapped for a tmpfs file, summed over their mappings in
    /proc/self/smaps; 0 where unreadable). Reading smaps walks every mapping's page tables:
    a few milliseconds for a 1B model."""
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                fields = line.split()
                if fields and "-" in fields[0] and not fields[0].endswith(":"):
                    inside = len(fields) >= 5 and fields[4].isdigit() and int(fields[4]) in inodes
                elif inside and fields[0] in PMD_MAPPED_FIELDS:
                    total += int(fields[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


def huge_page_bytes(spans: list[tuple[int, int]]) -> int:
    """Bytes of the whole 2 MB pages inside the (start, end) address ``spans``: the most of
    them that can be mapped on 2 MB pages."""
    return sum(max(0, end // HUGE_PAGE - -(-start // HUGE_PAGE)) * HUGE_PAGE for start, end in spans)
