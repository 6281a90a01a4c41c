"""The step time target swept (issue 34): what ``--max-step-ms`` buys and costs.

``bargein serve`` defaults to ``--max-step-ms 250`` (chosen from this sweep, from
``step_budget_sim.py``'s and from the tenants soak, see ``bargein/cli/serve.py``). This
measures it: the bundled model, one engine with the server's
scheduler settings, and for each target (``--budgets``, e.g. 50,100,250,500,none) the
same mixed load for ``--seconds``:

- ``--streams`` streams decoding all the time (one finishing is replaced at once), whose
  inter-token latency (the time between two of a stream's tokens, per token) is what a
  chat user feels: p50 and p99;
- a long prompt of ``--long-tokens`` random tokens (no prefix-cache hits) every
  ``--long-every`` seconds, one token each: its time to first token (p50, max), which a
  small target stretches (its prompt is cut in small chunks) and a large one shortens;
- the throughput of it all: generated tokens per second, prompt tokens per second counted
  two ways (``prompt_tok_s``: long prompts answered; ``prompt_computed_tok_s``: prompt
  tokens the forwards computed, answered or not, the streams' own included), steps per
  second and the step time (p50, p99).

``step_budget_sim.py`` replays the same load against the scheduler alone in virtual time
(a fixed cost model), which the machine's load does not move.

Targets run interleaved round by round (``--rounds``), so a shared machine's load swings
land on every target alike; each figure is the median over rounds. The engine is driven
on this thread (``OutputCollector``), as the server's engine thread does; between runs
the scheduler's config is swapped for the next target (its measured step times carry
over: they describe the machine, not the target). Prints a table and one JSON line.

    .venv/bin/python bench/bench_step_budget.py                      # 5 targets x 3 rounds x 20 s
    .venv/bin/python bench/bench_step_budget.py --quick              # a smoke run
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import apply_threads, base_parser, emit, format_table, machine_info, median, percentile  # noqa: E402

STREAM_TOKENS = 256  # a stream's answer before it is replaced
STREAM_PROMPT_TOKENS = 32


def parse_budgets(text: str) -> list[float | None]:
    return [None if part.strip().lower() in ("none", "off", "0") else float(part) for part in text.split(",")]


def load(model: str | None, max_step_ms: float | None):
    """The engine with the scheduler defaults ``bargein serve`` uses (64 sequences, 512 tokens a step)."""
    from bargein import Engine, SamplingParams

    engine = Engine.from_pretrained(model, progress=False)
    engine.scheduler.config = replace(engine.scheduler.config, max_step_ms=max_step_ms)
    # warm-up: native kernels built (first use) and the step timer fed, before anything is timed
    engine.generate([[1000 + i for i in range(300)]] * 4, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return engine


def run_one(engine, budget: float | None, seconds: float, streams: int, long_tokens: int, long_every: float,
            rng: random.Random) -> dict:
    """One target's run: the mixed load for ``seconds``; every request ended after."""
    from bargein import SamplingParams
    from bargein.engine.outputs import OutputCollector
    from bargein.engine.request import CancelReason

    engine.scheduler.config = replace(engine.scheduler.config, max_step_ms=budget)
    vocab = engine.model_config.vocab_size
    collector = OutputCollector(engine)
    stream_params = SamplingParams(temperature=0, max_tokens=STREAM_TOKENS, ignore_eos=True)
    long_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    live_streams = {collector.add_request(tokens(STREAM_PROMPT_TOKENS), stream_params) for _ in range(streams)}
    longs: dict[str, float] = {}  # long prompt -> when it was added
    last_token: dict[str, float] = {}
    unstarted = set(live_streams)
    while unstarted:  # the clock starts once every stream decodes (their own prefill is not the load)
        for out in collector.step():
            if out.new_token_ids:
                unstarted.discard(out.request_id)
                last_token[out.request_id] = time.perf_counter()
    itl: list[float] = []
    ttft: list[float] = []
    generated = prompt_tokens = steps = 0
    step_ms: list[float] = []
    computed_before = engine.scheduler.num_computed_tokens
    started = time.perf_counter()
    next_long = started + long_every / 2
    while (now := time.perf_counter()) - started < seconds:
        if now >= next_long:
            longs[collector.add_request(tokens(long_tokens), long_params)] = now
            next_long += long_every
        began = time.perf_counter()
        outputs = collector.step()
        steps += 1
        ended = time.perf_counter()
        step_ms.append((ended - began) * 1000)
        for out in outputs:
            rid = out.request_id
            if out.new_token_ids and rid in live_streams:
                if rid in last_token:
                    itl.append((ended - last_token[rid]) / len(out.new_token_ids))
                last_token[rid] = ended
                generated += len(out.new_token_ids)
            if out.new_token_ids and rid in longs:
                ttft.append(ended - longs.pop(rid))
                prompt_tokens += long_tokens
            if out.finished and rid in live_streams:
                live_streams.discard(rid)
                last_token.pop(rid, None)
                live_streams.add(collector.add_request(tokens(STREAM_PROMPT_TOKENS), stream_params))
    elapsed = time.perf_counter() - started
    prompt_computed = engine.scheduler.num_computed_tokens - computed_before - generated
    for rid in [*live_streams, *longs]:
        engine.abort(rid, CancelReason.USER)
    while collector.pending:
        collector.step()
    return {"itl_p50_ms": percentile(itl, 50) * 1000, "itl_p99_ms": percentile(itl, 99) * 1000,
            "itl_max_ms": max(itl, default=float("nan")) * 1000,
            "long_ttft_p50_s": percentile(ttft, 50), "long_ttft_max_s": max(ttft, default=float("nan")),
            "long_prompts_answered": len(ttft), "long_prompts_unanswered": len(longs),
            "generated_tok_s": generated / elapsed, "prompt_tok_s": prompt_tokens / elapsed,
            "steps_per_s": steps / elapsed,
            "prompt_computed_tok_s": prompt_computed / elapsed,
            "step_p50_ms": percentile(step_ms, 50), "step_p99_ms": percentile(step_ms, 99)}


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="50,100,250,500,none", help="step targets in ms, 'none' for no target")
    p.add_argument("--seconds", type=float, default=20.0, help="per target and round (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--streams", type=int, default=8, help="streams decoding all the time (default: %(default)s)")
    p.add_argument("--long-tokens", type=int, default=2000, help="a long prompt's tokens (default: %(default)s)")
    p.add_argument("--long-every", type=float, default=3.0, help="seconds between long prompts (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.rounds, args.long_tokens, args.long_every = 10.0, 1, 600, 3.0
    apply_threads(args.threads)
    budgets = parse_budgets(args.budgets)
    engine = load(args.model, budgets[0])
    rng = random.Random(args.seed)
    runs: dict[str, list[dict]] = {str(b or "none"): [] for b in budgets}
    for _ in range(args.rounds):
        for budget in budgets:
            runs[str(budget or "none")].append(run_one(engine, budget, args.seconds, args.streams, args.long_tokens,
                                                       args.long_every, rng))
    rows = [{"max_step_ms": name, **{k: median(r[k] for r in results) for k in results[0]}}
            for name, results in runs.items()]
    from bargein.cli.serve import DEFAULT_MAX_STEP_MS

    result = {"settings": {k: v for k, v in vars(args).items() if k != "json"},
              "server_default_max_step_ms": DEFAULT_MAX_STEP_MS, "targets": rows,
              "runs": runs, "machine": machine_info()}
    columns = ["max_step_ms", "itl_p50_ms", "itl_p99_ms", "itl_max_ms", "long_ttft_p50_s", "long_ttft_max_s",
               "generated_tok_s", "prompt_tok_s", "prompt_computed_tok_s", "steps_per_s", "step_p50_ms",
               "step_p99_ms", "long_prompts_unanswered"]
    emit("step time target sweep (medians over rounds)", [("per target", format_table(rows, columns))], result,
         args.json)
    return result


if __name__ == "__main__":
    main()
