"""The compiled-graph transport, checked in a process of its own.

A pipeline uses a Ray compiled graph only where every stage runs on the head's node;
the session's shared Ray cluster (``tests/ray_cluster.py``) gives that node one CPU,
and a process joins one Ray instance only. So ``tests/distributed/graph_pipeline_checks.py`` runs
under its own pytest in a subprocess, with a one-node Ray instance of its own: token
parity with the single engine for 2 and 3 stages, a failing plan, a cancel and C4, and
a killed or frozen stage recovered, in both transports where it applies.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.started import count

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(450)  # past the subprocess's own 400 s (the suite's default is 300)
def test_pipelines_on_one_node_run_a_compiled_graph_and_keep_the_contract() -> None:
    count("Ray clusters")  # the subprocess's one-node Ray instance
    count("Ray nodes")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/distributed/graph_pipeline_checks.py"], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout[-2000:]
