"""bargein.loader.file_reads: where a mapped tensor's bytes lie in its file, and the few
preadv calls that copy many such spans into memory (the private copy's reads)."""

from __future__ import annotations

import mmap
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest

import bargein.loader.file_reads as file_reads
from bargein.loader.file_reads import (
    MAX_GAP,
    FileSpan,
    file_span,
    plan_reads,
    run_read,
    shared_file_maps,
)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")


def _file(tmp_path: Path, nbytes: int, seed: int = 0) -> tuple[Path, bytes]:
    data = random.Random(seed).randbytes(nbytes)
    path = tmp_path / f"data{seed}.bin"
    path.write_bytes(data)
    return path, data


def _read_all(pairs: list[tuple[FileSpan, memoryview]], parts: int) -> list[file_reads.Read]:
    reads = plan_reads(pairs, parts, memoryview(bytearray(MAX_GAP)))
    for read in reads:
        run_read(read)
    return reads


@linux_only
def test_a_mapped_views_span_is_its_offset_in_the_file(tmp_path: Path) -> None:
    path, data = _file(tmp_path, 3 * mmap.PAGESIZE + 100)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    address = mapped.ctypes.data + 4097
    span = file_span(address, 1000, shared_file_maps())
    assert span == FileSpan(str(path), 4097, 1000)
    assert file_span(np.zeros(10).ctypes.data, 10, shared_file_maps()) is None  # not a file view
    assert file_span(address, len(data), shared_file_maps()) is None  # runs past the mapping


def test_a_path_that_no_longer_names_the_mapped_file_is_not_read(tmp_path: Path) -> None:
    here, _ = _file(tmp_path, 100, seed=4)
    other, _ = _file(tmp_path, 100, seed=5)
    inode = os.stat(here).st_ino
    maps = [(0x1000, 0x9000, 0, str(tmp_path / "gone.gguf (deleted)"), inode),
            (0x10000, 0x20000, 4096, str(here), inode), (0x30000, 0x40000, 0, str(other), inode)]
    assert file_span(0x2000, 16, maps) is None  # deleted
    assert file_span(0x10010, 16, maps) == FileSpan(str(here), 4096 + 0x10, 16)
    assert file_span(0x30010, 16, maps) is None  # the path names another file now


def test_spans_with_gaps_fill_their_destinations_in_few_reads(tmp_path: Path) -> None:
    path, data = _file(tmp_path, 3 << 20)
    rng = random.Random(1)
    at, spans = 0, []
    while True:  # spans in file order with gaps of 0 .. 300 bytes, some far apart
        at += rng.choice([0, 0, 7, 31, 300, MAX_GAP + 5])
        n = rng.randrange(1, 40_000)
        if at + n > len(data):
            break
        spans.append(FileSpan(str(path), at, n))
        at += n
    rng.shuffle(spans)  # the planner sorts them
    out = [bytearray(s.nbytes) for s in spans]
    reads = _read_all([(s, memoryview(b)) for s, b in zip(spans, out, strict=True)], parts=2)
    assert all(bytes(b) == data[s.offset:s.offset + s.nbytes] for s, b in zip(spans, out, strict=True))
    far = sum(1 for a, b in zip(sorted(spans, key=lambda s: s.offset)[:-1], sorted(spans, key=lambda s: s.offset)[1:],
                                strict=True) if b.offset - (a.offset + a.nbytes) > MAX_GAP)
    assert len(reads) <= far + 1 + 2  # split where spans lie far apart, and into about two shares
    assert reads == sorted(reads, key=lambda r: -r.nbytes)


def test_parts_cut_one_stretch_into_shares_and_limits_split_it(tmp_path: Path, monkeypatch) -> None:
    path, data = _file(tmp_path, 1 << 20, seed=2)
    spans = [FileSpan(str(path), i * 2048, 2048) for i in range(512)]  # back to back

    def plan(parts: int) -> list[file_reads.Read]:
        return plan_reads([(s, memoryview(bytearray(2048))) for s in spans], parts, memoryview(bytearray(MAX_GAP)))

    assert len(plan(1)) == 1 and len(plan(2)) == 2 and len(plan(4)) == 4
    assert {r.nbytes for r in plan(4)} == {256 * 1024}
    monkeypatch.setattr(file_reads, "MAX_BUFFERS", 100)  # a read's buffers: at most 100
    assert all(len(r.buffers) <= 100 for r in plan(1)) and len(plan(1)) == 6
    monkeypatch.setattr(file_reads, "MAX_READ", 64 * 1024)
    assert all(r.nbytes <= 64 * 1024 for r in plan(1)) and len(plan(1)) == 16


def test_a_short_read_continues_and_an_early_end_is_an_error(tmp_path: Path, monkeypatch) -> None:
    path, data = _file(tmp_path, 200_000, seed=3)
    real = os.preadv

    def short(fd: int, buffers: list[memoryview], offset: int) -> int:  # at most 777 bytes a call
        first = buffers[0][:777]
        return real(fd, [first], offset)

    monkeypatch.setattr(os, "preadv", short)
    spans = [FileSpan(str(path), 10, 5000), FileSpan(str(path), 5010, 3), FileSpan(str(path), 5100, 90_000)]
    out = [bytearray(s.nbytes) for s in spans]
    _read_all([(s, memoryview(b)) for s, b in zip(spans, out, strict=True)], parts=1)
    assert all(bytes(b) == data[s.offset:s.offset + s.nbytes] for s, b in zip(spans, out, strict=True))
    monkeypatch.setattr(os, "preadv", real)
    past = FileSpan(str(path), 199_000, 2000)
    with pytest.raises(OSError, match="ends before byte 201000"):
        _read_all([(past, memoryview(bytearray(2000)))], parts=1)


def test_a_destination_of_another_length_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="a destination of 9 bytes for a span of 10"):
        plan_reads([(FileSpan("/x", 0, 10), memoryview(bytearray(9)))], 1, memoryview(bytearray(MAX_GAP)))
