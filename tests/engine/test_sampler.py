"""Sampler: exact logits processing, kept sets, logprobs, seeds, and the distribution."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bargein.engine.sampler import (
    SampledToken,
    Sampler,
    SamplingState,
    adjust_logits,
    truncate_logits,
)
from bargein.engine.sampling import SamplingParams

V = 32
EOS = 31


def state(
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: Sequence[int] = (EOS,),
    **params: object,
) -> SamplingState:
    s = SamplingState.create(SamplingParams(**params), list(prompt), eos)  # type: ignore[arg-type]
    s.output_token_ids.extend(output)
    return s


def random_logits(rows: int, seed: int, vocab: int = V) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def kept_set(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def tokens(results: list[SampledToken]) -> list[int]:
    return [r.token_id for r in results]


# --- greedy -------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = random_logits(6, seed=0)
    states = [state(temperature=0) for _ in range(6)]
    results = Sampler().sample(logits, states)
    assert tokens(results) == logits.argmax(-1).tolist()
    assert all(r.logprob is None and r.top_logprobs == () for r in results)


def test_greedy_with_logprobs_takes_the_slow_path_to_the_same_tokens() -> None:
    logits = random_logits(6, seed=1)
    states = [state(temperature=0, logprobs=2) for _ in range(6)]
    assert tokens(Sampler().sample(logits, states)) == logits.argmax(-1).tolist()


def test_greedy_does_not_consume_randomness() -> None:
    s = state(temperature=0, seed=5, logprobs=1)
    before = s.generator.get_state()
    Sampler().sample(random_logits(1, seed=2), [s])
    assert torch.equal(s.generator.get_state(), before)


@pytest.mark.parametrize("temperature", [1e-4, 1e-30])
def test_low_temperature_tends_to_greedy(temperature: float) -> None:
    logits = random_logits(8, seed=3)
    for seed in range(10):
        states = [state(temperature=temperature, seed=seed * 8 + i) for i in range(8)]
        assert tokens(Sampler().sample(logits, states)) == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy() -> None:
    logits = random_logits(8, seed=4)
    for seed in range(10):
        states = [state(top_k=1, temperature=1.5, seed=seed * 8 + i) for i in range(8)]
        assert tokens(Sampler().sample(logits, states)) == logits.argmax(-1).tolist()


# --- kept sets ----------------------------------------------------------------------------

# Probabilities 0.5, 0.25, 0.15, 0.1 at shuffled positions.
PROBS = log_probs(0.15, 0.5, 0.1, 0.25)


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        ({}, {0, 1, 2, 3}),
        ({"top_k": 2}, {1, 3}),
        ({"top_k": 10}, {0, 1, 2, 3}),
        ({"top_p": 0.4}, {1}),
        ({"top_p": 0.6}, {1, 3}),
        ({"top_p": 0.8}, {0, 1, 3}),
        ({"min_p": 0.25}, {0, 1, 3}),  # p >= 0.125
        ({"min_p": 0.4}, {1, 3}),  # p >= 0.2
        ({"min_p": 1.0}, {1}),
        # top_p sees the distribution after top_k: 2/3, 1/3.
        ({"top_k": 2, "top_p": 0.6}, {1}),
        # Temperature first: at T=0.5 the probabilities are 0.72, 0.18, 0.07, 0.03.
        ({"temperature": 0.5, "top_p": 0.7}, {1}),
        ({"temperature": 0.5, "min_p": 0.2}, {1, 3}),
        ({"temperature": 2.0, "min_p": 0.6}, {1, 3}),  # sqrt: 0.707, 0.548 of the max
        ({"temperature": 0}, {1}),
    ],
)
def test_kept_set(params: dict, kept: set[int]) -> None:
    out = truncate_logits(PROBS, [SamplingParams(**params)])
    assert kept_set(out[0]) == kept


def test_kept_logits_are_shifted_and_scaled_by_temperature() -> None:
    logits = torch.tensor([[1.0, 3.0, -1.0, 2.0]])
    out = truncate_logits(logits, [SamplingParams(temperature=0.5, top_k=3)])
    assert out[0].tolist() == [-4.0, 0.0, -math.inf, -2.0]


def test_ties_at_a_cut_are_all_kept() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]])
    assert kept_set(truncate_logits(logits, [SamplingParams(top_k=1)])[0]) == {1, 2, 4}
    assert kept_set(truncate_logits(logits, [SamplingParams(top_p=0.1)])[0]) == {1, 2, 4}


def test_greedy_keeps_the_first_argmax() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert kept_set(truncate_logits(logits, [SamplingParams(temperature=0)])[0]) == {1}


def test_rows_are_truncated_independently() -> None:
    params = [SamplingParams(top_k=2), SamplingParams(temperature=0), SamplingParams(min_p=0.4)]
    out = truncate_logits(PROBS.expand(3, -1), params)
    assert [kept_set(row) for row in out] == [{1, 3}, {1}, {1, 3}]


@pytest.mark.parametrize(
    ("params", "allowed"),
    [({"top_k": 2}, {1, 3}), ({"top_p": 0.6}, {1, 3}), ({"min_p": 0.25}, {0, 1, 3})],
)
def test_sampling_only_ever_yields_kept_tokens(params: dict, allowed: set[int]) -> None:
    logits = PROBS.expand(500, -1)
    states = [state(seed=i, **params) for i in range(500)]
    seen = set(tokens(Sampler().sample(logits, states)))
    assert seen == allowed  # only the kept tokens, and with 500 draws every one of them


# --- logits adjustments, on known numbers -------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    s = state(prompt=[0, 0], output=[1], repetition_penalty=2.0)
    assert adjust_logits(logits, [s])[0].tolist() == [1.0, -4.0, 1.0, -1.0, 0.5]


def test_presence_and_frequency_penalties_use_output_counts_only() -> None:
    logits = torch.zeros(1, 5)
    s = state(prompt=[4, 4], output=[2, 2, 3], presence_penalty=0.5, frequency_penalty=0.25)
    assert adjust_logits(logits, [s])[0].tolist() == [0.0, 0.0, -1.0, -0.75, 0.0]


def test_negative_penalties_encourage() -> None:
    s = state(output=[1, 1], presence_penalty=-1.0, frequency_penalty=-0.5)
    assert adjust_logits(torch.zeros(1, 3), [s])[0].tolist() == [0.0, 2.0, 0.0]


def test_logit_bias_is_added() -> None:
    s = state(logit_bias={0: 1.5, 2: -100.0})
    assert adjust_logits(torch.ones(1, 3), [s])[0].tolist() == [2.5, 1.0, -99.0]


def test_order_is_bias_then_repetition_then_presence() -> None:
    # (2 + 2) / 2 - 0.5 = 1.5; penalty before bias would give 2 / 2 + 2 - 0.5 = 2.5,
    # presence before repetition (2 + 2 - 0.5) / 2 = 1.75.
    s = state(output=[0], logit_bias={0: 2.0}, repetition_penalty=2.0, presence_penalty=0.5)
    assert adjust_logits(torch.tensor([[2.0, 0.0]]), [s])[0, 0].item() == 1.5


def test_adjustments_stay_in_their_row_and_leave_the_input_alone() -> None:
    logits = torch.ones(3, 4)
    states = [
        state(output=[0], repetition_penalty=2.0),
        state(output=[1], frequency_penalty=1.0),
        state(logit_bias={3: 1.0}),
    ]
    out = adjust_logits(logits, states)
    assert out.tolist() == [[0.5, 1, 1, 1], [1, 0, 1, 1], [1, 1, 1, 2]]
    assert torch.equal(logits, torch.ones(3, 4))


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = random_logits(20, seed=5)
    weakest = logits.argmin(-1).tolist()
    states = [state(seed=i, logit_bias={w: 100.0}) for i, w in enumerate(weakest)]
    assert tokens(Sampler().sample(logits, states)) == weakest

    best = logits.argmax(-1).tolist()
    runner_up = logits.topk(2, dim=-1).indices[:, 1].tolist()
    states = [state(temperature=0, logit_bias={b: -100.0}) for b in best]
    assert tokens(Sampler().sample(logits, states)) == runner_up


# --- min_tokens ---------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, V)
    logits[0, EOS] = 50.0
    logits[0, 7] = 40.0  # a stop token id, next in line
    logits[0, 3] = 30.0
    for temperature in (0.0, 1.0):
        s = state(min_tokens=3, stop_token_ids=[7], temperature=temperature, seed=0)
        picked = []
        for _ in range(4):
            token = Sampler().sample(logits, [s])[0].token_id
            picked.append(token)
            s.output_token_ids.append(token)
        assert picked == [3, 3, 3, EOS]


def test_min_tokens_masks_only_its_own_row() -> None:
    logits = torch.zeros(2, V)
    logits[:, EOS] = 50.0
    states = [state(min_tokens=1, temperature=0), state(temperature=0)]
    out = tokens(Sampler().sample(logits, states))
    assert out[0] != EOS and out[1] == EOS


# --- logprobs -----------------------------------------------------------------------------


def test_logprobs_are_the_models_log_softmax() -> None:
    logits = random_logits(4, seed=6)
    states = [
        state(seed=1, logprobs=3, temperature=0.3, logit_bias={0: 5.0}, repetition_penalty=1.5),
        state(seed=2),
        state(temperature=0, logprobs=0),
        state(seed=3, logprobs=20, top_k=2),
    ]
    results = Sampler().sample(logits, states)
    expected = logits.log_softmax(-1)
    for row, (r, n) in enumerate(zip(results, [3, None, 0, 20], strict=True)):
        if n is None:
            assert r.logprob is None and r.top_logprobs == ()
            continue
        assert r.logprob == pytest.approx(expected[row, r.token_id].item(), abs=1e-6)
        assert len(r.top_logprobs) == n
        values = [lp for _, lp in r.top_logprobs]
        assert values == sorted(values, reverse=True)
        top = expected[row].topk(n) if n else None
        if top is not None:
            assert [t for t, _ in r.top_logprobs] == top.indices.tolist()
            assert values == pytest.approx(top.values.tolist(), abs=1e-6)


# --- seeds --------------------------------------------------------------------------------

TARGET = {
    "seed": 1234,
    "temperature": 0.9,
    "top_k": 20,
    "top_p": 0.95,
    "repetition_penalty": 1.2,
    "logprobs": 2,
}


def logits_after(history: Sequence[int], vocab: int = V) -> torch.Tensor:
    """A row of logits that depends only on the history, as a model's would."""
    seed = hash(tuple(history)) % 2**31
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2


def random_request(rng: torch.Generator) -> SamplingState:
    choice = int(torch.randint(4, (1,), generator=rng))
    params: list[dict] = [
        {"temperature": 0},
        {"seed": int(torch.randint(1000, (1,), generator=rng)), "top_p": 0.8},
        {"min_p": 0.1, "presence_penalty": 1.0, "logprobs": 1},  # unseeded
        {"seed": 1234, "temperature": 0.5},  # same seed as the target, other params
    ]
    return state(prompt=[1, 2, 3], **params[choice])


def run_target(steps: int, batch_size: int, position: int, mix_seed: int) -> list[int]:
    """Generate with the target request at ``position`` in batches of random others."""
    rng = torch.Generator().manual_seed(mix_seed)
    target = state(prompt=[5, 6], **TARGET)
    others = [random_request(rng) for _ in range(batch_size - 1)]
    for _ in range(steps):
        batch = [*others]
        batch.insert(position, target)
        logits = torch.stack(
            [logits_after([*s.prompt_token_ids, *s.output_token_ids]) for s in batch]
        )
        for s, r in zip(batch, Sampler().sample(logits, batch), strict=True):
            s.output_token_ids.append(r.token_id)
    return target.output_token_ids


def test_seeded_output_does_not_depend_on_the_batch() -> None:
    alone = run_target(steps=12, batch_size=1, position=0, mix_seed=0)
    for batch_size, position, mix_seed in [(2, 0, 1), (2, 1, 2), (5, 2, 3), (8, 7, 4), (8, 0, 5)]:
        assert run_target(12, batch_size, position, mix_seed) == alone


def test_generator_use_per_step_does_not_depend_on_params() -> None:
    a = state(seed=9, top_k=1)
    b = state(seed=9, min_p=0.5, presence_penalty=1.0, logprobs=3)
    Sampler().sample(random_logits(2, seed=7), [a, b])
    assert torch.equal(a.generator.get_state(), b.generator.get_state())


def sequence(s: SamplingState, steps: int = 10) -> list[int]:
    flat = torch.zeros(1, 64)
    for _ in range(steps):
        s.output_token_ids.append(Sampler().sample(flat, [s])[0].token_id)
    return s.output_token_ids


def test_same_seed_same_tokens_and_different_seeds_differ() -> None:
    assert sequence(state(seed=3)) == sequence(state(seed=3))
    runs = {tuple(sequence(state(seed=seed))) for seed in range(8)}
    assert len(runs) == 8


def test_unseeded_requests_do_not_share_a_stream() -> None:
    runs = {tuple(sequence(state())) for _ in range(8)}
    assert len(runs) == 8


# --- distribution -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"temperature": 0.7}, None),
        ({"temperature": 1.0, "top_k": 3}, "top3"),
    ],
)
def test_empirical_frequencies_match_softmax(params: dict, expected: str | None) -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 1.5])
    temperature = params["temperature"]
    if expected == "top3":
        masked = torch.full_like(logits, -math.inf)
        top = logits.topk(3).indices
        masked[top] = logits[top]
        probs = (masked / temperature).softmax(-1)
    else:
        probs = (logits / temperature).softmax(-1)
    draws = 4000
    states = [state(seed=i, **params) for i in range(draws)]
    counts: Counter[int] = Counter()
    for _ in range(3):
        counts.update(tokens(Sampler().sample(logits.expand(draws, -1), states)))
    total = 3 * draws
    for token, p in enumerate(probs.tolist()):
        # Standard error is at most 0.005 here; 0.02 is four of them.
        assert counts[token] / total == pytest.approx(p, abs=0.02)


# --- properties and errors ----------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    temperature=st.sampled_from([0.0, 0.1, 1.0, 2.0]),
    top_k=st.one_of(st.none(), st.integers(1, V + 5)),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    output=st.lists(st.integers(0, V - 1), max_size=6),
)
def test_sampled_token_is_always_kept(
    seed: int, temperature: float, top_k: int | None, top_p: float, min_p: float, output: list
) -> None:
    s = state(
        output=output,
        seed=seed,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
    )
    logits = random_logits(1, seed=seed)
    kept = kept_set(truncate_logits(adjust_logits(logits, [s]), [s.params])[0])
    token = Sampler().sample(logits, [s])[0].token_id
    assert token in kept


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="len"):
        Sampler().sample(torch.zeros(2, V), [state()])


def test_empty_batch() -> None:
    assert Sampler().sample(torch.zeros(0, V), []) == []


def test_random_stream_is_keyed_on_seed_and_token_index() -> None:
    """A state rebuilt from the kept tokens (a recompute after a lost stage or a preempted
    batch) draws the same next tokens as the state that lived through them."""
    logits = random_logits(1, seed=3)
    lived = state(seed=11, temperature=1.5)
    tokens = [Sampler().sample(logits, [lived])[0].token_id for _ in range(1)]
    for _ in range(7):
        lived.output_token_ids.append(tokens[-1])
        tokens.append(Sampler().sample(logits, [lived])[0].token_id)
    rebuilt = state(seed=11, temperature=1.5)
    rebuilt.output_token_ids.extend(lived.output_token_ids[:4])
    rebuilt.generator.manual_seed(12345)  # whatever the old generator object had drawn
    assert Sampler().sample(logits, [rebuilt])[0].token_id == tokens[4]
    assert len(set(tokens)) > 1  # the stream does move from token to token
