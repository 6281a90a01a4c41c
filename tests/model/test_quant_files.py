"""Tiny models whose matrices are the block types people download (K-quants, Q4_0, Q5_x,
Q8_0, IQ4, a Q4_K_M-like mix), written by the test: loaded by memory map as QuantWeights,
greedy output in ``exact`` token for token transformers' on the gguf.quants-dequantized
weights, ``fast`` batch-invariant, continuation after a cancel exact."""

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
from bargein.kernels.ggml_types import GGMLQuantizationType
from bargein.kernels.quant_weight import QUANT_TYPES
from bargein.loader import load_config, load_weights, resolve_model_ref
from bargein.loader.gguf_file import open_gguf
from bargein.model.linear import Linear
from tests.model.quant_models import (
    MIXES,
    SPEC,
    assert_matrices_view_the_file,
    transformers_greedy,
    write_quant_gguf,
)
from tests.tiny_engine import collector, step_until_delivered
from tests.tiny_models import TinySpec

TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K", "Q4_K_M"]
PROMPT = [5, 17, 42, 99, 3, 250, 7, 61, 8, 120, 33]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def config(precision: str, weights_memory: str = "private") -> EngineConfig:
    return EngineConfig(device="cpu", precision=precision, cache=CacheConfig(block_size=4, num_blocks=64),
                        cuda_graphs=False, weights_memory=weights_memory)


def kernels_read(mix: str) -> bool:
    names = {"Q4_K", "Q6_K"} if mix in MIXES else {mix}
    return all(GGMLQuantizationType[n] in QUANT_TYPES for n in names)


def typed(mix: str):
    """The parameter, skipped where the kernels have no dequantizer for the type yet."""
    return pytest.param(mix, marks=pytest.mark.skipif(not kernels_read(mix),
                                                      reason=f"{mix}: no kernels (or reference) for it yet"))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    folder = tmp_path_factory.mktemp("quant")
    return {mix: write_quant_gguf(folder / f"tiny.{mix}.gguf", mix=mix) for mix in TYPES}


@pytest.mark.parametrize("mix", [typed(m) for m in TYPES])
def test_exact_greedy_equals_transformers_on_the_dequantized_weights(files, mix: str) -> None:
    path, reference = files[mix]
    engine = Engine.from_pretrained(str(path), config("exact"), progress=False)
    linears = [m for m in engine.runner.stages[0].modules() if isinstance(m, Linear)]
    assert linears and not any(m.holds_dense for m in linears)  # blocks only: no float32 copy
    (out,) = engine.generate([PROMPT], GREEDY)
    assert list(out.token_ids) == transformers_greedy(SPEC, reference, PROMPT, GREEDY.max_tokens)


@pytest.mark.parametrize("mix", [typed("Q4_K_M"), typed("Q4_0"), typed("IQ4_XS"), typed("Q5_1")])
def test_fast_answers_a_sequence_alike_alone_and_batched(files, mix: str) -> None:
    engine = Engine.from_pretrained(str(files[mix][0]), config("fast"), progress=False)
    others = [[9, 8, 7, 6, 5, 4, 3, 2, 1] * 3, [200, 201]]
    (alone,) = engine.generate([PROMPT], GREEDY)
    _, batched, _ = engine.generate([others[0], PROMPT, others[1]], GREEDY)
    assert list(batched.token_ids) == list(alone.token_ids)
    exact = Engine.from_pretrained(str(files[mix][0]), config("exact"), progress=False)
    (want,) = exact.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert list(alone.token_ids)[:1] == list(want.token_ids)[:1]  # fast is close to exact


@pytest.mark.parametrize("mix", [typed("Q4_K_M"), typed("IQ4_NL")])
def test_weights_are_views_of_the_mapped_file(files, mix: str) -> None:
    path = files[mix][0]
    assert_matrices_view_the_file(path)
    mapped = open_gguf(path).mapped()
    start, end = mapped.ctypes.data, mapped.ctypes.data + mapped.nbytes
    engine = Engine.from_pretrained(str(path), config("exact", "mapped"), progress=False)
    model = engine.runner.stages[0]
    held = [s.data.data_ptr() for m in model.modules() if isinstance(m, Linear) for s in m.quant.segments]
    assert held and all(start <= p < end for p in held)  # the model holds the views, not copies


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_continuing_after_a_cancel_equals_no_cancel(files, precision: str) -> None:
    """C4 with QuantWeights: the cancelled conversation continued answers as fresh tokens do."""
    path = str(files["Q4_K_M"][0])
    engine = Engine.from_pretrained(path, config(precision), progress=False)
    conversation = engine.open_conversation()
    rid = collector(engine).add_request(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                        conversation_id=conversation)
    delivered = step_until_delivered(engine, 3)
    engine.abort(rid)
    collector(engine).step()
    follow_up = [11, 12, 13, 14]
    rid2 = collector(engine).add_request(follow_up, GREEDY, conversation_id=conversation)
    continued: list[int] = []
    while True:
        outs = [o for o in collector(engine).step() if o.request_id == rid2]
        if outs and outs[-1].finished:
            continued = list(outs[-1].token_ids)
            break
    (fresh,) = Engine.from_pretrained(path, config(precision), progress=False).generate(
        [PROMPT + delivered + follow_up], GREEDY)
    assert continued == list(fresh.token_ids)
    if precision == "exact":
        assert continued == transformers_greedy(SPEC, files["Q4_K_M"][1], PROMPT + delivered + follow_up,
                                                GREEDY.max_tokens)
    engine.close_conversation(conversation)
    engine.check_block_accounting()


_RSS_SCRIPT = """
import json, sys
from bargein import Engine, EngineConfig, CacheConfig, SamplingParams
from bargein.loader.resident import resident_memory
import torch
before = resident_memory()
engine = Engine.from_pretrained(sys.argv[1], EngineConfig(device="cpu", precision="exact",
                                cache=CacheConfig(block_size=4, num_blocks=16), weights_memory="mapped"),
                                progress=False)
loaded = resident_memory()
engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1))
ran = resident_memory()
print(json.dumps({"loaded_anon": loaded.anon - before.anon, "ran_file": ran.file - before.file}))
"""


@pytest.mark.skipif(not kernels_read("Q4_K"), reason="no Q4_K kernels yet")
def test_mapped_weights_are_file_backed_pages_not_private_ones(tmp_path: Path) -> None:
    spec = TinySpec(hidden_size=1024, intermediate_size=2048, num_heads=8, num_kv_heads=4, num_layers=3,
                    tie_word_embeddings=False)
    path, _ = write_quant_gguf(tmp_path / "mid.Q4_K.gguf", spec, mix="Q4_K")
    size = path.stat().st_size
    result = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(path)], capture_output=True, text=True,
                            timeout=300, check=True)
    m = json.loads(result.stdout.strip().splitlines()[-1])
    # Loading reads nothing into private memory (the tokenizer and the model's small
    # tensors aside); a forward touches every weight page, which the file backs.
    assert m["loaded_anon"] < 0.25 * size, m
    assert m["ran_file"] > 0.8 * size, m


def test_a_type_without_kernels_is_refused_by_name(tmp_path: Path) -> None:
    """A type no kernel reads (TQ2_0 here; IQ2/IQ3, MXFP4 alike) is refused with its name,
    never widened or read silently."""
    import numpy as np

    from bargein.loader import UnsupportedModelError
    from tests.model.quant_models import Q
    from tests.tiny_models import tiny_weights, write_gguf

    weights = tiny_weights(SPEC)
    raw = np.random.default_rng(0).integers(0, 256, (SPEC.hidden_size, SPEC.hidden_size // 256 * 66), dtype=np.uint8)
    path = write_gguf(tmp_path / "tiny.TQ2_0.gguf", SPEC, weights, tensor_type="Q8_0", skip=["blk.0.attn_output.weight"],
                      extra_tensors={"blk.0.attn_output.weight": (raw, Q.TQ2_0)})
    with pytest.raises(UnsupportedModelError, match="TQ2_0"):
        Engine.from_pretrained(str(path), config("exact"), progress=False)


def test_without_native_kernels_the_blocks_are_widened_with_one_log_line(files, caplog) -> None:
    import logging

    from bargein.engine.device import build_model

    path, reference = files["Q4_K_M"]
    source = resolve_model_ref(path)
    cfg = load_config(source)
    weights = load_weights(source, cfg, progress=False, blocks=True)
    with caplog.at_level(logging.WARNING, logger="bargein.engine.device"):
        model = build_model(cfg, weights, EngineConfig(device="cpu", native_kernels=False))
    lines = [r.getMessage() for r in caplog.records if r.name == "bargein.engine.device"]
    assert len(lines) == 1 and "widening" in lines[0] and "MiB" in lines[0] and "native kernels" in lines[0]
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.quant is None and m.holds_dense for m in linears)  # float32 (plain or packed)
    assert torch.equal(model.embed.weight, reference["embed.weight"])  # gguf.quants' values
