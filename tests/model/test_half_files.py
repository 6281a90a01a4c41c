"""Tiny models whose matrices are F16 or BF16, written by the test: held as 16-bit views
of the mapped file (no float32 copy, in either precision), greedy output in ``exact``
token for token transformers' on the same values, ``fast`` batch-invariant, and the
resident memory of a loaded and run model file-backed, not private."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bargein.config import CacheConfig, EngineConfig
from bargein.engine.engine import Engine
from bargein.engine.sampling import SamplingParams
from bargein.kernels.native import load_native_kernels
from bargein.model.linear import Linear
from tests.model.quant_models import (
    SPEC,
    assert_matrices_view_the_file,
    transformers_greedy,
    write_quant_gguf,
)
from tests.tiny_models import TinySpec

TYPES = ["F16", "BF16"]
PROMPT = [5, 17, 42, 99, 3, 250, 7, 61, 8, 120, 33]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
needs_kernels = pytest.mark.skipif(load_native_kernels() is None, reason="no C compiler here")


def config(precision: str) -> EngineConfig:
    return EngineConfig(device="cpu", precision=precision, cache=CacheConfig(block_size=4, num_blocks=64),
                        cuda_graphs=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    folder = tmp_path_factory.mktemp("half")
    return {t: write_quant_gguf(folder / f"tiny.{t}.gguf", mix=t) for t in TYPES}


@pytest.mark.parametrize("qtype", TYPES)
def test_exact_greedy_equals_transformers(files, qtype: str) -> None:
    path, reference = files[qtype]
    engine = Engine.from_pretrained(str(path), config("exact"), progress=False)
    linears = [m for m in engine.runner.stages[0].modules() if isinstance(m, Linear)]
    if load_native_kernels() is not None:
        assert linears and not any(m.holds_dense for m in linears)  # 16-bit rows only: no float32 copy
        assert all({t.name for t in m.quant.qtypes} == {qtype} for m in linears)
    (out,) = engine.generate([PROMPT], GREEDY)
    assert list(out.token_ids) == transformers_greedy(SPEC, reference, PROMPT, GREEDY.max_tokens)


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES)
def test_fast_reads_the_16_bit_rows_and_answers_alike_alone_and_batched(files, qtype: str) -> None:
    path, reference = files[qtype]
    engine = Engine.from_pretrained(str(path), config("fast"), progress=False)
    linears = [m for m in engine.runner.stages[0].modules() if isinstance(m, Linear)]
    assert linears and all(m.quant is not None and not m.holds_dense for m in linears)  # not requantized
    others = [[9, 8, 7, 6, 5, 4, 3, 2, 1] * 3, [200, 201]]
    (alone,) = engine.generate([PROMPT], GREEDY)
    _, batched, _ = engine.generate([others[0], PROMPT, others[1]], GREEDY)
    assert list(batched.token_ids) == list(alone.token_ids)
    # float32 matmuls, float16 K/V: the first tokens are the reference's
    assert list(alone.token_ids)[:4] == transformers_greedy(SPEC, reference, PROMPT, 4)


@pytest.mark.parametrize("qtype", TYPES)
def test_matrices_are_views_of_the_mapped_file(files, qtype: str) -> None:
    assert_matrices_view_the_file(files[qtype][0])


_RSS_SCRIPT = """
import json, sys
from bargein import Engine, EngineConfig, CacheConfig, SamplingParams
from bargein.loader.resident import resident_memory
import torch
before = resident_memory()
engine = Engine.from_pretrained(sys.argv[1], EngineConfig(device="cpu", precision=sys.argv[2],
                                cache=CacheConfig(block_size=4, num_blocks=16), weights_memory="mapped"),
                                progress=False)
loaded = resident_memory()
engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1))
ran = resident_memory()
print(json.dumps({"loaded_anon": loaded.anon - before.anon, "ran_anon": ran.anon - before.anon,
                  "ran_file": ran.file - before.file}))
"""


@needs_kernels
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_16_bit_weights_are_file_backed_pages_not_a_float32_copy(tmp_path_factory, precision: str) -> None:
    spec = TinySpec(hidden_size=1024, intermediate_size=2048, num_heads=8, num_kv_heads=4, num_layers=2,
                    tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("half-rss")
    path = folder / "mid.F16.gguf"
    if not path.exists():
        write_quant_gguf(path, spec, mix="F16")
    size = path.stat().st_size
    result = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(path), precision], capture_output=True,
                            text=True, timeout=300, check=True)
    m = json.loads(result.stdout.strip().splitlines()[-1])
    # A float32 copy would be twice the file in private memory; the model's small tensors,
    # the tokenizer and a forward's activations are a fraction of it.
    assert m["loaded_anon"] < 0.25 * size, m
    assert m["ran_anon"] < 0.5 * size, m
    assert m["ran_file"] > 0.8 * size, m  # every weight page, backed by the file
