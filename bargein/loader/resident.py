"""This process's resident memory, split into private and file-backed pages (Linux).

Weights loaded by memory map are file-backed: their pages belong to the page cache,
are shared with every process that maps the same file, and can be dropped and re-read
by the kernel under pressure; a private (anonymous) copy cannot. The split says which a
process holds: ``RssAnon`` (private: heap, KV cache, any copied weight) against
``RssFile`` (mapped files: weights, libraries), from ``/proc/self/status``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_FIELDS = {"VmRSS": "total", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem", "VmHWM": "peak"}


@dataclass(frozen=True)
class ResidentMemory:
    """Bytes resident now: ``anon`` (private) + ``file`` (file-backed) + ``shmem`` = ``total``;
    ``peak`` is the high-water mark of ``total`` (VmHWM). Zero where the system does not say."""

    total: int = 0
    anon: int = 0
    file: int = 0
    shmem: int = 0
    peak: int = 0

    def as_mb(self) -> dict[str, float]:
        return {name: round(getattr(self, name) / 2**20, 1) for name in _FIELDS.values()}


def resident_memory(pid: int | str = "self") -> ResidentMemory:
    """The resident set of process ``pid`` (default: this one), from ``/proc/<pid>/status``;
    all zero off Linux."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ResidentMemory()
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in _FIELDS:
            values[_FIELDS[key]] = int(rest.split()[0]) * 1024  # kB
    return ResidentMemory(**values)
