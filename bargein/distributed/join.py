"""How a machine becomes a node of a bargein Ray cluster: the token, the node's address,
the ``ray start`` command lines.

Ray (2.59 and later) authenticates nodes and drivers with a shared token once token
authentication is on, and a head turns it on by itself where ``~/.ray/auth_token``
exists. bargein always runs its clusters with it on: the head makes a token if it has
none; every other machine needs a copy of it (in its own ``~/.ray/auth_token``, or
``$RAY_AUTH_TOKEN``), and every Ray process there runs with ``RAY_AUTH_MODE=token``.

A machine with several interfaces (a LAN, a VPN, a container bridge) must give Ray the
address the others reach it by: :func:`address_towards` is the one its traffic to the
head leaves from. Nothing here imports Ray: these steps run where it may be missing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bargein.distributed.errors import PipelineSetupError

DEFAULT_PORT = 6379
INSTALL_HINT = ("install it with `make ray` in a bargein checkout (or `pip install 'bargein[ray]'`) "
                "on every machine")


def token_path() -> Path:
    """Where Ray looks for the token: ``$RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def local_token() -> str | None:
    """The token this machine holds (``$RAY_AUTH_TOKEN`` first, as Ray reads it), or None."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    try:
        return token_path().read_text().strip() or None
    except OSError:
        return None


def install_token(token: str) -> Path:
    """Writes ``token`` where Ray looks for it (mode 0600): the token-copy step."""
    token = token.strip()
    if not token or any(c.isspace() for c in token):
        raise PipelineSetupError("the token is empty or has spaces in it: copy the head's ~/.ray/auth_token as is")
    path = token_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return path


def ensure_token() -> str:
    """The head's token, made (64 hex digits, as Ray makes them) where it has none."""
    token = local_token()
    if token is None:
        token = secrets.token_hex(32)
        install_token(token)
    return token


def token_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default this process's) with token authentication on: what ``ray start``
    runs with, and so every Ray process of the node (stages and replicas included)."""
    out = dict(os.environ if env is None else env)
    out["RAY_AUTH_MODE"] = "token"
    return out


def split_address(address: str) -> tuple[str, int]:
    """HOST[:PORT] -> (host, port); the port defaults to Ray's 6379."""
    host, sep, port = address.rpartition(":")
    if not sep:
        return address, DEFAULT_PORT
    if not host or not port.isdigit():
        raise PipelineSetupError(f"bad Ray address {address!r}: give one like HOST:6379")
    return host, int(port)


def address_towards(host: str, port: int = DEFAULT_PORT) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
        except OSError as exc:
            raise PipelineSetupError(f"no route from this machine to {host}: {exc.strerror or exc}") from None
        return s.getsockname()[0]


def check_reachable(host: str, port: int, timeout: float = 5.0) -> None:
    """Raises PipelineSetupError in one line when nothing answers at host:port."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        raise PipelineSetupError(f"no Ray head answers at {host}:{port} from this machine ({why}): "
                                 f"is the head started, and is the port open?") from None


def ray_executable() -> str:
    """The ``ray`` command of this Python (beside it in a virtual environment), or on $PATH."""
    beside = Path(sys.executable).parent / "ray"
    found = str(beside) if beside.exists() else shutil.which("ray")
    if found is None:
        raise PipelineSetupError(f"Ray is not installed here: {INSTALL_HINT}")
    return found


@dataclass(frozen=True)
class NodeStart:
    """One ``ray start`` for a bargein node: a head (``head_address`` None) or a worker."""

    node_ip: str
    head_address: str | None = None  # HOST:PORT of the head, for a worker
    port: int = DEFAULT_PORT  # the head's GCS port
    temp_dir: str | None = None  # Ray's session files (sockets, logs); default /tmp/ray
    num_cpus: int | None = None
    memory_bytes: int | None = None  # Ray's `memory` resource, which the layer split reads
    object_store_bytes: int | None = None

    def command(self, ray: str) -> list[str]:
        argv = [ray, "start", "--node-ip-address", self.node_ip, "--disable-usage-stats"]
        if self.head_address is None:
            argv += ["--head", "--port", str(self.port), "--include-dashboard=false"]
        else:
            argv += ["--address", self.head_address]
        for flag, value in (("--temp-dir", self.temp_dir), ("--num-cpus", self.num_cpus),
                            ("--memory", self.memory_bytes), ("--object-store-memory", self.object_store_bytes)):
            if value is not None:
                argv += [flag, str(value)]
        return argv


def run_ray_start(start: NodeStart) -> None:
    """Runs ``ray start`` for ``start`` with token authentication on; a failure is one
    PipelineSetupError line (Ray's own output is long, and its advice about `ray stop`
    would mislead here)."""
    done = subprocess.run(start.command(ray_executable()), env=token_environment(), capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "error" in line] or lines[-1:]
        raise PipelineSetupError(f"`ray start` failed: {errors[-1].strip() if errors else done.returncode}")
