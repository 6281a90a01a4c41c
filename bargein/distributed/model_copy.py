"""Whether a node holds the head's model files, told by their names and sizes.

The head asks every node that may host a stage or a replica with a Ray task pinned to
it (:func:`has_model_copy`), before anything loads. Such a task starts a worker process
on the node, which imports the module the function lives in: this one imports neither
torch nor the loader, so that process starts in about a second instead of several.
"""

from __future__ import annotations

import os
from pathlib import Path

Fingerprint = tuple[tuple[str, int], ...]


def file_fingerprint(path: Path, kind: str) -> Fingerprint:
    """Names and sizes of the files a model of ``kind`` ("gguf", or a folder) is read
    from: a node whose copy at the same path matches reads it itself."""
    if kind == "gguf":
        return ((path.name, path.stat().st_size),)
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json"))
    return tuple((p.name, p.stat().st_size) for p in files)


def has_model_copy(path: str, kind: str, expected: Fingerprint) -> bool:
    """True if this machine holds the same model files at ``path`` (run on the node;
    ``~`` is this node's home directory)."""
    path = os.path.expanduser(path)
    try:
        return os.path.exists(path) and file_fingerprint(Path(path), kind) == expected
    except OSError:
        return False
