"""The committed tiny family files (tests/data/families, see make_family_files.py) and their
transformers references, shared by the family tests."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

from bargein.config import CacheConfig, EngineConfig
from bargein.engine.engine import Engine
from bargein.model.attention import AttentionMetadata
from tests.model.family_specs import FAMILIES, FamilySpec

DATA = Path(__file__).resolve().parents[1] / "data" / "families"
NAMES = tuple(f.name for f in FAMILIES)
FORMATS = ("hf", "gguf")
# The converter writes no window for Mistral (its GGUF is arch "llama"), and llama.cpp runs
# such a file with global attention: so does bargein, and so must the reference.
WINDOW_DROPPED = {("mistral", "gguf")}


def spec(name: str) -> FamilySpec:
    return next(f for f in FAMILIES if f.name == name)


def model_path(name: str, fmt: str) -> str:
    return str(DATA / name / ("hf" if fmt == "hf" else "model.gguf"))


@functools.cache
def reference(name: str, fmt: str = "hf") -> torch.nn.Module:
    """transformers' own model from the committed folder, as the file of ``fmt`` describes it."""
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.from_pretrained(DATA / name / "hf")
        if (name, fmt) in WINDOW_DROPPED:
            config.sliding_window = None
        model = transformers.AutoModelForCausalLM.from_pretrained(DATA / name / "hf", config=config,
                                                                  dtype=torch.float32)
    return model.eval()


def engine(name: str, fmt: str, precision: str, *, max_model_len: int = 64, block_size: int = 4,
           num_blocks: int = 96) -> Engine:
    config = EngineConfig(cache=CacheConfig(block_size=block_size, num_blocks=num_blocks), precision=precision, device="cpu",
                          max_model_len=max_model_len)
    return Engine.from_pretrained(model_path(name, fmt), config, progress=False)


def all_logits(eng: Engine, tokens: list[int]) -> torch.Tensor:
    """Logits (len(tokens), vocab) of every position of one prefill through the engine's model."""
    runner = eng.runner
    stage, caches = runner.stages[0], runner.kv_caches[0]
    bs = runner.block_size
    blocks = list(range(-(-len(tokens) // bs)))
    meta = AttentionMetadata.build(block_tables=[blocks], query_lens=[len(tokens)], context_lens=[len(tokens)],
                                   block_size=bs, decode_batch=stage.reads_decode_batch)
    ids = torch.tensor(tokens)
    return stage(ids, torch.arange(len(tokens)), meta, caches)


def reference_logits(name: str, fmt: str, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(name, fmt)(torch.tensor([tokens])).logits[0].float()


def reference_greedy(name: str, fmt: str, prompt: list[int], answer: list[int]) -> list[int]:
    """transformers' greedy choice after the prompt and each prefix of ``answer``, from one
    forward: equal to ``answer`` exactly when transformers' greedy generation is ``answer``
    (each step of its generation sees that same prefix), at a fraction of generate's cost."""
    logits = reference_logits(name, fmt, prompt + answer[:-1])
    return logits[len(prompt) - 1:].argmax(-1).tolist()
