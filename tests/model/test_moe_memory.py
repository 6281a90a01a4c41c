"""An MoE's experts stay in the mapped file: read in place, never copied, and only the
experts tokens choose are ever read.

A Qwen3-MoE GGUF with Q8_0 experts (8 of them, ~0.8 MB each per layer) is written here;
its router is zero, so every token chooses experts 0 and 1 (a tie goes to the lower
expert in ``fast``'s routing). Then the pages of experts 0 and 1 are all mapped into this
process, those of experts 4-6 none (/proc/self/pagemap's present bit, the file read cold
without readahead: the kernel maps a few pages around a fault, so the neighbours of what
was read, experts 2-3 and 7, are not judged), and the file's resident bytes (its mappings' Rss in /proc/self/smaps) grow by
about two experts' worth, not eight; with a random router every expert is read. The memory plan counts
every expert as mapped, and states the parameters, total and active per token. All of
this holds under ``weights_memory="private"`` (and the default "auto") too, which makes the
dense blocks' pages private memory in the background but leaves the experts in the file's pages.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from bargein.config import EngineConfig
from bargein.engine.device import build_model
from bargein.kernels.native import load_native_kernels
from bargein.kernels.quant_weight import QuantWeight
from bargein.loader import (
    load_config,
    load_weights,
    private_copy_of,
    resolve_model_ref,
    wait_private_copies,
)
from bargein.loader.file_maps import file_span, shared_file_maps
from bargein.loader.gguf_file import open_gguf
from bargein.loader.memory_plan import plan_memory
from bargein.loader.parameters import parameter_counts
from bargein.model.attention import AttentionMetadata
from bargein.model.moe import MoEFeedForward

pytestmark = pytest.mark.skipif(load_native_kernels() is None, reason="the fast precision needs the native kernels")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, EXPERTS, TOPK, EXPERT_FF, VOCAB = 256, 4, 2, 64, 2, 8, 2, 1024, 128
Q8 = gguf.GGMLQuantizationType.Q8_0
EXPERT_BYTES = 3 * EXPERT_FF * HIDDEN // 32 * 34  # one expert's gate, up and down in Q8_0, one layer
ATTENTION_BYTES = (2 * HEADS + 2 * KV_HEADS) * HEAD_DIM * HIDDEN // 32 * 34  # q, k, v, o in Q8_0, one layer


def _write(path: Path) -> None:
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(LAYERS)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(EXPERT_FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(TOPK)
    w.add_expert_feed_forward_length(EXPERT_FF)
    w.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    w.add_tensor("output.weight", rand(VOCAB, HIDDEN))
    for i in range(LAYERS):
        b = f"blk.{i}."
        for name, shape in (("attn_q", (HEADS * HEAD_DIM, HIDDEN)), ("attn_k", (KV_HEADS * HEAD_DIM, HIDDEN)),
                            ("attn_v", (KV_HEADS * HEAD_DIM, HIDDEN)), ("attn_output", (HIDDEN, HEADS * HEAD_DIM))):
            w.add_tensor(b + name + ".weight", gguf.quants.quantize(rand(*shape), Q8), raw_dtype=Q8)
        for name, n in (("attn_norm", HIDDEN), ("ffn_norm", HIDDEN), ("attn_q_norm", HEAD_DIM),
                        ("attn_k_norm", HEAD_DIM)):
            w.add_tensor(b + name + ".weight", np.ones(n, np.float32))
        w.add_tensor(b + "ffn_gate_inp.weight", np.zeros((EXPERTS, HIDDEN), np.float32))
        for name, shape in (("ffn_gate_exps", (EXPERTS, EXPERT_FF, HIDDEN)), ("ffn_up_exps", (EXPERTS, EXPERT_FF, HIDDEN)),
                            ("ffn_down_exps", (EXPERTS, HIDDEN, EXPERT_FF))):
            w.add_tensor(b + name + ".weight", gguf.quants.quantize(rand(*shape), Q8), raw_dtype=Q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _resident(path: Path) -> int:
    """Bytes of ``path``'s mappings resident in this process."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if not line[0].isupper() or ":" not in line.split()[0]:  # a mapping's header line
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def _mapped_pages(path: Path, stage) -> dict[int, float]:
    """Expert e -> the share of its slices' pages (all its matrices, every layer) mapped here."""
    f = open_gguf(path)
    base = f.mapped().ctypes.data
    present, pages = dict.fromkeys(range(EXPERTS), 0), dict.fromkeys(range(EXPERTS), 0)
    with open("/proc/self/pagemap", "rb") as pagemap:
        for i in range(LAYERS):
            for kind in ("gate", "up", "down"):
                info = f.tensors[f"blk.{i}.ffn_{kind}_exps.weight"]
                per = info.n_bytes // EXPERTS
                for e in range(EXPERTS):
                    first = (base + info.data_offset + e * per + 4095) // 4096  # whole pages inside it
                    last = (base + info.data_offset + (e + 1) * per) // 4096
                    pagemap.seek(first * 8)
                    entries = np.frombuffer(pagemap.read((last - first) * 8), dtype=np.uint64)
                    present[e] += int((entries >> np.uint64(63)).sum())
                    pages[e] += last - first
    return {e: present[e] / pages[e] for e in range(EXPERTS)}


def _cold(path: Path) -> None:
    """Drop ``path``'s pages from the page cache. The kernel maps a whole large folio of the
    page cache on a fault (Linux 6.x), so pages cached beside what was read would count as
    mapped; read cold with :func:`_random_access`, each fault brings in its own page only."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _random_access(path: Path) -> None:
    """No readahead on the loader's mapping of ``path`` (MADV_RANDOM)."""
    mapped = open_gguf(path).mapped()
    libc = ctypes.CDLL(None, use_errno=True)
    start = mapped.ctypes.data // mmap.PAGESIZE * mmap.PAGESIZE
    length = mapped.ctypes.data + mapped.nbytes - start
    assert libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), 1) == 0  # MADV_RANDOM


def _in_file(weight: QuantWeight, path: Path) -> bool:
    """Whether all of ``weight``'s blocks lie in a mapping of ``path``."""
    data = weight.segments[0].data
    span = file_span(data.data_ptr(), data.nbytes, shared_file_maps())
    return span is not None and Path(span.path) == path


def _forward(stage, tokens: int, seed: int) -> None:
    caches = stage.make_kv_caches(tokens // 4 + 1, 4)
    meta = AttentionMetadata.build(block_tables=[list(range(tokens // 4 + 1))], query_lens=[tokens],
                                   context_lens=[tokens], block_size=4, decode_batch=False)
    ids = torch.randint(0, VOCAB, (tokens,), generator=torch.Generator().manual_seed(seed))
    stage(ids, torch.arange(tokens), meta, caches)


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    """A file of each test's own: its pages are read cold, and none are mapped by another test."""
    path = tmp_path / "experts-q8.gguf"
    _write(path)
    return path


@pytest.mark.parametrize("private", [False, True], ids=["mapped", "private"])
def test_only_the_chosen_experts_are_read(model_file: Path, private: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Under either weights memory: ``private`` (the default) copies the dense blocks and
    leaves the experts in the file's pages."""
    source = resolve_model_ref(str(model_file))
    config = load_config(source)
    _cold(model_file)
    caplog.set_level(logging.INFO, logger="bargein.loader")
    weights = load_weights(source, config, progress=False, blocks=True)
    dense = [weights[f"layers.{i}.{w}.weight"] for i in range(LAYERS) for w in ("wq", "wk", "wv", "wo")]
    experts = [weights[f"layers.{i}.experts.{e}.{w}.weight"]
               for i in range(LAYERS) for e in range(EXPERTS) for w in ("w1", "w2", "w3")]
    copy = private_copy_of(weights) if private else None
    stage = build_model(config, weights, EngineConfig(precision="fast", device="cpu"), max_positions=64)
    if copy is not None:  # the dense blocks' pages made private in the background, as the engine does once built
        copy.start()
        assert wait_private_copies(60)
    _random_access(model_file)
    all_experts = LAYERS * EXPERTS * EXPERT_BYTES
    before = _resident(model_file)
    assert before <= model_file.stat().st_size - all_experts + 256 * 1024  # loading read the rest, no expert
    if private:  # the attention's blocks were copied into private memory, their file pages no longer mapped
        assert before <= model_file.stat().st_size - all_experts - LAYERS * ATTENTION_BYTES + 256 * 1024
        line = f"{all_experts / 2**20:,.0f} MiB of MoE experts (resident as tokens route to them) left in the file's"
        assert any(line in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert all(_in_file(w, model_file) != private for w in dense)
    assert all(_in_file(w, model_file) for w in experts)
    _forward(stage, 24, seed=1)
    mapped = _mapped_pages(model_file, stage)
    assert mapped[0] == mapped[1] == 1.0 and mapped[4] == mapped[5] == mapped[6] == 0.0, mapped
    chosen = _resident(model_file) - before
    assert 0.95 * TOPK * LAYERS * EXPERT_BYTES <= chosen <= (TOPK + 2) * LAYERS * EXPERT_BYTES  # + neighbours' pages
    for layer in stage.layers:  # now route at random: every expert is read
        moe = layer.feed_forward
        assert isinstance(moe, MoEFeedForward)
        moe.router.copy_(torch.randn(moe.router.shape, generator=torch.Generator().manual_seed(2)))
    _forward(stage, 48, seed=3)
    assert min(_mapped_pages(model_file, stage).values()) == 1.0
    assert _resident(model_file) - before >= 0.95 * all_experts  # (a few pages were mapped before)


@pytest.mark.parametrize("memory", ["mapped", "private", "auto"])
def test_the_memory_plan_maps_every_expert_and_states_the_parameters(model_file: Path, memory: str) -> None:
    source = resolve_model_ref(str(model_file))
    config = load_config(source)
    plan = plan_memory(source, config, EngineConfig(precision="fast", device="cpu", weights_memory=memory))
    experts = LAYERS * EXPERTS * EXPERT_BYTES  # the Q8_0 experts, once each
    assert plan.mapped_weight_bytes == experts + (LAYERS * ATTENTION_BYTES if memory == "mapped" else 0)
    total, active = parameter_counts(config)
    per_expert = 3 * EXPERT_FF * HIDDEN
    assert total - active == LAYERS * (EXPERTS - TOPK) * per_expert
    assert "M parameters" in plan.describe() and "active per token" in plan.describe()
