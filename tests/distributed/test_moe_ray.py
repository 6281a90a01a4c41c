"""A mixture-of-experts model on Ray (issue 26): replicas and a pipeline whose stage is lost.

The committed tiny Qwen3-MoE GGUF (tests/data/moe, llama.cpp's converter; two MoE layers)
runs on three simulated nodes this module adds to the shared cluster (each offering a
resource named for the module, so nothing else lands there and killing one touches no
other test): first as two whole-engine replicas, then as a pipeline of two stages (one MoE
layer each) and a spare. Every answer is compared with the single-process engine on the
same file, token for token: greedy and seeded sampled streams, a replica killed
mid-stream (its streams resume on the other), and a stage's node killed mid-turn of a
conversation (the stage is re-created on the spare, the turn goes on, and the next turn
continues the conversation exactly).
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Iterator

import pytest

pytest.importorskip("ray")

import ray  # noqa: E402

from bargein.build import build_engine  # noqa: E402
from bargein.distributed.replicas import BuildWith, ReplicaOptions, ReplicaSet, start_replicas  # noqa: E402
from bargein.engine.engine import Engine  # noqa: E402
from bargein.engine.request import FinishReason  # noqa: E402
from bargein.engine.sampling import SamplingParams  # noqa: E402
from tests.distributed.moe_engines import MODEL, build_replica, moe_config  # noqa: E402
from tests.distributed.test_pipeline_recovery import Nodes  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=4321, ignore_eos=True)
PROMPTS = [[(11 * i + 7 * j) % 300 + 3 for j in range(5 + 4 * i)] for i in range(3)]


@functools.cache
def _local() -> Engine:
    return Engine.from_pretrained(MODEL, moe_config(), progress=False)


def _want(prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [list(o.token_ids) for o in _local().generate(prompts, params)]


@pytest.fixture(scope="module")
def nodes(ray_cluster) -> Iterator[Nodes]:
    added = Nodes(ray_cluster, f"moe-{uuid.uuid4().hex[:8]}")
    added.add(3)
    try:
        yield added
    finally:
        added.remove_all()


async def _stream(group: ReplicaSet, stream, tokens: list[int], until: int | None = None):
    while True:
        out = await group.next_output(stream)
        tokens += out.new_token_ids
        if out.finished or (until is not None and len(tokens) >= until):
            return out


def test_moe_replicas_answer_as_one_process_and_a_killed_replica_s_streams_finish_exactly(nodes: Nodes) -> None:
    group = start_replicas(BuildWith(build_replica), 2, ReplicaOptions(
        num_cpus=1, call_timeout_s=5.0, hang_timeout_s=30.0, queue_cost_tokens=0, resources={nodes.resource: 1}))
    params = [GREEDY, SAMPLED, GREEDY]
    shared = [9, 8, 7, 6, 5, 4, 3, 2]  # two shared blocks: the router keeps these together
    victims = [shared + [40], shared + [41, 42]]
    long = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = _want(PROMPTS, params) + _want(victims, [long, SAMPLED])

    async def main() -> list[list[int]]:
        spread = [group.submit(p, q) for p, q in zip(PROMPTS, params, strict=True)]
        got = []
        for _, stream in spread:
            tokens: list[int] = []
            out = await _stream(group, stream, tokens)
            assert out.finish_reason == FinishReason.LENGTH
            got.append(tokens)
        streams = [group.submit(p, q) for p, q in zip(victims, [long, SAMPLED], strict=True)]
        victim = group.records.live[streams[0][0]].replica
        assert all(group.records.live[rid].replica == victim for rid, _ in streams)
        tokens = [[] for _ in streams]
        for k, (_, stream) in enumerate(streams):
            await _stream(group, stream, tokens[k], until=4)
        ray.kill(group.actors[victim], no_restart=False)
        for k, (_, stream) in enumerate(streams):
            out = await _stream(group, stream, tokens[k])
            assert out.finish_reason == FinishReason.LENGTH, out.error
        assert all(group.records.live.get(rid) is None for rid, _ in streams)
        return got + tokens

    try:
        assert asyncio.run(main()) == want
    finally:
        group.close()


def test_an_moe_pipeline_answers_as_one_process_and_a_lost_stage_keeps_the_turn(nodes: Nodes) -> None:
    pipe = build_engine(MODEL, moe_config(nodes.resource), progress=False)
    try:
        runner = pipe.runner
        assert [p.layers for p in runner.placements] == [(0, 1), (1, 2)]  # one MoE layer each
        outs = pipe.generate(PROMPTS, [GREEDY, SAMPLED, GREEDY])
        assert [list(o.token_ids) for o in outs] == _want(PROMPTS, [GREEDY, SAMPLED, GREEDY])

        opened, first, second, third = [5, 17, 29, 41, 53], [65, 77], [7, 19], [11, 23, 35]
        session = pipe.open_conversation(opened)
        rid = pipe.add_request(first, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                               conversation_id=session)
        answer1 = _finish(pipe, rid)
        first = opened + first
        lost = runner.placements[1].node_id
        rid = pipe.add_request(second, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                               conversation_id=session)
        answer2 = _finish(pipe, rid, kill_after=4, kill=lambda: nodes.remove(lost))
        assert runner.recovery.losses == 1 and runner.recovery.recoveries == 1
        assert runner.placements[1].node_id != lost
        rid = pipe.add_request(third, GREEDY, conversation_id=session)
        answer3 = _finish(pipe, rid)
        history = first + answer1 + second + answer2 + third
        assert pipe.conversation_tokens(session) == history + answer3
        local = _local()
        assert answer1 == _want([first], [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)])[0]
        assert answer2 == _want([first + answer1 + second],
                                [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)])[0]
        assert answer3 == _want([history], [GREEDY])[0]
        assert pipe.counters.kv_losses == 1 and pipe.counters.recomputed_tokens > 0
        pipe.close_conversation(session)
        pipe.step()
        pipe.check_block_accounting()
        assert pipe.pool.num_referenced == 0 and local.pool.num_referenced == 0
    finally:
        pipe.close()


def _finish(engine: Engine, rid: str, kill_after: int = 0, kill=None, timeout_s: float = 120.0) -> list[int]:
    """Steps ``engine`` until request ``rid`` ends; ``kill()`` once it has ``kill_after`` tokens."""
    tokens: list[int] = []
    ends = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < ends, "the engine stopped making progress"
        for delta in engine.step().deltas:
            if delta.request_id != rid:
                continue
            tokens += delta.new_token_ids
            if kill is not None and len(tokens) >= kill_after:
                kill()
                kill = None
            if delta.finished:
                assert delta.finish_reason == FinishReason.LENGTH, delta.error
                return tokens
