"""The matmul weights made private memory in place, beside serving.

A decode step reads every weight once per token, so one stream runs at the speed the
weights stream from memory. Read from the file's mapped pages (4 KB page-cache pages: a
read-only ext4 mapping gets no huge pages, and ``MADV_COLLAPSE`` refuses it) the same kernel
takes 1.18-1.27x as long per step as from an anonymous copy on 2 MB pages (about a third of
that from anonymous memory alone, the rest from the huge pages: TLB misses of a 600 MB
stream; ``bench/gemv_layout.c``, docs/benchmarks.md). llama.cpp's load-time repack gets its
one-stream lead the same way: its rows land in an anonymous buffer.

:func:`private_copy` finds the pages, and its :meth:`~PrivateWeights.start` returns at
once: the model serves from the file's mapping meanwhile, and one background thread at the
lowest priority makes the pages under the weights' file views private, a chunk at a time,
*at the same addresses*: each chunk's bytes
are copied into a fresh anonymous mapping (placed at the same offset within a 2 MB page
as the chunk, so that its huge pages survive the move), which one ``mremap(MREMAP_FIXED)``
then moves over the file's pages. Every tensor, C structure and kernel keeps its pointers;
a reader sees the file's bytes before the move and the same bytes after it (a page fault
during the move waits for it to end), so steps run while the copy goes on and give the
same bits (the load's critical path holds no copy: 0.12-0.77 s of the load times in
docs/benchmarks.md were this copy). The thread holds the weights only while it moves a
chunk (they keep the mapping it moves into alive); once nothing else holds any of them
(the model was dropped) it stops. It moves a chunk only while the model is quiet (no
forward for QUIET_S; :meth:`PrivateWeights.start`'s ``quiet``): the copy takes the time
between a chat's turns or an idle server's requests, never a step's memory bandwidth
(under constant load the weights stay the file's pages until a pause).

Each chunk is faulted in before its bytes come (``MADV_POPULATE_WRITE``: the kernel's own
loop, no trap per page), on huge pages while they come at HUGE_PAGE_MIN_RATE or faster and
for the first HUGE_PAGE_BUDGET_S of the thread's time at most (a huge page's first fault
can be slow); after that on 4 KB pages, advised huge once the copy is done so that
khugepaged may merge them over time. The copy is the same bytes at the same addresses, so
every kernel path gives the same bits from it. The price: the pages are private, not shared
with other processes serving the same file (``weights_memory="mapped"`` keeps the file's
pages; see EngineConfig). The caller may keep some weights out of the copy: the loader keeps
an MoE's experts in the file's pages, since a token reads only the few it is routed to
(bargein.loader.private_copy_of).

Linux only (``mremap``): elsewhere the weights stay mapped, and say so in the log.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from bargein.kernels.quant_weight import QuantWeight
from bargein.loader.file_maps import libc, madvise, os_error, shared_file_maps

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# A huge page's first fault can be slow: on this project's VMs (Firecracker guests whose
# virtio-balloon reports every free 2 MB block back to the host, so a huge page, a whole
# such block, is faulted in by the host on first touch) 600 MB took 3.9-7.4 s on fresh
# 2 MB pages, 0.09 s on reused ones, 0.2-0.6 s on 4 KB pages. So huge pages are faulted in
# during this much of the copy thread's time at most (its CPU time: a thread of the lowest
# priority waits for the CPU often, and that is no slow fault)...
HUGE_PAGE_BUDGET_S = 0.3
# ... and only while they come in at least this fast (bytes a second of that time, over the
# chunks so far): where a huge page costs about a memory clear (reused blocks, bare metal)
# the whole copy gets them; where each takes milliseconds (the VMs above: 72-336 MiB in
# 0.3 s) they bought no decode speed that one stream could show (llama1b Q4_K_M 41 against
# 42 tok/s, Q6_K 32 against 34, SmolLM2-135M 179 against 177, alternated processes,
# 2026-12-04).
HUGE_PAGE_MIN_RATE = 2e9
CHUNK = 4 * HUGE_PAGE  # bytes moved at a time (at most; ends fall on 2 MB boundaries)
MERGE_GAP = 1 << 20  # two ranges this close, with nothing kept between, are moved as one
# A model counts as quiet once no forward ran for this long: a decode's forwards follow one
# another within milliseconds, the turns of a chat or the requests of an idle server are
# seconds apart. Chunks moved beside steps cost them memory bandwidth: a 1B-class Q4_K_M
# file's first answer after load decoded at 23-31 tok/s against 33-38 (2026-12-04).
QUIET_S = 0.05
QUIET_POLL_S = 0.01  # how often a copy waiting for a quiet model asks again
_PAGE = mmap.PAGESIZE
_PROT_READ_WRITE = 3  # writable: khugepaged collapses no read-only anonymous range
_MAP_PRIVATE_ANONYMOUS = 0x02 | 0x20
_MREMAP_MAYMOVE_FIXED = 1 | 2
_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_HUGEPAGE = 14
_MADV_NOHUGEPAGE = 15
_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later; older kernels say EINVAL (the copy faults the pages in)
_LINUX = sys.platform.startswith("linux")
DROPPED = "the weights were dropped"  # PrivateCopy.error of a copy whose model went away


@dataclass(frozen=True)
class PrivateCopy:
    """What a private copy did: ``bytes`` moved into private memory (whole pages under the
    weights' blocks), ``huge_bytes`` of this process's anonymous memory on 2 MB pages after it
    (all of it, as /proc/self/smaps_rollup says; 0 where the system does not), ``seconds``
    from its start to its end, ``kept_bytes`` of blocks the caller kept in the file's pages,
    and ``error``: why it stopped early, the rest left mapped (None when it did not)."""

    bytes: int
    huge_bytes: int
    seconds: float
    kept_bytes: int = 0
    error: str | None = None

    def describe(self, kept: str = "weights") -> str:
        """The one log line of the copy; ``kept`` names what ``kept_bytes`` are."""
        left = (f"; {self.kept_bytes / 2**20:,.0f} MiB of {kept} left in the file's pages"
                if self.kept_bytes else "")
        stopped = f"; stopped early, the rest read from the file's pages: {self.error}" if self.error else ""
        return (f"weights: {self.bytes / 2**20:,.0f} MiB of blocks made private memory beside serving in "
                f"{self.seconds:.2f} s ({self.huge_bytes / 2**20:,.0f} MiB of the process on 2 MB pages)"
                f"{left}{stopped}; --weights-memory mapped keeps them all in the shared page cache instead")


@dataclass(frozen=True)
class PageRange:
    """Whole pages ``start`` .. ``end`` (addresses) of one file mapping."""

    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def private_ranges(weights: dict[str, object], keep: Callable[[str], bool],
                   maps: list[tuple[int, int, int, str, int]]) -> tuple[list[PageRange], int]:
    """The pages to make private: those under the blocks of every :class:`QuantWeight` of
    ``weights`` that lie in one of ``maps`` (shared_file_maps), but those whose name ``keep``
    says to leave (a page holding any of their bytes stays mapped); ranges of one mapping
    less than MERGE_GAP apart with no kept block between are joined. Returns the ranges, in
    address order, and the bytes of the kept weights' blocks. Blocks outside every mapping
    are private memory already."""
    wanted: dict[int, list[tuple[int, int]]] = {}  # mapping index: [(lo, hi)] of the blocks
    kept: dict[int, list[tuple[int, int]]] = {}
    kept_bytes, seen_kept = 0, set()
    for name, w in weights.items():
        if not isinstance(w, QuantWeight):
            continue
        for segment in w.segments:
            lo, hi = segment.data.data_ptr(), segment.data.data_ptr() + segment.data.nbytes
            index = next((i for i, (start, end, *_) in enumerate(maps) if start <= lo and hi <= end), None)
            if keep(name):
                if (lo, hi) not in seen_kept:
                    seen_kept.add((lo, hi))
                    kept_bytes += hi - lo
                if index is not None:
                    kept.setdefault(index, []).append((lo, hi))
            elif index is not None:
                wanted.setdefault(index, []).append((lo // _PAGE * _PAGE, -(-hi // _PAGE) * _PAGE))
    ranges: list[PageRange] = []
    for index, spans in sorted(wanted.items(), key=lambda item: maps[item[0]][0]):
        held = kept.get(index, [])
        merged: list[list[int]] = []
        for lo, hi in sorted(spans):
            if merged and lo - merged[-1][1] <= MERGE_GAP and not any(
                    k_lo < lo and k_hi > merged[-1][1] for k_lo, k_hi in held):
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        for lo, hi in merged:
            for k_lo, k_hi in sorted(held):  # the kept blocks' pages cut out
                k_lo, k_hi = k_lo // _PAGE * _PAGE, -(-k_hi // _PAGE) * _PAGE
                if k_lo < hi and lo < k_hi:
                    if lo < k_lo:
                        ranges.append(PageRange(lo, k_lo))
                    lo = max(lo, k_hi)
            if lo < hi:
                ranges.append(PageRange(lo, hi))
    return ranges, kept_bytes


def chunks(ranges: Iterable[PageRange]) -> list[PageRange]:
    """``ranges`` cut into pieces of at most CHUNK bytes, every cut on a 2 MB boundary (so
    that a huge page of a piece is whole inside it)."""
    out = []
    for r in ranges:
        at = r.start
        while at < r.end:
            end = min(r.end, (at + CHUNK) // HUGE_PAGE * HUGE_PAGE)
            if end <= at:
                end = min(r.end, at + CHUNK)
            out.append(PageRange(at, end))
            at = end
    return out


class HugePagePhase:
    """Whether the next chunk is faulted in on huge pages: from the start, until the chunks
    faulted in came slower than HUGE_PAGE_MIN_RATE (bytes over ``clock`` time since the
    start, looked at after each chunk) or HUGE_PAGE_BUDGET_S of it is spent; then never again."""

    def __init__(self, clock: Callable[[], float] = time.thread_time):
        self.clock = clock
        self.began = clock()
        self.faulted = 0
        self.on = True

    def faulted_in(self, nbytes: int) -> None:
        self.faulted += nbytes
        spent = self.clock() - self.began
        if self.faulted < HUGE_PAGE_MIN_RATE * spent or spent > HUGE_PAGE_BUDGET_S:
            self.on = False


def _staged(target: PageRange) -> int:
    """A fresh anonymous private mapping of ``target.nbytes`` at the same offset within a
    2 MB page as ``target.start`` (so that a huge page inside it stays one when moved there)."""
    raw = libc().mmap(None, target.nbytes + HUGE_PAGE, _PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS, -1, 0)
    if raw in (None, _MAP_FAILED):
        raise os_error("mmap")
    stage = raw + (target.start - raw) % HUGE_PAGE
    if stage > raw:
        libc().munmap(ctypes.c_void_p(raw), stage - raw)
    libc().munmap(ctypes.c_void_p(stage + target.nbytes), raw + HUGE_PAGE - stage)  # the slack past it
    return stage


def move_private(target: PageRange, huge: bool) -> int:
    """Make the pages of ``target`` private memory holding the same bytes, at the same
    addresses: a staged copy (faulted in first, on huge pages if ``huge``) moved over them.
    Returns the bytes faulted in on huge pages' advice; raises OSError where the system
    refuses (then the pages are as they were)."""
    stage = _staged(target)
    try:
        madvise(stage, target.nbytes, _MADV_HUGEPAGE if huge else _MADV_NOHUGEPAGE)
        madvise(stage, target.nbytes, _MADV_POPULATE_WRITE)  # else the copy faults them in
        ctypes.memmove(stage, target.start, target.nbytes)  # the GIL released
        moved = libc().mremap(ctypes.c_void_p(stage), target.nbytes, target.nbytes, _MREMAP_MAYMOVE_FIXED,
                              ctypes.c_void_p(target.start))
        if moved != target.start:
            raise os_error("mremap")
    except BaseException:
        libc().munmap(ctypes.c_void_p(stage), target.nbytes)
        raise
    return target.nbytes if huge else 0


def _anon_huge_bytes() -> int:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _lowest_priority() -> None:
    """This thread (Linux: a thread's nice value is its own) at nice 19: it takes a core
    only where serving leaves one, and never holds a step back."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class PrivateWeights:
    """One private copy of a model's weights, to start, running, or ended; see the module
    docstring. Made by :func:`private_copy`."""

    def __init__(self, weights: dict[str, object], ranges: list[PageRange], kept_bytes: int,
                 describe_kept: str):
        self._weights = [weakref.ref(w) for w in weights.values() if isinstance(w, QuantWeight)]
        self._chunks = chunks(ranges)
        self._kept_bytes, self._describe_kept = kept_bytes, describe_kept
        self._done = threading.Event()
        self._quiet: Callable[[], bool] | None = None
        self.result: PrivateCopy | None = None
        self._thread = threading.Thread(target=self._run, name="bargein-weights-private", daemon=True)

    def start(self, quiet: Callable[[], bool] | None = None) -> PrivateWeights:
        """Start the copy's thread (once); returns this copy. ``quiet``: asked before each
        chunk, which waits until it says True (the model's quiet_for: a chunk moves only
        while no step runs, so that steps never share the memory with the copy)."""
        self._quiet = quiet
        with _RUNNING_LOCK:
            _RUNNING.add(self)
        self._thread.start()
        return self

    def start_after_first_forward(self, stage: Any) -> None:
        """Start once ``stage`` (a LlamaStage: ``after_next_forward``, ``quiet_for``) has run
        its next forward, moving chunks only while it is quiet. That forward faults the
        file's pages in (thousands of faults), which the copy's moves beside it slowed by
        5-70 ms of its 30 ms on this project's VMs (SmolLM2-135M Q8_0, 2026-12-04)."""
        stage.after_next_forward(lambda: self.start(quiet=stage.quiet_for(QUIET_S)))

    def _held_any(self) -> bool:
        return any(ref() is not None for ref in self._weights)

    def wait(self, timeout: float | None = None) -> PrivateCopy | None:
        """What the copy did, once it ended (None if not within ``timeout`` seconds)."""
        return self.result if self._done.wait(timeout) else None

    def _run(self) -> None:
        began = time.perf_counter()
        _lowest_priority()
        phase, moved, error, small = HugePagePhase(), 0, None, []
        try:
            for chunk in self._chunks:
                while self._quiet is not None and not self._quiet() and self._held_any():
                    time.sleep(QUIET_POLL_S)
                held = [w for w in (ref() for ref in self._weights) if w is not None]
                if not held:  # the model was dropped: its mapping may be gone, and no one would read the copy
                    error = DROPPED
                    break
                huge = phase.on
                try:
                    move_private(chunk, huge)
                except OSError as exc:
                    error = str(exc)
                    break
                finally:
                    del held
                if huge:
                    phase.faulted_in(chunk.nbytes)
                else:
                    small.append(chunk)
                moved += chunk.nbytes
            for chunk in small:  # khugepaged may merge them now, a few ranges at a time
                madvise(chunk.start, chunk.nbytes, _MADV_HUGEPAGE)
            self.result = PrivateCopy(moved, _anon_huge_bytes(), time.perf_counter() - began, self._kept_bytes,
                                      error)
            (log.warning if error and error != DROPPED else log.info)("%s", self.result.describe(self._describe_kept))
        finally:
            self._done.set()
            with _RUNNING_LOCK:
                _RUNNING.discard(self)


_RUNNING: set[PrivateWeights] = set()
_RUNNING_LOCK = threading.Lock()


def _forget_in_child() -> None:  # a forked child has no copy threads; its pages are as the fork left them
    global _RUNNING_LOCK
    _RUNNING.clear()
    _RUNNING_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def wait_private_copies(timeout: float | None = None) -> bool:
    """Wait until every private copy running in this process has ended; False if one is
    still running after ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for copy in running:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if copy.wait(left) is None:
            return False
    return True


def private_copy(weights: dict[str, object], *, keep: Callable[[str], bool] = lambda name: False,
                 describe_kept: str = "weights") -> PrivateWeights | None:
    """The copy that makes the pages under the file views of ``weights``' QuantWeights
    private memory in place (see the module docstring), but those whose name ``keep`` says to
    leave (named ``describe_kept`` in the log line), ready to :meth:`~PrivateWeights.start`:
    its ranges are found now, while the views are at hand (it holds none of them: a model
    built from ``weights`` may take them out of the dict). Nothing in ``weights`` changes:
    the same tensors at the same addresses read the same bytes throughout. None where there
    is nothing to copy (no file views; off Linux, after one log line)."""
    maps = shared_file_maps()
    ranges, kept_bytes = private_ranges(weights, keep, maps)
    if not ranges:
        return None
    if not _LINUX:
        log.info("weights: read from the file's pages (a private copy in place needs Linux's mremap)")
        return None
    return PrivateWeights(weights, ranges, kept_bytes, describe_kept)
