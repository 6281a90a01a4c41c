"""The in-process runner writes every step's logits into one reused allocation
(bargein/engine/logits_buffer.py): the large-vocabulary families (Gemma's 262,144 tokens)
no longer fault in a fresh vocabulary-wide tensor per step.

Checked: the buffer's views and budget; and on the tiny Gemma 3, Gemma 2 (its final soft
cap is applied in place, in the reused memory) and Qwen3 GGUF files in ``fast``, that a
batch of greedy, seeded-sampling and logprobs-with-penalties requests of different lengths
(so the step's row count changes under the buffer) gives exactly the tokens and
log-probabilities of the same engine writing each step into a fresh tensor (today's path),
while the runner really hands out the reused memory.
"""

from __future__ import annotations

import pytest
import torch

from bargein.engine.logits_buffer import LogitsBuffer
from bargein.engine.outputs import OutputCollector
from bargein.engine.sampling import SamplingParams
from tests.model.family_files import engine

FAMILIES = ("gemma3", "gemma2", "qwen3")


def test_views_share_one_allocation_grown_to_the_largest_step() -> None:
    buffer = LogitsBuffer(vocab_size=10, budget_bytes=4 * 10 * 3)  # room for 3 rows
    assert buffer.max_rows == 3 and buffer.capacity_rows == 0
    two = buffer.rows(2)
    assert two.shape == (2, 10) and two.dtype == torch.float32 and two.is_contiguous()
    one = buffer.rows(1)
    assert one.data_ptr() == two.data_ptr() and buffer.capacity_rows == 2  # no new allocation
    three = buffer.rows(3)
    assert three.shape == (3, 10) and buffer.capacity_rows == 3
    assert buffer.rows(3).data_ptr() == three.data_ptr()
    assert buffer.rows(4) is None  # past the budget: the caller allocates
    assert LogitsBuffer(vocab_size=10, budget_bytes=0).max_rows == 1  # one row always fits
    with pytest.raises(ValueError, match="vocab_size"):
        LogitsBuffer(vocab_size=0)


def _params(salt: str) -> list[SamplingParams]:
    """Greedy, seeded sampling with truncation, and logprobs with penalties; different lengths."""
    return [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, cache_salt=salt),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=9, ignore_eos=True,
                       cache_salt=salt),
        SamplingParams(temperature=0.7, min_p=0.05, seed=11, logprobs=3, repetition_penalty=1.3,
                       presence_penalty=0.5, frequency_penalty=0.4, max_tokens=6, ignore_eos=True,
                       cache_salt=salt),
        SamplingParams(temperature=0, logprobs=2, max_tokens=4, ignore_eos=True, cache_salt=salt),
    ]


def _run(eng, salt: str) -> list[tuple[list[int], list]]:
    """Every request's tokens and every token's logprobs (each delta's, in order)."""
    prompts = [[5 + i, 17, 42, 99 + i, 3, 25 + 2 * i, 7] for i in range(4)]
    collector = OutputCollector(eng)
    ids = [collector.add_request(p, sp) for p, sp in zip(prompts, _params(salt), strict=True)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    logprobs: dict[str, list] = {i: [] for i in ids}
    finished: set[str] = set()
    while len(finished) < len(ids) or collector.pending:
        for out in collector.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.new_logprobs
            if out.finished:
                finished.add(out.request_id)
    eng.check_block_accounting()
    return [(tokens[i], logprobs[i]) for i in ids]


@pytest.mark.parametrize("name", FAMILIES)
def test_reused_logits_give_the_fresh_tensors_tokens_and_logprobs(name: str) -> None:
    eng = engine(name, "gguf", "fast")
    runner = eng.runner
    assert runner.stages[-1].fused is not None and runner.stages[-1].fused.has_head  # the fused head writes
    pointers: list[int] = []
    execute = runner.execute

    def record(plan):
        out = execute(plan)
        pointers.append(out.data_ptr())
        return out

    runner.execute = record
    reused = _run(eng, "reused")
    buffer = runner.logits_buffer
    assert buffer.capacity_rows == 4  # grown to the 4-row steps
    reused_at = buffer.rows(1).data_ptr()
    assert pointers.count(reused_at) >= 10  # the decode steps wrote into it

    buffer.max_rows = 0  # every step gets a fresh tensor: the path before the buffer
    pointers.clear()
    fresh = _run(eng, "fresh")  # another cache salt: no prefix hit, the same steps
    assert reused_at not in pointers
    assert [len(t) for t, _ in fresh] == [12, 9, 6, 4]
    assert reused == fresh
    assert all(lp is not None for lp in fresh[2][1] + fresh[3][1]) and len(fresh[2][1][0].top) == 3
