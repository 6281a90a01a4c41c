"""Random-weight Qwen3 and Gemma 3 GGUFs of a 1B-class, 256-divisible shape, made the way a
user's files are made: a Hugging Face folder (config.json, safetensors, tokenizer.json)
converted by llama.cpp's own converter, then quantized by llama.cpp's ``llama-quantize``
(Q4_K_M by default), for ``bench/bench_models.py``'s side-by-side with llama.cpp.

    python bench/make_family_gguf.py --family qwen3 --out /tmp/families   # -> qwen3-1b.Q4_K_M.gguf
    python bench/make_family_gguf.py --family gemma3 --out /tmp/families
    python bench/bench_models.py /tmp/families/qwen3-1b.Q4_K_M.gguf /tmp/families/gemma3-1b.Q4_K_M.gguf

Weights are written tensor by tensor (no model object: a 1.7B model never sits in memory),
normal with std 1/sqrt(fan-in), so activations stay of unit size as in a trained model.
The tokenizer is a byte-level BPE of the family's vocabulary size, made of merges of byte
pairs (and triples), so the LM head has the real model's width. ``--small`` writes a tiny
shape of the same family to check the chain quickly.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.llama_convert import LLAMA_BIN, LLAMA_CPP, convert_to_gguf, quantize  # noqa: E402

# Qwen3-1.7B's shape; Gemma 3 1B's with hidden 1024 (its 1152 is not a multiple of 256).
SHAPES = {
    "qwen3": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "gemma3": dict(hidden_size=1024, intermediate_size=6144, num_hidden_layers=26, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=256, vocab_size=262144),
}
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=2048)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def hf_config(family: str, shape: dict) -> dict:
    common = dict(shape, max_position_embeddings=32768, rms_norm_eps=1e-6, torch_dtype="bfloat16",
                  bos_token_id=0, eos_token_id=2)
    if family == "qwen3":
        return dict(common, architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=True,
                    rope_theta=1000000.0, hidden_act="silu", attention_bias=False)
    layers = shape["num_hidden_layers"]
    return dict(common, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", tie_word_embeddings=True,
                rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=512,
                query_pre_attn_scalar=shape["head_dim"], hidden_activation="gelu_pytorch_tanh",
                layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)])


def tensor_shapes(family: str, s: dict) -> dict[str, tuple[int, ...]]:
    h, f, d = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
        if family == "gemma3":
            shapes.update({p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)})
    return shapes


def write_weights(folder: Path, family: str, shape: dict, seed: int = 0) -> None:
    """Safetensors shards of about 1 GB, one tensor generated at a time."""
    g = torch.Generator().manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    size, index, weight_map = 0, 0, {}

    def flush() -> None:
        nonlocal shard, size, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard, size, index = {}, 0, index + 1

    for name, dims in tensor_shapes(family, shape).items():
        if len(dims) == 1:  # Gemma's norms multiply by 1 + w: w near 0; the others near 1
            t = torch.randn(dims, generator=g) * 0.1 + (0.0 if family == "gemma3" else 1.0)
        else:
            t = torch.randn(dims, generator=g) * (1.0 if "embed" in name else dims[1] ** -0.5)
        shard[name] = t.to(torch.bfloat16)
        size += shard[name].numel() * 2
        if size > 1 << 30:
            flush()
    flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE of exactly ``vocab_size`` tokens (specials included)."""
    base = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens, merges = list(base), []
    pairs = [(a, b) for a in base for b in base]
    triples = ((a + b, c) for a, b in pairs for c in base)
    for left, right in [*pairs, *triples]:
        if len(tokens) >= vocab_size - len(SPECIALS):
            break
        tokens.append(left + right)
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": SPECIALS[2],
        "chat_template": "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                         "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                         "{% endif %}"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True, help="folder for the GGUF files")
    parser.add_argument("--quant", default="Q4_K_M", help="llama-quantize's type (default %(default)s)")
    parser.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP, help="llama.cpp's source tree (the converter)")
    parser.add_argument("--llama-bin", type=Path, default=LLAMA_BIN, help="llama.cpp's binaries (llama-quantize)")
    parser.add_argument("--small", action="store_true", help="a tiny shape, to check the chain")
    args = parser.parse_args()
    shape = dict(SHAPES[args.family] if not args.small else SMALL)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.family}-{'small' if args.small else '1b'}"
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        folder = Path(tmp)
        write_tokenizer(folder, shape["vocab_size"])
        (folder / "config.json").write_text(json.dumps(hf_config(args.family, shape), indent=1))
        write_weights(folder, args.family, shape)
        f16 = convert_to_gguf(folder, args.out / f"{stem}.F16.gguf", outtype="f16", llama_cpp=args.llama_cpp)
    out = quantize(f16, args.out / f"{stem}.{args.quant}.gguf", args.quant, llama_bin=args.llama_bin)
    f16.unlink()
    print(out)


if __name__ == "__main__":
    main()
