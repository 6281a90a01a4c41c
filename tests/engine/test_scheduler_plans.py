"""The scheduler's plans, tested directly (no engine, no model, no torch): what one step
computes for prompts, chunks, decodes, prefix hits and a cancel in flight."""

from __future__ import annotations

from dataclasses import dataclass

from bargein.config import SchedulerConfig
from bargein.engine.blocks import BlockPool
from bargein.engine.request import FinishReason, Request, RequestStatus, Sequence
from bargein.engine.sampling import SamplingParams
from bargein.engine.scheduler import Scheduler

EOS = 0


@dataclass(frozen=True)
class Token:
    token_id: int
    logprobs: object = None


def scheduler(max_tokens: int = 8, num_blocks: int = 16, block_size: int = 4, max_num_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens)
    return Scheduler(config, BlockPool(num_blocks, block_size, True), 64, frozenset({EOS}))


def add(s: Scheduler, rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    s.ids.claim(rid)
    req = Request(request_id=rid, sequence=Sequence(rid, list(tokens)),
                  params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                  prompt_len=len(tokens), new_prompt_tokens=len(tokens))
    s.add(req)
    return req


def step(s: Scheduler, token: int = 7):
    plan = s.schedule()
    s.update(plan, {c.request_id: Token(token) for c in plan.chunks if c.sample})
    return plan, s.take_outcome()


def test_a_long_prompt_is_computed_in_chunks_within_the_token_budget():
    s = scheduler(max_tokens=8)
    add(s, "a", list(range(1, 21)))  # 20 prompt tokens, 8 a step
    sizes = []
    for _ in range(3):
        plan, _ = step(s)
        (chunk,) = plan.chunks
        sizes.append((chunk.start_pos, len(chunk.token_ids), chunk.sample))
    assert sizes == [(0, 8, False), (8, 8, False), (16, 4, True)]
    plan, _ = step(s)  # then a decode: one token, sampled
    assert [(c.start_pos, len(c.token_ids), c.sample) for c in plan.chunks] == [(20, 1, True)]


def test_decodes_come_first_and_a_new_prompt_takes_what_is_left():
    s = scheduler(max_tokens=8)
    add(s, "a", [1, 2, 3])
    step(s)  # a's prompt
    add(s, "b", list(range(1, 13)))
    plan, _ = step(s)
    assert [(c.request_id, len(c.token_ids)) for c in plan.chunks] == [("a", 1), ("b", 7)]
    assert sum(len(c.token_ids) for c in plan.chunks) <= 8


def test_a_prefix_hit_computes_only_the_new_tokens():
    s = scheduler(max_tokens=32)
    add(s, "a", list(range(1, 10)), max_tokens=1)
    while s.has_work:
        step(s)
    assert s.requests == {}
    add(s, "b", list(range(1, 10)) + [42, 43])
    plan, _ = step(s)
    (chunk,) = plan.chunks
    # every cached token: two full blocks of 4 and the partly filled third (C7)
    assert chunk.start_pos == 9 and chunk.token_ids == (42, 43)


def test_max_tokens_ends_a_request_and_frees_its_blocks():
    s = scheduler(max_tokens=16)
    add(s, "a", [1, 2, 3], max_tokens=2)
    finished = []
    while s.has_work:
        _, outcome = step(s)
        finished += [(d.request_id, d.finish_reason) for d in outcome.deltas if d.finished]
    assert finished == [("a", FinishReason.LENGTH)]
    assert s.pool.num_referenced == 0
    s.pool.check_invariants(s.live_block_tables())


def test_a_cancel_while_the_plan_is_in_flight_drops_the_sampled_token():
    s = scheduler(max_tokens=16)
    req = add(s, "a", [1, 2, 3])
    step(s)
    plan = s.schedule()  # a decode in flight
    s.finish(["a"], FinishReason.CANCELLED)
    assert req.status == RequestStatus.RUNNING  # ends when the plan comes back
    s.update(plan, {"a": Token(9)})
    (delta,) = s.take_outcome().deltas
    assert delta.finished and delta.finish_reason == FinishReason.CANCELLED and 9 not in delta.new_token_ids
    assert req.sequence.token_ids[-1] != 9 and s.pool.num_referenced == 0


def test_out_of_blocks_preempts_the_newest_running_request():
    s = scheduler(max_tokens=64, num_blocks=4, block_size=4)  # 16 token slots
    add(s, "old", [1] * 7, max_tokens=8)
    add(s, "new", [2] * 7, max_tokens=8)
    step(s)  # both prompts: 2 blocks each
    statuses = set()
    for _ in range(3):
        step(s)
        statuses.add(s.requests["new"].status if "new" in s.requests else None)
    assert s.num_preemptions >= 1 and RequestStatus.PREEMPTED in statuses | {s.requests["new"].status}
    s.pool.check_invariants(s.live_block_tables())
