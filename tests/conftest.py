"""Shared fixtures: real ``bargein serve`` processes on loopback.

``live_server`` (session-scoped) runs the bundled model with default settings plus the
debug endpoints; the server tests and the web UI tests share it. ``server_factory``
starts servers with other options (an API key, a small queue, a deadline), once per
distinct option set per session, since loading the model takes seconds. Every server
is started with the project's own entry point, forked from a process that imported
bargein once (``tests/forked_servers.py``), or with BARGEIN_TEST_FORK_SERVERS=0 as its own
command, ``python -m bargein.cli serve``. Under pytest-xdist (``make test``) each worker has
its own session, so its own servers, and gets its tests a module at a time
(``tests/workers.py``).

``check_kv`` (used by the server tests after each test) waits until the servers are
idle and asserts the engine's KV block accounting (contract C5) through ``/debug/kv``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bargein.cli.threads import settle_waiting
from tests import forked_servers, native_build, ray_starts, session_files, workers
from tests.started import STARTED, count

# Tests that give a process a home of its own (Ray nodes with their own HOME, namespace
# hosts) would otherwise build the native kernels again in each home, ~25 s of CPU each:
# the session pins the kernel cache where this machine's library already is.
if not (os.environ.get("BARGEIN_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME")):
    os.environ["BARGEIN_CACHE_DIR"] = str(Path.home() / ".cache" / "bargein")

# The OpenMP wait of bargein's own commands (bargein/cli/threads.py), for the models this
# session runs in its own processes, set before anything loads torch (and the runtime with
# it) and inherited by every process it starts. With GNU OpenMP's default, a thread spins
# 300,000 rounds between kernels and holds a core the other worker (or a server) needs:
# three engine test modules took 51.7 s of CPU with the default, 9.7 s with this (same
# loaded machine, the same 38 tests).
settle_waiting()
if "torch" in sys.modules:
    warnings.warn("torch was loaded before tests/conftest.py: GOMP_SPINCOUNT comes too late", stacklevel=1)

# Servers forked from a pre-imported process (tests/forked_servers.py) cost ~0.5 s of CPU
# a start instead of ~2.7 (the suite starts ~40). They were opt-in because
# test_server_hardening's test_a_stream_misses_no_step_while_4mb_inputs_are_refused failed
# 1 run in 4 with them and 0 in 4 without. Run 6 times each, interleaved, on one loaded
# machine (load 22-41): plain processes failed it 2 times (chunks of 9 and 4 tokens),
# forked ones 2 times (7 and 3): the failure comes with load, not with the fork. The one
# difference measured, a forked child's first full collection copying the pages the
# zygote's objects sit on (14k page faults, +20% on that one collection), is taken at
# start instead (tests/forked_servers.py). BARGEIN_TEST_FORK_SERVERS=0 starts plain ones.
FORK_SERVERS = os.environ.get("BARGEIN_TEST_FORK_SERVERS", "1") != "0"
STARTUP_TIMEOUT_S = float(os.environ.get("BARGEIN_TEST_STARTUP_TIMEOUT", "240"))
IDLE_TIMEOUT_S = 60.0
SERVING_LINE = re.compile(r"^bargein: serving .* at http://\S+:(\d+) ", re.MULTILINE)
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """One ``bargein serve`` process; its output goes to ``log_path``. It listens on a port
it picks (``--port 0``, so no two servers of parallel workers can race for one), read
from its serving line by :meth:`wait_ready`."""

    args: tuple[str, ...]
    api_key: str | None = None
    port: int | None = None
    proc: subprocess.Popen | forked_servers.ForkedProcess | None = None
    log_path: Path | None = None

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("the server's port is known once it is ready: call wait_ready() first")
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> ServerProcess:
        fd, self.log_path = session_files.log_file("serve-")
        argv = ["serve", "--port", "0", *self.args]
        if self.api_key:
            argv += ["--api-key", self.api_key]
        env = {k: v for k, v in os.environ.items() if not k.startswith("BARGEIN_")}
        if FORK_SERVERS:
            os.close(fd)
            self.proc = forked_servers.popen(argv, self.log_path, env)
        else:
            command = [sys.executable, "-m", "bargein.cli", *argv]
            self.proc = subprocess.Popen(command, stdout=fd, stderr=subprocess.STDOUT, cwd=REPO, env=env)
            os.close(fd)
        count("bargein servers")
        return self

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(f"bargein serve exited with {self.proc.returncode}:\n{self.log()}")
            if self.port is None and (serving := SERVING_LINE.search(self.log_path.read_text(errors="replace"))):
                self.port = int(serving[1])
            if self.port is None:
                time.sleep(0.05)
                continue
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # a start is seconds; a late poll adds up over the session
        self.stop()
        raise RuntimeError(f"bargein serve did not become ready in {timeout:.0f} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:] if self.log_path else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait_exit(timeout)

    def wait_exit(self, timeout: float = 30.0) -> int | None:
        """Waits for the process to end (a signal was sent), killing it after ``timeout``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def wait_idle(self, timeout: float = IDLE_TIMEOUT_S) -> dict:
        """Waits until nothing runs or waits; returns the last ``/debug/kv`` report."""
        deadline = time.monotonic() + timeout
        while True:
            report = httpx.get(f"{self.base_url}/debug/kv", headers=self.headers, timeout=10).json()
            idle = not (report["running"] or report["waiting"] or report["engine_live_requests"])
            if idle or time.monotonic() > deadline:
                return report
            time.sleep(0.05)


class ServerFactory:
    """Servers by option set, started on first use and stopped at the end of the session."""

    def __init__(self) -> None:
        self.servers: dict[tuple[tuple[str, ...], str | None], ServerProcess] = {}

    def get(self, args: Sequence[str] = (), api_key: str | None = None) -> ServerProcess:
        key = (("--debug-endpoints", *args), api_key)
        server = self.servers.get(key)
        if server is None or not server.running:
            server = ServerProcess(key[0], api_key=api_key).start().wait_ready()
            self.servers[key] = server
        return server

    def running(self) -> list[ServerProcess]:
        return [s for s in self.servers.values() if s.running]

    def stop_all(self) -> None:
        """All at once: a server takes a second or more to drain and exit, and a worker
        ends its session with several."""
        running = self.running()
        for server in running:
            server.proc.send_signal(signal.SIGTERM)
        for server in running:
            server.wait_exit()


@pytest.fixture(scope="session")
def server_factory() -> Iterator[ServerFactory]:
    factory = ServerFactory()
    yield factory
    factory.stop_all()


@pytest.fixture(scope="session")
def live_server(server_factory: ServerFactory) -> ServerProcess:
    """The bundled model with default settings, at ``.base_url`` (``.api_key`` is None)."""
    return server_factory.get()


# A server for the tests of key errors, deadlines and prompt progress (web page and CLI): an
# API key, a 3 s deadline, and prompts read 16 tokens a step so that progress is visible.
GUARDED_ARGS = ("--request-timeout", "3", "--max-num-batched-tokens", "16")
GUARDED_KEY = "web-secret"


@pytest.fixture
def guarded_server(server_factory: ServerFactory) -> ServerProcess:
    return server_factory.get(GUARDED_ARGS, api_key=GUARDED_KEY)


@pytest.fixture
def check_kv(server_factory: ServerFactory) -> Iterator[None]:
    """After the test: every server settles idle and its KV block accounting holds (C5)."""
    yield
    for server in server_factory.running():
        report = server.wait_idle()
        assert report["ok"], f"KV accounting broken on {server.base_url}: {report['error']}"
        assert not (report["running"] or report["waiting"] or report["engine_live_requests"]), report
        assert report["kv_blocks_used"] == 0, f"blocks still referenced with nothing running: {report}"
        assert report["live_requests"] == 0, report


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.02):
    """Polls ``predicate`` until it returns something truthy; returns that, or fails."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def listed_requests(server: ServerProcess) -> dict[str, dict]:
    """``GET /v1/requests`` as {id: entry}."""
    body = httpx.get(f"{server.base_url}/v1/requests", headers=server.headers, timeout=10).json()
    assert body["object"] == "list"
    return {entry["id"]: entry for entry in body["data"]}


def _is_worker(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist worker (the controller and a run without
    xdist are not)."""
    return hasattr(config, "workerinput")


def pytest_sessionstart(session) -> None:
    """The native kernels, built before any test starts a process (a build is ~25 s of CPU
    on a fresh machine): every server, CLI and Ray worker of the session then loads this
    one build instead of compiling its own beside another's. Under xdist the controller
    builds them before it starts the workers (xdist's own hook runs last)."""
    if _is_worker(session.config):
        return
    session_files.directory()  # named before xdist starts the workers, which inherit it
    ray_starts.name_the_lock()
    native_build.build_or_stop()  # under CI=true, a failed or timed-out build stops the run


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _is_worker(config):
        workers.check_groups(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Modules (and groups of modules) as units of work, heaviest first (``tests/workers.py``)."""
    return workers.ModuleScheduling(config, log) if config.getvalue("dist") == "loadgroup" else None


UNIT_CLOCK = workers.UnitClock()  # this worker's seconds per unit of work
WORKER_LINES: list[str] = []  # in the controller: one line per worker, as each ends


def pytest_runtest_logreport(report) -> None:
    UNIT_CLOCK.add(report.nodeid, report.duration)


SESSION_FILES_LINE: list[str] = []  # in the controller: where a failed session's logs are kept


def pytest_sessionfinish(session, exitstatus) -> None:
    if _is_worker(session.config):  # sent to the controller, which sums the workers' counts
        session.config.workeroutput["started"] = dict(STARTED)
        session.config.workeroutput["clock"] = UNIT_CLOCK.output()
    elif (line := session_files.finish(passed=exitstatus == 0)) is not None:
        SESSION_FILES_LINE.append(line)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    output = getattr(node, "workeroutput", {})
    STARTED.update(output.get("started", {}))
    if "clock" in output:
        WORKER_LINES.append(workers.describe_worker(node.gateway.id, output["clock"]))


def pytest_terminal_summary(terminalreporter) -> None:
    """The costly set-ups this run started (``tests/started.py``), in all its workers, and
    each worker's time by unit of work (``tests/workers.py``): the critical path."""
    if STARTED:
        terminalreporter.write_line("started: " + ", ".join(f"{n} {what}" for what, n in sorted(STARTED.items())))
    for line in WORKER_LINES + SESSION_FILES_LINE:
        terminalreporter.write_line(line)


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (``@pytest.mark.anyio``) run on asyncio."""
    return "asyncio"
from tests.ray_cluster import ray_cluster  # noqa: F401,E402  (session fixture: one Ray cluster)
