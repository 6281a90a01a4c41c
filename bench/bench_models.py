"""GGUF files side by side with llama.cpp (issue 33): load time, memory, decode and prefill.

For each GGUF file, bargein (in ``--precision``) and llama.cpp (llama-cpp-python, where
``import llama_cpp`` works) each run every measurement in a fresh process of its own, the
two sides' processes of one measurement back to back (seconds apart, so that a ratio
compares the two under the same load on the machine's memory):

- load: process start to the first token of a fixed prompt, minus the side's import floor
  (a process that only imports torch, for bargein, or llama_cpp), page cache warm (every
  file is read once before anything is timed: see ``--page-cache``); the median of ``--load-repeats`` (the
  floor's too). Python code starts from its compiled bytecode, as for every package an installer put in place
  (torch and llama_cpp included): bargein's sources are compiled to ``__pycache__`` first
  (``compileall``), since under ``PYTHONDONTWRITEBYTECODE`` a source checkout would
  otherwise compile its ~90 modules again at each start (~0.25 s of the bundled model's
  load on 2 cores). ``--no-bytecode`` times that case: bargein's ``__pycache__`` folders
  removed and none written;
- memory: peak RSS (VmHWM) over that side's processes above its import floor's, and the
  resident set at the end of the 1-stream run split into private (RssAnon) and file-backed
  (RssFile: mapped weights) pages;
- 1-stream and 32-stream decode tokens/s (greedy, ``--answer`` tokens after a 64-token
  prompt per stream; decode steps only);
- prefill tokens/s of one 512- and one 4,096-token prompt (after a short warm-up prompt).

Both sides get the same prompt token ids (bargein's tokenizer; llama.cpp reads the same
vocabulary from the file) and the same KV capacity in tokens for each measurement. Prints
a table and the JSON object, and writes the rows into ``docs/benchmarks.md`` (``--doc``),
replacing earlier rows of the same file and precision.

    python bench/bench_models.py [FILE.gguf ...] [--precision fast|exact] [--json PATH] [--quick]

``--rounds N`` runs every measurement N times on both sides, the order swapped each round:
on a VM whose host takes a share of its time, a file moves 20-25% between single runs on
either side (and the memory's speed by a third from one minute to the next), so each side's
value is then the median of its rounds and each ratio the median of the rounds' own ratios
(the JSON lists every round as ``NAME_rounds``).

``--page-cache read`` (the default) drops each file's pages from the page cache first (its
written pages written back; pages a process maps stay) and reads it again, so that both
sides run on the pages a file read from disk has: on Linux 6.18's ext4, 2 MB folios, which
a mapping gets on 2 MB pages, where a file written just before (as llama-quantize writes
its output) sits on the small pages of its writes until the kernel drops them, and a decode
step streams 4 KB pages 15-20% slower (both sides). ``as-is`` keeps what the cache holds.
Each row says the share of its file a mapping got on 2 MB pages (``page_cache_2mb``).

Any family bargein loads can be given; ``bench/make_family_gguf.py`` writes the random
1B-class Qwen3 and Gemma 3 Q4_K_M files (converted and quantized by llama.cpp's own tools)
of issue 25's side-by-side; the printed table and the JSON say each row's ``family`` (the
docs table keeps its columns, so rows measured before stay comparable).
"""

from __future__ import annotations

import datetime
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, emit, format_table, machine_info, run_fresh_python  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "public_domain.txt"
DOC = ROOT / "docs" / "benchmarks.md"
STREAM_PROMPT = 64
LOAD_PROMPT = 32

# Resident memory of the running process, MB (VmHWM: its peak), read without importing anything.
_STATUS = """
def memory():
    names = {"VmHWM": "peak_mb", "RssAnon": "anon_mb", "RssFile": "file_mb", "VmRSS": "rss_mb"}
    out = {}
    for line in open("/proc/self/status"):
        key, _, rest = line.partition(":")
        if key in names:
            out[names[key]] = int(rest.split()[0]) / 1024
    return out
"""

_FLOOR = _STATUS + """
import json, sys, time
args = json.loads(sys.argv[1])
__import__(args["module"])
print(json.dumps({"seconds": time.time() - args["launched"], **memory()}))
"""

_BARGEIN = _STATUS + """
import json, sys, time
args = json.loads(sys.argv[1])
import torch
if args["threads"]:
    torch.set_num_threads(args["threads"])
from bargein import CacheConfig, Engine, EngineConfig, SamplingParams
config = EngineConfig(precision=args["precision"], cache=CacheConfig(kv_tokens=args["kv_tokens"]),
                      max_model_len=args["kv_tokens"])
engine = Engine.from_pretrained(args["model"], config, progress=False)
prompts, out = args["prompts"], {}
def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
if args["kind"] == "load":
    engine.generate([prompts[0]], greedy(1))
    out["load_s"] = time.time() - args["launched"]
elif args["kind"] == "prefill":
    engine.generate([args["warmup"]], greedy(1))
    started = time.perf_counter()
    engine.generate([prompts[0]], greedy(1))
    out["tok_s"] = len(prompts[0]) / (time.perf_counter() - started)
else:
    sys.path.insert(0, args["bench"])  # not before the load: the load times bargein's imports only
    from common import drive_to_completion
    from bargein.engine.outputs import OutputCollector
    collector = OutputCollector(engine)
    engine.generate([args["warmup"]], greedy(1))
    started = time.perf_counter()
    ids = {collector.add_request(p, greedy(args["answer"])) for p in prompts}
    out["tok_s"] = drive_to_completion(collector.step, engine.abort, ids, started, 600).decode_tok_s
print(json.dumps({**out, **memory()}))
"""

_LLAMA = _STATUS + """
import json, sys, time
args = json.loads(sys.argv[1])
import numpy as np
import llama_cpp as lib
quiet = lib.llama_log_callback(lambda level, text, data: None)
lib.llama_log_set(quiet, None)
lib.llama_backend_init()
prompts, out = args["prompts"], {}
model = lib.llama_model_load_from_file(args["model"].encode(), lib.llama_model_default_params())
params = lib.llama_context_default_params()
params.n_ctx, params.n_seq_max = args["kv_tokens"], len(prompts) + 1
params.n_batch = max(512, sum(map(len, prompts)))
# One KV pool over all sequences, as bargein's: without it each sequence gets n_ctx / n_seq_max.
params.kv_unified = True
# llama.cpp's default is 4 threads whatever the machine: the same count as torch's instead.
params.n_threads = params.n_threads_batch = args["threads"] or args["cpu_threads"]
ctx = lib.llama_init_from_model(model, params)
n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
batch = lib.llama_batch_init(params.n_batch, 0, 1)
def decode(rows):  # (token, position, sequence, logits wanted)
    for i, (token, pos, seq, logits) in enumerate(rows):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, logits
    batch.n_tokens = len(rows)
    assert lib.llama_decode(ctx, batch) == 0
def greedy(index):
    return int(np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, index), shape=(n_vocab,)).argmax())
def prefill(prompt, seq):
    decode([(t, i, seq, i == len(prompt) - 1) for i, t in enumerate(prompt)])
    return greedy(len(prompt) - 1)
if args["kind"] == "load":
    prefill(prompts[0], 0)
    out["load_s"] = time.time() - args["launched"]
elif args["kind"] == "prefill":
    warm = len(prompts)  # the warm-up's own sequence
    prefill(args["warmup"], warm)
    started = time.perf_counter()
    prefill(prompts[0], 0)
    out["tok_s"] = len(prompts[0]) / (time.perf_counter() - started)
else:
    prefill(args["warmup"], len(prompts))
    decode([(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)])
    ends = [sum(map(len, prompts[:s + 1])) - 1 for s in range(len(prompts))]
    last = [greedy(e) for e in ends]
    started = time.perf_counter()
    for step in range(args["answer"] - 1):
        decode([(t, len(p) + step, s, True) for s, (t, p) in enumerate(zip(last, prompts))])
        last = [greedy(i) for i in range(len(prompts))]
    out["tok_s"] = len(prompts) * (args["answer"] - 1) / (time.perf_counter() - started)
print(json.dumps({**out, **memory()}))
"""


def exit_reason(code: int) -> str:
    """A child's nonzero exit code in words: its status, or the signal that killed it."""
    if code >= 0:
        return f"exit status {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def llama_failure(message: str, cpu_flags: frozenset[str] | None = None) -> str:
    """llama.cpp's failure, with the known cause where there is one: on CPUs with AMX
    (Sapphire Rapids and later Xeons) a llama.cpp built with ``GGML_NATIVE`` puts K-quant
    weights in ggml's AMX buffers, whose matmul segfaults on some of them (llama.cpp issue
    20824, open). ``cpu_flags``: /proc/cpuinfo's (default: this machine's)."""
    if "SIGSEGV" not in message:
        return message
    if cpu_flags is None:
        from bargein.kernels.build_flags import cpu_features
        cpu_flags = cpu_features()
    if "amx_int8" not in cpu_flags:
        return message
    return (f"{message} (on this AMX CPU, likely ggml's AMX matmul: llama.cpp issue 20824; build llama.cpp "
            "with GGML_NATIVE=OFF and the AMX options off, docs/benchmarks.md)")


def _run(script: str, args: dict[str, Any]) -> dict[str, Any]:
    """One fresh process of this tree (common.run_fresh_python); ``launched`` (wall clock)
    is set just before it starts."""
    extra_env = {} if args.get("bytecode", True) else {"PYTHONDONTWRITEBYTECODE": "1"}
    args = {**args, "launched": time.time()}
    result = run_fresh_python(script, [json.dumps(args)], timeout=1800, extra_env=extra_env)
    if result.returncode:
        lines = result.stderr.strip().splitlines()
        raise RuntimeError(lines[-1] if lines else exit_reason(result.returncode))
    return json.loads(result.stdout.strip().splitlines()[-1])


def _torch_threads() -> int:
    """The thread count bargein runs with when none is given (torch's default), for llama.cpp too."""
    import torch

    return torch.get_num_threads()


def text_ids(model: str, n: int) -> list[int]:
    """``n`` token ids of the public-domain text (repeated where it is shorter)."""
    from bargein.loader import load_tokenizer, resolve_model_ref

    ids = load_tokenizer(resolve_model_ref(model)).encode(TEXT.read_text(), add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def file_family(path: str) -> str:
    """The model family bargein reads the file as (qwen3, gemma3, llama, ...)."""
    from bargein.loader import load_config, resolve_model_ref

    return load_config(resolve_model_ref(path)).family


def measurements(ids: list[int], streams: int, answer: int, prefills: tuple[int, ...]) -> dict[str, dict[str, Any]]:
    """name -> the child's arguments (prompts, KV capacity), the same for both sides."""
    def stream_prompts(n: int) -> list[list[int]]:
        return [ids[i * 7:i * 7 + STREAM_PROMPT] for i in range(n)]

    plans: dict[str, dict[str, Any]] = {"load": {"kind": "load", "prompts": [ids[:LOAD_PROMPT]], "kv_tokens": 2048}}
    for n in sorted({1, streams}):
        plans[f"{n}_stream"] = {"kind": "decode", "prompts": stream_prompts(n), "answer": answer,
                                "kv_tokens": n * (STREAM_PROMPT + answer + 16) + 64}
    for length in prefills:
        plans[f"prefill_{length}"] = {"kind": "prefill", "prompts": [ids[-length:]],
                                      "kv_tokens": length + 64}
    for plan in plans.values():
        plan["warmup"] = ids[:16]
    return plans


def prepare_bytecode(compiled: bool) -> None:
    """bargein's sources compiled to ``__pycache__`` (``compiled``), or its ``__pycache__``
    folders removed, so that each start compiles the sources (see the module doc)."""
    if compiled:
        import compileall

        compileall.compile_dir(str(ROOT / "bargein"), quiet=1)
    else:
        for folder in (ROOT / "bargein").rglob("__pycache__"):
            shutil.rmtree(folder)


Side = tuple[str, str, str]  # (name, the child's script, the module its import floor imports)


def interleaved_round(sides: list[Side], plans: dict[str, dict[str, Any]], common: dict[str, Any],
                      load_repeats: int, failed: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Every measurement once per side, each a fresh process (see the module doc), the
    sides' runs of one measurement back to back in the order of ``sides``: a ratio then
    compares runs seconds apart, where a side's whole round took minutes (on these VMs the
    memory's speed moves by a third from one minute to the next: a ratio of runs minutes
    apart carried that). A side whose run fails gets its reason in ``failed`` and no more
    runs; the others go on. Returns each side's measurements that did not fail."""
    live = [side for side in sides if side[0] not in failed]

    def each(args_of: Callable[[Side], tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
        got = {}
        for side in list(live):
            script, args = args_of(side)
            try:
                got[side[0]] = _run(script, args)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                failed[side[0]] = llama_failure(str(exc)) if side[0] == "llama.cpp" else str(exc)
                live.remove(side)
        return got

    # The floor is as noisy as a load (an import of torch varies by ~0.2 s between
    # processes): the median of as many runs, so that one slow or fast floor does
    # not move the load by its own noise.
    floors = [each(lambda side: (_FLOOR, {"module": side[2]})) for _ in range(load_repeats)]
    loads = [each(lambda side: (side[1], {**common, **plans["load"]})) for _ in range(load_repeats)]
    runs = {name: each(lambda side, plan=plan: (side[1], {**common, **plan}))
            for name, plan in plans.items() if name != "load"}
    out = {}
    for name, _, _ in live:
        floor = {key: statistics.median(f[name][key] for f in floors) for key in ("seconds", "peak_mb")}
        seen = [r[name] for r in loads] + [r[name] for r in runs.values()]
        row: dict[str, Any] = {"load_s": statistics.median(r[name]["load_s"] for r in loads) - floor["seconds"]}
        for measure, got in runs.items():
            row[f"{measure}_tok_s"] = got[name]["tok_s"]
        if "1_stream" in runs:
            row["anon_mb"], row["file_mb"] = runs["1_stream"][name]["anon_mb"], runs["1_stream"][name]["file_mb"]
        row["peak_above_floor_mb"] = max(r["peak_mb"] for r in seen) - floor["peak_mb"]
        row["import_floor_s"], row["floor_mb"] = floor["seconds"], floor["peak_mb"]
        out[name] = row
    return out


# The measures a ratio row compares; for load and memory lower is better.
RATIO_KEYS = ("load_s", "peak_above_floor_mb")


def ratio_row(ours: list[dict[str, Any]], theirs: list[dict[str, Any]], base: dict[str, Any]) -> dict[str, Any]:
    """bargein / llama.cpp per measure: the median of the rounds' own ratios (each round ran
    both sides within the same minutes), with the rounds' ratios as ``NAME_rounds`` where
    there were several."""
    row = {**base, "side": "bargein / llama.cpp"}
    for key in ours[0]:
        if key.endswith("_tok_s") or key in RATIO_KEYS:
            ratios = [a[key] / b[key] for a, b in zip(ours, theirs, strict=True)]
            row[key] = statistics.median(ratios)
            if len(ratios) > 1:
                row[f"{key}_rounds"] = ratios
    return row


def warm_page_cache(path: str, *, read_again: bool) -> float:
    """Has ``path`` in the page cache (read once; with ``read_again`` its pages dropped first,
    see the module docstring) and returns the share of it a mapping gets on 2 MB pages."""
    import mmap
    import os

    from bargein.loader.huge_page_cache import file_huge_bytes

    with open(path, "rb") as f:
        if read_again:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        while f.read(1 << 24):
            pass
        stat = os.fstat(f.fileno())
        size, inode = stat.st_size, stat.st_ino
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        mapped.madvise(mmap.MADV_WILLNEED)
        sum(mapped[at] for at in range(0, size, mmap.PAGESIZE))  # mapped in, as a side's load maps it
        return file_huge_bytes({inode}) / size
    finally:
        mapped.close()


def bench_file(path: str, precision: str, *, threads: int | None, load_repeats: int, streams: int, answer: int,
               prefills: tuple[int, ...], llama: bool, bytecode: bool = True, rounds: int = 1,
               read_again: bool = True) -> list[dict[str, Any]]:
    """Rows for one file: bargein's, llama.cpp's (or why not), and their ratios.

    Each round runs every measurement on both sides back to back (interleaved_round), the
    order swapped each round (a machine that slows for a minute slows both sides): with
    ``rounds`` > 1 a side's value is the median of its rounds (each listed as
    ``NAME_rounds``), a ratio the median of the rounds' own ratios."""
    huge_share = warm_page_cache(path, read_again=read_again)  # the same pages for both sides
    prepare_bytecode(bytecode)
    family = file_family(path)
    ids = text_ids(path, max(prefills + (LOAD_PROMPT + STREAM_PROMPT * 2 + 7 * streams,)))
    plans = measurements(ids, streams, answer, prefills)
    sides: list[Side] = [("bargein", _BARGEIN, "torch")] + ([("llama.cpp", _LLAMA, "llama_cpp")] if llama else [])
    common = {"model": path, "threads": threads, "precision": precision, "bench": str(Path(__file__).parent),
              "cpu_threads": _torch_threads(), "bytecode": bytecode}
    results: dict[str, list[dict[str, Any]]] = {side: [] for side, _, _ in sides}
    failed: dict[str, str] = {}
    for number in range(rounds):
        got = interleaved_round(sides if number % 2 == 0 else sides[::-1], plans, common, load_repeats, failed)
        for side, measured in got.items():
            results[side].append(measured)
    base = {"file": Path(path).name, "family": family, "page_cache_2mb": round(huge_share, 3)}
    rows = []
    for side, _, _ in sides:
        row: dict[str, Any] = {**base, "side": side, "precision": precision if side == "bargein" else "-",
                               "bytecode": bytecode}
        if side in failed:
            row["skipped"] = failed[side]
        else:
            for key in results[side][0]:
                values = [r[key] for r in results[side]]
                row[key] = statistics.median(values)
                if rounds > 1:
                    row[f"{key}_rounds"] = values
        rows.append(row)
    if len(sides) == 2 and not failed:
        rows.append(ratio_row(results["bargein"], results["llama.cpp"], {**base, "precision": precision}))
    return rows


COLUMNS = ["file", "side", "precision", "skipped", "load_s", "peak_above_floor_mb", "anon_mb", "file_mb",
           "1_stream_tok_s", "32_stream_tok_s", "prefill_512_tok_s", "prefill_4096_tok_s"]
_BEGIN, _END = "<!-- bench_models: begin -->", "<!-- bench_models: end -->"


def write_doc(rows: list[dict[str, Any]], doc: Path, info: dict[str, Any]) -> None:
    """Puts ``rows`` into ``doc``'s bench_models table, replacing rows of the same file,
    side and precision (other files' rows stay)."""
    from common import fmt

    columns = [c for c in COLUMNS if c != "skipped"]
    key_of = {tuple(str(r.get(c, "-")) for c in columns[:3]) for r in rows}
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    kept: list[str] = []
    if _BEGIN in text:
        head, rest = text.split(_BEGIN, 1)
        old, tail = rest.split(_END, 1)
        for line in old.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("|") and len(cells) == len(columns) and cells[0] not in ("file", "---") \
                    and tuple(cells[:3]) not in key_of:
                kept.append(line)
    else:
        head, tail = text.rstrip() + "\n\n## GGUF files against llama.cpp (`bench/bench_models.py`)\n\n", "\n"
    new = ["| " + " | ".join(str(r.get(c, "-")) if i < 3 else fmt(r.get(c)) for i, c in enumerate(columns)) + " |"
           for r in rows if "skipped" not in r]
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *kept, *new]
    note = (f"Last run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {info.get('cpus')} CPUs "
            f"(load average {info.get('loadavg_1m')}); load in s above the import floor, memory in MB, "
            f"rates in tokens/s; ratio rows are bargein / llama.cpp.")
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(head + _BEGIN + "\n" + note + "\n\n" + "\n".join(table) + "\n" + _END + tail)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="GGUF files (default: the bundled model)")
    parser.add_argument("--precision", choices=("fast", "exact"), default="fast")
    parser.add_argument("--load-repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--answer", type=int, default=32, help="tokens per stream (default %(default)s)")
    parser.add_argument("--doc", default=str(DOC), help="the markdown file to update ('' for none)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run both sides this many times in turn, the order swapped each round; "
                             "medians of the rounds, ratios the median of the rounds' own ratios")
    parser.add_argument("--page-cache", choices=("read", "as-is"), default="read",
                        help="read: each file dropped from the page cache and read again first; as-is: as the "
                             "cache holds it (see the module doc)")
    parser.add_argument("--no-bytecode", action="store_true",
                        help="time bargein compiling its sources at each start (see the module doc)")
    args = parser.parse_args(argv)
    from bargein.loader import resolve_model_ref

    # Each side runs in a child process with its own working directory: absolute paths.
    files = [str(Path(f).resolve()) for f in args.files] or [str(resolve_model_ref(args.model).path)]
    prefills = (128,) if args.quick else (512, 4096)
    streams, answer = (4, 8) if args.quick else (args.streams, args.answer)
    try:
        import importlib.util

        llama = importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        llama = False
    if not llama:
        print("llama_cpp (llama-cpp-python) is not importable here: bargein's side only", file=sys.stderr)
    rows = []
    for path in files:
        rows += bench_file(path, args.precision, threads=args.threads, load_repeats=1 if args.quick else
                           args.load_repeats, streams=streams, answer=answer, prefills=prefills, llama=llama,
                           bytecode=not args.no_bytecode, rounds=1 if args.quick else args.rounds,
                           read_again=args.page_cache == "read")
    info = machine_info()
    result = {"benchmark": "models", "precision": args.precision, "machine": info, "rows": rows,
              "llama_cpp": llama}
    columns = ["family"] + [c for c in COLUMNS if any(c in r for r in rows)] + [
        c for c in sorted({k for r in rows for k in r}) if c not in COLUMNS and c.endswith("_tok_s")] + ["page_cache_2mb"]
    emit("GGUF files, bargein and llama.cpp side by side", [("one process per side per measurement",
                                                             format_table(rows, columns))], result, args.json)
    if args.doc and not args.quick:
        write_doc(rows, Path(args.doc), info)
    return result


if __name__ == "__main__":
    main()
