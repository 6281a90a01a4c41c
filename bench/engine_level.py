"""Concurrency levels of the engine, each run for a fixed time: aggregate tokens/s.

Used by ``bench_engine.py --before TREE`` to compare this tree's engine with another
commit's, each level in its own process (``PYTHONPATH`` picks the tree). It works with
the engine before issue 9 (``engine.step()`` returns outputs) and after (deltas, turned
into outputs by an ``OutputCollector`` on the consumer's side, which is timed too).
The level is kept full: a request that finishes is replaced at once; timing starts
once every first request has its first token (the initial prefill is left out).
One JSON line per level.

    PYTHONPATH=TREE python bench/engine_level.py --levels 1,32 --seconds 20
"""

from __future__ import annotations

import argparse
import json
import time

_TOPICS = ["a lighthouse keeper", "a lost robot", "the first city on Mars", "a dragon who bakes bread",
           "an old violin", "a river that flows uphill", "a chess prodigy", "the last library",
           "a time-travelling cat", "a desert festival", "a submarine crew", "a village of clockmakers"]


def prompt_text(i: int) -> str:
    """Distinct prompts (the index comes first), so no two share a cached prefix."""
    return f"{i}. Write a long, detailed story about {_TOPICS[i % len(_TOPICS)]}, chapter {i // len(_TOPICS) + 1}."


def load(model: str | None = None):
    from bargein import Engine, SamplingParams

    engine = Engine.from_pretrained(model, progress=False)
    engine.generate([prompt_text(0)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    return engine


def run_level(engine, level: int, seconds: float, max_tokens: int) -> dict:
    import bargein
    from bargein import SamplingParams

    try:
        from bargein.engine.outputs import OutputCollector
    except ImportError:  # the engine before issue 9: outputs come from step()
        add, step, api = engine.add_request, engine.step, "step() outputs"
    else:
        collector = OutputCollector(engine)
        add, step, api = collector.add_request, collector.step, "deltas + OutputCollector"
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    counter = 10_000 * level  # prompts no earlier level used (no prefix hits across levels)
    live = {add(prompt_text(counter + i), params) for i in range(level)}
    counter += level
    waiting_first = set(live)
    generated, steps = 0, 0
    started = None
    while started is None or time.perf_counter() - started < seconds:
        for out in step():
            if started is not None:
                generated += len(out.new_token_ids)
            elif out.new_token_ids:
                waiting_first.discard(out.request_id)
            if out.finished:
                live.discard(out.request_id)
                live.add(add(prompt_text(counter), params))
                counter += 1
        if started is None and not waiting_first:
            started = time.perf_counter()
        elif started is not None:
            steps += 1
    wall = time.perf_counter() - started
    for rid in live:
        engine.abort(rid)
    while engine.live_request_ids():
        step()
    return {"level": level, "tok_s": generated / wall, "generated": generated, "steps": steps, "wall_s": wall,
            "api": api, "bargein": bargein.__file__}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,32", help="comma-separated concurrency levels")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    engine = load(args.model)
    for level in (int(x) for x in args.levels.split(",")):
        print(json.dumps(run_level(engine, level, args.seconds, args.max_tokens)), flush=True)
