"""One server owns a tier directory: an exclusive, non-blocking ``fcntl`` lock on a file in it.

Two servers writing and evicting in one directory would delete each other's blocks and
race on the index, so the second to start does not share it: it is told who holds the
lock (the owner writes its pid into the lock file) and runs without the tier. The lock
goes with the process (the kernel drops it when the file is closed or the process dies,
``kill -9`` included), so a crashed server never leaves a stale lock behind.

This module imports no torch.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = "bargein-kv-disk.lock"


class DirectoryBusy(RuntimeError):
    """Another process owns the tier directory; the message names it."""


class DirectoryLock:
    """An exclusive hold on a directory for this process's lifetime, or until ``release``."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DirectoryBusy(f"{directory} is in use by another bargein server (pid {holder})") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Gives the directory up (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing drops the flock
