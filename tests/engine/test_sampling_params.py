"""SamplingParams: every out-of-range value is refused naming its field; inputs normalise."""

from __future__ import annotations

import math

import pytest

from bargein.engine.sampling import InvalidSamplingParams, SamplingParams

INVALID = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.5),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("min_tokens", 1.0),
    ("temperature", -0.1),
    ("temperature", 2.01),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1"),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("top_k", 0),
    ("top_k", -1),
    ("top_k", 3.0),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.5),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", math.nan),
    ("logit_bias", {1: 100.5}),
    ("logit_bias", {1: -101.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"x": 1.0}),
    ("logit_bias", {1: math.nan}),
    ("logit_bias", [(1, 1.0), (1, 2.0)]),
    ("logit_bias", [(1, 1.0, 2.0)]),
    ("logit_bias", 5),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", 3),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", 7),
    ("ignore_eos", 1),
    ("skip_special_tokens", "yes"),
    ("logprobs", -1),
    ("logprobs", 21),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("seed", 1.5),
    ("n", 0),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_is_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("top_p", 2.0, "(0, 1]"),
        ("temperature", -1.0, "[0, 2]"),
        ("min_p", 3.0, "[0, 1]"),
        ("presence_penalty", 3.0, "[-2, 2]"),
        ("logprobs", 50, "<= 20"),
        ("max_tokens", 0, ">= 1"),
    ],
)
def test_message_states_the_allowed_range(field: str, value: object, allowed: str) -> None:
    with pytest.raises(InvalidSamplingParams, match=field) as info:
        SamplingParams(**{field: value})
    assert allowed in str(info.value)
    assert repr(value) in str(info.value)


def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert info.value.field == "min_tokens"
    assert "max_tokens" in str(info.value)


def test_boundaries_are_accepted() -> None:
    SamplingParams(max_tokens=1, min_tokens=1)
    SamplingParams(max_tokens=None, min_tokens=10_000)
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0)
    SamplingParams(temperature=2.0, min_p=0.0, repetition_penalty=1e-3)
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0)
    SamplingParams(logit_bias={0: -100.0, 7: 100.0}, logprobs=0)
    SamplingParams(logprobs=20, seed=2**64 - 1, n=3)
    SamplingParams(seed=-(2**63))


def test_defaults() -> None:
    p = SamplingParams()
    assert p.max_tokens == 256
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, None, 0.0)
    assert p.logit_bias == () and p.stop == () and p.stop_token_ids == ()
    assert p.logprobs is None and p.seed is None and p.n == 1
    assert not p.greedy


def test_greedy_is_temperature_zero() -> None:
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-6).greedy


def test_single_stop_string_becomes_a_tuple() -> None:
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_logit_bias_mapping_becomes_sorted_pairs() -> None:
    p = SamplingParams(logit_bias={9: -1, 2: 0.5, "4": 3})
    assert p.logit_bias == ((2, 0.5), (4, 3.0), (9, -1.0))
    assert all(isinstance(bias, float) for _, bias in p.logit_bias)
    assert SamplingParams(logit_bias=[(9, -1.0), (2, 0.5)]).logit_bias == ((2, 0.5), (9, -1.0))


def test_sequences_become_tuples_and_params_are_hashable() -> None:
    a = SamplingParams(stop_token_ids=[5, 6], stop=["x"], logit_bias={1: 2.0}, temperature=1)
    b = SamplingParams(stop_token_ids=(5, 6), stop="x", logit_bias=((1, 2.0),), temperature=1.0)
    assert a.stop_token_ids == (5, 6)
    assert a == b and hash(a) == hash(b)
    assert isinstance(a.temperature, float)


def test_params_are_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


def test_validate_for_vocab() -> None:
    SamplingParams(logit_bias={31: 1.0}, stop_token_ids=[31]).validate_for_vocab(32)
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(logit_bias={32: 1.0}).validate_for_vocab(32)
    assert info.value.field == "logit_bias" and "32" in str(info.value)
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(stop_token_ids=[0, 40]).validate_for_vocab(32)
    assert info.value.field == "stop_token_ids" and "40" in str(info.value)
