"""``bargein serve`` processes forked from one process that imported bargein once.

On unless BARGEIN_TEST_FORK_SERVERS=0 (``tests/conftest.py`` says what was checked).
Most of a server start's CPU is imports (torch, FastAPI, pydantic: 2-3 s of CPU each
time), and the suite starts dozens of servers. So one process per test process (the
*zygote*, ``python -m tests.forked_servers``) imports them once, then forks each server:
the child runs the command line's own entry point (``bargein.cli.entry.main``) with the
same arguments, output going to its log, and exits as ``python -m bargein.cli`` would
(``SystemExit``: atexit handlers and thread shutdown run). Between zygote and server, a
monitor (a second fork, which only waits) writes the server's exit status to a file, so
that :class:`ForkedProcess` can answer ``poll``/``wait`` as ``subprocess.Popen`` does for
a process that is not the test's child.

What a fresh process settles before torch loads is settled in the zygote before it
imports anything: the OpenMP wait (``settle_waiting``, which ``main`` does first thing,
and which the runtime reads only when it loads; without it a forked server spins
300,000 rounds between kernels and runs an order of magnitude slower on a busy machine).
Each server gets the environment its start was given (``os.environ``) and reseeds
Python's and NumPy's random streams. A start whose environment differs from the
zygote's in more than pytest's current test runs as a plain subprocess (:func:`popen`):
what torch and the OpenMP runtime read as they load could differ.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What ``bargein serve`` imports as it starts, imported once in the zygote.
PRELOADED = ("bargein.cli.entry", "bargein.cli.model", "bargein.engine.engine", "bargein.engine.async_engine",
             "bargein.server", "bargein.server.serve", "bargein.startup")
POLL_S = 0.02


class ForkedProcess:
    """A forked server, with what the tests use of ``subprocess.Popen``."""

    def __init__(self, pid: int, status_path: Path, args: Sequence[str]):
        self.pid, self.args, self._status_path = pid, list(args), status_path
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._status_path.exists():
            self.returncode = int(self._status_path.read_text())
            self._status_path.unlink()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(POLL_S)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not yet reaped by its monitor: the pid is still the server's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


class Zygote:
    """The forking process, started on first use; one per test process."""

    def __init__(self, env: Mapping[str, str]):
        self.env = dict(env)
        self._lock = threading.Lock()  # one start at a time: the pid line answers the last job
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.forked_servers"], cwd=REPO, env=self.env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        ready = self._proc.stdout.readline().strip()
        if ready != "ready":
            raise RuntimeError(f"the server zygote did not start: {ready!r}")

    def start(self, argv: Sequence[str], log_path: Path, env: Mapping[str, str]) -> ForkedProcess:
        """``bargein ARGV`` forked, its output appended to ``log_path``, with ``os.environ``
        set to ``env`` (which differs from the zygote's in nothing read at import)."""
        fd, status = tempfile.mkstemp(prefix="bargein-exit-")
        os.close(fd)
        os.unlink(status)  # the monitor creates it, whole, when the server has exited
        with self._lock:
            self._proc.stdin.write(json.dumps({"argv": list(argv), "log": str(log_path), "status": status, "env": dict(env)}) + "\n")
            pid = int(self._proc.stdout.readline())
        return ForkedProcess(pid, Path(status), ["bargein", *argv])

    def close(self) -> None:
        """Ends the zygote once every server it forked has exited (the session stops them)."""
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:  # a server left running: it stays, as a Popen'd one would
                self._proc.kill()
                self._proc.wait()


_zygote: Zygote | None = None


def popen(argv: Sequence[str], log_path: Path, env: Mapping[str, str]) -> ForkedProcess | subprocess.Popen:
    """``python -m bargein.cli ARGV`` in REPO with ``env``, its output appended to
    ``log_path``: forked from this process's zygote when ``env`` is the zygote's (the first
    call's), else a plain subprocess."""
    global _zygote
    if _zygote is None:
        _zygote = Zygote(env)
        atexit.register(_zygote.close)
    if _settled(env) != _settled(_zygote.env):
        with open(log_path, "ab") as log:
            return subprocess.Popen([sys.executable, "-m", "bargein.cli", *argv], stdout=log,
                                    stderr=subprocess.STDOUT, cwd=REPO, env=dict(env))
    return _zygote.start(argv, log_path, env)


def _settled(env: Mapping[str, str]) -> dict[str, str]:
    """The environment less what pytest changes from test to test (which a server never
    reads, and which a forked server gets as it is at its start anyway)."""
    return {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}


def _serve_forever() -> None:
    """The zygote: imports bargein's server once, then per line of stdin forks a monitor,
    which forks the server, prints its pid, waits for it and writes its exit status."""
    from bargein.cli.threads import settle_waiting

    settle_waiting()  # before torch loads the OpenMP runtime, as bargein's main does
    from importlib import import_module

    for name in PRELOADED:
        import_module(name)
    if threading.active_count() != 1:  # a fork copies only the forking thread: the others' locks stay held
        print(f"threads after the imports: {threading.enumerate()}", flush=True)
        return
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if os.fork() == 0:
            _monitor(job)
        _reap_monitors(block=False)
    _reap_monitors(block=True)  # waited for, so that their servers' CPU time counts in ours


def _reap_monitors(block: bool) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _monitor(job: dict) -> None:
    pid = os.fork()
    if pid == 0:
        _become_server(job)  # raises SystemExit
    print(pid, flush=True)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # the zygote's pipes: closed here, so they end when the zygote does
        os.dup2(devnull, fd)
    _, status = os.waitpid(pid, 0)
    tmp = job["status"] + ".tmp"
    Path(tmp).write_text(str(os.waitstatus_to_exitcode(status)))
    os.replace(tmp, job["status"])
    os._exit(0)


def _become_server(job: dict) -> None:
    import gc
    import random

    import numpy as np

    from bargein.cli.entry import main

    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    log = os.open(job["log"], os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(job["env"])
    random.seed()
    np.random.seed()
    # A collection writes to every tracked object, and those the zygote imported sit on
    # pages this child shares with it: the first one copies them (~14k page faults). Taken
    # here, before the server answers anything, not in the middle of a request.
    gc.collect()
    sys.argv = [sys.executable, *job["argv"]]
    raise SystemExit(main(job["argv"]))


if __name__ == "__main__":
    _serve_forever()
