"""A head joins a Ray cluster with the cluster's own authentication mode, whatever token
this machine holds (bargein/distributed/cluster_auth.py).

The session's cluster (``tests/ray_cluster.py``) runs without tokens. A head started with
a token in its environment and no ``RAY_AUTH_MODE`` used to switch itself to token
authentication; the cluster then connected it, but refused its own calls back to it, so
every actor the head created was cancelled ("the actor never ran"). Here that head is a
process of its own (this one is joined already), which creates one actor and calls it.
The token-mode side is the namespace hosts' (``tests/distributed/test_hosts.py``), whose
servers join a cluster that asks for a token.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

from bargein.distributed.cluster_auth import ClusterAuth, probe  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HEAD = """
import os, sys
import ray
from bargein.distributed.connect import connect

connect(sys.argv[1], 1, check=False)

@ray.remote(num_cpus=0)
class Echo:
    def ran(self):
        return "ran"

print(os.environ["RAY_AUTH_MODE"], ray.get(Echo.remote().ran.remote(), timeout=120))
"""


def test_the_session_cluster_answers_a_call_without_a_token(ray_cluster) -> None:
    assert probe(ray_cluster.address) is ClusterAuth.NONE


def test_a_token_held_here_does_not_switch_a_head_to_tokens_on_a_cluster_without_them(ray_cluster) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env |= {"RAY_AUTH_TOKEN": "a-token-this-cluster-never-asks-for", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", HEAD, ray_cluster.address], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["disabled", "ran"], done.stdout
