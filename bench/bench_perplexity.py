"""Perplexity of GGUF files on tests/data/public_domain.txt: bargein (fast and exact) and
llama.cpp on the same windows and the same scored positions (issue 33: within 0.5%).

The text is tokenized once (bargein's tokenizer; llama.cpp reads the same vocabulary
from the file) and cut into windows of ``--window`` tokens, each scored from a fresh
context; every token of a window but the first is predicted from those before it
(``tests/perplexity.py``'s ``score`` for bargein, ``Llama(logits_all=True)`` for
llama.cpp, reset between windows).

``--offsets N`` scores the text N times, the cuts shifted by window / N each time, and
pools every pass's scored tokens (both sides the same). On a text of ~2,000 tokens one
pass's perplexity moves by up to 1.5% when an int8 rounding flips somewhere (both
sides round their activations to int8; which values flip is chance), so a difference
under that is not a difference of the two implementations; pooling several offsets
shrinks that spread.

    python bench/bench_perplexity.py [FILE.gguf ...] [--tokens 4096] [--window 512] [--offsets 1] [--json PATH]
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import apply_threads, base_parser, emit, format_table, machine_info  # noqa: E402


def offsets(window: int, passes: int) -> list[int]:
    """Where each pass's cuts start: window / passes apart."""
    return [p * window // passes for p in range(passes)]


def pooled(passes: list[np.ndarray]) -> tuple[float, list[float]]:
    """The perplexity of every pass's scored tokens together, and of each pass alone."""
    return (math.exp(float(np.concatenate(passes).mean())),
            [math.exp(float(nll.mean())) for nll in passes])


def bargein_perplexity(path: str, ids: list[int], window: int, precision: str,
                       passes: int) -> tuple[float, list[float]]:
    from bargein import CacheConfig, Engine, EngineConfig
    from tests.perplexity import score

    config = EngineConfig(precision=precision, cache=CacheConfig(kv_tokens=window + 64), max_model_len=window + 64)
    engine = Engine.from_pretrained(path, config, progress=False)
    return pooled([score(engine, ids, window, offset).nll.numpy() for offset in offsets(window, passes)])


def llama_perplexity(path: str, ids: list[int], window: int, threads: int | None,
                     passes: int) -> tuple[float, list[float]]:
    from llama_cpp import Llama  # type: ignore[import-not-found]

    from tests.perplexity import windows

    llm = Llama(model_path=path, n_ctx=window, n_batch=window, logits_all=True, verbose=False,
                **({"n_threads": threads, "n_threads_batch": threads} if threads else {}))
    per_pass: list[np.ndarray] = []
    for offset in offsets(window, passes):
        nll: list[np.ndarray] = []
        for start, stop in windows(len(ids), window, offset):
            chunk = ids[start:stop]
            llm.reset()
            llm.eval(chunk)
            logits = np.asarray(llm.scores[:len(chunk) - 1], dtype=np.float64)  # row i predicts chunk[i + 1]
            top = logits.max(-1, keepdims=True)
            log_z = top[:, 0] + np.log(np.exp(logits - top).sum(-1))
            nll.append(log_z - logits[np.arange(len(chunk) - 1), chunk[1:]])
        per_pass.append(np.concatenate(nll))
    return pooled(per_pass)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="GGUF files (default: the bundled model)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the text scored (default %(default)s)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--offsets", type=int, default=1,
                        help="passes over the text, the window cuts shifted by window / N each (default %(default)s)")
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    from bargein.loader import load_tokenizer, resolve_model_ref
    from tests.perplexity import TEXT

    files = args.files or [str(resolve_model_ref(args.model).path)]
    num_tokens = 512 if args.quick else args.tokens
    rows = []
    for path in files:
        ids = load_tokenizer(resolve_model_ref(path)).encode(TEXT.read_text(), add_special_tokens=False)
        ids = ids[:num_tokens]
        row: dict[str, Any] = {"file": Path(path).name, "tokens": len(ids), "window": args.window,
                               "offsets": args.offsets}
        for precision in ("fast", "exact"):
            started = time.perf_counter()
            row[f"bargein_{precision}"], row[f"bargein_{precision}_passes"] = bargein_perplexity(
                path, ids, args.window, precision, args.offsets)
            row[f"bargein_{precision}_s"] = time.perf_counter() - started
        try:
            started = time.perf_counter()
            row["llama_cpp"], row["llama_cpp_passes"] = llama_perplexity(path, ids, args.window, args.threads,
                                                                         args.offsets)
            row["llama_cpp_s"] = time.perf_counter() - started
            for precision in ("fast", "exact"):
                row[f"{precision}_vs_llama_cpp_pct"] = 100 * (row[f"bargein_{precision}"] / row["llama_cpp"] - 1)
        except ImportError:
            row["llama_cpp"] = "llama_cpp (llama-cpp-python) is not importable"
        rows.append(row)
    result = {"benchmark": "perplexity", "machine": machine_info(), "rows": rows}
    columns = [c for c in rows[0] if not c.endswith("_passes")]  # each pass's perplexity: in the JSON
    emit("Perplexity on tests/data/public_domain.txt", [("same windows and scored positions on both sides",
                                                         format_table(rows, columns))], result, args.json)
    return result


if __name__ == "__main__":
    main()
