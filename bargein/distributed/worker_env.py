"""What the head hands its Ray workers (pipeline stages, replicas) from its own environment:
the OpenMP wait policy.

``bargein``'s ``main`` settles how compute threads wait (``GOMP_SPINCOUNT``, unless the user
set it or ``OMP_WAIT_POLICY``: see ``bargein.cli.threads``) before torch loads. A stage or a
replica runs in a Ray worker process started by its node's raylet, which inherits the
environment of whoever ran ``ray start`` on that node: a node started by ``bargein cluster``
has the policy, one started by a plain ``ray start`` has OpenMP's long default spin, which
collapses decoding on a shared machine. So the head passes the variables it runs with to
every actor it starts, as the actor's ``runtime_env`` (Ray sets them before the worker
process starts, so before its OpenMP runtime loads).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

WAIT_POLICY_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def wait_policy_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The OpenMP wait-policy variables set in ``env`` (default: this process's)."""
    env = os.environ if env is None else env
    return {k: env[k] for k in WAIT_POLICY_VARIABLES if k in env}


def worker_runtime_env() -> dict[str, Any]:
    """The actor option ``runtime_env`` that carries the wait policy ({} if none is set)."""
    variables = wait_policy_env()
    return {"runtime_env": {"env_vars": variables}} if variables else {}


def describe_wait_policy(env: Mapping[str, str] | None = None) -> str:
    """The wait policy a worker runs with, as ``/v1/cluster`` shows it ("GOMP_SPINCOUNT=100";
    "OpenMP default" where none is set)."""
    variables = wait_policy_env(env)
    return " ".join(f"{k}={v}" for k, v in variables.items()) or "OpenMP default"
