"""A mixture-of-experts GGUF side by side with llama.cpp, and against a dense file of the same
active size (issue 26): load, memory, 1- and 32-stream decode, prefill.

Each file runs through ``bench/bench_models.py``'s measurements (one fresh process per side
and measurement, the same prompts and KV capacity for both sides; see there). Besides its
table this prints the issue's targets, each with the measured value:

- MoE, bargein / llama.cpp: 1 stream >= 1.0x, 32 streams >= 2x, peak RSS above the
  import floor <= 1.2x;
- MoE / dense of the same active bytes, bargein, 1 stream: >= 0.7.

    python bench/make_moe_gguf.py --out /tmp/moe
    python bench/bench_moe.py /tmp/moe/qwen3moe-2b.Q4_K_M.gguf /tmp/moe/qwen3-dense-2b.Q4_K_M.gguf [--precision fast]

``--quick``: 4 streams of 8 tokens, one load, a 128-token prefill (a smoke run).

``--rounds N``: only the ``--streams`` decode of the MoE file, bargein and llama.cpp in
turn (which goes first alternates), N rounds: each round's ratio and their median, so that
a change is judged against llama.cpp measured in the same minutes (the dense file is not
run). On a loaded machine the median of several rounds moves far less than one run. With
``--streams 1`` the rounds are the one-stream target's (the same plan as the full run's).

    python bench/bench_moe.py MOE.gguf DENSE.gguf --rounds 7 --streams 1
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import statistics  # noqa: E402

from bench_models import (  # noqa: E402
    _BARGEIN,
    _LLAMA,
    COLUMNS,
    LOAD_PROMPT,
    STREAM_PROMPT,
    _run,
    _torch_threads,
    bench_file,
    measurements,
    text_ids,
)
from common import base_parser, emit, format_table, machine_info  # noqa: E402


def _row(rows: list[dict[str, Any]], file: str, side: str) -> dict[str, Any]:
    return next((r for r in rows if r["file"] == Path(file).name and r["side"] == side and "skipped" not in r), {})


def targets(rows: list[dict[str, Any]], moe: str, dense: str, streams: int) -> list[dict[str, Any]]:
    """The issue's targets with the measured values (None where a side did not run)."""
    ratio, ours, dense_ours = _row(rows, moe, "bargein / llama.cpp"), _row(rows, moe, "bargein"), \
        _row(rows, dense, "bargein")
    moe_vs_dense = (ours["1_stream_tok_s"] / dense_ours["1_stream_tok_s"]
                    if ours.get("1_stream_tok_s") and dense_ours.get("1_stream_tok_s") else None)
    checks = [("1 stream, bargein / llama.cpp", ratio.get("1_stream_tok_s"), ">=", 1.0),
              (f"{streams} streams, bargein / llama.cpp", ratio.get(f"{streams}_stream_tok_s"), ">=", 2.0),
              ("peak RSS above floor, bargein / llama.cpp", ratio.get("peak_above_floor_mb"), "<=", 1.2),
              ("1 stream, MoE / dense of its active size (bargein)", moe_vs_dense, ">=", 0.7)]
    return [{"target": name, "measured": value, "goal": f"{op} {goal}",
             "met": None if value is None else (value >= goal if op == ">=" else value <= goal)}
            for name, value, op, goal in checks]


def stream_rounds(path: str, precision: str, threads: int | None, streams: int, answer: int,
                  rounds: int) -> list[dict[str, Any]]:
    """The ``streams``-stream decode of ``path``, bargein and llama.cpp in turn, ``rounds``
    times (one fresh process per side and round, as bench_models measures it)."""
    Path(path).read_bytes()  # the page cache warm for both sides
    ids = text_ids(path, LOAD_PROMPT + STREAM_PROMPT * 2 + 7 * streams)
    plan = measurements(ids, streams, answer, ())[f"{streams}_stream"]
    common = {"model": path, "threads": threads, "precision": precision, "bench": str(Path(__file__).parent),
              "cpu_threads": _torch_threads()}
    rows = []
    for r in range(rounds):
        sides = [("bargein", _BARGEIN), ("llama.cpp", _LLAMA)]
        got = {side: _run(script, {**common, **plan})["tok_s"] for side, script in (sides if r % 2 == 0 else sides[::-1])}
        rows.append({"round": r + 1, "bargein_tok_s": got["bargein"], "llama_cpp_tok_s": got["llama.cpp"],
                     "ratio": got["bargein"] / got["llama.cpp"]})
    rows.append({"round": "median", **{key: statistics.median(row[key] for row in rows)
                                      for key in ("bargein_tok_s", "llama_cpp_tok_s", "ratio")}})
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("moe", help="the MoE GGUF (bench/make_moe_gguf.py)")
    parser.add_argument("dense", help="the dense GGUF of the same active size")
    parser.add_argument("--precision", choices=("fast", "exact"), default="fast")
    parser.add_argument("--load-repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--answer", type=int, default=32, help="tokens per stream (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=0,
                        help="only the --streams decode of the MoE file, both sides in turn, this many rounds")
    args = parser.parse_args(argv)
    llama = importlib.util.find_spec("llama_cpp") is not None
    if not llama:
        print("llama_cpp (llama-cpp-python) is not importable here: bargein's side only", file=sys.stderr)
    if args.rounds:
        if not llama:
            parser.error("--rounds compares with llama.cpp: llama_cpp is not importable here")
        rounds = stream_rounds(args.moe, args.precision, args.threads, args.streams, args.answer, args.rounds)
        result = {"benchmark": "moe_stream_rounds", "streams": args.streams, "precision": args.precision,
                  "machine": machine_info(), "rounds": rounds}
        emit(f"The MoE file's {args.streams}-stream decode, bargein and llama.cpp in turn",
             [("tok/s per round", format_table(rounds, ["round", "bargein_tok_s", "llama_cpp_tok_s", "ratio"]))],
             result, args.json)
        return result
    prefills = (128,) if args.quick else (512,)
    streams, answer = (4, 8) if args.quick else (args.streams, args.answer)
    rows: list[dict[str, Any]] = []
    for path in (args.moe, args.dense):
        rows += bench_file(path, args.precision, threads=args.threads, load_repeats=1 if args.quick else
                           args.load_repeats, streams=streams, answer=answer, prefills=prefills,
                           llama=llama and path == args.moe)
    checks = targets(rows, args.moe, args.dense, streams)
    result = {"benchmark": "moe", "precision": args.precision, "machine": machine_info(), "rows": rows,
              "targets": checks, "llama_cpp": llama}
    columns = ["family"] + [c for c in COLUMNS if any(c in r for r in rows)] + [
        c for c in sorted({k for r in rows for k in r}) if c not in COLUMNS and c.endswith("_tok_s")]
    emit("An MoE GGUF: bargein and llama.cpp, and a dense file of its active size",
         [("one process per side per measurement", format_table(rows, columns)),
          ("the issue's targets", format_table(checks, ["target", "measured", "goal", "met"]))], result, args.json)
    return result


if __name__ == "__main__":
    main()
