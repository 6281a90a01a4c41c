"""Speculative decoding benchmark (issue 30): what prompt lookup earns, what verification costs.

Measures, on the bundled model (or ``--model``), greedy, ``fast`` precision by default:

- 1-stream decode tokens/s with and without prompt lookup (``--speculative ngram``) on the
  three workloads in ``bench/speculative_workloads/`` (editing a given code file,
  summarizing an article with quotes, free chat), each as a chat prompt; runs alternate
  off/on round by round (same engine and weights: speculation is switched on the engine)
  and the medians are compared. With the acceptance rate (confirmed / verified guesses),
  the mean tokens per decode step, and whether the answers were identical (they must be).
  Targets (issue 30): >= 1.5x on editing, >= 0.97x on free chat.
- the batch size where speculation stops paying: the editing workload at 1, 2, 4, 8 and 16
  streams, with speculation allowed at every width (``max_batch`` lifted; k still adapts
  to the step's measured cost) and without, alternating round by round, medians; the
  crossover is the first width whose ratio falls below 1 (``SpeculativeConfig.max_batch``
  should sit below it).
- the cost of a verification step on the bundled model (``--model``) and on the 1B-class
  file (``--verify-model``, default /work/models/llama1b.Q4_K_M.gguf): the forward time of
  one decode row carrying k guesses (k = 0..8) after a 256-token context, relative to
  k = 0, rounds of k = 0..8 interleaved; a guess pays when the expected confirmed tokens
  per step exceed that ratio.
- with ``--draft-model``: the same 1-stream runs with draft-model speculation instead.

    python bench/bench_speculative.py [--quick] [--json PATH] [--threads N] [--model REF]
        [--max-tokens N] [--rounds N] [--verify-model PATH] [--draft-model REF]
        [--sections streams,batch,verify]
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bargein.config import EngineConfig, SpeculativeConfig  # noqa: E402
from bargein.engine.engine import Engine  # noqa: E402
from bargein.engine.outputs import OutputCollector  # noqa: E402
from bargein.engine.sampling import SamplingParams  # noqa: E402
from bargein.engine.speculative.build import build_speculation  # noqa: E402
from bench.common import apply_threads, base_parser, emit, format_table, machine_info, median  # noqa: E402

WORKLOADS = Path(__file__).resolve().parent / "speculative_workloads"
WORKLOAD_FILES = {"editing": "editing.txt", "summarizing": "summarizing.txt", "free_chat": "chat.txt"}
VERIFY_MODEL = "/work/models/llama1b.Q4_K_M.gguf"


def workload_text(name: str) -> str:
    """The workload's user message, with ``{file:NAME}`` replaced by that file's text."""
    text = (WORKLOADS / WORKLOAD_FILES[name]).read_text()
    return re.sub(r"\{file:([^}]+)\}", lambda m: (WORKLOADS / m.group(1)).read_text().rstrip("\n"), text)


def chat_prompt(engine: Engine, name: str) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": workload_text(name)}])
    return engine.tokenizer.encode(text, add_special_tokens=False)


def run_streams(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Generates greedily for every prompt at once; decode tokens/s (after every first token)."""
    collector = OutputCollector(engine)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    ids = [collector.add_request(p, params) for p in prompts]
    answers: dict[str, list[int]] = {i: [] for i in ids}
    live, decode_tokens, decode_s, steps = set(ids), 0, 0.0, 0
    while live:
        in_decode = all(answers[i] for i in ids)
        started = time.perf_counter()
        outs = collector.step()
        elapsed = time.perf_counter() - started
        tokens = 0
        for out in outs:
            answers[out.request_id] += out.new_token_ids
            tokens += len(out.new_token_ids)
            if out.finished:
                live.discard(out.request_id)
        if in_decode and tokens:
            decode_tokens, decode_s, steps = decode_tokens + tokens, decode_s + elapsed, steps + 1
    return {"tok_s": decode_tokens / decode_s if decode_s else float("nan"), "steps": steps,
            "tokens": decode_tokens, "answers": [answers[i] for i in ids]}


def bench_streams(engine: Engine, speculation: Any, names: list[str], max_tokens: int, rounds: int,
                  label: str) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        prompt = chat_prompt(engine, name)
        off, on, identical, drafted, accepted = [], [], True, 0, 0
        per_step = []
        for _ in range(rounds):
            engine.speculation = None
            plain = run_streams(engine, [prompt], max_tokens)
            engine.speculation = speculation
            before = speculation.counts()
            spec = run_streams(engine, [prompt], max_tokens)
            after = speculation.counts()
            off.append(plain["tok_s"])
            on.append(spec["tok_s"])
            identical &= plain["answers"] == spec["answers"]
            drafted += after.drafted_tokens - before.drafted_tokens
            accepted += after.accepted_tokens - before.accepted_tokens
            per_step.append(spec["tokens"] / spec["steps"] if spec["steps"] else float("nan"))
        row = {"workload": name, "method": label, "prompt_tokens": len(prompt),
               "answer_tokens": len(plain["answers"][0]), "tok_s_off": median(off), "tok_s_on": median(on),
               "speedup": median(on) / median(off), "acceptance": accepted / drafted if drafted else 0.0,
               "tokens_per_step": median(per_step), "identical": identical}
        print(f"  {label} {name}: {row['tok_s_off']:.1f} -> {row['tok_s_on']:.1f} tok/s "
              f"({row['speedup']:.2f}x), acceptance {row['acceptance']:.2f}, identical {identical}", flush=True)
        rows.append(row)
    return rows


def bench_batch(engine: Engine, speculation: Any, widths: tuple[int, ...], max_tokens: int,
                rounds: int) -> list[dict[str, Any]]:
    """The editing workload at several widths, ``max_batch`` lifted above every width (k
    still adapts to the step's measured cost); off/on alternate round by round, medians."""
    forced = dataclasses.replace(speculation.config, max_batch=max(widths))
    speculation.config = forced
    prompt = chat_prompt(engine, "editing")
    rows = []
    for width in widths:
        prompts = [prompt] * width  # identical prompts: the prefix cache shares their K/V
        off, on, identical = [], [], True
        for _ in range(rounds):
            engine.speculation = None
            plain = run_streams(engine, prompts, max_tokens)
            engine.speculation = speculation
            spec = run_streams(engine, prompts, max_tokens)
            off.append(plain["tok_s"])
            on.append(spec["tok_s"])
            identical &= plain["answers"] == spec["answers"]
        rows.append({"streams": width, "tok_s_off": median(off), "tok_s_on": median(on),
                     "ratio": median(on) / median(off), "identical": identical})
        print(f"  {width} streams: {median(off):.1f} -> {median(on):.1f} tok/s ({rows[-1]['ratio']:.2f}x)", flush=True)
    return rows


def bench_verify_cost(path: str | None, precision: str, repeats: int, max_k: int = 8) -> list[dict[str, Any]]:
    """Forward time of one decode row with k guesses after a 256-token context, by k
    (``path`` None: the bundled model); rounds of k = 0..max_k interleaved, medians."""
    from bargein.engine.plan import ScheduledChunk, StepPlan

    config = EngineConfig(precision=precision, cache=dataclasses.replace(EngineConfig().cache, kv_tokens=1024))
    engine = Engine.from_pretrained(path, config, progress=False)
    runner, bs = engine.runner, engine.pool.block_size
    context = list(range(1000, 1256))
    table = tuple(range(-(-(len(context) + max_k + 1) // bs)))
    runner.execute(StepPlan(0, (ScheduledChunk("a", tuple(context[:-1]), 0, table, False),)))
    plans = [StepPlan(k + 1, (ScheduledChunk("a", (context[-1],), len(context) - 1, table, True,
                                             tuple(range(2000, 2000 + k))),)) for k in range(max_k + 1)]
    times: list[list[float]] = [[] for _ in plans]
    for round_ in range(repeats + 1):
        for k, plan in enumerate(plans):
            started = time.perf_counter()
            runner.execute(plan)
            if round_:  # the first round warms up
                times[k].append(time.perf_counter() - started)
    rows, base = [], median(times[0])
    for k, ts in enumerate(times):
        t = median(ts)
        rows.append({"model": engine.model_name, "guesses": k, "forward_ms": t * 1e3, "relative": t / base})
        print(f"  {engine.model_name} k={k}: {t * 1e3:.1f} ms ({t / base:.2f}x a decode)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=None, help="answer tokens per run (default 256; quick 48)")
    parser.add_argument("--rounds", type=int, default=None, help="off/on rounds per workload (default 3; quick 1)")
    parser.add_argument("--precision", default="fast", choices=["exact", "fast"])
    parser.add_argument("--verify-model", default=VERIFY_MODEL, help="the 1B-class file for the verification cost")
    parser.add_argument("--draft-model", default=None, help="also measure draft-model speculation with this model")
    parser.add_argument("--sections", default="streams,batch,verify", help="which parts to run (comma-separated)")
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    sections = set(args.sections.split(","))
    max_tokens = args.max_tokens or (48 if args.quick else 256)
    rounds = args.rounds or (1 if args.quick else 3)
    widths = (1, 2, 4) if args.quick else (1, 2, 4, 8, 16)

    config = EngineConfig(precision=args.precision, speculative=SpeculativeConfig(method="ngram"))
    engine = Engine.from_pretrained(args.model, config, progress=False)
    speculation = engine.speculation
    info = machine_info()
    print(f"loaded {engine.model_name}; torch threads {info['torch_threads']}, load average {info.get('loadavg_1m')}",
          flush=True)
    engine.generate([chat_prompt(engine, "free_chat")], SamplingParams(temperature=0, max_tokens=4))  # warm-up

    names = list(WORKLOAD_FILES)
    streams = bench_streams(engine, speculation, names, max_tokens, rounds, "ngram") if "streams" in sections else []
    if args.draft_model and "streams" in sections:
        draft_config = dataclasses.replace(config, speculative=SpeculativeConfig(method="draft",
                                                                                 draft_model=args.draft_model))
        draft = build_speculation(draft_config, engine.runner)
        streams += bench_streams(engine, draft, names, max_tokens, rounds, "draft")
    batch = bench_batch(engine, speculation, widths, max_tokens, rounds) if "batch" in sections else []
    crossover = next((r["streams"] for r in batch if r["ratio"] < 1.0), None)
    verify = []
    if "verify" in sections:
        repeats = 3 if args.quick else 10
        print("verification cost", flush=True)
        verify = bench_verify_cost(args.model, args.precision, repeats)
        if os.path.exists(args.verify_model):
            verify += bench_verify_cost(args.verify_model, args.precision, repeats)

    targets = {"editing": 1.5, "free_chat": 0.97}
    result = {
        "bench": "speculative", "model": engine.model_name, "precision": args.precision, "max_tokens": max_tokens,
        "rounds": rounds, "machine": info, "streams": streams, "batch": batch, "crossover_streams": crossover,
        "verify_model": args.verify_model if verify and os.path.exists(args.verify_model) else None, "verify_cost": verify,
        "targets": {name: {"target": t, "speedup": next((r["speedup"] for r in streams
                                                        if r["workload"] == name and r["method"] == "ngram"), None)}
                    for name, t in targets.items()},
    }
    sections_out = [("1 stream, with and without speculation", format_table(streams))]
    if batch:
        sections_out.append((f"streams (editing), max_batch lifted; crossover at {crossover}", format_table(batch)))
    if verify:
        sections_out.append(("verification step: one decode row with k guesses", format_table(verify)))
    emit("speculative decoding", sections_out, result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
