"""How the compute threads wait, probed (issue 29): one stream's inter-token latency, alone
and beside a busy loop, interleaved in one run.

Between two kernels a compute thread either spins (the next kernel starts at once, but
the core stays taken) or sleeps (the core is free, but waking costs tens of microseconds,
hundreds of times a step). bargein's kernel pool spins while spinning pays and stops when
it sees itself descheduled (``bargein/kernels/parallel.c``). This measures it against
fixed policies: each *variant* is a source tree and an environment (by default this tree,
and, with ``--baseline DIR``, an older tree whose kernels ran on OpenMP's threads, with
``GOMP_SPINCOUNT=100``, bargein's former setting, and ``10000``, a spinning one); each
*condition* is the machine alone or with ``--busy N`` busy-loop processes beside it. Each
measurement is a fresh process (a wait policy is fixed at start) that loads the model,
warms up and decodes ``--tokens`` tokens of one greedy stream ``--repeats`` times: the
median time between two tokens. Variants and conditions run interleaved round by round,
so a shared machine's swings land on all alike; each figure is the median over rounds.

    .venv/bin/python bench/bench_thread_wait.py --baseline /tmp/bargein-before   # a worktree of the older commit
    .venv/bin/python bench/bench_thread_wait.py --threads 2 --busy 1 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, emit, format_table, machine_info, median, token_gaps  # noqa: E402

HERE = Path(__file__).resolve().parent.parent


def child(threads: int, tokens: int, repeats: int, model: str | None) -> dict:
    """In the measuring process: one stream's median inter-token time, ``repeats`` times."""
    import torch

    torch.set_num_threads(threads)
    from bargein import Engine, SamplingParams
    from bargein.engine.outputs import OutputCollector

    engine = Engine.from_pretrained(model, progress=False)
    engine.generate([[1000 + i for i in range(64)]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    itl = []
    for r in range(repeats):
        collector = OutputCollector(engine)
        collector.add_request([2000 + 3 * i + r for i in range(128)],
                              SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        gaps = token_gaps(collector)
        itl.append(statistics.median(gaps) * 1000)
    return {"itl_ms": statistics.median(itl), "itl_runs_ms": itl}


def _busy_loop() -> None:
    while True:
        pass


def measure(tree: Path, env: dict[str, str], args) -> dict:
    full = {**os.environ, **env, "PYTHONPATH": str(tree)}
    threads = env.get("BENCH_THREADS", str(args.threads))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--threads", threads,
           "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
    if args.model:
        cmd += ["--model", args.model]
    out = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=600, cwd=str(tree))
    if out.returncode != 0:
        raise RuntimeError(f"{tree} {env}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--baseline", type=Path, default=None,
                   help="an older source tree to compare with (OpenMP's threads, GOMP_SPINCOUNT 100 and 10000)")
    p.add_argument("--busy", type=int, default=1, help="busy-loop processes in the busy condition (default: 1)")
    p.add_argument("--tokens", type=int, default=64, help="tokens a stream decodes (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="streams per measurement (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--one-thread", action="store_true",
                   help="also this tree with one thread (nothing to wait for: the floor a policy is judged by)")
    p.add_argument("--first-claim", action="store_true",
                   help="(root, Linux) run in a session of its own whose CPU weight is the highest (autogroup "
                        "nice -20), so that on a shared machine 'alone' comes near a quiet one and the busy "
                        "loops, in the same session, are what contends")
    args = p.parse_args(argv)
    args.threads = args.threads or 2
    if args.child:
        print(json.dumps(child(args.threads, args.tokens, args.repeats, args.model)))
        return {}
    if args.quick:
        args.rounds, args.repeats, args.tokens = 1, 1, 32
    if args.first_claim:
        with contextlib.suppress(OSError):  # a process group leader already: its session's group is raised
            os.setsid()
        Path("/proc/self/autogroup").write_text("-20")
    variants = {"adaptive (this tree)": (HERE, {"GOMP_SPINCOUNT": "100"})}
    if args.one_thread:
        variants["this tree, 1 thread"] = (HERE, {"GOMP_SPINCOUNT": "100", "BENCH_THREADS": "1"})
    if args.baseline is not None:
        base = args.baseline.resolve()
        variants["baseline, GOMP_SPINCOUNT=100"] = (base, {"GOMP_SPINCOUNT": "100"})
        variants["baseline, GOMP_SPINCOUNT=10000"] = (base, {"GOMP_SPINCOUNT": "10000"})
    conditions = {"alone": 0, f"{args.busy} busy loop(s)": args.busy}
    runs: dict[tuple[str, str], list[float]] = {(v, c): [] for v in variants for c in conditions}
    for _ in range(args.rounds):
        for cname, nbusy in conditions.items():
            busy = [multiprocessing.Process(target=_busy_loop, daemon=True) for _ in range(nbusy)]
            for proc in busy:
                proc.start()
            try:
                for vname, (tree, env) in variants.items():
                    runs[(vname, cname)].append(measure(tree, env, args)["itl_ms"])
            finally:
                for proc in busy:
                    proc.terminate()
                    proc.join()
    rows = [{"variant": v, **{c: median(runs[(v, c)]) for c in conditions}} for v in variants]
    result = {"settings": {k: str(v) for k, v in vars(args).items() if k != "json"},
              "itl_ms": rows, "runs": {f"{v} | {c}": r for (v, c), r in runs.items()}, "machine": machine_info()}
    emit(f"one stream's inter-token latency (ms, median over rounds), {args.threads} threads",
         [("per variant and condition", format_table(rows, ["variant", *conditions]))], result, args.json)
    return result


if __name__ == "__main__":
    main()
