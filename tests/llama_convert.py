"""llama.cpp's own converter (``convert_hf_to_gguf.py``) and ``llama-quantize``, as the test
files (tests/model/make_family_files.py, make_moe_files.py) and the benchmark files
(bench/make_family_gguf.py, make_moe_gguf.py) all run them: one call each.

The converter is pure Python, in llama-cpp-python's sdist; it runs in a child process, so
its package and its vendored ``gguf`` stay out of ours. It picks a tokenizer by the hash of
its pre-tokenizer's output and refuses one it does not know; the synthetic byte-level BPEs
of the tests and benchmarks are unknown to it, so the conversion runs with that lookup
answered "gpt-2" and with the SentencePiece vocabularies that Gemma 2 and Phi-3 expect read
as GPT-2 ones (from tokenizer.json). Every tensor and every architecture key is written by
the converter's own code for the family.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LLAMA_CPP = Path("/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp")  # the converter's tree
LLAMA_BIN = Path("/work/llamacpp/build/bin")  # llama-quantize and its libraries

_CONVERT = """
import sys
from pathlib import Path
root = Path(sys.argv[1])
sys.path.insert(0, str(root)); sys.path.insert(1, str(root / "gguf-py"))
import convert_hf_to_gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
TextModel._set_vocab_sentencepiece = TextModel._set_vocab_gpt2
from conversion.phi import Phi3MiniModel
Phi3MiniModel.set_vocab = TextModel._set_vocab_gpt2
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], "--outtype", sys.argv[4]]
convert_hf_to_gguf.main()
"""


def convert_to_gguf(folder: Path, out: Path, *, outtype: str = "f32", llama_cpp: Path = LLAMA_CPP) -> Path:
    """Converts a Hugging Face folder to the GGUF ``out`` (``outtype``: the converter's
    --outtype, f32 or f16) with llama.cpp's converter; raises CalledProcessError if it fails."""
    subprocess.run([sys.executable, "-c", _CONVERT, str(llama_cpp), str(folder), str(out), outtype], check=True,
                   env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return out


def quantize(src: Path, out: Path, qtype: str, *, llama_bin: Path = LLAMA_BIN) -> Path:
    """``llama-quantize src out qtype`` (Q4_K_M, Q8_0, ...); raises CalledProcessError if it fails."""
    subprocess.run([str(llama_bin / "llama-quantize"), str(src), str(out), qtype], check=True,
                   env={**os.environ, "LD_LIBRARY_PATH": str(llama_bin)})
    return out
