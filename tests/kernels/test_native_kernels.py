"""The native decode-attention kernel against PyTorch's attention, and its fallbacks."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.nn.functional as F

from bargein.kernels import native
from bargein.kernels.native import NativeKernelError, load_native_kernels
from bargein.kernels.ops import KernelSet, resolve_kernels
from bargein.model.attention import AttentionMetadata, KVCache, paged_attention
from tests.dense_reference import random_weights
from tests.model.test_model import CONFIGS, PagedRunner, tokens

KERNELS = load_native_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler here; the fallback is tested below")


def reference(q: torch.Tensor, cache: KVCache, tables: list[list[int]], ctx_lens: list[int]) -> torch.Tensor:
    """Plain SDPA over each sequence's keys, gathered by hand, in float64."""
    block_size = cache.k.shape[1]
    out = []
    for i, (table, ctx) in enumerate(zip(tables, ctx_lens, strict=True)):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        k = cache.k.flatten(0, 1)[slots].transpose(0, 1).double()  # (KVH, ctx, D)
        v = cache.v.flatten(0, 1)[slots].transpose(0, 1).double()
        out.append(F.scaled_dot_product_attention(q[i].double().unsqueeze(1), k, v, enable_gqa=True).squeeze(1))
    return torch.stack(out).float()


def random_case(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, ctx_lens: list[int],
                seed: int) -> tuple[torch.Tensor, KVCache, list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(per_seq) + 3
    cache = KVCache(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g),
                    torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g))
    order = torch.randperm(num_blocks, generator=g).tolist()  # blocks scattered over the pool
    tables, used = [], 0
    for n in per_seq:
        tables.append(order[used:used + n])
        used += n
    q = torch.randn(len(ctx_lens), num_heads, head_dim, generator=g) * 2
    return q, cache, tables


@needs_kernels
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [
    (9, 3, 64),  # SmolLM2-135M: groups of 3
    (8, 2, 16),  # groups of 4: exactly one pass
    (10, 2, 32),  # groups of 5: a full pass and a pass of one
    (4, 4, 8),  # no grouping
    (6, 2, 12),  # head_dim not a multiple of 8: the portable loop
])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_matches_reference(num_heads: int, num_kv_heads: int, head_dim: int, threads: int) -> None:
    ctx_lens = [1, 4, 5, 16, 37, 3, 64, 17]  # ragged, on and off block boundaries
    q, cache, tables = random_case(num_heads, num_kv_heads, head_dim, 4, ctx_lens, seed=head_dim + threads)
    meta = AttentionMetadata.build(block_tables=tables, query_lens=[1] * len(ctx_lens), context_lens=ctx_lens,
                                   block_size=4)
    got = KERNELS.paged_decode_attention(q, cache.k, cache.v, meta.decode_block_tables, meta.decode_context_lens,
                                         head_dim ** -0.5, threads)
    want = reference(q, cache, tables, ctx_lens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_kernel_handles_extreme_scores() -> None:
    """Scores hundreds apart (softmax underflows to exact zeros) still give the reference."""
    q, cache, tables = random_case(4, 2, 16, 4, [30, 9], seed=7)
    q = q * 60
    meta = AttentionMetadata.build(block_tables=tables, query_lens=[1, 1], context_lens=[30, 9], block_size=4)
    got = KERNELS.paged_decode_attention(q, cache.k, cache.v, meta.decode_block_tables, meta.decode_context_lens,
                                         0.25, 2)
    torch.testing.assert_close(got, reference(q, cache, tables, [30, 9]), rtol=1e-4, atol=1e-4)
    assert torch.isfinite(got).all()


@needs_kernels
def test_paged_attention_native_equals_torch_path_in_a_mixed_batch() -> None:
    """Decodes through the kernel, a prompt chunk through SDPA: same output as all-PyTorch."""
    q_lens, ctx_lens = [1, 6, 1, 1], [9, 6, 1, 23]
    num_heads, num_kv_heads, head_dim = 6, 2, 16
    _, cache, tables = random_case(num_heads, num_kv_heads, head_dim, 4, ctx_lens, seed=3)
    g = torch.Generator().manual_seed(4)
    t = sum(q_lens)
    q = torch.randn(t, num_heads, head_dim, generator=g)
    k = torch.randn(t, num_kv_heads, head_dim, generator=g)
    v = torch.randn(t, num_kv_heads, head_dim, generator=g)
    meta = AttentionMetadata.build(block_tables=tables, query_lens=q_lens, context_lens=ctx_lens, block_size=4)
    torch_cache = KVCache(cache.k.clone(), cache.v.clone())
    got = paged_attention(q, k, v, cache, meta, KernelSet(KERNELS))
    want = paged_attention(q, k, v, torch_cache, meta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache.k, torch_cache.k) and torch.equal(cache.v, torch_cache.v)


@needs_kernels
def test_model_logits_same_with_and_without_kernels() -> None:
    """A whole model: prompt then decodes, native kernels on and off, to float32 rounding."""
    config = CONFIGS["gqa-tied"]
    w = random_weights(config)
    with_kernels = PagedRunner([native_stage(config, w, True)])
    without = PagedRunner([native_stage(config, w, False)])
    prompt = tokens(11, seed=5)
    for runner in (with_kernels, without):
        runner.run([(0, prompt, 0), (1, prompt[:3], 0)])
    for step in range(6):
        chunks = [(0, [step + 1], 11 + step), (1, [step + 2], 3 + step)]
        a, b = with_kernels.run(chunks), without.run(chunks)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def native_stage(config, weights, use: bool):
    from bargein.model.llama import LlamaStage

    return LlamaStage(config, weights, kernels=resolve_kernels("cpu", native=use))


@needs_kernels
def test_kernel_refuses_tensors_outside_its_contract() -> None:
    q, cache, tables = random_case(4, 2, 16, 4, [5], seed=1)
    meta = AttentionMetadata.build(block_tables=tables, query_lens=[1], context_lens=[5], block_size=4)
    args = (meta.decode_block_tables, meta.decode_context_lens, 0.25, 1)
    with pytest.raises(NativeKernelError, match="float32"):
        KERNELS.paged_decode_attention(q.double(), cache.k, cache.v, *args)
    with pytest.raises(NativeKernelError, match="contiguous"):
        KERNELS.paged_decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), cache.k, cache.v, *args)
    with pytest.raises(NativeKernelError, match="shapes"):
        KERNELS.paged_decode_attention(q[:, :, :8].contiguous(), cache.k, cache.v, *args)
    with pytest.raises(NativeKernelError, match="int64"):
        KERNELS.paged_decode_attention(q, cache.k, cache.v, args[0].int(), args[1], 0.25, 1)


def test_metadata_refuses_a_table_too_short_for_its_context() -> None:
    with pytest.raises(ValueError, match="cannot use a table of 1 blocks of 4"):
        AttentionMetadata.build(block_tables=[[0]], query_lens=[1], context_lens=[5], block_size=4)


@pytest.fixture
def fresh_loader():
    """load_native_kernels() remembers its answer; these tests need it asked anew, then forgotten."""
    load_native_kernels.cache_clear()
    yield load_native_kernels
    load_native_kernels.cache_clear()


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch, fresh_loader) -> None:
    monkeypatch.setenv("BARGEIN_NATIVE_KERNELS", "0")
    assert fresh_loader() is None


def test_no_compiler_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch, fresh_loader,
                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(native, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert fresh_loader() is None
    assert "no C compiler found" in caplog.text


def test_failed_build_falls_back_with_the_compiler_output(monkeypatch: pytest.MonkeyPatch, tmp_path, fresh_loader,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    bad = tmp_path / "broken.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(native, "_SOURCES", (bad,))
    monkeypatch.setenv("BARGEIN_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert fresh_loader() is None
    assert "building the native kernels failed" in caplog.text
    assert "error" in caplog.text  # the compiler's own message is passed on
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))  # no half-built library left


def test_portable_build_when_the_cpu_flag_is_refused(portable_kernels: native.NativeKernels) -> None:
    """A compiler that refuses -march=native (and, here, OpenMP) still gets a library: the
    portable C code on bargein's own thread pool, which also serves concurrent callers.
    (The build cache itself is tested end to end, with a tiny source, in
    test_native_build_cache.py.)"""
    kernels = portable_kernels
    ctx_lens = [3, 21, 8]
    q, cache, tables = random_case(6, 2, 16, 4, ctx_lens, seed=11)
    meta = AttentionMetadata.build(block_tables=tables, query_lens=[1] * 3, context_lens=ctx_lens, block_size=4)
    want = reference(q, cache, tables, ctx_lens)
    failures: list[int] = []

    def call(i: int) -> None:
        for threads in (1, 2, 3) * 10:
            got = kernels.paged_decode_attention(q, cache.k, cache.v, meta.decode_block_tables,
                                                 meta.decode_context_lens, 0.25, threads)
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                failures.append(i)

    callers = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=60)
    assert not failures and not any(t.is_alive() for t in callers)


def test_unwritable_cache_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch, tmp_path, fresh_loader,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    if native._compiler() is None:
        pytest.skip("no C compiler here")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("BARGEIN_CACHE_DIR", str(blocker))  # kernels/ cannot be made under a file
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert fresh_loader() is None
    assert "native kernels are unavailable" in caplog.text
