"""Several machines on namespace hosts (issue 28): one process, a pipeline across hosts,
replicas, and decoding with one core taken, side by side with llama.cpp.

The hosts are Linux network namespaces on one bridge (tests/net_hosts.py), joined into
a Ray cluster with ``bargein cluster start`` / ``join`` as the README says. They share
this machine's cores and memory: the numbers show the overheads and the behaviour of
each set-up, not speed-ups. Every bargein figure is measured through the HTTP API
(greedy chat completions of ``--answer`` tokens, ``ignore_eos``) as completion tokens
over wall time, for 1 stream and ``--streams`` concurrent streams:

- ``one process``: ``bargein serve`` on this machine (loopback);
- ``pipeline 2 hosts``: ``--pipeline-stages 2``, served from h0, stages on h1 and h2;
- ``replicas 2 hosts``: ``--replicas 2`` on h1 and h2;
- ``contention`` (issue 28's targets): one stream on one server, quiet and with a
  CPU-bound process pinned to core 1 (``taskset``), alternated ``--rounds`` times on the
  same server, for bargein (target: keep >= 50% of the quiet speed) and for llama.cpp
  (llama-cpp-python, where it is importable; bench_models' decode script, the same
  prompt and thread count); and two bargein servers on this machine, each answering one
  stream alone and then both at once, alternated (target: each keeps >= 40%; the row
  shows the one that kept less). Medians; ``kept`` and ``meets`` are within the run.

Needs root for the hosts (namespaces), not for the contention; prints the tables and
the JSON object.

    python bench/bench_hosts.py [--quick] [--only all|throughput|contention] [--rounds 3]
                                [--streams 32] [--answer 64] [--json PATH]
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import base_parser, emit, format_table, machine_info  # noqa: E402

from tests.net_hosts import Host, make_hosts, remove_hosts, unavailable  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Write a long story about a lighthouse keeper and the sea."


def chat_load(url: str, streams: int, answer: int) -> dict[str, Any]:
    """``streams`` concurrent greedy chats of ``answer`` tokens: completion tokens per second."""
    body = {"model": "m", "max_tokens": answer, "temperature": 0, "ignore_eos": True}

    def one(i: int) -> int:
        messages = [{"role": "user", "content": f"{QUESTION} (number {i})"}]
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "messages": messages}, timeout=900)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    one(-1)  # warm: first-request costs out of the measurement
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(one, range(streams)))
    return {"streams": streams, "tok_s": tokens / (time.perf_counter() - started)}


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited: {log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.25)
    raise RuntimeError(f"serve not ready in {timeout:.0f} s")


def serve_args(model: str | None, port: int, host: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "bargein.cli", "serve", "--host", host, "--port", str(port), "--kv-tokens",
            "16384", *(["--model", model] if model else []), *flags]


def measure_server(argv: list[str], url: str, streams: int, answer: int, run_on: Host | None, log: Path) -> list:
    proc = run_on.popen(argv, log) if run_on else subprocess.Popen(argv, stdout=log.open("wb"),
                                                                   stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_ready(url, proc, log)
        return [chat_load(url, n, answer) for n in sorted({1, streams})]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def core_taken(core: int = 1):
    """A CPU-bound process pinned to ``core`` for the duration."""
    hog = subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield
    finally:
        hog.kill()
        hog.wait()


@contextlib.contextmanager
def running_servers(model: str | None, ports: tuple[int, ...], tmp: Path):
    """``bargein serve`` on each port of this machine (default threads), ready; stopped after."""
    procs = [subprocess.Popen(serve_args(model, port, "127.0.0.1"), stdout=(tmp / f"serve-{port}.log").open("wb"),
                              stderr=subprocess.STDOUT, cwd=ROOT) for port in ports]
    try:
        for port, proc in zip(ports, procs, strict=True):
            wait_ready(f"http://127.0.0.1:{port}", proc, tmp / f"serve-{port}.log")
        yield [f"http://127.0.0.1:{port}" for port in ports]
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)


def llama_one_stream(model: str | None, answer: int, threads: int) -> float:
    from bench_models import _LLAMA, _run, text_ids

    from bargein.loader import resolve_model_ref

    path = str(resolve_model_ref(model).path)
    ids = text_ids(path, 80)
    return _run(_LLAMA, {"model": path, "kind": "decode", "prompts": [ids[16:80]], "warmup": ids[:16],
                         "answer": answer, "kv_tokens": 1024, "threads": threads, "cpu_threads": threads})["tok_s"]


# Issue 28's contention targets: the share of its quiet speed each must keep (same run).
TARGETS = {"core 1 taken": 0.50, "two servers at once": 0.40}


def _row(case: str, side: str, quiet: list[float], busy: list[float], target: float | None) -> dict[str, Any]:
    """Medians over the rounds; ``kept`` = busy / quiet; ``meets`` against the target."""
    q, b = statistics.median(quiet), statistics.median(busy)
    return {"case": case, "side": side, "rounds": len(quiet), "quiet_tok_s": q, "busy_tok_s": b, "kept": b / q,
            "target": target, "meets": None if target is None else b / q >= target}


def contention(model: str | None, answer: int, tmp: Path, rounds: int) -> list[dict[str, Any]]:
    """One stream quiet and with core 1 taken, alternated ``rounds`` times on one server
    (and for llama.cpp, a fresh process each); then two servers, each alone and both at once,
    alternated. Medians; every ratio is within this run."""
    threads = len(os.sched_getaffinity(0))
    case = "core 1 taken"
    with running_servers(model, (18990,), tmp) as (url,):
        quiet, busy = [], []
        for _ in range(rounds):
            quiet.append(chat_load(url, 1, answer)["tok_s"])
            with core_taken():
                busy.append(chat_load(url, 1, answer)["tok_s"])
    rows = [_row(case, "bargein", quiet, busy, TARGETS[case])]
    if importlib.util.find_spec("llama_cpp") is None:
        rows.append({"case": case, "side": "llama.cpp", "note": "llama_cpp not importable"})
    else:
        quiet, busy = [], []
        for _ in range(rounds):
            quiet.append(llama_one_stream(model, answer, threads))
            with core_taken():
                busy.append(llama_one_stream(model, answer, threads))
        rows.append(_row(case, "llama.cpp", quiet, busy, None))
    case = "two servers at once"
    with running_servers(model, (18992, 18993), tmp) as urls, concurrent.futures.ThreadPoolExecutor(2) as pool:
        alone: dict[str, list[float]] = {u: [] for u in urls}
        together: dict[str, list[float]] = {u: [] for u in urls}
        for _ in range(rounds):
            for u in urls:
                alone[u].append(chat_load(u, 1, answer)["tok_s"])
            for u, r in zip(urls, pool.map(lambda u: chat_load(u, 1, answer), urls), strict=True):
                together[u].append(r["tok_s"])
    worst = min(urls, key=lambda u: statistics.median(together[u]) / statistics.median(alone[u]))
    rows.append(_row(case, "bargein (the server that kept less)", alone[worst], together[worst], TARGETS[case]))
    return rows


def on_hosts(model: str | None, streams: int, answer: int, tmp: Path) -> list[dict[str, Any]]:
    hosts = make_hosts(3, tmp / "hosts")
    rows = []
    try:
        env = {"PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
        for host in hosts.hosts:
            host.env = dict(env)
        head = hosts[0]
        address = f"{head.ip}:6379"
        for host, cpus in zip(hosts.hosts, ("0", "2", "2"), strict=True):
            if host is head:
                done = host.bargein("cluster", "start", "--node-ip", host.ip, "--temp-dir", str(host.temp_dir),
                                    "--num-cpus", cpus, "--object-store-memory", "200MiB")
            else:
                token = tmp / "token-copy"
                token.write_text((head.home / ".ray" / "auth_token").read_text())
                done = host.bargein("cluster", "join", address, "--token-file", str(token), "--temp-dir",
                                    str(host.temp_dir), "--num-cpus", cpus, "--object-store-memory", "200MiB")
            if done.returncode:
                raise RuntimeError(f"{host.name}: {done.stderr.strip().splitlines()[-1]}")
        for name, flags in (("pipeline 2 hosts", ("--pipeline-stages", "2")), ("replicas 2 hosts", ("--replicas", "2"))):
            url = f"http://{head.ip}:8000"
            for r in measure_server(serve_args(model, 8000, head.ip, "--ray", address, *flags), url, streams, answer,
                                    head, tmp / f"{name.replace(' ', '-')}.log"):
                rows.append({"set-up": name, **r})
    finally:
        remove_hosts(hosts)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--answer", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="contention: quiet/busy rounds, alternated")
    parser.add_argument("--only", choices=("all", "throughput", "contention"), default="all")
    args = parser.parse_args(argv)
    streams, answer, rounds = (4, 16, 1) if args.quick else (args.streams, args.answer, args.rounds)
    why = unavailable()
    rows: list[dict[str, Any]] = []
    contended: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-hosts-") as name:
        tmp = Path(name)
        if args.only in ("all", "throughput"):
            rows = [{"set-up": "one process", **r} for r in measure_server(
                serve_args(args.model, 18991, "127.0.0.1"), "http://127.0.0.1:18991", streams, answer, None,
                tmp / "one.log")]
            rows += on_hosts(args.model, streams, answer, tmp) if why is None else [{"set-up": "hosts", "note": why}]
        if args.only in ("all", "contention"):
            contended = contention(args.model, answer, tmp, rounds)
    result = {"machine": machine_info(), "answer": answer, "throughput": rows, "contention": contended}
    sections = []
    if rows:
        sections.append(("throughput (completion tokens/s over wall time)", format_table(rows)))
    if contended:
        sections.append(("one stream on a shared CPU: share of quiet speed kept (issue 28 targets)",
                         format_table(contended)))
    emit("bargein on namespace hosts", sections, result, args.json)
    return result


if __name__ == "__main__":
    main()
