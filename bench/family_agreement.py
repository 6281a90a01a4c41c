"""``fast``'s top-1 agreement on the tiny family files, beside llama.cpp's on the same files.

The family tests (tests/model/test_families.py) hold bargein's ``fast`` precision to a top-1
agreement with transformers over 256 teacher-forced positions. This script answers whether
a shortfall is bargein's: it quantizes each committed tiny GGUF (tests/data/families) to
Q8_0 with llama.cpp's ``llama-quantize`` and runs it through llama.cpp (``llama_cpp`` in
the venv, which quantizes activations to Q8_0 blocks against Q8_0 weights, as ``fast``
does to int8 per block of 32), and prints, against transformers in float32 on the same
tokens: llama.cpp on the float32 file (its float path), llama.cpp on Q8_0, and bargein
``fast`` on the float32 file (which it holds as Q8_0 blocks).

    python bench/family_agreement.py gemma2 gemma3 qwen3
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.model.family_files import DATA, NAMES, all_logits, engine, reference_logits  # noqa: E402

QUANTIZE = Path("/work/llamacpp/build/bin/llama-quantize")
POSITIONS = 256


def _compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    return {"agreement": round((got.argmax(-1) == want.argmax(-1)).float().mean().item(), 4),
            "max_abs_diff": round((got - want).abs().max().item(), 4),
            "mean_abs_diff": round((got - want).abs().mean().item(), 4)}


def _llama_cpp_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=POSITIONS, n_batch=POSITIONS, n_threads=1,
                          verbose=False)
    llm.eval(tokens)
    return torch.tensor(np.array(llm.scores[:len(tokens)]), dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=list(NAMES), help=f"families (default: all of {NAMES})")
    args = parser.parse_args()
    rng = random.Random(3)  # the tokens of test_fast_agrees_with_transformers_over_256_positions
    tokens = [rng.randrange(3, 300) for _ in range(POSITIONS)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.names:
            f32 = DATA / name / "model.gguf"
            q8 = Path(tmp) / f"{name}.Q8_0.gguf"
            subprocess.run([str(QUANTIZE), str(f32), str(q8), "Q8_0"], check=True, capture_output=True)
            want = reference_logits(name, "gguf", tokens)
            fast = engine(name, "gguf", "fast", max_model_len=POSITIONS, block_size=16, num_blocks=17)
            for label, got in (("llama.cpp F32", _llama_cpp_logits(f32, tokens)),
                               ("llama.cpp Q8_0", _llama_cpp_logits(q8, tokens)),
                               ("bargein fast", all_logits(fast, tokens))):
                rows.append({"family": name, "run": label, **_compare(got, want)})
    print(f"{'family':8} {'run':16} {'top-1':>7} {'max|diff|':>10} {'mean|diff|':>10}")
    for r in rows:
        print(f"{r['family']:8} {r['run']:16} {r['agreement']:7.3f} {r['max_abs_diff']:10.4f} "
              f"{r['mean_abs_diff']:10.4f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
