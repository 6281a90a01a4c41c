"""Speculative decoding through the server: the per-request opt-out, unchanged answers and
usage, the drafted/accepted counters in /metrics, and the serve flags (no model to load)."""

from __future__ import annotations

import argparse

import pytest
import torch

from bargein.cli.errors import CliError
from bargein.cli.serve import _add_serve_arguments, _speculative
from bargein.config import SpeculativeConfig
from bargein.server.settings import SettingsError
from tests.server.inprocess_app import inprocess_app
from tests.tiny_engine import prompt, tiny_engine

BODY = {"prompt": prompt(11, 4) * 2 + prompt(5, 5),  # the tiny model repeats some of it
        "max_tokens": 20, "temperature": 0, "ignore_eos": True}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see test_speculative.py
    yield
    torch.set_num_threads(threads)


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
                or line.startswith(name + "_total "))


@pytest.mark.anyio
async def test_answers_usage_and_metrics_with_speculation_and_a_request_that_opts_out() -> None:
    (plain,) = tiny_engine(speculative="off").generate([BODY["prompt"]], _params())
    async with inprocess_app(tiny_engine(speculative=SpeculativeConfig(method="ngram", guess_cost=0.1))) as (_, client):
        spec = (await client.post("/v1/completions", json=BODY)).json()
        drafted = _metric((await client.get("/metrics")).text, "bargein_speculative_drafted_tokens")
        out = (await client.post("/v1/completions", json={**BODY, "speculative": False})).json()
        metrics = (await client.get("/metrics")).text
        bad = await client.post("/v1/completions", json={**BODY, "speculative": "sometimes"})
    for answer in (spec, out):
        assert answer["choices"][0]["text"] == plain.text
        assert answer["usage"]["completion_tokens"] == len(plain.token_ids) == 20
    assert drafted > 0 and _metric(metrics, "bargein_speculative_drafted_tokens") == drafted  # the opt-out drafted none
    assert 0 < _metric(metrics, "bargein_speculative_accepted_tokens") <= drafted
    assert bad.status_code in (400, 422) and "speculative" in bad.text


def _params():
    from bargein.engine.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    _add_serve_arguments(p)
    return p.parse_args(list(argv))


def test_the_serve_flags_make_the_speculative_config_or_a_clear_error() -> None:
    assert _speculative(_args(), False) == SpeculativeConfig()
    assert _speculative(_args("--speculative", "ngram", "--speculative-tokens", "3"), False) == \
        SpeculativeConfig(method="ngram", max_draft_tokens=3)
    assert _speculative(_args("--draft-model", "d.gguf"), False) == SpeculativeConfig(method="draft",
                                                                                      draft_model="d.gguf")
    with pytest.raises(SettingsError, match="pipeline"):
        _speculative(_args("--speculative", "ngram"), True)
    with pytest.raises(SettingsError, match="--draft-model is for"):
        _speculative(_args("--speculative", "ngram", "--draft-model", "d.gguf"), False)
    with pytest.raises(ValueError, match="needs a draft model"):
        _speculative(_args("--speculative", "draft"), False)
    with pytest.raises((SystemExit, CliError)):
        _args("--speculative", "eagle")
