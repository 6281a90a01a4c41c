"""Writes tests/data/families/<family>/: a tiny random model of each family as transformers
saves it (``hf/``: config.json, model.safetensors, tokenizer files) and as llama.cpp's own
converter turns that folder into a GGUF (``model.gguf``, float32).

Run it where llama-cpp-python's sdist is unpacked (the converter is pure Python)::

    python tests/model/make_family_files.py [--llama-cpp DIR]

The conversion (tests/llama_convert.py) answers the converter's tokenizer lookup for the
tiny byte-level BPE here; every tensor and every architecture key is written by the
converter's own code for the family: that is what the tests check against.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.llama_convert import LLAMA_CPP, convert_to_gguf  # noqa: E402
from tests.model.family_specs import FAMILIES, FamilySpec  # noqa: E402
from tests.tiny_models import SPECIAL_TOKENS, tiny_tokenizer  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "families"
def save_hf(spec: FamilySpec, folder: Path) -> None:
    tok = tiny_tokenizer()
    config = getattr(transformers, spec.config_class)(vocab_size=tok.get_vocab_size(), bos_token_id=0,
                                                      eos_token_id=2, pad_token_id=0,
                                                      **{k: v for k, v in spec.config.items()
                                                         if k not in ("bos_token_id", "eos_token_id",
                                                                      "pad_token_id")})
    torch.manual_seed(0)
    model = getattr(transformers, spec.model_class)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # random norms (not all ones, not all zeros): a wrong +1 shows
                # Gemma's norms multiply by 1 + w; its layers' outputs pass a norm on the way into the
                # residual, which a larger weight lets outweigh the (tied) embedding (see below); a larger
                # final norm sharpens its logits as a trained model's are (fewer near ties).
                center = (2.0 if ".post_" in name or name == "model.norm.weight" else 0.0) if "gemma" in spec.name \
                    else 1.0
                p.copy_(0.2 * torch.randn_like(p) + center)
            elif p.dim() == 2:  # transformers' init (std 0.02) gives near-uniform logits and greedy
                # output that repeats one token; unit-variance activations give varied answers. A
                # tied embedding is kept small (Gemma's is scaled by sqrt(hidden) = 8 on the way in),
                # else the last token's own row dominates its logits and greedy repeats it.
                tied = "embed" in name and config.tie_word_embeddings
                p.copy_(torch.randn_like(p) * (0.15 if tied else 1.0 if "embed" in name else p.shape[1] ** -0.5))
    model.save_pretrained(folder, safe_serialization=True)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL_TOKENS[0],
                                                eos_token=SPECIAL_TOKENS[2], pad_token=SPECIAL_TOKENS[0])
    fast.chat_template = spec.chat_template
    fast.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP, help="llama.cpp's source tree")
    parser.add_argument("families", nargs="*", help="only these (default: all)")
    args = parser.parse_args()
    for spec in FAMILIES:
        if args.families and spec.name not in args.families:
            continue
        out = DATA / spec.name
        shutil.rmtree(out, ignore_errors=True)
        save_hf(spec, out / "hf")
        convert_to_gguf(out / "hf", out / "model.gguf", llama_cpp=args.llama_cpp)
        print(f"{spec.name}: {out}")


if __name__ == "__main__":
    main()
