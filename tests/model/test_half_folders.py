"""Safetensors folders under the float-source rule (bargein/kernels/half_rows.py): F16 and
BF16 matrices are held as 16-bit rows that are views of the mapped files (in both
precisions: never widened, never copied); an F32 folder in ``fast`` is narrowed to 16-bit
rows once, with one log line stating it and its memory; greedy output in ``exact`` equals
transformers' on the same values token for token, and ``fast`` answers a prompt alike
alone and batched."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from bargein.config import CacheConfig, EngineConfig
from bargein.engine.engine import Engine
from bargein.engine.sampling import SamplingParams
from bargein.kernels.native import load_native_kernels
from bargein.kernels.quant_weight import QuantWeight
from bargein.loader import load_config, load_weights, resolve_model_ref
from bargein.model.linear import Linear
from tests.model.quant_models import transformers_greedy
from tests.tiny_models import TinySpec, tiny_weights, write_hf_folder

SPEC = TinySpec(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, tie_word_embeddings=False)
DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
PROMPT = [5, 17, 42, 99, 3, 250, 7, 61, 8, 120, 33]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
needs_kernels = pytest.mark.skipif(load_native_kernels() is None, reason="no C compiler here")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """A folder per dtype (two shards), with the float32 values it holds (its reference)."""
    weights = tiny_weights(SPEC, seed=7)
    out = {}
    for name, dtype in DTYPES.items():
        folder = write_hf_folder(tmp_path_factory.mktemp(f"half-{name}"), SPEC, weights, dtype=dtype)
        out[name] = folder, {k: v.to(dtype).float() for k, v in weights.items()}
    return out


def _engine(folder: Path, precision: str) -> Engine:
    config = EngineConfig(device="cpu", precision=precision, cache=CacheConfig(block_size=4, num_blocks=64),
                          cuda_graphs=False)
    return Engine.from_pretrained(str(folder), config, progress=False)


def _linears(engine: Engine) -> list[Linear]:
    return [m for m in engine.runner.stages[0].modules() if isinstance(m, Linear)]


def _mapped_ranges(folder: Path) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of the folder's safetensors files."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith(str(folder)) and fields[5].endswith(".safetensors"):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_16_bit_matrices_are_views_of_the_mapped_files(folders, dtype: str) -> None:
    folder, _ = folders[dtype]
    source = resolve_model_ref(str(folder))
    weights = load_weights(source, load_config(source), progress=False, blocks=True)
    matrices = [w for w in weights.values() if isinstance(w, QuantWeight)]
    assert len(matrices) == 7 * SPEC.num_layers + 2  # every matrix, the embedding and the head
    assert all({t.name for t in w.qtypes} == {dtype} for w in matrices)
    ranges = _mapped_ranges(folder)
    assert ranges
    for w in matrices:
        for segment in w.segments:
            lo, hi = segment.data.data_ptr(), segment.data.data_ptr() + segment.data.nbytes
            assert any(start <= lo and hi <= end for start, end in ranges)  # in a file's map: no copy
    assert all(w.dtype == torch.float32 for w in weights.values() if isinstance(w, torch.Tensor))  # norms


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_exact_greedy_equals_transformers_from_the_16_bit_rows(folders, dtype: str) -> None:
    folder, reference = folders[dtype]
    engine = _engine(folder, "exact")
    if load_native_kernels() is not None:
        assert all({t.name for t in m.quant.qtypes} == {dtype} and not m.holds_dense for m in _linears(engine))
    (out,) = engine.generate([PROMPT], GREEDY)
    assert list(out.token_ids) == transformers_greedy(SPEC, reference, PROMPT, GREEDY.max_tokens)


@needs_kernels
@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_fast_holds_16_bit_rows_and_answers_alike_alone_and_batched(folders, dtype: str, caplog) -> None:
    folder, reference = folders[dtype]
    with caplog.at_level(logging.INFO, logger="bargein.engine.device"):
        engine = _engine(folder, "fast")
    want = "F16" if dtype == "F32" else dtype  # these float32 values fit float16: narrowed to F16
    assert all({t.name for t in m.quant.qtypes} == {want} and m.blocks is None and not m.holds_dense
               for m in _linears(engine))
    narrowed = [r.getMessage() for r in caplog.records if "16-bit rows" in r.getMessage()]
    if dtype == "F32":  # one line, with the memory: every matrix (7 a layer, embedding, head) as F16
        assert len(narrowed) == 1 and f"{7 * SPEC.num_layers + 2} as F16" in narrowed[0], narrowed
    else:
        assert not narrowed  # a 16-bit source is held as stored: nothing narrowed
    (alone,) = engine.generate([PROMPT], GREEDY)
    _, batched, _ = engine.generate([[9, 8, 7, 6, 5, 4, 3, 2, 1] * 3, PROMPT, [200, 201]], GREEDY)
    assert list(batched.token_ids) == list(alone.token_ids)
    assert list(alone.token_ids)[:4] == transformers_greedy(SPEC, reference, PROMPT, 4)


@pytest.mark.parametrize(("dtype", "precision"), [("BF16", "exact"), ("BF16", "fast"), ("F32", "fast"),
                                                  ("F32", "exact")])
def test_memory_plan_states_the_16_bit_rows(folders, dtype: str, precision: str) -> None:
    """The plan counts what the rule holds: 16-bit matrices mapped (2 bytes a value, file-backed),
    float32 ones narrowed to 2 private bytes in ``fast``, 4 in ``exact``; vectors 4."""
    from bargein.loader.memory_plan import plan_memory

    folder, reference = folders[dtype]
    source = resolve_model_ref(str(folder))
    config = EngineConfig(device="cpu", precision=precision, cache=CacheConfig(block_size=4, num_blocks=64),
                          weights_memory="mapped")
    plan = plan_memory(source, load_config(source), config, available=1 << 40)
    matrices = sum(w.numel() for w in reference.values() if w.dim() == 2)
    vectors = sum(w.numel() for w in reference.values() if w.dim() == 1)
    reads_rows = config.native_kernels  # what the plan assumes, compiler or not
    if dtype == "BF16" and reads_rows:
        assert (plan.mapped_weight_bytes, plan.private_weight_bytes) == (2 * matrices, 4 * vectors)
    elif precision == "fast" and reads_rows:
        assert (plan.mapped_weight_bytes, plan.private_weight_bytes) == (0, 2 * matrices + 4 * vectors)
    else:
        assert (plan.mapped_weight_bytes, plan.private_weight_bytes) == (0, 4 * (matrices + vectors))


def test_memory_plan_of_a_float32_gguf_narrows_its_matrices_in_fast(tmp_path) -> None:
    """A GGUF's F32 matrices: 2 private bytes a value in ``fast`` (16-bit rows), 4 in ``exact``."""
    from bargein.loader.memory_plan import plan_memory
    from tests.tiny_models import write_gguf

    weights = tiny_weights(SPEC, seed=7)
    path = write_gguf(tmp_path / "tiny.f32.gguf", SPEC, weights, tensor_type="F32")
    source = resolve_model_ref(str(path))
    matrices = sum(w.numel() for w in weights.values() if w.dim() == 2)
    vectors = sum(w.numel() for w in weights.values() if w.dim() == 1)
    for precision in ("fast", "exact"):
        config = EngineConfig(device="cpu", precision=precision, cache=CacheConfig(block_size=4, num_blocks=64),
                              weights_memory="mapped")
        plan = plan_memory(source, load_config(source), config, available=1 << 40)
        narrowed = precision == "fast"  # the plan assumes the native kernels (config.native_kernels)
        assert plan.private_weight_bytes == (2 if narrowed else 4) * matrices + 4 * vectors, precision
