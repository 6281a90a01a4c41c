"""Start-up benchmark (issue 11): from launching ``bargein serve`` to the first streamed token.

Each run starts a real server process (``bargein serve --port 0`` on loopback, the bundled
model or ``--model``), waits for its "serving ... at URL" line, sends one streamed chat
request and stops the clock at the first SSE chunk that carries content. The yardstick is
``python -c "import torch"`` on the same machine, run interleaved with the servers, so
that a busy machine slows both alike. Figures are medians over runs. Beside wall time, the
CPU seconds each process used up to that point (user + system, all threads; from
/proc): on a machine other work keeps busy, CPU time is what the start-up itself costs.

    python bench/bench_startup.py [--runs 5] [--quick] [--json PATH] [--model REF]
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, emit, format_table, machine_info, median  # noqa: E402

TARGET_EXTRA_S = 1.0  # issue 11: at most this much more than `import torch`


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


def _serve_command(model: str | None, threads: int | None) -> list[str]:
    script = shutil.which("bargein", path=str(Path(sys.executable).parent))
    command = [script] if script else [sys.executable, "-m", "bargein.cli"]
    command += ["serve", "--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]
    if model:
        command += ["--model", model]
    return command


def time_import_torch() -> tuple[float, float]:
    """Wall seconds of ``python -c "import torch"``, and the CPU seconds it used."""
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", "import os, torch; t = os.times(); print(t.user + t.system)"],
                         check=True, env=_env(), capture_output=True, text=True).stdout
    return time.perf_counter() - started, float(out.strip())


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a live process has used (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_first_token(model: str | None, threads: int | None, timeout: float = 300.0) -> dict[str, float]:
    """Seconds from launch to the serving line, and to the first streamed token."""
    env = _env()
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    started = time.perf_counter()
    server = subprocess.Popen(_serve_command(model, threads), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(server.stderr), daemon=True).start()
    try:
        url = None
        for line in server.stdout:  # "bargein: serving MODEL at http://127.0.0.1:PORT (chat UI at ...)"
            if " at http://" in line:
                url = line.split(" at ", 1)[1].split()[0]
                break
        if url is None:
            raise RuntimeError(f"the server exited before serving: {''.join(stderr[-5:])}")
        serving = time.perf_counter() - started
        host, port = url.removeprefix("http://").rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
        body = json.dumps({"model": "default", "stream": True, "max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": "Say hello."}]})
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"the chat request got {response.status}: {response.read()[:200]!r}")
        first = None
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                first = time.perf_counter() - started
                cpu = _cpu_seconds(server.pid)
                break
        connection.close()
        if first is None:
            raise RuntimeError("the stream ended without a token")
        return {"serving_s": serving, "first_token_s": first, "first_token_cpu_s": cpu}
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=None, help="servers started (default 5; quick 2)")
    args = parser.parse_args(argv)
    runs = args.runs or (2 if args.quick else 5)
    time_first_token(args.model, args.threads)  # a first start builds/caches what later starts reuse
    rows = []
    for i in range(runs):
        torch_s, torch_cpu = time_import_torch()
        got = time_first_token(args.model, args.threads)
        rows.append({"run": i + 1, "import_torch_s": torch_s, **got, "extra_s": got["first_token_s"] - torch_s,
                     "import_torch_cpu_s": torch_cpu, "extra_cpu_s": got["first_token_cpu_s"] - torch_cpu})
        print(f"  run {i + 1}: import torch {torch_s:.2f} s, serving {got['serving_s']:.2f} s, "
              f"first token {got['first_token_s']:.2f} s", flush=True)
    keys = ("import_torch_s", "serving_s", "first_token_s", "import_torch_cpu_s", "first_token_cpu_s")
    summary = {key: median([r[key] for r in rows]) for key in keys}
    summary["extra_s"] = summary["first_token_s"] - summary["import_torch_s"]
    summary["extra_cpu_s"] = summary["first_token_cpu_s"] - summary["import_torch_cpu_s"]
    info = machine_info()
    result = {"benchmark": "startup", "runs": rows, "median": summary, "machine": info,
              "target": {"extra_s": TARGET_EXTRA_S, "met": summary["extra_s"] <= TARGET_EXTRA_S}}
    emit("bargein start-up benchmark",
         [(f"`bargein serve` launch -> first streamed chat token vs `python -c \"import torch\"`, seconds "
           f"(interleaved runs; load average {info.get('loadavg_1m')})", format_table(rows)),
          (f"Medians (target: first_token_s - import_torch_s <= {TARGET_EXTRA_S} s)", format_table([summary]))],
         result, args.json)
    return result


if __name__ == "__main__":
    main()
