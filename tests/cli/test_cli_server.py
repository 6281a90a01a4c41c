"""``bargein ps``, ``cancel``, ``run --url`` and ``chat --url`` against a real server.

The server is the shared ``live_server``; a long request is a streamed chat completion in
a background thread with an id we chose. ``ps`` and ``cancel`` run in-process through
``bargein.cli.main`` (a subprocess costs seconds of imports each); ``run``, ``chat`` and
the error cases run the real command in a subprocess or a pseudo-terminal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import httpx
import pexpect
import pytest

from tests.cli.test_cli_chat import send_and_stop, spawn_cli, stats
from tests.conftest import REPO, listed_requests, wait_until

pytestmark = pytest.mark.slow
CLI_TIMEOUT_S = 120


def bargein(*args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BARGEIN_")}
    return subprocess.run([sys.executable, "-m", "bargein.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """``bargein ARGS`` in this process: (exit status, stdout, stderr)."""
    from bargein.cli import main

    capsys.readouterr()
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


@dataclass
class LongRequest:
    """A streamed chat completion that runs until cancelled, read in a thread."""

    base_url: str
    request_id: str
    finish_reason: str | None = None
    text: list[str] = field(default_factory=list)
    thread: threading.Thread | None = None

    def start(self) -> LongRequest:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        body = {"messages": [{"role": "user", "content": "Count to a million."}], "stream": True,
                "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", f"{self.base_url}/v1/chat/completions", json=body, timeout=120,
                          headers={"X-Request-Id": self.request_id}) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    self.text.append(choice.get("delta", {}).get("content") or "")
                    self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def join(self, timeout: float = 30) -> str | None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.request_id} still streams"
        return self.finish_reason


def start_long(server, request_id: str) -> LongRequest:
    request = LongRequest(server.base_url, request_id).start()
    wait_until(lambda: request_id in listed_requests(server))
    return request


def test_ps_lists_and_cancel_stops_a_request(live_server, check_kv, capsys):
    url = live_server.base_url
    request = start_long(live_server, "cli-ps-1")
    status, out, err = cli(capsys, "ps", "--url", url)
    assert status == 0, err
    header, *rows = out.splitlines()
    assert header.split() == ["ID", "STATUS", "PROMPT", "COMPLETION", "AGE", "DEADLINE"]
    row = next(r.split() for r in rows if r.startswith("cli-ps-1 "))
    assert row[1] in ("queued", "running") and int(row[2]) > 0 and row[5] == "-"

    status, out, err = cli(capsys, "cancel", "cli-ps-1", "--url", url)
    assert status == 0, err
    assert "cli-ps-1: cancelled" in out
    assert request.join() == "cancelled"
    assert "cli-ps-1" not in cli(capsys, "ps", "--url", url)[1]


def test_cancel_unknown_id_exits_1_naming_it(live_server, capsys):
    status, out, err = cli(capsys, "cancel", "no-such-request", "--url", live_server.base_url)
    assert status == 1
    assert err.strip() == "bargein: error: no request with id 'no-such-request' on the server"


def test_cancel_all(live_server, check_kv, capsys):
    requests = [start_long(live_server, f"cli-all-{i}") for i in range(2)]
    status, out, err = cli(capsys, "cancel", "--all", "--url", live_server.base_url)
    assert status == 0, err
    assert "cli-all-0" in out and "cli-all-1" in out
    assert [r.join() for r in requests] == ["cancelled", "cancelled"]
    assert cli(capsys, "ps", "--url", live_server.base_url)[1].strip() == "no requests in flight"


def test_cancel_needs_ids_or_all(capsys):
    assert cli(capsys, "cancel")[0] == 2
    assert cli(capsys, "cancel", "x", "--all")[0] == 2


def test_run_against_the_server(live_server, check_kv):
    result = bargein("run", "What is the capital of France?", "--url", live_server.base_url,
                     "--max-tokens", "8", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    raw = bargein("run", "The capital of France is", "--raw", "--url", live_server.base_url, "--max-tokens", "4")
    assert raw.returncode == 0, raw.stderr
    assert raw.stdout.strip()


def test_chat_against_the_server_stops_and_continues(live_server, check_kv):
    child = spawn_cli("chat", "--url", live_server.base_url, "--temperature", "0", "--max-tokens", "400")
    try:
        send_and_stop(child, "Write a very long story about a dragon.", min_words=6)
        wait_until(lambda: not listed_requests(live_server))  # the server stopped it too
        first = stats(child)
        assert first["finish"] == "cancelled" and first["messages"] == 2

        send_and_stop(child, "Give the story a title.", min_words=1)
        second = stats(child)
        assert second["messages"] == 4 and second["cached"] > 0  # the server's prefix cache

        child.sendintr()  # Ctrl-C at the prompt quits cleanly
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    assert "Traceback" not in child.before


def test_server_errors_are_one_line(live_server):
    down = bargein("ps", "--url", "http://127.0.0.1:9")
    assert down.returncode == 1
    assert down.stderr.startswith("bargein: error: cannot reach") and len(down.stderr.strip().splitlines()) == 1
    run_down = bargein("run", "hi", "--url", "http://127.0.0.1:9")
    assert run_down.returncode == 1 and len(run_down.stderr.strip().splitlines()) == 1
    bad = bargein("run", "hi", "--url", live_server.base_url, "--temperature", "9")
    assert bad.returncode == 2 and "--temperature" in bad.stderr and "Traceback" not in bad.stderr
