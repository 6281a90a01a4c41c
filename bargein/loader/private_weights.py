"""The matmul weights copied out of the mapped file into this process's own memory, on 2 MB pages.

A decode step reads every weight once per token, so one stream runs at the speed the
weights stream from memory. Read from the file's mapped pages (4 KB page-cache pages: a
read-only ext4 mapping gets no huge pages, and ``MADV_COLLAPSE`` refuses it) the same kernel
takes 1.18-1.27x as long per step as from an anonymous copy on 2 MB pages (about a third of
that from anonymous memory alone, the rest from the huge pages: TLB misses of a 600 MB
stream; ``bench/gemv_layout.c``, docs/benchmarks.md). llama.cpp's load-time repack gets its
one-stream lead the same way: its rows land in an anonymous buffer.

:func:`copy_to_private` makes that copy in one anonymous mapping for all the blocks, with
``MADV_HUGEPAGE`` advised. First the mapping is faulted in, in order, by a few threads
(``MADV_POPULATE_WRITE``: the kernel's own loop, no trap per page), on huge pages during the
first HUGE_PAGE_BUDGET_S at most, and only while they come at HUGE_PAGE_MIN_RATE or faster
(a huge page's first fault can be slow); the rest is advised
4 KB pages, for khugepaged to merge into 2 MB pages over time. Then the segments' stored
bytes come in: those viewed from a mapped file are read from the file, about one ``preadv``
per thread (bargein.loader.file_reads: the file's pages never enter this process, and the
threads need the GIL only between reads while the tokenizer is built beside them), the
others copied (the rest of the mapping faulted in first, each copy dropping its source's
file pages, if any, with ``MADV_DONTNEED``). The copy is the same bytes in the same layout
(rows, order, segments), so every kernel path gives the same bits from it. The price: the
pages are private, not shared with other processes serving the same file
(``weights_memory="mapped"`` keeps the file's pages; see EngineConfig). The caller may keep
some weights out of the copy: the loader keeps an MoE's experts in the file's pages, since a
token reads only the few it is routed to (bargein.loader.load_weights).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from bargein.kernels.quant_weight import QuantSegment, QuantWeight
from bargein.loader.file_reads import file_span, read_spans, shared_file_maps

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# A huge page's first fault can be slow: on this project's VMs (Firecracker guests whose
# virtio-balloon reports every free 2 MB block back to the host, so a huge page, a whole
# such block, is faulted in by the host on first touch) 600 MB took 3.9-7.4 s on fresh
# 2 MB pages, 0.09 s on reused ones, 0.2-0.6 s on 4 KB pages. So huge
# pages are faulted in during this long of the copy at most; the rest in 4 KB pages (two
# threads or more), left to khugepaged to merge (see _Arena.huge_pages_later).
HUGE_PAGE_BUDGET_S = 0.3
# ... and only while they come in at least this fast (bytes a second, over the phase so
# far, looked at once a chunk is in): where a huge page costs about a memory clear (reused
# blocks, bare metal) the whole copy gets them within the budget; where each takes
# milliseconds (the VMs above: 72-336 MiB in the 0.3 s) the budget bought no decode speed
# that one stream could show (llama1b Q4_K_M 41 against 42 tok/s, Q6_K 32 against 34,
# SmolLM2-135M 179 against 177, alternated processes) and took 0.3-0.4 s of every load
# (SmolLM2-135M: 0.55-0.60 s against 0.19-0.22 s to its first token; 2026-12-04).
HUGE_PAGE_MIN_RATE = 2e9
_ALIGN = 64  # each segment starts on a cache line
_CHUNK = 4 * HUGE_PAGE  # huge pages are faulted in this much at a time, the budget looked at between
_COPY_THREADS = min(4, os.cpu_count() or 1)
_MADV_DONTNEED = 4
_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later; older kernels say EINVAL
_LINUX = sys.platform.startswith("linux")  # the advice numbers above are Linux's


@dataclass(frozen=True)
class PrivateCopy:
    """What :func:`copy_to_private` made: ``bytes`` copied (the private memory the weights now
    take), ``huge_bytes`` of this process's anonymous memory on 2 MB pages after it (all of
    it, as /proc/self/smaps_rollup says; 0 where the system does not), ``seconds`` taken."""

    bytes: int
    huge_bytes: int
    seconds: float
    kept_bytes: int = 0  # blocks of the weights the caller kept out of the copy, left where they were

    def describe(self, kept: str = "weights") -> str:
        """The one log line of the copy; ``kept`` names what ``kept_bytes`` are."""
        left = (f"; {self.kept_bytes / 2**20:,.0f} MiB of {kept} left in the file's pages"
                if self.kept_bytes else "")
        return (f"weights: {self.bytes / 2**20:,.0f} MiB of blocks copied into private memory in "
                f"{self.seconds:.2f} s ({self.huge_bytes / 2**20:,.0f} MiB of the process on 2 MB pages){left}; "
                "--weights-memory mapped keeps them all in the shared page cache instead")


def _anon_huge_bytes() -> int:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _drop_pages(tensor: torch.Tensor, shared_files: list[tuple[int, int]]) -> None:
    """Unmap from this process the whole pages inside ``tensor``'s bytes where they lie in one
    of ``shared_files`` (the data stays in the file and the page cache; a later read faults
    it back). Never anywhere else: on private memory MADV_DONTNEED would zero the bytes."""
    lo, hi = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    if not any(start <= lo and hi <= end for start, end in shared_files):
        return
    page = mmap.PAGESIZE
    start = (tensor.data_ptr() + page - 1) // page * page
    end = (tensor.data_ptr() + tensor.nbytes) // page * page
    if end > start:
        _madvise(start, end - start, _MADV_DONTNEED)


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _LIBC


def _madvise(address: int, nbytes: int, advice: int) -> bool:
    """madvise(2) on ``nbytes`` from ``address`` (the GIL released for the call); True if it did."""
    return _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), ctypes.c_int(advice)) == 0


class _Arena:
    """``nbytes`` of zeroed anonymous private memory starting on a 2 MB boundary (``tensor``,
    flat uint8, keeps the mapping alive), huge pages advised until :meth:`small_pages_from`."""

    def __init__(self, nbytes: int):
        # MAP_PRIVATE: Python's default for -1 is MAP_SHARED, shared memory (shmem), which gets
        # no transparent huge pages where shmem_enabled is never, and counts as RssShmem
        self.region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20))
        self.huge = hasattr(mmap, "MADV_HUGEPAGE")
        if self.huge:
            self.region.madvise(mmap.MADV_HUGEPAGE)
        anchor = ctypes.c_char.from_buffer(self.region)
        self.skip = -ctypes.addressof(anchor) % HUGE_PAGE
        del anchor  # a live export would keep the mapping from ever closing
        self.nbytes = nbytes
        self.tensor = torch.frombuffer(self.region, dtype=torch.uint8)[self.skip:self.skip + nbytes]
        self.address = self.tensor.data_ptr()

    def fault_in(self, start: int, end: int) -> None:
        """Make bytes ``start`` .. ``end`` of the arena resident, on whatever pages are advised
        there: MADV_POPULATE_WRITE where the kernel has it, else a write to every 4 KB page
        (each a page fault of its own); the GIL released either way."""
        if end > start and not (_LINUX and _madvise(self.address + start, end - start, _MADV_POPULATE_WRITE)):
            self.tensor[start:end:4096].fill_(0)  # zero already: only the faults matter

    def small_pages_from(self, at: int) -> int:
        """Fault the arena from byte ``at`` (rounded up to a huge page) in 4 KB pages: no direct
        compaction from here on. Returns where the 4 KB pages start."""
        start = (at + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        if self.huge and start < self.nbytes:
            self.region.madvise(mmap.MADV_NOHUGEPAGE, self.skip + start, self.nbytes - start)
        return start

    def huge_pages_later(self, start: int) -> None:
        """Advise huge pages again from ``start``, so that khugepaged may merge the 4 KB pages
        in the background, a few ranges at a time. Not MADV_COLLAPSE from a thread of our
        own: each range collapsed holds its readers until it is copied (~20 ms here), and
        every decode step reads every range; one stream decoded 2-3x slower for the seconds
        it took (2026-12-02)."""
        if self.huge and start < self.nbytes:
            self.region.madvise(mmap.MADV_HUGEPAGE, self.skip + start, self.nbytes - start)


def copy_to_private(weights: dict[str, object], *, keep: Callable[[str], bool] = lambda name: False,
                    after_huge_pages: Callable[[], None] | None = None) -> PrivateCopy:
    """Replace every :class:`QuantWeight` of ``weights`` by the same matrix over a private
    copy of its blocks (see the module docstring), except those whose name ``keep`` says to
    leave where they are (counted in ``kept_bytes``); other values are left as they are. A
    segment shared by several weights (a tied embedding and head) is copied once and
    stays shared. Returns what was copied.

    ``after_huge_pages`` is called once the huge pages are in (before the blocks are read
    or copied, or before returning): work started there runs beside the rest of the copy
    without taking the huge pages' time budget (a thread holding the GIL there stalls the
    faulting threads between chunks, and the budget then buys fewer huge pages)."""
    began = time.perf_counter()
    quants = {id(w): w for name, w in weights.items() if isinstance(w, QuantWeight) and not keep(name)}
    kept = {(s.data.data_ptr(), s.data.nbytes) for name, w in weights.items()
            if isinstance(w, QuantWeight) and keep(name) for s in w.segments}
    sources: dict[tuple[int, int], torch.Tensor] = {}
    for w in quants.values():
        for s in w.segments:
            sources.setdefault((s.data.data_ptr(), s.data.nbytes), s.data)
    offsets, total = {}, 0
    for key, data in sources.items():
        offsets[key] = total
        total += (data.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    if not sources:
        if after_huge_pages is not None:
            after_huge_pages()
        return PrivateCopy(0, _anon_huge_bytes(), 0.0, sum(nbytes for _, nbytes in kept))
    arena = _Arena(total)
    maps = shared_file_maps()  # the file views among the sources: read from their files
    spans = {key: file_span(key[0], key[1], maps) for key in sources}
    threads = min(_COPY_THREADS, max(1, total // _CHUNK))
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bargein-weights-copy") as pool:
        small_from = _fault_in_huge(arena, began, pool, threads)
        if after_huge_pages is not None:
            after_huge_pages()
        in_memory = [(key, data) for key, data in sources.items() if spans[key] is None]
        if in_memory and small_from < total:  # the rest on 4 KB pages, one range per thread (their faults overlap)
            bounds = [small_from + (total - small_from) * i // threads // 4096 * 4096 for i in range(threads)]
            bounds.append(total)
            list(pool.map(arena.fault_in, bounds[:-1], bounds[1:]))
        # The file views among the sources, read from their files into their places (the
        # pages past the huge ones faulted in by the reads themselves).
        region = memoryview(arena.region)
        read_spans([(span, region[arena.skip + offsets[key]:arena.skip + offsets[key] + span.nbytes])
                    for key, span in spans.items() if span], pool, threads)
        del region
        shared_files = [(lo, hi) for lo, hi, *_ in maps]

        def copy_one(item: tuple[tuple[int, int], torch.Tensor]) -> None:
            at, data = offsets[item[0]], item[1]
            arena.tensor[at:at + data.nbytes].view(data.shape).copy_(data)  # the GIL released
            _drop_pages(data, shared_files)

        list(pool.map(copy_one, sorted(in_memory, key=lambda item: -item[1].nbytes)))
    arena.huge_pages_later(small_from)
    copies = {key: arena.tensor[offsets[key]:offsets[key] + data.nbytes].view(data.shape)
              for key, data in sources.items()}
    replaced = {
        key: QuantWeight(tuple(QuantSegment(s.qtype, copies[(s.data.data_ptr(), s.data.nbytes)], s.order)
                               for s in w.segments))
        for key, w in quants.items()
    }
    for name, w in weights.items():
        if id(w) in replaced:
            weights[name] = replaced[id(w)]
    return PrivateCopy(sum(d.nbytes for d in sources.values()), _anon_huge_bytes(), time.perf_counter() - began,
                       sum(key[1] for key in kept if key not in sources))


def _fault_in_huge(arena: _Arena, began: float, pool: ThreadPoolExecutor, threads: int) -> int:
    """Fault the arena in from its start, _CHUNK at a time in order, on huge pages, by
    ``threads`` workers of ``pool`` until HUGE_PAGE_BUDGET_S from ``began`` is spent, or
    until the chunks in so far came slower than HUGE_PAGE_MIN_RATE (bytes in over the time
    since ``began``; looked at from the first chunk in); then advise 4 KB pages for
    the rest (:meth:`_Arena.small_pages_from`). Returns where the 4 KB pages start (the
    arena's size if it all got in)."""
    lock = threading.Lock()
    state = {"next": 0, "small_from": arena.nbytes, "in": 0}

    def worker() -> None:
        while True:
            with lock:  # taking a chunk and ending the phase are one step: no chunk past the end
                at = state["next"]
                if at >= state["small_from"]:
                    return
                spent = time.perf_counter() - began
                slow = state["in"] > 0 and state["in"] < HUGE_PAGE_MIN_RATE * spent
                if slow or spent > HUGE_PAGE_BUDGET_S:
                    state["small_from"] = arena.small_pages_from(at)
                    return
                state["next"] = at + _CHUNK
            end = min(at + _CHUNK, arena.nbytes)
            arena.fault_in(at, end)
            with lock:
                state["in"] += end - at

    for done in [pool.submit(worker) for _ in range(threads)]:
        done.result()
    return min(state["small_from"], arena.nbytes)
