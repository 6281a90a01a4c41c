"""The kernels' exp (bargein/kernels/exp.h) over every float32: the same bits built for this
machine, as plain C and for ARM64 under qemu-aarch64, its error, and its vector bodies.

``make test`` checks a dense sample (tests/kernels/test_arm64_emulated.py: about 2.1 million
inputs); this runs all 2^32, in chunks over every core, with tests/kernels/arm64/exp_check.c
built three ways: ``native`` (-march=native: on x86-64 the AVX2 body exp256, fmaf an
instruction), ``plain`` (no -march: no vector body, fmaf from libm on x86-64) and ``arm64``
(cross-built for ARMv8.0, run under qemu on a Cortex-A57: the NEON body exp4_mirror; needs
gcc-aarch64-linux-gnu and qemu-user). Per build: the inputs run, the largest distance in
ulp from libm's double exp rounded to float, how many are more than 1 ulp off, where the
vector body gave other bits than the scalar function, and how many chunks hash the same as
``native``'s (every one must). Emulation is slow: the arm64 build takes about 20 CPU minutes
(``--quick``: every 257th float, seconds).

    python bench/bench_exp.py [--quick] [--json PATH] [--jobs N] [--no-arm64]
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, emit, format_table, machine_info  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bargein.kernels import build_flags  # noqa: E402

KERNELS = ROOT / "bargein" / "kernels"
EXP_CHECK = ROOT / "tests" / "kernels" / "arm64" / "exp_check.c"
CHUNKS = 64
FLAGS = [f for f in build_flags.COMMON_FLAGS if f not in ("-shared", "-fPIC")]


def builds(arm64: bool) -> dict[str, tuple[str, list[str], list[str]]]:
    """name -> (compiler, flags, the command that runs the program)."""
    cc = os.environ.get("CC", "cc")
    found = {"native": (cc, [*FLAGS, "-march=native"], []), "plain": (cc, FLAGS, [])}
    if arm64 and shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64"):
        found["arm64"] = ("aarch64-linux-gnu-gcc", [*FLAGS, build_flags.ARM64_BASE_MARCH],
                          ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", "-cpu", "cortex-a57"])
    return found


def run_chunk(command: list[str], stride: int, chunk: int) -> dict[str, str]:
    span = (1 << 32) // CHUNKS
    first = chunk * span
    # the chunk's first pattern on the stride's grid, so the chunks together run one grid
    first += (-first) % stride
    last = (chunk + 1) * span - 1
    done = subprocess.run([*command, str(stride), str(first), str(last)], check=True, capture_output=True, text=True)
    return dict(line.split("\t") for line in done.stdout.splitlines())


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="chunks run at once")
    parser.add_argument("--no-arm64", action="store_true", help="this machine's builds only")
    args = parser.parse_args()
    stride = 257 if args.quick else 1
    started = time.perf_counter()
    rows, chunk_hashes = [], {}
    with tempfile.TemporaryDirectory() as folder, concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for name, (cc, flags, runner) in builds(not args.no_arm64).items():
            binary = Path(folder) / f"exp_check-{name}"
            subprocess.run([cc, *flags, f"-I{KERNELS}", "-o", str(binary), str(EXP_CHECK), "-lm"], check=True)
            t0 = time.perf_counter()
            chunks = list(pool.map(lambda c, b=binary, r=runner: run_chunk([*r, str(b)], stride, c), range(CHUNKS)))
            chunk_hashes[name] = [c["hash"] for c in chunks]
            rows.append({"build": name, "vector": chunks[0]["vector"],
                         "inputs": sum(int(c["count"]) for c in chunks),
                         "max_ulp": max(int(c["max_ulp"]) for c in chunks),
                         "over_1_ulp": sum(int(c["over_one"]) for c in chunks),
                         "vector_mismatch": sum(int(c["vector_mismatch"]) for c in chunks),
                         "seconds": time.perf_counter() - t0})
    for row in rows:
        row["chunks_as_native"] = sum(a == b for a, b in zip(chunk_hashes[row["build"]], chunk_hashes["native"],
                                                              strict=True))
    info = machine_info()
    result = {"benchmark": "exp", "stride": stride, "chunks": CHUNKS, "builds": rows, "machine": info,
              "all_equal": all(r["chunks_as_native"] == CHUNKS and r["vector_mismatch"] == 0 for r in rows),
              "seconds": time.perf_counter() - started}
    title = f"bargein_expf over {'every float' if stride == 1 else f'every {stride}th float'} on {info['machine']}"
    emit(title, [(f"Per build ({CHUNKS} chunks; chunks_as_native must be {CHUNKS})",
                  format_table(rows, ["build", "vector", "inputs", "max_ulp", "over_1_ulp", "vector_mismatch",
                                      "chunks_as_native", "seconds"]))], result, args.json)
    if not result["all_equal"]:
        raise SystemExit("bench_exp: the builds' bits differ (see the table)")


if __name__ == "__main__":
    main()
