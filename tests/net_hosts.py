"""Machines for the several-machines tests: Linux network namespaces on one bridge.

Each :class:`Host` is a network namespace with its own address (a veth pair whose other
end is on a bridge in this namespace, loopback up), its own ``HOME`` and its own Ray
``--temp-dir``, so nothing one host writes (the Ray token, Ray's sockets, the model file
in ``~/models``) is seen by another unless the test copies it, as a user would. The test
process, in the root namespace, reaches every host at its address through the bridge;
traffic goes only to the addresses made here.

Commands run on a host with ``ip netns exec`` and ``HOME`` set; every process started
there is in the host's namespace, which is how :meth:`Host.kill_all` finds them all (Ray
daemonizes its processes: there is no parent to wait on). :func:`remove_hosts` kills
them, deletes the namespaces and the bridge, whatever happened before.

Needs root and iproute2: where they are missing the tests are skipped, except under
``CI=true``, where they fail (CI runs as root and must run them).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    return None


def skip_or_fail(why: str) -> None:
    """Skips the tests, or under CI=true fails them: CI must run them."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"namespace hosts are required under CI=true: {why}", pytrace=False)
    pytest.skip(why)


@dataclass
class Host:
    """One machine: a namespace, an address, a home and a Ray temp dir of its own."""

    name: str  # the namespace
    ip: str
    veth: str  # the bridge's end of its link (in the root namespace)
    home: Path
    temp_dir: Path
    env: dict[str, str] = field(default_factory=dict)  # what its commands run with

    def command(self, argv: list[str]) -> list[str]:
        env = [f"{k}={v}" for k, v in self.env.items()]
        return ["ip", "netns", "exec", self.name, "env", f"HOME={self.home}", *env, *argv]

    def run(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout, cwd=REPO)

    def bargein(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """``bargein ARGS`` on this host (this checkout's)."""
        return self.run([sys.executable, "-m", "bargein.cli", *args], timeout=timeout)

    def popen(self, argv: list[str], log: Path) -> subprocess.Popen:
        with open(log, "wb") as out:
            return subprocess.Popen(self.command(argv), stdout=out, stderr=subprocess.STDOUT, cwd=REPO)

    def pids(self) -> list[int]:
        return [int(p) for p in _ip("netns", "pids", self.name, check=False).stdout.split()]

    def kill_all(self, timeout: float = 10.0) -> None:
        """Every process on this host, killed (SIGKILL): the machine lost its power."""
        deadline = time.monotonic() + timeout
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)

    def link(self, up: bool) -> None:
        """Its cable plugged in or pulled (the bridge's end of its veth up or down)."""
        _ip("link", "set", self.veth, "up" if up else "down")


@dataclass
class Hosts:
    bridge: str
    gateway: str  # the bridge's address: the test process, as the hosts see it
    hosts: list[Host]

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)


def _free_subnet() -> str:
    """A 10.x.y.0/24 no interface of this machine uses: the first three octets."""
    used = _ip("-4", "-o", "addr").stdout
    for _ in range(100):
        prefix = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
        if f" {prefix}." not in used:
            return prefix
    raise RuntimeError("no free 10.x.y.0/24 subnet")


def make_hosts(count: int, root: Path) -> Hosts:
    """``count`` hosts on a new bridge (removed again if any step fails)."""
    tag = f"bg{random.getrandbits(24):06x}"  # unique per run: other test runs may make theirs at once
    prefix = _free_subnet()
    hosts = Hosts(f"{tag}br", f"{prefix}.1", [])
    try:
        _ip("link", "add", hosts.bridge, "type", "bridge")
        _ip("addr", "add", f"{hosts.gateway}/24", "dev", hosts.bridge)
        _ip("link", "set", hosts.bridge, "up")
        for i in range(count):
            host = Host(f"{tag}-h{i}", f"{prefix}.{10 + i}", f"{tag}h{i}", root / f"h{i}" / "home",
                        root / f"h{i}" / "ray")
            host.home.mkdir(parents=True)
            _ip("netns", "add", host.name)
            hosts.hosts.append(host)
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.name)
            _ip("link", "set", host.veth, "master", hosts.bridge, "up")
            _ip("-n", host.name, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            _ip("-n", host.name, "link", "set", "eth0", "up")
            _ip("-n", host.name, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        remove_hosts(hosts)
        stderr = getattr(exc, "stderr", "") or ""
        raise RuntimeError(f"cannot make namespace hosts: {stderr.strip() or exc}") from exc
    return hosts


def remove_hosts(hosts: Hosts) -> None:
    """Kills every process on every host, deletes the namespaces, their links and the bridge."""
    for host in hosts.hosts:
        host.kill_all()
        _ip("link", "del", host.veth, check=False)
        _ip("netns", "del", host.name, check=False)
    _ip("link", "del", hosts.bridge, check=False)
