"""The `fast` prompt attention alone (bargein/kernels/attention_f16.c, issues 33 and 25): one
prefill of N tokens (default 4,096) through ``paged_attention_f16`` on one sequence, one
thread, for Llama-3.2-1B's layer shape (32 query heads, 8 KV heads, head dim 64) and
Gemma 3 1B's (4 query heads, 1 KV head, head dim 256; a global layer and a local one with a
512-token sliding window).

With ``--ab TREE`` the same measurement runs on another checkout's kernels too (its own
build, in its own kernel cache folder, a fresh process per measurement, the two trees
interleaved over ``--rounds``), and the table gives each tree's median seconds and the
ratio other / this (above 1: this tree is faster); the outputs are compared bit for bit.

    python bench/bench_prompt_attention.py [--tokens 4096] [--rounds 5] [--ab /work/main]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name: (query heads, KV heads, head dim, sliding window or 0)
SHAPES = {"llama1b": (32, 8, 64, 0), "gemma3-global": (4, 1, 256, 0), "gemma3-local": (4, 1, 256, 512)}
BLOCK_SIZE = 16


def measure(shape: str, tokens: int) -> dict:
    """One call's CPU seconds (the calling thread's: a shared machine's other work sways it
    less than wall time; best of two, after a warm-up) and a hash of its output, in this
    process, with the kernels of the tree first on ``sys.path``."""
    import torch

    from bargein.kernels.native import load_native_kernels

    kernels = load_native_kernels()
    heads, kv_heads, head_dim, window = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    blocks = -(-tokens // BLOCK_SIZE)
    k_cache, v_cache = (torch.randn(blocks, BLOCK_SIZE, kv_heads, head_dim, generator=g).half() for _ in range(2))
    tables = torch.randperm(blocks, generator=g).view(1, blocks)  # scattered, as a pool's blocks are
    q = torch.randn(tokens, heads, head_dim, generator=g)
    seq = torch.zeros(tokens, dtype=torch.int64)
    ctx = torch.arange(1, tokens + 1, dtype=torch.int64)

    def call():
        return kernels.paged_attention_f16(q, k_cache, v_cache, tables, seq, ctx, head_dim ** -0.5, 1,
                                           window=window or None)

    call()
    best = float("inf")
    for _ in range(2):
        start = time.thread_time()
        out = call()
        best = min(best, time.thread_time() - start)
    return {"seconds": best, "hash": hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16]}


def run_tree(tree: Path, cache: str, shape: str, tokens: int) -> dict:
    """measure() in a fresh process, with tree's bargein and kernel cache."""
    env = dict(os.environ, PYTHONPATH=str(tree), BARGEIN_CACHE_DIR=cache, OMP_NUM_THREADS="1")
    args = [sys.executable, str(Path(__file__).resolve()), "--child", shape, "--tokens", str(tokens)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--ab", type=Path, help="another checkout to time against this one")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.tokens)))
        return
    cache = os.environ.get("BARGEIN_CACHE_DIR", "/tmp/bargein_bench_this")
    trees = [("this", ROOT, cache)] + ([("other", args.ab.resolve(), cache + "_ab")] if args.ab else [])
    for shape in args.shapes.split(","):
        times: dict[str, list[float]] = {name: [] for name, _, _ in trees}
        hashes: dict[str, set[str]] = {name: set() for name, _, _ in trees}
        for r in range(args.rounds):
            for name, tree, folder in trees if r % 2 == 0 else trees[::-1]:
                result = run_tree(tree, folder, shape, args.tokens)
                times[name].append(result["seconds"])
                hashes[name].add(result["hash"])
        line = f"{shape:14s} tokens {args.tokens}: this {statistics.median(times['this']):.3f} s"
        if args.ab:
            ratio = [o / t for o, t in zip(times["other"], times["this"], strict=True)]
            line += (f", other {statistics.median(times['other']):.3f} s, other/this median "
                     f"{statistics.median(ratio):.3f} (rounds {', '.join(f'{x:.3f}' for x in ratio)}), "
                     f"same bits: {hashes['this'] == hashes['other']}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
