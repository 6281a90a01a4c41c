"""The block file format: exact round trip, every bad file skipped with one warning and
deleted, private permissions, and atomic writes under SIGKILL (no torch)."""

from __future__ import annotations

import logging
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bargein.engine.kv_disk import block_file
from bargein.engine.kv_disk.block_file import (
    BadBlockFile,
    BlockRecord,
    Skipped,
    decode,
    encode,
    file_name,
    parse_name,
    read_block,
    write_block,
)
from bargein.engine.kv_disk.fingerprint import ModelFingerprint, file_identity
from tests.engine.kv_disk_helpers import FP, OTHER_FP, chain

REPO = Path(__file__).resolve().parents[2]


def written(tmp_path: Path, record: BlockRecord, fp: ModelFingerprint = FP) -> Path:
    write_block(tmp_path, record, fp.digest, fp.short)
    return tmp_path / file_name(record.key, fp.short)


def test_round_trip_is_exact(tmp_path: Path) -> None:
    first, second = chain(list(range(8)), payload_size=1000, seed=1)
    for record in (first, second):  # with and without a parent
        path = written(tmp_path, record)
        assert parse_name(path.name) == (record.key, FP.short)
        assert read_block(tmp_path, record.key, FP.digest, FP.short, record.tokens) == record
        assert decode(encode(record, FP.digest), key=record.key, fingerprint=FP.digest) == record


def test_a_missing_file_is_a_plain_miss(tmp_path: Path, caplog) -> None:
    (record,) = chain(list(range(4)))
    with caplog.at_level(logging.WARNING, "bargein.kv_disk"):
        assert read_block(tmp_path, record.key, FP.digest, FP.short) is None
    assert not caplog.records


def corrupt_truncated(data: bytes) -> bytes:
    return data[:len(data) - 7]


def corrupt_flipped(data: bytes) -> bytes:
    i = len(data) - 3  # in the payload
    return data[:i] + bytes([data[i] ^ 1]) + data[i + 1:]


def corrupt_token(data: bytes) -> bytes:
    i = block_file._HEADER.size + 32  # the first token id
    return data[:i] + bytes([data[i] ^ 1]) + data[i + 1:]


def corrupt_magic(data: bytes) -> bytes:
    return b"NOTABLOK" + data[8:]


def corrupt_version(data: bytes) -> bytes:
    return data[:8] + (99).to_bytes(2, "little") + data[10:]


def corrupt_empty(data: bytes) -> bytes:
    return b""


@pytest.mark.parametrize("damage", [corrupt_truncated, corrupt_flipped, corrupt_token, corrupt_magic,
                                    corrupt_version, corrupt_empty])
def test_a_bad_file_is_skipped_with_one_warning_and_deleted(tmp_path: Path, caplog, damage) -> None:
    (record,) = chain(list(range(4)), payload_size=200)
    path = written(tmp_path, record)
    path.write_bytes(damage(path.read_bytes()))
    with caplog.at_level(logging.WARNING, "bargein.kv_disk"):
        found = read_block(tmp_path, record.key, FP.digest, FP.short, record.tokens)
    assert isinstance(found, Skipped)
    assert len(caplog.records) == 1 and path.name in caplog.records[0].getMessage()
    assert not path.exists()


def test_another_models_file_is_skipped_and_deleted(tmp_path: Path, caplog) -> None:
    (record,) = chain(list(range(4)))
    other = written(tmp_path, record, OTHER_FP)
    # Renamed to this model's name (the name is only a hint): the header still says no.
    path = tmp_path / file_name(record.key, FP.short)
    other.rename(path)
    with caplog.at_level(logging.WARNING, "bargein.kv_disk"):
        found = read_block(tmp_path, record.key, FP.digest, FP.short)
    assert isinstance(found, Skipped) and "another model" in found.reason
    assert len(caplog.records) == 1 and not path.exists()


def test_a_file_under_another_key_or_with_other_tokens_is_refused(tmp_path: Path) -> None:
    a, b = chain(list(range(8)))
    path = written(tmp_path, a)
    path.rename(tmp_path / file_name(b.key, FP.short))  # a's file under b's name
    assert isinstance(read_block(tmp_path, b.key, FP.digest, FP.short), Skipped)
    written(tmp_path, a)
    assert isinstance(read_block(tmp_path, a.key, FP.digest, FP.short, (9, 9, 9, 9)), Skipped)


def test_tokens_must_chain_to_the_key() -> None:
    (record,) = chain(list(range(4)))
    forged = BlockRecord(record.key, None, (7, 7, 7, 7), record.payload)  # checksum is fine, chain is not
    with pytest.raises(BadBlockFile, match="chain"):
        decode(encode(forged, FP.digest), key=record.key, fingerprint=FP.digest)


def test_files_are_private(tmp_path: Path) -> None:
    (record,) = chain(list(range(4)))
    path = written(tmp_path, record)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_fingerprint_changes_with_every_ingredient(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(os.urandom(300_000))
    base = dict(precision="fast", kv_dtype="float16", block_size=16, layer_range=(0, 30))
    fp = ModelFingerprint.of_model(model, **base)
    assert fp.digest == ModelFingerprint.of_model(model, **base).digest
    os.utime(model, (1, 1))  # touched or copied: same content, same fingerprint
    assert ModelFingerprint.of_model(model, **base).digest == fp.digest
    variants = [dict(base, precision="exact"), dict(base, kv_dtype="float32"), dict(base, block_size=32),
                dict(base, layer_range=(0, 15)), dict(base, kernels="abc")]
    digests = {ModelFingerprint.of_model(model, **v).digest for v in variants}
    digests.add(ModelFingerprint(fp.files, "fast", "float16", 16, (0, 30), numerics_version=fp.numerics_version + 1).digest)
    data = bytearray(model.read_bytes())
    data[-1] ^= 1  # another model of the same size
    model.write_bytes(bytes(data))
    digests.add(ModelFingerprint.of_model(model, **base).digest)
    assert fp.digest not in digests and len(digests) == len(variants) + 2
    assert file_identity(model)[1] == 300_000


WRITER = r"""
import os, sys
from pathlib import Path
from bargein.engine.kv_disk.block_file import write_block
from tests.engine.kv_disk_helpers import FP, chain
directory, start = Path(sys.argv[1]), int(sys.argv[2])
print("ready", flush=True)
i = start
while True:
    for record in chain([i, i + 1, i + 2, i + 3], payload_size=256 * 1024, seed=1):
        write_block(directory, record, FP.digest, FP.short)
    i += 4
"""


def test_sigkill_mid_write_never_leaves_a_partial_block(tmp_path: Path) -> None:
    """A writer killed with SIGKILL at random moments, 20 times: every block file left
    reads back whole; only temporary files can be partial, and the index removes them."""
    rng = random.Random(27)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for attempt in range(20):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(attempt * 1_000_000)],
                                stdout=subprocess.PIPE, env=env, cwd=REPO)
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.0, 0.15))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    names = os.listdir(tmp_path)
    blocks = [n for n in names if parse_name(n) is not None]
    assert blocks, "the writer never finished a block: kill later"
    for name in blocks:
        key, short = parse_name(name)
        found = read_block(tmp_path, key, FP.digest, short)
        assert isinstance(found, BlockRecord), f"{name}: {found}"
    leftovers = [n for n in names if n.startswith(block_file.TMP_PREFIX)]
    from bargein.engine.kv_disk.index import DiskIndex
    index, report = DiskIndex.rebuild(tmp_path, FP.short, 1 << 40)
    assert report.removed_partial == len(leftovers) and index.num_blocks == len(blocks)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(block_file.TMP_PREFIX)]
    print(f"\n{len(blocks)} whole blocks, {len(leftovers)} interrupted writes removed")


def test_a_failed_write_leaves_neither_a_block_nor_a_temporary_file(tmp_path: Path, monkeypatch) -> None:
    (record,) = chain(list(range(4)))

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(block_file.os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space"):
        write_block(tmp_path, record, FP.digest, FP.short)
    assert os.listdir(tmp_path) == []
