"""Perplexity of an engine's model on a text, for comparing precision modes.

The text is cut into windows of ``window`` tokens, each scored from a fresh context (no
window sees another), which keeps the cost linear in the text's length. Every token of a
window but the first is predicted from the ones before it. An ``offset`` shifts the cuts
(the first window is then the first ``offset`` tokens): scoring the same text at several
offsets averages over contexts, which ``bench/bench_perplexity.py`` uses to shrink the
run-to-run spread that int8 rounding gives a short text.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bargein.config import CacheConfig, EngineConfig
from bargein.engine.blocks import BlockTable
from bargein.engine.device import build_model
from bargein.engine.engine import Engine
from bargein.loader import load_config, load_tokenizer, load_weights, resolve_model_ref
from bargein.model.attention import AttentionMetadata

TEXT = Path(__file__).with_name("data") / "public_domain.txt"


@dataclass(frozen=True)
class Scores:
    """Negative log-likelihoods and greedy predictions of every scored token, in order."""

    nll: torch.Tensor  # (N,) float64
    top1: torch.Tensor  # (N,) int64: the model's most likely token at each scored position

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll.mean().item())


def bundled_engines(precisions: tuple[str, ...], max_positions: int = 1024) -> list[Engine]:
    """Engines over the bundled model, one per precision, from a single read of the file."""
    source = resolve_model_ref(None)
    model_config = load_config(source)
    weights = load_weights(source, model_config, progress=False)
    tokenizer = load_tokenizer(source)
    engines = []
    for precision in precisions:
        config = EngineConfig(precision=precision, cache=CacheConfig(memory_bytes=32 * 1024**2))
        model = build_model(model_config, dict(weights), config, max_positions=max_positions)
        engines.append(Engine(model, tokenizer, config, model_name=source.name))
    return engines


def text_ids(engine: Engine, num_tokens: int) -> list[int]:
    ids = engine.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"{TEXT.name} has {len(ids)} tokens; {num_tokens} were asked for")
    return ids[:num_tokens]


def windows(num_tokens: int, window: int, offset: int = 0) -> list[tuple[int, int]]:
    """[start, stop) of each window over ``num_tokens`` tokens: cuts at ``offset`` (mod
    ``window``) and every ``window`` tokens after it; a window of fewer than 2 tokens
    scores nothing and is left out."""
    cuts = sorted({0, num_tokens, *range(offset % window, num_tokens, window)})
    return [(start, stop) for start, stop in itertools.pairwise(cuts) if stop - start >= 2]


def score(engine: Engine, ids: list[int], window: int = 512, offset: int = 0) -> Scores:
    """Scores of ``ids`` in :func:`windows` of ``window`` tokens, each a single prefill."""
    (stage,) = engine.runner.stages
    nll, top1 = [], []
    for start, stop in windows(len(ids), window, offset):
        chunk = ids[start:stop]
        table = BlockTable()
        engine.pool.ensure_writable(table, 0, len(chunk))
        try:
            meta = AttentionMetadata.build(block_tables=[list(table.block_ids)], query_lens=[len(chunk)],
                                           context_lens=[len(chunk)], block_size=engine.runner.block_size)
            logits = stage(torch.tensor(chunk), torch.arange(len(chunk)), meta, engine.runner.kv_caches[0],
                           logits_indices=torch.arange(len(chunk) - 1)).double()
        finally:
            engine.pool.release(table)
        nll.append(F.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="none"))
        top1.append(logits.argmax(-1))
    return Scores(torch.cat(nll), torch.cat(top1))
