"""``bargein bench``: runs bench/bench_model.py, bench_engine.py and bench_startup.py of a source checkout."""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path
from typing import Any

from bargein.cli.common import Command
from bargein.cli.errors import EXIT_USAGE, CliError

BENCHMARKS = ("model", "engine", "startup")


def bench_dir() -> Path:
    """bench/ of the source tree this package runs from (an installed wheel has none)."""
    return Path(__file__).resolve().parents[2] / "bench"


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a smoke run of each benchmark (about a minute each)")
    p.add_argument("--only", choices=BENCHMARKS, action="append", help="run only this benchmark (repeatable)")
    p.add_argument("--model", default=None, metavar="REF", help="model reference (default: the bundled SmolLM2)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="torch intra-op threads")
    p.add_argument("--json-dir", default=None, metavar="DIR", help="also write each result as DIR/bench_NAME.json")


def run_bench(args: argparse.Namespace) -> int:
    """Runs bench/bench_model.py, bench_engine.py and bench_startup.py in turn; each prints its own table."""
    folder = bench_dir()
    names = args.only or list(BENCHMARKS)
    paths = {name: folder / f"bench_{name}.py" for name in names}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise CliError(f"the benchmarks are not here ({', '.join(missing)}); `bargein bench` runs "
                           "from a source checkout of bargein, not from an installed package")
    argv = ["--quick"] if args.quick else []
    if args.model:
        argv += ["--model", args.model]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    for name, path in paths.items():
        extra = ["--json", str(Path(args.json_dir) / f"bench_{name}.json")] if args.json_dir else []
        started = time.perf_counter()
        print(f"bargein bench: {name} ({path})", flush=True)
        try:
            _load_benchmark(name, path).main(argv + extra)
        except SystemExit as exc:  # the benchmark's own argparse refused an argument
            if exc.code not in (0, None):
                raise CliError(f"benchmark {name} refused its arguments", EXIT_USAGE) from None
        print(f"bargein bench: {name} took {time.perf_counter() - started:.0f} s", flush=True)
    return 0


def _load_benchmark(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"bargein_bench_{name}", path)
    if spec is None or spec.loader is None:
        raise CliError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "main", None)):
        raise CliError(f"{path} has no main(argv)")
    return module



COMMAND = Command("run the benchmarks of bench/ and print their tables", add_bench_arguments, run_bench)
