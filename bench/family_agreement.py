"""``fast``'s top-1 agreement on the tiny family files, beside llama.cpp's on the same files.

The family tests (tests/model/test_families.py) hold bargein's ``fast`` precision to a top-1
agreement with transformers over 256 teacher-forced positions. This script answers whether
a shortfall is bargein's: it quantizes each committed tiny GGUF (tests/data/families) to
Q8_0 with llama.cpp's ``llama-quantize`` and runs it through llama.cpp (``llama_cpp`` in
the venv, which quantizes activations to Q8_0 blocks against Q8_0 weights, as ``fast``
does to int8 per block of 32), and prints, against transformers in float32 on the same
tokens: llama.cpp on the float32 file (its float path), llama.cpp on Q8_0, bargein ``fast``
on the float32 file (a float source: held as 16-bit rows, F16 here, against float32
activations; bargein/kernels/half_rows.py), on the file converted to F16 by
``llama-quantize`` (read in place, the same rows) and on the Q8_0 file (int8 blocks against
int8 activations: what ``fast`` did with a float file before the float-source rule).

``--ablate`` also says where ``fast`` diverges from ``exact``: the float32 file in ``fast``,
one operation at a time (``fuse_layers`` off), with parts of it replaced by ``exact``'s
modules of the same file (float32 weights and activations): each kind of matmul, the LM
head, all matmuls. What is left when every matmul is ``exact``'s is the rest of ``fast``
(float16 K/V, the native norms, GeGLU, soft caps, embedding and query scales, attention).

    python bench/family_agreement.py gemma2 gemma3 qwen3 [--ablate]
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

from bargein.config import CacheConfig, EngineConfig  # noqa: E402
from bargein.engine.engine import Engine  # noqa: E402
from tests.model.family_files import DATA, NAMES, all_logits, reference_logits  # noqa: E402

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


def _engine(path: Path | str, precision: str) -> Engine:
    config = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=17), precision=precision, device="cpu",
                          max_model_len=POSITIONS)
    return Engine.from_pretrained(str(path), config, progress=False)


# ablation rows: label -> the parts of each layer (and "head") taken from exact
PARTS = {"wqkv": ("wqkv",), "wo": ("wo",), "w13 (gate, up)": ("w13",), "w2 (down)": ("w2",), "LM head": ("head",),
         "every layer matmul": ("wqkv", "wo", "w13", "w2"), "every matmul": ("wqkv", "wo", "w13", "w2", "head")}


def _ablation(path: Path, tokens: list[int]) -> list[tuple[str, torch.Tensor]]:
    """fast's logits with parts replaced by exact's modules (see the module doc)."""
    exact = _engine(path, "exact").runner.stages[0]
    out = []
    for label, parts in {"fast, one operation at a time": (), **PARTS}.items():
        eng = _engine(path, "fast")
        stage = eng.runner.stages[0]
        stage.fused = None  # the per-operation path (bit for bit the fused one), whose modules can be swapped
        for mine, theirs in zip(stage.layers, exact.layers, strict=True):
            for part in parts:
                owner = "attention" if part in ("wqkv", "wo") else "feed_forward"
                if part != "head":
                    setattr(getattr(mine, owner), part, getattr(getattr(theirs, owner), part))
        if "head" in parts:
            stage.lm_head = exact.lm_head
        out.append((f"fast, {label} exact" if parts else label, all_logits(eng, tokens)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=list(NAMES), help=f"families (default: all of {NAMES})")
    parser.add_argument("--ablate", action="store_true", help="also fast with parts replaced by exact's")
    args = parser.parse_args()
    rng = random.Random(3)  # the tokens of test_fast_agrees_with_transformers_over_256_positions
    tokens = [rng.randrange(3, 300) for _ in range(POSITIONS)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.names:
            f32 = DATA / name / "model.gguf"
            q8, f16 = Path(tmp) / f"{name}.Q8_0.gguf", Path(tmp) / f"{name}.F16.gguf"
            for out, qtype in ((q8, "Q8_0"), (f16, "F16")):
                subprocess.run([str(QUANTIZE), str(f32), str(out), qtype], check=True, capture_output=True)
            want = reference_logits(name, "gguf", tokens)
            runs = [("llama.cpp F32", _llama_cpp_logits(f32, tokens)),
                    ("llama.cpp Q8_0", _llama_cpp_logits(q8, tokens)),
                    ("bargein fast (16-bit rows)", all_logits(_engine(f32, "fast"), tokens)),
                    ("bargein fast, F16 file", all_logits(_engine(f16, "fast"), tokens)),
                    ("bargein fast, Q8_0 file", all_logits(_engine(q8, "fast"), tokens))]
            if args.ablate:
                runs += _ablation(f32, tokens)
            rows += [{"family": name, "run": label, **_compare(got, want)} for label, got in runs]
    print(f"{'family':8} {'run':40} {'top-1':>7} {'max|diff|':>10} {'mean|diff|':>10}")
    for r in rows:
        print(f"{r['family']:8} {r['run']:40} {r['agreement']:7.3f} {r['max_abs_diff']:10.4f} "
              f"{r['mean_abs_diff']:10.4f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
