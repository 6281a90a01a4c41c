"""A random-weight Qwen3-MoE GGUF of a CPU-sized shape, and a dense Qwen3 (Llama-shaped) GGUF
whose weights read per token equal the MoE's active ones, for ``bench/bench_moe.py``.

Both are made the way a user's files are made (as ``bench/make_family_gguf.py`` makes its
files, whose tokenizer, converter call and quantization this reuses): a Hugging Face
folder written tensor by tensor, converted by llama.cpp's own converter, quantized by
``llama-quantize`` (Q4_K_M by default).

    python bench/make_moe_gguf.py --out /tmp/moe            # -> qwen3moe-2b.Q4_K_M.gguf, qwen3-dense-2b.Q4_K_M.gguf
    python bench/bench_moe.py /tmp/moe/qwen3moe-2b.Q4_K_M.gguf /tmp/moe/qwen3-dense-2b.Q4_K_M.gguf

The MoE: 16 layers, hidden 1024, 48 experts of 768, top 8 (renormalised, as Qwen3-MoE),
16 query / 4 KV heads of 128, vocabulary 32768, the head tied to the embedding (as the
dense file's): ~1.93 B parameters, ~0.42 B active per token. The dense file has the same
layers, attention and vocabulary with an MLP of
8 x 768 = 6144: per token it reads what the MoE reads (its MLP is the 8 chosen experts'
size), so the MoE's speed against it is the cost of routing and of grouping by expert.
The router is random (std 1/sqrt(hidden)): tokens spread over all experts, as in a
trained model. ``--small`` writes tiny shapes of both to check the chain quickly.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from make_family_gguf import hf_config, write_tokenizer  # noqa: E402
from make_family_gguf import write_weights as write_dense_weights  # noqa: E402

from tests.llama_convert import LLAMA_BIN, LLAMA_CPP, convert_to_gguf, quantize  # noqa: E402

MOE = dict(hidden_size=1024, moe_intermediate_size=768, num_experts=48, num_experts_per_tok=8,
           num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=32768)
SMALL_MOE = dict(hidden_size=256, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=2048)


def moe_config(s: dict) -> dict:
    return dict(s, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                intermediate_size=s["moe_intermediate_size"] * s["num_experts_per_tok"], norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=32768, rms_norm_eps=1e-6,
                rope_theta=1000000.0, hidden_act="silu", attention_bias=False, tie_word_embeddings=True,
                torch_dtype="bfloat16", bos_token_id=0, eos_token_id=2)


def dense_shape(s: dict) -> dict:
    """The Llama-shaped (Qwen3) model reading per token what the MoE reads."""
    return dict(hidden_size=s["hidden_size"], intermediate_size=s["moe_intermediate_size"] * s["num_experts_per_tok"],
                num_hidden_layers=s["num_hidden_layers"], num_attention_heads=s["num_attention_heads"],
                num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"], vocab_size=s["vocab_size"])


def moe_tensors(s: dict):
    """(name, shape) of every tensor, in file order."""
    h, f, d, e = s["hidden_size"], s["moe_intermediate_size"], s["head_dim"], s["num_experts"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (s["vocab_size"], h)
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield from ((p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                    (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                    (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                    (p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,)),
                    (p + "mlp.gate.weight", (e, h)))
        for x in range(e):
            yield from ((p + f"mlp.experts.{x}.gate_proj.weight", (f, h)), (p + f"mlp.experts.{x}.up_proj.weight", (f, h)),
                        (p + f"mlp.experts.{x}.down_proj.weight", (h, f)))
    yield "model.norm.weight", (h,)


def write_moe_weights(folder: Path, s: dict, seed: int = 0) -> None:
    """Safetensors shards of about 1 GB, one tensor generated at a time (bfloat16)."""
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

    for name, dims in moe_tensors(s):
        if len(dims) == 1:
            t = torch.randn(dims, generator=g) * 0.1 + 1.0
        else:
            t = torch.randn(dims, generator=g) * (1.0 if "embed" in name else dims[1] ** -0.5)
        shard[name] = t.to(torch.bfloat16)
        size += shard[name].numel() * 2
        if size > 1 << 30:
            flush()
    flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def convert(folder: Path, out: Path, quant: str, llama_cpp: Path, llama_bin: Path) -> Path:
    """``folder`` converted to float16 by llama.cpp's converter, then quantized to ``quant``."""
    f16 = convert_to_gguf(folder, out.with_suffix(".F16.gguf"), outtype="f16", llama_cpp=llama_cpp)
    final = quantize(f16, out.with_suffix(f".{quant}.gguf"), quant, llama_bin=llama_bin)
    f16.unlink()
    return final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the GGUF files")
    parser.add_argument("--quant", default="Q4_K_M", help="llama-quantize's type (default %(default)s)")
    parser.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP, help="llama.cpp's source tree (the converter)")
    parser.add_argument("--llama-bin", type=Path, default=LLAMA_BIN, help="llama.cpp's binaries (llama-quantize)")
    parser.add_argument("--small", action="store_true", help="tiny shapes, to check the chain")
    parser.add_argument("--only", choices=("moe", "dense"), help="write one of the two files")
    parser.add_argument("--layers", type=int, help="this many layers instead (a quicker file of the same width)")
    args = parser.parse_args()
    shape = dict(SMALL_MOE if args.small else MOE)
    size = "small" if args.small else "2b"
    if args.layers:
        shape["num_hidden_layers"], size = args.layers, f"{size}-{args.layers}l"
    args.out.mkdir(parents=True, exist_ok=True)
    for kind in ("moe", "dense"):
        if args.only and kind != args.only:
            continue
        with tempfile.TemporaryDirectory(dir=args.out) as tmp:
            folder = Path(tmp)
            write_tokenizer(folder, shape["vocab_size"])
            if kind == "moe":
                (folder / "config.json").write_text(json.dumps(moe_config(shape), indent=1))
                write_moe_weights(folder, shape)
                stem = f"qwen3moe-{size}"
            else:
                dense = dense_shape(shape)
                (folder / "config.json").write_text(json.dumps(hf_config("qwen3", dense), indent=1))
                write_dense_weights(folder, "qwen3", dense)
                stem = f"qwen3-dense-{size}"
            print(convert(folder, args.out / stem, args.quant, args.llama_cpp, args.llama_bin))


if __name__ == "__main__":
    main()
