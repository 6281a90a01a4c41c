"""The GGUF container, parsed lean: header, metadata and tensor table; no tensor data.

gguf.GGUFReader keeps every metadata array item as a numpy view of a memory map; for a
49k-token vocabulary and its merges that is a quarter of a million small arrays (about
75 MB and most of a second, measured on SmolLM2-135M). Here metadata values become plain
Python values, numeric arrays one numpy array each, and string arrays a
:class:`StringArray`: the array's bytes as stored and where each item lies in them (a
loop that only reads lengths), decoded when asked for, the whole array in one call where
it can be (start-up parses a 49k vocabulary and 49k merges). The header is read once,
front to back, through a memory map closed at the end; the tensor data is left to
:meth:`TensorInfo.read` (``os.pread``, one tensor at a time).

Every count and length is checked against the bytes left before anything is allocated
from it, so a corrupt header is a :class:`CorruptModelError`, never a huge allocation.
Little-endian files of GGUF versions 2 and 3 are read (what llama.cpp writes).
"""

from __future__ import annotations

import array
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bargein.kernels.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType
from bargein.loader.errors import CorruptModelError, UnsupportedModelError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types -> struct format of one item (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings as the file stores it: ``data`` is the array's bytes
    (each item's 8-byte length, then its bytes), item i is ``data[starts[i]:ends[i]]``.
    Decoded by whoever reads it (:meth:`decoded`, :meth:`joined_text`)."""

    data: bytes
    starts: np.ndarray  # int64
    ends: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def items(self) -> list[bytes]:
        data = self.data
        return [data[s:e] for s, e in zip(self.starts.tolist(), self.ends.tolist(), strict=True)]

    def joined_bytes(self) -> bytes | None:
        """The items' bytes, each after a NUL (``b"\\0" + b"\\0".join(items)``), in one
        gather: the last byte of each item's length (always 0) is kept as the separator.
        None where the NULs would not stand for the items' bounds: an item holds a NUL."""
        region = np.frombuffer(self.data, dtype=np.uint8)
        edges = np.zeros(len(region) + 1, dtype=np.int8)
        edges[self.starts - 1] = 1  # starts and ends never meet: 8 length bytes lie between
        edges[self.ends] = -1
        joined = region[np.cumsum(edges[:-1], dtype=np.int8).view(np.bool_)].tobytes()
        return joined if joined.count(0) == len(self.starts) else None  # more NULs: an item's

    def joined_text(self, joined: bytes | None = None) -> str | None:
        """The items decoded from UTF-8 and joined by NULs, in one decode of
        :meth:`joined_bytes` (``joined``: those bytes, where the caller has them already).
        None where that cannot stand for the items: an item holds a NUL or is not valid
        UTF-8."""
        joined = self.joined_bytes() if joined is None else joined
        if joined is None:
            return None
        try:
            return joined[1:].decode("utf-8")
        except UnicodeDecodeError:
            return None

    def decoded(self, errors: str = "strict") -> list[str]:
        """Each item decoded from UTF-8 (``errors`` as for ``bytes.decode``): what decoding
        item by item gives, usually split from :meth:`joined_text`."""
        if len(self.starts) == 0:
            return []
        text = self.joined_text()
        if text is not None:
            return text.split("\0")
        # item by item, where ``errors`` applies to each alone
        return [item.decode("utf-8", errors=errors) for item in self.items]


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table. ``shape`` lists dims as GGUF does, innermost first."""

    path: Path
    name: str
    shape: np.ndarray
    tensor_type: int
    data_offset: int  # absolute, in the file
    n_bytes: int
    present: int  # bytes of it the file holds (n_bytes unless truncated)

    @property
    def torch_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.shape.tolist()))

    def read(self) -> np.ndarray:
        """The tensor's bytes, read (not mapped) into a new uint8 array."""
        if self.present != self.n_bytes:
            raise CorruptModelError(f"{self.path}: tensor {self.name!r} is truncated ({self.present} of "
                                    f"{self.n_bytes} bytes present)")
        out = np.empty(self.n_bytes, dtype=np.uint8)
        view, done = memoryview(out), 0
        fd = os.open(self.path, os.O_RDONLY)
        try:
            while done < self.n_bytes:
                got = os.preadv(fd, [view[done:]], self.data_offset + done)
                if got <= 0:
                    raise CorruptModelError(f"{self.path}: tensor {self.name!r} is truncated")
                done += got
        finally:
            os.close(fd)
        return out

    @property
    def data(self) -> np.ndarray:
        """The stored elements as numpy gives them for the type (float32/float16 for F32/F16,
        bytes for block types), read from the file now."""
        raw = self.read()
        if self.tensor_type == GGMLQuantizationType.F32:
            return raw.view(np.float32)
        if self.tensor_type == GGMLQuantizationType.F16:
            return raw.view(np.float16)
        return raw


@dataclass
class ParsedGGUF:
    fields: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int


class _Cursor:
    """Reads the file front to back over a memory map; every read is bounds-checked. The map
    is closed when parsing ends, so the header's pages leave the resident set with it."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            if self.size == 0:
                raise CorruptModelError(f"{path}: not a readable GGUF file (empty)")
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.pos = 0

    def close(self) -> None:
        self.map.close()

    def need(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise CorruptModelError(f"{self.path}: {what} runs past the end of the file")
        start = self.pos
        self.pos += n
        return self.map[start:self.pos]

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.need(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> bytes:
        return self.need(self.unpack("<Q", what), what)

    def strings(self, count: int, what: str) -> StringArray:
        """``count`` strings in a row: where each lies found at once (:func:`short_item_starts`)
        or, where that finds nothing certain, by a loop that only reads each length (kept to
        local names); a length past the end of the file ends it, checked once."""
        if count * 8 > self.size - self.pos:
            raise CorruptModelError(f"{self.path}: {what} runs past the end of the file")
        first = self.pos
        found = short_item_starts(self.map, first, self.size, count) if count else None
        if found is not None:
            begins, pos = found
            self.pos = pos
            ends = np.empty_like(begins)
            ends[:-1], ends[-1] = begins[1:] - 8, pos
            return StringArray(self.map[first:pos], begins - first, ends - first)
        data, pos, size, starts = self.map, first, self.size, array.array("q")
        length_at, start = struct.Struct("<Q").unpack_from, starts.append
        for _ in range(count):
            if pos + 8 > size:  # also stops a length that jumped past the end
                raise CorruptModelError(f"{self.path}: {what} runs past the end of the file")
            pos += 8
            start(pos)
            pos += length_at(data, pos - 8)[0]
        if pos > size:
            raise CorruptModelError(f"{self.path}: {what} runs past the end of the file")
        self.pos = pos
        begins = np.frombuffer(starts, dtype=np.int64) if count else np.empty(0, dtype=np.int64)
        ends = np.empty_like(begins)
        ends[:-1], ends[-1:] = begins[1:] - 8, pos
        return StringArray(data[first:pos], begins - first, ends - first)

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype], what)
        if vtype == STRING:
            return self.string(what).decode("utf-8")
        if vtype != ARRAY:
            raise CorruptModelError(f"{self.path}: {what} has unknown value type {vtype}")
        item, count = self.unpack("<I", what), self.unpack("<Q", what)
        if item in _NUMPY:
            width = np.dtype(_NUMPY[item]).itemsize
            if count * width > self.size - self.pos:
                raise CorruptModelError(f"{self.path}: {what} runs past the end of the file")
            return np.frombuffer(self.need(count * width, what), dtype=_NUMPY[item]).copy()
        if item == STRING:
            return self.strings(count, what)
        if item == ARRAY:  # arrays of arrays: no key llama.cpp writes; read and kept as a list
            if count > self.size - self.pos:
                raise CorruptModelError(f"{self.path}: {what} runs past the end of the file")
            return [self.value(ARRAY, what) for _ in range(count)]
        raise CorruptModelError(f"{self.path}: {what} has unknown item type {item}")


def short_item_starts(buffer: mmap.mmap, first: int, size: int, count: int) -> tuple[np.ndarray, int] | None:
    """Where ``count`` length-prefixed items from ``buffer[first:]`` begin (each after its
    8-byte little-endian length), and where the last ends; found with a few passes of numpy
    over the bytes instead of a step of Python per item (a 49k vocabulary's loop took 10 ms).

    A length of 1 to 255 is a nonzero byte and seven zero bytes, so where every item is
    that long, the items' lengths are among the positions that look so (the candidates):
    if, from ``first``, each candidate's length leads to the next candidate, ``count``
    times, these are the items. Anything else (an empty item or one of 256 bytes or more, a
    nonzero byte and seven NULs inside an item, a length past ``size``) gives None, and
    the caller reads the lengths one by one, which finds what is there or says what is
    wrong. The window read grows until it holds the items."""
    left = size - first
    window = min(left, 16 * count + 64)
    while window >= 8:
        region = np.frombuffer(buffer, dtype=np.uint8, count=window, offset=first)
        nonzero = region != 0
        length = nonzero[: window - 7].copy()  # a nonzero byte at p, then seven zero bytes
        for shift in range(1, 8):
            length &= ~nonzero[shift : window - 7 + shift]
        candidates = np.flatnonzero(length)
        lengths = region[candidates].astype(np.int64)
        del region  # a view of the map, which the parse closes
        ends = candidates + 8 + lengths
        n = min(count, len(candidates))
        if n == 0 or candidates[0] != 0:
            return None
        agree = ends[: n - 1] == candidates[1:n]
        wrong = int(np.argmin(agree)) if n > 1 and not agree.all() else -1
        if wrong < 0 and n == count:
            if ends[n - 1] > left:
                return None
            return candidates[:n] + 8 + first, int(ends[n - 1]) + first
        # the chain ran out of the window (or off the candidates inside it): a wider window, if any
        reached = ends[wrong] if wrong >= 0 else ends[n - 1]
        if reached + 8 <= window or window == left:
            return None
        window = min(left, 2 * window)
    return None


def parse_gguf(path: Path) -> ParsedGGUF:
    """Header, metadata and tensor table of a GGUF file (raises CorruptModelError if malformed)."""
    cursor = _Cursor(path)
    try:
        return _parse(cursor)
    finally:
        cursor.close()


def _parse(c: _Cursor) -> ParsedGGUF:
    if bytes(c.need(4, "the magic")) != MAGIC:
        raise CorruptModelError(f"{c.path}: not a readable GGUF file (no GGUF magic)")
    version = c.unpack("<I", "the version")
    if version not in (2, 3):
        if version & 0xFFFF == 0 and version >> 16 in (2, 3):
            raise UnsupportedModelError(f"{c.path}: big-endian GGUF files are not supported")
        raise UnsupportedModelError(f"{c.path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_fields = c.unpack("<Q", "the tensor count"), c.unpack("<Q", "the field count")
    if n_fields > c.size or n_tensors > c.size:
        raise CorruptModelError(f"{c.path}: the header's counts are larger than the file")
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = c.string("a metadata key").decode("utf-8", errors="replace")
        fields[key] = c.value(c.unpack("<I", f"metadata {key!r}"), f"metadata {key!r}")
    table = []
    for _ in range(n_tensors):
        name = c.string("a tensor name").decode("utf-8", errors="replace")
        n_dims = c.unpack("<I", f"tensor {name!r}")
        if n_dims > 8:
            raise CorruptModelError(f"{c.path}: tensor {name!r} has {n_dims} dimensions")
        dims = np.frombuffer(c.need(8 * n_dims, f"tensor {name!r}"), dtype="<u8").copy()
        table.append((name, dims, c.unpack("<I", f"tensor {name!r}"), c.unpack("<Q", f"tensor {name!r}")))
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise CorruptModelError(f"{c.path}: general.alignment must be a power of two, got {alignment!r}")
    data_offset = -(-c.pos // alignment) * alignment
    tensors = {}
    for name, dims, qtype, offset in table:
        n_bytes = _tensor_bytes(c.path, name, dims, qtype)
        start = data_offset + offset
        present = max(0, min(n_bytes, c.size - start))
        tensors[name] = TensorInfo(c.path, name, dims, qtype, start, n_bytes, present)
    return ParsedGGUF(fields, tensors, data_offset)


def _tensor_bytes(path: Path, name: str, dims: np.ndarray, qtype: int) -> int:
    numel = 1
    for d in dims.tolist():
        numel *= int(d)
    try:
        block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        return 0  # a type we do not know: refused by name when the tensor is asked for
    if numel % block_elems:
        raise CorruptModelError(f"{path}: tensor {name!r} has {numel} values, not whole blocks of {block_elems}")
    return numel // block_elems * block_bytes
