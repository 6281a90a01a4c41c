"""The synchronous engine on a tiny model: exact outputs and the cancellation contract."""

from __future__ import annotations

import threading

import pytest

from bargein.engine.engine import EngineError
from bargein.engine.request import AbortResult, CancelReason, FinishReason
from bargein.engine.sampling import InvalidSamplingParams, SamplingParams
from tests.tiny_engine import (
    EOS,
    collector,
    prompt,
    reference_greedy,
    run_until_finished,
    step_until_delivered,
    tiny_engine,
)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_batched_greedy_matches_the_reference_token_for_token() -> None:
    engine = tiny_engine(max_num_batched_tokens=16)  # forces chunked prefill of the long prompt
    prompts = [prompt(5, 1), prompt(23, 2), prompt(1, 3)]
    outs = engine.generate(prompts, GREEDY)
    for p, out in zip(prompts, outs, strict=True):
        assert list(out.token_ids) == reference_greedy(p, 8)
        assert out.finish_reason == FinishReason.LENGTH
        assert out.usage.prompt_tokens == len(p) and out.usage.completion_tokens == 8
    engine.check_block_accounting()
    assert engine.pool.num_referenced == 0


def test_outputs_stream_deltas_that_add_up() -> None:
    engine = tiny_engine()
    rid = collector(engine).add_request(prompt(6, 4), GREEDY)
    outs = run_until_finished(engine, rid)
    assert sum((list(o.new_token_ids) for o in outs), []) == list(outs[-1].token_ids)
    assert "".join(o.delta_text for o in outs) == outs[-1].text
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]


def test_stop_conditions() -> None:
    engine = tiny_engine()
    p = prompt(6, 5)
    free = reference_greedy(p, 8)
    # A stop token id ends the answer at its first occurrence, included in the tokens.
    (out,) = engine.generate([p], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[free[3]]))
    assert out.finish_reason == FinishReason.STOP
    assert list(out.token_ids) == free[:free.index(free[3]) + 1]
    # eos stops unless ignored; logit_bias forces it here.
    (out,) = engine.generate([p], SamplingParams(temperature=0, max_tokens=8, logit_bias={EOS: 100}))
    assert out.finish_reason == FinishReason.STOP and list(out.token_ids) == [EOS]
    (out,) = engine.generate([p], SamplingParams(temperature=0, max_tokens=3, min_tokens=2, logit_bias={EOS: 100}))
    assert list(out.token_ids)[-1] == EOS and len(out.token_ids) == 3


def test_stop_string_cuts_text_and_finishes() -> None:
    engine = tiny_engine()
    p = prompt(6, 6)
    (free,) = engine.generate([p], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    text = free.text
    assert len(text) >= 4
    stop = text[2:4]
    (out,) = engine.generate([p], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stop))
    assert out.finish_reason == FinishReason.STOP
    assert out.text == text[:text.index(stop)]


def test_seeded_sampling_does_not_depend_on_the_batch() -> None:
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=1234, ignore_eos=True)
    (alone,) = tiny_engine().generate([prompt(7, 8)], params)
    others = [prompt(n, 9 + n) for n in (3, 11, 5)]
    crowd = tiny_engine().generate(others[:2] + [prompt(7, 8)] + others[2:],
                                   [SamplingParams(temperature=1.0, max_tokens=10)] * 2 + [params]
                                   + [SamplingParams(temperature=0.7, max_tokens=6)])
    assert crowd[2].token_ids == alone.token_ids


def test_logprobs_are_reported_per_token() -> None:
    engine = tiny_engine()
    rid = collector(engine).add_request(prompt(5, 10), SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))
    outs = run_until_finished(engine, rid)
    lps = [lp for o in outs for lp in o.new_logprobs]
    assert [lp.token_id for lp in lps] == list(outs[-1].token_ids)
    for lp in lps:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id and lp.logprob == pytest.approx(lp.top[0][1])


def test_bad_requests_are_refused_clearly() -> None:
    engine = tiny_engine()
    with pytest.raises(EngineError, match="context holds 256"):
        collector(engine).add_request([1] * 600, GREEDY)
    with pytest.raises(EngineError, match="empty"):
        collector(engine).add_request([], GREEDY)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        collector(engine).add_request([1, 9999], GREEDY)
    with pytest.raises(InvalidSamplingParams, match="logit_bias"):
        collector(engine).add_request([1, 2], SamplingParams(logit_bias={9999: 1.0}))
    rid = collector(engine).add_request([1, 2], GREEDY, request_id="same")
    with pytest.raises(EngineError, match="already in use"):
        collector(engine).add_request([1, 2], GREEDY, request_id="same")
    assert run_until_finished(engine, rid)[-1].finish_reason == FinishReason.LENGTH


# -- cancellation -------------------------------------------------------------------------

def test_cancel_between_steps_keeps_exactly_the_delivered_tokens() -> None:
    engine = tiny_engine()
    p = prompt(9, 11)
    rid = collector(engine).add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    delivered = step_until_delivered(engine, 4)
    assert engine.abort(rid) == AbortResult.CANCELLED
    final = collector(engine).step()
    assert len(final) == 1 and final[0].finished
    assert final[0].finish_reason == FinishReason.CANCELLED and final[0].cancel_reason == CancelReason.USER
    assert final[0].new_token_ids == () and list(final[0].token_ids) == delivered
    assert delivered == reference_greedy(p, 4)
    assert engine.abort(rid) == AbortResult.ALREADY_FINISHED
    assert engine.abort("no-such-id") == AbortResult.NOT_FOUND
    engine.check_block_accounting()
    assert engine.pool.num_referenced == 0


def test_cancel_during_a_step_takes_effect_at_its_end_and_drops_its_sample() -> None:
    engine = tiny_engine()
    rid = collector(engine).add_request(prompt(9, 12), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    collector(engine).step()
    collector(engine).step()  # two tokens delivered
    entered, release = threading.Event(), threading.Event()
    execute = engine.runner.execute
    plans = []

    def blocking_execute(plan):
        plans.append(plan)
        entered.set()
        assert release.wait(10)
        return execute(plan)

    engine.runner.execute = blocking_execute
    result: list = []
    stepper = threading.Thread(target=lambda: result.extend(collector(engine).step()))
    stepper.start()
    assert entered.wait(10)
    # Cancel from another thread while the forward is blocked, twice (idempotent).
    assert engine.abort(rid) == AbortResult.CANCELLED
    assert engine.abort(rid) == AbortResult.CANCELLED
    release.set()
    stepper.join(10)
    (final,) = result
    assert final.finished and final.finish_reason == FinishReason.CANCELLED
    assert final.new_token_ids == ()  # the token sampled in the cancelled step never reaches the caller
    assert len(final.token_ids) == 2
    assert engine.counters.cancel_latency_steps[-1] == 0
    collector(engine).step()
    assert all(rid not in [c.request_id for c in plan.chunks] for plan in plans[1:])
    assert engine.abort(rid) == AbortResult.ALREADY_FINISHED


def test_queued_request_is_removed_without_compute() -> None:
    engine = tiny_engine(max_num_seqs=1)
    a = collector(engine).add_request(prompt(5, 13), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    b = collector(engine).add_request(prompt(50, 14), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    collector(engine).step()
    computed = engine.scheduler.num_computed_tokens
    assert [r.request_id for r in engine.scheduler.waiting] == [b]
    assert engine.abort(b) == AbortResult.CANCELLED
    outs = {o.request_id: o for o in collector(engine).step()}
    assert outs[b].finish_reason == FinishReason.CANCELLED and outs[b].token_ids == ()
    assert engine.scheduler.num_computed_tokens - computed == 1  # only a's decode token
    run_until_finished(engine, a)
    engine.check_block_accounting()


def test_deadline_cancels_with_its_own_reason() -> None:
    engine = tiny_engine()
    rid = collector(engine).add_request(prompt(5, 15), SamplingParams(temperature=0, max_tokens=10_000 // 30, ignore_eos=True),
                             timeout=1e-6)
    outs = run_until_finished(engine, rid)
    assert outs[-1].finish_reason == FinishReason.CANCELLED and outs[-1].cancel_reason == CancelReason.DEADLINE
    assert engine.stats().cancelled == {"deadline": 1}


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("cancel_after", [0, 1, 3, 7])
def test_continuing_after_a_cancel_equals_no_cancel_and_the_reference(cancel_after: int, precision: str) -> None:
    """C4, and C7: the continuation computes only the new tokens. In ``fast`` the answer is
    compared with an engine that never cancelled (the float64 reference is exact's)."""
    engine = tiny_engine(max_num_batched_tokens=8, precision=precision)  # the 20-token prompt takes 3 steps
    p, follow_up = prompt(20, 16), prompt(6, 17)
    session = engine.open_conversation()
    rid = collector(engine).add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), conversation_id=session)
    delivered: list[int] = []
    steps = 0
    while len(delivered) < cancel_after or (cancel_after == 0 and steps < 1):
        for out in collector(engine).step():
            delivered += out.new_token_ids
        steps += 1
    engine.abort(rid)
    collector(engine).step()
    assert engine.conversation_tokens(session) == p + delivered
    if cancel_after == 0:
        assert delivered == [] and 0 < engine.scheduler.conversation(session).sequence.num_computed < len(p)
    computed_before = engine.scheduler.num_computed_tokens
    held = engine.scheduler.conversation(session).sequence.num_computed
    rid2 = collector(engine).add_request(follow_up, GREEDY, conversation_id=session)
    outs = run_until_finished(engine, rid2)
    continued = list(outs[-1].token_ids)
    if precision == "exact":
        assert continued == reference_greedy(p + delivered + follow_up, 8)
    # Only tokens without K/V were computed: the rest of the prompt, the follow-up, the answer.
    total = len(p) + len(delivered) + len(follow_up)
    assert engine.scheduler.num_computed_tokens - computed_before == total - held + 8 - 1
    assert outs[-1].usage.cached_tokens == held
    # The same tokens with no cancel anywhere give the same answer.
    (fresh,) = tiny_engine(precision=precision).generate([p + delivered + follow_up], GREEDY)
    assert list(fresh.token_ids) == continued
    engine.close_conversation(session)
    engine.check_block_accounting()
    assert engine.pool.num_referenced == 0


def test_prefix_reuse_computes_only_new_tokens() -> None:
    engine = tiny_engine(block_size=4)
    p = prompt(30, 18)
    rid = collector(engine).add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    delivered = step_until_delivered(engine, 5)
    engine.abort(rid)
    collector(engine).step()
    tokens = p + delivered + prompt(7, 19)
    before = engine.scheduler.num_computed_tokens
    (out,) = engine.generate([tokens], GREEDY)
    # 34 of the 35 previous tokens have K/V (the last delivered one was never computed);
    # all of them are reused, the partly filled last block (2 tokens) included, by copy.
    assert out.usage.cached_tokens == len(p) + len(delivered) - 1 == 34
    assert engine.scheduler.num_computed_tokens - before == len(tokens) - 34 + 8 - 1
    assert list(out.token_ids) == reference_greedy(tokens, 8)


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("how", ["cancelled", "finished"])
def test_continuation_after_a_plain_answer_reuses_every_computed_token(how: str, precision: str) -> None:
    """Token-granular prefix reuse (C7): prompt + delivered answer + new text hits every
    token that has K/V (the last delivered one has none), and answers like a fresh engine."""
    engine = tiny_engine(block_size=4, precision=precision)
    p = prompt(13, 40)
    params = SamplingParams(temperature=0, max_tokens=6 if how == "finished" else 50, ignore_eos=True)
    rid = collector(engine).add_request(p, params)
    delivered = step_until_delivered(engine, 6)
    if how == "cancelled":
        assert engine.abort(rid) == AbortResult.CANCELLED
        collector(engine).step()
    tokens = p + delivered + prompt(5, 41)
    (out,) = engine.generate([tokens], GREEDY)
    assert out.usage.cached_tokens == len(p) + len(delivered) - 1
    (fresh,) = tiny_engine(block_size=4, precision=precision).generate([tokens], GREEDY)
    assert out.token_ids == fresh.token_ids
    engine.check_block_accounting()


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_preemption_under_a_small_pool_finishes_everything_correctly(precision: str) -> None:
    prompts = [prompt(10 + i, 20 + i) for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = tiny_engine(num_blocks=256, precision=precision).generate(prompts, params)
    small = tiny_engine(num_blocks=12, block_size=4, precision=precision)  # 48 token slots for 5 x 30+ tokens
    outs = small.generate(prompts, params)
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    assert small.stats().preemptions > 0
    small.check_block_accounting()
    assert small.pool.num_referenced == 0


def test_idle_conversation_blocks_are_reclaimed_under_pressure_and_recomputed() -> None:
    engine = tiny_engine(num_blocks=10, block_size=4)
    session = engine.open_conversation()
    p = prompt(20, 30)
    run_until_finished(engine, collector(engine).add_request(p, GREEDY, conversation_id=session))
    assert engine.scheduler.conversation(session).sequence.block_table.block_ids
    (other,) = engine.generate([prompt(24, 31)], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert engine.scheduler.num_reclaimed_conversations >= 1
    tokens = engine.conversation_tokens(session)
    outs = run_until_finished(engine, collector(engine).add_request([5], GREEDY, conversation_id=session))
    assert list(outs[-1].token_ids) == reference_greedy(tokens + [5], 8)
    engine.check_block_accounting()


def test_a_request_larger_than_the_pool_gets_a_clear_error() -> None:
    engine = tiny_engine(num_blocks=4, block_size=4)
    with pytest.raises(EngineError, match="context holds 16"):
        collector(engine).add_request(prompt(20, 32), GREEDY)
    (out,) = engine.generate([prompt(10, 33)], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 6


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on() -> None:
    engine = tiny_engine()
    session = engine.open_conversation()
    p = prompt(9, 34)
    rid = collector(engine).add_request(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), conversation_id=session)
    collector(engine).step()
    delivered = list(engine.conversation_tokens(session)[len(p):])
    execute = engine.runner.execute

    def broken(plan):
        raise RuntimeError("simulated kernel failure")

    engine.runner.execute = broken
    (out,) = collector(engine).step()
    assert out.finished and out.finish_reason == FinishReason.ERROR and "simulated kernel failure" in out.error
    assert engine.abort(rid) == AbortResult.ALREADY_FINISHED
    engine.runner.execute = execute
    # The conversation holds exactly what was delivered and continues exactly.
    assert engine.conversation_tokens(session) == p + delivered
    outs = run_until_finished(engine, collector(engine).add_request([7], GREEDY, conversation_id=session))
    assert list(outs[-1].token_ids) == reference_greedy(p + delivered + [7], 8)
    engine.close_conversation(session)
    engine.check_block_accounting()
    assert engine.pool.num_referenced == 0
