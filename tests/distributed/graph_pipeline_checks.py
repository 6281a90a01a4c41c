"""Pipelines whose stages all run on the head's node: the compiled-graph transport.

Run by ``tests/distributed/test_pipeline_graph.py`` in a process of its own (``python -m pytest
tests/distributed/graph_pipeline_checks.py``): the transport is a Ray compiled graph only where
every stage shares the head's node (with CPUs to spare), and the session's shared
cluster gives the head's node one CPU, so these tests start a one-node Ray instance of
their own.
Every result is compared with the single-process engine on the same file, and the same
checks run over actor calls (``transport="calls"``) on the same node.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest
import torch

ray = pytest.importorskip("ray")

from bargein.build import build_engine  # noqa: E402
from bargein.config import CacheConfig, EngineConfig, PipelineConfig, SchedulerConfig  # noqa: E402
from bargein.engine.engine import Engine  # noqa: E402
from bargein.engine.request import FinishReason  # noqa: E402
from bargein.engine.sampling import SamplingParams  # noqa: E402
from bargein.server.cluster import runner_body  # noqa: E402
from tests.pipeline_plans import check_a_failing_plan_fails_alone  # noqa: E402
from tests.ray_starts import one_at_a_time  # noqa: E402
from tests.tiny_models import TinySpec, tiny_weights, write_gguf  # noqa: E402

SPEC = TinySpec(num_layers=6)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)


def _config(**pipeline) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(block_size=4, num_blocks=40),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
                        device="cpu", dtype="float32",
                        pipeline=PipelineConfig(ray_address="auto", heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5,
                                                step_timeout_s=10.0, **pipeline) if pipeline else None)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Iterator[str]:
    # Ray's CPUs, not the machine's: a CPU for each stage of the module's pipeline and of a
    # test's own (a re-created stage included), so "auto" picks a graph (one CPU per stage
    # thread, see transport.pick_transport) and no stage waits for room.
    with one_at_a_time():  # not beside another Ray instance's start (tests/ray_starts.py)
        ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False)
    try:
        yield str(write_gguf(tmp_path_factory.mktemp("graph") / "tiny.gguf", SPEC, tiny_weights(SPEC),
                             tensor_type="Q8_0"))
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def local(model: str) -> Engine:
    return Engine.from_pretrained(model, _config(), progress=False)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, SPEC.vocab_size, (n,), generator=g).tolist()


def _run(engine: Engine, ids: list[str], on_step: Callable[[dict[str, list[int]]], None] | None = None
         ) -> dict[str, tuple[list[int], FinishReason]]:
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    done: dict[str, tuple[list[int], FinishReason]] = {}
    ends = time.monotonic() + 60
    while len(done) < len(ids):
        assert time.monotonic() < ends, "the engine stopped making progress"
        for delta in engine.step().deltas:
            if delta.request_id in tokens:
                tokens[delta.request_id] += delta.new_token_ids
                if delta.finished:
                    done[delta.request_id] = (tokens[delta.request_id], delta.finish_reason)
        if on_step is not None:
            on_step(tokens)
    return done


def _mixed_batch(engine: Engine, on_step: Callable[[dict[str, list[int]]], None] | None = None) -> list:
    """Prefix hits, chunked prefill (prompts over the 32-token budget), preemption (40
    blocks of 4), a seeded sampled stream and a two-turn conversation."""
    shared = _prompt(24, 10)
    first = engine.add_request(shared + _prompt(6, 11), GREEDY)
    out = _run(engine, [first])
    ids = [engine.add_request(p, GREEDY) for p in (_prompt(45, 12), shared + _prompt(3, 14), _prompt(60, 15))]
    ids.append(engine.add_request(_prompt(7, 13), SAMPLED))
    session = engine.open_conversation(_prompt(5, 16))
    turn1 = engine.add_request(_prompt(4, 17), GREEDY, conversation_id=session)
    out |= _run(engine, [*ids, turn1], on_step)
    turn2 = engine.add_request(_prompt(3, 18), GREEDY, conversation_id=session)
    out |= _run(engine, [turn2])
    conversation = engine.conversation_tokens(session)
    engine.close_conversation(session)
    return [[out[i] for i in [first, *ids, turn1, turn2]], conversation]


def _check_idle(engine: Engine) -> None:
    engine.check_block_accounting()
    assert engine.pool.num_referenced == 0
    assert not engine.scheduler.requests and not engine.runner.num_in_flight


@pytest.fixture(scope="module")
def expected(local: Engine) -> list:
    """The single engine's results of ``_mixed_batch`` (the same every time: greedy, seeded)."""
    return _mixed_batch(local)


@pytest.fixture(scope="module")
def graph(model: str) -> Iterator[Engine]:
    """The module's two-stage graph pipeline (a fresh one for the first test that uses it,
    the transport test below); a lost stage's test recovers it for the tests after it."""
    pipe = build_engine(model, _config(stages=2), progress=False)
    assert pipe.runner.transport.kind == "graph"
    yield pipe
    pipe.close()


@pytest.mark.parametrize(("stages", "transport", "kind"), [
    (2, "auto", "graph"), (3, "auto", "graph"), (2, "calls", "calls")])
def test_each_transport_gives_the_single_engine_s_tokens(model: str, expected: list, stages: int, transport: str,
                                                         kind: str, request: pytest.FixtureRequest) -> None:
    """One plan per stage in flight (three with three stages), on one node. The two-stage
    graph is the module's (built here, fresh), not one more pipeline of the same kind."""
    shared = (stages, transport) == (2, "auto")
    pipe = request.getfixturevalue("graph") if shared else \
        build_engine(model, _config(stages=stages, transport=transport), progress=False)
    try:
        assert pipe.runner.transport.kind == kind
        assert runner_body(pipe.runner.describe())["transport"] == kind
        assert pipe.runner.max_in_flight == stages
        assert not any(c.plans for c in pipe.runner.stage_counters())  # a fresh pipeline
        assert _mixed_batch(pipe) == expected
        counters = pipe.runner.stage_counters()
        assert len({c.plans for c in counters}) == 1 and counters[0].plans > 0
        assert all(c.hidden_bytes_out > 0 for c in counters[:-1]) and counters[-1].hidden_bytes_out == 0
        _check_idle(pipe)
    finally:
        if not shared:
            pipe.close()


def test_in_a_graph_a_plan_that_fails_on_a_stage_fails_alone(graph: Engine, local: Engine) -> None:
    """Stage 0 fails on a plan (a block id outside the pool): the error travels down the
    graph, ``collect`` raises StepFailed naming the plan and the stage, and the next plan
    (already in flight) runs on every stage with the single engine's logits."""
    check_a_failing_plan_fails_alone(graph.runner, local.runner, _prompt(7, 40))


def test_in_a_graph_a_cancel_stops_every_stage_and_continuing_equals_no_cancel(graph: Engine) -> None:
    base = _prompt(8, 20)
    plain = graph.open_conversation(base)
    ref = graph.add_request([], GREEDY, conversation_id=plain)
    want = _run(graph, [ref])[ref][0]
    graph.close_conversation(plain)

    session = graph.open_conversation(base)
    rid = graph.add_request([], GREEDY, conversation_id=session)
    in_flight: list[int] = []

    def cancel_after_four(tokens: dict[str, list[int]]) -> None:
        if len(tokens[rid]) == 4 and not in_flight:
            in_flight.extend(s for s, ids in graph.scheduler._in_flight.items() if rid in ids)
            graph.abort(rid)

    tokens, reason = _run(graph, [rid], cancel_after_four)[rid]
    assert reason == FinishReason.CANCELLED and len(tokens) == 4
    logs = [c.steps_with(rid) for c in graph.runner.stage_counters()]
    assert logs[0] == logs[1] and max(logs[0]) == max(in_flight, default=max(logs[0]))
    rest = graph.add_request([], SamplingParams(max_tokens=10 - len(tokens), temperature=0, ignore_eos=True),
                             conversation_id=session)
    more, _ = _run(graph, [rest])[rest]
    assert tokens + more == want  # C4
    graph.close_conversation(session)
    _check_idle(graph)


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_in_a_graph_a_lost_stage_is_recreated_and_every_stream_continues_token_exact(
        graph: Engine, expected: list, fault: str) -> None:
    """The last stage's process is killed, or the first stage's process stops answering
    (SIGSTOP: the watchdog's heartbeat goes unanswered and it kills it), mid-stream. The
    graph is torn down, the stage re-created on this node and a new graph compiled; every
    sequence recomputes from its tokens and the results equal the fault-free run's.

    Both faults hit the module's pipeline, one after the other (the frozen one finds a
    pipeline that already recovered once): each counts its own loss and recovery."""
    pipe, runner = graph, graph.runner
    stopped: list[int] = []
    losses, recoveries, kv_losses = runner.recovery.losses, runner.recovery.recoveries, pipe.counters.kv_losses
    recomputed = pipe.counters.recomputed_tokens
    try:
        assert runner.transport.kind == "graph" and pipe.runner_health().state == "ok"
        victim = runner.actors[1 if fault == "killed" else 0]
        _, pid = ray.get(victim.ping.remote())
        fired: list[bool] = []

        def fault_once(tokens: dict[str, list[int]]) -> None:
            if not fired and max(len(t) for t in tokens.values()) >= 3:
                fired.append(True)
                if fault == "killed":
                    os.kill(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)

        got = _mixed_batch(pipe, fault_once)
        assert fired and got == expected
        assert (runner.recovery.losses - losses, runner.recovery.recoveries - recoveries) == (1, 1)
        assert pipe.counters.kv_losses - kv_losses == 1 and pipe.counters.recomputed_tokens > recomputed
        assert runner.transport.kind == "graph" and pipe.runner_health().state == "ok"
        _check_idle(pipe)
    finally:
        for p in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
