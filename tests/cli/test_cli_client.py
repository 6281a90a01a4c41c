"""The client commands (ps, cancel, chat/run --url, --help): no torch, URL forms, key errors, progress."""

from __future__ import annotations

import asyncio
import io
import json
import re
import subprocess
import sys
import uuid

import pytest

from bargein.cli.backends import GenerationSettings, RemoteBackend
from bargein.cli.client import BargeinClient, server_root
from bargein.cli.progress import progress_text, with_progress
from bargein.cli.repl import ChatREPL
from bargein.cli.requests import format_requests
from tests.conftest import GUARDED_KEY
from tests.tiny_engine import prompt, tiny_engine

UNREACHABLE = "http://127.0.0.1:9"  # nothing listens on the discard port
# Runs the CLI in a fresh interpreter and prints, after it, the heavy modules it imported.
PROBE = """
import json, sys
from bargein.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exc:  # --help
    status = exc.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "fastapi")
               or m.startswith(("bargein.engine.engine", "bargein.model", "bargein.loader")))
print("\\nPROBE " + json.dumps({"status": status, "heavy": heavy}))
"""


def probe(*argv: str, stdin: str = "") -> tuple[dict, subprocess.CompletedProcess]:
    result = subprocess.run([sys.executable, "-c", PROBE, *argv], input=stdin, capture_output=True, text=True,
                            timeout=120)
    [line] = [x for x in result.stdout.splitlines() if x.startswith("PROBE ")]
    return json.loads(line[len("PROBE "):]), result


@pytest.mark.parametrize("argv", [
    ("--help",), ("ps", "--help"), ("cancel", "--help"), ("chat", "--help"), ("run", "--help"),
    ("serve", "--help"), ("ps", "--url", UNREACHABLE), ("cancel", "some-id", "--url", UNREACHABLE),
])
def test_client_commands_import_no_torch(argv):
    report, result = probe(*argv)
    assert report["heavy"] == [], report
    if "--help" in argv:
        assert report["status"] == 0
    else:
        assert report["status"] == 1 and "cannot reach a bargein server" in result.stderr


@pytest.mark.slow
def test_chat_and_run_with_url_import_no_torch(live_server):
    base = f"{live_server.base_url}/v1"  # the OpenAI base URL people paste works too
    report, result = probe("run", "Say hi.", "--url", base, "--max-tokens", "4", "--temperature", "0")
    assert (report["status"], report["heavy"]) == (0, []), result.stderr
    assert result.stdout.split("PROBE")[0].strip()
    report, result = probe("chat", "--url", base, "--max-tokens", "4", stdin="Say hi.\n")
    assert (report["status"], report["heavy"]) == (0, []), result.stderr


def test_server_root_accepts_the_openai_base_url():
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/", " http://h:8000/v1// "):
        assert server_root(url) == "http://h:8000"
    assert server_root("http://h/proxy/v1") == "http://h/proxy"
    assert server_root("http://h/v10") == "http://h/v10"
    assert BargeinClient("http://h:8000/v1").base_url == "http://h:8000"


@pytest.mark.slow
def test_key_errors_say_what_is_wrong(guarded_server):
    url = guarded_server.base_url
    report, missing = probe("ps", "--url", url)
    assert report["status"] == 1 and "wants an API key" in missing.stderr
    report, wrong = probe("ps", "--url", f"{url}/v1", "--api-key", "wrong")
    assert report["status"] == 1
    assert "rejected the API key" in wrong.stderr and "wants an API key" not in wrong.stderr
    report, right = probe("ps", "--url", url, "--api-key", GUARDED_KEY)
    assert report["status"] == 0 and "no requests in flight" in right.stdout


def test_ps_shows_how_far_the_prompt_is_read():
    table = format_requests([
        {"id": "a", "status": "running", "prompt_tokens": 2000, "prompt_computed": 512, "completion_tokens": 0,
         "age_s": 3.0, "deadline_s": None},
        {"id": "b", "status": "running", "prompt_tokens": 12, "prompt_computed": 12, "completion_tokens": 5,
         "age_s": 1.0, "deadline_s": None},
    ]).splitlines()
    assert table[1].split()[:4] == ["a", "running", "512/2000", "(25%)"]
    assert table[2].split()[:4] == ["b", "running", "12", "5"]


def test_engine_reports_prompt_progress_per_step():
    from bargein import SamplingParams

    engine = tiny_engine(max_num_batched_tokens=16)
    rid = engine.add_request(prompt(40, 1), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    seen = []
    for _ in range(4):
        engine.step()
        [info] = engine.list_requests()
        seen.append((info.request_id, info.prompt_tokens, info.prompt_computed, info.completion_tokens))
    # 16 prompt tokens a step; the step that reads the last 8 also samples the first token.
    assert seen == [(rid, 40, 16, 0), (rid, 40, 32, 0), (rid, 40, 40, 1), (rid, 40, 40, 2)]


def test_prompt_progress_line_is_drawn_then_erased():
    readings = iter([None, (0, 100), (16, 100), (48, 100), (100, 100)])
    out = io.StringIO()

    async def probe():
        return next(readings, (100, 100))

    async def answer(first_text):
        await asyncio.sleep(0.2)
        first_text()
        return "answer"

    async def main():
        return await with_progress(answer, probe, out, interval_s=0.01, delay_s=0, min_remaining=0)

    assert asyncio.run(main()) == "answer"
    text = out.getvalue()
    drawn = [line for line in text.split("\r") if line.strip()]
    assert [d.strip() for d in drawn] == [progress_text(0, 100), progress_text(16, 100), progress_text(48, 100)]
    assert text.endswith("\r" + " " * len(progress_text(16, 100)) + "\r")  # erased before the answer
    assert progress_text(512, 2000) == "[reading the prompt: 512/2000 tokens (25%)]"


def test_prompt_progress_stays_quiet_for_a_short_read():
    readings = iter([(0, 100), (16, 100), (60, 100)])
    out = io.StringIO()

    async def probe():
        return next(readings, (100, 100))

    async def answer(first_text):
        await asyncio.sleep(0.1)
        first_text()

    asyncio.run(with_progress(answer, probe, out, interval_s=0.01, delay_s=0))  # fewer than 256 tokens left
    assert out.getvalue() == ""


@pytest.mark.slow
def test_chat_shows_prompt_progress_from_the_server(guarded_server):
    client = BargeinClient(guarded_server.base_url, GUARDED_KEY)
    loop = asyncio.new_event_loop()
    out, status = io.StringIO(), io.StringIO()
    try:
        backend = RemoteBackend(client, client.model_name())
        repl = ChatREPL(backend, GenerationSettings(max_tokens=4, temperature=0.0), None, loop, out=out, status=status)
        # A prompt of its own (a fresh first line), so that no earlier test left it in the prefix cache.
        repl.turn(f"Notes {uuid.uuid4().hex}. " + " ".join(f"Note {i}: the sky was grey." for i in range(60)))
    finally:
        loop.close()
    readings = re.findall(r"reading the prompt: (\d+)/(\d+) tokens", status.getvalue())
    assert readings, status.getvalue()
    assert all(0 <= int(done) < int(total) and int(total) > 300 for done, total in readings)
    assert status.getvalue().endswith("\r")  # erased
    assert "reading the prompt" not in out.getvalue()


@pytest.mark.slow
def test_serve_logs_lines_not_progress_bars_when_not_a_terminal(live_server):
    log = live_server.log_path.read_text(errors="replace")  # its stderr is a file, not a terminal
    assert "bargein: loaded SmolLM2-135M-Instruct in " in log
    assert "\r" not in log and "tensor/s" not in log and "Loading" not in log
