"""Hugging Face folders: config.json, (sharded) safetensors, tokenizer files, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bargein.config import RopeScaling
from bargein.loader import (
    CorruptModelError,
    UnsupportedModelError,
    load_config,
    load_tokenizer,
    load_weights,
    resolve_model_ref,
)
from tests.tiny_models import (
    TinySpec,
    quantized_reference,
    tiny_config,
    tiny_tokenizer,
    tiny_weights,
    write_gguf,
    write_hf_folder,
)

SPEC = TinySpec(num_layers=3, tie_word_embeddings=False)
WEIGHTS = tiny_weights(SPEC, seed=3)


def load(folder: Path, **kwargs):
    source = resolve_model_ref(folder)
    config = load_config(source)
    return config, load_weights(source, config, progress=False, **kwargs)


@pytest.mark.parametrize("num_shards", [1, 3])
def test_folder_loads_exactly(tmp_path: Path, num_shards: int) -> None:
    folder = write_hf_folder(tmp_path / "Tiny-HF", SPEC, WEIGHTS, num_shards=num_shards)
    assert (folder / "model.safetensors.index.json").exists() == (num_shards > 1)
    source = resolve_model_ref(folder)
    assert source.kind == "hf" and source.name == "Tiny-HF"
    config, weights = load(folder)
    assert config == tiny_config(SPEC, name="Tiny-HF")
    assert weights.keys() == WEIGHTS.keys()
    for name, expected in WEIGHTS.items():
        assert torch.equal(weights[name], expected), name


def test_bf16_folder_and_layer_range(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "bf16", SPEC, WEIGHTS, dtype=torch.bfloat16)
    _, weights = load(folder, layer_range=(1, 3))
    assert {n for n in weights if not n.startswith("layers.")} == {"norm.weight", "lm_head.weight"}
    assert {int(n.split(".")[1]) for n in weights if n.startswith("layers.")} == {1, 2}
    assert torch.equal(
        weights["layers.2.wk.weight"], WEIGHTS["layers.2.wk.weight"].bfloat16().float()
    )


@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0", "Q4_1"])
def test_gguf_and_safetensors_versions_agree(tmp_path: Path, tensor_type: str) -> None:
    spec = TinySpec(num_layers=2, tie_word_embeddings=True)
    weights = tiny_weights(spec, seed=4)
    _, from_gguf = load(write_gguf(tmp_path / "m.gguf", spec, weights, tensor_type=tensor_type))
    _, from_hf = load(
        write_hf_folder(tmp_path / "m", spec, quantized_reference(weights, tensor_type))
    )
    assert from_gguf.keys() == from_hf.keys()
    for name in from_hf:
        assert torch.equal(from_gguf[name], from_hf[name]), name


def test_qwen2_folder(tmp_path: Path) -> None:
    spec = TinySpec(arch="qwen2")
    weights = tiny_weights(spec, seed=5)
    config, got = load(write_hf_folder(tmp_path / "qwen", spec, weights))
    assert config.attention_bias
    assert torch.equal(got["layers.1.wv.bias"], weights["layers.1.wv.bias"])


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_llama3_rope_scaling_and_head_dim(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "l3", SPEC, WEIGHTS)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config_json = json.loads((folder / "config.json").read_text())
    del config_json["head_dim"]
    (folder / "config.json").write_text(json.dumps({**config_json, "rope_scaling": scaling}))
    config = load_config(resolve_model_ref(folder))
    assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert config.head_dim == SPEC.hidden_size // SPEC.num_heads


def test_unsupported_rope_scaling(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "dynamic", SPEC, WEIGHTS)
    _edit_config(folder, rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match=r"config\.json.*'dynamic'"):
        load_config(resolve_model_ref(folder))


def test_unsupported_architecture(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "gpt2", SPEC, WEIGHTS)
    _edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match=r"config\.json.*GPT2LMHeadModel"):
        load_config(resolve_model_ref(folder))


def test_missing_tensor(tmp_path: Path) -> None:
    weights = {n: t for n, t in WEIGHTS.items() if n != "lm_head.weight"}
    folder = write_hf_folder(tmp_path / "nohead", SPEC, weights, num_shards=1)
    with pytest.raises(CorruptModelError, match=r"nohead.*'lm_head\.weight' is missing"):
        load(folder)


def test_missing_shard(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "shards", SPEC, WEIGHTS, num_shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CorruptModelError, match=r"model-00002-of-00002\.safetensors: safetensors file is missing"
    ):
        load(folder)


def test_corrupt_safetensors(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "bad", SPEC, WEIGHTS, num_shards=1)
    (folder / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(
        CorruptModelError, match=r"model\.safetensors: not a readable safetensors file"
    ):
        load(folder)


def test_tokenizer_and_template_from_folder(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "tok", SPEC, WEIGHTS)
    tok = load_tokenizer(resolve_model_ref(folder))
    text = "<|im_start|>user\nhi there 123<|im_end|>"
    assert tok.encode(text) == tiny_tokenizer().encode(text).ids
    assert tok.bos_token_id == tiny_tokenizer().token_to_id("<|im_start|>")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_generation_config_eos_ids_are_stop_tokens(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "gen", SPEC, WEIGHTS)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert {2, 7} <= load_tokenizer(resolve_model_ref(folder)).eos_token_ids


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_weights_go_to_the_device_one_by_one(tmp_path: Path, kind: str) -> None:
    """``device``/``dtype`` apply to every tensor as it is read (the meta device stands in
    for a GPU: nothing is computed, only placed)."""
    if kind == "hf":
        path = write_hf_folder(tmp_path / "tiny-hf", SPEC, WEIGHTS)
    else:
        path = write_gguf(tmp_path / "tiny.gguf", SPEC, WEIGHTS, tensor_type="F32")
    _, weights = load(path, dtype=torch.bfloat16, device="meta")
    assert weights.keys() == WEIGHTS.keys()
    assert all(w.device.type == "meta" and w.dtype == torch.bfloat16 for w in weights.values())
