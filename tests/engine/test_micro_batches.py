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
from bargein.engine.runner import KVLost, RunnerHealth, StepResult
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

    row_sampling = None

    def health(self) -> RunnerHealth:
        return RunnerHealth()

    def wait_ready(self, timeout: float) -> bool:
        return True

    def describe(self):
        return self.inner.describe()

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


class LosingRunner(HoldingRunner):
    """Loses every block's K/V once (as a pipeline whose stage died): at the ``lose_at``-th
    collect it scrambles the caches, drops the plans in flight and raises KVLost, then
    says "recovering" for ``pause`` checks before it is "ok" again; or, with ``give_up``,
    "degraded" until ``heal()``."""

    def __init__(self, inner, n: int, lose_at: int, pause: int = 3, give_up: bool = False):
        super().__init__(inner, n)
        self.lose_at, self.pause, self.give_up = lose_at, pause, give_up
        self.collects = 0
        self.state = "ok"

    def collect(self) -> StepResult:
        self.collects += 1
        if self.collects == self.lose_at:
            for caches in self.inner.kv_caches:
                for cache in caches:
                    for t in (cache.k, cache.v):
                        t.normal_()  # whatever is read from the old K/V now is garbage
            self.held.clear()
            self.state = "degraded" if self.give_up else "recovering"
            raise KVLost("stage 1 (layers 1-2) on node n1 was lost")
        return super().collect()

    def health(self) -> RunnerHealth:
        if self.state == "recovering":
            self.pause -= 1
            if self.pause <= 0:
                self.state = "ok"
        return RunnerHealth(self.state, None if self.state == "ok" else "stage 1 (layers 1-2) on node n1 was lost")

    def wait_ready(self, timeout: float) -> bool:
        return self.state == "ok"

    def heal(self) -> None:
        self.state = "ok"


def _conversation(engine, params, between=None):
    """A conversation's turn, then three streams (the conversation idle), then its next turn."""
    session = engine.open_conversation(prompt(7, 20))
    first = _generate_on(engine, [(prompt(3, 21), session)], params)
    streams = _generate_on(engine, [(p, None) for p in (prompt(10, 22), prompt(10, 22)[:8] + prompt(5, 23),
                                                        prompt(6, 24))], params)
    second = _generate_on(engine, [(prompt(2, 25), session)], params)
    tokens = engine.conversation_tokens(session)
    engine.close_conversation(session)
    return first, streams, second, tokens


def _generate_on(engine, turns, params):
    ids = [engine.add_request(p, params, conversation_id=s) for p, s in turns]
    out = {i: [] for i in ids}
    done = {}
    while len(done) < len(ids):
        for d in engine.step().deltas:
            out[d.request_id] += d.new_token_ids
            if d.finished:
                done[d.request_id] = d.finish_reason
    return [(out[i], done[i]) for i in ids]


@pytest.mark.parametrize("sampled", [False, True])
def test_a_lost_kv_cache_is_recomputed_from_tokens_and_gives_the_same_tokens(sampled: bool) -> None:
    params = (SamplingParams(max_tokens=9, temperature=0.8, seed=99, ignore_eos=True) if sampled
              else SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    want = _conversation(tiny_engine(num_blocks=40, max_num_batched_tokens=16), params)
    engine = tiny_engine(num_blocks=40, max_num_batched_tokens=16)
    runner = engine.runner = LosingRunner(engine.runner, 2, lose_at=9)
    got = _conversation(engine, params)
    assert runner.collects > runner.lose_at  # the loss happened while the streams ran
    assert got == want
    assert engine.counters.kv_losses == 1 and engine.counters.recomputed_tokens > 0
    engine.check_block_accounting()
    assert engine.pool.num_referenced == 0


def test_a_loss_forgets_every_cached_block_and_every_idle_conversation_s_kv() -> None:
    engine = tiny_engine(num_blocks=40)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    session = engine.open_conversation(prompt(9, 30))
    _generate_on(engine, [(prompt(2, 31), session)], params)
    _generate_on(engine, [(prompt(13, 32), None)], params)  # leaves cached blocks behind
    assert engine.pool.num_cached > 0 and engine.scheduler.conversations[session].sequence.num_computed > 0
    rid = engine.add_request(prompt(5, 33), params)
    engine.runner = LosingRunner(engine.runner, 1, lose_at=1, pause=1)
    engine.step()  # its plan is lost
    seq = engine.scheduler.requests[rid].sequence
    assert seq.num_computed == 0 and not seq.block_table.block_ids
    assert engine.scheduler.conversations[session].sequence.num_computed == 0
    assert engine.pool.num_cached == 0 and engine.pool.num_free == engine.pool.num_blocks
    engine.check_block_accounting()
    assert engine.counters.recomputed_tokens == 9 + 2 + 4 - 1  # the idle conversation's computed tokens
    engine.close_conversation(session)


def test_a_runner_that_gives_up_fails_requests_with_its_message_and_serves_again_once_healed() -> None:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = _generate(tiny_engine(), [prompt(5, 40)], params)
    engine = tiny_engine()
    runner = engine.runner = LosingRunner(engine.runner, 2, lose_at=3, give_up=True)
    ids = [engine.add_request(p, params) for p in (prompt(5, 41), prompt(6, 42))]
    errors = {}
    while len(errors) < len(ids):
        for d in engine.step().deltas:
            if d.finished:
                errors[d.request_id] = (d.finish_reason, d.error)
    assert set(errors.values()) == {(FinishReason.ERROR, "stage 1 (layers 1-2) on node n1 was lost")}
    late = engine.add_request(prompt(5, 43), params)  # still degraded: fails at once, no compute
    collects = runner.collects
    outcome = engine.step()
    assert [(d.request_id, d.finish_reason) for d in outcome.deltas if d.finished] == [(late, FinishReason.ERROR)]
    assert runner.collects == collects
    runner.heal()
    assert _generate(engine, [prompt(5, 40)], params) == want


def test_plain_rows_sampled_where_the_logits_are_pick_the_sampler_s_tokens() -> None:
    """A pipeline's last stage picks plain rows' tokens (``sample_rows``); they must be the
    tokens ``Sampler.sample`` picks on the head, greedy and seeded alike."""
    import torch

    from bargein.engine.sampler import Sampler, SamplingState, row_sampling, sample_rows

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=g) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=1),
              SamplingParams(temperature=1.3, top_k=20, seed=2), SamplingParams(temperature=0.9, top_p=0.8, seed=3),
              SamplingParams(temperature=1.0, min_p=0.1, seed=4), SamplingParams(temperature=0.5, seed=5, logprobs=2)]
    states = [SamplingState.create(p, [1, 2, 3]) for p in params]
    for state, n in zip(states, range(6), strict=True):
        state.output_token_ids.extend(range(n))  # different token indices
    want = [t.token_id for t in Sampler().sample(logits, states)]
    rows = [row_sampling(s) for s in states]
    assert rows[-1] is None  # logprobs: the head samples it
    assert sample_rows(logits[:5], rows[:5]) == want[:5]
    assert sample_rows(logits[1:2], rows[1:2]) == want[1:2]  # alone or in a batch alike


def test_a_cancel_pending_when_the_kv_is_lost_ends_the_request_cancelled_with_its_tokens() -> None:
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engine = tiny_engine()
    runner = engine.runner = LosingRunner(engine.runner, 2, lose_at=-1, pause=1)
    ids = [engine.add_request(p, params) for p in (prompt(6, 50), prompt(7, 51))]
    tokens = {i: [] for i in ids}
    done = {}
    while len(done) < len(ids):
        in_flight = any(c.request_id == ids[0] for p in runner.held for c in p.chunks)
        if runner.lose_at < 0 and len(tokens[ids[0]]) >= 3 and in_flight:
            engine.abort(ids[0])  # pending until its plan returns; the next collect loses every plan
            runner.lose_at = runner.collects + 1
        for d in engine.step().deltas:
            tokens[d.request_id] += d.new_token_ids
            if d.finished:
                done[d.request_id] = d.finish_reason
    assert engine.counters.kv_losses == 1
    assert done == {ids[0]: FinishReason.CANCELLED, ids[1]: FinishReason.LENGTH}
    want = _generate(tiny_engine(), [prompt(6, 50), prompt(7, 51)], params)
    assert tokens[ids[1]] == want[1][0]
    assert 3 <= len(tokens[ids[0]]) < 10 and tokens[ids[0]] == want[0][0][:len(tokens[ids[0]])]
    engine.check_block_accounting()
    assert engine.pool.num_referenced == 0
