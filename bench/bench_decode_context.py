"""What one stream's decode costs as its context grows, in this process (issue 29: the
one-stream ITL at input 512 against 128).

Per context (prompt lengths ``--contexts``), rounds interleaved so that a shared machine's
swings land on every context alike: one greedy stream decodes ``--tokens`` tokens; the
median time between two tokens (``ms/token``) and, of it, the median time of the model's
forward (``forward ms``); the rest of the step (``other ms``: schedule, sample, outputs)
should not grow with the context. Beside it, the float16 attention kernel alone on the
model's shapes at the same context, one query (a decode), ``--threads`` threads: the
fastest of ``--repeats`` calls over one layer's scattered blocks (``attention us/layer``),
and that times the number of layers.

    .venv/bin/python bench/bench_decode_context.py --threads 2
    .venv/bin/python bench/bench_decode_context.py --quick
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import apply_threads, base_parser, emit, format_table, machine_info, rnd, token_gaps  # noqa: E402


def parse_args():
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--contexts", default="128,512,2048", help="prompt lengths in tokens")
    p.add_argument("--tokens", type=int, default=48, help="tokens decoded per stream")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=200, help="kernel calls per context and round")
    args = p.parse_args()
    if args.quick:
        args.contexts, args.tokens, args.rounds, args.repeats = "128,512", 16, 1, 20
    return args


def decode_gaps(engine, context: int, tokens: int, salt: int, forwards: list[float]) -> tuple[float, float]:
    """One greedy stream of ``context`` prompt tokens: median ms between tokens and of the forward."""
    from bargein import SamplingParams
    from bargein.engine.outputs import OutputCollector

    collector = OutputCollector(engine)
    collector.add_request([1000 + (7 * i + salt) % 20000 for i in range(context)],
                          SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    start = len(forwards)
    gaps = token_gaps(collector)
    decode_forwards = forwards[start + 2:]  # past the prompt's steps and the first token's
    return 1000 * statistics.median(gaps), 1000 * statistics.median(decode_forwards or [float("nan")])


def attention_us(kernels, config, context: int, threads: int, repeats: int, block_size: int = 16) -> float:
    """The fastest one-query call over ``context`` keys in scattered blocks, in microseconds."""
    import torch

    g = torch.Generator().manual_seed(context)
    blocks = -(-context // block_size)
    pool = max(4 * blocks, 256)  # a pool several times the sequence: its blocks are scattered
    shape = (pool, block_size, config.num_kv_heads, config.head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half()
    table = torch.randperm(pool, generator=g)[:blocks].reshape(1, blocks)
    q = torch.randn(1, config.num_heads, config.head_dim, generator=g)
    seq, ctx = torch.zeros(1, dtype=torch.int64), torch.tensor([context])
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        kernels.paged_attention_f16(q, k_cache, v_cache, table, seq, ctx, config.scale, threads)
        best = min(best, time.perf_counter() - t0)
    return 1e6 * best


def main() -> None:
    args = parse_args()
    apply_threads(args.threads)
    import torch

    from bargein import Engine
    from bargein.kernels.native import load_native_kernels

    engine = Engine.from_pretrained(args.model, progress=False)
    forwards: list[float] = []
    execute = engine.runner.execute

    def timed_execute(plan):
        t0 = time.perf_counter()
        try:
            return execute(plan)
        finally:
            forwards.append(time.perf_counter() - t0)

    engine.runner.execute = timed_execute
    decode_gaps(engine, 64, 8, 0, forwards)  # warm-up
    kernels, config, threads = load_native_kernels(), engine.model_config, torch.get_num_threads()
    contexts = [int(c) for c in args.contexts.split(",") if c]
    runs: dict[int, list[tuple[float, float, float]]] = {c: [] for c in contexts}
    for r in range(args.rounds):
        for c in contexts:
            gap, forward = decode_gaps(engine, c, args.tokens, r, forwards)
            attn = attention_us(kernels, config, c, threads, args.repeats) if kernels else float("nan")
            runs[c].append((gap, forward, attn))
    rows = []
    for c in contexts:
        gap, forward, attn = (statistics.median(x[i] for x in runs[c]) for i in range(3))
        rows.append({"context": c, "ms/token": gap, "forward ms": forward, "other ms": gap - forward,
                     "attention us/layer": attn, "attention ms/token": attn * config.num_layers / 1000})
    base = rows[0]["ms/token"]
    for row in rows:
        row[f"vs {contexts[0]}"] = row["ms/token"] / base
    result = {"machine": machine_info(), "threads": threads, "tokens": args.tokens, "rounds": args.rounds,
              "rows": rows}
    emit("One stream's decode against its context", [("in-process, greedy, medians over rounds",
                                                       format_table(rnd(rows, 3)))], result, args.json)


if __name__ == "__main__":
    main()
