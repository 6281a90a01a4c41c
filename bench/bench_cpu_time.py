"""CPU-time benchmark (issue 11): bargein in both precisions against llama.cpp, on one thread.

On a shared machine wall-clock rates swing with the neighbours' load (a spinning thread
pool waiting for a descheduled thread is the worst case); the CPU time a process spends
on one thread is far steadier. This measures, in one process and interleaved round by
round, the CPU seconds (``time.process_time``, best of ``--rounds``) of:

- a 512-token prefill (one forward of the bundled model; llama.cpp: ``Llama.eval``);
- decoding one sequence at context ~256 (16 tokens, one forward each).

for bargein ``exact``, bargein ``fast`` and, where llama-cpp-python is installed,
llama.cpp on the same GGUF and tokens. Ratios are llama.cpp's CPU time over ours (above 1:
we are faster).

    python bench/bench_cpu_time.py [--rounds N] [--json PATH]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from common import base_parser, emit, format_table, machine_info  # noqa: E402

from bargein.config import CacheConfig, EngineConfig  # noqa: E402
from bargein.engine.engine import Engine  # noqa: E402
from bargein.loader import resolve_model_ref  # noqa: E402
from bargein.model.attention import AttentionMetadata  # noqa: E402

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "public_domain.txt"
PROMPT, CONTEXT, DECODE = 512, 256, 16


def cpu_seconds(fn: Callable[[], Any]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


class Ours:
    """A forward of one sequence through an engine's model, on cache blocks of its own."""

    def __init__(self, engine: Engine, ids: list[int]):
        self.stage, self.caches = engine.runner.stages[0], engine.runner.kv_caches[0]
        self.block_size, self.ids = engine.runner.block_size, ids
        self.table = list(range(1, 2 + (PROMPT + DECODE) // self.block_size))

    def forward(self, start: int, end: int) -> None:
        meta = AttentionMetadata.build(block_tables=[self.table], query_lens=[end - start], context_lens=[end],
                                       block_size=self.block_size)
        self.stage(torch.tensor(self.ids[start:end]), torch.arange(start, end), meta, self.caches,
                   torch.tensor([end - start - 1]))

    def prefill(self) -> float:
        return cpu_seconds(lambda: self.forward(0, PROMPT))

    def decode(self) -> float:
        self.forward(0, CONTEXT)
        return cpu_seconds(lambda: [self.forward(p, p + 1) for p in range(CONTEXT, CONTEXT + DECODE)]) / DECODE


class LlamaCpp:
    def __init__(self, llama_cpp: Any, path: str, ids: list[int]):
        self.llm = llama_cpp.Llama(path, n_ctx=2 * PROMPT, n_batch=PROMPT, n_ubatch=PROMPT, n_threads=1,
                                   n_threads_batch=1, verbose=False)
        self.ids, self.version = ids, getattr(llama_cpp, "__version__", "?")

    def _eval(self, ids: list[int], fresh: bool) -> None:
        if fresh:
            self.llm.reset()
            self.llm._ctx.kv_cache_clear()
        self.llm.eval(ids)

    def prefill(self) -> float:
        return cpu_seconds(lambda: self._eval(self.ids[:PROMPT], True))

    def decode(self) -> float:
        self._eval(self.ids[:CONTEXT], True)
        return cpu_seconds(lambda: [self._eval([t], False) for t in self.ids[CONTEXT:CONTEXT + DECODE]]) / DECODE


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each is kept")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    torch.set_num_threads(1)  # one thread by design (--threads is not used): CPU time is the measure
    cache = CacheConfig(memory_bytes=64 * 1024**2)
    engines = {p: Engine.from_pretrained(args.model, EngineConfig(precision=p, cache=cache), progress=False)
               for p in ("exact", "fast")}
    ids = engines["fast"].tokenizer.encode(TEXT.read_text(), add_special_tokens=False)[:PROMPT + DECODE]
    contenders: dict[str, Any] = {p: Ours(e, ids) for p, e in engines.items()}
    try:
        import llama_cpp  # type: ignore[import-not-found]

        contenders["llama.cpp"] = LlamaCpp(llama_cpp, str(resolve_model_ref(args.model).path), ids)
    except ImportError:
        pass
    best: dict[str, dict[str, float]] = {name: {"prefill": float("inf"), "decode": float("inf")} for name in contenders}
    for _ in range(rounds):
        for name, c in contenders.items():
            best[name]["prefill"] = min(best[name]["prefill"], c.prefill())
            best[name]["decode"] = min(best[name]["decode"], c.decode())
    rows = []
    for name, b in best.items():
        row = {"engine": name, "prefill_512_cpu_s": b["prefill"], "prefill_tok_per_cpu_s": PROMPT / b["prefill"],
               "decode_cpu_ms_per_token": b["decode"] * 1e3}
        if "llama.cpp" in best and name != "llama.cpp":
            row["prefill_vs_llama_cpp"] = best["llama.cpp"]["prefill"] / b["prefill"]
            row["decode_vs_llama_cpp"] = best["llama.cpp"]["decode"] / b["decode"]
        rows.append(row)
    result = {"benchmark": "cpu_time", "rounds": rounds, "rows": rows, "machine": machine_info()}
    emit("CPU time on one thread (best of rounds; ratios = llama.cpp's CPU time / ours)",
         [(f"prefill {PROMPT} tokens; decode 1 sequence at context {CONTEXT}", format_table(rows))], result, args.json)
    return result


if __name__ == "__main__":
    main()
