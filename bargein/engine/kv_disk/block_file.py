"""One KV block on disk: the file format, an atomic writer and a checking reader.

A block file holds, in this order::

    header    magic "BGKVBLK\\0", format version (u16), flags (u16: bit 0 = has a parent),
              key (16 bytes), parent key (16 bytes, zeros without a parent),
              model fingerprint digest (16 bytes), token count (u32), payload length (u64)
    checksum  BLAKE2b-256 over header, token ids and payload
    tokens    the block's token ids, int64 little-endian
    payload   the block's K/V bytes (``payload.py`` says how they are laid out)

A file is used only if the magic, version, key, fingerprint and checksum all match and
its tokens chain to its key (``chain_hash(parent, tokens) == key``); the caller then
compares the tokens with the request's. Anything else (a truncated file after a crash
or a full disk, flipped bits, another model's file) is reported with one warning, the
file is deleted, and the caller recomputes: a bad file costs time, never a wrong token.

Writes go to a temporary file in the same directory (mode 0600), are fsynced, then
renamed over the final name, so a reader or a restart sees a whole file or none; a
crash leaves at most a ``.tmp-`` file, which the index removes at start.

This module imports no torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bargein.engine.block_keys import BlockHash, chain_hash

log = logging.getLogger("bargein.kv_disk")

MAGIC = b"BGKVBLK\x00"
FORMAT_VERSION = 1
SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
_HEADER = struct.Struct("<8sHH16s16s16sIQ")
_CHECKSUM_SIZE = 32
_HAS_PARENT = 1
_NO_PARENT = bytes(16)


@dataclass(frozen=True)
class BlockRecord:
    """A full block's identity and contents: its chained key, its parent's key (None for
    a sequence's first block), its token ids and its K/V bytes."""

    key: BlockHash
    parent: BlockHash | None
    tokens: tuple[int, ...]
    payload: bytes


class BadBlockFile(ValueError):
    """A block file that must not be used; the message says why in a few words."""


@dataclass(frozen=True)
class Skipped:
    """``read_block``'s answer for a bad file, which it deleted: why it was bad."""

    reason: str


def file_name(key: BlockHash, fingerprint_short: str) -> str:
    """``<key hex>.<fingerprint short>.kvb``: the index reads keys from names alone."""
    return f"{key.hex()}.{fingerprint_short}{SUFFIX}"


def parse_name(name: str) -> tuple[BlockHash, str] | None:
    """(key, fingerprint short) from a block file's name; None for any other name."""
    if not name.endswith(SUFFIX):
        return None
    parts = name[:-len(SUFFIX)].split(".")
    if len(parts) != 2 or len(parts[0]) != 32:
        return None
    try:
        return bytes.fromhex(parts[0]), parts[1]
    except ValueError:
        return None


def file_size(num_tokens: int, payload_bytes: int) -> int:
    """Bytes of the file of a block of ``num_tokens`` tokens and ``payload_bytes`` of K/V."""
    return _HEADER.size + _CHECKSUM_SIZE + 8 * num_tokens + payload_bytes


def encode(record: BlockRecord, fingerprint: bytes) -> bytes:
    """The bytes of a block file."""
    flags = _HAS_PARENT if record.parent is not None else 0
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, flags, record.key, record.parent or _NO_PARENT, fingerprint,
                          len(record.tokens), len(record.payload))
    tokens = array("q", record.tokens).tobytes()
    return header + _checksum(header, tokens, record.payload) + tokens + record.payload


def decode(data: bytes, *, key: BlockHash, fingerprint: bytes) -> BlockRecord:
    """The record in ``data``; raises BadBlockFile unless every check passes."""
    if len(data) < _HEADER.size + _CHECKSUM_SIZE:
        raise BadBlockFile("truncated header")
    magic, version, flags, file_key, parent, file_fp, num_tokens, payload_len = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BadBlockFile("not a block file")
    if version != FORMAT_VERSION:
        raise BadBlockFile(f"format version {version}, this build reads {FORMAT_VERSION}")
    if file_fp != fingerprint:
        raise BadBlockFile("written for another model, precision, layout or numerics version")
    if file_key != key:
        raise BadBlockFile("holds another block's key")
    start = _HEADER.size + _CHECKSUM_SIZE
    end = start + 8 * num_tokens + payload_len
    if len(data) != end:
        raise BadBlockFile(f"{len(data)} bytes where the header says {end}")
    header, checksum = data[:_HEADER.size], data[_HEADER.size:start]
    tokens_bytes, payload = data[start:start + 8 * num_tokens], data[start + 8 * num_tokens:]
    if _checksum(header, tokens_bytes, payload) != checksum:
        raise BadBlockFile("checksum mismatch")
    tokens = tuple(array("q", tokens_bytes))
    parent_key = parent if flags & _HAS_PARENT else None
    if chain_hash(parent_key, tokens) != key:
        raise BadBlockFile("tokens do not chain to the key")
    return BlockRecord(key, parent_key, tokens, payload)


def header_fingerprint(data: bytes) -> bytes | None:
    """The fingerprint digest a block file's header names (None if it has no whole
    header): for tools that check a directory without knowing the model."""
    if len(data) < _HEADER.size:
        return None
    return _HEADER.unpack_from(data)[5]


def _checksum(header: bytes, tokens: bytes, payload: bytes) -> bytes:
    h = hashlib.blake2b(header, digest_size=_CHECKSUM_SIZE)
    h.update(tokens)
    h.update(payload)
    return h.digest()


def write_block(directory: Path, record: BlockRecord, fingerprint: bytes, fingerprint_short: str) -> int:
    """Encodes ``record`` and writes it as its file (:func:`write_file`); returns its size."""
    data = encode(record, fingerprint)
    write_file(directory, record.key, data, fingerprint_short)
    return len(data)


def write_file(directory: Path, key: BlockHash, data: bytes, fingerprint_short: str) -> None:
    """Writes the encoded block ``data`` atomically as ``key``'s file in ``directory`` (mode 0600).

    The data is fsynced before the rename, so after a crash the final name holds the
    whole file or does not exist. The directory entry's own durability is the caller's
    (one directory fsync per flush, not per block).
    """
    final = directory / file_name(key, fingerprint_short)
    tmp = directory / f"{TMP_PREFIX}{final.name}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        remove_file(tmp)
        raise
    os.close(fd)
    os.replace(tmp, final)


def read_block(directory: Path, key: BlockHash, fingerprint: bytes, fingerprint_short: str,
               tokens: Sequence[int] | None = None) -> BlockRecord | Skipped | None:
    """The block keyed ``key`` if its file is whole, this model's and (given ``tokens``)
    holds exactly those tokens; None if there is no such file (or it cannot be read);
    :class:`Skipped` for a bad file.

    A bad file is logged once and deleted, so it is neither read again nor counted
    against the tier's size. Raises BadBlockFile never.
    """
    path = directory / file_name(key, fingerprint_short)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("kv disk: cannot read %s (%s); it is skipped", path.name, exc)
        return None
    try:
        record = decode(data, key=key, fingerprint=fingerprint)
        if tokens is not None and tuple(tokens) != record.tokens:
            raise BadBlockFile("holds other tokens than the request's")
    except BadBlockFile as exc:
        log.warning("kv disk: skipping and deleting %s: %s", path.name, exc)
        remove_file(path)
        return Skipped(str(exc))
    return record


def remove_file(path: str | os.PathLike[str]) -> None:
    """Deletes a file that may already be gone (another thread's eviction, a crash)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
