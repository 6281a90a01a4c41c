"""``bargein serve`` mistakes end with one clear line and a non-zero status (no model load needed).

The busy port runs the real command in a subprocess (the process's own exit status); the
other mistakes run ``bargein.cli.main`` in this process, which is what ``python -m
bargein.cli`` calls: a subprocess costs seconds of imports (torch) each.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bargein.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.fixture
def serve_here(capsys, monkeypatch):
    """``bargein serve ARGS`` in this process, with ``env`` set over os.environ: its exit
    status (argparse's ``SystemExit`` included) and output, as a CompletedProcess."""
    import torch

    from bargein.cli import main

    def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        capsys.readouterr()
        threads = torch.get_num_threads()  # a serve that gets past its arguments sets them
        with monkeypatch.context() as patch:  # the variables are restored as the call returns
            for name, value in (env or {}).items():
                patch.setenv(name, value)
            try:
                status = main(["serve", *args])
            except SystemExit as exit_info:
                status = exit_info.code
            finally:
                torch.set_num_threads(threads)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["bargein", "serve", *args], status, out, err)

    return run


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


def test_bad_size(serve_here):
    assert_one_line_error(serve_here("--kv-memory", "lots", "--port", "0"), "not a size")


def test_missing_model(serve_here):
    assert_one_line_error(serve_here("--model", "/nonexistent/model.gguf", "--port", "0"), "nonexistent", status=2)


def test_bad_environment_variable(serve_here):
    assert_one_line_error(serve_here(env={"BARGEIN_MAX_QUEUE": "many"}), "BARGEIN_MAX_QUEUE")


def test_serve_help(serve_here):
    result = serve_here("--help")
    assert result.returncode == 0 and "--api-key" in result.stdout and "--request-timeout" in result.stdout


def test_corrupt_model_exits_1(tmp_path, serve_here):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 60)
    assert_one_line_error(serve_here("--model", str(bad), "--port", "0"), "bad.gguf", status=1)


def test_kv_disk_flags(tmp_path, serve_here):
    result = serve_here("--help")
    assert "--kv-disk DIR" in result.stdout and "--kv-disk-size SIZE" in result.stdout
    assert_one_line_error(serve_here("--kv-disk-size", "1GiB", "--port", "0"), "--kv-disk DIR")
    assert_one_line_error(serve_here("--kv-disk", str(tmp_path), "--kv-disk-size", "lots", "--port", "0"), "not a size")
    assert_one_line_error(serve_here("--kv-disk", str(tmp_path), env={"BARGEIN_KV_DISK_SIZE": "lots"}),
                          "BARGEIN_KV_DISK_SIZE")
    assert os.listdir(tmp_path) == []  # refused before the tier is opened
    (tmp_path / "a-file").write_text("")
    assert_one_line_error(serve_here("--kv-disk", str(tmp_path / "a-file" / "kv"), "--port", "0"),
                          "--kv-disk", "a-file/kv", "Not a directory")


def test_kv_disk_for_pipeline_stages_is_made_by_the_stages(tmp_path, capsys):
    from argparse import Namespace

    from bargein.cli.serve import _kv_disk

    args = Namespace(kv_disk=str(tmp_path / "kv"), kv_disk_size="1GiB", kv_disk_size_default="20GiB", replicas=None)
    expected = {"kv_disk_dir": str(tmp_path / "kv"), "kv_disk_bytes": 1 << 30}
    assert _kv_disk(args, pipeline=True) == expected and not (tmp_path / "kv").exists()  # stages make DIR/stage-A-B
    assert _kv_disk(args, pipeline=False) == expected and (tmp_path / "kv").is_dir()
    assert capsys.readouterr().err == ""
