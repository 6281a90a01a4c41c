"""A load's file pages mapped in ahead of the first forward (bargein.loader.file_maps.map_ahead):
exactly the pages asked for come in, and a load (a GGUF file, a safetensors folder) asks for what it or its first forward reads
whole."""

from __future__ import annotations

import mmap
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

import bargein.loader.gguf_file as gguf_file
import bargein.loader.hf_folder as hf_folder
from bargein.loader import load_config, load_weights, resolve_model_ref
from bargein.loader.file_maps import map_ahead
from bargein.loader.gguf_file import close_gguf_files, open_gguf
from tests.tiny_models import TinySpec, tiny_weights, write_gguf

PAGE = mmap.PAGESIZE
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/pagemap is Linux's")


def _present(address: int, pages: int) -> list[bool]:
    """Whether each page from ``address`` is mapped into this process (pagemap's bit 63)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(address // PAGE * 8)
        entries = struct.unpack(f"{pages}Q", f.read(8 * pages))
    return [bool(e >> 63) for e in entries]


@linux_only
def test_map_ahead_maps_in_the_pages_of_its_spans(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(256 * PAGE))  # in the page cache, as a warm model file
    with path.open("rb") as f:
        mapped = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
    base = mapped.ctypes.data
    assert base % PAGE == 0 and not any(_present(base, 256))  # a fresh mapping: nothing mapped in yet
    # a page; two spans a few bytes apart merged; one starting mid-page (its first page too)
    spans = [(0, PAGE), (100 * PAGE + 8, 2 * PAGE), (102 * PAGE + 16, 100), (150 * PAGE + 5, 1)]
    thread = map_ahead(mapped, spans)
    assert thread is not None
    thread.join(10)
    present = _present(base, 256)
    # (the kernel may map more: a fault maps a page's neighbours in the page cache's folio
    # or its fault-around window)
    assert present[0] and all(present[100:103]) and present[150]


def test_map_ahead_with_nothing_asked_starts_nothing() -> None:
    assert map_ahead(np.zeros(PAGE, dtype=np.uint8), [(0, 0)]) is None


def _spans_asked(monkeypatch, path: Path, **load) -> tuple[set[str], dict]:
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(gguf_file, "map_ahead", lambda mapped, spans: asked.extend(spans))
    source = resolve_model_ref(str(path))
    config = load_config(source)
    load_weights(source, config, progress=False, **load)
    tensors = open_gguf(path).tensors
    names = {name for name, info in tensors.items() if (info.data_offset, info.n_bytes) in set(asked)}
    assert len(names) == len(asked)  # each span a whole tensor
    close_gguf_files()
    return names, tensors


def test_a_load_maps_ahead_what_it_or_its_first_forward_reads_whole(tmp_path: Path, monkeypatch) -> None:
    untied = TinySpec(tie_word_embeddings=False)
    path = write_gguf(tmp_path / "untied.gguf", untied, tiny_weights(untied), tensor_type="Q8_0")
    names, tensors = _spans_asked(monkeypatch, path, blocks=True)
    # every tensor but the embedding, which a forward reads a row at a time
    assert names == set(tensors) - {"token_embd.weight"}
    # read and converted at load, the embedding too
    names, _ = _spans_asked(monkeypatch, path, blocks=False)
    assert names == set(tensors)
    # a first stage: its layer's tensors only
    names, _ = _spans_asked(monkeypatch, path, blocks=True, layer_range=(0, 1))
    assert names == {name for name in tensors if name.startswith("blk.0.")}
    tied = TinySpec()
    path = write_gguf(tmp_path / "tied.gguf", tied, tiny_weights(tied), tensor_type="Q8_0")
    names, tensors = _spans_asked(monkeypatch, path, blocks=True)
    assert names == set(tensors) and "token_embd.weight" in names  # the head: read whole each token


def test_an_moe_file_maps_ahead_all_but_its_experts(monkeypatch) -> None:
    path = Path(__file__).parents[1] / "data" / "moe" / "qwen2moe" / "model.gguf"
    names, tensors = _spans_asked(monkeypatch, path, blocks=True)
    experts = {name for name in tensors if "_exps" in name}  # a token reads those it is routed to
    # the shared expert and the router are read whole
    assert experts and {"blk.0.ffn_gate_shexp.weight", "blk.0.ffn_gate_inp.weight"} <= names
    assert names == set(tensors) - experts - {"token_embd.weight"}


def test_a_safetensors_folder_maps_ahead_what_it_reads_whole(monkeypatch) -> None:
    folder = Path(__file__).parents[1] / "data" / "families" / "qwen3" / "hf"  # untied
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(hf_folder, "map_ahead", lambda mapped, spans: asked.extend(spans))
    source = resolve_model_ref(str(folder))
    load_weights(source, load_config(source), progress=False, blocks=True)
    (file,) = folder.glob("*.safetensors")
    stored = hf_folder.MappedSafetensors(file)
    spans = {stored.span(name): name for name in stored.header if name != "__metadata__"}
    assert sorted(spans[s] for s in asked) == sorted(set(spans.values()) - {"model.embed_tokens.weight"})
