"""``bargein serve`` mistakes end with one clear line and a non-zero status (no model load needed)."""

from __future__ import annotations

import socket
import subprocess
import sys


def serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bargein.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str, status: int = 2) -> None:
    """One ``error`` line naming ``needles``; status 1 at run time, 2 for usage (README)."""
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        result = serve("--port", str(s.getsockname()[1]))
    assert_one_line_error(result, "cannot listen on 127.0.0.1", status=1)


def test_bad_size():
    assert_one_line_error(serve("--kv-memory", "lots", "--port", "0"), "not a size")


def test_missing_model():
    assert_one_line_error(serve("--model", "/nonexistent/model.gguf", "--port", "0"), "nonexistent", status=2)


def test_bad_environment_variable():
    import os

    env = {**os.environ, "BARGEIN_MAX_QUEUE": "many"}
    assert_one_line_error(serve(env=env), "BARGEIN_MAX_QUEUE")


def test_serve_help():
    result = serve("--help")
    assert result.returncode == 0 and "--api-key" in result.stdout and "--request-timeout" in result.stdout


def test_corrupt_model_exits_1(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 60)
    assert_one_line_error(serve("--model", str(bad), "--port", "0"), "bad.gguf", status=1)
