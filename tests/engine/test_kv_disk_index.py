"""The disk tier's index: rebuilt from names and stats alone, LRU order from file times,
a byte bound that evicts the least recently used, and what a start cleans up (no torch)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from bargein.engine.kv_disk.block_file import TMP_PREFIX, encode, file_name, write_block
from bargein.engine.kv_disk.index import DiskIndex
from tests.engine.kv_disk_helpers import FP, OTHER_FP, chain


def test_rebuild_of_10000_blocks_takes_well_under_a_second(tmp_path: Path) -> None:
    records = chain(list(range(4 * 10_000)), payload_size=32)
    for record in records:  # no fsync: the index never opens a file
        (tmp_path / file_name(record.key, FP.short)).write_bytes(encode(record, FP.digest))
    start = time.perf_counter()
    index, report = DiskIndex.rebuild(tmp_path, FP.short, 1 << 40)
    elapsed = time.perf_counter() - start
    print(f"\nindex rebuild: {report.blocks} blocks in {elapsed * 1000:.0f} ms")
    assert index.num_blocks == 10_000 and report.blocks == 10_000
    assert index.num_bytes == sum(len(encode(r, FP.digest)) for r in records[:1]) * 10_000
    # Wide bound (the target is 1 s): this machine's 2 cores are shared with other jobs.
    assert elapsed < 2.0


def test_lru_bound_evicts_least_recently_used_first() -> None:
    index = DiskIndex(max_bytes=300)
    keys = [bytes([i]) * 16 for i in range(4)]
    assert index.add(keys[0], 100) == (True, [])
    assert index.add(keys[1], 100) == (True, [])
    assert index.add(keys[2], 100) == (True, [])
    index.touch(keys[0])  # a hit: keys[1] is now the oldest
    assert index.add(keys[3], 100) == (True, [keys[1]])
    assert index.num_bytes == 300 and index.leading_present([keys[0], keys[2], keys[1]]) == 2
    assert index.add(bytes(16), 301) == (False, [])  # larger than the whole bound: not kept
    assert index.remove(keys[0]) and not index.remove(keys[0]) and index.num_bytes == 200


def test_rebuild_keeps_lru_order_and_applies_a_smaller_bound(tmp_path: Path) -> None:
    records = chain(list(range(4 * 5)), payload_size=100)
    size = len(encode(records[0], FP.digest))
    for age, record in enumerate(records):
        write_block(tmp_path, record, FP.digest, FP.short)
        os.utime(tmp_path / file_name(record.key, FP.short), ns=(10**18 + age, 10**18 + age))
    # The oldest-written block was read last (touched): it survives the smaller bound.
    os.utime(tmp_path / file_name(records[0].key, FP.short), ns=(2 * 10**18, 2 * 10**18))
    index, report = DiskIndex.rebuild(tmp_path, FP.short, 3 * size)
    kept = [r.key for r in records if r.key in index]
    assert kept == [records[0].key, records[3].key, records[4].key] and report.evicted == 2
    on_disk = {p.name for p in tmp_path.iterdir()}
    assert on_disk == {file_name(k, FP.short) for k in kept}


def test_rebuild_removes_interrupted_writes_and_other_fingerprints_once(tmp_path: Path, caplog) -> None:
    mine, theirs = chain(list(range(8)))
    write_block(tmp_path, mine, FP.digest, FP.short)
    write_block(tmp_path, theirs, OTHER_FP.digest, OTHER_FP.short)
    (tmp_path / f"{TMP_PREFIX}{file_name(theirs.key, FP.short)}.123").write_bytes(b"half")
    (tmp_path / "README.txt").write_text("not ours: left alone")
    with caplog.at_level("WARNING", "bargein.kv_disk"):
        index, report = DiskIndex.rebuild(tmp_path, FP.short, 1 << 30)
    assert (report.blocks, report.removed_partial, report.removed_foreign) == (1, 1, 1)
    assert len(caplog.records) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["README.txt", file_name(mine.key, FP.short)])
