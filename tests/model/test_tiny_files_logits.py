"""Tiny models written to GGUF (several tensor types) and to safetensors, loaded by the
engine end to end, give the logits of a plain dense reference forward and of each other."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bargein.config import CacheConfig, EngineConfig
from bargein.engine.engine import Engine
from bargein.engine.sampling import SamplingParams
from tests.dense_reference import dense_logits
from tests.tiny_models import (
    TinySpec,
    quantized_reference,
    tiny_config,
    tiny_weights,
    write_gguf,
    write_hf_folder,
)

SPEC = TinySpec()
TOKENS = [5, 17, 42, 99, 3, 250, 7, 61, 8, 120, 33]
CONFIG = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32), precision="exact")


def _logits(engine: Engine, tokens: list[int]) -> torch.Tensor:
    from bargein.engine.blocks import BlockTable
    from bargein.engine.plan import ScheduledChunk, StepPlan

    table = BlockTable()
    engine.pool.ensure_writable(table, 0, len(tokens))
    plan = StepPlan(0, (ScheduledChunk("x", tuple(tokens), 0, tuple(table.block_ids), True),))
    out = engine.runner.execute(plan)[0].clone()  # execute may hand out reused memory
    engine.pool.release(table)
    return out


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return tiny_weights(SPEC)


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_logits_equal_the_dense_reference(tmp_path: Path, weights, tensor_type: str) -> None:
    path = write_gguf(tmp_path / f"tiny-{tensor_type}.gguf", SPEC, weights, tensor_type=tensor_type)
    engine = Engine.from_pretrained(str(path), CONFIG, progress=False)
    expected = dense_logits(tiny_config(SPEC), quantized_reference(weights, tensor_type), TOKENS)
    got = torch.stack([_logits(engine, TOKENS[:n]) for n in range(1, len(TOKENS) + 1)])
    torch.testing.assert_close(got.double(), expected[torch.arange(len(TOKENS))], atol=2e-4, rtol=1e-4)
    engine.check_block_accounting()


def test_safetensors_and_gguf_give_the_same_logits_and_answers(tmp_path: Path, weights) -> None:
    from_gguf = Engine.from_pretrained(str(write_gguf(tmp_path / "tiny.gguf", SPEC, weights)), CONFIG,
                                       progress=False)
    from_hf = Engine.from_pretrained(str(write_hf_folder(tmp_path / "tiny-hf", SPEC, weights)), CONFIG,
                                     progress=False)
    torch.testing.assert_close(_logits(from_gguf, TOKENS), _logits(from_hf, TOKENS), atol=1e-5, rtol=1e-5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert from_gguf.generate([TOKENS], params)[0].token_ids == from_hf.generate([TOKENS], params)[0].token_ids
