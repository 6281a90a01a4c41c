"""Older MoE GGUFs with one tensor per expert (issue 26): ``blk.N.ffn_gate.E.weight``,
``ffn_up.E``, ``ffn_down.E``, as Mixtral files converted before llama.cpp stacked the
experts (its LLM_TENSOR_FFN_*_EXP names).

The committed tiny Mixtral GGUF (made by llama.cpp's converter, stacked) is rewritten here
with the gguf package's writer, its experts split into one tensor each, in float32 and
with the experts in Q8_0 (beside a stacked Q8_0 copy, the same blocks). Each expert's
tensor is read as any matrix: with blocks, a QuantWeight over its bytes in the mapped file
(no copy, no stacking: the expert kernels take one pointer per expert). Answers must equal
the stacked file's token for token, in ``exact`` and in ``fast``, and transformers' for the
float32 file; the memory plan, the pipeline's matrix widths and the weights a pipeline
ships are those of the stacked file.
"""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from bargein.config import CacheConfig, EngineConfig
from bargein.distributed.weights import materialize, read_stored
from bargein.distributed.widths import stage_widths
from bargein.engine.engine import Engine
from bargein.engine.sampling import SamplingParams
from bargein.kernels.native import load_native_kernels
from bargein.kernels.quant_weight import QuantWeight
from bargein.loader import load_config, load_weights, resolve_model_ref
from bargein.loader.gguf_file import open_gguf
from bargein.loader.memory_plan import plan_memory
from tests.model.moe_files import model_path, reference_greedy

Q8 = gguf.GGMLQuantizationType.Q8_0
EXPERTS = 4
PROMPT = [5, 71, 13, 200, 8, 99, 42, 7, 300, 17, 64]


def rewrite(src: str, dst: Path, *, per_expert: bool, q8: bool) -> Path:
    """``src`` with its stacked experts split into one tensor per expert and/or in Q8_0."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        writer.add_key_value(key, field.contents(), kind,
                             sub_type=field.types[1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if "_exps." not in t.name:
            writer.add_tensor(t.name, data)
            continue
        parts = [(t.name.replace("_exps.", f".{e}."), data[e]) for e in range(EXPERTS)] if per_expert \
            else [(t.name, data)]
        for name, values in parts:
            if q8:
                writer.add_tensor(name, gguf.quants.quantize(values, Q8), raw_dtype=Q8)
            else:
                writer.add_tensor(name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("per-expert")
    src = model_path("mixtral", "gguf")
    return {"f32": rewrite(src, folder / "per-expert-f32.gguf", per_expert=True, q8=False),
            "q8": rewrite(src, folder / "per-expert-q8.gguf", per_expert=True, q8=True),
            "stacked-q8": rewrite(src, folder / "stacked-q8.gguf", per_expert=False, q8=True)}


@functools.cache
def _engine(path: Path, precision: str) -> Engine:
    config = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32), precision=precision, device="cpu",
                          max_model_len=64)
    return Engine.from_pretrained(str(path), config, progress=False)


def _greedy(path: Path, precision: str, n: int = 16) -> list[int]:
    (out,) = _engine(path, precision).generate([PROMPT], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return list(out.token_ids)


def test_the_file_has_one_tensor_per_expert(files: dict[str, Path]) -> None:
    names = set(open_gguf(files["q8"]).tensors)
    assert {f"blk.1.ffn_{w}.{e}.weight" for w in ("gate", "up", "down") for e in range(EXPERTS)} <= names
    assert not any("_exps" in n for n in names)


def test_each_expert_is_read_in_place_from_its_own_tensor(files: dict[str, Path]) -> None:
    source = resolve_model_ref(str(files["q8"]))
    config = load_config(source)
    assert config.family == "mixtral" and config.moe is not None and config.moe.num_experts == EXPERTS
    weights = load_weights(source, config, progress=False, blocks=True)
    stacked = load_weights(resolve_model_ref(str(files["stacked-q8"])), config, progress=False, blocks=True)
    f = open_gguf(files["q8"])
    start = f.mapped().ctypes.data
    for e in range(EXPERTS):
        for w, part in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
            held = weights[f"layers.1.experts.{e}.{w}.weight"]
            assert isinstance(held, QuantWeight) and len(held.segments) == 1
            info = f.tensors[f"blk.1.ffn_{part}.{e}.weight"]
            assert held.segments[0].data.data_ptr() == start + info.data_offset  # its bytes in the map: no copy
            assert torch.equal(held.dequantize(), stacked[f"layers.1.experts.{e}.{w}.weight"].dequantize())


def test_float32_experts_equal_transformers_in_exact(files: dict[str, Path]) -> None:
    answer = _greedy(files["f32"], "exact")
    assert answer == reference_greedy("mixtral", PROMPT, answer)


@pytest.mark.parametrize("precision", ["exact",
                                       pytest.param("fast", marks=pytest.mark.skipif(
                                           load_native_kernels() is None, reason="fast needs the native kernels"))])
def test_q8_experts_answer_as_the_stacked_file(files: dict[str, Path], precision: str) -> None:
    assert _greedy(files["q8"], precision) == _greedy(files["stacked-q8"], precision)


def test_memory_plan_widths_and_shipped_weights_match_the_stacked_file(files: dict[str, Path]) -> None:
    ours, stacked = resolve_model_ref(str(files["q8"])), resolve_model_ref(str(files["stacked-q8"]))
    config, engine = load_config(ours), EngineConfig(precision="fast", device="cpu", weights_memory="mapped")
    plan, plan_stacked = plan_memory(ours, config, engine), plan_memory(stacked, config, engine)
    assert plan.mapped_weight_bytes == plan_stacked.mapped_weight_bytes == 2 * 3 * EXPERTS * 64 * 64 // 32 * 34
    widths = stage_widths(ours, config, engine)
    assert widths == stage_widths(stacked, config, engine) and widths.of("layers.1.experts.3.w2.weight") == 34 / 32
    shipped = materialize(read_stored(ours, config, (1, 2)), config, torch.float32, torch.device("cpu"), blocks=True)
    loaded = load_weights(stacked, config, layer_range=(1, 2), progress=False, blocks=True)
    assert set(shipped) == set(loaded)
    for name, w in loaded.items():
        got = shipped[name]
        if isinstance(w, QuantWeight):
            assert isinstance(got, QuantWeight) and torch.equal(got.dequantize(), w.dequantize()), name
        else:
            assert torch.equal(got, w), name
