"""Several plans in flight, without Ray: the engine's side of a pipeline.

A runner that holds up to N plans and runs each at ``collect`` (as a pipeline returns
them, oldest first) must give exactly the tokens of the one-plan engine: micro-batches
split the running sequences, no sequence is in two plans, and a sequence's next token
is scheduled when its plan came back.
"""

from __future__ import annotations

from collections import deque

import pytest

from bargein.engine.request import FinishReason
from bargein.engine.runner import StepResult
from bargein.engine.sampling import SamplingParams
from tests.tiny_engine import prompt, tiny_engine


class HoldingRunner:
    """Holds up to ``n`` plans; runs the oldest when it is collected."""

    def __init__(self, inner, n: int):
        self.inner, self.max_in_flight = inner, n
        self.model_config, self.num_blocks, self.device = inner.model_config, inner.num_blocks, inner.device
        self.held: deque = deque()
        self.most_in_flight = 0
        self.plans: list[frozenset[str]] = []

    @property
    def num_in_flight(self) -> int:
        return len(self.held)

    def submit(self, plan) -> None:
        assert len(self.held) < self.max_in_flight
        in_flight = {c.request_id for p in self.held for c in p.chunks}
        assert not in_flight & {c.request_id for c in plan.chunks}, "a sequence in two plans in flight"
        self.held.append(plan)
        self.plans.append(frozenset(c.request_id for c in plan.chunks))
        self.most_in_flight = max(self.most_in_flight, len(self.held))

    def collect(self) -> StepResult:
        plan = self.held.popleft()
        return StepResult(plan, self.inner.execute(plan))

    def close(self) -> None:
        pass


def _generate(engine, prompts, params, cancel_after: int | None = None):
    ids = [engine.add_request(p, params) for p in prompts]
    tokens = {i: [] for i in ids}
    reasons = {}
    while len(reasons) < len(ids):
        for d in engine.step().deltas:
            tokens[d.request_id] += d.new_token_ids
            if d.finished:
                reasons[d.request_id] = d.finish_reason
        if cancel_after is not None and len(tokens[ids[0]]) >= cancel_after and ids[0] not in reasons:
            engine.abort(ids[0])
    engine.check_block_accounting()
    assert engine.pool.num_referenced == 0
    return [(tokens[i], reasons[i]) for i in ids]


@pytest.mark.parametrize("n", [2, 3])
def test_micro_batches_give_the_tokens_of_one_plan_at_a_time(n: int) -> None:
    # 24 blocks of 4 for 7 sequences: chunked prefill (budget 16), prefix hits, preemption
    prompts = [prompt(30, 1), prompt(9, 2), prompt(30, 1)[:24] + prompt(4, 3), prompt(5, 4), prompt(17, 5),
               prompt(3, 6), prompt(12, 7)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = tiny_engine(num_blocks=24, max_num_batched_tokens=16)
    want = _generate(plain, prompts[:1], params) + _generate(plain, prompts[1:], params)
    engine = tiny_engine(num_blocks=24, max_num_batched_tokens=16)
    runner = engine.runner = HoldingRunner(engine.runner, n)
    assert _generate(engine, prompts[:1], params) + _generate(engine, prompts[1:], params) == want
    assert runner.most_in_flight == n
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_prefix_hit_tokens > 0


def test_a_cancel_drops_the_token_of_the_plan_in_flight_and_no_later_plan_holds_it() -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = tiny_engine()
    runner = engine.runner = HoldingRunner(engine.runner, 2)
    ids = [engine.add_request(p, params) for p in (prompt(6, 10), prompt(7, 11), prompt(8, 12))]
    rid, tokens, finished = ids[0], [], {}
    plans_at_abort = None
    while len(finished) < len(ids):
        for d in engine.step().deltas:
            if d.request_id == rid:
                tokens += d.new_token_ids
            if d.finished:
                finished[d.request_id] = d.finish_reason
        in_flight = any(c.request_id == rid for plan in runner.held for c in plan.chunks)
        if len(tokens) == 3 and plans_at_abort is None and in_flight:
            plans_at_abort = len(runner.plans)
            engine.abort(rid)
    assert plans_at_abort is not None, "the request never had a plan in flight at a step boundary"
    assert finished[rid] == FinishReason.CANCELLED and len(tokens) == 3  # the in-flight token was dropped
    assert not any(rid in ids for ids in runner.plans[plans_at_abort:])
    engine.check_block_accounting()
    assert engine.pool.num_referenced == 0
