"""A file mapping's pages read again onto 2 MB page-cache pages in place
(bargein.loader.huge_page_cache): the addresses read the file's bytes before, during and
after, the range stays a view of the file, and on a kernel whose page cache holds the file
in 2 MB folios the range is then mapped on 2 MB pages, also for pages just written (dirty)."""

from __future__ import annotations

import mmap
import os
import random
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bargein.loader.file_maps import MADV_HUGEPAGE, MADV_POPULATE_READ, madvise, shared_file_maps
from bargein.loader.huge_page_cache import HUGE_PAGE, file_huge_bytes, huge_page_bytes, refill

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mremap and smaps are Linux's")


def _mapped(path: Path) -> tuple[np.ndarray, int]:
    with open(path, "rb") as f:
        return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8), os.fstat(f.fileno()).st_ino


def gives_file_huge_pages(tmp_path: Path) -> bool:
    """Whether this kernel and filesystem map a file read from disk on 2 MB page-cache pages
    (large folios; ext4 since Linux 6.16): 8 MB written, synced, dropped, read through a
    mapping advised huge."""
    path = tmp_path / "probe.bin"
    path.write_bytes(random.Random(1).randbytes(8 * HUGE_PAGE // 2))
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    mapped, inode = _mapped(path)
    if mapped.ctypes.data % HUGE_PAGE:
        return False
    madvise(mapped.ctypes.data, mapped.nbytes, MADV_HUGEPAGE)
    madvise(mapped.ctypes.data, mapped.nbytes, MADV_POPULATE_READ)
    return file_huge_bytes({inode}) > 0


def test_whole_huge_pages_are_counted_inside_each_span() -> None:
    h = HUGE_PAGE
    assert huge_page_bytes([(0, 4 * h), (5 * h + 1, 8 * h - 1), (9 * h, 9 * h + 10)]) == 4 * h + 1 * h
    assert huge_page_bytes([(h - 4096, 2 * h + 4096)]) == h
    assert huge_page_bytes([]) == 0


@linux_only
def test_a_refill_reads_the_files_bytes_throughout_and_maps_2mb_pages(tmp_path: Path) -> None:
    """24 MB just written 64 KB at a time, as a copy or a download writes (its pages dirty,
    on the small pages of the writes; one large write can give 2 MB ones): a thread reads
    the range over and over while 20 MB of it are refilled in two pieces; every read equals
    the file, the range is still a view of the file, and where the kernel gives 2 MB
    page-cache pages it is mapped on them."""
    huge = gives_file_huge_pages(tmp_path)
    data = np.frombuffer(random.Random(2).randbytes(12 * HUGE_PAGE), dtype=np.uint8)
    path = tmp_path / "weights.bin"
    with open(path, "wb") as f:
        for at in range(0, data.nbytes, 1 << 16):
            f.write(data[at:at + (1 << 16)].tobytes())
    mapped, inode = _mapped(path)
    base = mapped.ctypes.data
    madvise(base, mapped.nbytes, MADV_POPULATE_READ)
    before = file_huge_bytes({inode})
    fd = os.open(path, os.O_RDONLY)
    try:
        for start, end in _read_throughout(mapped, data):  # huge pages 1-10 of 12, in two pieces
            refill(base + start * HUGE_PAGE, (end - start) * HUGE_PAGE, fd, start * HUGE_PAGE)
    finally:
        os.close(fd)
    assert np.array_equal(mapped, data) and mapped.ctypes.data == base
    assert any(lo <= base + HUGE_PAGE and base + 11 * HUGE_PAGE <= hi and ino == inode
               for lo, hi, _, _, ino in shared_file_maps())  # one view of the file, as before
    if huge:
        assert before < 10 * HUGE_PAGE <= file_huge_bytes({inode}), (before, file_huge_bytes({inode}))


def _read_throughout(mapped: np.ndarray, data: np.ndarray) -> Iterator[tuple[int, int]]:
    """Yields the pieces (huge pages 1-5, then 6-10) to move while a thread reads ``mapped``
    over and over; once they are moved, checks that every read equalled ``data``."""
    wrong, reads, stop = [], [0], threading.Event()

    def read() -> None:
        while not stop.is_set():
            if not np.array_equal(mapped, data):
                wrong.append(reads[0])
            reads[0] += 1

    reader = threading.Thread(target=read)
    reader.start()
    try:
        yield from ((1, 6), (6, 11))
    finally:
        stop.set()
        reader.join(60)
    assert not wrong and reads[0] > 0


MOUNTINFO = """\
22 1 252:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
36 22 0:32 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw,size=24683784k
37 22 0:33 / /mnt/ram rw,relatime shared:4 - ramfs ramfs rw
38 22 0:34 / /mnt/odd\\040name rw,relatime shared:5 master:2 - tmpfs none rw
"""


def test_a_devices_mount_type_is_read_from_mountinfo() -> None:
    from bargein.loader.huge_page_cache import mount_type

    assert mount_type(os.makedev(252, 0), MOUNTINFO) == "ext4"
    assert mount_type(os.makedev(0, 32), MOUNTINFO) == "tmpfs"
    assert mount_type(os.makedev(0, 33), MOUNTINFO) == "ramfs"
    assert mount_type(os.makedev(0, 34), MOUNTINFO) == "tmpfs"  # optional fields before " - "
    assert mount_type(os.makedev(0, 99), MOUNTINFO) is None


def tmpfs_at_dev_shm() -> bool:
    """Whether /proc/mounts shows a tmpfs mounted at /dev/shm (read apart from mountinfo)."""
    return any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in Path("/proc/mounts").read_text().splitlines())


def test_a_file_in_dev_shm_is_on_a_memory_file_system(tmp_path: Path) -> None:
    from bargein.loader.huge_page_cache import memory_file_system

    assert memory_file_system(str(tmp_path / "no-such-file")) is None
    if not tmpfs_at_dev_shm():
        pytest.skip("no tmpfs at /dev/shm here")
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as shared:
        assert memory_file_system(shared.name) == "tmpfs"


def gathers_tmpfs_pages(directory: Path) -> str | None:
    """None where this kernel gathers a tmpfs file's pages onto 2 MB pages in place
    (MADV_COLLAPSE: Linux 6.1 and later, shmem_enabled not ``deny``), else its refusal:
    4 MB in ``directory``, mapped by map_whole_file, collapsed."""
    from bargein.loader.file_maps import map_whole_file
    from bargein.loader.huge_page_cache import collapse

    with tempfile.NamedTemporaryFile(dir=directory) as probe:
        probe.write(bytes(2 * HUGE_PAGE))
        probe.flush()
        mapped = map_whole_file(probe.name)
        try:
            collapse(mapped.ctypes.data, mapped.nbytes)
        except OSError as exc:
            return str(exc)
        return None


@linux_only
def test_a_tmpfs_files_pages_are_gathered_onto_2mb_pages_in_place(tmp_path: Path) -> None:
    """12 MB in /dev/shm on 4 KB pages: a thread reads the mapping over and over while 10 MB
    of it are gathered in two pieces; every read equals the file, the range is still the same
    view of the file, now mapped on 2 MB pages, and the file takes no more memory."""
    from bargein.loader.file_maps import map_whole_file
    from bargein.loader.huge_page_cache import collapse

    if not tmpfs_at_dev_shm():
        pytest.skip("no tmpfs at /dev/shm here")
    refused = gathers_tmpfs_pages(Path("/dev/shm"))
    if refused:
        pytest.skip(f"this kernel does not gather tmpfs pages onto 2 MB pages: {refused}")
    data = np.frombuffer(random.Random(4).randbytes(12 * HUGE_PAGE), dtype=np.uint8)
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as shared:
        shared.write(data.tobytes())
        shared.flush()
        inode = os.fstat(shared.fileno()).st_ino
        blocks = os.fstat(shared.fileno()).st_blocks
        mapped = map_whole_file(shared.name)
        base = mapped.ctypes.data
        madvise(base, mapped.nbytes, MADV_POPULATE_READ)
        before = file_huge_bytes({inode})
        for start, end in _read_throughout(mapped, data):
            collapse(base + start * HUGE_PAGE, (end - start) * HUGE_PAGE)
        assert np.array_equal(mapped, data) and mapped.ctypes.data == base
        assert any(lo == base and ino == inode for lo, _, _, _, ino in shared_file_maps())
        assert before < 10 * HUGE_PAGE <= file_huge_bytes({inode}), (before, file_huge_bytes({inode}))
        assert os.fstat(shared.fileno()).st_blocks == blocks
