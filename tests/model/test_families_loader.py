"""The loader's family cases that the committed files do not cover: Gemma 3 shipped as
``Gemma3ForConditionalGeneration`` (its text model is read), and scalings it refuses."""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bargein.loader import UnsupportedModelError, load_config, load_weights, resolve_model_ref
from tests.model.family_files import DATA


def test_gemma3_for_conditional_generation_loads_its_text_model(tmp_path: Path) -> None:
    import transformers

    text = DATA / "gemma3" / "hf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text_config = transformers.AutoConfig.from_pretrained(text)
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14)
        config = transformers.Gemma3Config(text_config=text_config.to_dict(), vision_config=vision.to_dict(),
                                           mm_tokens_per_image=4)
        model = transformers.Gemma3ForConditionalGeneration(config)
        source_model = transformers.AutoModelForCausalLM.from_pretrained(text)
    stripped = {k.removeprefix("model."): v for k, v in source_model.state_dict().items() if k.startswith("model.")}
    model.model.language_model.load_state_dict(stripped)
    model.save_pretrained(tmp_path / "mm")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(text / name, tmp_path / "mm" / name)

    mm_source, text_source = resolve_model_ref(tmp_path / "mm"), resolve_model_ref(text)
    mm_config, text_config_read = load_config(mm_source), load_config(text_source)
    assert replace(mm_config, name="x") == replace(text_config_read, name="x")
    got = load_weights(mm_source, mm_config, progress=False)
    want = load_weights(text_source, text_config_read, progress=False)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("kind", ["dynamic", "mrope"])
def test_an_unknown_rope_scaling_is_refused_by_name(tmp_path: Path, kind: str) -> None:
    folder = tmp_path / "qwen3"
    shutil.copytree(DATA / "qwen3" / "hf", folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": kind, "factor": 2.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=rf"RoPE scaling type '{kind}' is not supported \(supported: "
                                                    r"llama3, linear, yarn, longrope\)"):
        load_config(resolve_model_ref(folder))


def test_yarn_scaling_is_read_from_config_json(tmp_path: Path) -> None:
    folder = tmp_path / "qwen3"
    shutil.copytree(DATA / "qwen3" / "hf", folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                 "original_max_position_embeddings": 64}
    (folder / "config.json").write_text(json.dumps(config))
    scaling = load_config(resolve_model_ref(folder)).rope_scaling
    assert (scaling.kind, scaling.factor, scaling.original_max_position_embeddings) == ("yarn", 4.0, 64)


@pytest.mark.parametrize("params", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "linear", "factor": 8.0},
])
def test_scaled_frequencies_equal_transformers(tmp_path: Path, params: dict) -> None:
    """The RoPE frequencies and cos/sin factor that bargein derives from a config equal those
    transformers' own rope functions derive from it."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from bargein.model.rope import inverse_frequencies

    folder = tmp_path / "qwen3"
    shutil.copytree(DATA / "qwen3" / "hf", folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {**params, "rope_theta": 1e6}
    (folder / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = transformers.AutoConfig.from_pretrained(folder)
    want, want_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](reference, "cpu")
    got, got_factor = inverse_frequencies(load_config(resolve_model_ref(folder)))
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-6, atol=0)
    assert got_factor == pytest.approx(want_factor, rel=1e-7)


def test_ministral_interleaved_windows_equal_transformers(tmp_path: Path) -> None:
    """Ministral's config lists each layer's kind: local and global layers interleaved."""
    import transformers

    from bargein.config import EngineConfig
    from bargein.engine.device import build_model
    from bargein.model.attention import AttentionMetadata

    config = transformers.MinistralConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          sliding_window=8, max_position_embeddings=64,
                                          layer_types=["sliding_attention", "full_attention"] * 2)
    torch.manual_seed(0)
    model = transformers.MinistralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn_like(p) * (1.0 if "embed" in name else p.shape[1] ** -0.5))
    model.save_pretrained(tmp_path / "ministral")
    source = resolve_model_ref(tmp_path / "ministral")
    read = load_config(source)
    assert (read.family, read.sliding_window, read.local_layers) == ("mistral", 8, (0, 2))
    stage = build_model(read, load_weights(source, read, progress=False), EngineConfig(precision="exact", device="cpu"),
                        max_positions=64)
    tokens = list(range(3, 33))
    meta = AttentionMetadata.build(block_tables=[list(range(8))], query_lens=[30], context_lens=[30], block_size=4)
    got = stage(torch.tensor(tokens), torch.arange(30), meta, stage.make_kv_caches(8, 4))
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
