"""This process's shared file mappings, and where a tensor viewed from one lies in its file.

A weight loaded from a GGUF or safetensors file is a view of the file's shared mapping.
:func:`shared_file_maps` lists those mappings (``/proc/self/maps``: Linux only, none
elsewhere); :func:`file_span` finds where a view's bytes lie in which file (``None`` for
memory that is not a file view, such as weights made private memory by
bargein.loader.private_weights).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class FileSpan:
    """``nbytes`` at byte ``offset`` of the file at ``path``."""

    path: str
    offset: int
    nbytes: int


def shared_file_maps() -> list[tuple[int, int, int, str, int]]:
    """(start, end, file offset, path, inode) of this process's shared file mappings; none off Linux."""
    if not sys.platform.startswith("linux"):
        return []
    maps = []
    try:
        with open("/proc/self/maps") as lines:
            for line in lines:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[1][3] == "s" and fields[5].startswith("/"):
                    lo, hi = fields[0].split("-")
                    maps.append((int(lo, 16), int(hi, 16), int(fields[2], 16), fields[5].rstrip("\n"),
                                 int(fields[4])))
    except (OSError, ValueError, IndexError):
        return []
    return maps


def file_span(address: int, nbytes: int, maps: list[tuple[int, int, int, str, int]]) -> FileSpan | None:
    """Where ``nbytes`` at ``address`` lie in a file, if inside one of ``maps`` (shared_file_maps)
    and the path still names the file mapped (same inode: not for a file deleted or replaced
    since, nor a path /proc/self/maps had to escape)."""
    for lo, hi, offset, path, inode in maps:
        if lo <= address and address + nbytes <= hi:
            try:
                same = os.stat(path).st_ino == inode
            except OSError:
                same = False
            return FileSpan(path, offset + address - lo, nbytes) if same else None
    return None
