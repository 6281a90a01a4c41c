"""CLI start-up benchmark (issue 16): how long the client commands take to start.

``bargein ps``, ``cancel`` and every ``--help`` import no torch and no model code, so they
should answer at once (target: ``bargein ps --help`` under 0.3 s on a 2-core machine).
Each command runs as a fresh ``python -m bargein.cli`` subprocess, as a user's shell
would start it; a bare ``python -c pass`` is timed alongside as the floor. Figures are
medians over repeats, interleaved command by command so that machine load hits all alike.

    python bench/bench_cli.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

# The benchmarks share bench/common.py whether run as scripts or loaded by `bargein bench`.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, format_table, median, percentile  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TARGET_S = 0.3
# A port nothing listens on: `ps` then fails at once with "cannot reach", after its imports.
UNREACHABLE = "http://127.0.0.1:9"
COMMANDS: dict[str, list[str]] = {
    "python -c pass (floor)": ["-c", "pass"],
    "bargein --help": ["-m", "bargein.cli", "--help"],
    "bargein ps --help": ["-m", "bargein.cli", "ps", "--help"],
    "bargein cancel --help": ["-m", "bargein.cli", "cancel", "--help"],
    "bargein chat --help": ["-m", "bargein.cli", "chat", "--help"],
    "bargein ps (server down)": ["-m", "bargein.cli", "ps", "--url", UNREACHABLE],
}


def run_once(args: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("BARGEIN_URL", None)
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--repeats", type=int, default=None, help="runs per command (default: 15, quick: 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON result to PATH")
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 15)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for cmd in COMMANDS.values():  # one untimed warm-up each (file cache, .pyc)
        run_once(cmd)
    for _ in range(repeats):
        for name, cmd in COMMANDS.items():
            times[name].append(run_once(cmd))
    rows = [{"command": name, "median_s": median(t), "p90_s": percentile(t, 90), "min_s": min(t)}
            for name, t in times.items()]
    ps_help = median(times["bargein ps --help"])
    result = {"bench": "cli", "repeats": repeats, "target_s": TARGET_S, "cpus": os.cpu_count(),
              "loadavg_1m": round(os.getloadavg()[0], 2), "ps_help_median_s": ps_help,
              "ps_help_under_target": ps_help < TARGET_S, "rows": rows}
    emit("bargein CLI start-up", [(f"wall seconds per command, {repeats} runs each", format_table(rows))],
         result, args.json)
    return result


if __name__ == "__main__":
    main()
