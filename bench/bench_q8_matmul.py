"""The `fast` precision's int8 block matmul against the packed float32 matmul (issue 11).

Times, for every linear shape of the bundled model (SmolLM2-135M: qkv 576->960, wo
576->576, gate/up 576->3072, down 1536->576, the LM head 576->49152 in Q8_0) and
1, 4, 8, 16, 32, 128 and 512 rows (the LM head up to 32: only the last token of a
prompt reaches it), in one process and interleaved:

- ``q8``: ``NativeKernels.q8_block_matmul`` on the GGUF's own blocks (what ``fast`` runs);
- ``fp32``: oneDNN's packed float32 matmul of the same weight dequantized (what ``exact``
  runs for many rows, bargein.model.linear).

Each figure is the median over repeats of the calling thread's CPU time
(``time.thread_time``; one thread) and of wall time (one and two threads). ``q8 cold``
is the one-row CPU time when the weight is read from memory rather than cache, as in a
decode step (copies of the weight, ``--cold-mb`` in all, taken in turn).

    python bench/bench_q8_matmul.py [--quick] [--json PATH] [--isa c|avx2|vnni]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from common import base_parser, emit, format_table, machine_info  # noqa: E402

from bargein.kernels.block_quant import BlockWeight  # noqa: E402
from bargein.kernels.native import Q8_ISAS, load_native_kernels  # noqa: E402
from bargein.loader import load_config, load_weights, resolve_model_ref  # noqa: E402
from bargein.model.block_weights import cat_rows  # noqa: E402
from bargein.model.linear import _try_pack  # noqa: E402

ROWS = (1, 4, 8, 16, 32, 128, 512)
LM_HEAD_ROWS = 32


def shapes(model: str | None) -> dict[str, BlockWeight]:
    source = resolve_model_ref(model)
    config = load_config(source)
    w = load_weights(source, config, layer_range=(0, 1), progress=False, blocks=True)
    return {"qkv": cat_rows([w["layers.0.wq.weight"], w["layers.0.wk.weight"], w["layers.0.wv.weight"]]),
            "wo": w["layers.0.wo.weight"],
            "gate_up": cat_rows([w["layers.0.w1.weight"], w["layers.0.w3.weight"]]),
            "down": w["layers.0.w2.weight"],
            "lm_head": w.get("lm_head.weight", w["embed.weight"])}


def median_times(fn: Callable[[], Any], budget_s: float, threads: int) -> tuple[float, float]:
    """(median thread CPU seconds, median wall seconds) over repeats filling ``budget_s``."""
    torch.set_num_threads(threads)
    fn()
    cpu, wall = [], []
    deadline = time.perf_counter() + budget_s
    while len(wall) < 3 or (time.perf_counter() < deadline and len(wall) < 200):
        c0, w0 = time.thread_time(), time.perf_counter()
        fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


def cold_copies(weight: BlockWeight, total_mb: float) -> list[BlockWeight]:
    count = max(2, int(total_mb * 2**20 / weight.nbytes) + 1)
    return [BlockWeight(weight.bits, weight.qs.clone(), weight.scales.clone(),
                        None if weight.mins is None else weight.mins.clone()) for _ in range(count)]


def measure(kernels: Any, isa: str | None, weight: BlockWeight, packed: torch.Tensor,
            copies: list[BlockWeight] | None, m: int, budget: float) -> dict[str, float]:
    """One shape at ``m`` rows: both matmuls' medians (and the cold one-row figure with ``copies``)."""
    x = torch.randn(m, weight.shape[1], generator=torch.Generator().manual_seed(m))

    def q8(threads: int) -> torch.Tensor:
        return kernels.q8_block_matmul(x, weight, threads, isa)

    def fp32() -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    q8_cpu, q8_wall1 = median_times(lambda: q8(1), budget, 1)
    fp_cpu, fp_wall1 = median_times(fp32, budget, 1)
    _, q8_wall2 = median_times(lambda: q8(2), budget, 2)
    _, fp_wall2 = median_times(fp32, budget, 2)
    row = {"q8_cpu_ms": q8_cpu * 1e3, "fp32_cpu_ms": fp_cpu * 1e3, "fp32/q8": fp_cpu / q8_cpu}
    if copies is not None:
        turn = iter(range(10**9))
        cold = median_times(lambda: kernels.q8_block_matmul(x, copies[next(turn) % len(copies)], 1, isa), budget, 1)
        row["q8_cold_cpu_ms"] = cold[0] * 1e3
        row["q8_cold_GB_s"] = weight.nbytes / cold[0] / 1e9
    row.update({"q8_wall_ms_1t": q8_wall1 * 1e3, "q8_wall_ms_2t": q8_wall2 * 1e3,
                "fp32_wall_ms_1t": fp_wall1 * 1e3, "fp32_wall_ms_2t": fp_wall2 * 1e3})
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--isa", choices=sorted(Q8_ISAS), default=None, help="force the int8 instruction set")
    parser.add_argument("--budget", type=float, default=0.15, help="seconds of repeats per figure")
    parser.add_argument("--cold-mb", type=float, default=96.0, help="weight copies for the cold one-row figure")
    parser.add_argument("--shapes", default=None, help="comma-separated subset of qkv,wo,gate_up,down,lm_head")
    parser.add_argument("--rows", default=None, help="comma-separated row counts (default: 1,4,8,16,32,128,512)")
    args = parser.parse_args(argv)
    kernels = load_native_kernels()
    if kernels is None:
        raise SystemExit("the native kernels are unavailable here (no C compiler?)")
    budget = 0.03 if args.quick else args.budget
    rows_list = tuple(int(r) for r in args.rows.split(",")) if args.rows else (1, 32) if args.quick else ROWS
    weights = shapes(args.model)
    if args.shapes:
        weights = {k: v for k, v in weights.items() if k in args.shapes.split(",")}
    before = torch.get_num_threads()
    table = []
    try:
        for name, weight in weights.items():
            n, k = weight.shape
            packed = _try_pack(weight.dequantize(), None)
            copies = cold_copies(weight, args.cold_mb)
            for m in rows_list:
                if name == "lm_head" and m > LM_HEAD_ROWS:
                    continue
                row = {"shape": f"{name} {k}->{n}", "rows": m}
                row.update(measure(kernels, args.isa, weight, packed, copies if m == 1 else None, m, budget))
                table.append(row)
                print(row, file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(before)
    isa = args.isa or next(name for name, v in Q8_ISAS.items() if v == kernels.q8_isa)
    result = {"benchmark": "q8_matmul", "isa": isa, "rows": table, "machine": machine_info()}
    columns = ["shape", "rows", "q8_cpu_ms", "fp32_cpu_ms", "fp32/q8", "q8_cold_cpu_ms", "q8_cold_GB_s",
               "q8_wall_ms_1t", "q8_wall_ms_2t", "fp32_wall_ms_1t", "fp32_wall_ms_2t"]
    emit(f"int8 block matmul ({isa}) against packed float32, per call (median; CPU = calling thread's)",
         [("ms per call", format_table(table, columns))], result, args.json)
    return result


if __name__ == "__main__":
    main()
