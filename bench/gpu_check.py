"""The GPU checks that scripts/gpu_check.sh runs, one part per subcommand.

    python bench/gpu_check.py info
    python bench/gpu_check.py parity    [--device cuda] [--json PATH]
    python bench/gpu_check.py attention [--device cuda] [--json PATH]

``parity``: writes a small random-weight model as a Hugging Face folder (config.json
and safetensors), loads it through bargein's loader straight onto the device, and
compares greedy answers of a batch of prompts with this machine's own CPU in float32:
CUDA float32 must give the same tokens; CUDA bfloat16 is compared teacher-forced (the
CPU's answer fed to both) against the tolerance stated in tests/engine/test_device.py: every
logit within ``BF16_TOL`` x the row's largest |logit| of the CPU's, and the same argmax
wherever the CPU's best token leads by more than twice that. CUDA graphs on and off are
compared the same way.

``attention``: decode attention over a paged bf16 cache at SmolLM2-135M's head shape,
PyTorch's gathered path (the engine's: gather each sequence's blocks, then SDPA)
against flex attention reading the blocks in place through a block mask built from the
block tables; both checked against each other and timed. This is the measurement
behind the choice of the engine's CUDA attention path.

Each prints what passed or failed and exits non-zero on a failure; ``--device cpu``
runs the same logic on the CPU (a dry run of the script).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from bench_gpu import IdTokenizer, random_weights  # noqa: E402

from bargein.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from bargein.engine.device import build_model, resolve_device  # noqa: E402
from bargein.engine.engine import Engine  # noqa: E402
from bargein.engine.sampling import SamplingParams  # noqa: E402
from bargein.kernels.ops import gathered_decode_attention  # noqa: E402
from bargein.model.attention import AttentionMetadata  # noqa: E402

BF16_TOL = 0.04  # the tolerance stated in tests/engine/test_device.py
PARITY_MODEL = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                           num_kv_heads=2, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=False,
                           name="parity-tiny")


# -- parity ------------------------------------------------------------------------------------
def write_hf_folder(folder: Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    from bargein.loader.names import wanted_tensors

    folder.mkdir(parents=True, exist_ok=True)
    names = wanted_tensors(config, 0, config.num_layers)
    save_file({names[canon][1]: t.contiguous() for canon, t in weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings}))


def load_engine(folder: Path, device: str, dtype: str, cuda_graphs: bool = True) -> tuple[Engine, float]:
    """The folder through bargein's loader onto ``device``; returns the engine and the
    growth of this process's peak host memory (MB) while loading."""
    from bargein.engine.device import resolve_dtype
    from bargein.loader import load_config, load_weights, resolve_model_ref

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    config = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=512),
                          scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
                          device=device, dtype=dtype, cuda_graphs=cuda_graphs)
    source = resolve_model_ref(str(folder))
    model_config = load_config(source)
    target = resolve_device(device)
    weights = load_weights(source, model_config, dtype=resolve_dtype(dtype, target), device=target, progress=False)
    model = build_model(model_config, weights, config)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    engine = Engine(model, IdTokenizer(model_config.vocab_size), config, model_name="parity")
    if cuda_graphs and engine.runner.decode_graphs is None:
        # No CUDA here: the same padded decode path, run eagerly (a dry run of its logic).
        engine.runner.decode_graphs = engine.runner.padded_decode(config.cuda_graph_batch_sizes, capture=False)
    return engine, grown


def sequence_logits(engine: Engine, tokens: list[int]) -> torch.Tensor:
    """Logits (T, vocab) at every position of one sequence, in one forward, on the CPU."""
    model = engine.runner.stages[0]
    block = 16
    n = -(-len(tokens) // block)
    caches = model.make_kv_caches(n, block)
    meta = AttentionMetadata.build(block_tables=[list(range(n))], query_lens=[len(tokens)],
                                   context_lens=[len(tokens)], block_size=block, device=model.device)
    positions = torch.arange(len(tokens), device=model.device)
    out = model(torch.tensor(tokens, device=model.device), positions, meta, caches, logits_indices=positions)
    return out.float().cpu()


def compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, Any]:
    """Deviation relative to each row's largest |logit|, and argmax agreement where clear."""
    row_max = want.abs().amax(-1, keepdim=True)
    rel = ((got - want).abs() / row_max).amax().item()
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * BF16_TOL * row_max.squeeze(-1)
    agree = (got.argmax(-1) == want.argmax(-1))
    return {"max_rel_dev": rel, "clear_positions": int(clear.sum()), "clear_disagree": int((~agree & clear).sum()),
            "argmax_agree_all": float(agree.float().mean())}


def parity(args: argparse.Namespace) -> int:
    device = args.device
    weights = random_weights(PARITY_MODEL, torch.device("cpu"), torch.float32, seed=7)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, PARITY_MODEL.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 40, 90, 150, 7)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    result: dict[str, Any] = {"device": device, "prompts": [len(p) for p in prompts], "max_tokens": args.max_tokens}
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "parity-tiny"
        write_hf_folder(folder, PARITY_MODEL, weights)
        cpu, _ = load_engine(folder, "cpu", "float32", cuda_graphs=False)
        want = [list(o.token_ids) for o in cpu.generate(prompts, params)]
        cpu.check_block_accounting()
        references = [sequence_logits(cpu, p + a) for p, a in zip(prompts, want, strict=True)]
        for dtype, graphs in (("float32", True), ("bfloat16", True), ("bfloat16", False), ("float32", False)):
            name = f"{device} {dtype} graphs {'on' if graphs else 'off'}"
            started = time.perf_counter()
            engine, host_mb = load_engine(folder, device, dtype, graphs)
            got = [list(o.token_ids) for o in engine.generate(prompts, params)]
            engine.check_block_accounting()
            same = sum(a == b for a, b in zip(got, want, strict=True))
            dev = [compare(sequence_logits(engine, p + a), ref)
                   for p, a, ref in zip(prompts, want, references, strict=True)]
            worst = max(d["max_rel_dev"] for d in dev)
            disagree = sum(d["clear_disagree"] for d in dev)
            replays = engine.runner.decode_graphs.replays if engine.runner.decode_graphs is not None else 0
            row = {"case": name, "same_greedy_sequences": f"{same}/{len(prompts)}", "max_rel_logit_dev": worst,
                   "clear_argmax_disagreements": disagree, "graph_replays": replays,
                   "host_peak_growth_mb": host_mb, "seconds": time.perf_counter() - started}
            if dtype == "float32":
                ok = same == len(prompts) and worst < 1e-3
            else:
                ok = worst <= BF16_TOL and disagree == 0
            row["ok"] = ok
            if not ok:
                failures.append(name)
            result.setdefault("cases", []).append(row)
            print(("PASS " if ok else "FAIL ") + json.dumps(row), flush=True)
            del engine
    result["failures"] = failures
    _write(args.json, result)
    print(f"parity: {'PASS' if not failures else 'FAIL: ' + ', '.join(failures)}", flush=True)
    return 1 if failures else 0


# -- attention --------------------------------------------------------------------------------
def _time_ms(fn, device: torch.device, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) * 1e3 / repeats


def flex_block_mask(b: int, num_blocks: int, bs: int, tables: torch.Tensor, ctx: torch.Tensor) -> Any:
    """The block mask of B decode queries over a paged cache read in place: the whole
    cache is one long key sequence (batch 1, broadcast over the queries) and each
    query's row lists its own blocks, the last one cut at its context length. Built once
    per step; every layer shares it."""
    from torch.nn.attention.flex_attention import BlockMask

    used = (ctx + bs - 1) // bs  # (B,)
    last_block = tables.gather(1, (used - 1).unsqueeze(1)).squeeze(1)
    last_len = ctx - (used - 1) * bs
    # Which physical blocks each query may read (the block mask skips the others; the
    # mask_mod must say so too, for the positions inside listed blocks and for eager runs).
    owned = torch.zeros(b, num_blocks, dtype=torch.bool, device=tables.device)
    in_table = torch.arange(tables.shape[1], device=tables.device)[None, :] < used[:, None]
    owned.scatter_(1, tables, in_table)

    def mask_mod(bi, hi, qi, ki):
        block = ki // bs
        return owned[bi, block] & ((block != last_block[bi]) | (ki % bs < last_len[bi]))

    # kv_indices spans every KV block of the (whole-cache) key sequence; the first
    # kv_num_blocks entries of a row are the ones read.
    indices = torch.zeros(b, num_blocks, dtype=torch.int32, device=tables.device)
    indices[:, :tables.shape[1]] = tables.to(torch.int32)
    return BlockMask.from_kv_blocks(used.to(torch.int32).view(b, 1, 1), indices.view(b, 1, 1, num_blocks),
                                    BLOCK_SIZE=(128, bs), mask_mod=mask_mod, seq_lengths=(1, num_blocks * bs))


def flex_decode_attention(flex, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: Any,
                          kernel_options: dict | None) -> torch.Tensor:
    """Decode attention q (B, H, D) through ``flex`` and a :func:`flex_block_mask`."""
    num_blocks, bs, kvh, d = k_cache.shape
    keys = k_cache.view(num_blocks * bs, kvh, d).permute(1, 0, 2).unsqueeze(0)  # (1, KVH, N*bs, D)
    values = v_cache.view(num_blocks * bs, kvh, d).permute(1, 0, 2).unsqueeze(0)
    out = flex(q.unsqueeze(2), keys, values, block_mask=mask, enable_gqa=True, kernel_options=kernel_options)
    return out.squeeze(2)


def _attention_case(flex: Any, device: torch.device, dtype: torch.dtype, bs: int, b: int, ctx_len: int,
                    g: torch.Generator, failures: list[str]) -> dict[str, Any]:
    """One (block size, batch) case: the gathered path against flex attention, timed."""
    h, kvh, d = 9, 3, 64  # SmolLM2-135M's heads
    per_seq = -(-ctx_len // bs)
    num_blocks = b * per_seq + 8
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=g, device=device).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=g, device=device).to(dtype)
    order = torch.randperm(num_blocks, generator=g, device=device)[:b * per_seq]
    tables = order.view(b, per_seq).to(torch.int64)
    ctx = torch.randint(ctx_len // 2, ctx_len + 1, (b,), generator=g, device=device)
    q = torch.randn(b, h, d, generator=g, device=device).to(dtype)
    key_pos = torch.arange(per_seq * bs, device=device)
    mask = torch.where(key_pos[None, :] < ctx[:, None], 0.0, float("-inf"))[:, None, None, :]
    want = gathered_decode_attention(q, k_cache, v_cache, tables, mask)
    row: dict[str, Any] = {"block_size": bs, "batch": b, "context": ctx_len,
                           "gathered_sdpa_ms": _time_ms(
                               lambda: gathered_decode_attention(q, k_cache, v_cache, tables, mask), device)}
    started = time.perf_counter()
    block_mask = flex_block_mask(b, num_blocks, bs, tables, ctx)
    row["flex_mask_first_s"] = time.perf_counter() - started
    row["flex_mask_ms"] = _time_ms(lambda: flex_block_mask(b, num_blocks, bs, tables, ctx), device, 5)
    for label, options in (("flex", None), ("flex_blockn16", {"BLOCK_N": 16})):
        if label != "flex" and "flex_error" not in row:
            continue  # the other kernel options only where the defaults failed
        try:
            started = time.perf_counter()
            got = flex_decode_attention(flex, q, k_cache, v_cache, block_mask, options)
            row[f"{label}_first_call_s"] = time.perf_counter() - started
            row[f"{label}_max_abs_diff"] = (got.float() - want.float()).abs().max().item()
            row[f"{label}_ms"] = _time_ms(
                lambda o=options: flex_decode_attention(flex, q, k_cache, v_cache, block_mask, o), device)
            if row[f"{label}_max_abs_diff"] > (2e-2 if dtype == torch.bfloat16 else 1e-4):
                failures.append(f"{label} bs={bs} B={b} differs by {row[f'{label}_max_abs_diff']:.3g}")
        except Exception as exc:  # a measurement, not a contract: report and go on
            row[f"{label}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return row


def attention(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
    batches = [32, 256] if device.type == "cuda" else [1, 3]
    ctx_len = 512 if device.type == "cuda" else 37
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    g = torch.Generator(device=device).manual_seed(0)
    for bs in (16,) if device.type == "cuda" else (16, 64):  # each shape costs a compile on CUDA
        for b in batches:
            row = _attention_case(flex, device, dtype, bs, b, ctx_len, g, failures)
            rows.append(row)
            print(json.dumps(row), flush=True)
            _write(args.json, {"device": str(device), "dtype": str(dtype), "rows": rows, "failures": failures})
    _write(args.json, {"device": str(device), "dtype": str(dtype), "rows": rows, "failures": failures})
    print(f"attention: {'PASS' if not failures else 'FAIL: ' + '; '.join(failures)}", flush=True)
    return 1 if failures else 0


# -- info ------------------------------------------------------------------------------------
def info(args: argparse.Namespace) -> int:
    """Versions, the GPU, and which of the project's packages this machine has."""
    import importlib.util
    import platform

    print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
          "cuda available", torch.cuda.is_available())
    if torch.cuda.is_available():
        print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0),
              f"memory {torch.cuda.get_device_properties(0).total_memory / 1024**3:.0f} GiB")
    for name in ("gguf", "safetensors", "tokenizers", "jinja2", "pytest", "hypothesis", "fastapi", "triton"):
        print(f"  {name}: {'present' if importlib.util.find_spec(name) else 'MISSING'}")
    return 0


def _write(path: str | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("info", "parity", "attention"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    return {"info": info, "parity": parity, "attention": attention}[args.part](args)


if __name__ == "__main__":
    sys.exit(main())
