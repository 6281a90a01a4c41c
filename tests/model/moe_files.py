"""The committed tiny MoE files (tests/data/moe, see make_moe_files.py) and their transformers
references, shared by the MoE tests."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

from bargein.config import CacheConfig, EngineConfig
from bargein.engine.engine import Engine
from bargein.model.attention import AttentionMetadata
from tests.model.moe_specs import MOE_FAMILIES

DATA = Path(__file__).resolve().parents[1] / "data" / "moe"
NAMES = tuple(f.name for f in MOE_FAMILIES)
FORMATS = ("hf", "gguf")


def model_path(name: str, fmt: str) -> str:
    return str(DATA / name / ("hf" if fmt == "hf" else "model.gguf"))


@functools.cache
def reference(name: str) -> torch.nn.Module:
    """transformers' own model from the committed folder (the GGUF holds the same weights)."""
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(DATA / name / "hf", dtype=torch.float32)
    return model.eval()


def reference_greedy(name: str, prompt: list[int], answer: list[int]) -> list[int]:
    """transformers' greedy choice after the prompt and each prefix of ``answer``, from one
    teacher-forced forward (equal to ``answer`` exactly when its greedy generation is)."""
    with torch.no_grad():
        logits = reference(name)(torch.tensor([prompt + answer[:-1]])).logits[0]
    return logits[len(prompt) - 1:].argmax(-1).tolist()


@functools.cache
def engine(name: str, fmt: str, precision: str) -> Engine:
    config = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=96), precision=precision, device="cpu",
                          max_model_len=64)
    return Engine.from_pretrained(model_path(name, fmt), config, progress=False)


def last_logits(eng: Engine, prompts: list[list[int]]) -> torch.Tensor:
    """The logits after each prompt (len(prompts), vocab), all prompts in one forward of the model."""
    runner = eng.runner
    stage, caches, bs = runner.stages[0], runner.kv_caches[0], runner.block_size
    tables, first = [], 0
    for p in prompts:
        n = -(-len(p) // bs)
        tables.append(list(range(first, first + n)))
        first += n
    lens = [len(p) for p in prompts]
    meta = AttentionMetadata.build(block_tables=tables, query_lens=lens, context_lens=lens, block_size=bs,
                                   decode_batch=stage.reads_decode_batch)
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    last = torch.tensor(lens).cumsum(0) - 1
    return stage(ids, positions, meta, caches, last)
