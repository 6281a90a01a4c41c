"""The model fingerprint: what a block's K/V depends on besides its tokens.

Two servers produce the same K/V for the same tokens only if they run the same weights
with the same arithmetic into the same cache layout. A block file is used only when its
fingerprint equals the running model's, so a file written by another model, another
precision, another block size, another pipeline stage's layers, or an older build whose
``fast`` arithmetic differs, is never read as this model's K/V (C4).

The model files enter by content, not by path or modification time: each file's size
and a BLAKE2b of sampled stretches of it (its head, where GGUF and safetensors keep
their metadata, its tail and evenly spaced chunks between), so a copied or touched file
keeps its fingerprint and a different fine-tune of the same shape does not share one.
Reading the samples costs about 1 MiB per file, once per start.

This module imports no torch.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Bump whenever the arithmetic that writes K/V changes (a kernel's summation order, the
# rounding of activations, rope, the K/V dtype conversion): old files must not match.
NUMERICS_VERSION = 1

_SAMPLES = 16  # evenly spaced chunks per file, besides head and tail
_CHUNK = 64 * 1024
_HEAD = 256 * 1024


def file_identity(path: str | os.PathLike[str]) -> tuple[str, int, str]:
    """(name, size, hex digest of sampled content) of one model file."""
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    h.update(size.to_bytes(8, "little"))
    with open(p, "rb") as f:
        h.update(f.read(_HEAD))
        for i in range(1, _SAMPLES + 1):
            f.seek(size * i // (_SAMPLES + 1))
            h.update(f.read(_CHUNK))
        f.seek(max(0, size - _CHUNK))
        h.update(f.read(_CHUNK))
    return p.name, size, h.hexdigest()


def identity_files(model_identity: str | os.PathLike[str]) -> tuple[tuple[str, int, str], ...]:
    """``file_identity`` of each file of the model at ``model_identity`` (a file or a
    folder); for a string that names no path (in-memory weights), that string alone."""
    path = Path(model_identity)
    if path.exists():
        return tuple(file_identity(f) for f in model_files(path))
    return (("id", 0, str(model_identity)),)


def files_digest(files: tuple[tuple[str, int, str], ...]) -> str:
    """A hex digest of a model's files' identities alone: which weights (and tokenizer),
    whatever the precision or layout. ``Conversation.save`` files carry it."""
    h = hashlib.blake2b(digest_size=16, person=b"bargein-model")
    h.update(repr(files).encode())
    return h.hexdigest()


def model_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files a model is read from: a GGUF file itself, or a folder's weights and configs."""
    p = Path(path)
    if p.is_file():
        return [p]
    return sorted(f for f in p.iterdir() if f.suffix in (".safetensors", ".json", ".gguf"))


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything a block's K/V depends on besides its tokens; ``digest`` names it in 16 bytes."""

    files: tuple[tuple[str, int, str], ...]  # file_identity of each model file
    precision: str  # "exact" | "fast"
    kv_dtype: str  # e.g. "float16"
    block_size: int
    layer_range: tuple[int, int]  # [start, end) of the stage whose K/V the tier holds
    numerics_version: int = NUMERICS_VERSION
    kernels: str = ""  # optional digest of the kernels' sources (see ``sources_digest``)

    @classmethod
    def of_model(cls, path: str | os.PathLike[str], *, precision: str, kv_dtype: str, block_size: int,
                 layer_range: tuple[int, int], kernels: str = "") -> ModelFingerprint:
        """The fingerprint of the model at ``path`` (a GGUF file or a model folder)."""
        files = tuple(file_identity(f) for f in model_files(path))
        return cls(files, precision, kv_dtype, block_size, tuple(layer_range), kernels=kernels)  # type: ignore[arg-type]

    @property
    def digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=16, person=b"bargein-kvfp")
        h.update(repr((self.files, self.precision, self.kv_dtype, self.block_size, self.layer_range,
                       self.numerics_version, self.kernels)).encode())
        return h.digest()

    @property
    def files_digest(self) -> str:
        return files_digest(self.files)

    @property
    def short(self) -> str:
        """8 hex characters of the digest, put in block file names so a start can pass
        over another model's files without opening them (the header is still checked)."""
        return self.digest.hex()[:8]


def sources_digest(paths: Iterable[str | os.PathLike[str]]) -> str:
    """A hex digest of files' contents (e.g. the C kernels), for ``ModelFingerprint.kernels``:
    any change to them gives new fingerprints, the safe side of "did the arithmetic change"."""
    h = hashlib.blake2b(digest_size=16)
    for p in sorted(Path(x) for x in paths):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()
