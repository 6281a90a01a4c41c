"""Connecting the head to Ray, and checking the cluster before anything is loaded on it.

``connect(address)`` joins "auto" (the cluster this machine belongs to: ``$RAY_ADDRESS``
or the one ``ray start`` recorded here), "local" (a new one in this process) or
HOST:PORT. Where the cluster asks for a token (see :mod:`bargein.distributed.join`),
the head presents the one this machine holds; where it holds none, it says so. Whether it
asks is found out from the cluster itself (:mod:`bargein.distributed.cluster_auth`), not
from a token file here, unless ``$RAY_AUTH_MODE`` says.

:func:`check_cluster` then asks every live node, with a task pinned to it, for its Ray,
Python and bargein versions, and tries the head's route to each node's raylet. Each
problem is one line of :class:`ClusterProblems`: a node whose Ray or Python differs from
the head's (Ray refuses to run across them), a node that cannot import bargein (no
``ray`` extra installed there), a node the head has no route to, a node that does not
answer. ``bargein serve --ray`` and ``bargein cluster check`` run it.
"""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass
from typing import Any

from bargein.distributed.cluster_auth import ClusterAuth, mode_for, probe
from bargein.distributed.errors import PipelineSetupError
from bargein.distributed.join import INSTALL_HINT, check_reachable, local_token, split_address

try:
    import ray
except ModuleNotFoundError as exc:
    if exc.name != "ray":
        raise
    ray = None

PROBE_TIMEOUT_S = 20.0


def connect(address: str, num_cpus: int, *, check: bool = True) -> None:
    """Connects this process to Ray ("auto", "local" or HOST:PORT), then, for a cluster
    that runs outside this process, :func:`check_cluster` (unless ``check`` is False).
    Raises PipelineSetupError with one line per problem."""
    if ray is None:
        raise PipelineSetupError(f"Ray is not installed: {INSTALL_HINT}")
    if address not in ("auto", "local") and not address.startswith("ray://"):
        check_reachable(*split_address(address), timeout=3.0)  # Ray itself retries for minutes
    if ray.is_initialized():
        return
    if address != "local" and "RAY_AUTH_MODE" not in os.environ:
        # A Ray Client address (ray://) has no GCS to ask: a token held here is presented.
        cluster = ClusterAuth.UNKNOWN if address.startswith("ray://") else probe(address)
        mode = mode_for(cluster, address, has_token=local_token() is not None)
        if mode is not None:
            _run_with_auth_mode(mode)
    try:
        if address == "local":
            # address="local": a new instance even where a cluster runs on this machine
            # (Ray would otherwise join that one, and refuse num_cpus for it).
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except ray.exceptions.AuthenticationError:
        raise PipelineSetupError(no_token_message(address)) from None
    except (ConnectionError, RuntimeError, ValueError) as exc:
        if "authentication" in type(exc).__name__.lower():  # older Rays raise it under another base
            raise PipelineSetupError(no_token_message(address)) from None
        if address == "auto":
            raise PipelineSetupError("no Ray cluster runs on this machine: start one with `bargein cluster start` "
                                     "(or use --ray local)") from None
        if local_token() is None:
            # Ray reports a refused token only in its log ("InvalidAuthToken"), then fails
            # to connect: without a token here, that is the likely reason; say both.
            raise PipelineSetupError(f"no Ray cluster at {address} ({_first_line(exc)}); if it uses token "
                                     f"authentication: {no_token_message(address)}") from None
        raise PipelineSetupError(f"no Ray cluster at {address}: {_first_line(exc)}") from None
    if check and address != "local":
        problems = check_cluster()
        if problems:
            raise PipelineSetupError(str(problems))


def _run_with_auth_mode(mode: str) -> None:
    """This process (and what it starts) joins with ``mode`` ("token" or "disabled"): set
    explicitly, so that Ray does not turn tokens on by itself for "auto" where this machine
    holds one."""
    os.environ["RAY_AUTH_MODE"] = mode
    try:  # Ray read the mode into its config when it was imported: read it again
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError):  # a Ray without token authentication
        pass


def no_token_message(address: str) -> str:
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return (f"the Ray cluster at {address} asks for a token and RAY_AUTH_MODE=disabled here: unset "
                f"RAY_AUTH_MODE (or set it to token) and give this machine the head's ~/.ray/auth_token")
    if local_token() is None:
        return (f"the Ray cluster at {address} asks for a token and this machine has none: copy the head's "
                f"~/.ray/auth_token here (`bargein cluster join HEAD --token-file FILE` does it)")
    return (f"the Ray cluster at {address} refused this machine's token: copy the head's ~/.ray/auth_token "
            f"here again (the head may have made a new one)")


@dataclass(frozen=True)
class NodeFacts:
    """What a node says about itself (from a task pinned to it)."""

    ray_version: str
    python_version: str
    bargein_version: str


def node_facts() -> NodeFacts:
    """Runs on a node: its versions. Shipped by reference, so a node without bargein fails
    to import this very function, which is how that problem is found."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        bargein_version = version("bargein")
    except PackageNotFoundError:
        bargein_version = "?"
    return NodeFacts(ray.__version__, platform.python_version(), bargein_version)


class ClusterProblems(list):
    """One line per problem found (empty: the cluster is fit to run on)."""

    def __str__(self) -> str:
        return "the Ray cluster is not ready:\n  " + "\n  ".join(self) if self else "the Ray cluster is ready"


def check_cluster(timeout_s: float = PROBE_TIMEOUT_S) -> ClusterProblems:
    """Every live node checked (Ray must be connected): see the module doc."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    problems = ClusterProblems()
    here = node_facts()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    probe = ray.remote(num_cpus=0)(node_facts)
    pending = {}
    for n in nodes:
        route = _route_problem(n)
        if route:
            problems.append(route)
            continue
        strategy = NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        pending[probe.options(scheduling_strategy=strategy).remote()] = n
    ready, late = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s) if pending else ([], [])
    for ref in late:
        n = pending[ref]
        problems.append(f"node {n['NodeManagerAddress']} did not answer within {timeout_s:.0f} s: is it overloaded, "
                        f"or can it not reach the head?")
        ray.cancel(ref, force=True)
    for ref in ready:
        n = pending[ref]
        try:
            facts = ray.get(ref)
        except ray.exceptions.RayError as exc:
            text = str(exc)
            if "No module named 'bargein" in text or "ModuleNotFoundError" in text:
                problems.append(f"node {n['NodeManagerAddress']} cannot import bargein: {INSTALL_HINT}")
            else:
                problems.append(f"node {n['NodeManagerAddress']} failed a check: {_first_line(exc)}")
            continue
        problems += version_problems(n["NodeManagerAddress"], facts, here)
    return problems


def version_problems(node: str, facts: NodeFacts, head: NodeFacts) -> list[str]:
    """The differences between a node's versions and the head's that break a cluster, one line each."""
    out = []
    if facts.ray_version != head.ray_version:
        out.append(f"node {node} runs Ray {facts.ray_version}, the head {head.ray_version}: install the same "
                   f"Ray on every machine ({INSTALL_HINT})")
    if facts.python_version.rsplit(".", 1)[0] != head.python_version.rsplit(".", 1)[0]:
        out.append(f"node {node} runs Python {facts.python_version}, the head {head.python_version}: Ray needs "
                   f"the same Python minor version everywhere")
    if facts.bargein_version != head.bargein_version:
        out.append(f"node {node} has bargein {facts.bargein_version}, the head {head.bargein_version}: install "
                   f"the same checkout on every machine")
    return out


def _route_problem(node: dict[str, Any], timeout: float = 3.0) -> str | None:
    """A line when the head cannot open a connection to the node's raylet."""
    host, port = node["NodeManagerAddress"], node.get("NodeManagerPort")
    if not port:
        return None
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        return f"no route from the head to node {host} (port {port}: {why}): check its address and firewall"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
