"""The DiskTier facade: spills written in the background and read back after a restart,
the size bound, deletes, a full queue that drops instead of blocking, one owner per
directory, private permissions, and bad files met at read time (no torch)."""

from __future__ import annotations

import logging
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bargein.engine.block_keys import ChainBlock
from bargein.engine.kv_disk import tier as tier_module
from bargein.engine.kv_disk.block_file import BlockRecord, encode, file_name
from bargein.engine.kv_disk.lock import DirectoryBusy
from bargein.engine.kv_disk.tier import DiskTier, Loaded
from tests.engine.kv_disk_helpers import FP, chain


def wanted(records: list[BlockRecord]) -> list[ChainBlock]:
    return [ChainBlock(r.key, r.parent, r.tokens) for r in records]


def load(tier: DiskTier, records: list[BlockRecord], ticket: str = "r1", timeout: float = 10.0) -> Loaded:
    tier.load(ticket, wanted(records))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for done in tier.drain_loaded():
            if done.ticket == ticket:
                return done
        time.sleep(0.005)
    raise AssertionError("the load never finished")


@pytest.fixture
def make_tier(tmp_path: Path) -> Iterator:
    tiers: list[DiskTier] = []

    def make(directory: Path = tmp_path / "kv", max_bytes: int = 1 << 30, **kwargs) -> DiskTier:
        tiers.append(DiskTier(directory, FP, max_bytes, **kwargs))
        return tiers[-1]

    yield make
    for t in tiers:
        t.close(timeout=5)


def test_spilled_blocks_survive_a_restart_and_read_back_exactly(make_tier, tmp_path: Path) -> None:
    records = chain(list(range(4 * 6)), payload_size=4096, seed=1)
    tier = make_tier()
    for r in records:
        assert tier.spill(r)
    assert tier.flush(timeout=10)
    assert tier.present([r.key for r in records]) == 6
    tier.close()
    woke = threading.Event()
    again = make_tier(on_loaded=woke.set)  # a restart: the index comes from the directory
    assert again.rebuild.blocks == 6 and again.present([r.key for r in records]) == 6
    done = load(again, records)
    assert woke.is_set() and done.wanted == 6 and list(done.records) == records
    stats = again.stats()
    assert (stats.blocks, stats.hits, stats.misses, stats.skipped_files) == (6, 6, 0, 0)
    assert stats.read_seconds_max >= stats.read_seconds_mean > 0


def test_a_load_stops_at_the_first_missing_block(make_tier) -> None:
    records = chain(list(range(4 * 4)))
    tier = make_tier()
    for r in records[:2] + records[3:]:
        tier.spill(r)
    tier.flush(10)
    assert tier.present([r.key for r in records]) == 2
    done = load(tier, records)
    assert list(done.records) == records[:2]
    assert (tier.stats().hits, tier.stats().misses) == (2, 2)


def test_a_corrupt_file_met_at_read_time_is_skipped_once_and_deleted(make_tier, caplog) -> None:
    records = chain(list(range(4 * 3)), payload_size=512)
    tier = make_tier()
    for r in records:
        tier.spill(r)
    tier.flush(10)
    path = tier.directory / file_name(records[1].key, FP.short)
    path.write_bytes(path.read_bytes()[:100])  # truncated
    with caplog.at_level(logging.WARNING, "bargein.kv_disk"):
        done = load(tier, records)
    assert list(done.records) == records[:1]  # the request recomputes from block 1
    assert len(caplog.records) == 1 and not path.exists()
    assert records[1].key not in tier and tier.stats().skipped_files == 1
    assert list(load(tier, records, "r2").records) == records[:1]  # not read again
    assert len(caplog.records) == 1


def test_the_size_bound_evicts_the_least_recently_used_files(make_tier) -> None:
    records = chain(list(range(4 * 5)), payload_size=1000)
    size = len(encode(records[0], FP.digest))
    tier = make_tier(max_bytes=3 * size)
    for r in records[:3]:
        tier.spill(r)
    tier.flush(10)
    load(tier, records[:1])  # block 0 is used: block 1 is now the oldest
    for r in records[3:]:
        tier.spill(r)
    tier.flush(10)
    kept = {r.key for r in records if r.key in tier}
    assert kept == {records[0].key, records[3].key, records[4].key}
    on_disk = {p.name for p in tier.directory.glob("*.kvb")}
    assert on_disk == {file_name(k, FP.short) for k in kept}
    assert tier.stats().bytes == 3 * size <= tier.stats().max_bytes


def test_the_bound_holds_on_disk_at_every_instant_so_a_kill_cannot_leave_it_exceeded(make_tier, monkeypatch) -> None:
    # A process killed between writing a file and deleting the ones it evicts would leave
    # the directory over its bound: the evicted files must be gone before the new one lands.
    records = chain(list(range(4 * 6)), payload_size=1000)
    size = len(encode(records[0], FP.digest))
    real_write = tier_module.write_file
    seen: list[int] = []

    def checked_write(directory, key, data, short):
        seen.append(sum(p.stat().st_size for p in directory.glob("*.kvb")) + len(data))
        real_write(directory, key, data, short)

    monkeypatch.setattr(tier_module, "write_file", checked_write)
    tier = make_tier(max_bytes=3 * size)
    for r in records:
        tier.spill(r)
    assert tier.flush(10)
    assert seen == [size, 2 * size] + [3 * size] * 4  # never a fourth file, even for an instant
    assert tier.stats().writes == 6 and tier.stats().blocks == 3


def test_delete_removes_blocks_even_when_their_write_is_still_queued(make_tier) -> None:
    records = chain(list(range(4 * 3)))
    tier = make_tier()
    for r in records:
        tier.spill(r)
    tier.delete([records[0].key, records[2].key])  # ordered after the writes
    tier.flush(10)
    assert [r.key in tier for r in records] == [False, True, False]
    assert [p.name for p in tier.directory.glob("*.kvb")] == [file_name(records[1].key, FP.short)]
    assert tier.stats().deleted == 2


def test_a_full_write_queue_drops_and_counts_instead_of_blocking(make_tier, monkeypatch) -> None:
    release = threading.Event()
    real_write = tier_module.write_file

    def slow_write(*args, **kwargs):
        release.wait(10)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(tier_module, "write_file", slow_write)
    records = chain(list(range(4 * 5)))
    tier = make_tier(max_queued_writes=2)
    start = time.perf_counter()
    accepted = [tier.spill(r) for r in records]
    assert time.perf_counter() - start < 0.5  # the step thread never waits on the disk
    assert accepted == [True, True, False, False, False]
    assert tier.spill(records[0])  # already queued: not queued twice
    assert tier.stats().dropped_writes == 3 and tier.stats().queued_writes == 2
    release.set()
    assert tier.flush(10) and tier.stats().writes == 2


def test_close_drops_what_the_time_limit_leaves_and_never_half_a_file(make_tier, monkeypatch) -> None:
    real_write = tier_module.write_file

    def slow_write(*args, **kwargs):
        time.sleep(0.2)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(tier_module, "write_file", slow_write)
    records = chain(list(range(4 * 10)))
    tier = make_tier()
    for r in records:
        tier.spill(r)
    assert not tier.close(timeout=0.3)
    assert not tier.spill(records[0])  # closed
    names = [p.name for p in tier.directory.iterdir() if p.name.endswith(".kvb")]
    assert 1 <= len(names) < 10
    assert not [p for p in tier.directory.iterdir() if p.name.startswith(".tmp-")]
    assert tier.stats().writes + tier.stats().dropped_writes == 10


def test_one_server_owns_a_directory(make_tier, tmp_path: Path, caplog) -> None:
    first = make_tier()
    with pytest.raises(DirectoryBusy, match="in use by another bargein server"):
        DiskTier(tmp_path / "kv", FP, 1 << 20)
    with caplog.at_level(logging.WARNING, "bargein.kv_disk"):
        assert DiskTier.open(tmp_path / "kv", FP, 1 << 20) is None
    assert "running without the disk tier" in caplog.records[0].getMessage()
    first.close()
    second = DiskTier.open(tmp_path / "kv", FP, 1 << 20)  # released: the next owner gets it
    assert second is not None
    second.close()


def test_the_directory_and_files_are_private(make_tier, tmp_path: Path) -> None:
    fresh = make_tier(tmp_path / "new" / "kv")
    assert stat.S_IMODE(fresh.directory.stat().st_mode) == 0o700
    fresh.spill(chain(list(range(4)))[0])
    fresh.flush(10)
    (path,) = fresh.directory.glob("*.kvb")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    lock = fresh.directory / "bargein-kv-disk.lock"
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    make_tier(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o700  # narrowed


def test_a_shutdown_spill_waits_for_room_within_its_time_limit(make_tier, monkeypatch) -> None:
    real_write = tier_module.write_file

    def slow_write(*args, **kwargs):
        time.sleep(0.05)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(tier_module, "write_file", slow_write)
    records = chain(list(range(4 * 6)))
    tier = make_tier(max_queued_writes=1)
    assert all(tier.spill(r, timeout=5.0) for r in records)  # each waits for the one before
    assert tier.flush(10) and tier.stats().writes == 6 and tier.stats().dropped_writes == 0
    blocked = chain(list(range(100, 108)))
    release = threading.Event()
    monkeypatch.setattr(tier_module, "write_file", lambda *a, **k: release.wait(10) and real_write(*a, **k))
    assert tier.spill(blocked[0])
    start = time.perf_counter()
    assert not tier.spill(blocked[1], timeout=0.1)  # no room within the limit: dropped
    assert 0.1 <= time.perf_counter() - start < 2
    release.set()


def test_a_full_disk_drops_blocks_with_one_warning_and_the_tier_goes_on(make_tier, monkeypatch, caplog) -> None:
    real_write = tier_module.write_file
    full = True

    def maybe_full(*args, **kwargs):
        if full:
            raise OSError(28, "No space left on device")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(tier_module, "write_file", maybe_full)
    records = chain(list(range(4 * 4)))
    tier = make_tier()
    with caplog.at_level(logging.WARNING, "bargein.kv_disk"):
        for r in records[:3]:
            tier.spill(r)
        assert tier.flush(10)
    assert len(caplog.records) == 1 and "No space" in caplog.records[0].getMessage()
    assert tier.stats().dropped_writes == 3 and tier.stats().blocks == 0
    full = False
    tier.spill(records[3])
    assert tier.flush(10) and records[3].key in tier


HOLDER = r"""
import sys, time
from bargein.engine.kv_disk.tier import DiskTier
from tests.engine.kv_disk_helpers import FP
tier = DiskTier(sys.argv[1], FP, 1 << 20)
print("owner", flush=True)
time.sleep(60)
"""


def test_another_process_owns_the_directory_until_it_dies_even_by_sigkill(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "kv")], stdout=subprocess.PIPE,
                              env=dict(os.environ, PYTHONPATH=str(repo)), cwd=repo)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"owner"
        with pytest.raises(DirectoryBusy, match=f"pid {holder.pid}"):
            DiskTier(tmp_path / "kv", FP, 1 << 20)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    tier = DiskTier.open(tmp_path / "kv", FP, 1 << 20)  # no stale lock after a crash
    assert tier is not None
    tier.close()
