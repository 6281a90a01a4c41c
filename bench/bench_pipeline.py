"""Pipeline stages on Ray (issue 12): what splitting the model over processes costs and gains.

Runs on this machine only (``ray.init`` with ``--ray local`` semantics), so "nodes" are
processes sharing its cores. Every pipeline runs twice, once per transport (see
``bargein.distributed.transport``): ``graph`` (a Ray compiled graph: what ``auto``
picks where every stage runs on the head's node with a core per stage thread, as here)
and ``calls`` (actor calls: what ``auto`` picks across nodes):

1. **Real model** (the bundled SmolLM2 unless ``--model``): 2 stages x 1 torch thread
   against 1 process x 2 threads, at 1 and 32 streams: tokens/s; per-step overhead (a
   plan's time at the head minus the stages' compute, one plan in flight) in ms and as
   a share of the step; each stage's idle share with one plan in flight, with one
   micro-batch per stage and with one more; and, with micro-batches, where the first
   stage's wait for its next plan goes (per plan, medians: the last stage's result
   reaching the head, the head's own work from collecting one plan to submitting the
   next, and that plan reaching the first stage).
2. **Recovery** from a killed stage (the last stage's actor is killed mid-stream, 8
   streams, median of ``--recoveries`` runs): time until the head noticed, time to
   re-create the stage, the pause the streams saw (kill -> next token), and the tokens
   recomputed; every run's tokens are checked against the fault-free run.
3. **Stand-in stages** that take a fixed time per token (``--token-ms``, sleeping, so 2
   cores don't limit them): 2, 3 and 4 stages at 32 streams, one plan in flight and one
   micro-batch per stage, against the ideal (every stage always busy: 1000 / token_ms
   tokens/s).

Prints tables, then one JSON object on the last line. Run as a script:
``python bench/bench_pipeline.py [--quick]``.
"""

from __future__ import annotations

import copy
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from common import apply_threads, base_parser, emit, format_table, machine_info, median  # noqa: E402

from bargein.build import build_engine  # noqa: E402
from bargein.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    ModelConfig,
    PipelineConfig,
    SchedulerConfig,
)
from bargein.distributed.pipeline import HeadTraffic, PipelineRunner, StagePlacement  # noqa: E402
from bargein.distributed.stage import PrefetchedInputs, StageCounters  # noqa: E402
from bargein.engine.engine import Engine  # noqa: E402
from bargein.engine.sampling import SamplingParams  # noqa: E402


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, min(vocab, 10000), (length,), generator=g).tolist() for _ in range(n)]


def run_streams(engine: Engine, streams: int, max_tokens: int, prompt_len: int = 16) -> dict[str, Any]:
    """Generates ``streams`` greedy answers at once; rates over the whole run and over the
    steps in which every stream was decoding."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = {engine.add_request(p, params) for p in _prompts(streams, prompt_len, engine.model_config.vocab_size)}
    started = time.perf_counter()
    decoding: set[str] = set()
    done: set[str] = set()
    tokens = decode_tokens = steps = 0
    decode_s = 0.0
    step_times = []
    while len(done) < len(ids):
        t0 = time.perf_counter()
        outcome = engine.step()
        dt = time.perf_counter() - t0
        n = sum(len(d.new_token_ids) for d in outcome.deltas)
        if len(decoding) == len(ids) and not done:
            decode_tokens += n
            decode_s += dt
            step_times.append(dt)
        tokens += n
        steps += 1
        for d in outcome.deltas:
            if d.new_token_ids:
                decoding.add(d.request_id)
            if d.finished:
                done.add(d.request_id)
    wall = time.perf_counter() - started
    engine.check_block_accounting()
    return {"tokens": tokens, "steps": steps, "wall_s": wall, "tok_s": tokens / wall,
            "decode_tok_s": decode_tokens / decode_s if decode_s else None,
            "median_step_ms": 1000 * median(step_times) if step_times else None}


class HeadTimeline:
    """Wall-clock times (``time.time``, as the stages' timelines) of the runner's submits
    and collects, recorded by wrapping them."""

    def __init__(self, runner: PipelineRunner):
        self.events: list[tuple[str, int, float, float]] = []  # (kind, plan step, start, end)
        submit, collect = runner.submit, runner.collect

        def timed_submit(plan: Any) -> None:
            start = time.time()
            submit(plan)
            self.events.append(("submit", plan.step, start, time.time()))

        def timed_collect() -> Any:
            start = time.time()
            result = collect()
            self.events.append(("collect", result.plan.step, start, time.time()))
            return result

        runner.submit, runner.collect = timed_submit, timed_collect  # type: ignore[method-assign]

    def breakdown(self, counters: list[StageCounters]) -> dict[str, Any]:
        """Medians per plan, in ms: ``s0_wait`` (the first stage from one plan's end to the
        next plan's arrival), ``return`` (the last stage done -> the head has the result),
        ``head`` (collect returned -> the next submit starts: sampling, applying, planning,
        pickling) and ``dispatch`` (submit starts -> the first stage runs it, where that
        stage was idle)."""
        first, last = ({step: (entered, done) for step, entered, _, done in c.timeline}
                       for c in (counters[0], counters[-1]))
        order = sorted(first.values())
        s0_wait = [b[0] - a[1] for a, b in zip(order, order[1:], strict=False) if b[0] > a[1]]
        returned, head, dispatch = [], [], []
        for i, (kind, step, start, end) in enumerate(self.events):
            if kind == "collect" and step in last:
                returned.append(end - last[step][1])
                nxt = next((e for e in self.events[i + 1:] if e[0] == "submit"), None)
                if nxt is not None:
                    head.append(nxt[2] - end)
            if kind == "submit" and step in first:
                earlier = [d for e, d in first.values() if e < first[step][0]]
                if not earlier or max(earlier) < start:  # the stage was idle when it was sent
                    dispatch.append(first[step][0] - start)
        return {f"{k}_ms": 1000 * median(v) if v else None
                for k, v in (("s0_wait", s0_wait), ("return", returned), ("head", head), ("dispatch", dispatch))}


def stage_report(runner: PipelineRunner, plans_head_s: float | None = None) -> dict[str, Any]:
    counters = runner.stage_counters()
    idle = [c.idle_fraction for c in counters]
    plans = counters[0].plans
    busy_per_plan = sum(c.busy_s for c in counters) / plans if plans else 0.0
    report: dict[str, Any] = {"stage_idle_pct": [round(100 * i, 1) for i in idle], "plans": plans,
                              "stage_busy_ms_per_plan": 1000 * busy_per_plan}
    if plans_head_s is not None and plans:
        per_plan = plans_head_s / plans
        report["overhead_ms"] = 1000 * (per_plan - busy_per_plan)
        report["overhead_pct"] = 100 * (per_plan - busy_per_plan) / per_plan
    return report


def real_model(args: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    base = {"cache": CacheConfig(memory_bytes=128 * 2**20), "device": "cpu", "dtype": "float32",
            "scheduler": SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512)}
    rows = []
    torch.set_num_threads(2)
    single = Engine.from_pretrained(args.model, EngineConfig(**base), progress=False)
    # The single process runs before Ray starts: with Ray's processes alive on these 2
    # cores, its 2-thread forwards measured 4-10x slower (some steps much slower still).
    for streams in (1, 32):
        run_streams(single, streams, 2)  # warm-up
        results = [run_streams(single, streams, args.tokens) for _ in range(args.repeats)]
        rows.append({"setup": "1 process x 2 threads", "streams": streams, **_medians(results)})
    del single
    recoveries, layers, traffic = {}, None, None
    for transport in ("graph", "calls"):
        pipe = build_engine(args.model, EngineConfig(**base, pipeline=PipelineConfig(
            stages=2, ray_address="local", threads_per_stage=1, transport=transport)), progress=False)
        runner: PipelineRunner = pipe.runner
        kind = runner.transport.kind
        timeline = HeadTimeline(runner)
        for streams in (1, 32):
            runs: dict[str, list[dict[str, Any]]] = {}
            for _ in range(args.repeats):
                for micro in (1, 2, 3):
                    runner.max_in_flight = micro
                    run_streams(pipe, streams, 2)
                    runner.reset_counters()
                    timeline.events.clear()
                    r = run_streams(pipe, streams, args.tokens)
                    head_s = r["wall_s"] if micro == 1 else None  # one plan at a time: wall = sum of plan times
                    report = r | stage_report(runner, head_s)
                    if micro > 1:
                        report |= timeline.breakdown(runner.stage_counters())
                    runs.setdefault(f"2 stages x 1 thread, {kind}, {micro} in flight", []).append(report)
            for setup, results in runs.items():
                rows.append({"setup": setup, "streams": streams, **_medians(results)})
        recoveries[kind] = recover_runs(pipe, args.recoveries, args.tokens)
        layers, traffic = [list(p.layers) for p in runner.placements], vars(runner.traffic)
        pipe.close()
    return rows, {"model": pipe.model_name, "layers": layers, "traffic": traffic, "recovery": recoveries}


def recover_runs(engine: Engine, runs: int, max_tokens: int) -> dict[str, Any]:
    """Kills the last stage's actor once each run, after every stream has 4 tokens."""
    runner: PipelineRunner = engine.runner
    runner.max_in_flight = 2
    params = SamplingParams(max_tokens=max(8, max_tokens), temperature=0, ignore_eos=True)
    prompts = _prompts(8, 16, engine.model_config.vocab_size)

    def generate(kill: bool) -> tuple[list[list[int]], dict[str, float]]:
        ids = [engine.add_request(p, params) for p in prompts]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        done: set[str] = set()
        times: dict[str, float] = {}
        losses = engine.counters.kv_losses
        while len(done) < len(ids):
            outcome = engine.step()
            now = time.perf_counter()
            for d in outcome.deltas:
                tokens[d.request_id] += d.new_token_ids
                if d.new_token_ids and "killed" in times and "noticed" in times and "resumed" not in times:
                    times["resumed"] = now
                if d.finished:
                    done.add(d.request_id)
            if "killed" in times and "noticed" not in times and engine.counters.kv_losses > losses:
                times["noticed"] = now
            if kill and "killed" not in times and all(len(t) >= 4 for t in tokens.values()):
                ray.kill(runner.actors[-1])  # as a process killed on its node
                times["killed"] = time.perf_counter()
        return [tokens[i] for i in ids], times

    want, _ = generate(kill=False)
    samples = []
    for _ in range(runs):
        recomputed = engine.counters.recomputed_tokens
        got, times = generate(kill=True)
        assert got == want, "a recovered run gave other tokens than the fault-free run"
        samples.append({"detect_s": times["noticed"] - times["killed"],
                        "recreate_s": runner.recovery.recover_seconds[-1],
                        "pause_s": times["resumed"] - times["killed"],
                        "tokens_recomputed": engine.counters.recomputed_tokens - recomputed})
    engine.check_block_accounting()
    return {"runs": runs, "streams": len(prompts), "same_tokens": True, **_medians(samples),
            "samples": samples}


def _medians(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median over repeats (element-wise for lists)."""
    out: dict[str, Any] = {}
    for key, value in results[0].items():
        values = [r[key] for r in results]
        if isinstance(value, list):
            out[key] = [median(v) for v in zip(*values, strict=True)]
        elif any(v is None for v in values):
            out[key] = None
        else:
            out[key] = median(values)
    return out


class StandInStage:
    """A stage that sleeps ``token_s`` per token of each plan; same interface as
    StageWorker, for both transports."""

    def __init__(self, index: int, last: bool, token_s: float, hidden: int, vocab: int):
        self.last, self.token_s, self.hidden, self.vocab = last, token_s, hidden, vocab
        self.counters = StageCounters(index, (index, index + 1), "", "none", 0)
        self.inputs = PrefetchedInputs()
        self.next_stage: Any = None

    def connect_next(self, handles: list) -> None:
        self.next_stage = handles[0] if handles else None

    @ray.method(concurrency_group="inputs")
    def receive(self, seq: int, hidden: Any, sent_at: float, error: str | None = None) -> None:
        self.inputs.put(seq, (hidden, time.time() - sent_at))

    @ray.method(concurrency_group="inputs")
    def void_through(self, seq: int) -> None:
        self.inputs.void_through(seq)

    def run(self, seq: int, payload: bytes, receives: bool, rows: Any = None) -> Any:
        entered = time.time()
        if receives:
            self.inputs.take(seq)
        out = self._execute(payload, entered)
        if self.last:
            return out
        self.next_stage.receive.remote(seq, *out)
        return None

    def step(self, inputs: tuple, previous: Any = None) -> Any:
        out = self._execute(inputs[1], time.time())
        if self.last:
            os.write(self.doorbell, b"r")
        return out

    def ring_on(self, path: str) -> None:
        self.doorbell = os.open(path, os.O_WRONLY | os.O_NONBLOCK)

    def _execute(self, payload: bytes, entered: float) -> Any:
        started = time.perf_counter()
        plan = pickle.loads(payload)
        c = self.counters
        time.sleep(self.token_s * plan.num_tokens)
        c.plans += 1
        ended = time.perf_counter()
        c.busy_s += ended - started
        c.first_start = started if c.first_start is None else c.first_start
        c.last_end = ended
        c.timeline.append((plan.step, entered, entered, time.time()))
        if self.last:
            return np.zeros((len(plan.sampled), self.vocab), np.float32), None, time.time()
        return np.zeros((plan.num_tokens, self.hidden), np.float32), time.time()

    def read_counters(self) -> StageCounters:
        return copy.deepcopy(self.counters)

    def ping(self) -> tuple[str, int]:
        return "", 0

    def progress(self) -> int:
        return 0

    def reset_counters(self) -> None:
        c = self.counters
        self.counters = StageCounters(c.index, c.layers, "", "none", 0)


class _Tokens:
    eos_token_ids = frozenset({255})

    def encode(self, text: str, **_: Any) -> list[int]:
        return list(text.encode())


def stand_in(args: Any) -> list[dict[str, Any]]:
    config = ModelConfig(vocab_size=256, hidden_size=576, intermediate_size=1536, num_layers=4, num_heads=9,
                         num_kv_heads=3, head_dim=64, max_position_embeddings=2048)
    actor = ray.remote(num_cpus=0, concurrency_groups={"inputs": 1})(StandInStage)
    token_s = args.token_ms / 1000
    here = ray.get_runtime_context().get_node_id()
    rows = []
    for transport in ("graph", "calls"):
        for n in (2, 3, 4):
            actors = [actor.remote(i, i == n - 1, token_s, config.hidden_size, config.vocab_size) for i in range(n)]
            ray.get([a.read_counters.remote() for a in actors])  # started: a plan's wait is not start-up
            placements = [StagePlacement(i, (i, i + 1), here, "local", 0) for i in range(n)]
            # A stand-in answers the heartbeat on its one thread: allow it the time of a queue of plans.
            pipe = PipelineConfig(stages=n, micro_batches=n + 1, heartbeat_timeout_s=60, transport=transport)
            runner = PipelineRunner(actors, placements, config, 512, 16, EngineConfig(pipeline=pipe), HeadTraffic())
            engine = Engine(runner, _Tokens(), EngineConfig(cache=CacheConfig(block_size=16, num_blocks=512)))
            timeline = HeadTimeline(runner)
            for micro in (1, n, n + 1):
                runner.max_in_flight = micro
                run_streams(engine, 32, 2, prompt_len=4)
                runner.reset_counters()
                timeline.events.clear()
                r = run_streams(engine, 32, args.stand_in_tokens, prompt_len=4)
                ideal = 1000 / args.token_ms  # every stage always busy
                counters = runner.stage_counters()
                rows.append({"transport": runner.transport.kind, "stages": n, "in_flight": micro,
                             "tok_s": r["tok_s"], "decode_tok_s": r["decode_tok_s"], "ideal_tok_s": ideal,
                             "of_ideal_pct": 100 * (r["decode_tok_s"] or 0) / ideal,
                             "stage_idle_pct": [round(100 * c.idle_fraction, 1) for c in counters],
                             **(timeline.breakdown(counters) if micro > 1 else {})})
            runner.close()
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser("pipeline stages on Ray: overhead, idle stages, scaling with stand-in stages")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per stream (default: %(default)s)")
    parser.add_argument("--token-ms", type=float, default=1.0, help="stand-in stage time per token")
    parser.add_argument("--stand-in-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3, help="side-by-side repeats (default: %(default)s)")
    parser.add_argument("--recoveries", type=int, default=5, help="killed-stage runs (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.stand_in_tokens, args.repeats, args.recoveries = 8, 8, 1, 1
    apply_threads(args.threads)
    result: dict[str, Any] = {"machine": machine_info()}
    rows, info = real_model(args)  # starts Ray here (2 CPUs: one per stage)
    stand = stand_in(args)
    result |= {"real_model": rows, **info, "stand_in": stand, "token_ms": args.token_ms}
    result["machine_end"] = machine_info()
    real_cols = ["setup", "streams", "tok_s", "decode_tok_s", "median_step_ms", "overhead_ms", "overhead_pct",
                 "stage_idle_pct", "s0_wait_ms", "return_ms", "head_ms", "dispatch_ms"]
    recs = info["recovery"]
    any_rec = next(iter(recs.values()))
    recovery_cols = ["transport", "detect_s", "recreate_s", "pause_s", "tokens_recomputed"]
    emit("bench_pipeline", [("real model (tokens/s, per-step overhead, stage idle %)",
                             format_table(rows, real_cols)),
                            (f"recovery from a killed last stage, {any_rec['streams']} streams, "
                             f"median of {any_rec['runs']}",
                             format_table([{"transport": k} | {c: r[c] for c in recovery_cols[1:]}
                                           for k, r in recs.items()], recovery_cols)),
                            (f"stand-in stages, {args.token_ms} ms per token per stage, 32 streams",
                             format_table(stand))], result, args.json)
    ray.shutdown()
    return result


if __name__ == "__main__":
    main()
