"""Tiny random-weight Llama-family models, written to disk the way real ones are.

Tests across the project use these instead of downloaded weights::

    spec = TinySpec()                       # hidden 64, 2 layers, 4 heads, 2 KV heads
    weights = tiny_weights(spec)            # canonical names, HF rotate_half Q/K layout
    gguf_path = write_gguf(tmp_path / "tiny.gguf", spec, weights, tensor_type="Q8_0")
    hf_dir = write_hf_folder(tmp_path / "tiny-hf", spec, weights)   # sharded safetensors

The GGUF gets llama.cpp's Q/K permutation (arch ``llama``), a byte-level BPE tokenizer
with ChatML control tokens and a chat template; the HF folder gets config.json,
safetensors shards with an index, tokenizer.json and tokenizer_config.json, so that
transformers can load both (the reference in slow tests).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from bargein.config import ModelConfig

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "Hello world! hello there, how are you today?",
    "Il était une fois une petite fille. 日本語のテキスト 😀🎉",
    "def main():\n    return 42\n\n",
]


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny model. Row sizes are multiples of 32, so every block type fits."""

    arch: str = "llama"  # "llama" or "qwen2" (q/k/v biases, no Q/K permutation)
    num_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 256

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def attention_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def vocab_size(self) -> int:
        return tiny_tokenizer().get_vocab_size(with_added_tokens=True)


@functools.cache
def tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE with ~300 tokens; ids 0-2 are the ChatML special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok


def tiny_config(spec: TinySpec = TinySpec(), name: str = "tiny") -> ModelConfig:
    """The ModelConfig the loader must read back from either written format."""
    return ModelConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        attention_bias=spec.attention_bias,
        name=name,
    )


def tiny_weights(spec: TinySpec = TinySpec(), seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under canonical names (HF rotate_half layout for Q/K)."""
    g = torch.Generator().manual_seed(seed)
    h, f = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim

    def linear(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) / inp**0.5

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=g)

    w = {"embed.weight": torch.randn(spec.vocab_size, h, generator=g)}
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        w[p + "attn_norm.weight"] = norm()
        w[p + "wq.weight"], w[p + "wk.weight"], w[p + "wv.weight"] = (
            linear(q, h),
            linear(kv, h),
            linear(kv, h),
        )
        if spec.attention_bias:
            for name, n in (("wq", q), ("wk", kv), ("wv", kv)):
                w[p + f"{name}.bias"] = 0.1 * torch.randn(n, generator=g)
        w[p + "wo.weight"] = linear(h, q)
        w[p + "ffn_norm.weight"] = norm()
        w[p + "w1.weight"], w[p + "w3.weight"] = linear(f, h), linear(f, h)
        w[p + "w2.weight"] = linear(h, f)
    w["norm.weight"] = norm()
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = linear(spec.vocab_size, h)
    return w


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "wq.weight": "attn_q.weight",
    "wk.weight": "attn_k.weight",
    "wv.weight": "attn_v.weight",
    "wq.bias": "attn_q.bias",
    "wk.bias": "attn_k.bias",
    "wv.bias": "attn_v.bias",
    "wo.weight": "attn_output.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "w1.weight": "ffn_gate.weight",
    "w2.weight": "ffn_down.weight",
    "w3.weight": "ffn_up.weight",
}
_GGUF_GLOBAL = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(canonical: str) -> str:
    if canonical in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[canonical]
    _, i, suffix = canonical.split(".", 2)
    return f"blk.{i}.{_GGUF_NAMES[suffix]}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K of Llama models."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def quantized_reference(
    weights: Mapping[str, torch.Tensor], tensor_type: str
) -> dict[str, torch.Tensor]:
    """The values a GGUF of ``tensor_type`` holds for ``weights``: each quantized matrix
    round-tripped through gguf's numpy (de)quantizer; 1-D tensors stay float32."""
    qtype = gguf.GGMLQuantizationType[tensor_type]
    out = {}
    for name, t in weights.items():
        a = t.numpy()
        if a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            a = gguf_dequantize(gguf_quantize(a, qtype), qtype)
        out[name] = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    return out


def write_gguf(
    path: Path,
    spec: TinySpec,
    weights: Mapping[str, torch.Tensor],
    *,
    tensor_type: str = "F32",
    arch: str | None = None,
    skip: Iterable[str] = (),
    extra_tensors: Mapping[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
    chat_template: str | None = CHAT_TEMPLATE,
) -> Path:
    """Write ``weights`` as llama.cpp would: 2-D tensors in ``tensor_type``, norms and
    biases in F32, Q/K permuted for arch llama. ``skip`` leaves out GGUF tensor names;
    ``extra_tensors`` adds raw (bytes, type) tensors; ``arch`` overrides the arch key."""
    arch = arch or spec.arch
    qtype = gguf.GGMLQuantizationType[tensor_type]
    skip = set(skip)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(spec.num_layers)
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_vocab_size(spec.vocab_size)
    _add_gguf_tokenizer(writer, chat_template)
    for name, tensor in weights.items():
        gname = gguf_name(name)
        if gname in skip:
            continue
        a = tensor.numpy().astype(np.float32)
        if spec.arch == "llama" and (".wq." in name or ".wk." in name):
            a = llama_cpp_permute(a, spec.num_heads if ".wq." in name else spec.num_kv_heads)
        if a.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gname, a)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gname, a.astype(np.float16))
        else:
            writer.add_tensor(gname, gguf_quantize(a, qtype), raw_dtype=qtype)
    for gname, (raw, raw_type) in (extra_tensors or {}).items():
        writer.add_tensor(gname, raw, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_gguf_tokenizer(writer: gguf.GGUFWriter, chat_template: str | None) -> None:
    tok = tiny_tokenizer()
    model = json.loads(tok.to_str())["model"]
    by_id = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tok.token_to_id("<|im_start|>"))
    writer.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


# ---------------------------------------------------------------- Hugging Face folder

_HF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "wq.weight": "self_attn.q_proj.weight",
    "wk.weight": "self_attn.k_proj.weight",
    "wv.weight": "self_attn.v_proj.weight",
    "wq.bias": "self_attn.q_proj.bias",
    "wk.bias": "self_attn.k_proj.bias",
    "wv.bias": "self_attn.v_proj.bias",
    "wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "w1.weight": "mlp.gate_proj.weight",
    "w2.weight": "mlp.down_proj.weight",
    "w3.weight": "mlp.up_proj.weight",
}
_HF_GLOBAL = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def hf_name(canonical: str) -> str:
    if canonical in _HF_GLOBAL:
        return _HF_GLOBAL[canonical]
    _, i, suffix = canonical.split(".", 2)
    return f"model.layers.{i}.{_HF_NAMES[suffix]}"


def write_hf_folder(
    folder: Path,
    spec: TinySpec,
    weights: Mapping[str, torch.Tensor],
    *,
    num_shards: int = 2,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A Hugging Face model folder; ``num_shards`` > 1 writes an index json too."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {hf_name(n): t.to(dtype).contiguous() for n, t in weights.items()}
    names = list(tensors)
    per_shard = -(-len(names) // num_shards)
    weight_map = {}
    for s in range(num_shards):
        file = (
            "model.safetensors"
            if num_shards == 1
            else f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        )
        chunk = names[s * per_shard : (s + 1) * per_shard]
        save_file({n: tensors[n] for n in chunk}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
    if num_shards > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[spec.arch]
    config = {
        "architectures": [architecture],
        "model_type": spec.arch,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return folder
