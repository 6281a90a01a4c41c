"""The two servers of the serving benchmark, started the same way: one process on
loopback, the same GGUF file, the same context per sequence and the same threads.

``bargein serve`` runs from this checkout's interpreter; ``llama-server`` from a build of
``../shared/tools/build_llamacpp_all.sh`` (``--llama-server`` or ``$LLAMA_SERVER``), with
as many slots as the highest concurrency, its prompt cache on (its default) and a
unified KV pool of the same total size. ``cpu_seconds`` reads the process's CPU time
from /proc, so each workload reports what the server spent beside the load generator.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    command: list[str]
    ready_path: str
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    busy_gauges: tuple[str, ...] = ()  # /metrics gauges whose sum is the requests it still works on

    def start(self, timeout_s: float = 300.0) -> Server:
        fd, name = tempfile.mkstemp(prefix=f"serving-{self.name}-", suffix=".log")
        self.log_path = Path(name)
        command = [c.replace("{port}", str(self.port)) for c in self.command]
        self.proc = subprocess.Popen(command, stdout=fd, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, **self.env})
        os.close(fd)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{self.ready_path}", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{self.name} was not ready within {timeout_s:.0f} s:\n{self.log()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process (all its threads) so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            return r.read().decode()

    def busy(self) -> float:
        """Requests queued or running now, by the server's own gauges."""
        text = self.metrics_text()
        return sum(float(value) for name in self.busy_gauges
                   for value in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    def wait_idle(self, timeout_s: float = 60.0, poll_s: float = 0.1) -> float:
        """Seconds until the server works on no request (it may still finish requests whose
        client has gone); ``timeout_s`` at most: the caller reports what it got."""
        started = time.monotonic()
        while self.busy() > 0 and time.monotonic() - started < timeout_s:
            time.sleep(poll_s)
        return time.monotonic() - started


def bargein_server(model: Path, threads: int, context: int, max_seqs: int, extra: list[str]) -> Server:
    return Server("bargein", [sys.executable, "-m", "bargein.cli", "serve", "--model", str(model),
                              "--port", "{port}", "--threads", str(threads), "--max-model-len", str(context),
                              "--max-num-seqs", str(max_seqs), "--log-level", "warning", *extra],
                  "/health", env={"PYTHONPATH": str(REPO)},
                  busy_gauges=("bargein_requests_waiting", "bargein_requests_running"))


def find_llama_server(explicit: str | None) -> str | None:
    for candidate in (explicit, os.environ.get("LLAMA_SERVER"), shutil.which("llama-server"),
                      str(REPO.parent / "llamacpp" / "build" / "bin" / "llama-server")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def llama_server(binary: str, model: Path, threads: int, context: int, slots: int) -> Server:
    lib = str(Path(binary).resolve().parent)
    env = {"LD_LIBRARY_PATH": lib + (":" + os.environ["LD_LIBRARY_PATH"] if os.environ.get("LD_LIBRARY_PATH") else "")}
    return Server("llama-server", [binary, "-m", str(model), "--port", "{port}", "--host", "127.0.0.1",
                                   "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                                   "-c", str(context * slots), "--kv-unified", "--no-webui",
                                   "--metrics"], "/health", env=env,
                  busy_gauges=("llamacpp:requests_processing", "llamacpp:requests_deferred"))
