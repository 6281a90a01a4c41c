"""Tiny llama-family GGUF files whose matrices are any block type, written by the test.

Widths are multiples of 256, so every K-quant and IQ4_XS super-block fits. Types that
``gguf.quants`` can quantize (Q4_0, Q5_0, Q5_1, Q8_0, ...) are quantized from random
float weights; the others (the K-quants, IQ4_NL, IQ4_XS) are random but valid blocks:
random bytes with each block's float16 scale(s) set so that the values have the spread
of a real layer's (a float16 scale is the only field that could be NaN or infinite).
:func:`reference_weights` gives the values the file holds, dequantized by
``gguf.quants`` (the oracle), under canonical names in the Hugging Face Q/K layout.

    path, ref = write_quant_gguf(tmp_path / "m.gguf", SPEC, mix="Q4_K_M")
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from bargein.kernels.quant_weight import QuantWeight
from bargein.loader import load_config, load_weights, resolve_model_ref
from bargein.loader.gguf_file import open_gguf
from tests.tiny_models import TinySpec, gguf_name, llama_cpp_permute, tiny_weights, write_gguf

Q = gguf.GGMLQuantizationType
SPEC = TinySpec(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, tie_word_embeddings=False)

# Byte offsets of each block's float16 d (and dmin), for the types written as random blocks,
# and dmin's size against d so that a block's values average about zero.
_SCALE_FIELDS: dict[Q, tuple[tuple[int, ...], float]] = {
    Q.Q2_K: ((80, 82), 1.5), Q.Q3_K: ((108,), 0.0), Q.Q4_K: ((0, 2), 7.5), Q.Q5_K: ((0, 2), 15.5),
    Q.Q6_K: ((208,), 0.0), Q.IQ4_NL: ((0,), 0.0), Q.IQ4_XS: ((0,), 0.0),
}


def random_blocks(qtype: Q, rows: int, k: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks (rows, k) of ``qtype`` as uint8 (rows, bytes per row), whose
    values have about ``std`` spread; each block's scale varies by up to 1.5x."""
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * (k // values), nbytes), dtype=np.uint8)
    offsets, dmin_ratio = _SCALE_FIELDS[qtype]

    def set_scales(scale: np.ndarray) -> None:
        for i, off in enumerate(offsets):
            raw[:, off:off + 2] = (scale * (1.0 if i == 0 else dmin_ratio)).astype(np.float16)[:, None].view(np.uint8)

    set_scales(np.ones(raw.shape[0]))
    spread = float(gguf_dequantize(raw.reshape(rows, -1), qtype).std())
    set_scales(std / spread * rng.uniform(0.67, 1.0, raw.shape[0]))
    return raw.reshape(rows, -1)


def stored_matrix(qtype: Q, weight: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A matrix as a file of ``qtype`` stores it: quantized by gguf where it can, else random
    blocks of ``weight``'s spread."""
    if qtype in _SCALE_FIELDS:
        return random_blocks(qtype, weight.shape[0], weight.shape[1], float(weight.std()), rng)
    return gguf_quantize(weight, qtype)


def uniform(qtype: str) -> Callable[[str], Q]:
    return lambda name: Q[qtype]


def q4_k_m(name: str) -> Q:
    """llama.cpp's Q4_K_M, roughly: Q4_K, with Q6_K for attn_v, ffn_down and the head."""
    return Q.Q6_K if name.endswith((".wv.weight", ".w2.weight")) or name == "lm_head.weight" else Q.Q4_K


MIXES: dict[str, Callable[[str], Q]] = {"Q4_K_M": q4_k_m}


def write_quant_gguf(path: Path, spec: TinySpec = SPEC, *, mix: str, seed: int = 0
                     ) -> tuple[Path, dict[str, torch.Tensor]]:
    """A GGUF whose matrices are of ``mix`` (a type's name, or a key of :data:`MIXES`), norms
    F32; and the reference weights (see :func:`reference_weights`)."""
    type_of = MIXES[mix] if mix in MIXES else uniform(mix)
    rng = np.random.default_rng(seed)
    weights = tiny_weights(spec, seed)
    matrices = {name: w for name, w in weights.items() if w.dim() == 2}
    extra = {}
    for name, w in matrices.items():
        a = w.numpy().astype(np.float32)
        if spec.arch == "llama" and (".wq." in name or ".wk." in name):
            a = llama_cpp_permute(a, spec.num_heads if ".wq." in name else spec.num_kv_heads)
        qtype = type_of(name)
        extra[gguf_name(name)] = (stored_matrix(qtype, a, rng), qtype)
    write_gguf(path, spec, weights, skip=[gguf_name(n) for n in matrices], extra_tensors=extra)
    return path, reference_weights(spec, weights, extra)


def reference_weights(spec: TinySpec, weights: dict[str, torch.Tensor],
                      stored: dict[str, tuple[np.ndarray, Q]]) -> dict[str, torch.Tensor]:
    """Canonical float32 weights with the values the file holds (gguf.quants' dequantization),
    Q/K back in the Hugging Face layout."""
    out = {}
    for name, w in weights.items():
        if gguf_name(name) not in stored:
            out[name] = w
            continue
        raw, qtype = stored[gguf_name(name)]
        a = gguf_dequantize(raw, qtype).reshape(w.shape)
        if spec.arch == "llama" and (".wq." in name or ".wk." in name):
            heads = spec.num_heads if ".wq." in name else spec.num_kv_heads
            a = a.reshape(heads, a.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        out[name] = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    return out


def transformers_greedy(spec: TinySpec, weights: dict[str, torch.Tensor], prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of transformers' LlamaForCausalLM (float32, eager) over ``weights``,
    each the argmax of a forward over the whole sequence so far."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny_models import hf_name

    config = LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                         intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                         num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                         head_dim=spec.head_dim, rms_norm_eps=spec.rms_norm_eps, rope_theta=spec.rope_theta,
                         max_position_embeddings=spec.max_position_embeddings,
                         tie_word_embeddings=spec.tie_word_embeddings, attn_implementation="eager")
    model = LlamaForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict({hf_name(k): v for k, v in weights.items()}, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    tokens = list(prompt)
    with torch.no_grad():  # the whole sequence each step (not generate(), whose defaults may steer picks)
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def assert_matrices_view_the_file(path: Path, spec: TinySpec = SPEC) -> None:
    """Every matrix of ``path`` (the layers', the embedding and the head) loads as views of
    the file's one mapping, never a copy."""
    source = resolve_model_ref(path)
    weights = load_weights(source, load_config(source), progress=False, blocks=True)
    mapped = open_gguf(path).mapped()
    start, end = mapped.ctypes.data, mapped.ctypes.data + mapped.nbytes
    matrices = [w for w in weights.values() if isinstance(w, QuantWeight)]
    assert len(matrices) == 7 * spec.num_layers + 2  # every matrix, the embedding and the head
    for w in matrices:
        for segment in w.segments:
            assert start <= segment.data.data_ptr() and segment.data.data_ptr() + segment.data.nbytes <= end
