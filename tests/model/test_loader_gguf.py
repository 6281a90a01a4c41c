"""GGUF loading of tiny written models: config, canonical weights per tensor type, Q/K
layout, layer ranges and the errors a bad file gives."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from bargein.loader import (
    CorruptModelError,
    UnsupportedModelError,
    load_config,
    load_tokenizer,
    load_weights,
    resolve_model_ref,
)
from bargein.loader.gguf_file import unpermute_qk
from tests.tiny_models import (
    TinySpec,
    llama_cpp_permute,
    quantized_reference,
    tiny_config,
    tiny_weights,
    write_gguf,
)

SPEC = TinySpec()
WEIGHTS = tiny_weights(SPEC)
# max |error| of one quantized value relative to the largest |value| in its block, loosely
QUANT_TOLERANCE = {
    "F16": 1e-3,
    "BF16": 1e-2,
    "Q8_0": 1e-2,
    "Q5_0": 0.07,
    "Q5_1": 0.07,
    "Q4_0": 0.15,
    "Q4_1": 0.15,
}


def load(path: Path, **kwargs):
    source = resolve_model_ref(path)
    config = load_config(source)
    return config, load_weights(source, config, progress=False, **kwargs)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def test_config_from_metadata(gguf_dir: Path) -> None:
    path = write_gguf(gguf_dir / "tiny.F32.gguf", SPEC, WEIGHTS)
    source = resolve_model_ref(path)
    assert source.kind == "gguf" and source.name == "tiny"
    config = load_config(source)
    assert config.rms_norm_eps == pytest.approx(SPEC.rms_norm_eps)
    assert dataclasses.replace(config, rms_norm_eps=SPEC.rms_norm_eps) == tiny_config(
        SPEC, name="tiny"
    )


def test_f32_loads_exactly(gguf_dir: Path) -> None:
    _, weights = load(write_gguf(gguf_dir / "exact.gguf", SPEC, WEIGHTS))
    assert weights.keys() == WEIGHTS.keys()
    for name, expected in WEIGHTS.items():
        assert torch.equal(weights[name], expected), name


@pytest.mark.parametrize("tensor_type", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_types_load_within_their_error(gguf_dir: Path, tensor_type: str) -> None:
    _, weights = load(
        write_gguf(gguf_dir / f"q.{tensor_type}.gguf", SPEC, WEIGHTS, tensor_type=tensor_type)
    )
    stored = quantized_reference(WEIGHTS, tensor_type)  # what the file holds, dequantized by gguf
    for name, original in WEIGHTS.items():
        assert torch.equal(weights[name], stored[name]), name
        scale = original.abs().max().item()
        assert (weights[name] - original).abs().max().item() <= QUANT_TOLERANCE[
            tensor_type
        ] * scale, name


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = torch.randn(12 * 8, 5)
    for heads in (1, 3, 12):
        permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), heads))
        assert torch.equal(unpermute_qk(permuted, heads), w)
    bias = torch.arange(16.0)
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(bias.numpy(), 2)), 2), bias)


def _rope_interleaved(x: torch.Tensor, pos: int, theta: float = 10000.0) -> torch.Tensor:
    """llama.cpp's (GGUF) RoPE: rotate adjacent pairs (x0, x1), (x2, x3), ..."""
    d = x.shape[-1]
    freqs = pos * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * freqs.cos() - b * freqs.sin()
    out[..., 1::2] = a * freqs.sin() + b * freqs.cos()
    return out


def _rope_rotate_half(x: torch.Tensor, pos: int, theta: float = 10000.0) -> torch.Tensor:
    """Hugging Face's RoPE: rotate (x_i, x_{i + d/2}) pairs."""
    d = x.shape[-1]
    freqs = pos * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([freqs.cos()] * 2), torch.cat([freqs.sin()] * 2)
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def test_loaded_q_k_give_the_attention_scores_of_the_gguf_layout(gguf_dir: Path) -> None:
    """Independent of how the permutation is written: RoPE'd q.k from the loaded (HF
    layout) weights equals interleaved-RoPE'd q.k from the raw GGUF (permuted) weights."""
    _, weights = load(
        gguf_dir / "exact.gguf"
        if (gguf_dir / "exact.gguf").exists()
        else write_gguf(gguf_dir / "exact.gguf", SPEC, WEIGHTS)
    )
    x = torch.randn(SPEC.hidden_size, dtype=torch.float64)
    hd, group = SPEC.head_dim, SPEC.num_heads // SPEC.num_kv_heads
    wq, wk = weights["layers.0.wq.weight"].double(), weights["layers.0.wk.weight"].double()
    gq = torch.from_numpy(llama_cpp_permute(wq.numpy(), SPEC.num_heads))
    gk = torch.from_numpy(llama_cpp_permute(wk.numpy(), SPEC.num_kv_heads))
    for h in range(SPEC.num_heads):
        kv = h // group
        hf = _rope_rotate_half((wq @ x)[h * hd : (h + 1) * hd], 5) @ _rope_rotate_half(
            (wk @ x)[kv * hd : (kv + 1) * hd], 2
        )
        gg = _rope_interleaved((gq @ x)[h * hd : (h + 1) * hd], 5) @ _rope_interleaved(
            (gk @ x)[kv * hd : (kv + 1) * hd], 2
        )
        assert hf.item() == pytest.approx(gg.item(), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize(
    ("tied", "layer_range", "expected_globals"),
    [
        (True, (0, 1), {"embed.weight"}),
        (
            True,
            (1, 3),
            {"embed.weight", "norm.weight"},
        ),  # last stage of a tied model needs the embedding
        (True, (1, 2), set()),
        (False, (0, 1), {"embed.weight"}),
        (False, (2, 3), {"norm.weight", "lm_head.weight"}),
        (False, None, {"embed.weight", "norm.weight", "lm_head.weight"}),
    ],
)
def test_layer_range_subsets(
    gguf_dir: Path, tied: bool, layer_range, expected_globals: set[str]
) -> None:
    spec = TinySpec(num_layers=3, tie_word_embeddings=tied)
    weights = tiny_weights(spec, seed=1)
    path = gguf_dir / f"range-{tied}.gguf"
    if not path.exists():
        write_gguf(path, spec, weights)
    _, got = load(path, layer_range=layer_range)
    start, end = layer_range or (0, 3)
    layers = {int(n.split(".")[1]) for n in got if n.startswith("layers.")}
    assert layers == set(range(start, end))
    assert {n for n in got if not n.startswith("layers.")} == expected_globals
    for name, tensor in got.items():
        assert torch.equal(tensor, weights[name]), name


def test_bad_layer_range_is_refused(gguf_dir: Path) -> None:
    path = write_gguf(gguf_dir / "lr.gguf", SPEC, WEIGHTS)
    with pytest.raises(ValueError, match="layer_range"):
        load(path, layer_range=(1, 1))
    with pytest.raises(ValueError, match="layer_range"):
        load(path, layer_range=(0, 3))


def test_dtype(gguf_dir: Path) -> None:
    _, weights = load(write_gguf(gguf_dir / "dt.gguf", SPEC, WEIGHTS), dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert torch.equal(weights["layers.1.w2.weight"], WEIGHTS["layers.1.w2.weight"].bfloat16())


def test_qwen2_has_biases_and_no_permutation(gguf_dir: Path) -> None:
    spec = TinySpec(arch="qwen2", tie_word_embeddings=False)
    weights = tiny_weights(spec, seed=2)
    config, got = load(write_gguf(gguf_dir / "qwen.gguf", spec, weights))
    assert config.attention_bias and not config.tie_word_embeddings
    assert got.keys() == weights.keys()
    for name, expected in weights.items():
        assert torch.equal(got[name], expected), name


def test_rope_freq_factors_are_passed_through(gguf_dir: Path) -> None:
    factors = np.linspace(1.0, 8.0, SPEC.head_dim // 2, dtype=np.float32)
    path = write_gguf(
        gguf_dir / "rf.gguf",
        SPEC,
        WEIGHTS,
        extra_tensors={"rope_freqs.weight": (factors, GGMLQuantizationType.F32)},
    )
    _, got = load(path, layer_range=(1, 2))
    assert torch.equal(got["rope_freq_factors"], torch.from_numpy(factors))


def test_progress_bar_on_stderr(gguf_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = resolve_model_ref(write_gguf(gguf_dir / "pb.gguf", SPEC, WEIGHTS))
    config = load_config(source)
    load_weights(source, config)
    assert "Loading pb" in capsys.readouterr().err
    load_weights(source, config, progress=False)
    assert capsys.readouterr().err == ""


def test_tokenizer_from_tiny_gguf_matches_its_source(gguf_dir: Path) -> None:
    from tests.tiny_models import tiny_tokenizer

    tok = load_tokenizer(resolve_model_ref(write_gguf(gguf_dir / "tok.gguf", SPEC, WEIGHTS)))
    reference = tiny_tokenizer()
    text = "Hello <|im_start|>user\nwörld 😀 日本  42<|im_end|>"
    assert tok.encode(text) == reference.encode(text).ids
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.eos_token_ids == {
        reference.token_to_id("<|im_end|>"),
        reference.token_to_id("<|endoftext|>"),
    }


# ---------------------------------------------------------------- errors


def test_unsupported_architecture(gguf_dir: Path) -> None:
    path = write_gguf(gguf_dir / "phi.gguf", SPEC, WEIGHTS, arch="phi2")
    with pytest.raises(UnsupportedModelError, match=r"phi\.gguf.*'phi2'"):
        load_config(resolve_model_ref(path))


def test_unsupported_tensor_type(gguf_dir: Path) -> None:
    raw = np.zeros((2, 2), dtype=np.int32)
    path = write_gguf(
        gguf_dir / "i32.gguf",
        SPEC,
        WEIGHTS,
        skip={"blk.0.ffn_norm.weight"},
        extra_tensors={"blk.0.ffn_norm.weight": (raw, GGMLQuantizationType.I32)},
    )
    with pytest.raises(UnsupportedModelError, match=r"i32\.gguf.*'blk\.0\.ffn_norm\.weight'.*I32"):
        load(path)


def test_missing_tensor(gguf_dir: Path) -> None:
    path = write_gguf(gguf_dir / "missing.gguf", SPEC, WEIGHTS, skip={"blk.1.attn_v.weight"})
    with pytest.raises(
        CorruptModelError, match=r"missing\.gguf.*'blk\.1\.attn_v\.weight' is missing"
    ):
        load(path)
    _, first = load(path, layer_range=(0, 1))  # a stage that does not need it still loads
    assert "layers.0.wv.weight" in first


def test_wrong_shape(gguf_dir: Path) -> None:
    bad = dict(WEIGHTS, **{"layers.0.w1.weight": torch.zeros(96, SPEC.hidden_size)})
    with pytest.raises(CorruptModelError, match=r"shape\.gguf.*layers\.0\.w1\.weight.*\(96, 64\)"):
        load(write_gguf(gguf_dir / "shape.gguf", SPEC, bad))


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.999])
def test_truncated_file(gguf_dir: Path, keep: float) -> None:
    whole = write_gguf(gguf_dir / "whole.gguf", SPEC, WEIGHTS).read_bytes()
    path = gguf_dir / f"truncated-{keep}.gguf"
    path.write_bytes(whole[: int(len(whole) * keep)])
    with pytest.raises(CorruptModelError, match=rf"truncated-{keep}\.gguf"):
        load(path)


def test_garbage_file(gguf_dir: Path) -> None:
    path = gguf_dir / "garbage.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(CorruptModelError, match=r"garbage\.gguf: not a readable GGUF file"):
        load_config(resolve_model_ref(path))
