"""The paged model against a dense reference: single, batched, chunked and staged."""

from __future__ import annotations

import pytest
import torch

from bargein.config import ModelConfig, RopeScaling
from bargein.model.attention import AttentionMetadata
from bargein.model.llama import LlamaStage
from tests.dense_reference import dense_logits, random_weights

BLOCK = 4

CONFIGS = {
    "gqa-tied": ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3,
                            num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True),
    "mha-untied-bias": ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2,
                                   num_heads=3, num_kv_heads=3, head_dim=16, attention_bias=True),
    "llama3-rope": ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                               num_heads=4, num_kv_heads=1, head_dim=16, rope_theta=500000.0,
                               rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64)),
}


class PagedRunner:
    """Gives each sequence its own blocks (distinct, interleaved ids) and runs chunks."""

    def __init__(self, stages: list[LlamaStage], num_blocks: int = 64):
        self.stages = stages
        self.caches = [s.make_kv_caches(num_blocks, BLOCK) for s in stages]
        self.tables: dict[int, list[int]] = {}
        self.next_block = num_blocks - 1  # hand out from the top, so ids are not 0..n in order

    def table(self, seq: int, length: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * BLOCK < length:
            table.append(self.next_block)
            self.next_block -= 1
        return table

    def run(self, chunks: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """chunks: (seq, new tokens, num already computed) -> logits (len, vocab) per chunk."""
        ids, positions, tables, q_lens, ctx_lens = [], [], [], [], []
        for seq, tokens, done in chunks:
            ids += tokens
            positions += range(done, done + len(tokens))
            tables.append(self.table(seq, done + len(tokens)))
            q_lens.append(len(tokens))
            ctx_lens.append(done + len(tokens))
        meta = AttentionMetadata.build(block_tables=tables, query_lens=q_lens, context_lens=ctx_lens, block_size=BLOCK)
        x = torch.tensor(ids)
        pos = torch.tensor(positions)
        for stage, caches in zip(self.stages, self.caches, strict=True):
            x = stage(x, pos, meta, caches, logits_indices=torch.arange(len(ids)) if stage.is_last else None)
        return list(x.split(q_lens))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", CONFIGS)
def test_single_sequence_matches_dense_reference(name: str) -> None:
    config = CONFIGS[name]
    w = random_weights(config)
    seq = tokens(23, 1)
    (logits,) = PagedRunner([LlamaStage(config, w)]).run([(0, seq, 0)])
    torch.testing.assert_close(logits.double(), dense_logits(config, w, seq), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", CONFIGS)
def test_batched_mixed_prefill_and_decode_equals_each_alone(name: str) -> None:
    config = CONFIGS[name]
    w = random_weights(config)
    model = LlamaStage(config, w)
    seqs = [tokens(n, 10 + n) for n in (1, 5, 17, 9, 30)]
    expected = [dense_logits(config, w, s) for s in seqs]
    runner = PagedRunner([model])
    # Step 1: prompts of different lengths (all but the last token) in one forward.
    out = runner.run([(i, s[:-1], 0) for i, s in enumerate(seqs) if len(s) > 1])
    # Step 2: every sequence's last token, as decodes, plus the 1-token prompt's prefill.
    out2 = runner.run([(i, s[-1:], len(s) - 1) for i, s in enumerate(seqs)])
    for i in range(len(seqs)):
        torch.testing.assert_close(out2[i][0].double(), expected[i][-1], atol=1e-4, rtol=1e-4)
    for logits, s in zip(out, [s for s in seqs if len(s) > 1], strict=True):
        torch.testing.assert_close(logits.double(), dense_logits(config, w, s)[:-1], atol=1e-4, rtol=1e-4)


def test_chunked_prefill_equals_whole_prefill() -> None:
    config = CONFIGS["gqa-tied"]
    w = random_weights(config)
    seq = tokens(29, 3)
    runner = PagedRunner([LlamaStage(config, w)])
    got = []
    for start, end in [(0, 7), (7, 8), (8, 20), (20, 29)]:
        got += runner.run([(0, seq[start:end], start)])
    torch.testing.assert_close(torch.cat(got).double(), dense_logits(config, w, seq), atol=1e-4, rtol=1e-4)


def test_pipeline_stages_compose_to_the_whole_model() -> None:
    config = CONFIGS["gqa-tied"]
    w = random_weights(config)
    seq = tokens(12, 4)
    stages = [LlamaStage(config, w, (0, 1)), LlamaStage(config, w, (1, 2)), LlamaStage(config, w, (2, 3))]
    assert [s.is_first for s in stages] == [True, False, False]
    assert stages[1].embed is None and stages[1].lm_head is None and stages[2].embed is None
    (logits,) = PagedRunner(stages).run([(0, seq, 0)])
    torch.testing.assert_close(logits.double(), dense_logits(config, w, seq), atol=1e-4, rtol=1e-4)


def test_bfloat16_stays_close_to_reference() -> None:
    config = CONFIGS["gqa-tied"]
    w = random_weights(config)
    seq = tokens(16, 5)
    model = LlamaStage(config, {k: v.to(torch.bfloat16) for k, v in w.items()})
    (logits,) = PagedRunner([model]).run([(0, seq, 0)])
    assert logits.dtype == torch.float32
    ref = dense_logits(config, w, seq)
    assert (logits.double() - ref).abs().max() < 0.1 * ref.abs().max()
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_bad_layer_range_is_refused() -> None:
    config = CONFIGS["gqa-tied"]
    with pytest.raises(ValueError, match="layer range"):
        LlamaStage(config, random_weights(config), (2, 5))


def test_a_callback_after_the_next_forward_runs_once_when_it_has_returned() -> None:
    config = CONFIGS["gqa-tied"]
    model = LlamaStage(config, random_weights(config))
    runner = PagedRunner([model])
    calls: list[object] = []
    stored = runner.caches[0][-1].k  # the last layer's keys: written by the forward, zero before
    model.after_next_forward(lambda: calls.append(bool(stored.any())))
    model.after_next_forward(lambda: calls.append("second"))
    assert calls == []  # nothing before a forward
    runner.run([(0, tokens(5, 1), 0)])
    assert calls == [True, "second"]  # after it (its keys stored), in order
    runner.run([(0, tokens(1, 2), 5)])
    assert calls == [True, "second"]  # once


def test_quiet_for_says_whether_no_forward_ran_for_so_long_and_holds_the_stage_weakly() -> None:
    import gc
    import time

    config = CONFIGS["gqa-tied"]
    model = LlamaStage(config, random_weights(config))
    runner = PagedRunner([model])
    quiet = model.quiet_for(0.2)
    during: list[bool] = []
    model.after_next_forward(lambda: during.append(quiet()))
    runner.run([(0, tokens(5, 1), 0)])
    assert during == [False]  # just after a forward: not quiet yet
    time.sleep(0.25)
    assert quiet()
    del model, runner
    gc.collect()
    assert quiet()  # a stage gone is quiet (and was not kept alive by the check)
