"""The loader against transformers' own GGUF/safetensors loading, and the bundled model.

transformers un-permutes GGUF Q/K itself, so agreeing with it on a tiny written model
checks the layout convention independently of our own permutation code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bargein.loader import load_config, load_weights, resolve_model_ref
from tests.tiny_models import TinySpec, hf_name, tiny_weights, write_gguf, write_hf_folder


def _transformers_state(path: Path, gguf_file: str | None = None) -> dict[str, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, **kwargs
    )
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_tiny_model_matches_transformers(tmp_path: Path, fmt: str) -> None:
    spec = TinySpec(num_layers=2, tie_word_embeddings=False)
    weights = tiny_weights(spec, seed=7)
    if fmt == "gguf":
        path = write_gguf(tmp_path / "tiny.gguf", spec, weights)
        reference = _transformers_state(tmp_path, "tiny.gguf")
    else:
        path = write_hf_folder(tmp_path / "tiny", spec, weights)
        reference = _transformers_state(path)
    source = resolve_model_ref(path)
    ours = load_weights(source, load_config(source), progress=False)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[hf_name(name)], rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_bundled_model_config_and_weights() -> None:
    source = resolve_model_ref(None)
    config = load_config(source)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (49152, 576, 1536)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        30,
        9,
        3,
        64,
    )
    assert config.rope_theta == 100000.0 and config.max_position_embeddings == 8192
    assert config.tie_word_embeddings and not config.attention_bias
    assert config.name == "SmolLM2-135M-Instruct"
    last = load_weights(source, config, layer_range=(28, 30), progress=False)
    assert set(last) == {"embed.weight", "norm.weight"} | {
        f"layers.{i}.{n}"
        for i in (28, 29)
        for n in (
            "attn_norm.weight",
            "wq.weight",
            "wk.weight",
            "wv.weight",
            "wo.weight",
            "ffn_norm.weight",
            "w1.weight",
            "w2.weight",
            "w3.weight",
        )
    }
    assert last["layers.29.wk.weight"].shape == (192, 576)
    assert all(torch.isfinite(t).all() for t in last.values())
