"""The sampler on vocabulary-wide rows (Gemma's 262,144 tokens) picks what it picked before
its large-vocabulary work (one torch thread, numpy's sort for top_p, a partial selection for
top_k alone): token for token and log-probability for log-probability, against the
algorithm as it was (``_reference_truncate``, the earlier ``truncate_logits`` verbatim)
run on two torch threads as the engine ran it.

Rows of 131,072 tokens: past torch's grain (32,768 elements), so the two-thread reference
really splits its operations.
"""

from __future__ import annotations

import pytest
import torch

from bargein.engine import sampler
from bargein.engine.sampler import Sampler, SamplingState, adjust_logits, row_sampling, sample_rows
from bargein.engine.sampling import SamplingParams
from tests.torch_threads import torch_threads

VOCAB = 131_072


def _reference_truncate(logits: torch.Tensor, params) -> torch.Tensor:
    """``truncate_logits`` before this change (full torch sort for top_k and top_p)."""
    row_max = logits.max(dim=-1, keepdim=True).values
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    temperature = sampler._column([p.temperature if not p.greedy else 1.0 for p in params], logits)
    scaled = (logits - row_max) / temperature
    threshold = torch.full_like(row_max, float("-inf"))
    vocab_size = logits.shape[-1]
    if any(p.top_k is not None or p.top_p < 1.0 for p in params):
        sorted_desc = scaled.sort(dim=-1, descending=True).values
        top_k = [min(p.top_k or vocab_size, vocab_size) for p in params]
        kth = sorted_desc.gather(1, sampler._column(top_k, logits, torch.long) - 1)
        sorted_desc = torch.where(sorted_desc >= kth, sorted_desc, float("-inf"))
        probs = sorted_desc.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        within = mass_before < sampler._column([p.top_p for p in params], logits)
        within |= sampler._column([p.top_p == 1.0 for p in params], logits, torch.bool)
        last_kept = sorted_desc.gather(1, within.sum(dim=-1, keepdim=True) - 1)
        threshold = torch.maximum(kth, last_kept)
    if any(p.min_p > 0.0 for p in params):
        threshold = torch.maximum(threshold, sampler._column([p.min_p for p in params], logits).log())
    kept = torch.where(scaled >= threshold, scaled, float("-inf"))
    if any(p.greedy for p in params):
        best = logits.argmax(dim=-1, keepdim=True)
        one_hot = torch.full_like(logits, float("-inf")).scatter_(1, best, 0.0)
        kept = torch.where(sampler._column([p.greedy for p in params], logits, torch.bool), one_hot, kept)
    return kept


def _reference_sample(logits: torch.Tensor, states) -> list:
    with torch_threads(2):
        kept = _reference_truncate(adjust_logits(logits, states), [s.params for s in states])
        token_ids = (kept + sampler._gumbel_noise(logits, states)).argmax(dim=-1)
        return sampler._with_logprobs(logits, token_ids, states)


def _logits(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * 4
    logits[:, ::7] = logits[:, :1]  # ties at the cut: equal values are all kept or all dropped
    logits[0, 100:200] = float("-inf")  # masked tokens (a grammar, min_tokens)
    return logits


BATCHES = {
    "top_p and top_k mixed": [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=1.2, top_k=40, top_p=0.95, seed=2, logprobs=3),
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=0.5, top_p=0.5, min_p=0.1, seed=3, repetition_penalty=1.2,
                       presence_penalty=0.3, frequency_penalty=0.2),
    ],
    "top_k alone": [
        SamplingParams(temperature=0.8, top_k=40, seed=4),
        SamplingParams(temperature=1.0, seed=5, logprobs=5),  # no top_k beside one that has it
        SamplingParams(temperature=0.7, top_k=1, min_p=0.2, seed=6),
        SamplingParams(temperature=0.9, top_k=VOCAB + 5, seed=7),  # past the vocabulary: all
    ],
    "temperature only": [SamplingParams(temperature=0.8, seed=s) for s in range(8, 11)],
}


@pytest.mark.parametrize("batch", list(BATCHES))
def test_the_same_tokens_and_logprobs_as_before(batch: str) -> None:
    params = BATCHES[batch]
    logits = _logits(len(params), seed=len(batch))
    for step in range(2):  # two token indices: two draws of each row's random stream
        states = [SamplingState.create(p, prompt_token_ids=[5, 9, 100 + i], eos_token_ids=[2])
                  for i, p in enumerate(params)]
        for state in states:
            state.output_token_ids.extend([7, 7, 11][:step + 1])
        want = _reference_sample(logits, states)
        assert Sampler().sample(logits, states) == want
        plain = [row_sampling(s) for s in states]
        if all(r is not None for r in plain):  # a pipeline's last stage picks the same tokens
            assert sample_rows(logits, plain) == [t.token_id for t in want]


def test_the_threads_come_back_after_sampling() -> None:
    with torch_threads(2):
        states = [SamplingState.create(SamplingParams(temperature=0.8, top_p=0.9, seed=1), [1])]
        Sampler().sample(_logits(1, seed=0), states)
        assert torch.get_num_threads() == 2
