"""Model benchmark (issue 2): load time, prefill and decode throughput of the runner.

Measures, for the bundled model (or ``--model``) on this machine:

- load time of ``Engine.from_pretrained``;
- prefill tokens/s for one 512-token prompt (one forward);
- decode tokens/s for 1, 8 and 32 sequences in one batch (one token each per forward,
  at a fixed context length).

Each figure goes through the engine's own runner (``engine.runner.execute(plan)`` on
hand-built :class:`StepPlan` objects, so prefill and decode are timed apart and nothing
else runs), and side by side with a plain fp32 PyTorch forward of the same weights
(contiguous KV cache, no paging), interleaved repeat by repeat, so that the ratio holds
even on a busy machine. Figures are medians over repeats.

    python bench/bench_model.py [--quick] [--json PATH] [--threads N]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# The benchmarks share bench/common.py whether run as scripts or loaded by `bargein bench`.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import apply_threads, base_parser, emit, format_table, machine_info, median, timed  # noqa: E402
from rss import measure_rss, rss_section  # noqa: E402

from bargein import Engine
from bargein.config import EngineConfig
from bargein.engine.plan import ScheduledChunk, StepPlan


# -- plans for the engine's runner ------------------------------------------------------
class PlanMaker:
    """Hand-built plans over block ids of an otherwise idle engine (nothing else uses them)."""

    def __init__(self, engine: Engine):
        self.block_size = engine.pool.block_size
        self.num_blocks = engine.pool.num_blocks
        self.vocab = engine.model_config.vocab_size

    def tables(self, num_seqs: int, max_len: int) -> list[tuple[int, ...]]:
        per_seq = -(-max_len // self.block_size)
        if per_seq * num_seqs > self.num_blocks:
            raise ValueError(f"{num_seqs} sequences of {max_len} tokens need {per_seq * num_seqs} blocks; "
                             f"the pool has {self.num_blocks}")
        return [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]

    def tokens(self, n: int, seed: int = 0) -> tuple[int, ...]:
        g = torch.Generator().manual_seed(seed)
        return tuple(torch.randint(100, min(self.vocab, 20_000), (n,), generator=g).tolist())

    def prefill(self, prompt_len: int) -> StepPlan:
        table = self.tables(1, prompt_len)[0]
        return StepPlan(0, (ScheduledChunk("p0", self.tokens(prompt_len), 0, table, True),))

    def decode(self, tables: Sequence[tuple[int, ...]], position: int) -> StepPlan:
        chunks = tuple(ScheduledChunk(f"d{i}", (1000 + i,), position, t, True) for i, t in enumerate(tables))
        return StepPlan(0, chunks)


# -- a plain fp32 PyTorch forward of the same weights, as the yardstick ------------------
class DenseModel:
    """The textbook forward over the same weights: plain F.linear, contiguous K/V, no paging.

    It reads the checkpoint's canonical weights itself (the engine's layers may hold them
    pre-packed for a faster kernel), fusing Q/K/V and gate/up as any fast forward would.
    """

    def __init__(self, engine: Engine, ref: str | None):
        from bargein.loader import load_weights, resolve_model_ref

        (stage,) = engine.runner.stages
        self.stage = stage
        cfg = engine.model_config
        w = load_weights(resolve_model_ref(ref), cfg, progress=False)
        self.layers = [
            {"attn_norm": w[f"layers.{i}.attn_norm.weight"], "ffn_norm": w[f"layers.{i}.ffn_norm.weight"],
             "wqkv": torch.cat([w[f"layers.{i}.{n}.weight"] for n in ("wq", "wk", "wv")]),
             "bqkv": (torch.cat([w[f"layers.{i}.{n}.bias"] for n in ("wq", "wk", "wv")])
                      if cfg.attention_bias else None),
             "wo": w[f"layers.{i}.wo.weight"],
             "w13": torch.cat([w[f"layers.{i}.w1.weight"], w[f"layers.{i}.w3.weight"]]),
             "w2": w[f"layers.{i}.w2.weight"]}
            for i in range(cfg.num_layers)]
        self.embed = w["embed.weight"]
        self.norm = w["norm.weight"]
        self.lm_head = w["embed.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = self.stage.rope.cos[pos], self.stage.rope.sin[pos]  # (T, D), broadcast over (B, heads)
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    def alloc(self, batch: int, max_len: int) -> None:
        shape = (batch, self.kvh, max_len, self.d)
        self.caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in self.layers]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids (B, T) at positions start..start+T-1; returns logits of the last position (B, V)."""
        b, t = ids.shape
        pos = torch.arange(start, start + t)
        x = F.embedding(ids, self.embed)  # (B, T, hidden)
        q_size, kv_size = self.h * self.d, self.kvh * self.d
        for layer, (kc, vc) in zip(self.layers, self.caches, strict=True):
            qkv = F.linear(self._norm(x, layer["attn_norm"]), layer["wqkv"], layer["bqkv"])
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = self._rope(q.view(b, t, self.h, self.d).transpose(1, 2), pos)  # (B, H, T, D)
            k = self._rope(k.view(b, t, self.kvh, self.d).transpose(1, 2), pos)
            kc[:, :, start:start + t] = k
            vc[:, :, start:start + t] = v.view(b, t, self.kvh, self.d).transpose(1, 2)
            keys, values = kc[:, :, :start + t], vc[:, :, :start + t]
            o = F.scaled_dot_product_attention(q, keys, values, is_causal=t > 1 and start == 0, enable_gqa=True)
            x = x + F.linear(o.transpose(1, 2).reshape(b, t, q_size), layer["wo"])
            gate, up = F.linear(self._norm(x, layer["ffn_norm"]), layer["w13"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["w2"])
        return F.linear(self._norm(x[:, -1], self.norm), self.lm_head)


# -- measurements ---------------------------------------------------------------------
def _interleaved(ours: Callable[[], Any], dense: Callable[[], Any] | None, repeats: int, warmup: int,
                 budget_s: float) -> tuple[list[float], list[float]]:
    """Times ours and dense alternately, so both see the same machine load.

    Stops early (after at least two repeats) once ``budget_s`` seconds are spent, so a
    busy machine cannot stretch the run past its time limit.
    """
    started = time.perf_counter()
    for _ in range(warmup):
        ours()
        if dense is not None:
            dense()
    a: list[float] = []
    b: list[float] = []
    for i in range(repeats):
        a.append(timed(ours)[0])
        if dense is not None:
            b.append(timed(dense)[0])
        if i >= 1 and time.perf_counter() - started > budget_s:
            break
    return a, b


def bench_prefill(engine: Engine, dense: DenseModel | None, prompt_len: int, repeats: int,
                  budget_s: float) -> dict[str, Any]:
    maker = PlanMaker(engine)
    plan = maker.prefill(prompt_len)
    ids = torch.tensor([plan.chunks[0].token_ids])

    def ours() -> None:
        engine.runner.execute(plan)

    def ref() -> None:
        dense.alloc(1, prompt_len)
        dense.forward(ids, 0)

    times, dtimes = _interleaved(ours, None if dense is None else ref, repeats, 1, budget_s)
    return _row(f"prefill {prompt_len}", 1, prompt_len, prompt_len, times, dtimes)


def bench_decode(engine: Engine, dense: DenseModel | None, batch: int, context: int, steps: int,
                 budget_s: float) -> dict[str, Any]:
    maker = PlanMaker(engine)
    warmup = 2
    tables = maker.tables(batch, context + warmup + steps + 1)
    position = [context]
    ids = torch.tensor([[1000 + i] for i in range(batch)])
    dense_pos = [context]
    if dense is not None:
        dense.alloc(batch, context + warmup + steps + 1)

    def ours() -> None:
        engine.runner.execute(maker.decode(tables, position[0]))
        position[0] += 1

    def ref() -> None:
        dense.forward(ids, dense_pos[0])
        dense_pos[0] += 1

    times, dtimes = _interleaved(ours, None if dense is None else ref, steps, warmup, budget_s)
    return _row(f"decode x{batch}", batch, context, batch, times, dtimes)


def _row(name: str, batch: int, context: int, tokens_per_forward: int, times: list[float],
         dense_times: list[float]) -> dict[str, Any]:
    t = median(times)
    row: dict[str, Any] = {
        "case": name, "batch": batch, "context": context,
        "forward_ms": t * 1e3, "tok_s": tokens_per_forward / t, "repeats": len(times),
    }
    if dense_times:
        td = median(dense_times)
        row["dense_forward_ms"] = td * 1e3
        row["dense_tok_s"] = tokens_per_forward / td
        row["vs_dense"] = td / t
    return row


def bench_llama_cpp_prefill(engine: Engine, model_ref: str | None, prompt_len: int, threads: int,
                            repeats: int) -> dict[str, Any] | None:
    """llama.cpp evaluating the same prompt in one call (``Llama.eval`` of prompt_len
    tokens on a fresh context), where llama-cpp-python is installed; else None."""
    try:
        import llama_cpp  # type: ignore[import-not-found]
    except ImportError:
        return None
    from bargein.loader import resolve_model_ref

    llm = llama_cpp.Llama(str(resolve_model_ref(model_ref).path), n_ctx=2 * prompt_len, n_batch=prompt_len,
                          n_ubatch=prompt_len, n_threads=threads, n_threads_batch=threads, verbose=False)
    ids = PlanMaker(engine).prefill(prompt_len).chunks[0].token_ids
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        llm.reset()
        llm._ctx.kv_cache_clear()
        t0 = time.perf_counter()
        llm.eval(list(ids))
        times.append(time.perf_counter() - t0)
    t = median(times[1:])
    return {"case": f"llama.cpp prefill {prompt_len}", "batch": 1, "context": prompt_len, "forward_ms": t * 1e3,
            "tok_s": prompt_len / t, "repeats": repeats, "llama_cpp_version": getattr(llama_cpp, "__version__", "?")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=["exact", "fast"], default=EngineConfig.precision,
                        help="the engine's precision mode (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--context", type=int, default=256, help="context length of the decode cases")
    parser.add_argument("--case-budget", type=float, default=None,
                        help="seconds one case may take before it stops repeating (default 30; quick 8)")
    parser.add_argument("--no-dense", action="store_true", help="skip the plain PyTorch yardstick")
    parser.add_argument("--kv-tokens", type=int, default=2048, help="KV capacity of the RSS runs (default %(default)s)")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak RSS runs (fresh processes)")
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    quick = args.quick
    prefill_repeats, decode_steps = (2, 4) if quick else (3, 16)
    budget = args.case_budget or (8.0 if quick else 30.0)

    rss_rows = [] if args.no_rss else measure_rss(args.model, args.kv_tokens, threads=args.threads)
    load_s, engine = timed(lambda: Engine.from_pretrained(args.model, EngineConfig(precision=args.precision),
                                                          progress=False))
    dense = None if args.no_dense else DenseModel(engine, args.model)
    info = machine_info()
    print(f"loaded {engine.model_name} in {load_s:.1f}s; torch threads {info['torch_threads']}, "
          f"load average {info.get('loadavg_1m')}", flush=True)

    rows = []
    started = time.perf_counter()
    rows.append(bench_prefill(engine, dense, args.prompt_len, prefill_repeats, budget))
    print(f"  {rows[-1]['case']}: {rows[-1]['tok_s']:.0f} tok/s", flush=True)
    for batch in (1, 8, 32):
        rows.append(bench_decode(engine, dense, batch, args.context, decode_steps, budget))
        print(f"  {rows[-1]['case']}: {rows[-1]['tok_s']:.1f} tok/s", flush=True)
    llama = bench_llama_cpp_prefill(engine, args.model, args.prompt_len, info["torch_threads"], prefill_repeats)
    if llama is not None:
        print(f"  {llama['case']}: {llama['tok_s']:.0f} tok/s", flush=True)
        rows[0]["vs_llama_cpp"] = rows[0]["tok_s"] / llama["tok_s"]

    orientation = {"prefill 512": 1000.0, "decode x1": 35.0, "decode x32": 450.0}
    for row in rows:
        if row["case"] in orientation:
            row["target_tok_s"] = orientation[row["case"]]
    info["loadavg_1m_end"] = machine_info().get("loadavg_1m")
    result = {
        "benchmark": "model",
        "model": engine.model_name,
        "quick": quick,
        "load_s": load_s,
        "precision": args.precision,
        "prefill_tok_s": rows[0]["tok_s"],
        "decode_tok_s": {str(r["batch"]): r["tok_s"] for r in rows[1:]},
        "cases": rows,
        "llama_cpp_prefill": llama,
        "rss": rss_rows,
        "machine": info,
        "seconds": time.perf_counter() - started + load_s,
    }
    columns = ["case", "batch", "context", "forward_ms", "tok_s", "target_tok_s"]
    if dense is not None:
        columns += ["dense_tok_s", "vs_dense"]
    if llama is not None:
        columns.append("vs_llama_cpp")
    emit(f"bargein model benchmark ({engine.model_name}, precision {args.precision}, load {load_s:.1f}s)",
         [("Runner forward (median over repeats; vs_dense = our speed / plain PyTorch speed, "
           "measured interleaved; vs_llama_cpp = our prefill speed / llama.cpp's in this run)",
           format_table(rows + ([llama] if llama else []), columns))]
         + ([rss_section(rss_rows, args.kv_tokens)] if rss_rows else []),
         result, args.json)
    return result


if __name__ == "__main__":
    main()
