"""``bargein run``, ``bench``, ``--help`` and the one-line errors of the client commands."""

from __future__ import annotations

import os
import sys
import time

import pexpect
import pytest

from bargein.cli import bench as cli_bench
from bargein.cli.client import _parse_sse_line
from bargein.cli.errors import ClientError
from bargein.cli.requests import format_requests
from tests.cli.test_cli_chat import STOP_TIMEOUT_S
from tests.cli.test_cli_server import bargein, cli
from tests.conftest import REPO

COMMANDS = ("chat", "run", "ps", "cancel", "bench")


@pytest.mark.slow
def test_run_prints_an_answer_locally():
    result = bargein("run", "What is the capital of France?", "--max-tokens", "8", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_run_ctrl_c_prints_what_was_produced_and_exits_130(live_server, check_kv):
    env = {k: v for k, v in os.environ.items() if not k.startswith("BARGEIN_")}
    child = pexpect.spawn(sys.executable, ["-m", "bargein.cli", "run", "Write a very long story about a dragon.",
                                           "--url", live_server.base_url, "--max-tokens", "400", "--temperature", "0"],
                          cwd=str(REPO), env=env, encoding="utf-8", timeout=120)
    try:
        child.expect(r"\w+\W+\w+\W+\w+")
        pressed = time.monotonic()
        child.sendintr()
        child.expect_exact("[stopped]", timeout=STOP_TIMEOUT_S)
        assert time.monotonic() - pressed < STOP_TIMEOUT_S
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close(force=True)
    assert child.exitstatus == 130
    assert "Traceback" not in child.before


def test_every_command_has_help(capsys):
    for name in COMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            cli(capsys, name, "--help")
        assert exit_info.value.code == 0
        assert f"usage: bargein {name}" in capsys.readouterr().out


def test_user_mistakes_are_one_line(capsys, tmp_path):
    status, _, err = cli(capsys, "run", "hi", "--model", str(tmp_path / "missing.gguf"))
    assert status == 2 and err.strip().splitlines()[-1].startswith("bargein: error: ")
    assert "missing.gguf" in err and "Traceback" not in err
    status, _, err = cli(capsys, "chat", "--url", "not-a-url")
    assert status == 1 and err.strip() == "bargein: error: bad URL 'not-a-url': give one like http://127.0.0.1:8000"
    status, _, err = cli(capsys, "run", "hi", "--max-tokens", "0")
    assert status == 2 and "--max-tokens" in err
    with pytest.raises(SystemExit) as exit_info:  # argparse: a usage line and status 2
        cli(capsys, "run", "hi", "--model", "m", "--url", "http://x")
    assert exit_info.value.code == 2


def test_precision_flag_reaches_the_engine_config_and_is_checked(capsys, monkeypatch):
    import bargein

    seen = []

    def fake_from_pretrained(ref, config=None, **kwargs):
        seen.append(config.precision)
        raise FileNotFoundError("no model in this test")

    monkeypatch.setattr(bargein.Engine, "from_pretrained", staticmethod(fake_from_pretrained))
    for precision in ("exact", "fast"):
        status, _, err = cli(capsys, "run", "hi", "--precision", precision)
        assert status == 2 and "no model in this test" in err
    assert seen == ["exact", "fast"]
    for command in (("run", "hi"), ("serve",)):
        with pytest.raises(SystemExit) as exit_info:
            cli(capsys, *command, "--precision", "quick")
        assert exit_info.value.code == 2 and "invalid choice: 'quick'" in capsys.readouterr().err


@pytest.mark.slow
def test_a_missing_model_is_one_line_in_a_real_process(tmp_path):
    result = bargein("chat", "--model", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("bargein: error: ")


def test_bench_without_the_bench_folder_says_so(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli_bench, "bench_dir", lambda: tmp_path / "bench")
    status, _, err = cli(capsys, "bench", "--quick")
    assert status == 1 and "source checkout" in err and len(err.strip().splitlines()) == 1


def test_bench_runs_each_benchmark_main(capsys, monkeypatch, tmp_path):
    for name in ("model", "engine", "startup"):
        (tmp_path / f"bench_{name}.py").write_text(
            "def main(argv):\n"
            f"    print('{name} table', argv)\n"
            "    return {}\n")
    monkeypatch.setattr(cli_bench, "bench_dir", lambda: tmp_path)
    status, out, err = cli(capsys, "bench", "--quick", "--threads", "2")
    assert status == 0, err
    assert "model table ['--quick', '--threads', '2']" in out
    assert "engine table ['--quick', '--threads', '2']" in out
    status, out, _ = cli(capsys, "bench", "--only", "engine")
    assert "engine table []" in out and "model table" not in out


def test_bench_folder_is_found_in_the_source_tree():
    assert (cli_bench.bench_dir() / "bench_model.py").is_file()


def test_ps_table():
    assert format_requests([]) == "no requests in flight"
    table = format_requests([
        {"id": "a", "status": "running", "prompt_tokens": 12, "completion_tokens": 3, "age_s": 1.25,
         "deadline_s": None},
        {"id": "longer-id", "status": "queued", "prompt_tokens": 7, "completion_tokens": 0, "age_s": 125.0,
         "deadline_s": 4.0},
    ]).splitlines()
    assert table[0].split() == ["ID", "STATUS", "PROMPT", "COMPLETION", "AGE", "DEADLINE"]
    assert table[1].split() == ["a", "running", "12", "3", "1.2s", "-"]
    assert table[2].split() == ["longer-id", "queued", "7", "0", "2m05s", "in", "4.0s"]


def test_stream_lines():
    assert _parse_sse_line(": ping", "delta") is None
    assert _parse_sse_line("data: [DONE]", "delta") is None
    event = _parse_sse_line('data: {"choices":[{"delta":{"content":"Hi"},"finish_reason":null}]}', "delta")
    assert (event.delta, event.finish_reason) == ("Hi", None)
    event = _parse_sse_line('data: {"choices":[{"text":"x","finish_reason":"cancelled"}]}', "text")
    assert (event.delta, event.finish_reason) == ("x", "cancelled")
    assert _parse_sse_line('data: {"choices":[],"usage":{"total_tokens":5}}', "delta").usage == {"total_tokens": 5}
    with pytest.raises(ClientError, match="boom"):
        _parse_sse_line('data: {"error":{"message":"boom"}}', "delta")
