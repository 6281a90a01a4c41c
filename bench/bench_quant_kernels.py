"""The GGUF block kernels (gguf_matmul.c) per type, shape, row count and instruction set.

Prints a table and JSON: milliseconds per call (best of repeats), GB/s of weight
blocks read at one row, GFLOP/s (2 m n k) at many. With ``--compare``, the raw-layout
Q4_1/Q8_0 path beside today's BlockWeight kernel (quant_matmul.c) on the same blocks.
With ``--cold``, each call reads one of enough copies of the blocks (>= 96 MB) that it
streams them from memory, as a decode step does (the model is larger than the caches);
without it one matrix is repeated and stays cached, which favours the kernel with less
work per block and hides prefetching.

    python bench/bench_quant_kernels.py --types Q4_K Q6_K --shapes 2048x2048 --rows 1 32 512
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from bargein.kernels.ggml_types import GGMLQuantizationType
from bargein.kernels.native import load_native_kernels
from bargein.kernels.native_structs import describe_quant
from bargein.kernels.quant_weight import QuantWeight
from tests.gguf_blocks import random_blocks


def timed(fns, seconds: float) -> float:
    """Best time of one call, the calls taken in turn from fns (copies of one matrix)."""
    fns[0]()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 3:
        for fn in fns:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return float(np.min(times))  # the least disturbed run: colleagues share these cores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
    parser.add_argument("--shapes", nargs="+", default=["2048x2048", "8192x2048", "2048x8192"], help="n x k")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32, 512])
    parser.add_argument("--isas", nargs="+", default=["vnni", "avx2"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--compare", action="store_true", help="Q4_1/Q8_0 against BlockWeight's kernel")
    parser.add_argument("--cold", action="store_true", help="cycle over >= 96 MB of copies (weights from memory)")
    args = parser.parse_args()
    native = load_native_kernels()
    assert native is not None, "needs the native kernels"
    rng = np.random.default_rng(0)
    results = []
    print(f"{'type':7} {'shape':>10} {'rows':>5} {'isa':5} {'ms':>9} {'GB/s':>7} {'GFLOP/s':>8} {'blockw ms':>9}")
    for name in args.types:
        qtype = GGMLQuantizationType[name]
        for shape in args.shapes:
            n, k = map(int, shape.split("x"))
            data = random_blocks(qtype, n, k, rng)
            copies = int(96e6 // (data.numel() * data.element_size())) + 2 if args.cold else 1
            datas = [data] + [data.clone() for _ in range(copies - 1)]
            weights = [QuantWeight.of(qtype, d, n, k) for d in datas]
            weight, matrices = weights[0], [describe_quant(w) for w in weights]
            blocks = None
            if args.compare and name in ("Q4_1", "Q8_0"):
                from tests.kernels.test_gguf_kernels import _block_weight
                blocks = [_block_weight(qtype, d, n, k) for d in datas]
            for m in args.rows:
                x = torch.randn(m, k)
                for isa in args.isas:
                    if not native.q8_isa_available(isa):
                        continue
                    sec = timed([lambda x=x, mt=mt, isa=isa: native.quant_matmul(x, mt, args.threads, isa=isa)
                                 for mt in matrices], args.seconds)
                    old = (timed([lambda x=x, b=b, isa=isa: native.q8_block_matmul(x, b, args.threads, isa=isa)
                                  for b in blocks], args.seconds)
                           if blocks is not None else None)
                    row = {"type": name, "n": n, "k": k, "rows": m, "isa": isa, "ms": sec * 1e3,
                           "gb_s": weight.nbytes / sec / 1e9, "gflop_s": 2 * m * n * k / sec / 1e9,
                           "blockweight_ms": None if old is None else old * 1e3}
                    results.append(row)
                    print(f"{name:7} {shape:>10} {m:5} {isa:5} {row['ms']:9.3f} {row['gb_s']:7.1f} "
                          f"{row['gflop_s']:8.1f} {'' if old is None else f'{old * 1e3:9.3f}'}")
    print(json.dumps({"threads": args.threads, "cold": args.cold, "results": results}))


if __name__ == "__main__":
    main()
