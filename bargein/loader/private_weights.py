"""The matmul weights copied out of the mapped file into this process's own memory, on 2 MB pages.

A decode step reads every weight once per token, so one stream runs at the speed the
weights stream from memory. Read from the file's mapped pages (4 KB page-cache pages: a
read-only ext4 mapping gets no huge pages, and ``MADV_COLLAPSE`` refuses it) the same kernel
takes 1.18-1.27x as long per step as from an anonymous copy on 2 MB pages (about a third of
that from anonymous memory alone, the rest from the huge pages: TLB misses of a 600 MB
stream; ``bench/gemv_layout.c``, docs/benchmarks.md). llama.cpp's load-time repack gets its
one-stream lead the same way: its rows land in an anonymous buffer.

:func:`copy_to_private` makes that copy, weight by weight: one anonymous mapping for all the
blocks with ``MADV_HUGEPAGE`` advised, each segment's stored bytes copied into it, then the
file's pages of that segment dropped from this process (``MADV_DONTNEED``: they stay in the
page cache, where the kernel may reclaim them), so the resident set never holds both copies
of more than one tensor. The copy is the same bytes in the same layout (rows, order,
segments), so every kernel path gives the same bits from it. The price: the pages are
private, not shared with other processes serving the same file (``weights_memory="mapped"``
keeps the file's pages; see EngineConfig).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import time
from dataclasses import dataclass

import torch

from bargein.kernels.quant_weight import QuantSegment, QuantWeight

log = logging.getLogger(__name__)

# EngineConfig.weights_memory: where the weights read in place live.
WEIGHTS_MEMORY = ("private", "mapped")
HUGE_PAGE = 2 << 20
_ALIGN = 64  # each segment starts on a cache line
_MADV_DONTNEED = 4


@dataclass(frozen=True)
class PrivateCopy:
    """What :func:`copy_to_private` made: ``bytes`` copied (the private memory the weights now
    take), ``huge_bytes`` of this process's anonymous memory on 2 MB pages after it (all of
    it, as /proc/self/smaps_rollup says; 0 where the system does not), ``seconds`` taken."""

    bytes: int
    huge_bytes: int
    seconds: float

    def describe(self) -> str:
        """The one log line of the copy."""
        return (f"weights: {self.bytes / 2**20:,.0f} MiB of blocks copied into private memory in "
                f"{self.seconds:.2f} s ({self.huge_bytes / 2**20:,.0f} MiB of the process on 2 MB pages); "
                "--weights-memory mapped keeps them in the shared page cache instead")


def _anon_huge_bytes() -> int:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _drop_pages(tensor: torch.Tensor) -> None:
    """Unmap from this process the whole pages inside ``tensor``'s bytes (a view of a shared
    file mapping: the data stays in the file and the page cache; a later read faults it back)."""
    if not sys.platform.startswith("linux"):
        return
    page = mmap.PAGESIZE
    start = (tensor.data_ptr() + page - 1) // page * page
    end = (tensor.data_ptr() + tensor.nbytes) // page * page
    if end > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(_MADV_DONTNEED))


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _LIBC


def _arena(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed anonymous memory, starting on a 2 MB boundary, huge pages advised
    (a flat uint8 tensor that keeps its mapping alive)."""
    # MAP_PRIVATE: Python's default for -1 is MAP_SHARED, shared memory (shmem), which gets
    # no transparent huge pages where shmem_enabled is never, and counts as RssShmem
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    anchor = ctypes.c_char.from_buffer(region)
    skip = -ctypes.addressof(anchor) % HUGE_PAGE
    del anchor  # a live export would keep the mapping from ever closing
    return torch.frombuffer(region, dtype=torch.uint8)[skip:skip + nbytes]


def copy_to_private(weights: dict[str, object]) -> PrivateCopy:
    """Replace every :class:`QuantWeight` of ``weights`` by the same matrix over a private
    copy of its blocks (see the module docstring); other values are left as they are. A
    segment shared by several weights (a tied embedding and head) is copied once and
    stays shared. Returns what was copied."""
    began = time.perf_counter()
    quants = {id(w): w for w in weights.values() if isinstance(w, QuantWeight)}
    sources: dict[tuple[int, int], torch.Tensor] = {}
    for w in quants.values():
        for s in w.segments:
            sources.setdefault((s.data.data_ptr(), s.data.nbytes), s.data)
    offsets, total = {}, 0
    for key, data in sources.items():
        offsets[key] = total
        total += (data.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    if not sources:
        return PrivateCopy(0, _anon_huge_bytes(), 0.0)
    arena = _arena(total)
    copies: dict[tuple[int, int], torch.Tensor] = {}
    for key, data in sources.items():
        at = offsets[key]
        copy = arena[at:at + data.nbytes].view(data.shape)
        copy.copy_(data)
        copies[key] = copy
        _drop_pages(data)
    replaced = {
        key: QuantWeight(tuple(QuantSegment(s.qtype, copies[(s.data.data_ptr(), s.data.nbytes)], s.order)
                               for s in w.segments))
        for key, w in quants.items()
    }
    for name, w in weights.items():
        if isinstance(w, QuantWeight):
            weights[name] = replaced[id(w)]
    return PrivateCopy(sum(d.nbytes for d in sources.values()), _anon_huge_bytes(), time.perf_counter() - began)
