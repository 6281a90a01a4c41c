"""``kill -9`` while the disk tier's writer is busy, 20 times over one directory, through
real ``bargein serve`` processes (issue 27): never a wrong answer, never a partial block
file kept.

Each round starts a server with the tier, a small KV pool (8 blocks: each chat evicts
the one before, and the writer writes its blocks) and a disk bound of 14 blocks (the
three chats have 18: the tier's LRU deletes some every round, so every round has blocks
to write again and blocks to read back), sends two chats and kills it with SIGKILL, at
random: either within 0.1 s of the second chat's start (the first chat's blocks it evicts
being written), or during the shutdown's flush (SIGTERM, then SIGKILL within 20 ms of the
writer opening its first file). After each kill every block file in the directory must be whole (checksum,
key, tokens chaining to it) and hold one of the chats' blocks; a temporary file the kill
left mid-write is allowed, and must be gone once the next server is up. Every answer a
server gave equals that of a server without the tier, and rounds' first answers (memory
empty) read blocks back from disk; a last, clean server answers every chat the same.

A server start is ~1 s of this test, not ~10: the servers are forked from one process
that imported bargein, torch and the server once (``python -m
tests.server.test_kv_disk_kill``); each child runs the same ``bargein serve`` entry point
(``bargein.cli.entry.main``) as the command line, in a process of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from bargein.cli.threads import settle_waiting
from bargein.distributed.router import block_hashes
from bargein.engine.kv_disk.block_file import (
    SUFFIX,
    TMP_PREFIX,
    BadBlockFile,
    decode,
    header_fingerprint,
    parse_name,
)
from tests import session_files
from tests.conftest import REPO, STARTUP_TIMEOUT_S, free_port
from tests.started import count
from tests.tiny_models import SPECIAL_TOKENS, TinySpec, tiny_tokenizer, tiny_weights, write_gguf

pytestmark = pytest.mark.slow
ROUNDS = 20
BLOCK = 16
CHATS = [f"Chat {i}: the quick brown fox jumps over the lazy dog {i} times, then it rests under a tree "
         f"for {i + 2} hours." for i in range(3)]
NO_CONTROL = {str(tiny_tokenizer().token_to_id(t)): -100 for t in SPECIAL_TOKENS}
TURN = {"temperature": 0, "max_tokens": 16, "ignore_eos": True, "logit_bias": NO_CONTROL, "return_token_ids": True}


class Zygote:
    """A process that imported the server once and forks ``bargein serve`` children."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BARGEIN_")}
        settle_waiting(env)  # the OpenMP wait of bargein's main, which its children would set too late
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.server.test_kv_disk_kill"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        assert self.proc.stdout.readline().strip() == "ready"

    def serve(self, *args: str) -> Child:
        port = free_port()
        fd, log = session_files.log_file("kill-")
        os.close(fd)
        self.proc.stdin.write(json.dumps({"args": ["--port", str(port), *args], "log": str(log)}) + "\n")
        count("bargein servers")
        return Child(int(self.proc.stdout.readline()), port, log)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


class Child:
    def __init__(self, pid: int, port: int, log: Path):
        self.pid, self.base_url, self.log_path = pid, f"http://127.0.0.1:{port}", log

    @property
    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self) -> Child:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.alive, self.log()
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        self.kill_and_wait()
        raise AssertionError(f"not ready:\n{self.log()}")

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def kill_and_wait(self) -> None:
        self.signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while self.alive:  # the zygote ignores SIGCHLD: a dead child is reaped at once
            assert time.monotonic() < deadline
            time.sleep(0.005)


def chat(server: Child, i: int) -> dict:
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": [{"role": "user", "content": CHATS[i]}], **TURN})
    assert r.status_code == 200, r.text
    body = r.json()
    return {**body["choices"][0], "cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def block_keys(tokens: list[int]) -> list[bytes]:
    """The keys the server's pool gives the full blocks of ``tokens`` (the common namespace)."""
    return block_hashes(tokens, BLOCK)


def check_files(kv: Path, known: set[bytes]) -> tuple[int, int]:
    """Every block file is whole and one of the chats' blocks; returns (files, temporary files)."""
    files = tmp = 0
    for path in kv.iterdir():
        if path.name.startswith(TMP_PREFIX):
            tmp += 1
            continue
        parsed = parse_name(path.name)
        if parsed is None:
            continue
        data = path.read_bytes()
        fingerprint = header_fingerprint(data) or b""
        try:
            decode(data, key=parsed[0], fingerprint=fingerprint)
        except BadBlockFile as exc:
            raise AssertionError(f"{path.name} kept after a kill -9: {exc}") from None
        assert parsed[0] in known, f"{path.name} holds no chat's block"
        files += 1
    return files, tmp


@pytest.fixture(scope="module")
def zygote() -> Zygote:
    z = Zygote()
    yield z
    z.close()


def test_kill_9_while_the_writer_is_busy_never_gives_a_wrong_answer_nor_keeps_a_partial_file(
        zygote: Zygote, tmp_path: Path) -> None:
    model = write_gguf(tmp_path / "tiny.gguf", TinySpec(), tiny_weights(TinySpec()))
    base = ("--model", str(model), "--kv-tokens", "128", "--log-level", "warning")
    reference = zygote.serve(*base).wait_ready()
    try:
        expected = [chat(reference, i) for i in range(len(CHATS))]
    finally:
        reference.kill_and_wait()
    known = {k for c in expected for k in block_keys(c["prompt_token_ids"] + c["token_ids"])}
    kv, rng = tmp_path / "kv", random.Random(27)
    bound = 14 * (4096 + 232) + 100  # 14 block files of this model (K/V bytes + header, tokens, checksum)
    with_tier = (*base, "--kv-disk", str(kv), "--kv-disk-size", str(bound))
    answers = mid_flush = left_tmp = from_disk = 0
    previous: Child | None = None
    for _ in range(ROUNDS):
        server = zygote.serve(*with_tier).wait_ready()
        if previous is not None:  # the start removed what the last kill left mid-write
            assert not list(kv.glob(f"{TMP_PREFIX}*.{previous.pid}")), server.log()
        got: list[tuple[int, dict]] = []
        first_done = threading.Event()

        def run_chats(server: Child = server, got: list = got, first_done: threading.Event = first_done) -> None:
            for i in rng.sample(range(len(CHATS)), 2):
                try:
                    got.append((i, chat(server, i)))
                except httpx.HTTPError:
                    return  # killed mid-answer
                finally:
                    first_done.set()

        client = threading.Thread(target=run_chats)
        client.start()
        if rng.random() < 0.5:  # while the second chat evicts the first one's blocks to disk
            assert first_done.wait(60)
            time.sleep(rng.uniform(0.0, 0.1))
        else:  # during the shutdown's flush, as soon as the writer has a file open
            client.join()
            server.signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            writing = False  # no wait past the server's exit: with nothing left to flush it exits at once
            while not (writing := bool(list(kv.glob(f"{TMP_PREFIX}*.{server.pid}")))) and server.alive \
                    and time.monotonic() < deadline:
                time.sleep(0.0005)
            mid_flush += writing
            time.sleep(rng.uniform(0.0, 0.02))
        server.kill_and_wait()
        client.join()
        for i, choice in got:
            assert choice["token_ids"] == expected[i]["token_ids"], (i, server.log())
            assert choice["message"]["content"] == expected[i]["message"]["content"]
        answers += len(got)
        from_disk += bool(got) and got[0][1]["cached_tokens"] >= BLOCK  # memory was empty: these came from disk
        files, tmp = check_files(kv, known)
        assert sum(p.stat().st_size for p in kv.glob(f"*{SUFFIX}")) <= bound
        left_tmp += tmp
        previous = server

    final = zygote.serve(*with_tier).wait_ready()
    try:
        assert not list(kv.glob(f"{TMP_PREFIX}*")), final.log()
        for i in range(len(CHATS)):
            assert chat(final, i)["token_ids"] == expected[i]["token_ids"]
        disk = httpx.get(f"{final.base_url}/v1/cache", timeout=10).json()["kv_disk"]
        assert disk["skipped_files"] == 0 and disk["bytes"] <= bound  # every file a kill left was whole
    finally:
        final.signal(signal.SIGTERM)
        if not _exited(final, 30):
            final.kill_and_wait()
    assert from_disk > 0 and files > 0, "the tier was never read back: the rounds tested nothing"
    print(f"{ROUNDS} kills ({mid_flush} mid-flush, {left_tmp} left a temporary file), {answers} answers checked, "
          f"{from_disk} rounds read from disk")


def _exited(child: Child, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while child.alive and time.monotonic() < deadline:
        time.sleep(0.02)
    return not child.alive


def _zygote() -> None:
    """Imports bargein's server once, then forks one ``bargein serve`` per line of stdin."""
    from importlib import import_module

    from bargein.cli.entry import main

    for name in ("bargein.engine.engine", "bargein.engine.async_engine", "bargein.server.serve", "bargein.server"):
        import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped as they die
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            fd = os.open(job["log"], os.O_WRONLY | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = 1
            try:
                code = main(["serve", *job["args"]])
            finally:
                os._exit(code)
        print(pid, flush=True)


if __name__ == "__main__":
    _zygote()
