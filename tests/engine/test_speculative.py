"""Speculative decoding never changes an answer (issue 30).

Every check compares an engine that speculates with one that never does, token for token:
greedy and seeded sampled streams, in both precisions, with three proposers (prompt
lookup; a scripted one that guesses the true continuation with a planted miss, so long
confirmed runs and misses at every offset occur; a draft model, both the target's own
weights and random ones). Then the contract: a cancel at every position inside a
verification step leaves the conversation equal to one that never speculated (C3, C4),
with blocks holding only accepted tokens, the accounting exact to the block (C5), and
only accepted full blocks registered; and the scheduling: opt-out, back-off, k adapting.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import pytest
import torch

from bargein.config import EngineConfig, SpeculativeConfig
from bargein.engine.block_keys import chain_hash
from bargein.engine.device import build_model
from bargein.engine.engine import Engine
from bargein.engine.kv_disk.block_file import parse_name
from bargein.engine.plan import ScheduledChunk, StepPlan
from bargein.engine.request import AbortResult, FinishReason
from bargein.engine.sampler import argmax_rows
from bargein.engine.sampling import SamplingParams
from bargein.engine.speculative.controller import guesses_that_pay
from bargein.engine.speculative.draft_model import DraftModelProposer
from bargein.engine.speculative.ngram import NgramProposer
from bargein.engine.speculative.proposer import DraftRequest
from tests.dense_reference import random_weights
from tests.tiny_engine import (
    EOS,
    TINY,
    collector,
    prompt,
    run_until_finished,
    target_device,
    tiny_engine,
    tiny_weights,
)

K = 4
# A fixed guess cost: which guesses are made must not depend on this machine's step times.
SPEC = SpeculativeConfig(method="ngram", max_draft_tokens=K, guess_cost=0.1)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
# Repeats so that prompt lookup finds matches; the others are plain random prompts.
PROMPTS = [prompt(7, 1) * 3, prompt(23, 2), prompt(3, 3), prompt(11, 4) * 2 + prompt(5, 5)]


class ScriptedProposer:
    """Guesses the continuation a speculation-free engine produced (``truth``), with one
    wrong guess planted at an offset that moves with the position, and none at every
    fourth position: confirmed runs of every length, misses at every offset."""

    def __init__(self, truth: Sequence[Sequence[int]], miss: bool = True):
        self.truth = [list(t) for t in truth]
        self.miss = miss
        self.asked: list[DraftRequest] = []

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]:
        self.asked += requests
        out = {}
        for r in requests:
            n = len(r.token_ids)
            full = next((t for t in self.truth if t[:n] == list(r.token_ids) and len(t) > n), None)
            if full is None:
                continue
            guess = full[n:n + r.k]
            bad = n % (K + 1)
            if self.miss and n % 4 and bad < len(guess):
                guess[bad] = (guess[bad] + 1) % 256
            out[r.request_id] = tuple(guess)
        return out

    def forget(self, request_id: str) -> None:
        pass


def _draft(seed: int, precision: str) -> DraftModelProposer:
    """A draft model of the tiny family: the target's own weights (seed 0) or random ones."""
    weights = tiny_weights(0) if seed == 0 else random_weights(TINY, seed=seed)
    config = EngineConfig(device=target_device(), dtype=os.environ.get("BARGEIN_TEST_DTYPE", "float32"),
                          precision=precision)  # as tiny_engine's
    stage = build_model(TINY, dict(weights), config, max_positions=TINY.max_position_embeddings)
    return DraftModelProposer(stage, kv_tokens=512, block_size=4, target_vocab_size=TINY.vocab_size)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny forwards gain nothing from a second thread, and on a loaded 2-core machine
    torch's threads wait on each other: one thread made this module ~20x faster there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_BASE: dict[tuple, list] = {}


def baseline(precision: str, params: SamplingParams, prompts=PROMPTS, **engine_args) -> list[list[int]]:
    """The speculation-free answers (each prompt's full token list), computed once per module."""
    key = (precision, params, tuple(map(tuple, prompts)), tuple(sorted(engine_args.items())))
    if key not in _BASE:
        outs = tiny_engine(precision=precision, speculative="off", **engine_args).generate(prompts, params)
        _BASE[key] = [list(p) + list(o.token_ids) for p, o in zip(prompts, outs, strict=True)]
    return _BASE[key]


def speculating(precision: str, proposer: str, truth=(), **engine_args) -> Engine:
    if proposer == "ngram":
        return tiny_engine(precision=precision, speculative=SPEC, **engine_args)
    chosen = (ScriptedProposer(truth) if proposer == "scripted" else
              _draft(0 if proposer == "draft-same" else 7, precision))
    return tiny_engine(precision=precision, speculative=SPEC, draft_proposer=chosen, **engine_args)


def answers(engine: Engine, params: SamplingParams, prompts=PROMPTS) -> list[list[int]]:
    outs = engine.generate(prompts, params)
    for o in outs:
        assert o.usage.completion_tokens == len(o.token_ids) <= params.max_tokens  # usage: delivered tokens only
    return [list(p) + list(o.token_ids) for p, o in zip(prompts, outs, strict=True)]


def assert_clean(engine: Engine) -> None:
    """C5 to the block, and nothing registered but accepted tokens (checked keys)."""
    engine.check_block_accounting()
    assert engine.pool.num_referenced == 0
    assert not engine.scheduler.requests


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("proposer", ["ngram", "scripted", "draft-same", "draft-random"])
def test_greedy_answers_are_identical_with_and_without_speculation(precision: str, proposer: str) -> None:
    # 16 batched tokens: the long prompt's chunks share steps with other requests' verification rows.
    truth = baseline(precision, GREEDY, max_num_batched_tokens=16)
    engine = speculating(precision, proposer, truth, max_num_batched_tokens=16)
    assert answers(engine, GREEDY) == truth
    counts = engine.speculation.counts()
    assert counts.drafted_tokens > 0
    if proposer == "draft-same":
        assert counts.accepted_tokens > counts.verify_steps  # runs of several confirmed guesses
    assert_clean(engine)


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("proposer", ["scripted", "draft-random"])
def test_a_seeded_sampled_stream_is_identical_with_and_without_speculation(precision: str, proposer: str) -> None:
    truth = baseline(precision, SEEDED)
    engine = speculating(precision, proposer, truth)
    assert answers(engine, SEEDED) == truth
    assert engine.speculation.counts().drafted_tokens > 0
    assert_clean(engine)


def _block_keys(sequences: Sequence[Sequence[int]]) -> set[bytes]:
    """The chained keys of every full block of ``sequences``."""
    keys = set()
    for tokens in sequences:
        parent = None
        for i in range(len(tokens) // 4):
            parent = chain_hash(parent, tokens[i * 4:(i + 1) * 4])
            keys.add(parent)
    return keys


@pytest.mark.parametrize("proposer", ["scripted", "draft-random"])
def test_only_blocks_of_accepted_tokens_are_ever_registered(proposer: str, tmp_path) -> None:
    """The one rule of every block index (prefix cache, router, KV disk tier): each key the
    pool ever held, and each block the disk tier wrote, names a full block of the answers
    as delivered, never a rejected guess."""
    truth = baseline("exact", GREEDY)
    engine = speculating("exact", proposer, truth, num_blocks=24, kv_disk_dir=str(tmp_path))  # a small pool: evictions
    engine.pool.track_key_changes()
    assert answers(engine, GREEDY) == truth
    expected = _block_keys(truth)
    ever = set(engine.pool.drain_key_changes().keys)  # every key registered (or dropped) since tracking began
    assert engine.speculation.counts().drafted_tokens > engine.speculation.counts().accepted_tokens  # misses
    assert ever and ever <= expected and engine.pool.registered_keys() <= expected
    assert engine.close_kv_disk()
    on_disk = {parsed[0] for f in tmp_path.iterdir() if (parsed := parse_name(f.name)) is not None}
    assert on_disk and on_disk <= expected


def test_a_stop_token_inside_the_confirmed_run_ends_the_answer_there() -> None:
    """Tokens confirmed after eos or past max_tokens are never delivered nor counted."""
    params = SamplingParams(temperature=0, max_tokens=9)
    truth = baseline("exact", GREEDY)
    # Plant eos in the truth: the scripted guesses then confirm it mid-run.
    planted = [t[:len(p) + 5] + [EOS] + t[len(p) + 6:] for p, t in zip(PROMPTS, truth, strict=True)]
    engine = speculating("exact", "scripted", planted)
    outs = engine.generate(PROMPTS, params)
    plain = tiny_engine(speculative="off").generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.usage.completion_tokens for o in outs] == [len(o.token_ids) for o in plain]
    assert_clean(engine)


def _verification_step(engine: Engine, conversation: str, p: list[int]) -> tuple[str, list[int]]:
    """Starts a greedy answer in ``conversation``; steps until a verification step has
    delivered 1 + K tokens. Returns the request id and the tokens delivered before it."""
    rid = collector(engine).add_request(p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                        conversation_id=conversation)
    delivered: list[int] = []
    while True:
        before = list(delivered)
        for out in collector(engine).step():
            delivered += out.new_token_ids
        if len(delivered) - len(before) == 1 + K:
            return rid, before


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_a_cancel_at_every_position_inside_a_verification_step_keeps_only_delivered_tokens(precision: str) -> None:
    """C3 and C4: cut after j of a verification step's tokens, for every j, the
    conversation holds the prompt and exactly the delivered tokens, its blocks hold only
    accepted tokens, and continuing it answers as an engine that never speculated."""
    p, follow_up = prompt(10, 50), prompt(5, 51)
    truth = baseline(precision, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), prompts=[p])
    plain = tiny_engine(precision=precision, speculative="off")
    engine = tiny_engine(precision=precision, speculative=SPEC, draft_proposer=ScriptedProposer(truth, miss=False))
    for j in range(K + 2):
        conversation = engine.open_conversation()
        rid, before = _verification_step(engine, conversation, p)
        assert engine.abort(rid, delivered=len(before) + j) == AbortResult.CANCELLED
        collector(engine).step()
        kept = p + truth[0][len(p):len(p) + len(before) + j]
        seq = engine.scheduler.conversation(conversation).sequence
        assert engine.conversation_tokens(conversation) == kept
        assert seq.num_computed <= len(kept) and len(seq.block_table.block_ids) == -(-len(kept) // 4)
        assert len(seq.block_table.hashes) <= seq.num_computed // 4  # registered: accepted full blocks only
        engine.check_block_accounting()
        held = seq.num_computed
        rid2 = collector(engine).add_request(follow_up, GREEDY, conversation_id=conversation)
        final = run_until_finished(engine, rid2)[-1]
        assert final.usage.cached_tokens == held  # C7: every computed token reused
        (fresh,) = plain.generate([kept + follow_up], GREEDY)
        assert final.token_ids == fresh.token_ids, j
        engine.close_conversation(conversation)
        assert_clean(engine)


def test_a_cancel_during_the_verification_forward_drops_every_token_of_the_step() -> None:
    p = prompt(10, 52)
    truth = baseline("exact", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), prompts=[p])
    engine = tiny_engine(speculative=SPEC, draft_proposer=ScriptedProposer(truth, miss=False))
    conversation = engine.open_conversation()
    rid, before = _verification_step(engine, conversation, p)
    delivered = truth[0][len(p):len(p) + len(before) + 1 + K]
    entered, release = threading.Event(), threading.Event()
    execute = engine.runner.execute

    def blocking_execute(plan):
        entered.set()
        assert release.wait(10)
        return execute(plan)

    engine.runner.execute = blocking_execute
    result: list = []
    stepper = threading.Thread(target=lambda: result.extend(collector(engine).step()))
    stepper.start()
    assert entered.wait(10)
    assert engine.abort(rid) == AbortResult.CANCELLED
    release.set()
    stepper.join(10)
    (final,) = result
    assert final.finish_reason == FinishReason.CANCELLED and final.new_token_ids == ()
    seq = engine.scheduler.conversation(conversation).sequence
    assert engine.conversation_tokens(conversation) == p + delivered
    assert seq.num_computed == len(p) + len(delivered)  # the pending token was computed; the guesses were not
    assert len(seq.block_table.block_ids) == -(-seq.num_tokens // 4)
    engine.check_block_accounting()


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_verification_rows_compute_what_single_decodes_compute(precision: str) -> None:
    """A row's logits (and the K/V behind them) do not depend on how many rows share the
    step: a chunk of 1 + k tokens equals k + 1 one-token decodes, bit for bit in ``fast``."""
    runner = tiny_engine(precision=precision).runner
    p, follow = prompt(9, 53), prompt(5, 54)
    logits_one = runner.execute(StepPlan(1, (ScheduledChunk("a", tuple(p), 0, (0, 1, 2, 3), True,
                                                                  tuple(follow[:4])),))).clone()
    runner.execute(StepPlan(2, (ScheduledChunk("b", tuple(p[:-1]), 0, (4, 5, 6, 7), False),)))
    singles = []
    for i, t in enumerate([p[-1], *follow[:4]]):
        other = ScheduledChunk("c", (7,), i, (8, 9), True)  # another request's decode in the step
        out = runner.execute(StepPlan(3 + i, (other, ScheduledChunk("b", (t,), len(p) - 1 + i, (4, 5, 6, 7), True))))
        singles.append(out[1].clone())  # execute's logits live until its next call
    if precision == "fast":
        assert torch.equal(logits_one, torch.stack(singles))
    else:
        torch.testing.assert_close(logits_one, torch.stack(singles), rtol=1e-5, atol=1e-5)


def test_a_request_that_opts_out_never_speculates_and_others_still_do() -> None:
    truth = baseline("exact", GREEDY)
    proposer = ScriptedProposer(truth)
    engine = tiny_engine(speculative=SPEC, draft_proposer=proposer)
    collector(engine)
    outs = engine.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                        speculative=False), GREEDY])
    assert [list(p) + list(o.token_ids) for p, o in zip(PROMPTS[:2], outs, strict=True)] == truth[:2]
    def asked_for(p: list[int]) -> bool:
        return any(list(r.token_ids[:len(p)]) == p for r in proposer.asked)

    assert not asked_for(PROMPTS[0]) and asked_for(PROMPTS[1])
    assert_clean(engine)


def test_speculation_backs_off_in_a_wide_batch() -> None:
    truth = baseline("exact", GREEDY)
    proposer = ScriptedProposer(truth)
    engine = tiny_engine(speculative=SpeculativeConfig(method="ngram", max_draft_tokens=K, max_batch=3, guess_cost=0.1),
                         draft_proposer=proposer)
    wide = engine.scheduler.schedule
    widths = []

    def schedule(*args):
        plan = wide(*args)
        widths.append(sum(1 for c in plan.chunks if c.sample and len(c.token_ids) == 1))
        return plan

    engine.scheduler.schedule = schedule
    assert answers(engine, GREEDY) == truth
    assert max(widths) == 4 and proposer.asked  # 4 decodes: no guesses; fewer: guesses
    assert len(proposer.asked) <= sum(w for w in widths if w <= 3)
    assert_clean(engine)


def test_k_adapts_to_the_acceptance_rate() -> None:
    """Always wrong: k falls with the acceptance rate, then the request rests between
    one-guess probes; always right: k stays at its most. (Which k pays: ``guesses_that_pay``.)"""

    class Wrong(ScriptedProposer):
        def propose(self, requests):  # 256 is eos, which this ignore_eos answer never picks
            return {r.request_id: (EOS,) * r.k for r in requests}

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    wrong = tiny_engine(speculative=SPEC, draft_proposer=Wrong([]))
    (out,) = wrong.generate([prompt(6, 55)], params)
    counts = wrong.speculation.counts()
    assert counts.accepted_tokens == 0 and counts.verify_steps <= 12  # of 39 decode steps: it rested
    assert counts.drafted_tokens < K * counts.verify_steps / 2  # k fell
    truth = baseline("exact", params, prompts=[prompt(6, 55)])
    right = tiny_engine(speculative=SPEC, draft_proposer=ScriptedProposer(truth, miss=False))
    assert answers(right, params, prompts=[prompt(6, 55)]) == truth
    counts = right.speculation.counts()
    assert counts.accepted_tokens == counts.drafted_tokens and counts.drafted_tokens >= 30
    assert list(out.token_ids) == truth[0][6:]


def test_guesses_pay_while_their_chance_exceeds_their_cost() -> None:
    assert guesses_that_pay(0.8, 0.35, 8) == 4  # 0.8 ** 4 = 0.41 > 0.35 > 0.8 ** 5 = 0.33
    assert guesses_that_pay(0.8, 0.35, 3) == 3
    assert guesses_that_pay(0.3, 0.35, 8) == 0
    assert guesses_that_pay(0.99, 0.0, 5) == 5


def test_verification_picks_each_rows_argmax_as_torch_does() -> None:
    """The one-thread argmax that verification uses takes the first of equal maxima, as
    torch.argmax (and so the decode path's sampler) does: a tie can never change a token."""
    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(3))
    logits[1, 10] = logits[1, 200] = logits[1].max() + 1  # a tie: the first one wins
    logits[2] = 0.0
    logits[3, 5] = float("inf")
    logits[4, 9] = float("nan")
    assert argmax_rows(logits) == logits.argmax(dim=-1).tolist()
    assert argmax_rows(logits)[1:3] == [10, 0]


def test_prompt_lookup_guesses_what_followed_the_longest_earlier_match() -> None:
    lookup = NgramProposer(ngram_min=2, ngram_max=3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # "1 2 3" occurred at 0..2 (followed by 4 5 9); "2 3" last at 6..7 (followed by 7 8): the longer wins.
    assert lookup.propose([DraftRequest("a", tokens, 3)]) == {"a": (4, 5, 9)}
    assert lookup.propose([DraftRequest("a", tokens + [4], 2)]) == {"a": (5, 9)}  # extended incrementally
    assert lookup.propose([DraftRequest("a", [6, 6, 5], 2)]) == {}  # cut tail: index rebuilt, no match
    # A run that repeats itself: the guesses go on past the text's end, as long as the match.
    assert lookup.propose([DraftRequest("b", [1, 1, 1, 1], 4)]) == {"b": (1, 1, 1)}
    assert lookup.propose([DraftRequest("c", [8, 5, 6, 5, 6, 5, 6], 8)]) == {"c": (5, 6, 5, 6)}  # matched 4 back
    # No more guesses than the match is long: "5 6" matched 2 tokens back, "9 5 6" 3 tokens.
    assert lookup.propose([DraftRequest("d", [5, 6, 1, 2, 3, 4, 9, 5, 6], 5)]) == {"d": (1, 2)}
    assert lookup.propose([DraftRequest("e", [9, 5, 6, 1, 2, 3, 4, 9, 5, 6], 5)]) == {"e": (1, 2, 3)}


def test_the_draft_model_rolls_its_kv_back_and_gives_every_block_back() -> None:
    draft = _draft(0, "exact")
    p = prompt(9, 56)
    first = draft.propose([DraftRequest("a", p, 3)])["a"]
    # The target took two of the guesses and then another token: the draft keeps p + 2 guesses.
    cont = p + list(first[:2]) + [(first[2] + 1) % 256]
    again = draft.propose([DraftRequest("a", cont, 3)])["a"]
    fresh = _draft(0, "exact").propose([DraftRequest("z", cont, 3)])["z"]
    assert again == fresh  # rolled back: as if it never saw the rejected guess
    draft.pool.check_invariants([s.table for s in draft._sequences.values()])
    draft.forget("a")
    assert draft.pool.num_free == draft.pool.num_blocks
    with pytest.raises(ValueError, match="vocabulary"):
        DraftModelProposer(draft.runner.stages, kv_tokens=64, block_size=4, target_vocab_size=999)


def test_speculation_needs_the_model_in_this_process_and_a_draft_path() -> None:
    with pytest.raises(ValueError, match="draft model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="one of"):
        SpeculativeConfig(method="eagle")
