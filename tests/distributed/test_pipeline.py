"""The model split into pipeline stages on a Ray cluster (issue 12, contract C8).

Every test compares against the single-process engine on the same file: logits to
float32 rounding, greedy tokens exactly. Two set-ups share one simulated cluster
(``tests/ray_cluster.py``): 2 stages over the GGUF (Q8_0) split automatically by node
memory, with stage 1's weights shipped by the head; 3 stages over a bfloat16
safetensors folder, with stage 2's weights shipped.
"""

from __future__ import annotations

import asyncio
import pickle
import time
from dataclasses import dataclass

import httpx
import pytest
import torch

ray = pytest.importorskip("ray")

from bargein.build import build_engine  # noqa: E402
from bargein.cli.cluster import format_cluster  # noqa: E402
from bargein.config import CacheConfig, EngineConfig, PipelineConfig, SchedulerConfig  # noqa: E402
from bargein.distributed.pipeline import PipelineRunner  # noqa: E402
from bargein.distributed.stage import held_weights  # noqa: E402
from bargein.distributed.worker_env import describe_wait_policy  # noqa: E402
from bargein.engine.async_engine import AsyncEngine  # noqa: E402
from bargein.engine.engine import Engine  # noqa: E402
from bargein.engine.plan import ScheduledChunk, StepPlan  # noqa: E402
from bargein.engine.request import CancelReason, FinishReason  # noqa: E402
from bargein.engine.sampling import SamplingParams  # noqa: E402
from bargein.server.app import create_app, finish_shutdown  # noqa: E402
from bargein.server.settings import ServerSettings  # noqa: E402
from tests.pipeline_plans import check_a_failing_plan_fails_alone  # noqa: E402
from tests.tiny_models import TinySpec, tiny_weights, write_gguf, write_hf_folder  # noqa: E402

SPEC = TinySpec(num_layers=6)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@dataclass
class Setup:
    name: str
    local: Engine
    pipe: Engine
    ranges: tuple[tuple[int, int], ...]
    shipped_stage: int
    stored_bytes: int  # what the shipped stage's tensors take as stored


def _config(**pipeline) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(block_size=4, num_blocks=40),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
                        device="cpu", dtype="float32",
                        pipeline=PipelineConfig(**pipeline) if pipeline else None)


@pytest.fixture(scope="module", params=["gguf-2", "hf-3"])
def setup(request, ray_cluster, tmp_path_factory) -> Setup:
    folder = tmp_path_factory.mktemp("pipeline-model")
    weights = tiny_weights(SPEC)
    if request.param == "gguf-2":
        path = write_gguf(folder / "tiny.gguf", SPEC, weights, tensor_type="Q8_0")
        pipeline = {"stages": 2, "ship_weights": (1,)}
        ranges = ((0, 4), (4, 6))  # nodes of 600 and 400 MB: 3.6 and 2.4 layers
        # Q8_0: 34 bytes per 32 values for the matrices, float32 norms
        per_layer = 4 * (2 * SPEC.hidden_size) + 34 * (
            2 * 64 * 64 // 32 + 2 * 64 * 32 // 32 + 3 * 64 * 128 // 32)
        stored = 2 * per_layer + 4 * SPEC.hidden_size + 34 * SPEC.vocab_size * 64 // 32
    else:
        path = write_hf_folder(folder / "tiny-hf", SPEC, weights, dtype=torch.bfloat16)
        pipeline = {"stages": 3, "ship_weights": (2,)}
        ranges = ((0, 3), (3, 5), (5, 6))  # 600, 400, 200 MB: 3, 2 and 1 layers
        per_layer = 2 * (2 * 64 + 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)
        stored = per_layer + 2 * SPEC.hidden_size + 2 * SPEC.vocab_size * 64
    local = Engine.from_pretrained(str(path), _config(), progress=False)
    pipe = build_engine(str(path), _config(**pipeline), progress=False)
    yield Setup(request.param, local, pipe, ranges, pipeline["ship_weights"][0], stored)
    pipe.close()


def _run(engine: Engine, ids: list[str], *, on_step=None) -> dict[str, tuple[list[int], FinishReason]]:
    """Steps until every id finished; returns each one's tokens and finish reason."""
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    done: dict[str, tuple[list[int], FinishReason]] = {}
    steps = 0
    while len(done) < len(ids):
        outcome = engine.step()
        steps += 1
        assert steps < 500, "the engine stopped making progress"
        for delta in outcome.deltas:
            if delta.request_id in tokens:
                tokens[delta.request_id] += delta.new_token_ids
                if delta.finished:
                    done[delta.request_id] = (tokens[delta.request_id], delta.finish_reason)
        if on_step is not None:
            on_step(engine, tokens)
    return done


def _check_idle_accounting(engine: Engine) -> None:
    engine.check_block_accounting()
    assert engine.pool.num_referenced == 0, "blocks still referenced with nothing running"
    assert not engine.scheduler.requests and not engine.runner.num_in_flight


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, SPEC.vocab_size, (n,), generator=g).tolist()


def test_layers_follow_node_memory_and_shipped_weights_are_counted(setup: Setup) -> None:
    runner: PipelineRunner = setup.pipe.runner
    assert tuple(p.layers for p in runner.placements) == setup.ranges
    counters = runner.stage_counters()
    sources = ["head" if i == setup.shipped_stage else "file" for i in range(len(counters))]
    assert [c.weights_from for c in counters] == sources
    received = [c.weights_received_bytes for c in counters]
    assert received == [setup.stored_bytes if i == setup.shipped_stage else 0 for i in range(len(counters))]
    assert runner.traffic.weights_shipped_bytes == setup.stored_bytes


def test_every_stage_holds_the_single_engine_s_weights_bit_for_bit(setup: Setup) -> None:
    """Read from the node's file or shipped by the head, a stage's weights are the single
    engine's: a GGUF's Q8_0 matrices as the file's blocks (never through float32), the rest
    converted alike."""
    local = held_weights(setup.local.runner.stages[0])
    held = [ray.get(a.read_weights.remote()) for a in setup.pipe.runner.actors]
    assert set().union(*held) == set(local)
    for stage in held:
        for name, tensor in stage.items():
            assert tensor.dtype == local[name].dtype and torch.equal(tensor, local[name]), name
    if setup.name == "gguf-2":  # every matrix of the layers and the tied head/embedding, as stored
        blocks = {name.rsplit(".quant.", 1)[0] for stage in held for name in stage if ".quant." in name}
        assert len(blocks) == 4 * SPEC.num_layers + 2
        assert all(stage[n].dtype == torch.uint8 for stage in held for n in stage if n.endswith(".data"))


def test_logits_equal_the_single_process_engine_and_only_plans_and_logits_pass_the_head(setup: Setup) -> None:
    """Hand-made plans on blocks that no sequence holds (the engines are fresh)."""
    runner: PipelineRunner = setup.pipe.runner
    a, b, c = _prompt(11, 1), _prompt(6, 2), _prompt(9, 3)
    prefill = StepPlan(1001, (
        ScheduledChunk("a", tuple(a), 0, (30, 31, 32), True),
        ScheduledChunk("b", tuple(b), 0, (33, 34), True),
        ScheduledChunk("c", tuple(c[:5]), 0, (35, 36, 37), False),
    ))
    decode = StepPlan(1002, (
        ScheduledChunk("a", (7,), 11, (30, 31, 32), True),
        ScheduledChunk("c", tuple(c[5:]), 5, (35, 36, 37), True),
        ScheduledChunk("b", (9,), 6, (33, 34), True),
    ), block_copies=((34, 38),))
    before = runner.traffic.plan_bytes, runner.traffic.logits_bytes
    hidden_before = [c.hidden_bytes_out for c in runner.stage_counters()]
    for plan in (prefill, decode):
        want = setup.local.runner.execute(plan)
        runner.submit(plan)
        got = runner.collect().logits
        assert got.shape == (len(plan.sampled), SPEC.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    stages = len(runner.actors)
    sent = sum(len(pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)) for p in (prefill, decode))
    assert runner.traffic.plan_bytes - before[0] == stages * sent
    assert runner.traffic.logits_bytes - before[1] == 4 * SPEC.vocab_size * (2 + 3)
    tokens = prefill.num_tokens + decode.num_tokens
    hidden = [c.hidden_bytes_out - h for c, h in zip(runner.stage_counters(), hidden_before, strict=True)]
    assert hidden == [4 * SPEC.hidden_size * tokens] * (stages - 1) + [0]


def test_a_plan_that_fails_on_a_stage_fails_alone_and_the_next_plan_runs_on_every_stage(setup: Setup) -> None:
    """Stage 0 fails on a plan (a block id outside the pool): the stages after it get the
    error instead of hidden states, ``collect`` raises StepFailed naming the plan, no stage
    is lost, and the next plan runs in order on every stage with the single engine's logits."""
    check_a_failing_plan_fails_alone(setup.pipe.runner, setup.local.runner, _prompt(7, 40))


def test_greedy_outputs_match_for_a_mixed_batch(setup: Setup) -> None:
    """Prefix hits, chunked prefill (prompts over the 32-token budget), preemption (40
    blocks of 4 for 6 sequences of up to 70 tokens) and a two-turn conversation."""
    shared = _prompt(24, 10)
    prompts = [shared + _prompt(6, 11), _prompt(45, 12), _prompt(7, 13), shared + _prompt(3, 14),
               _prompt(60, 15)]
    results = {}
    for name, engine in (("local", setup.local), ("pipe", setup.pipe)):
        hits, preemptions = engine.scheduler.num_prefix_hit_tokens, engine.scheduler.num_preemptions
        first = engine.add_request(prompts[0], GREEDY)
        out = _run(engine, [first])
        ids = [engine.add_request(p, GREEDY) for p in prompts[1:]]
        session = engine.open_conversation(_prompt(5, 16))
        turn1 = engine.add_request(_prompt(4, 17), GREEDY, conversation_id=session)
        out |= _run(engine, [*ids, turn1])
        turn2 = engine.add_request(_prompt(3, 18), GREEDY, conversation_id=session)
        out |= _run(engine, [turn2])
        conversation = engine.conversation_tokens(session)
        engine.close_conversation(session)
        results[name] = ([out[i] for i in [first, *ids, turn1, turn2]], conversation)
        assert engine.scheduler.num_prefix_hit_tokens > hits
        assert engine.scheduler.num_preemptions > preemptions
        _check_idle_accounting(engine)
    assert results["pipe"] == results["local"]


def _in_flight_steps(engine: Engine, request_id: str) -> set[int]:
    return {step for step, ids in engine.scheduler._in_flight.items() if request_id in ids}


def _check_stages_stopped(engine: Engine, request_id: str, last_step: int) -> None:
    """Every stage computed the request in the same plans, none after ``last_step``."""
    logs = [c.steps_with(request_id) for c in engine.runner.stage_counters()]
    assert all(log == logs[0] for log in logs), logs
    assert logs[0] and max(logs[0]) == last_step, (logs[0], last_step)


def test_cancel_mid_decode_stops_every_stage_and_continuing_equals_no_cancel(setup: Setup) -> None:
    engine = setup.pipe
    base = _prompt(8, 20)
    # C4 reference: the same conversation (and neighbours), never cancelled
    plain = engine.open_conversation(base)
    ref_others = [engine.add_request(_prompt(5, 21 + i), GREEDY) for i in range(3)]
    ref = engine.add_request([], GREEDY, conversation_id=plain)
    want = _run(engine, [ref, *ref_others])
    engine.close_conversation(plain)

    session = engine.open_conversation(base)
    others = [engine.add_request(_prompt(5, 21 + i), GREEDY) for i in range(3)]
    rid = engine.add_request([], GREEDY, conversation_id=session)
    cancelled_at: dict[str, int] = {}

    def cancel_after_four(engine: Engine, tokens: dict[str, list[int]]) -> None:
        # At a step boundary with the request's fifth token in flight (two micro-batches:
        # the other one was just collected).
        if len(tokens[rid]) == 4 and not cancelled_at and (in_flight := _in_flight_steps(engine, rid)):
            cancelled_at["last"] = max(in_flight)
            engine.abort(rid)

    got = _run(engine, [rid, *others], on_step=cancel_after_four)
    tokens, reason = got[rid]
    assert reason == FinishReason.CANCELLED and len(tokens) == 4  # the in-flight plan's token dropped
    _check_stages_stopped(engine, rid, cancelled_at["last"])
    assert [got[o] for o in others] == [want[o] for o in ref_others]
    rest = engine.add_request([], SamplingParams(max_tokens=10 - len(tokens), temperature=0, ignore_eos=True),
                              conversation_id=session)
    more, _ = _run(engine, [rest])[rest]
    assert tokens + more == want[ref][0]  # C4
    engine.close_conversation(session)
    _check_idle_accounting(engine)


def test_cancel_mid_prefill_stops_every_stage(setup: Setup) -> None:
    """A cancel that arrives during the forward of the first prompt chunk."""
    engine = setup.pipe
    rid = engine.add_request(_prompt(100, 30), GREEDY)  # 4 chunks of at most 32 tokens
    runner = engine.runner
    collect = runner.collect
    seen: dict[str, int] = {}

    def collect_and_cancel():
        if not seen:  # the first chunk's plan is in flight: cancel now, from "another caller"
            seen["last"] = max(_in_flight_steps(engine, rid))
            engine.abort(rid)
        return collect()

    runner.collect = collect_and_cancel
    try:
        got = _run(engine, [rid])
    finally:
        del runner.collect
    assert got[rid] == ([], FinishReason.CANCELLED)
    _check_stages_stopped(engine, rid, seen["last"])
    assert len(engine.runner.stage_counters()[0].steps_with(rid)) == 1  # one chunk of four
    _check_idle_accounting(engine)


class _IssuedPlans:
    """Records, at the head, every plan step submitted with a given request (engine thread);
    ``pace_s``: a pause before each submit, so a test's timing does not hang on how fast
    the stages are."""

    def __init__(self, engine: Engine, request_id: str | None = None, pace_s: float = 0.0):
        self.runner, self.request_id, self.steps = engine.runner, request_id, []
        submit = self.runner.submit

        def recording_submit(plan: StepPlan) -> None:
            if any(c.request_id == self.request_id for c in plan.chunks):
                self.steps.append(plan.step)
            time.sleep(pace_s)
            submit(plan)

        self.runner.submit = recording_submit

    def close(self) -> None:
        del self.runner.submit


def test_a_deadline_cancel_reaches_every_stage(setup: Setup) -> None:
    """The deadline passes mid-decode: the request ends cancelled (deadline) at the next
    step boundary, and every stage computed exactly the plans the head issued before it."""
    engine = setup.pipe
    rid = engine.add_request(_prompt(6, 40), SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
                             timeout=0.6)
    issued = _IssuedPlans(engine, rid, pace_s=0.005)  # 400 tokens take over 2 s: the deadline passes mid-decode
    expire = engine.scheduler.expire_deadlines
    at_cancel: list[list[int]] = []

    def expire_and_record(now=None):
        expire(now)
        if not at_cancel and (rid in engine.scheduler._pending_finish or rid not in engine.scheduler.requests):
            at_cancel.append(list(issued.steps))  # the plans issued up to the boundary that applied it

    engine.scheduler.expire_deadlines = expire_and_record
    try:
        tokens, reason = _run(engine, [rid])[rid]
    finally:
        del engine.scheduler.expire_deadlines
        issued.close()
    assert reason == FinishReason.CANCELLED and 0 < len(tokens) < 400
    assert at_cancel and issued.steps == at_cancel[0], "a plan issued after the deadline held the request"
    logs = [c.steps_with(rid) for c in engine.runner.stage_counters()]
    assert logs == [issued.steps] * len(logs)
    _check_idle_accounting(engine)


def test_a_client_disconnect_reaches_every_stage(setup: Setup) -> None:
    """The consumer of an AsyncEngine stream walks away (the server's disconnect route):
    cancelled with reason disconnect; every stage computed exactly the plans the head
    issued, and none was issued after the abort except one scheduled in the same boundary."""
    engine = setup.pipe
    issued = _IssuedPlans(engine)
    at_abort: list[list[int]] = []
    abort = engine.abort

    def abort_and_record(request_id, reason=CancelReason.USER, **kwargs):
        at_abort.append(list(issued.steps))
        return abort(request_id, reason, **kwargs)

    engine.abort = abort_and_record
    finals = []

    async def main() -> None:
        async_engine = AsyncEngine(engine).start()
        try:
            rid, stream = async_engine.submit(_prompt(6, 41), SamplingParams(max_tokens=400, temperature=0,
                                                                              ignore_eos=True))
            issued.request_id = rid
            received = 0
            async for out in async_engine.stream(rid, stream):
                received += len(out.new_token_ids)
                if received >= 5:
                    break  # as a server does when its client hangs up
            while engine.live_request_ids():
                await asyncio.sleep(0.01)
            finals.append(rid)
        finally:
            async_engine._stopping.set()
            engine.wake()
            await asyncio.to_thread(async_engine._thread.join, 10)

    try:
        asyncio.run(main())
    finally:
        del engine.abort
        issued.close()
    rid = finals[0]
    assert engine.counters.cancelled["disconnect"] >= 1
    assert at_abort and len(issued.steps) - len(at_abort[0]) <= 1, (issued.steps, at_abort)
    logs = [c.steps_with(rid) for c in engine.runner.stage_counters()]
    assert logs == [issued.steps] * len(logs)
    _check_idle_accounting(engine)


def test_v1_cluster_lists_the_stages_and_the_server_answers_through_the_pipeline(setup: Setup) -> None:
    """Last for each set-up: the server's engine thread takes the engine over."""
    async def main() -> tuple[dict, dict, dict, str]:
        engine = AsyncEngine(setup.pipe)
        app = create_app(engine, ServerSettings())
        ctx = app.state.ctx
        ctx.loop = asyncio.get_running_loop()
        engine.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                answer = (await client.post("/v1/completions", json={
                    "model": "tiny", "prompt": "Hello world", "max_tokens": 5, "temperature": 0,
                    "ignore_eos": True})).json()
                info = (await client.get("/v1/cluster")).json()
                metrics = (await client.get("/metrics")).text
                local = create_app(AsyncEngine(setup.local), ServerSettings())
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=local), base_url="http://l") as one:
                    single = (await one.get("/v1/cluster")).json()
            return answer, info, single, metrics
        finally:
            await finish_shutdown(ctx)

    answer, info, single, metrics = asyncio.run(main())
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("bargein_stage_") or line.startswith("bargein_pipeline_")}
    for i in range(len(setup.ranges)):
        assert samples[f'bargein_stage_compute_seconds_total{{stage="{i}"}}'] > 0
        assert samples[f'bargein_stage_plans_total{{stage="{i}"}}'] > 0
        assert samples[f'bargein_stage_restarts_total{{stage="{i}"}}'] == 0
    assert samples['bargein_stage_transfer_seconds_total{stage="1"}'] > 0
    assert samples["bargein_pipeline_degraded"] == 0 and samples["bargein_pipeline_recoveries_total"] == 0
    assert answer["usage"]["completion_tokens"] == 5
    assert info["pipeline"] is True and info["num_stages"] == len(setup.ranges)
    assert [tuple(s["layers"]) for s in info["stages"]] == list(setup.ranges)
    assert [s["weights_from"] for s in info["stages"]].count("head") == 1
    assert all(s["plans"] > 0 and s["mean_step_ms"] > 0 for s in info["stages"])
    assert info["head_traffic"]["weights_shipped_bytes"] == setup.stored_bytes
    assert info["health"] == "ok" and info["recovery"]["recoveries"] == 0
    assert all(s["transfer_s"] >= 0 and s["restarts"] == 0 for s in info["stages"])
    assert info["stages"][0]["mean_transfer_ms"] is None  # the first stage receives no hidden states
    assert all(s["mean_transfer_ms"] > 0 for s in info["stages"][1:])
    # The simulated nodes share one address (one machine's CPUs): split by memory alone.
    assert info["split"].startswith("by memory: ")
    # Threads as the Python API's default (1 a stage); the wait policy the head hands the stages.
    assert [s["threads"] for s in info["stages"]] == [1] * len(setup.ranges)
    assert info["wait_policy"] == describe_wait_policy() != ""
    table = format_cluster(info).splitlines()
    assert len(table) == 5 + len(setup.ranges) and table[1] == "health ok; 0 recoveries"
    assert table[2] == f"layers split {info['split']}" and table[3] == f"stage threads wait with {info['wait_policy']}"
    assert table[4].split() == ["STAGE", "LAYERS", "NODE", "THREADS", "MEMORY", "WEIGHTS", "PLANS", "STEP", "XFER",
                                "IDLE", "RESTARTS"]
    assert [row.split()[3] for row in table[5:]] == ["1"] * len(setup.ranges)
    assert single == {"object": "cluster", "pipeline": False, "num_stages": 1, "max_in_flight": 1,
                      "kv_blocks": 40, "stages": [{"index": 0, "layers": [0, 6], "node_address": "local",
                                                   "device": "cpu"}]}

