"""Kernel and engine speed per instruction-set path (issue 31), ready for a real ARM64 machine.

ARM64 speed is unmeasured in this project: its ARM64 paths (NEON, and sdot from the
dot-product extension) were checked bit for bit under qemu on x86-64
(tests/kernels/test_arm64_emulated.py), and emulated time says nothing of a real core.
This is the one command to measure them on a Raspberry Pi 5, an Apple Silicon Mac under
Linux or a Graviton; on x86-64 it measures the plain C, AVX2 and AVX-512 VNNI paths alike.

1. Kernels, in one process, interleaved: the GGUF block matmul (gguf_matmul.c, the `fast`
   precision) per block type at 1, 8, 32 and 128 rows (decode, and prefill chunks: from 4
   rows on the sdot path runs its register tiles, neon_int8_tile.h, for the types with one
   scale per 32 and the BlockWeights), and the BlockWeight int8 matmuls (quant_matmul.c,
   4-bit and 8-bit), on every path this CPU runs; milliseconds per call (best of repeats:
   the least disturbed run), and the speed-up over plain C measured in the same run. Every
   path's output is checked to equal plain C's, bit for bit, on this machine.
2. Engine: ``bench/bench_model.py``'s decode tokens/s (1 and 8 sequences) and prefill
   tokens/s, in a fresh process per path (``BARGEIN_Q8_ISA``), unless ``--no-engine``
   (``--quick``: bench_model's quick run with a 128-token prompt).

Prints the tables, then one JSON line.

    python bench/bench_arm64.py [--quick] [--json PATH] [--threads N] [--no-engine] [--paths neon dotprod]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, emit, format_table, machine_info  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bargein.kernels import build_flags  # noqa: E402
from bargein.kernels.block_quant import BlockWeight, quantize_8bit  # noqa: E402
from bargein.kernels.ggml_types import GGMLQuantizationType  # noqa: E402
from bargein.kernels.native import Q8_ISAS, load_native_kernels  # noqa: E402
from bargein.kernels.native_structs import describe_quant  # noqa: E402
from bargein.kernels.quant_weight import QuantWeight  # noqa: E402
from tests.gguf_blocks import random_blocks  # noqa: E402

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "IQ4_XS", "Q4_K", "Q5_K", "Q6_K")
ROWS = (1, 8, 32, 128)


def best_time(fn, seconds: float) -> float:
    """The least disturbed of repeated calls filling ``seconds`` (at least three)."""
    fn()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def kernel_rows(kernels, paths: list[str], n: int, k: int, threads: int, seconds: float) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    cases = [(name, describe_quant(QuantWeight.of(GGMLQuantizationType[name],
                                                  random_blocks(GGMLQuantizationType[name], n, k, rng), n, k)))
             for name in TYPES]
    cases.append(("blockweight q8", quantize_8bit(torch.randn(n, k, generator=torch.Generator().manual_seed(0)))))
    g = torch.Generator().manual_seed(1)
    cases.append(("blockweight q4", BlockWeight(4, torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=g),
                                                torch.rand(n, k // 32, generator=g) * 0.01,
                                                torch.randn(n, k // 32, generator=g) * 0.05)))
    for name, weight in cases:
        for m in ROWS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))

            def call(path: str, x=x, weight=weight, name=name) -> torch.Tensor:
                if name.startswith("blockweight"):
                    return kernels.q8_block_matmul(x, weight, threads, path)
                return kernels.quant_matmul(x, weight, threads, isa=path)

            reference = call("c")
            times = {path: float("inf") for path in paths}
            for _ in range(3):  # interleaved rounds: each path sees the same machine
                for path in paths:
                    times[path] = min(times[path], best_time(lambda path=path: call(path), seconds / 3))
            for path in paths:
                rows.append({"kernel": name, "n": n, "k": k, "rows": m, "path": path, "ms": times[path] * 1e3,
                             "vs_c": times["c"] / times[path], "same_bits_as_c": bool(torch.equal(call(path),
                                                                                                  reference))})
    return rows


def engine_rows(paths: list[str], threads: int | None, quick: bool) -> list[dict]:
    rows = []
    for path in paths:
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "model.json"
            command = [sys.executable, str(ROOT / "bench" / "bench_model.py"), "--no-dense", "--no-rss",
                       "--json", str(out), *(["--quick", "--prompt-len", "128"] if quick else []),
                       *(["--threads", str(threads)] if threads else [])]
            done = subprocess.run(command, env={**os.environ, "BARGEIN_Q8_ISA": path}, capture_output=True,
                                  text=True)
            if done.returncode:
                rows.append({"path": path, "error": done.stderr.strip().splitlines()[-1:]})
                continue
            result = json.loads(out.read_text())
            rows.append({"path": path, "prefill_tok_s": result["prefill_tok_s"],
                         "decode_x1_tok_s": result["decode_tok_s"]["1"], "decode_x8_tok_s": result["decode_tok_s"]["8"]})
    return rows


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--no-engine", action="store_true", help="kernels only")
    parser.add_argument("--shape", default="2048x2048", help="n x k of the kernel cases (default %(default)s)")
    parser.add_argument("--paths", nargs="+", choices=sorted(Q8_ISAS), default=None,
                        help="the paths to measure (default: every one this CPU runs); the kernels always run plain C too, "
                             "as their baseline")
    args = parser.parse_args()
    kernels = load_native_kernels()
    if kernels is None:
        raise SystemExit("bench_arm64: the native kernels did not build here (see the log); nothing to measure")
    threads = args.threads or torch.get_num_threads()
    paths = [name for name in Q8_ISAS if kernels.q8_isa_available(name) and (not args.paths or name in args.paths
                                                                              or name == "c")]
    n, k = map(int, args.shape.split("x"))
    started = time.perf_counter()
    kernel = kernel_rows(kernels, paths, n, k, threads, 0.2 if args.quick else 1.0)
    engine = [] if args.no_engine else engine_rows([p for p in paths if not args.paths or p in args.paths],
                                                   args.threads, args.quick)
    info = machine_info()
    info.update({"arm64": build_flags.is_arm64(), "cpu_features": sorted(build_flags.cpu_features()),
                 "library": kernels.path.name, "paths": paths})
    result = {"benchmark": "arm64", "threads": threads, "kernels": kernel, "engine": engine, "machine": info,
              "seconds": time.perf_counter() - started}
    sections = [(f"Kernels, {n}x{k}, {threads} threads: ms per call (best of repeats), vs_c = plain C's time / "
                 "this path's (same run)",
                 format_table(kernel, ["kernel", "rows", "path", "ms", "vs_c", "same_bits_as_c"]))]
    if engine:
        sections.append(("Engine (bench/bench_model.py per path, fresh process each): tokens/s",
                         format_table(engine)))
    emit(f"bargein per-path speed on {info['machine']} (paths: {', '.join(paths)})", sections, result, args.json)


if __name__ == "__main__":
    main()
