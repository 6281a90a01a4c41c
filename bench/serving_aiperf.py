"""AIPerf beside this benchmark's own client, at one light workload, on the same server.

AIPerf is not a dependency of bargein: it is installed into its own virtualenv
(``bench/.aiperf-venv`` by default, made on first use; the registries must be reachable
then). It reads a tokenizer from a local folder written here from the model's own
tokenizer, so nothing is fetched from a hub. Both clients run the same workload (chat,
streaming, input 128 and output 128 tokens with ``ignore_eos``, concurrency 4); the
table shows both clients' numbers side by side and the CPU time each client spent
(AIPerf's: all its processes, from the children's resource usage once it exited).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import format_table, rnd
from serving_client import Target, run_concurrency
from serving_metrics import summarize

AIPERF_VERSION = "0.13.0"  # the version issue 29's first run used
CONCURRENCY, REQUESTS, INPUT, OUTPUT = 4, 16, 128, 128


def ensure_venv(venv: Path) -> Path:
    aiperf = venv / "bin" / "aiperf"
    if not aiperf.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"aiperf=={AIPERF_VERSION}"], check=True)
    return aiperf


def write_tokenizer(tokenizer: Any, folder: Path) -> Path:
    """The model's tokenizer as a Hugging Face folder (tokenizer.json + its config)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
              "eos_token": tokenizer.eos_token, "chat_template": tokenizer.chat_template,
              "model_max_length": 8192}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def run_aiperf(aiperf: Path, port: int, tokenizer_dir: Path, artifacts: Path) -> tuple[dict[str, Any], float]:
    """AIPerf's profile export and the CPU seconds its processes used."""
    command = [str(aiperf), "profile", "--model", "m", "--url", f"http://127.0.0.1:{port}",
               "--endpoint-type", "chat", "--streaming", "--tokenizer", str(tokenizer_dir),
               "--synthetic-input-tokens-mean", str(INPUT), "--synthetic-input-tokens-stddev", "0",
               "--output-tokens-mean", str(OUTPUT), "--output-tokens-stddev", "0",
               "--extra-inputs", "ignore_eos:true", "--concurrency", str(CONCURRENCY),
               "--request-count", str(REQUESTS), "--artifact-dir", str(artifacts), "--ui-type", "none"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Not HF_HUB_OFFLINE: AIPerf's offline mode looks the name up in the hub's cache only;
    # an absolute folder is read in place without the hub either way.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf exited with {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    exports = sorted(artifacts.rglob("profile_export_aiperf.json"))
    if not exports:
        raise RuntimeError(f"aiperf wrote no profile_export_aiperf.json under {artifacts}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(exports[-1].read_text()), cpu


def _metric(export: dict[str, Any], name: str, stat: str) -> float | None:
    found = export.get(name) or (export.get("records") or {}).get(name)
    return None if not isinstance(found, dict) else found.get(stat)


def cross_check(server: Any, bench: Any, venv: Path) -> dict[str, Any]:
    """Both clients against ``server`` at the same workload; a table and the raw numbers."""
    try:
        aiperf = ensure_venv(venv)
    except (OSError, subprocess.CalledProcessError) as exc:
        return {"error": f"AIPerf could not be installed into {venv}: {exc}", "table": str(exc)}
    with tempfile.TemporaryDirectory(prefix="aiperf-") as tmp:
        tokenizer_dir = write_tokenizer(bench.tokenizer, Path(tmp) / "tokenizer")
        prompts = bench.maker.prompts(REQUESTS, INPUT, seed=5)
        ours = summarize(asyncio.run(run_concurrency(Target("127.0.0.1", server.port, "m"), prompts,
                                                     CONCURRENCY, OUTPUT)), bench.slo)
        cpu0 = server.cpu_seconds()
        export, aiperf_cpu = run_aiperf(aiperf, server.port, tokenizer_dir, Path(tmp) / "artifacts")
        server_cpu = server.cpu_seconds() - cpu0
    theirs = {
        "output_tok_s": _metric(export, "output_token_throughput", "avg"),
        "ttft_ms_p50": _metric(export, "time_to_first_token", "p50"),
        "ttft_ms_p99": _metric(export, "time_to_first_token", "p99"),
        "itl_ms_p50": _metric(export, "inter_token_latency", "p50"),
        "itl_ms_p99": _metric(export, "inter_token_latency", "p99"),
        "duration_s": _metric(export, "benchmark_duration", "avg"),
        "client_cpu_s": aiperf_cpu,
        "server_cpu_s": server_cpu,
    }
    rows = [{"client": "this benchmark's", "out tok/s": ours["output_tok_s"], "TTFT p50 ms": ours["ttft_ms"]["p50"],
             "TTFT p99 ms": ours["ttft_ms"]["p99"], "ITL p50 ms": ours["itl_ms"]["p50"],
             "ITL p99 ms": ours["itl_ms"]["p99"], "client CPU s": ours["client_cpu_s"],
             "client CPU share": ours["client_cpu_share"]},
            {"client": f"AIPerf {AIPERF_VERSION}", "out tok/s": theirs["output_tok_s"],
             "TTFT p50 ms": theirs["ttft_ms_p50"], "TTFT p99 ms": theirs["ttft_ms_p99"],
             "ITL p50 ms": theirs["itl_ms_p50"], "ITL p99 ms": theirs["itl_ms_p99"],
             "client CPU s": aiperf_cpu,
             "client CPU share": aiperf_cpu / theirs["duration_s"] if theirs["duration_s"] else None}]
    return {"ours": ours, "aiperf": theirs, "table": format_table(rnd(rows, 2)),
            "workload": {"concurrency": CONCURRENCY, "requests": REQUESTS, "input": INPUT, "output": OUTPUT}}
