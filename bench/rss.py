"""Peak resident memory of bargein and of llama.cpp, each in a fresh process, at the same
KV capacity in tokens (issue 11).

Each measurement is a new Python process that loads the model, answers one request (a
prompt of ``PROMPT_TOKENS`` tokens, then ``ANSWER_TOKENS`` greedy tokens) and reports its
peak resident set (``VmHWM``, the ``ru_maxrss`` of its own address space). The import floor is the peak of a fresh process that
only imports torch (for bargein) or llama_cpp (for llama.cpp): "above the floor" is
what the model, its KV cache and the engine cost. Both see the same prompt token ids.

bargein's KV cache takes physical pages only as it is written (llama.cpp clears, so
writes, all of its cache at start): beside the peak after the request, each bargein row
gives the peak once its whole cache has been written (``above_floor_kv_written_mb``),
which is what a server whose cache is full holds.

    python bench/rss.py [--model REF] [--kv-tokens 2048] [--json PATH]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_fresh_python  # noqa: E402

PROMPT_TOKENS = 100
ANSWER_TOKENS = 32

# The process's peak resident set, MB: VmHWM, the high-water mark of its own address space.
# (Not ru_maxrss: Linux carries the parent's peak into a child made by vfork + exec, which
# is how subprocess starts one, so a child of a big benchmark process would report the parent's.)
_PEAK = """
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
"""

_FLOOR = _PEAK + """
import json, sys
__import__(sys.argv[1])
print(json.dumps({"peak_mb": peak()}))
"""

_BARGEIN = _PEAK + """
import json, sys, time
args = json.loads(sys.argv[1])
import torch
if args["threads"]:
    torch.set_num_threads(args["threads"])
from bargein import CacheConfig, Engine, EngineConfig, SamplingParams
started = time.perf_counter()
config = EngineConfig(cache=CacheConfig(kv_tokens=args["kv_tokens"]), **args["config"])
engine = Engine.from_pretrained(args["model"], config, progress=False)
load_s = time.perf_counter() - started
loaded = peak()
(out,) = engine.generate([args["prompt"]], SamplingParams(max_tokens=args["answer"], temperature=0, ignore_eos=True))
assert len(out.token_ids) == args["answer"]
after_request = peak()
# The cache's pages become resident as they are written (bargein.model.zeroed): write it all,
# for the peak of a cache in full use.
caches = [c for stage in engine.runner.kv_caches for c in stage]
for c in caches:
    c.k.zero_()
    c.v.zero_()
print(json.dumps({"peak_mb": after_request, "after_load_mb": loaded, "load_s": load_s,
                  "kv_tokens": engine.pool.num_blocks * engine.pool.block_size,
                  "kv_cache_mb": sum(t.numel() * t.element_size() for c in caches for t in (c.k, c.v)) / 2**20,
                  "peak_kv_written_mb": peak()}))
"""

_LLAMA = _PEAK + """
import json, sys, time
import numpy as np
args = json.loads(sys.argv[1])
import llama_cpp as lib
quiet = lib.llama_log_callback(lambda level, text, data: None)
lib.llama_log_set(quiet, None)
lib.llama_backend_init()
started = time.perf_counter()
model = lib.llama_model_load_from_file(args["path"].encode(), lib.llama_model_default_params())
params = lib.llama_context_default_params()
params.n_ctx, params.n_seq_max = args["kv_tokens"], 1
params.n_batch = params.n_ubatch = 512
if args["threads"]:
    params.n_threads = params.n_threads_batch = args["threads"]
ctx = lib.llama_init_from_model(model, params)
load_s = time.perf_counter() - started
loaded = peak()
n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
batch = lib.llama_batch_init(512, 0, 1)
def decode(tokens, start):
    for i, token in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
        batch.seq_id[i][0], batch.logits[i] = 0, i == len(tokens) - 1
    batch.n_tokens = len(tokens)
    assert lib.llama_decode(ctx, batch) == 0
    logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, len(tokens) - 1), shape=(n_vocab,))
    return int(logits.argmax())
prompt = args["prompt"]
token = decode(prompt, 0)
for step in range(args["answer"] - 1):
    token = decode([token], len(prompt) + step)
print(json.dumps({"peak_mb": peak(), "after_load_mb": loaded, "load_s": load_s, "kv_tokens": lib.llama_n_ctx(ctx),
                  "version": getattr(lib, "__version__", "?")}))
"""


def _run(script: str, *argv: str) -> dict[str, Any]:
    result = run_fresh_python(script, argv, timeout=600)
    if result.returncode:
        raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _prompt(model: str | None) -> tuple[list[int], str]:
    """PROMPT_TOKENS token ids of ordinary text (our tokenizer; llama.cpp reads the same
    vocabulary from the GGUF), and the GGUF's path (None where the model is no GGUF)."""
    from bargein.loader import load_tokenizer, resolve_model_ref

    source = resolve_model_ref(model)
    text = " ".join(["The quick brown fox jumps over the lazy dog while the river runs to the sea."] * 20)
    ids = load_tokenizer(source).encode(text)[:PROMPT_TOKENS]
    return ids, str(source.path) if source.kind == "gguf" else ""


# bargein's variants measured by default: name -> EngineConfig fields.
VARIANTS: dict[str, dict[str, Any]] = {"bargein fast (default)": {"precision": "fast"},
                                      "bargein exact": {"precision": "exact"}}


def measure_rss(model: str | None = None, kv_tokens: int = 2048, *, threads: int | None = None,
                variants: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per engine (bargein for each of ``variants``, EngineConfig fields by name,
    then llama.cpp where llama_cpp imports), each with its peak, its import floor and the
    difference, in MB."""
    prompt, gguf_path = _prompt(model)
    rows = []
    torch_floor = _run(_FLOOR, "torch")["peak_mb"]
    for name, config in (VARIANTS if variants is None else variants).items():
        args = {"model": model, "kv_tokens": kv_tokens, "config": config, "threads": threads,
                "prompt": prompt, "answer": ANSWER_TOKENS}
        try:
            got = _run(_BARGEIN, json.dumps(args))
        except RuntimeError as exc:
            rows.append({"engine": name, "skipped": str(exc)})
            continue
        rows.append({"engine": name, **got, "floor_mb": torch_floor, "floor": "import torch",
                     "above_floor_mb": got["peak_mb"] - torch_floor,
                     "above_floor_kv_written_mb": got["peak_kv_written_mb"] - torch_floor})
    try:
        llama_floor = _run(_FLOOR, "llama_cpp")["peak_mb"]
    except RuntimeError as exc:
        rows.append({"engine": "llama.cpp", "skipped": f"llama_cpp is not importable ({exc})"})
        return rows
    if not gguf_path:
        rows.append({"engine": "llama.cpp", "skipped": "the model is not a GGUF file"})
        return rows
    args = {"path": gguf_path, "kv_tokens": kv_tokens, "threads": threads, "prompt": prompt, "answer": ANSWER_TOKENS}
    got = _run(_LLAMA, json.dumps(args))
    rows.append({"engine": "llama.cpp", **got, "floor_mb": llama_floor, "floor": "import llama_cpp",
                 "above_floor_mb": got["peak_mb"] - llama_floor})
    llama = rows[-1]["above_floor_mb"]
    for row in rows[:-1]:
        if "above_floor_mb" in row:
            row["above_floor_vs_llama_cpp"] = row["above_floor_mb"] / llama
            row["kv_written_vs_llama_cpp"] = row["above_floor_kv_written_mb"] / llama
    return rows


RSS_COLUMNS = ["engine", "skipped", "kv_tokens", "kv_cache_mb", "peak_mb", "floor", "floor_mb", "above_floor_mb",
               "above_floor_vs_llama_cpp", "above_floor_kv_written_mb", "kv_written_vs_llama_cpp", "after_load_mb",
               "load_s"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from common import base_parser, emit

    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--kv-tokens", type=int, default=2048, help="KV capacity of both (default %(default)s)")
    args = parser.parse_args(argv)
    rows = measure_rss(args.model, args.kv_tokens, threads=args.threads)
    result = {"benchmark": "rss", "kv_tokens": args.kv_tokens, "rss": rows}
    emit("Peak RSS, fresh processes", [rss_section(rows, args.kv_tokens)], result, args.json)
    return result


def rss_section(rows: list[dict[str, Any]], kv_tokens: int) -> tuple[str, str]:
    """The table's title and text, for a benchmark's report."""
    from common import format_table

    columns = [c for c in RSS_COLUMNS if any(c in r for r in rows)]
    return (f"Peak RSS after load + one request ({PROMPT_TOKENS} prompt + {ANSWER_TOKENS} tokens), KV capacity "
            f"{kv_tokens} tokens, each in a fresh process; above_floor = peak - the import floor's peak, MB",
            format_table(rows, columns))


if __name__ == "__main__":
    main()
