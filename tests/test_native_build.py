"""Under CI=true a failed or timed-out kernel build stops the session (tests/native_build.py)."""

from __future__ import annotations

import subprocess

import pytest

from bargein.kernels import native
from tests import native_build


def refuse(exc: Exception):
    def build_library(compiler, target_dir):
        raise exc
    return build_library


@pytest.mark.parametrize("exc, says", [
    (subprocess.TimeoutExpired(["cc", "-c", "gguf_matmul.c"], 300), "ran past its 300 s limit (cc -c gguf_matmul.c)"),
    (subprocess.CalledProcessError(1, ["cc"], stderr="error: no such flag"), "did not build:\nerror: no such flag"),
])
def test_a_failed_build_stops_a_ci_run(monkeypatch, exc, says):
    monkeypatch.setenv("CI", "true")
    monkeypatch.delenv("BARGEIN_NATIVE_KERNELS", raising=False)
    monkeypatch.setattr(native, "_compiler", lambda: "cc")
    monkeypatch.setattr(native, "build_library", refuse(exc))
    with pytest.raises(pytest.exit.Exception, match="^CI=true: ") as stopped:
        native_build.build_or_stop()
    assert says in str(stopped.value)
    assert stopped.value.returncode == 3


@pytest.mark.parametrize("env", [{"CI": ""}, {"CI": "true", "BARGEIN_NATIVE_KERNELS": "0"}])
def test_outside_ci_or_with_the_kernels_off_nothing_is_required(monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(native, "_compiler", lambda: "cc")
    assert not native_build.required()
