"""One model loader, one set of exit statuses: a model that is not there is a usage error
(exit 2) under every command that loads one; a model that is there but does not load is a
failure at run time (exit 1)."""

from __future__ import annotations

import pytest

from bargein.cli import main
from bargein.cli.errors import EXIT_FAILURE, EXIT_USAGE, ClientError, CliError
from bargein.cli.model import model_error
from bargein.loader import CorruptModelError, ModelNotFoundError


@pytest.mark.parametrize("command", [("run", "hi"), ("chat",)])
def test_a_missing_model_exits_2(capsys, tmp_path, command):
    status = main([*command, "--model", str(tmp_path / "missing.gguf")])
    err = capsys.readouterr().err
    assert status == EXIT_USAGE == 2
    assert err.strip().splitlines()[-1].startswith("bargein: error: ") and "missing.gguf" in err


def test_a_corrupt_model_exits_1(capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 60)
    status = main(["run", "hi", "--model", str(bad)])
    assert status == EXIT_FAILURE == 1 and "bad.gguf" in capsys.readouterr().err


def test_the_one_classification():
    assert model_error(ModelNotFoundError("gone")).status == EXIT_USAGE
    assert model_error(FileNotFoundError("gone")).status == EXIT_USAGE
    assert model_error(CorruptModelError("bad")).status == EXIT_FAILURE
    assert isinstance(ClientError("down"), CliError) and ClientError("down").status == EXIT_FAILURE
