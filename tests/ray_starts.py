"""One Ray start at a time among a test session's processes.

The session runs three Ray instances: the shared cluster (``tests/ray_cluster.py``), the
namespace hosts' (``tests/distributed/test_hosts.py``) and the compiled graph's one-node
instance (``tests/distributed/graph_pipeline_checks.py``, in a subprocess). They are
separate units of work, so that the two xdist workers run them side by side; but a Ray
start (a GCS, a raylet, their first workers) is seconds of CPU against timeouts of its
own, and two at once on a loaded 2-core machine missed them. So each start (an instance,
or a node joining one) holds an exclusive lock on one file of the session, which the
controller names in :data:`LOCK_ENV` before it starts the workers; the tests themselves
run side by side.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests import session_files

LOCK_ENV = "BARGEIN_TEST_RAY_START_LOCK"


def name_the_lock() -> None:
    """Names the session's lock file (in the controller, or a run without xdist), for
    every process started after this to inherit; a name already set is kept."""
    if LOCK_ENV not in os.environ:
        os.environ[LOCK_ENV] = str(session_files.directory() / "ray-start.lock")


@contextmanager
def one_at_a_time() -> Iterator[None]:
    """Holds the session's Ray start lock (blocking until the start before is done)."""
    path = os.environ.get(LOCK_ENV) or str(Path(tempfile.gettempdir()) / f"bargein-ray-starts-{os.getuid()}.lock")
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
