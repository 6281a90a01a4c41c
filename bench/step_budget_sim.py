"""The step time target's load, replayed in virtual time: the scheduler alone, no model.

``bench_step_budget.py`` measures the real engine, which on a shared machine measures the
neighbours as well. This drives the real :class:`~bargein.engine.scheduler.Scheduler` (and
its real step timer, which fits what it observes) through the same load, with every step
taking the time a fixed cost model gives it (``--cost overhead,per_token,per_pair``,
seconds; the default is fitted to a quiet sweep of the bundled model on 2 cores: a decode
step of 8 streams ~26 ms, a 504-token chunk 1.6 s on average over a 2,000-token prompt).
So it is exact and repeatable, takes seconds, and shows what the scheduling itself does
to throughput and latency, apart from the machine.

Reported per target, over ``--seconds`` of virtual time: the streams' inter-token latency
(p50, p99), the long prompts' time to first token (p50, max) and how many were answered,
generated tokens/s, prompt tokens/s counted two ways (``prompt_tok_s``: prompts answered,
as ``bench_step_budget.py`` counts them; ``prompt_computed_tok_s``: prompt tokens the
forwards computed, answered or not), the mean prompt chunk and the step time p50/p99.

    .venv/bin/python bench/step_budget_sim.py                      # targets 50,100,250,500,none
    .venv/bin/python bench/step_budget_sim.py --budgets 100,250 --seconds 600
"""

from __future__ import annotations

import heapq
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import base_parser, emit, format_table, percentile  # noqa: E402

from bargein.config import SchedulerConfig  # noqa: E402
from bargein.engine.blocks import BlockPool  # noqa: E402
from bargein.engine.request import Request, Sequence  # noqa: E402
from bargein.engine.sampling import SamplingParams  # noqa: E402
from bargein.engine.scheduler import Scheduler  # noqa: E402
from bargein.engine.step_time import StepCost, StepTimer, plan_features  # noqa: E402

DEFAULT_COST = "0.013,0.00157,1.6e-6"
STREAM_TOKENS, STREAM_PROMPT_TOKENS = 256, 32


class ModelledTimer(StepTimer):
    """The scheduler's step timer, fed the modelled time of each plan instead of the clock."""

    def __init__(self, cost: StepCost):
        super().__init__()
        self.model = cost
        self.last_seconds = 0.0

    def observe_plan(self, plan, seconds: float) -> None:
        self.last_seconds = self.model.seconds(*plan_features(plan))
        super().observe_plan(plan, self.last_seconds)


class _Token:
    def __init__(self, token_id: int):
        self.token_id, self.logprobs = token_id, None


def simulate(budget: float | None, cost: StepCost, seconds: float, streams: int, long_tokens: int,
             long_every: float, seed: int = 0) -> dict:
    """One target: the load for ``seconds`` of virtual time."""
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, max_step_ms=budget)
    s = Scheduler(config, BlockPool(8192, 16, True), 32768, frozenset({0}))
    timer = s.step_timer = ModelledTimer(cost)
    serial = iter(range(10**9))

    def add(n: int, max_tokens: int) -> str:
        rid = f"r{next(serial)}"
        s.ids.claim(rid)
        tokens = [rng.randrange(100, 30000) for _ in range(n)]
        s.add(Request(request_id=rid, sequence=Sequence(rid, tokens),
                      params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      prompt_len=n, new_prompt_tokens=n))
        return rid

    live = {add(STREAM_PROMPT_TOKENS, STREAM_TOKENS) for _ in range(streams)}
    longs: dict[str, float] = {}
    last: dict[str, float] = {}
    itl, ttft, step_ms, chunks = [], [], [], []
    now = 0.0
    generated = prompt_answered = prompt_computed = 0
    arrivals = [long_every / 2 + k * long_every for k in range(int(seconds / long_every) + 1)]
    heapq.heapify(arrivals)
    warm = True  # until every stream has its first token (their own prefill is not the load)
    while now < seconds:
        while not warm and arrivals and arrivals[0] <= now:
            longs[add(long_tokens, 1)] = heapq.heappop(arrivals)
        plan = s.schedule()
        for c in plan.chunks:
            if len(c.token_ids) > 1 and c.request_id in longs:
                prompt_computed += len(c.token_ids)
                chunks.append(len(c.token_ids))
        s.update(plan, {c.request_id: _Token(7) for c in plan.chunks if c.sample})
        now += timer.last_seconds if plan.chunks else 0.001
        if not warm:
            step_ms.append(timer.last_seconds * 1000)
        for delta in s.take_outcome().deltas:
            rid = delta.request_id
            if delta.new_token_ids and rid in live and not warm:
                if rid in last:
                    itl.append(now - last[rid])
                generated += len(delta.new_token_ids)
            if delta.new_token_ids and rid in live:
                last[rid] = now
            if delta.new_token_ids and rid in longs:
                ttft.append(now - longs.pop(rid))
                prompt_answered += long_tokens
            if delta.finished and rid in live:
                live.discard(rid)
                last.pop(rid, None)
                live.add(add(STREAM_PROMPT_TOKENS, STREAM_TOKENS))
        if warm and all(r in last for r in live):
            warm, now = False, 0.0
            last = dict.fromkeys(last, 0.0)
    return {"itl_p50_ms": percentile(itl, 50) * 1000, "itl_p99_ms": percentile(itl, 99) * 1000,
            "long_ttft_p50_s": percentile(ttft, 50), "long_ttft_max_s": max(ttft, default=float("nan")),
            "long_prompts_answered": len(ttft), "long_prompts_unanswered": len(longs),
            "generated_tok_s": generated / now, "prompt_tok_s": prompt_answered / now,
            "prompt_computed_tok_s": prompt_computed / now,
            "mean_chunk": sum(chunks) / len(chunks) if chunks else float("nan"),
            "step_p50_ms": percentile(step_ms, 50), "step_p99_ms": percentile(step_ms, 99)}


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="50,100,250,500,none", help="step targets in ms, 'none' for no target")
    p.add_argument("--cost", default=DEFAULT_COST, help="overhead,per_token,per_pair in seconds (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=120.0, help="virtual seconds per target (default: %(default)s)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--long-every", type=float, default=3.0)
    args = p.parse_args(argv)
    if args.quick:
        args.seconds = 30.0
    cost = StepCost(*(float(x) for x in args.cost.split(",")))
    rows = []
    for part in args.budgets.split(","):
        budget = None if part.strip().lower() in ("none", "off", "0") else float(part)
        rows.append({"max_step_ms": part.strip(),
                     **simulate(budget, cost, args.seconds, args.streams, args.long_tokens, args.long_every)})
    result = {"settings": {k: v for k, v in vars(args).items() if k != "json"}, "targets": rows}
    columns = ["max_step_ms", "itl_p50_ms", "itl_p99_ms", "long_ttft_p50_s", "long_ttft_max_s",
               "long_prompts_answered", "long_prompts_unanswered", "generated_tok_s", "prompt_tok_s",
               "prompt_computed_tok_s", "mean_chunk", "step_p50_ms", "step_p99_ms"]
    emit("step time target, simulated (virtual time, a fixed cost model)",
         [("per target", format_table(rows, columns))], result, args.json)
    return result


if __name__ == "__main__":
    main()
