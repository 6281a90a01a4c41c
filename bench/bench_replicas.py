"""Engine replicas on Ray (issue 17): router overhead, prefix-hit rate by routing policy,
and throughput of 1-4 replicas against the ideal.

Three measurements, on a local Ray instance started here:

1. **Router overhead per request.** ``Router.choose`` alone on a long prompt with a
   filled index; ``ReplicaSet.submit`` (route + dispatch, the head's cost on the event
   loop); and the round trip of a one-token request through a replica against the same
   stand-in engine in this process (the extra milliseconds are the Ray hops and the poll).
2. **Prefix-hit rate, conversation-affine vs round-robin** (and least-loaded), on a
   multi-turn workload: conversations of several turns, run concurrently, each answer
   ended by stop strings (so the next turn continues from the delivered text, token-exact),
   on 3 tiny-model replicas. The rate is the engines' own count: cached prompt tokens
   over prompt tokens, of the turns after the first (the first turn cannot hit).
3. **Throughput of 1-4 replicas** whose engine is a stand-in (the real scheduler and
   sampler, a runner that sleeps a fixed time per step): 2 cores cannot show scaling
   with real forwards, a sleeping runner can. Ideal = replicas x batch / step time.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402
import torch  # noqa: E402
from common import base_parser, emit, format_table, machine_info, median  # noqa: E402

from bargein.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from bargein.distributed.replicas import BuildWith, ReplicaOptions, ReplicaSet, start_replicas  # noqa: E402
from bargein.distributed.router import Router  # noqa: E402
from bargein.engine.async_engine import AsyncEngine  # noqa: E402
from bargein.engine.block_keys import KeyChanges  # noqa: E402
from bargein.engine.engine import Engine  # noqa: E402
from bargein.engine.plan import StepPlan  # noqa: E402
from bargein.engine.runner import RunnerHealth, RunnerInfo, StepResult  # noqa: E402
from bargein.engine.sampling import SamplingParams  # noqa: E402

SMALL_KV_BLOCKS = 128  # 512 tokens per replica: about half of the conversations it holds (evictions)
TINY_KV_BLOCKS = 48  # 192 tokens per replica: the cache thrashes
NEW_TURN_TOKENS = 12  # a user turn's new tokens: the part of a continuation no cache can hold
STAND_IN = ModelConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, max_position_embeddings=4096)


class StandInRunner:
    """A runner that sleeps ``step_s`` per plan and returns zero logits (greedy token 0)."""

    max_in_flight = 1

    def __init__(self, step_s: float, num_blocks: int = 1024):
        self.step_s = step_s
        self.model_config = STAND_IN
        self.num_blocks = num_blocks
        self.device = torch.device("cpu")
        self._plan: StepPlan | None = None

    @property
    def num_in_flight(self) -> int:
        return int(self._plan is not None)

    def submit(self, plan: StepPlan) -> None:
        self._plan = plan

    def collect(self) -> StepResult:
        plan, self._plan = self._plan, None
        assert plan is not None
        if self.step_s:
            time.sleep(self.step_s)
        return StepResult(plan, torch.zeros(len(plan.sampled), STAND_IN.vocab_size))

    def close(self) -> None:
        pass

    row_sampling = None

    def health(self) -> RunnerHealth:
        return RunnerHealth()

    def wait_ready(self, timeout: float) -> bool:
        return True

    def describe(self) -> RunnerInfo:
        return RunnerInfo(self.num_blocks, self.max_in_flight, ())


class _Bytes:
    vocab_size = 260
    bos_token_id = None
    eos_token_ids = frozenset({256})
    special_token_ids = frozenset({256, 257, 258, 259})
    chat_template = None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def token_bytes(self, token_id: int, *, skip_special_tokens: bool = True) -> bytes:
        return bytes([token_id]) if token_id < 256 else b""

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return b"".join(self.token_bytes(t) for t in ids).decode(errors="replace")


def stand_in_engine(step_s: float, max_num_seqs: int) -> Engine:
    torch.set_num_threads(1)
    config = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=1024),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512),
                          device="cpu", dtype="float32")
    return Engine(StandInRunner(step_s), _Bytes(), config, model_name="stand-in")


def tiny_model_engine(num_blocks: int = 1024) -> Engine:
    from tests.tiny_engine import tiny_engine

    torch.set_num_threads(1)
    return tiny_engine(num_blocks=num_blocks, block_size=4, max_num_seqs=16, max_num_batched_tokens=256)


async def one(group: Any, prompt: list[int], params: SamplingParams) -> Any:
    rid, stream = group.submit(prompt, params)
    while True:
        out = await group.next_output(stream)
        if out.finished:
            return out


# -- 1. router overhead ---------------------------------------------------------------------
def router_overhead(args: Any) -> dict[str, Any]:
    rng = random.Random(0)
    router = Router(num_replicas=4, block_size=16)
    prompts = [[rng.randrange(256) for _ in range(2048)] for _ in range(64)]
    for p in prompts:  # each replica reports the prompts it computed
        route = router.choose(p)
        router.apply(route.replica, KeyChanges(keys=dict.fromkeys(route.hashes, True)))
        router.finished(route)
    samples, applied = [], []
    for p in prompts * 4:
        started = time.perf_counter()
        route = router.choose(p + [1, 2, 3])
        router.finished(route)
        samples.append(time.perf_counter() - started)
        report = KeyChanges(keys=dict.fromkeys(route.hashes[-8:], True))  # a step's worth of new blocks
        started = time.perf_counter()
        router.apply(route.replica, report)
        applied.append(time.perf_counter() - started)
    choose_ms = 1000 * median(samples)

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    group = start_replicas(BuildWith(lambda: stand_in_engine(0.0, 8)), 1, ReplicaOptions(num_cpus=0.5))
    local = AsyncEngine(stand_in_engine(0.0, 8))

    async def round_trips(engine: Any, n: int) -> tuple[list[float], list[float]]:
        submit_s, total_s = [], []
        for _ in range(n):
            prompt = [rng.randrange(256) for _ in range(32)]
            started = time.perf_counter()
            rid, stream = engine.submit(prompt, params)
            submit_s.append(time.perf_counter() - started)
            while not (await engine.next_output(stream)).finished:
                pass
            total_s.append(time.perf_counter() - started)
        return submit_s, total_s

    n = 40 if args.quick else 200
    asyncio.run(round_trips(group, 5))
    r_submit, r_total = asyncio.run(round_trips(group, n))
    l_submit, l_total = asyncio.run(round_trips(local, n))
    group.close()
    asyncio.run(local.shutdown())
    return {"choose_2k_prompt_ms": choose_ms, "apply_8_keys_ms": 1000 * median(applied), "submit_ms": 1000 * median(r_submit),
            "round_trip_ms": 1000 * median(r_total), "local_round_trip_ms": 1000 * median(l_total),
            "overhead_ms": 1000 * (median(r_total) - median(l_total)), "requests": n}


# -- 2. prefix-hit rate by policy -------------------------------------------------------------
def hit_rates(args: Any) -> list[dict[str, Any]]:
    """Each policy on 3 replicas with room for everything; then replicas whose KV pools
    hold about half of their conversations (evictions), and a third that thrashes. Each
    row also checks the router's index against the replicas' caches once all is done
    (``index_vs_cache_diff``: keys in one and not the other; 0 when the reports keep it
    exact)."""
    conversations, turns = (7, 3) if args.quick else (19, 4)
    rows = []
    for k, (policy, blocks) in enumerate((("affine", 1024), ("round_robin", 1024), ("least_loaded", 1024),
                                          ("affine", SMALL_KV_BLOCKS), ("round_robin", SMALL_KV_BLOCKS),
                                          ("affine", TINY_KV_BLOCKS))):
        group = start_replicas(BuildWith(functools.partial(tiny_model_engine, blocks)), 3,
                                  ReplicaOptions(num_cpus=0.5, routing=policy))
        try:
            row = asyncio.run(_conversations(group, policy, conversations, turns, seed=1000 * (k % 3 + 1)))
            row["kv_blocks"] = blocks
            row["evictions"] = sum(info.evictions for info in group.replica_infos().values())
            # The index against the caches, once every output (and cache report) is in.
            time.sleep(1.0)
            truth = group._gather("registered_keys")
            row["index_vs_cache_diff"] = sum(len(keys ^ group.router.held_keys(i)) for i, keys in truth.items())
            row["index_blocks"] = sum(len(keys) for keys in truth.values())
            rows.append(row)
        finally:
            group.close()
    return rows


async def _conversations(group: ReplicaSet, policy: str, conversations: int, turns: int, seed: int) -> dict:
    """Each conversation runs its turns one after another, all conversations at once, with a
    short random pause between turns (so turns of different conversations interleave)."""
    rng = random.Random(seed)
    # Stop strings on 16 letters: most answers end early, where the router cannot predict.
    stop = tuple("abcdefghijklmnop")
    totals = {"prompt": 0, "cached": 0, "later_prompt": 0, "later_cached": 0, "later_possible": 0, "stopped": 0, "answers": 0}

    async def conversation(c: int) -> None:
        history = [rng.randrange(32, 127) for _ in range(40)]
        for turn in range(turns):
            await asyncio.sleep(rng.uniform(0, 0.03))
            params = SamplingParams(max_tokens=24, temperature=0.9, seed=rng.randrange(2**31), stop=stop)
            out = await one(group, history, params)
            totals["prompt"] += out.usage.prompt_tokens
            totals["cached"] += out.usage.cached_tokens
            if turn:
                totals["later_prompt"] += out.usage.prompt_tokens
                totals["later_cached"] += out.usage.cached_tokens
                totals["later_possible"] += out.usage.prompt_tokens - NEW_TURN_TOKENS
            totals["stopped"] += out.finish_reason.value == "stop"
            totals["answers"] += 1
            history = history + list(out.token_ids) + [rng.randrange(32, 127) for _ in range(NEW_TURN_TOKENS)]

    await asyncio.gather(*(conversation(c) for c in range(conversations)))
    routing = group.router.snapshot()
    predicted = sum(r["predicted_hit_tokens"] for r in routing) / sum(r["prompt_tokens"] for r in routing)
    return {"policy": policy, "conversations": conversations, "turns": turns,
            "predicted_hit_rate_all_turns": predicted,
            "ended_by_stop_pct": 100 * totals["stopped"] / totals["answers"],
            "hit_rate_after_first_turn": totals["later_cached"] / totals["later_prompt"],
            "ceiling": totals["later_possible"] / totals["later_prompt"],  # all but the new turn's tokens
            "hit_rate_all_turns": totals["cached"] / totals["prompt"]}


# -- 3. throughput of 1-4 stand-in replicas ------------------------------------------------------
def throughput(args: Any) -> list[dict[str, Any]]:
    step_s, batch = args.step_ms / 1000, 8
    tokens = 16 if args.quick else 48
    rows = []
    for n in (1, 2, 3, 4):
        group = start_replicas(BuildWith(lambda: stand_in_engine(step_s, batch)), n, ReplicaOptions(num_cpus=0.5))
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        rng = random.Random(n)

        async def run(requests: int, group: ReplicaSet = group, params: SamplingParams = params,
                      rng: random.Random = rng) -> float:
            prompts = [[rng.randrange(256) for _ in range(8)] for _ in range(requests)]
            started = time.perf_counter()
            outs = await asyncio.gather(*(one(group, p, params) for p in prompts))
            assert all(o.usage.completion_tokens == tokens for o in outs)
            return requests * tokens / (time.perf_counter() - started)

        asyncio.run(run(batch * n))  # warm-up
        measured = median([asyncio.run(run(2 * batch * n)) for _ in range(1 if args.quick else 3)])
        group.close()
        # Ideal: every replica runs a full batch every step (prefill steps included: one per batch).
        ideal = n * batch / step_s * tokens / (tokens + 1)
        rows.append({"replicas": n, "tok_s": measured, "ideal_tok_s": ideal, "of_ideal_pct": 100 * measured / ideal})
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser("engine replicas on Ray: router overhead, prefix-hit rate by policy, scaling")
    parser.add_argument("--step-ms", type=float, default=40.0, help="stand-in replica time per step")
    parser.add_argument("--only", choices=("router", "hits", "scaling"), default=None,
                        help="run one of the three measurements")
    args = parser.parse_args(argv)
    root = str(Path(__file__).resolve().parent.parent)  # the replicas import bargein and tests from here
    os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    result: dict[str, Any] = {"machine": machine_info()}
    overhead = router_overhead(args) if args.only in (None, "router") else {}
    hits = hit_rates(args) if args.only in (None, "hits") else []
    scaling = throughput(args) if args.only in (None, "scaling") else []
    result |= {"router": overhead, "hit_rates": hits, "scaling": scaling, "step_ms": args.step_ms,
               "machine_end": machine_info()}
    emit("bench_replicas", [
        ("router overhead per request (ms, medians)", format_table([overhead])),
        ("prefix-hit rate on a multi-turn workload with stops (3 tiny-model replicas)", format_table(hits)),
        (f"throughput of stand-in replicas ({args.step_ms:g} ms per step, batch 8)", format_table(scaling)),
    ], result, args.json)
    ray.shutdown()
    return result


if __name__ == "__main__":
    main()
