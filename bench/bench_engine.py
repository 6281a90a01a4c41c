"""Engine benchmark (issue 3): batching throughput, time to first token, cancel latency,
and the prefill saved when a cancelled conversation is continued.

Measures, for the bundled model (or ``--model``) on this machine:

- aggregate decode tokens/s at 1, 4, 16 and 32 concurrent greedy requests (256 tokens
  each, ``ignore_eos``), stepping the synchronous ``Engine``; with the time to first
  token (median, p99) of each level. A level that runs past ``--level-budget`` seconds
  is stopped there (its requests cancelled) and marked ``truncated``: its rates are
  still those of the steps it ran.
- cancel latency: a second thread steps the engine (as AsyncEngine does) while this one
  calls ``engine.abort()`` at random moments and tops the batch up again. Latency runs
  from the ``abort()`` call to the step that returns the cancelled output, in ms and in
  steps, measured here and as the engine records it (``engine.counters``). Every
  forward is recorded too, so a forward that started after the abort and still held the
  request (a breach of contract C1) would be counted.
- prefill saved: a ~1,000-token conversation is cancelled mid-answer (and another
  mid-prefill), then prompted again; the tokens computed for the continuation
  (``engine.stats().computed_tokens``) are compared with a cold run of the same tokens
  on a fresh cache (a second Engine over the same weights).
- where ``llama_cpp`` (llama-cpp-python) is importable, llama.cpp's aggregate tokens/s
  on the same GGUF file, prompts and concurrency levels, every sequence in one batch
  per step; skipped otherwise.
- output processing per token (issue 9): the engine-side cost (the scheduler's update
  and the step's deltas) and the consumer-side cost (detokenizing, a stop string,
  packing) of one generated token, at answer position ~20 and ~2,000, with no model in
  the loop (sampled tokens are given), so it is the output path alone. It must not grow
  with the answer's length.
- with ``--before TREE`` (another commit's checkout, e.g. ``git worktree add
  /tmp/engine-before abfdbbc``): aggregate tokens/s at 1 and 32 streams of that tree's
  engine and this one's, in separate processes, interleaved round by round
  (``engine_level.py``); medians over the rounds.

    python bench/bench_engine.py [--quick] [--json PATH] [--threads N] [--before TREE]
        [--sections throughput,cancel,continue,llama,output,compare]
"""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# The benchmarks share bench/common.py whether run as scripts or loaded by `bargein bench`.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    apply_threads,
    base_parser,
    drive_to_completion,
    emit,
    format_table,
    machine_info,
    median,
    percentile,
    timed,
)
from engine_level import prompt_text as _prompt  # noqa: E402
from rss import measure_rss, rss_section  # noqa: E402

from bargein import Engine, SamplingParams
from bargein.config import CacheConfig, EngineConfig, SchedulerConfig
from bargein.engine.blocks import BlockPool
from bargein.engine.outputs import OutputCollector, OutputProcessor
from bargein.engine.request import FinishReason, Request, Sequence
from bargein.engine.sampler import SampledToken
from bargein.engine.scheduler import Scheduler


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# -- 1. throughput and time to first token ---------------------------------------------
def bench_concurrency(engine: OutputCollector, n: int, max_tokens: int, budget_s: float) -> dict[str, Any]:
    params = _greedy(max_tokens)
    started = time.perf_counter()
    ids = [engine.add_request(_prompt(i), params) for i in range(n)]
    run = drive_to_completion(engine.step, engine.engine.abort, set(ids), started, budget_s)
    wall = time.perf_counter() - started
    ttft = list(run.first.values())
    return {
        "concurrency": n, "max_tokens": max_tokens, "generated": run.generated, "wall_s": wall,
        "aggregate_tok_s": run.generated / wall, "decode_tok_s": run.decode_tok_s,
        "median_step_tok_s": median(tokens / seconds for tokens, seconds in run.decode_steps),
        "ttft_ms_median": median(ttft) * 1e3, "ttft_ms_p99": percentile(ttft, 99) * 1e3,
        "truncated": run.truncated,
    }


# -- 2. cancel latency -------------------------------------------------------------------
class _Stepper:
    """Steps the engine in its own thread (as AsyncEngine does) and records what happened."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.steps = 0  # completed step() calls
        self.cancelled_at: dict[str, tuple[float, int]] = {}  # rid -> (time, steps) when its output came
        self.forwards: list[tuple[float, frozenset[str]]] = []  # (start time, request ids) of each forward
        self.step_times: list[float] = []
        self._stop = threading.Event()
        self._execute = engine.runner.execute
        engine.runner.execute = self._recording_execute  # instance attribute: the class is untouched
        self.thread = threading.Thread(target=self._loop, name="bench-stepper", daemon=True)

    def _recording_execute(self, plan: Any) -> Any:
        self.forwards.append((time.perf_counter(), frozenset(c.request_id for c in plan.chunks)))
        return self._execute(plan)

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            engine.wait_for_work(timeout=0.05)
            if not engine.has_work:
                continue
            start = time.perf_counter()
            deltas = engine.step().deltas
            now = time.perf_counter()
            self.steps += 1
            self.step_times.append(now - start)
            for delta in deltas:
                if delta.finished and delta.finish_reason == FinishReason.CANCELLED:
                    self.cancelled_at[delta.request_id] = (now, self.steps)

    def start(self) -> _Stepper:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.engine.wake()
        self.thread.join()
        del self.engine.runner.execute  # back to the class's method


def bench_cancel(engine: Engine, concurrency: int, cancels: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    engine.counters.cancel_latencies.clear()
    engine.counters.cancel_latency_steps.clear()
    params = _greedy(512)
    stepper = _Stepper(engine).start()
    live: list[str] = []
    counter = [0]

    def add() -> None:
        live.append(engine.add_request(_prompt(1000 + counter[0]), params))
        counter[0] += 1

    samples: list[tuple[float, float, int, int, str]] = []  # (latency s, latency steps, violations, ...)
    try:
        for _ in range(concurrency):
            add()
        while stepper.steps < 3:  # past the first prompts
            time.sleep(0.01)
        for _ in range(cancels):
            typical = median(stepper.step_times[-20:]) or 0.05
            time.sleep(rng.uniform(0.0, 1.5 * typical))  # random phase against the step loop
            rid = live.pop(rng.randrange(len(live)))
            steps_before = stepper.steps
            requested = time.perf_counter()
            engine.abort(rid)
            add()  # keep the batch full
            deadline = time.perf_counter() + 60
            while rid not in stepper.cancelled_at and time.perf_counter() < deadline:
                time.sleep(0.0005)
            if rid not in stepper.cancelled_at:
                samples.append((float("nan"), float("nan"), 0, 0, rid))
                continue
            done, steps_after = stepper.cancelled_at[rid]
            late = sum(1 for t, rids in list(stepper.forwards) if t > requested and rid in rids)
            samples.append((done - requested, steps_after - steps_before, late, 0, rid))
        # Snapshot the engine's own samples before the clean-up aborts below add theirs.
        internal = list(engine.counters.cancel_latencies), list(engine.counters.cancel_latency_steps)
        for rid in live:
            engine.abort(rid)
        deadline = time.perf_counter() + 60
        while engine.live_request_ids() and time.perf_counter() < deadline:
            time.sleep(0.01)
    finally:
        stepper.stop()
    ms = [s[0] * 1e3 for s in samples if s[0] == s[0]]
    steps = [s[1] for s in samples if s[1] == s[1]]
    internal_ms = [x * 1e3 for x in internal[0]]
    internal_steps = internal[1]
    step_ms = median(stepper.step_times) * 1e3
    return {
        "concurrency": concurrency, "cancels": len(samples), "step_ms_median": step_ms,
        "latency_ms_median": median(ms), "latency_ms_p99": percentile(ms, 99), "latency_ms_max": max(ms, default=None),
        "latency_steps_median": median(steps), "latency_steps_p99": percentile(steps, 99),
        "latency_steps_max": max(steps, default=None),
        "latency_in_step_times_p99": percentile(ms, 99) / step_ms if step_ms else None,
        "forwards_after_cancel": sum(s[2] for s in samples),
        "timed_out": sum(1 for s in samples if s[0] != s[0]),
        "engine_latency_ms_median": median(internal_ms), "engine_latency_ms_p99": percentile(internal_ms, 99),
        "engine_latency_steps_median": median(internal_steps),
        "engine_latency_steps_p99": percentile(internal_steps, 99),
        "engine_latency_steps_max": max(internal_steps, default=None),
    }


# -- 3. prefill saved on continuing a cancelled conversation -------------------------------
def _long_prompt(engine: Engine, n_tokens: int, salt: str) -> list[int]:
    paragraph = (f"[{salt}] The committee met again on Tuesday to review the harbour plans. Each member read "
                 "a section aloud, argued about the tides, the cost of stone, and the fishermen's complaints, "
                 "and then voted. ")
    text = ""
    ids: list[int] = []
    while len(ids) < n_tokens:
        text += paragraph
        ids = engine.encode(text)
    return ids[:n_tokens]


def _run_to_end(collector: OutputCollector, rid: str) -> Any:
    final = None
    while final is None or collector.pending:
        for out in collector.step():
            if out.request_id == rid and out.finished:
                final = out
    return final


def bench_continue(engine: Engine, cold: Engine, prompt_tokens: int, cancel_after: int | None) -> dict[str, Any]:
    """Prompt a conversation, cancel it (after ``cancel_after`` tokens, or None: mid-prefill), continue it."""
    salt = "decode" if cancel_after is not None else "prefill"
    prompt = _long_prompt(engine, prompt_tokens, salt)
    sid = engine.open_conversation()
    warm, cool = OutputCollector(engine), OutputCollector(cold)
    rid = warm.add_request(prompt, _greedy(4 * (cancel_after or 1) + 64), conversation_id=sid)
    delivered = 0
    if cancel_after is None:
        warm.step()  # the first prompt chunk is computed, the rest is still pending
    else:
        while delivered < cancel_after:
            delivered += sum(len(o.new_token_ids) for o in warm.step() if o.request_id == rid)
    engine.abort(rid)
    cancelled = _run_to_end(warm, rid)
    conv_tokens = engine.conversation_tokens(sid)
    follow = engine.tokenizer.encode("\nUser: Go on, and summarise the vote.\nAssistant:", add_special_tokens=False)

    before = engine.stats().computed_tokens
    seconds, out = timed(lambda: _run_to_end(warm, warm.add_request(follow, _greedy(1), conversation_id=sid)))
    computed = engine.stats().computed_tokens - before
    engine.close_conversation(sid)

    full = conv_tokens + follow
    cold_before = cold.stats().computed_tokens
    cold_seconds, cold_out = timed(lambda: _run_to_end(cool, cool.add_request(full, _greedy(1))))
    cold_computed = cold.stats().computed_tokens - cold_before
    same = list(out.token_ids) == list(cold_out.token_ids)
    return {
        "case": "cancel mid-answer" if cancel_after is not None else "cancel mid-prefill",
        "conversation_tokens": len(conv_tokens), "delivered_before_cancel": len(cancelled.token_ids),
        "continuation_prompt_tokens": out.usage.prompt_tokens, "cached_tokens": out.usage.cached_tokens,
        "computed": computed, "cold_computed": cold_computed,
        "saved_pct": 100.0 * (1 - computed / cold_computed) if cold_computed else float("nan"),
        "cached_pct": 100.0 * out.usage.cached_tokens / out.usage.prompt_tokens if out.usage.prompt_tokens else None,
        "continue_ms": seconds * 1e3, "cold_ms": cold_seconds * 1e3, "same_next_token": same,
    }


# -- 4. llama.cpp, where installed ----------------------------------------------------------
def bench_llama_cpp(engine: Engine, model_ref: str | None, threads: int, levels: tuple[int, ...],
                    max_tokens: int, budget_s: float) -> list[dict[str, Any]]:
    """llama.cpp on the same GGUF, the same prompts (our tokenizer; the vocabulary is the
    GGUF's) and the same concurrency levels: one ``llama_decode`` per step over every
    sequence, greedy, as bargein's engine does it. One row per level, or one row saying
    why it was skipped."""
    try:
        import llama_cpp  # type: ignore[import-not-found]
    except ImportError:
        return [{"skipped": "llama_cpp (llama-cpp-python) is not installed"}]
    from bargein.loader import resolve_model_ref

    source = resolve_model_ref(model_ref)
    if not str(source.path).endswith(".gguf"):
        return [{"skipped": "the model is not a GGUF file"}]
    try:
        return _LlamaCpp(llama_cpp, str(source.path), threads).run_levels(
            [engine.encode(_prompt(i)) for i in range(max(levels))], levels, max_tokens, budget_s)
    except Exception as exc:  # optional comparison: report, never fail the benchmark
        return [{"skipped": f"llama_cpp failed: {type(exc).__name__}: {exc}"}]


class _LlamaCpp:
    """llama.cpp's low-level API (the high-level ``Llama`` drives one sequence only)."""

    def __init__(self, llama_cpp: Any, path: str, threads: int):
        self.lib, self.threads = llama_cpp, threads
        self._quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)  # kept alive here
        llama_cpp.llama_log_set(self._quiet, None)
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.version = getattr(llama_cpp, "__version__", "?")

    def run_levels(self, prompts: list[list[int]], levels: tuple[int, ...], max_tokens: int,
                   budget_s: float) -> list[dict[str, Any]]:
        try:
            return [self.run(prompts[:n], max_tokens, budget_s) for n in levels]
        finally:
            self.lib.llama_model_free(self.model)

    def run(self, prompts: list[list[int]], max_tokens: int, budget_s: float) -> dict[str, Any]:
        import numpy as np

        lib, n = self.lib, len(prompts)
        params = lib.llama_context_default_params()
        params.n_seq_max = n
        params.n_ctx = n * (max(map(len, prompts)) + max_tokens + 16)
        params.n_batch = params.n_ubatch = max(512, sum(map(len, prompts)))
        params.n_threads = params.n_threads_batch = self.threads
        ctx = lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {n} sequences")
        batch = lib.llama_batch_init(params.n_batch, 0, 1)
        try:
            def decode(rows: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, logits)
                for i, (token, pos, seq, logits) in enumerate(rows):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                    batch.seq_id[i][0], batch.logits[i] = seq, logits
                batch.n_tokens = len(rows)
                if lib.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")

            def greedy(index: int) -> int:
                logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, index), shape=(self.n_vocab,))
                return int(logits.argmax())

            started = time.perf_counter()
            decode([(tok, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, tok in enumerate(p)])
            ends = list(itertools.accumulate(map(len, prompts)))
            last = [greedy(end - 1) for end in ends]
            ttft = time.perf_counter() - started
            generated, decode_start = n, time.perf_counter()
            for step in range(max_tokens - 1):
                if time.perf_counter() - started > budget_s:
                    break
                decode([(tok, len(p) + step, seq, True) for seq, (tok, p) in enumerate(zip(last, prompts, strict=True))])
                last = [greedy(i) for i in range(n)]
                generated += n
            now = time.perf_counter()
            return {"concurrency": n, "generated": generated, "wall_s": now - started,
                    "aggregate_tok_s": generated / (now - started),
                    "decode_tok_s": (generated - n) / (now - decode_start) if generated > n else float("nan"),
                    "ttft_ms": ttft * 1e3, "threads": self.threads, "version": self.version}
        finally:
            lib.llama_batch_free(batch)
            lib.llama_free(ctx)


# -- 5. output processing per token, by answer position ------------------------------------
def bench_output_cost(tokenizer: Any, positions: tuple[int, ...] = (20, 2000), window: int = 20,
                      repeats: int = 5) -> list[dict[str, Any]]:
    """Per-token cost of the output path at each answer position: engine side (the
    scheduler applying a sampled token and making the step's deltas) and consumer side
    (the request's OutputProcessor: detokenizing, a stop string, packing). No model: the
    sampled tokens are given, so only the output path is timed. Medians over a window of
    ``window`` tokens around each position and over ``repeats`` fresh requests."""
    text = "The committee met again on Tuesday to review the harbour plans, and argued about the tides. "
    answer = tokenizer.encode(text * 8, add_special_tokens=False)
    length = max(positions) + window
    block_size = 16
    engine_ns: dict[int, list[float]] = {p: [] for p in positions}
    consumer_ns: dict[int, list[float]] = {p: [] for p in positions}
    for r in range(repeats):
        pool = BlockPool(-(-(length + 64) // block_size) + 4, block_size)
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512), pool,
                              length + 64, frozenset())
        params = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True, stop=["</answer>"])
        rid = f"cost-{r}"
        scheduler.ids.claim(rid)
        prompt = answer[:16]
        scheduler.add(Request(rid, Sequence(rid, list(prompt)), params, len(prompt), len(prompt)))
        processor = OutputProcessor(rid, params, tokenizer)
        per_engine, per_consumer = [], []
        for i in range(length):
            plan = scheduler.schedule()
            token = answer[i % len(answer)]
            t0 = time.perf_counter_ns()
            scheduler.update(plan, {rid: SampledToken(token, None, ())})
            outcome = scheduler.take_outcome()
            t1 = time.perf_counter_ns()
            for delta in outcome.deltas:
                processor.process(delta)
            t2 = time.perf_counter_ns()
            per_engine.append(t1 - t0)
            per_consumer.append(t2 - t1)
        for p in positions:
            lo = max(0, p - window // 2)
            engine_ns[p] += per_engine[lo:lo + window]
            consumer_ns[p] += per_consumer[lo:lo + window]
    rows = []
    for p in positions:
        e, c = median(engine_ns[p]) / 1e3, median(consumer_ns[p]) / 1e3
        rows.append({"answer_position": p, "engine_us_per_token": e, "consumer_us_per_token": c,
                     "total_us_per_token": e + c})
    for row in rows:
        row[f"vs_position_{positions[0]}"] = row["total_us_per_token"] / rows[0]["total_us_per_token"]
    return rows


# -- 6. throughput before / after, another tree's engine in its own processes ---------------
def bench_before_after(before: str, levels: tuple[int, ...], seconds: float, rounds: int, max_tokens: int,
                       threads: int | None, model: str | None) -> dict[str, Any]:
    """Runs ``engine_level.py`` with PYTHONPATH set to each tree, alternating which goes
    first each round; returns the runs and the medians per tree and level."""
    script = str(Path(__file__).resolve().parent / "engine_level.py")
    trees = {"before": str(Path(before).resolve()), "after": str(Path(__file__).resolve().parent.parent)}
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        for name in (["before", "after"] if r % 2 == 0 else ["after", "before"]):
            cmd = [sys.executable, script, "--levels", ",".join(map(str, levels)), "--seconds", str(seconds),
                   "--max-tokens", str(max_tokens)]
            if threads:
                cmd += ["--threads", str(threads)]
            if model:
                cmd += ["--model", model]
            env = {**os.environ, "PYTHONPATH": trees[name]}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                runs.append({"tree": name, "round": r, "error": proc.stderr.strip().splitlines()[-1:]})
                continue
            for line in proc.stdout.splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    runs.append({"tree": name, "round": r, **row})
                    print(f"  {name} round {r}: {row['level']} streams {row['tok_s']:.1f} tok/s", flush=True)
    summary = []
    for level in levels:
        row: dict[str, Any] = {"streams": level}
        for name in ("before", "after"):
            rates = [x["tok_s"] for x in runs if x.get("tree") == name and x.get("level") == level]
            row[f"{name}_tok_s_median"] = median(rates)
            row[f"{name}_runs"] = len(rates)
        row["after_vs_before"] = row["after_tok_s_median"] / row["before_tok_s_median"]
        summary.append(row)
    return {"before_tree": trees["before"], "seconds_per_level": seconds, "rounds": rounds,
            "runs": runs, "summary": summary}


# -- main ----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=["exact", "fast"], default=EngineConfig.precision,
                        help="the engine's precision mode (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 256; quick 16)")
    parser.add_argument("--level-budget", type=float, default=None,
                        help="seconds one concurrency level may run (default 120; quick 5)")
    parser.add_argument("--cancels", type=int, default=None, help="cancels to measure (default 24; quick 8)")
    parser.add_argument("--before", metavar="TREE", default=None,
                        help="another checkout whose engine to compare throughput with (1 and 32 streams)")
    parser.add_argument("--compare-seconds", type=float, default=25.0, help="seconds per level and round (--before)")
    parser.add_argument("--compare-rounds", type=int, default=3, help="rounds of the before/after comparison")
    parser.add_argument("--sections", default="rss,throughput,cancel,continue,llama,output,compare",
                        help="which parts to run (comma-separated)")
    parser.add_argument("--kv-tokens", type=int, default=2048, help="KV capacity of the RSS runs (default %(default)s)")
    args = parser.parse_args(argv)
    sections_wanted = set(args.sections.split(","))
    apply_threads(args.threads)
    quick = args.quick
    max_tokens = args.max_tokens or (16 if quick else 256)
    budget = args.level_budget or (5.0 if quick else 120.0)
    cancels = args.cancels or (8 if quick else 24)
    levels = (1, 4, 16, 32)

    rss_rows = measure_rss(args.model, args.kv_tokens, threads=args.threads) if "rss" in sections_wanted else []
    config = EngineConfig(precision=args.precision)
    load_s, engine = timed(lambda: Engine.from_pretrained(args.model, config, progress=False))
    info = machine_info()
    print(f"loaded {engine.model_name} in {load_s:.1f}s; torch threads {info['torch_threads']}, "
          f"load average {info.get('loadavg_1m')}", flush=True)
    started = time.perf_counter()
    engine.generate([_prompt(0)], _greedy(4))  # warm-up

    output_cost = bench_output_cost(engine.tokenizer) if "output" in sections_wanted else []
    for row in output_cost:
        print(f"  output path at token {row['answer_position']}: {row['total_us_per_token']:.1f} us/token", flush=True)
    compare = None
    if args.before and "compare" in sections_wanted:
        compare = bench_before_after(args.before, (1, 32), args.compare_seconds, args.compare_rounds, max_tokens,
                                     args.threads, args.model)

    throughput = []
    for n in (levels if "throughput" in sections_wanted else ()):
        throughput.append(bench_concurrency(OutputCollector(engine), n, max_tokens, budget))
        row = throughput[-1]
        print(f"  {n} concurrent: {row['aggregate_tok_s']:.1f} tok/s aggregate, "
              f"ttft {row['ttft_ms_median']:.0f} ms{' (truncated)' if row['truncated'] else ''}", flush=True)

    cancel: dict[str, Any] = {}
    if "cancel" in sections_wanted:
        cancel = bench_cancel(engine, 8, cancels)
        print(f"  cancel: median {cancel['latency_ms_median']:.0f} ms, p99 {cancel['latency_steps_p99']} steps",
              flush=True)

    prompt_tokens = 1000
    cont: list[dict[str, Any]] = []
    if "continue" in sections_wanted:
        cold = Engine(engine.runner.stages, engine.tokenizer,
                      EngineConfig(cache=CacheConfig(memory_bytes=96 * 1024**2), precision=args.precision),
                      model_name=engine.model_name)
        cont = [bench_continue(engine, cold, prompt_tokens, cancel_after=8 if quick else 16)]
        if not quick:  # the mid-prefill case costs two more long prefills
            cont.append(bench_continue(engine, cold, prompt_tokens, cancel_after=None))
        print(f"  continue after cancel: {cont[0]['saved_pct']:.1f}% of prefill saved", flush=True)

    llama = (bench_llama_cpp(engine, args.model, info["torch_threads"], levels, max_tokens, budget)
             if "llama" in sections_wanted else [])
    info["loadavg_1m_end"] = machine_info().get("loadavg_1m")
    for row in throughput:  # same-run ratios: ours over llama.cpp's aggregate tokens/s
        theirs = next((r for r in llama if r.get("concurrency") == row["concurrency"]), None)
        if theirs is not None:
            row["vs_llama_cpp"] = row["aggregate_tok_s"] / theirs["aggregate_tok_s"]

    targets: dict[str, Any] = {}
    at32 = next((r for r in throughput if r["concurrency"] == 32), None)
    if at32 is not None:
        targets["aggregate_tok_s_at_32"] = {"target": 400, "measured": at32["aggregate_tok_s"],
                                            "met": at32["aggregate_tok_s"] >= 400}
    if cancel:
        targets["cancel_latency_steps_p99"] = {
            "target": 1, "measured": cancel["latency_steps_p99"],
            "met": cancel["latency_steps_p99"] <= 1 and cancel["forwards_after_cancel"] == 0}
    if cont:
        targets["prefill_saved_pct"] = {"target": 95, "measured": cont[0]["saved_pct"],
                                        "met": cont[0]["saved_pct"] >= 95}
    if output_cost:
        ratio = output_cost[-1]["total_us_per_token"] / output_cost[0]["total_us_per_token"]
        targets["output_cost_at_2000_vs_20"] = {"target": 1.1, "measured": ratio, "met": ratio <= 1.1}
    rss_vs_llama = next((r["above_floor_vs_llama_cpp"] for r in rss_rows if "above_floor_vs_llama_cpp" in r), None)
    if rss_vs_llama is not None:  # the first row is the default configuration
        targets["rss_above_floor_vs_llama_cpp"] = {"target": 1.5, "measured": rss_vs_llama,
                                                   "met": rss_vs_llama <= 1.5}
    if compare is not None:
        for row in compare["summary"]:
            targets[f"tok_s_after_vs_before_{row['streams']}_streams"] = {
                "target": 1.0, "measured": row["after_vs_before"], "met": row["after_vs_before"] >= 1.0}
    result = {
        "benchmark": "engine", "model": engine.model_name, "precision": args.precision, "quick": quick,
        "load_s": load_s,
        "throughput": throughput, "cancel": cancel, "continue_after_cancel": cont, "llama_cpp": llama,
        "output_cost": output_cost, "before_after": compare, "rss": rss_rows,
        "targets": targets, "machine": info, "seconds": time.perf_counter() - started + load_s,
    }

    target_rows = [{"target": k, "goal": v["target"], "measured": v["measured"], "met": v["met"]}
                   for k, v in targets.items()]
    sections = []
    if throughput:
        sections.append((
            f"Throughput ({max_tokens} greedy tokens per request, ignore_eos; decode_tok_s = steps with every "
            "request decoding; median_step_tok_s = median over those steps)",
            format_table(throughput, ["concurrency", "generated", "wall_s", "aggregate_tok_s", "decode_tok_s",
                                      "median_step_tok_s", "ttft_ms_median", "ttft_ms_p99", "truncated",
                                      "vs_llama_cpp"])))
    if cancel:
        cancel_rows = [
            {"measured by": "abort() -> cancelled output (here)", "median_ms": cancel["latency_ms_median"],
             "p99_ms": cancel["latency_ms_p99"], "median_steps": cancel["latency_steps_median"],
             "p99_steps": cancel["latency_steps_p99"], "max_steps": cancel["latency_steps_max"]},
            {"measured by": "engine.counters", "median_ms": cancel["engine_latency_ms_median"],
             "p99_ms": cancel["engine_latency_ms_p99"], "median_steps": cancel["engine_latency_steps_median"],
             "p99_steps": cancel["engine_latency_steps_p99"], "max_steps": cancel["engine_latency_steps_max"]},
        ]
        sections.append((
            f"Cancel latency ({cancel['cancels']} aborts from another thread at random moments, "
            f"{cancel['concurrency']} running; median step {cancel['step_ms_median']:.0f} ms; "
            f"forwards holding a request after its abort: {cancel['forwards_after_cancel']})",
            format_table(cancel_rows)))
    if cont:
        sections.append((
            f"Continuing a cancelled ~{prompt_tokens}-token conversation (computed tokens vs a cold run)",
            format_table(cont, ["case", "conversation_tokens", "continuation_prompt_tokens", "cached_tokens",
                                "computed", "cold_computed", "saved_pct", "continue_ms", "cold_ms",
                                "same_next_token"])))
    if llama:
        sections.append(("llama.cpp on the same GGUF, same prompts and levels (optional; where "
                         "llama-cpp-python is installed)", format_table(llama)))
    if output_cost:
        sections.append(("Output path per generated token, by answer position (engine side: the scheduler "
                         "applying the token and the step's deltas; consumer side: detokenizing, a stop string; "
                         "no model; medians over 20 tokens x 5 requests)", format_table(output_cost)))
    if compare is not None:
        sections.append((f"Throughput before ({compare['before_tree']}) and after, tokens/s, medians over "
                         f"{compare['rounds']} interleaved rounds of {compare['seconds_per_level']:.0f} s per level "
                         "(each tree in its own process; the level is kept full)",
                         format_table(compare["summary"])))
    if rss_rows:
        sections.append(rss_section(rss_rows, args.kv_tokens))
    sections.append(("Targets (issues 3, 9 and 11)", format_table(target_rows)))
    emit(f"bargein engine benchmark ({engine.model_name}, precision {args.precision})", sections, result, args.json)
    return result


if __name__ == "__main__":
    main()
