"""Writes tests/data/moe/<name>/: a tiny random mixture-of-experts model of each MoE family as
transformers saves it (``hf/``) and as llama.cpp's own converter turns that folder into a
GGUF (``model.gguf``, float32), as make_family_files.py does for the dense families.

Run it where llama-cpp-python's sdist is unpacked (the converter is pure Python)::

    python tests/model/make_moe_files.py [--llama-cpp DIR] [names...]

Weights are drawn so that the experts matter: every matrix (each expert's too) has
unit-variance outputs and the router's logits are O(1), so tokens spread over the experts
and a wrong expert, weight or normalisation changes the answer.
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
from tests.model.moe_specs import MOE_FAMILIES, MoESpec  # noqa: E402
from tests.tiny_models import SPECIAL_TOKENS, tiny_tokenizer  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "moe"


def save_hf(spec: MoESpec, folder: Path) -> None:
    tok = tiny_tokenizer()
    config = getattr(transformers, spec.config_class)(vocab_size=tok.get_vocab_size(), bos_token_id=0,
                                                      eos_token_id=2, pad_token_id=0, **spec.config)
    torch.manual_seed(0)
    model = getattr(transformers, spec.model_class)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn_like(p) + 1.0)
            elif p.dim() >= 2:  # matrices and stacked experts (E, out, in): unit-variance outputs
                p.copy_(torch.randn_like(p) * (1.0 if "embed" in name else p.shape[-1] ** -0.5))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL_TOKENS[0],
                                                eos_token=SPECIAL_TOKENS[2], pad_token=SPECIAL_TOKENS[0])
    fast.chat_template = spec.chat_template
    fast.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP, help="llama.cpp's source tree")
    parser.add_argument("names", nargs="*", help="only these (default: all)")
    args = parser.parse_args()
    for spec in MOE_FAMILIES:
        if args.names and spec.name not in args.names:
            continue
        out = DATA / spec.name
        shutil.rmtree(out, ignore_errors=True)
        save_hf(spec, out / "hf")
        convert_to_gguf(out / "hf", out / "model.gguf", llama_cpp=args.llama_cpp)
        print(f"{spec.name}: {out}")


if __name__ == "__main__":
    main()
