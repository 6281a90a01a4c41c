"""One folder for the files a test session leaves behind it (servers' logs, the Ray start
lock): named by the controller before xdist starts its workers, which inherit the name,
and removed when the session passes. A failed session keeps it, and says where."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DIR_ENV = "BARGEIN_TEST_SESSION_DIR"
_MADE_HERE: list[str] = []  # the folder this process made: only its maker removes it


def directory() -> Path:
    """The session's folder, made (and named for the processes started after) on first use.
    A pytest run inside a test inherits the name, and so writes into the outer session's."""
    if DIR_ENV not in os.environ:
        os.environ[DIR_ENV] = tempfile.mkdtemp(prefix="bargein-tests-")
        _MADE_HERE.append(os.environ[DIR_ENV])
    return Path(os.environ[DIR_ENV])


def log_file(prefix: str) -> tuple[int, Path]:
    """A new log file in the session's folder: (open descriptor, path)."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=".log", dir=directory())
    return fd, Path(name)


def finish(passed: bool) -> str | None:
    """At the controller's end: remove the folder if this process made it and the session
    ``passed``; else the line that says where its logs are kept (None where it made none)."""
    path = os.environ.get(DIR_ENV)
    if path not in _MADE_HERE or not Path(path).exists():
        return None
    if passed:
        shutil.rmtree(path, ignore_errors=True)
        return None
    return f"the session's server logs are kept in {path}"
