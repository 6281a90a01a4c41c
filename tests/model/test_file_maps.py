"""bargein.loader.file_maps: where a mapped tensor's bytes lie in its file."""

from __future__ import annotations

import json
import mmap
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bargein.loader.file_maps import FileSpan, file_span, shared_file_maps

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")


def _file(tmp_path: Path, nbytes: int, seed: int = 0) -> tuple[Path, bytes]:
    data = random.Random(seed).randbytes(nbytes)
    path = tmp_path / f"data{seed}.bin"
    path.write_bytes(data)
    return path, data


@linux_only
def test_a_mapped_views_span_is_its_offset_in_the_file(tmp_path: Path) -> None:
    path, data = _file(tmp_path, 3 * mmap.PAGESIZE + 100)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    address = mapped.ctypes.data + 4097
    span = file_span(address, 1000, shared_file_maps())
    assert span == FileSpan(str(path), 4097, 1000, path.stat().st_ino)
    assert file_span(np.zeros(10).ctypes.data, 10, shared_file_maps()) is None  # not a file view
    assert file_span(address, len(data), shared_file_maps()) is None  # runs past the mapping


def test_a_path_that_no_longer_names_the_mapped_file_is_not_read(tmp_path: Path) -> None:
    here, _ = _file(tmp_path, 100, seed=4)
    other, _ = _file(tmp_path, 100, seed=5)
    inode = os.stat(here).st_ino
    maps = [(0x1000, 0x9000, 0, str(tmp_path / "gone.gguf (deleted)"), inode),
            (0x10000, 0x20000, 4096, str(here), inode), (0x30000, 0x40000, 0, str(other), inode)]
    assert file_span(0x2000, 16, maps) is None  # deleted
    assert file_span(0x10010, 16, maps) == FileSpan(str(here), 4096 + 0x10, 16, inode)
    assert file_span(0x30010, 16, maps) is None  # the path names another file now


@linux_only
def test_a_whole_file_is_mapped_at_a_2mb_boundary_read_only_until_its_last_view_goes(tmp_path: Path) -> None:
    """map_whole_file: the file's bytes at a 2 MB boundary (so its 2 MB pages can be mapped
    whole, on any file system), one shared view of the file, read-only, unmapped with the
    last view of it and not before."""
    import gc

    from bargein.loader.file_maps import HUGE_PAGE, map_whole_file

    path, data = _file(tmp_path, 3 * HUGE_PAGE + 12345, seed=3)
    mapped = map_whole_file(path)
    base = mapped.ctypes.data
    assert base % HUGE_PAGE == 0 and mapped.tobytes() == data
    assert not mapped.flags.writeable and not mapped[100:200].flags.writeable
    assert file_span(base + HUGE_PAGE + 7, 10, shared_file_maps()) == FileSpan(str(path), HUGE_PAGE + 7, 10,
                                                                                os.stat(path).st_ino)
    view = mapped[HUGE_PAGE:HUGE_PAGE + 64]
    del mapped
    gc.collect()
    assert view.tobytes() == data[HUGE_PAGE:HUGE_PAGE + 64]  # the view holds the mapping
    del view
    gc.collect()
    assert not [m for m in shared_file_maps() if m[3] == str(path)]  # gone with it


RESERVED_LEFT = """
import gc, json, sys
from bargein.loader.file_maps import map_whole_file
def reserved():  # inaccessible mappings of no file: the placement's reservation would be one
    return sorted(line.split()[0] for line in open("/proc/self/maps") if line.split()[1:2] == ["---p"]
                  and len(line.split()) == 5)
before = reserved()
mapped = map_whole_file(sys.argv[1])
during = reserved()
del mapped
gc.collect()
print(json.dumps([before, during, reserved()]))
"""


@linux_only
def test_nothing_of_the_range_reserved_to_place_a_mapping_is_left(tmp_path: Path) -> None:
    """map_whole_file reserves 2 MB more than the file and gives back what the file does not
    cover, at once, and the file's own part with its last view (in a process of its own: a
    thread's stack guard, also inaccessible, could land where a mapping was)."""
    path, _ = _file(tmp_path, 3 * (2 << 20) + 12345, seed=6)
    done = subprocess.run([sys.executable, "-c", RESERVED_LEFT, str(path)], capture_output=True, text=True,
                          timeout=60, check=True)
    before, during, after = json.loads(done.stdout.splitlines()[-1])
    assert before == during == after


EXIT_WHILE_READ = """
import sys, threading, time
from bargein.loader.file_maps import map_whole_file
mapped = map_whole_file(sys.argv[1])
def read():
    while True:
        int(mapped[::4096].sum())
threading.Thread(target=read, daemon=True).start()
time.sleep(0.2)
"""


@linux_only
def test_a_process_ends_cleanly_while_a_daemon_thread_reads_its_mapped_file(tmp_path: Path) -> None:
    """The mapping is not unmapped at the interpreter's exit, under a daemon thread still
    reading it (an engine's, a weights thread's): the process ends with it instead."""
    path, _ = _file(tmp_path, 8 << 20, seed=5)
    done = subprocess.run([sys.executable, "-c", EXIT_WHILE_READ, str(path)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
