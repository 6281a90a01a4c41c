"""Whether a Ray cluster asks for a token, found out from the cluster before joining it.

Ray takes a process's authentication mode from local facts only: ``$RAY_AUTH_MODE``, and
for the address "auto" whether this machine holds a token (``~/.ray/auth_token``). A head
that runs with a token on a cluster started without one connects and runs tasks, but the
cluster's calls back to it are refused (they carry no token), so each actor it creates is
reported as never having run. A token on this machine says nothing about the cluster at
hand (a test cluster, a second cluster, a node's leftover copy).

So :func:`probe` asks the cluster's GCS one question without a token: a GCS that checks
tokens refuses it, one that does not answers. :func:`mode_for` turns the answer (and
whether this machine holds a token) into the mode this process must run with, or a clear
error before anything is started. An explicit ``$RAY_AUTH_MODE`` is the user's and is
kept; :mod:`bargein.distributed.connect` does not probe then.
"""

from __future__ import annotations

import enum
import socket

from bargein.distributed.errors import PipelineSetupError
from bargein.distributed.join import split_address

PROBE_TIMEOUT_S = 3.0


class ClusterAuth(enum.Enum):
    """What the cluster's GCS said to a call without a token."""

    TOKEN = "token"  # refused it: token authentication is on
    NONE = "none"  # answered it: no authentication
    UNKNOWN = "unknown"  # not asked or no answer (no GCS there, a Ray without token support)


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> ClusterAuth:
    """Asks the GCS at ``address`` (HOST:PORT, or "auto" for the cluster this machine
    belongs to) for its cluster id without a token. Never raises: whatever keeps it from
    an answer (nothing listens, a Ray without token authentication, this process already
    presenting a token, which a GCS of either kind accepts) is UNKNOWN."""
    try:
        import ray  # noqa: F401  (the optional extra: without it, nothing to ask with)
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
        from ray._private.services import canonicalize_bootstrap_address
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError
    except ImportError:
        return ClusterAuth.UNKNOWN
    if is_token_auth_enabled():
        return ClusterAuth.UNKNOWN
    try:
        gcs_address = canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError):
        return ClusterAuth.UNKNOWN
    if gcs_address is None or not _listens(gcs_address, timeout_s):
        return ClusterAuth.UNKNOWN  # GcsClient would retry for 40 s; ray.init says what is wrong
    try:
        GcsClient(address=gcs_address)  # asks for the cluster's id at once
    except AuthenticationError:
        return ClusterAuth.TOKEN
    except Exception:  # an error of Ray's own making (a timeout, an RPC error): no answer
        return ClusterAuth.UNKNOWN
    return ClusterAuth.NONE


def mode_for(cluster: ClusterAuth, address: str, *, has_token: bool) -> str | None:
    """The ``RAY_AUTH_MODE`` this process must join the cluster with: "token", "disabled",
    or None where the cluster did not say (then a token this machine holds is presented,
    as before the probe existed). Raises PipelineSetupError when the cluster asks for a
    token that this machine does not hold."""
    if cluster is ClusterAuth.TOKEN:
        if not has_token:
            raise PipelineSetupError(
                f"the Ray cluster at {address} uses token authentication and this machine holds no token: "
                f"copy the head's ~/.ray/auth_token here (`bargein cluster join HEAD --token-file FILE` does it) "
                f"or set RAY_AUTH_TOKEN")
        return "token"
    if cluster is ClusterAuth.NONE:
        return "disabled"
    return "token" if has_token else None


def _listens(gcs_address: str, timeout_s: float) -> bool:
    try:
        socket.create_connection(split_address(gcs_address), timeout=timeout_s).close()
    except (OSError, PipelineSetupError):
        return False
    return True
