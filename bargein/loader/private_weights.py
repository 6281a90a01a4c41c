"""The matmul weights' pages made fast in place, beside serving: the file's own pages on
2 MB pages of the page cache where the kernel gives them, else private memory.

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

With ``file_pages_first`` (``weights_memory="auto"``, the default) the thread first tries,
once the model has been quiet for SETTLED_S, the file's own pages: where they are on 2 MB
page-cache pages already (a file read from disk, on a kernel whose page cache holds it in
large folios) there is nothing to do; else it
refills the first chunks from the file on 2 MB pages (bargein.loader.huge_page_cache) and,
where /proc/self/smaps then shows them mapped so, the rest. That is faster than the private
copy where huge anonymous pages come slowly (one stream 53-54 against 49 tok/s, llama1b
Q4_K_M on a 2-core Zen 4 VM) and shares the pages with every process on the file. Where
the refilled chunks came back on 4 KB pages (an older kernel, a filesystem without large
folios, another process holding the small pages) it makes the private copy as above. A file
on tmpfs or ramfs is read in place: its pages are memory already, there is no disk to read
them again from, and a copy would hold the weights twice; where they are not on 2 MB pages
(/dev/shm, mounted without huge pages) the thread gathers them onto 2 MB pages in place,
for every process on the file (``MADV_COLLAPSE``, bargein.loader.huge_page_cache).

Linux only (``mremap``): elsewhere the weights stay mapped, and say so in the log.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from bargein.kernels.quant_weight import QuantWeight
from bargein.loader.file_maps import (
    MADV_HUGEPAGE,
    MADV_NOHUGEPAGE,
    MADV_POPULATE_WRITE,
    FileSpan,
    file_span,
    madvise,
    shared_file_maps,
    staged_at_offset,
)
from bargein.loader.huge_page_cache import (
    HUGE_PAGE,
    collapse,
    file_huge_bytes,
    huge_page_bytes,
    memory_file_system,
    move_over,
    refill,
)
from bargein.loader.weight_pages import PageRange, private_ranges

log = logging.getLogger(__name__)

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
# A model counts as quiet once no forward ran for this long: a decode's forwards follow one
# another within milliseconds, the turns of a chat or the requests of an idle server are
# seconds apart. Chunks moved beside steps cost them memory bandwidth: a 1B-class Q4_K_M
# file's first answer after load decoded at 23-31 tok/s against 33-38 (2026-12-04).
QUIET_S = 0.05
QUIET_POLL_S = 0.01  # how often a copy waiting for a quiet model asks again
# file_pages_first looks at the file's pages (a walk of every mapping's page tables) and
# reads them again from the disk only once the model has been quiet this long: a server
# between requests, a chat between turns, not a short-lived process (the test suite's
# engines took 20 s more of its 470 with 50 ms, 2026-12-07).
SETTLED_S = 1.0
# file_pages_first: the file's pages count as on 2 MB pages already from this share of the
# whole 2 MB pages under the weights; else the first PROBE_BYTES of chunks are refilled
# from the file, and the rest follow where the file's mappings then have at least PROBE_GAIN
# of those chunks' 2 MB pages' worth on 2 MB pages (smaps counts per mapping, not per range).
ALREADY_HUGE = 0.9
PROBE_BYTES = 4 * CHUNK
PROBE_GAIN = 0.5
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
    # With file_pages_first: the file's pages of this process on 2 MB pages at the end, the
    # bytes refilled from the file, and whether those pages serve (no copy was made).
    file_huge_bytes: int = 0
    refilled_bytes: int = 0
    file_pages: bool = False
    memory_file_system: str | None = None  # the file's, where it is one (tmpfs): read in place
    # A tmpfs file's: the bytes of whole 2 MB pages gathered onto 2 MB pages in place, and why
    # the kernel refused the rest (huge_page_cache.collapse; the file's pages serve either way)
    gathered_bytes: int = 0
    gather_refused: str | None = None

    def describe(self, kept: str = "weights") -> str:
        """The one log line of the copy; ``kept`` names what ``kept_bytes`` are."""
        left = (f"; {self.kept_bytes / 2**20:,.0f} MiB of {kept} left in the file's pages"
                if self.kept_bytes else "")
        stopped = f"; stopped early, the rest read from the file's pages: {self.error}" if self.error else ""
        if self.file_pages:
            refilled = (f" ({self.refilled_bytes / 2**20:,.0f} MiB read again from the file onto them in "
                        f"{self.seconds:.2f} s)" if self.refilled_bytes else "")
            if self.memory_file_system:
                gathered = (f" ({self.gathered_bytes / 2**20:,.0f} MiB gathered onto them in place in "
                            f"{self.seconds:.2f} s)" if self.gathered_bytes else "")
                refused = (f"; the kernel did not gather the rest onto 2 MB pages ({self.gather_refused})"
                           if self.gather_refused else "")
                return (f"weights: read in place from the file's pages on {self.memory_file_system}, which are "
                        f"memory already (a private copy would hold them twice), "
                        f"{self.file_huge_bytes / 2**20:,.0f} MiB of them on 2 MB pages{gathered}, shared with "
                        f"every process on the file{left}{refused}{stopped}")
            return (f"weights: read in place from the file's pages, {self.file_huge_bytes / 2**20:,.0f} MiB of "
                    f"them on 2 MB pages of the page cache{refilled}, shared with every process on the file"
                    f"{left}{stopped}")
        tried = (f"; the {self.refilled_bytes / 2**20:,.0f} MiB read again from the file came back on 4 KB pages"
                 if self.refilled_bytes else "")
        return (f"weights: {self.bytes / 2**20:,.0f} MiB of blocks made private memory beside serving in "
                f"{self.seconds:.2f} s ({self.huge_bytes / 2**20:,.0f} MiB of the process on 2 MB pages)"
                f"{left}{tried}{stopped}; --weights-memory mapped keeps them all in the shared page cache instead")


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


def move_private(target: PageRange, huge: bool) -> int:
    """Make the pages of ``target`` private memory holding the same bytes, at the same
    addresses: a staged copy (faulted in first, on huge pages if ``huge``) moved over them.
    Returns the bytes faulted in on huge pages' advice; raises OSError where the system
    refuses (then the pages are as they were)."""
    stage = staged_at_offset(target.start, target.nbytes)
    madvise(stage, target.nbytes, MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE)
    madvise(stage, target.nbytes, MADV_POPULATE_WRITE)  # else the copy faults them in
    ctypes.memmove(stage, target.start, target.nbytes)  # the GIL released
    move_over(stage, target.start, target.nbytes)
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
    """One private copy of a model's weights (or, with ``file_pages_first``, the file's pages
    on 2 MB pages where they come so), to start, running, or ended; see the module docstring.
    Made by :func:`private_copy`."""

    def __init__(self, weights: dict[str, object], ranges: list[PageRange], kept_bytes: int,
                 describe_kept: str, *, files: list[FileSpan | None] | None = None):
        self._weights = [weakref.ref(w) for w in weights.values() if isinstance(w, QuantWeight)]
        self._chunks = chunks(ranges)
        self._kept_bytes, self._describe_kept = kept_bytes, describe_kept
        self._files = files  # file_pages_first: where each chunk lies in its file (None: no refill)
        self._done = threading.Event()
        self._quiet: Callable[[], bool] | None = None
        self._settled: Callable[[], bool] | None = None
        self.result: PrivateCopy | None = None
        self._thread = threading.Thread(target=self._run, name="bargein-weights-private", daemon=True)

    def start(self, quiet: Callable[[], bool] | None = None,
              settled: Callable[[], bool] | None = None) -> PrivateWeights:
        """Start the copy's thread (once); returns this copy. ``quiet``: asked before each
        chunk, which waits until it says True (the model's quiet_for: a chunk moves only
        while no step runs, so that steps never share the memory with the copy);
        ``settled``: likewise, once, before file_pages_first looks at the file's pages."""
        self._quiet, self._settled = quiet, settled
        with _RUNNING_LOCK:
            _RUNNING.add(self)
        self._thread.start()
        return self

    def start_after_first_forward(self, stage: Any) -> None:
        """Start once ``stage`` (a LlamaStage: ``after_next_forward``, ``quiet_for``) has run
        its next forward, moving chunks only while it is quiet. That forward faults the
        file's pages in (thousands of faults), which the copy's moves beside it slowed by
        5-70 ms of its 30 ms on this project's VMs (SmolLM2-135M Q8_0, 2026-12-04)."""
        stage.after_next_forward(lambda: self.start(quiet=stage.quiet_for(QUIET_S),
                                                    settled=stage.quiet_for(SETTLED_S)))

    def _held_any(self) -> bool:
        return any(ref() is not None for ref in self._weights)

    def wait(self, timeout: float | None = None) -> PrivateCopy | None:
        """What the copy did, once it ended (None if not within ``timeout`` seconds)."""
        return self.result if self._done.wait(timeout) else None

    def _turn(self, quiet: Callable[[], bool] | None = None) -> list[QuantWeight] | None:
        """Wait until the model is quiet (``quiet``, default the start's); then the weights,
        held for one chunk's move (None once the model was dropped: its mapping may be gone,
        and no one would read the pages)."""
        quiet = quiet or self._quiet
        while quiet is not None and not quiet() and self._held_any():
            time.sleep(QUIET_POLL_S)
        held = [w for w in (ref() for ref in self._weights) if w is not None]
        return held or None

    def _run(self) -> None:
        began = time.perf_counter()
        _lowest_priority()
        try:
            tried = self._file_pages(began) if self._files is not None else None
            if tried is not None and (tried.file_pages or tried.error):
                self.result = tried
            else:
                self.result = self._private(began, refilled=tried.refilled_bytes if tried else 0)
            error = self.result.error
            (log.warning if error and error != DROPPED else log.info)("%s", self.result.describe(self._describe_kept))
        finally:
            self._done.set()
            with _RUNNING_LOCK:
                _RUNNING.discard(self)

    def _file_pages(self, began: float) -> PrivateCopy:
        """The file's pages on 2 MB pages, as they are or refilled (``file_pages`` True in the
        result; ``error`` where a refill was refused), or a result with ``file_pages`` False
        where the first chunks refilled came back on 4 KB pages (then the copy follows). A
        tmpfs file's pages always serve (:meth:`_gathered`)."""
        assert self._files is not None
        inodes = {span.inode for span in self._files if span is not None}
        # A tmpfs file's pages are the file: nothing to read them again from, and a copy
        # would hold the weights twice. They serve, gathered onto 2 MB pages where they are not.
        paths = sorted({span.path for span in self._files if span is not None})
        in_memory = next((kind for kind in map(memory_file_system, paths) if kind), None)
        worth = [(chunk, span) for chunk, span in zip(self._chunks, self._files, strict=True)
                 if span is not None and huge_page_bytes([(chunk.start, chunk.end)])]
        if not worth and not in_memory:  # no whole 2 MB page under the weights: the copy, as with "private"
            return PrivateCopy(0, 0, 0.0)
        if worth and self._turn(self._settled) is None:
            return PrivateCopy(0, 0, time.perf_counter() - began, self._kept_bytes, DROPPED, file_pages=True)
        before = file_huge_bytes(inodes) if worth else 0  # (a walk of every mapping's page tables)
        if before >= ALREADY_HUGE * huge_page_bytes([(c.start, c.end) for c, _ in worth]):
            return PrivateCopy(0, _anon_huge_bytes(), time.perf_counter() - began, self._kept_bytes,
                               file_huge_bytes=before, file_pages=True, memory_file_system=in_memory)
        if in_memory:
            return self._gathered([chunk for chunk, _ in worth], inodes, in_memory, began)
        refilled, error, opened = 0, None, {}
        try:
            for index, (chunk, span) in enumerate(worth):
                held = self._turn()
                if held is None:
                    error = DROPPED
                    break
                try:
                    refill(chunk.start, chunk.nbytes, _opened(opened, span), span.offset)
                except OSError as exc:
                    error = str(exc)
                    break
                finally:
                    del held
                refilled += chunk.nbytes
                if refilled - chunk.nbytes < PROBE_BYTES <= refilled or index == len(worth) - 1:
                    # The whole mapping, not the gain: chunks on 2 MB pages before their refill
                    # gain nothing, and where any chunk has them the kernel gives them.
                    probed = huge_page_bytes([(c.start, c.end) for c, _ in worth[:index + 1]])
                    if file_huge_bytes(inodes) < PROBE_GAIN * probed:
                        return PrivateCopy(0, 0, 0.0, refilled_bytes=refilled)  # no 2 MB pages: the copy
        finally:
            for fd in opened.values():
                os.close(fd)
        return PrivateCopy(0, _anon_huge_bytes(), time.perf_counter() - began, self._kept_bytes, error,
                           file_huge_bytes=file_huge_bytes(inodes), refilled_bytes=refilled, file_pages=True)

    def _gathered(self, worth: list[PageRange], inodes: set[int], kind: str, began: float) -> PrivateCopy:
        """A tmpfs file's pages under the weights gathered onto 2 MB pages in place
        (huge_page_cache.collapse), a chunk at a time while the model is quiet: the memory the
        file takes stays the same, and a decode step no longer misses the TLB every 4 KB. The
        first chunk the kernel refuses ends it; the pages serve either way."""
        gathered, refused, error = 0, None, None
        for chunk in worth:
            held = self._turn()
            if held is None:
                error = DROPPED
                break
            try:
                collapse(chunk.start, chunk.nbytes)
            except OSError as exc:
                refused = str(exc)
                break
            finally:
                del held
            gathered += huge_page_bytes([(chunk.start, chunk.end)])
        return PrivateCopy(0, _anon_huge_bytes(), time.perf_counter() - began, self._kept_bytes, error,
                           file_huge_bytes=file_huge_bytes(inodes), file_pages=True, memory_file_system=kind,
                           gathered_bytes=gathered, gather_refused=refused)

    def _private(self, began: float, *, refilled: int = 0) -> PrivateCopy:
        """Every chunk made private memory in place (the module docstring)."""
        phase, moved, error, small = HugePagePhase(), 0, None, []
        for chunk in self._chunks:
            held = self._turn()
            if held is None:
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
            madvise(chunk.start, chunk.nbytes, MADV_HUGEPAGE)
        return PrivateCopy(moved, _anon_huge_bytes(), time.perf_counter() - began, self._kept_bytes, error,
                           refilled_bytes=refilled)


def _opened(opened: dict[str, int], span: FileSpan) -> int:
    """A read-only descriptor of ``span``'s file (opened once into ``opened``); OSError where
    the path names another file now than the one mapped."""
    fd = opened.get(span.path)
    if fd is None:
        fd = opened[span.path] = os.open(span.path, os.O_RDONLY)
        if os.fstat(fd).st_ino != span.inode:
            raise OSError(f"{span.path} was replaced since it was mapped")
    return fd


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
                 describe_kept: str = "weights", file_pages_first: bool = False) -> PrivateWeights | None:
    """The copy that makes the pages under the file views of ``weights``' QuantWeights
    private memory in place (see the module docstring), but those whose name ``keep`` says to
    leave (named ``describe_kept`` in the log line), ready to :meth:`~PrivateWeights.start`:
    its ranges are found now, while the views are at hand (it holds none of them: a model
    built from ``weights`` may take them out of the dict). Nothing in ``weights`` changes:
    the same tensors at the same addresses read the same bytes throughout. ``file_pages_first``:
    the file's pages on 2 MB pages of the page cache first, the copy only where they do not
    come so (the module docstring). None where there is nothing to copy (no file views; off
    Linux, after one log line)."""
    maps = shared_file_maps()
    ranges, kept_bytes = private_ranges(weights, keep, maps)
    if not ranges:
        return None
    if not _LINUX:
        log.info("weights: read from the file's pages (a private copy in place needs Linux's mremap)")
        return None
    files = [file_span(c.start, c.nbytes, maps) for c in chunks(ranges)] if file_pages_first else None
    return PrivateWeights(weights, ranges, kept_bytes, describe_kept, files=files)
