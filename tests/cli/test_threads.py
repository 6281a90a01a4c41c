"""``--threads`` and the OpenMP wait policy (bargein.cli.threads), without loading a model."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

from bargein.cli import main
from bargein.cli.threads import SPIN_COUNT, apply_threads, available_cpus, settle_waiting


def test_the_short_spin_is_set_unless_a_wait_policy_is_given() -> None:
    env: dict[str, str] = {}
    settle_waiting(env)
    assert env == {"GOMP_SPINCOUNT": SPIN_COUNT}
    for given in ({"GOMP_SPINCOUNT": "5"}, {"OMP_WAIT_POLICY": "active"}):
        env = dict(given)
        settle_waiting(env)
        assert env == given


def test_the_cli_sets_the_spin_before_torch_loads() -> None:
    code = ("import os, sys; os.environ.pop('GOMP_SPINCOUNT', None); os.environ.pop('OMP_WAIT_POLICY', None)\n"
            "from bargein.cli import main\n"
            "try:\n    main(['run', '--threads', '0', 'x'])\nexcept SystemExit: pass\n"
            "print(os.environ['GOMP_SPINCOUNT'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.split()
    assert out == [SPIN_COUNT, "False"]  # set, and --threads 0 was refused before torch was imported


def test_threads_are_applied_and_stated(capsys) -> None:
    before = torch.get_num_threads()
    try:
        assert apply_threads(argparse.Namespace(threads=1)) == 1 and torch.get_num_threads() == 1
        assert capsys.readouterr().err == f"bargein: 1 compute threads (--threads; {available_cpus()} CPUs here)\n"
        assert apply_threads(argparse.Namespace(threads=None)) == available_cpus()
        assert "default: the CPUs this process may use" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("command", [["run", "hi"], ["chat"], ["serve", "--port", "0"]])
def test_threads_below_one_are_refused_with_exit_2(command, capsys) -> None:
    assert main([*command, "--threads", "0"]) == 2
    assert capsys.readouterr().err.strip().endswith("--threads must be at least 1, got 0")
