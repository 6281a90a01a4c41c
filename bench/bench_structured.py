"""Per-token overhead of grammar-constrained decoding, at 1 and 32 streams.

Same run, same prompts, same model: the level is decoded once constrained (a JSON schema
whose one string must be long, so no answer ends early) and once not (``ignore_eos``),
alternating (which goes first alternates too), ``--rounds`` times. A step's per-token
time is its wall time over the tokens it produced; the median over the steps in which
every stream decoded is reported, with the overhead = constrained / unconstrained - 1,
and, less sensitive to load that comes and goes on a shared machine, the median of the
rounds' own ratios (each round's constrained and free runs are back to back).
``p10_overhead_pct`` compares the 10th-percentile steps (the least disturbed by other
work: interference only ever adds time). ``cpu_overhead_pct`` compares the same steps' process CPU time (this process's threads
only: less sensitive to other processes on the machine than wall time). ``mask_ms`` is
the median time of the sampler's mask fill + apply alone (included in the constrained
step).

    python bench/bench_structured.py            # levels 1,32
    python bench/bench_structured.py --quick
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    apply_threads,
    base_parser,
    emit,
    format_table,
    machine_info,
    median,
    percentile,
)

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                           "story": {"type": "string", "minLength": 4000}},
          "required": ["title", "story"], "additionalProperties": False}


def _prompt(i: int) -> str:
    return f"<|im_start|>user\n{i}. Write a story about a lighthouse as JSON.<|im_end|>\n<|im_start|>assistant\n"


def run_level(engine: Any, level: int, tokens: int, constrained: bool, mask_times: list[float],
              cpu: list[float] | None = None) -> list[float]:
    """Per-token seconds of each step in which all ``level`` streams decoded (wall time;
    the same steps' process CPU time per token is appended to ``cpu``)."""
    from bargein import SamplingParams
    from bargein.engine.constraint import Constraint
    from bargein.engine.outputs import OutputCollector

    if constrained:
        params = SamplingParams(temperature=0, max_tokens=tokens, constraint=Constraint.json_schema(SCHEMA))
    else:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    collector = OutputCollector(engine)
    salt = time.monotonic_ns()  # distinct prompts per run: no prefix hits between runs
    ids = {collector.add_request(_prompt(salt + i), params) for i in range(level)}
    masks = engine.sampler.grammar_masks
    plain_apply = masks.apply

    def timed_apply(logits, matchers):
        start = time.perf_counter()
        out = plain_apply(logits, matchers)
        if any(m is not None for m in matchers):
            mask_times.append(time.perf_counter() - start)
        return out

    masks.apply = timed_apply
    per_token: list[float] = []
    done: set[str] = set()
    try:
        while len(done) < len(ids) or collector.pending:
            start, cpu_start = time.perf_counter(), time.process_time()
            outs = collector.step()
            elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu_start
            produced = sum(len(o.new_token_ids) for o in outs)
            decoding = all(len(o.new_token_ids) == 1 and o.usage.completion_tokens > 1 for o in outs)
            if produced == level and decoding:
                per_token.append(elapsed / produced)
                if cpu is not None:
                    cpu.append(cpu_elapsed / produced)
            done |= {o.request_id for o in outs if o.finished}
    finally:
        masks.apply = plain_apply
    return per_token


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,32")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per request (default 48; quick 16)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; quick 1)")
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    from bargein import Engine
    from bargein.engine.constraint import Constraint

    tokens = args.tokens or (16 if args.quick else 48)
    rounds = args.rounds or (1 if args.quick else 3)
    engine = Engine.from_pretrained(args.model, progress=False)
    engine.grammars.compile(Constraint.json_schema(SCHEMA))  # the token table and grammar, before timing
    rows = []
    for level in (int(x) for x in args.levels.split(",")):
        run_level(engine, level, 4, True, [])  # warm-up (shapes, the grammar's first masks)
        free: list[float] = []
        constrained: list[float] = []
        mask_times: list[float] = []
        ratios: list[float] = []
        cpu: dict[bool, list[float]] = {False: [], True: []}
        for r in range(rounds):
            pair = {}
            for mode in (False, True) if r % 2 == 0 else (True, False):
                pair[mode] = run_level(engine, level, tokens, mode, mask_times if mode else [], cpu[mode])
            free += pair[False]
            constrained += pair[True]
            ratios.append(median(pair[True]) / median(pair[False]))
        f, c = median(free), median(constrained)
        rows.append({"streams": level, "free_ms_per_token": f * 1e3, "constrained_ms_per_token": c * 1e3,
                     "overhead_pct": (c / f - 1) * 100, "round_overhead_pct": (median(ratios) - 1) * 100,
                     "cpu_overhead_pct": (median(cpu[True]) / median(cpu[False]) - 1) * 100,
                     "p10_overhead_pct": (percentile(constrained, 10) / percentile(free, 10) - 1) * 100,
                     "mask_ms_per_step": median(mask_times) * 1e3, "steps": len(constrained)})
    result = {"bench": "structured", "tokens": tokens, "rounds": rounds, "rows": rows, "machine": machine_info()}
    emit("constrained decoding overhead", [("per token (median over full steps)", format_table(rows))], result,
         args.json)
    return result


if __name__ == "__main__":
    main()
