"""bargein.loader.file_maps: where a mapped tensor's bytes lie in its file."""

from __future__ import annotations

import mmap
import os
import random
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
