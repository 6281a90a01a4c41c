"""Ray starts wait for each other (tests/ray_starts.py): a second holder enters only once
the first has left, across processes (the lock is a file the session names)."""

from __future__ import annotations

import subprocess
import sys
import time

from tests import ray_starts


def test_a_start_waits_for_the_one_before(monkeypatch, tmp_path):
    monkeypatch.setenv(ray_starts.LOCK_ENV, str(tmp_path / "lock"))
    other = [sys.executable, "-c", "import time; from tests.ray_starts import one_at_a_time\n"
             "print('waiting', flush=True)\nwith one_at_a_time():\n    print(time.time(), flush=True)"]
    with ray_starts.one_at_a_time():
        waiter = subprocess.Popen(other, stdout=subprocess.PIPE, text=True)
        assert waiter.stdout.readline() == "waiting\n"
        time.sleep(0.3)  # were the lock free, the other process would be in by now
        left = time.time()
    entered = float(waiter.communicate(timeout=60)[0])
    assert waiter.returncode == 0 and entered >= left


def test_the_controller_names_one_lock_for_the_session(monkeypatch):
    monkeypatch.delenv(ray_starts.LOCK_ENV, raising=False)
    ray_starts.name_the_lock()
    named = ray_starts.os.environ[ray_starts.LOCK_ENV]
    ray_starts.name_the_lock()
    assert ray_starts.os.environ[ray_starts.LOCK_ENV] == named
