"""Engine throughput on a GPU (issue 18): aggregate tokens/s at 1, 32 and 256 streams,
CUDA graphs on and off, on a random-weight model of the bundled model's shape.

Speed depends on a model's shape, not its weights, and the bundled 98 MB GGUF cannot
travel to a machine that has no network; so the model here is SmolLM2-135M's shape
(hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536, vocabulary 49152)
with random weights made on the device. Prompts are random token ids (32 each, all
distinct, so no prefix is shared); every request generates ``--max-tokens`` greedy
tokens with ``ignore_eos``. Each level runs twice with fresh prompts: once to warm up
(CUDA graphs are captured on first use of a shape) and once timed.

    python bench/bench_gpu.py [--device cuda] [--dtype auto] [--streams 1,32,256]
                              [--max-tokens 128] [--graphs both|on|off] [--json PATH]

``--small`` uses a tiny model (a CPU dry run of the script's logic).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

# The benchmarks share bench/common.py whether run as scripts or loaded by `bargein bench`.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from common import (  # noqa: E402
    base_parser,
    drive_to_completion,
    emit,
    format_table,
    machine_info,
    median,
    percentile,
    rnd,
)

from bargein.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from bargein.engine.device import build_model, resolve_device, resolve_dtype  # noqa: E402
from bargein.engine.engine import Engine  # noqa: E402
from bargein.engine.outputs import OutputCollector  # noqa: E402
from bargein.engine.sampling import SamplingParams  # noqa: E402

SMOLLM2_135M = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                           num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                           max_position_embeddings=8192, tie_word_embeddings=True, name="smollm2-135m-shape")
TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
                   name="tiny")
PROMPT_LEN = 32


class IdTokenizer:
    """Token t is one printable byte: the engine detokenizes without a real vocabulary."""

    bos_token_id = None
    eos_token_ids = frozenset({0})
    special_token_ids = frozenset({0})
    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [1 + b for b in text.encode()]

    def token_bytes(self, token_id: int, *, skip_special_tokens: bool = True) -> bytes:
        return bytes([32 + token_id % 95])

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return b"".join(self.token_bytes(t) for t in ids).decode()


def random_weights(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """Canonical-named random weights made on the device (no host copy of the model)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.05, offset: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale + offset).to(dtype)

    h, q, kv, f = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.intermediate_size
    w = {"embed.weight": rnd(config.vocab_size, h, scale=0.5), "norm.weight": rnd(h, offset=1.0)}
    if not config.tie_word_embeddings:
        w["lm_head.weight"] = rnd(config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"layers.{i}"
        w |= {f"{p}.attn_norm.weight": rnd(h, offset=1.0), f"{p}.ffn_norm.weight": rnd(h, offset=1.0),
              f"{p}.wq.weight": rnd(q, h), f"{p}.wk.weight": rnd(kv, h), f"{p}.wv.weight": rnd(kv, h),
              f"{p}.wo.weight": rnd(h, q), f"{p}.w1.weight": rnd(f, h), f"{p}.w3.weight": rnd(f, h),
              f"{p}.w2.weight": rnd(h, f)}
    return w


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n, PROMPT_LEN), generator=g).tolist()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_level(engine: Engine, prompts: list[list[int]], max_tokens: int, budget_s: float) -> dict[str, Any]:
    """All prompts at once; steps until every request finished (or the budget ran out)."""
    device = engine.runner.device
    driver = OutputCollector(engine)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    graphs = engine.runner.decode_graphs
    replays_before = graphs.replays if graphs is not None else 0
    _sync(device)
    started = time.perf_counter()
    live = {driver.add_request(p, params) for p in prompts}
    run = drive_to_completion(driver.step, engine.abort, live, started, budget_s)
    _sync(device)
    wall = time.perf_counter() - started
    engine.check_block_accounting()
    ttft = [t * 1e3 for t in run.first.values()]
    step_ms = [seconds * 1e3 for _, seconds in run.decode_steps]
    return {
        "streams": len(prompts), "generated": run.generated, "wall_s": wall,
        "aggregate_tok_s": run.generated / wall, "decode_tok_s": run.decode_tok_s,
        "step_ms_median": median(step_ms), "step_ms_p99": percentile(step_ms, 99),
        "ttft_ms_median": median(ttft),
        "graph_replays": (graphs.replays if graphs is not None else 0) - replays_before,
        "truncated": run.truncated,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--streams", default="1,32,256", help="comma-separated concurrency levels")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--graphs", choices=("both", "on", "off"), default="both")
    parser.add_argument("--level-budget", type=float, default=30.0, help="seconds one timed level may run")
    parser.add_argument("--kv-memory-gb", type=float, default=4.0)
    parser.add_argument("--small", action="store_true", help="a tiny model (CPU dry run)")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    shape = TINY if args.small else SMOLLM2_135M
    levels = [int(s) for s in args.streams.split(",")]
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.graphs]

    t0 = time.perf_counter()
    weights = random_weights(shape, device, dtype)
    base = EngineConfig(
        cache=CacheConfig(block_size=16, memory_bytes=int(args.kv_memory_gb * 1024**3)),
        scheduler=SchedulerConfig(max_num_seqs=max(levels), max_num_batched_tokens=max(2048, PROMPT_LEN * max(levels))),
        device=str(device), dtype=_dtype_name(dtype), max_model_len=PROMPT_LEN + args.max_tokens + 16)
    model = build_model(shape, weights, base, max_positions=base.max_model_len)
    _sync(device)
    build_s = time.perf_counter() - t0
    info = machine_info()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    print(f"built {shape.name} ({dtype}) on {device} in {build_s:.1f}s", flush=True)

    rows: list[dict[str, Any]] = []
    for graphs_on in modes:
        config = dataclasses.replace(base, cuda_graphs=graphs_on)
        engine = Engine(model, IdTokenizer(shape.vocab_size), config, model_name=shape.name)
        mode = "off"
        if graphs_on:
            mode = "on" if engine.runner.decode_graphs is not None else "padded-eager"
            if engine.runner.decode_graphs is None:  # no CUDA: the same padded path, without capture
                engine.runner.decode_graphs = engine.runner.padded_decode(config.cuda_graph_batch_sizes,
                                                                          capture=False)
        for i, n in enumerate(levels):
            warm_s = time.perf_counter()
            run_level(engine, _prompts(n, shape.vocab_size, seed=1000 + i), args.max_tokens, args.level_budget)
            warm_s = time.perf_counter() - warm_s
            row = run_level(engine, _prompts(n, shape.vocab_size, seed=2000 + i), args.max_tokens,
                            args.level_budget)
            row = {"cuda_graphs": mode, **row, "warmup_s": warm_s}
            rows.append(row)
            if args.json:  # what is measured so far survives a run cut short
                Path(args.json).write_text(json.dumps(rnd({"partial": True, "rows": rows})) + "\n")
            print(f"  graphs {mode} {n:4d} streams: {row['aggregate_tok_s']:,.0f} tok/s "
                  f"aggregate, decode {row['decode_tok_s']:,.0f} tok/s, step {row['step_ms_median']:.2f} ms",
                  flush=True)
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()

    result = {"benchmark": "gpu_engine", "model": shape.name, "device": str(device), "dtype": _dtype_name(dtype),
              "max_tokens": args.max_tokens, "prompt_len": PROMPT_LEN, "build_s": build_s, "rows": rows,
              "machine": info}
    if device.type == "cuda":
        result["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 1024**3
    columns = ["cuda_graphs", "streams", "generated", "wall_s", "aggregate_tok_s", "decode_tok_s", "step_ms_median",
               "step_ms_p99", "ttft_ms_median", "graph_replays", "warmup_s", "truncated"]
    emit(f"bargein GPU engine benchmark ({shape.name}, {dtype}, {device})",
         [(f"{PROMPT_LEN}-token prompts, {args.max_tokens} greedy tokens per stream (ignore_eos); timed run after a "
           "warm-up run of the same shape", format_table(rows, columns))], result, args.json)
    return result


if __name__ == "__main__":
    main()
