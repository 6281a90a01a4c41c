"""What one expert's MLP costs in `fast` (moe_matmul.c through bargein_gguf_matmul_expert), split
into the part paid once per expert read and the part paid per row that chose it.

A 32-stream decode step of the 48-expert top-8 file gives each expert ~5.3 rows (32 * 8 /
48), so the step's expert time is about experts * (fixed + 5.3 * per_row) per layer. This
times the native experts call of every MoE layer of a GGUF with ``r`` rows all choosing the
same ``topk`` experts (so each chosen expert gets exactly ``r`` rows), for each ``r`` of
``--rows``, cycling over the layers and over the experts as a step does (their weights come
from memory, not from the cache), on one thread, in process CPU seconds (a loaded machine's
waits for a core do not count), the instruction-set paths in turn within each round;
medians over ``--rounds``. Then a least-squares line per path: ``us_per_expert = fixed +
per_row * rows``, and what it predicts for a step's mean rows per expert.

    python bench/bench_moe_experts.py /work/models/moe/qwen3moe-2b.Q4_K_M.gguf

``--step`` times instead a whole step's experts call per layer, as a decode step makes it:
``--streams`` rows, each routed to ``topk`` distinct random experts (seeded), on
``--threads`` threads, in wall-clock milliseconds per step (every layer once; the threads'
balance and waits count), the median over ``--rounds``. ``--against LIB.so`` loads another
build of the kernels (one from ``BARGEIN_CACHE_DIR``, built by another tree) into the same
process and runs each step's routing on both in turn, alternating which goes first, checks
that their outputs are the same bits, and prints the median of the per-step ratios: a
same-run A/B that a loaded machine's noise moves for both sides alike.

    python bench/bench_moe_experts.py FILE --step --threads 2 --rounds 40 --against OTHER.so

(With ``--threads 2`` the two libraries' thread pools spin against each other; one may fall
back to sleeping workers for a while. bench/gemm_tile_ab.c's header says how to time
threads instead: each library in a process of its own, the processes alternated.)

Without ``--step``, ``--against LIB.so`` times the two builds' expert calls in turn for each
rows count and path instead, and prints per rows count the median of the rounds' ratios
(this tree / LIB.so): a same-run A/B of the few-row pass at each row count.

    python bench/bench_moe_experts.py FILE --rows 1,5,8,9,12 --rounds 9 --against OTHER.so
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, format_table, machine_info  # noqa: E402

from bargein.kernels.moe_native import MoEKernels  # noqa: E402
from bargein.kernels.native import Q8_ISAS  # noqa: E402
from bargein.kernels.ops import resolve_kernels  # noqa: E402
from bargein.loader import load_config, load_weights, resolve_model_ref  # noqa: E402
from bargein.model.llama import LlamaStage  # noqa: E402
from bargein.model.moe import MoEFeedForward  # noqa: E402

PATHS = {"vnni": "AVX-512 VNNI", "avx2": "AVX2"}  # the x86 paths, best first


def moe_layers(path: str) -> list[MoEFeedForward]:
    """The file's MoE feed-forward modules in `fast` (their experts read in place from the file)."""
    source = resolve_model_ref(path)
    config = load_config(source)
    weights = dict(load_weights(source, config, blocks=True, progress=False))
    stage = LlamaStage(config, weights, None, kernels=resolve_kernels("cpu", precision="fast"))
    layers = [layer.feed_forward for layer in stage.layers if isinstance(layer.feed_forward, MoEFeedForward)]
    if not layers or layers[0].table is None:
        raise SystemExit(f"{path}: no MoE layers with native expert tables")
    return layers


def time_rows(layers: list[MoEFeedForward], moe: MoEKernels, rows: int, isa: int) -> float:
    """Microseconds of CPU per expert call of build ``moe`` with ``rows`` rows, over every
    layer and every group of ``topk`` experts in turn."""
    first = layers[0]
    topk, experts = first.topk, first.num_experts
    x = torch.randn(rows, first.table.hidden, generator=torch.Generator().manual_seed(rows))
    weights = torch.full((rows, topk), 1.0 / topk)
    groups = [torch.arange(g, g + topk).repeat(rows, 1).contiguous() for g in range(0, experts - topk + 1, topk)]
    started = time.process_time()
    for layer in layers:
        for ids in groups:
            moe.experts(x, layer.table, ids, weights, exact=False, num_threads=1, isa=isa)
    return (time.process_time() - started) / (len(layers) * len(groups) * topk) * 1e6


def time_steps(layers: list[MoEFeedForward], builds: dict[str, MoEKernels], streams: int, threads: int,
               isa: int, rounds: int) -> dict[str, list[float]]:
    """Per build, the wall-clock milliseconds of each round's step (every layer's experts
    call, ``streams`` rows routed at random, seeded), the builds in turn within a round
    (alternating which goes first) on the same routing; their outputs must agree bit for bit."""
    first = layers[0]
    topk, experts = first.topk, first.num_experts
    g = torch.Generator().manual_seed(streams)
    x = torch.randn(streams, first.table.hidden, generator=g)
    weights = torch.full((streams, topk), 1.0 / topk)
    times: dict[str, list[float]] = {name: [] for name in builds}
    for r in range(rounds + 1):  # round 0: the first calls (set-up, pages of the file mapped), not counted
        routes = [torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(streams)]) for _ in layers]
        outputs = {}
        for name in list(builds)[::1 if r % 2 else -1]:
            started = time.perf_counter()
            outputs[name] = [builds[name].experts(x, layer.table, ids, weights, exact=False, num_threads=threads,
                                                  isa=isa) for layer, ids in zip(layers, routes, strict=True)]
            if r:
                times[name].append((time.perf_counter() - started) * 1e3)
        reference = next(iter(outputs.values()))
        if not all(torch.equal(a, b) for other in outputs.values() for a, b in zip(reference, other, strict=True)):
            raise SystemExit("the builds' outputs differ")
    return times


def rows_against(layers: list[MoEFeedForward], other: MoEKernels, counts: list[int], isas: list[int],
                 rounds: int, names: dict[int, str], file: str, json_path: str | None) -> dict[str, Any]:
    """Per rows count and path, the median over ``rounds`` of this tree's expert call time
    over ``other``'s, the two timed in turn within a round (alternating which goes first)."""
    builds = [layers[0].kernels.native.moe, other]
    for isa in isas:  # first calls: the libraries' lazy set-up, pages of the file mapped
        for moe in builds:
            time_rows(layers, moe, 1, isa)
    ratios: dict[tuple[int, int], list[float]] = {}
    for r in range(rounds):
        for rows in counts:
            for isa in isas:
                us = [time_rows(layers, moe, rows, isa) for moe in builds[::1 if r % 2 else -1]]
                ratios.setdefault((isa, rows), []).append(us[0] / us[1] if r % 2 else us[1] / us[0])
    table = [{"rows": rows, **{names[isa]: statistics.median(ratios[isa, rows]) for isa in isas}} for rows in counts]
    result = {"benchmark": "moe_experts_against", "file": file, "machine": machine_info(),
              "ratio_this_over_against": table}
    emit("One expert's MLP, this tree / --against per call (CPU time, one thread, median of rounds)",
         [("ratio by rows per expert", format_table(table))], result, json_path)
    return result


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares (fixed, per_row) of us = fixed + per_row * rows."""
    n = len(points)
    mx, my = sum(r for r, _ in points) / n, sum(t for _, t in points) / n
    slope = sum((r - mx) * (t - my) for r, t in points) / sum((r - mx) ** 2 for r, _ in points)
    return my - slope * mx, slope


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("moe", help="an MoE GGUF (bench/make_moe_gguf.py)")
    parser.add_argument("--rows", default="1,2,4,5,6,8,12,16", help="rows per expert (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=32, help="a step's rows, for the prediction")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--step", action="store_true", help="time a whole step's experts call per layer instead")
    parser.add_argument("--threads", type=int, default=2, help="threads of --step (default %(default)s)")
    parser.add_argument("--against", metavar="LIB.so", help="another build of the kernels, timed in turn: per step (--step) or per rows count")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    layers = moe_layers(args.moe)
    native = layers[0].kernels.native
    if args.step:
        builds = {"this tree": native.moe}
        if args.against:
            builds["against"] = MoEKernels(ctypes.CDLL(args.against))
        times = time_steps(layers, builds, args.streams, args.threads, native.q8_isa, args.rounds)
        result = {"benchmark": "moe_experts_step", "file": Path(args.moe).name, "streams": args.streams,
                  "threads": args.threads, "ms_per_step": {k: statistics.median(v) for k, v in times.items()},
                  "machine": machine_info()}
        line = ", ".join(f"{k} {v:.1f}" for k, v in result["ms_per_step"].items())
        if args.against:
            ratios = [a / b for a, b in zip(times["this tree"], times["against"], strict=True)]
            result["ratio_median"] = statistics.median(ratios)
            line += f"; this tree / against per step, median {result['ratio_median']:.3f}"
        print(f"{args.streams} rows, {args.threads} threads, ms per step's experts calls: {line}")
        return result
    isas = [Q8_ISAS[name] for name in PATHS if native.q8_isa_available(name)]
    names = {Q8_ISAS[name]: label for name, label in PATHS.items()}
    counts = [int(r) for r in args.rows.split(",")]
    if args.against:
        return rows_against(layers, MoEKernels(ctypes.CDLL(args.against)), counts, isas, args.rounds, names,
                            Path(args.moe).name, args.json)
    for isa in isas:  # first calls: the library's lazy set-up, pages of the file mapped
        time_rows(layers, native.moe, 1, isa)
    times: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.rounds):
        for rows in counts:
            for isa in isas:
                times.setdefault((isa, rows), []).append(time_rows(layers, native.moe, rows, isa))
    table = [{"rows": rows, **{names[isa]: statistics.median(times[isa, rows]) for isa in isas}}
             for rows in counts]
    mean_rows = args.streams * layers[0].topk / layers[0].num_experts
    lines = []
    for isa in isas:
        fixed, per_row = fit([(rows, statistics.median(times[isa, rows])) for rows in counts])
        step = fixed + per_row * mean_rows
        lines.append({"path": names[isa], "fixed_us": fixed, "per_row_us": per_row,
                      "mean_rows": mean_rows, "us_per_expert_at_mean": step,
                      "rows_share": per_row * mean_rows / step})
    result = {"benchmark": "moe_experts", "file": Path(args.moe).name, "machine": machine_info(),
              "us_per_expert_call": table, "fit": lines}
    emit("One expert's MLP: the part per expert read and the part per row (CPU us, one thread)",
         [("us per expert call, by rows per expert", format_table(table)),
          ("us = fixed + per_row * rows", format_table(lines))], result, args.json)
    return result


if __name__ == "__main__":
    main()
