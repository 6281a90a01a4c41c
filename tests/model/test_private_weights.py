"""The private copy of the weights made in place beside serving
(bargein.loader.private_weights): the same objects at the same addresses, now private
memory, with the same bits on every kernel path, also for matmuls running while the pages
move; the same tokens with every ``weights_memory``; the resident set holding the copy as
private pages, the file's pages gone, peak about one copy; the ranges moved, the chunks,
the huge pages' phase; a refused move or a stop leaving the rest mapped."""

from __future__ import annotations

import json
import logging
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from bargein.config import CacheConfig, EngineConfig
from bargein.engine.engine import Engine
from bargein.engine.sampling import SamplingParams
from bargein.kernels.ggml_types import GGMLQuantizationType
from bargein.kernels.native import load_native_kernels
from bargein.kernels.native_structs import describe_quant
from bargein.kernels.quant_weight import QuantWeight
from bargein.loader import load_config, load_weights, resolve_model_ref, wait_private_copies
from bargein.loader.file_maps import shared_file_maps
from bargein.loader.gguf_file import close_gguf_files, open_gguf
from bargein.loader.private_weights import (
    DROPPED,
    HUGE_PAGE,
    HugePagePhase,
    PrivateCopy,
    PrivateWeights,
    private_copy,
)
from bargein.loader.weight_pages import MERGE_GAP, PageRange, private_ranges
from tests.model.quant_models import write_quant_gguf
from tests.tiny_models import TinySpec

KERNELS = load_native_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler here")
PROMPT = [5, 17, 42, 99, 3, 250, 7, 61, 8, 120, 33]
TIED = TinySpec(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_quant_gguf(tmp_path_factory.mktemp("private") / "tiny.Q4_K_M.gguf", TIED, mix="Q4_K_M")[0]


def _loaded(path: Path) -> dict[str, object]:
    """The file's weights as views of a mapping of their own (not the cached file's: the copy
    moves pages of the mapping it is given, and a reference must keep the file's)."""
    close_gguf_files()
    source = resolve_model_ref(path)
    return load_weights(source, load_config(source), progress=False, blocks=True)


def _started(weights: dict[str, object]) -> PrivateWeights:
    copy = private_copy(weights)
    assert copy is not None
    return copy.start()


def _copied(weights: dict[str, object]) -> PrivateCopy:
    made = _started(weights).wait(60)
    assert made is not None and made.error is None, made
    return made


def _in_a_file(address: int, nbytes: int) -> bool:
    return any(lo <= address and address + nbytes <= hi for lo, hi, *_ in shared_file_maps())


def _segments(weights: dict[str, object]) -> dict[int, int]:
    return {s.data.data_ptr(): s.data.nbytes for w in weights.values() if isinstance(w, QuantWeight)
            for s in w.segments}


def _record_moves(monkeypatch, each: Callable[[list[PageRange]], None] = lambda moved: None) -> list[PageRange]:
    """Every chunk the copy moves, in order; ``each`` is called with them before each move
    (it may raise, as a refusing system would)."""
    import bargein.loader.private_weights as private_weights

    moved: list[PageRange] = []
    real = private_weights.move_private

    def recorded(target: PageRange, huge: bool) -> int:
        moved.append(target)
        each(moved)
        return real(target, huge)

    monkeypatch.setattr(private_weights, "move_private", recorded)
    return moved


def test_the_copy_is_private_memory_in_place_holding_the_same_bytes(q4_k_m: Path, caplog) -> None:
    reference, copied = _loaded(q4_k_m), _loaded(q4_k_m)
    segments = _segments(copied)
    before = {name: w for name, w in copied.items()}
    assert all(_in_a_file(p, n) for p, n in segments.items())  # views of the file, to begin with
    caplog.set_level(logging.INFO, logger="bargein.loader")
    made = _copied(copied)
    assert all(copied[name] is w for name, w in before.items())  # nothing replaced: the same objects
    assert _segments(copied) == segments  # at the same addresses
    assert not any(_in_a_file(p, n) for p, n in segments.items())  # now private memory
    blocks = sum(t.n_bytes for t in open_gguf(q4_k_m).tensors.values() if len(t.shape) == 2)
    assert blocks <= made.bytes <= blocks + 2 * 4096 * len(segments) + MERGE_GAP  # whole pages, each once
    for name, w in copied.items():
        was = reference[name]
        if isinstance(w, QuantWeight):
            assert isinstance(was, QuantWeight) and len(w.segments) == len(was.segments)
            for s, t in zip(w.segments, was.segments, strict=True):
                assert s.qtype == t.qtype and s.data.data_ptr() != t.data.data_ptr() and torch.equal(s.data, t.data)
        else:
            assert torch.equal(w, was)
    (line,) = [r.getMessage() for r in caplog.records if "private memory" in r.getMessage()]
    assert f"{made.bytes / 2**20:,.0f} MiB of blocks made private memory beside serving" in line, line


@needs_kernels
def test_every_kernel_path_gives_the_same_bits_from_the_copy(q4_k_m: Path) -> None:
    mapped, copied = _loaded(q4_k_m), _loaded(q4_k_m)
    _copied(copied)
    isas = [i for i in ("c", "avx2", "vnni", "amx", "neon", "dotprod") if KERNELS.q8_isa_available(i)]
    x = torch.randn(19, 512, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([0, 3, 200, TIED.vocab_size - 1, 7])
    for name, w in copied.items():
        if not isinstance(w, QuantWeight):
            continue
        a, b = describe_quant(mapped[name]), describe_quant(w)
        xs = x[:, :w.k].contiguous()
        for isa in isas:
            for rows in (1, 3, 19):  # the few-row passes and the tile pass
                for exact in (False, True):
                    want = KERNELS.quant_matmul(xs[:rows].contiguous(), a, 2, exact=exact, isa=isa)
                    assert torch.equal(KERNELS.quant_matmul(xs[:rows].contiguous(), b, 2, exact=exact, isa=isa), want), (name, isa)
        if name == "embed.weight":  # the tied head's rows, looked up
            assert torch.equal(KERNELS.quant_rows(b, ids, 2), KERNELS.quant_rows(a, ids, 2))


@needs_kernels
def test_matmuls_running_while_the_pages_move_give_the_same_bits(tmp_path: Path, monkeypatch) -> None:
    """Two threads multiply by every weight over and over while the copy moves the pages
    under them, 64 KB at a time: every product equals the one from the file's pages.

    Each chunk moves only once another product has finished since the previous move, so
    the products and the moves interleave however the machine schedules the threads (on a
    loaded machine the copy could otherwise end before the products begin)."""
    import bargein.loader.private_weights as private_weights

    monkeypatch.setattr(private_weights, "CHUNK", 64 * 1024)
    spec = TinySpec(hidden_size=1024, intermediate_size=2048, num_heads=8, num_kv_heads=4, num_layers=2,
                    tie_word_embeddings=False)
    path, _ = write_quant_gguf(tmp_path / "moving.Q6_K.gguf", spec, mix="Q6_K")
    weights = _loaded(path)
    quants = [w for w in weights.values() if isinstance(w, QuantWeight)]
    x = torch.randn(3, 2048, generator=torch.Generator().manual_seed(4))
    want = [KERNELS.quant_matmul(x[:, :w.k].contiguous(), describe_quant(w), 1) for w in quants]
    seen: list[int] = []
    wrong: list[int] = []
    unpaced: list[int] = []  # moves that found no new product within the wait

    def after_a_product(moved: list[PageRange]) -> None:
        deadline = time.monotonic() + 30
        while len(seen) < len(moved):
            if time.monotonic() > deadline:
                unpaced.append(len(moved))
                return
            time.sleep(0.0005)

    moved = _record_moves(monkeypatch, after_a_product)
    running = _started(weights)

    def multiply() -> None:
        while running.wait(0) is None or len(seen) < 2 * len(quants):
            for i, w in enumerate(quants):
                if not torch.equal(KERNELS.quant_matmul(x[:, :w.k].contiguous(), describe_quant(w), 1), want[i]):
                    wrong.append(i)
                seen.append(i)

    threads = [threading.Thread(target=multiply) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    made = running.wait(0)
    assert made is not None and made.error is None and made.bytes >= sum(w.nbytes for w in quants)
    assert len(moved) * private_weights.CHUNK >= made.bytes and not unpaced
    assert not wrong and len(seen) >= len(moved)
    assert not any(_in_a_file(p, n) for p, n in _segments(weights).items())


@pytest.mark.parametrize("precision", ["fast", "exact"])
def test_both_settings_give_the_same_tokens(q4_k_m: Path, precision: str) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for where in ("auto", "private", "mapped"):
        config = EngineConfig(device="cpu", precision=precision, cache=CacheConfig(block_size=4, num_blocks=64),
                              cuda_graphs=False, weights_memory=where)
        (out,) = Engine.from_pretrained(str(q4_k_m), config, progress=False).generate([PROMPT], greedy)
        outs[where] = list(out.token_ids)
    assert outs["auto"] == outs["private"] == outs["mapped"]


def test_an_unknown_setting_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="weights_memory must be one of auto, private, mapped"):
        EngineConfig(weights_memory="shared")




_RSS_SCRIPT = """
import json, logging, sys
from bargein import Engine, EngineConfig, CacheConfig, SamplingParams
from bargein.loader import wait_private_copies
from bargein.loader.resident import resident_memory
import torch
lines = []
handler = logging.Handler()
handler.emit = lambda record: lines.append(record.getMessage())
logging.getLogger("bargein.loader").addHandler(handler)
logging.getLogger("bargein.loader").setLevel(logging.INFO)
before = resident_memory()
engine = Engine.from_pretrained(sys.argv[1], EngineConfig(device="cpu", precision="fast",
                                cache=CacheConfig(block_size=4, num_blocks=16), weights_memory="private"),
                                progress=False)
import bargein.loader.private_weights as private_weights
at_load = {"running": len(private_weights._RUNNING), "lines": len(lines)}  # none yet: it starts after a step
engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2))  # the first forward starts it
assert wait_private_copies(120)
copied = resident_memory()
engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2))
ran = resident_memory()
file_rss, inside = 0, False  # the model file's pages resident in this process, from its mappings
with open("/proc/self/smaps") as smaps:
    for line in smaps:
        head = line.split()
        if "-" in head[0] and not line.startswith(("Rss", "Pss")):
            inside = line.rstrip().endswith(sys.argv[1])
        elif inside and head[0] == "Rss:":
            file_rss += int(head[1]) * 1024
print(json.dumps({"at_load": at_load, "copied_anon": copied.anon - before.anon, "file_rss": file_rss,
                  "peak": ran.peak - before.total, "log": [l for l in lines if "private memory" in l]}))
"""


@needs_kernels
def test_the_copy_is_private_memory_and_the_files_pages_are_dropped(tmp_path: Path) -> None:
    """The load copies nothing; the first forward, from the file's pages, starts the copy;
    once it ends the weights are private memory, the file's pages no longer in this process,
    and the peak was about one copy, not two."""
    spec = TinySpec(hidden_size=1024, intermediate_size=2048, num_heads=8, num_kv_heads=4, num_layers=3,
                    tie_word_embeddings=False)
    path, _ = write_quant_gguf(tmp_path / "mid.Q4_K.gguf", spec, mix="Q4_K")
    size = path.stat().st_size
    blocks = sum(t.n_bytes for t in open_gguf(path).tensors.values() if len(t.shape) == 2)
    result = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(path)], capture_output=True, text=True,
                            timeout=300, check=True)
    m = json.loads(result.stdout.strip().splitlines()[-1])
    assert m["at_load"] == {"running": 0, "lines": 0}, m  # the load itself copied nothing
    assert m["copied_anon"] > 0.95 * blocks, m  # the copy is resident, as private pages
    assert m["file_rss"] < 0.02 * size, m  # the file's pages under the weights left this process
    assert m["peak"] < 1.3 * size + 100 * 2**20, m  # about one copy at a time, not two
    (line,) = m["log"]  # one line, stating the bytes
    assert "MiB of blocks made private memory beside serving" in line, line


def _fake_weight(data: torch.Tensor, offset: int, nbytes: int) -> QuantWeight:
    rows = nbytes // 34
    return QuantWeight.of(GGMLQuantizationType.Q8_0, data[offset:offset + rows * 34], rows, 32)


def test_the_ranges_are_whole_pages_of_the_copied_blocks_joined_where_nothing_kept_lies_between() -> None:
    page = mmap.PAGESIZE
    data = torch.zeros(64 * 2**20 + 2 * page, dtype=torch.uint8)
    base = -(-data.data_ptr() // page) * page - data.data_ptr()  # data[base] starts a page
    at = data.data_ptr() + base
    maps = [(at, at + 32 * 2**20, 0, "/m1", 1), (at + 32 * 2**20, at + 64 * 2**20, 0, "/m2", 2)]
    mb = 2**20
    weights = {
        "a": _fake_weight(data, base + 100, 34 * 1000),  # pages 0-8
        "b": _fake_weight(data, base + 34 * 1000 + 200, 34 * 100),  # joins a (a few bytes apart)
        "c": _fake_weight(data, base + 4 * mb, 34 * 100),  # 4 MB on: a range of its own
        "g": _fake_weight(data, base + 6 * mb - 240, 34 * 10),  # its last page holds the expert's first bytes
        "expert": _fake_weight(data, base + 6 * mb + 100, 34 * 1000),
        "d": _fake_weight(data, base + 6 * mb + 100 + 34 * 1000 + 4 * page, 34 * 10),  # kept bytes between g, d
        "e": _fake_weight(data, base + 32 * mb - 34 * 10, 34 * 10),  # the first mapping's end
        "f": _fake_weight(data, base + 32 * mb, 34 * 10),  # the second's start: not joined to e
        "also_a": None,
    }
    weights["also_a"] = weights["a"]  # a tied weight, counted once
    weights["norm"] = torch.ones(4)
    ranges, kept = private_ranges(weights, keep=lambda name: name == "expert", maps=maps)
    assert kept == 34 * 1000

    def pages(lo: int, hi: int) -> PageRange:
        return PageRange(at + lo // page * page, at + -(-hi // page) * page)

    assert ranges == [
        pages(100, 34 * 1000 + 200 + 3400),
        pages(4 * mb, 4 * mb + 3400),
        pages(6 * mb - 240, 6 * mb),  # the page shared with the expert stays mapped
        pages(6 * mb + 100 + 34000 + 4 * page, 6 * mb + 100 + 34000 + 4 * page + 340),
        pages(32 * mb - 340, 32 * mb),
        pages(32 * mb, 32 * mb + 340),
    ]
    unmapped = {"a": weights["a"]}  # blocks in no file mapping: private memory already
    assert private_ranges(unmapped, keep=lambda name: False, maps=[]) == ([], 0)


def test_chunks_are_cut_on_huge_page_boundaries_and_cover_every_page() -> None:
    from bargein.loader.private_weights import CHUNK, chunks

    start = 7 * HUGE_PAGE + 3 * 4096
    ranges = [PageRange(start, start + 3 * CHUNK + 5 * 4096), PageRange(start + 4 * CHUNK, start + 4 * CHUNK + 4096)]
    cut = chunks(ranges)
    assert cut[0] == PageRange(start, start // HUGE_PAGE * HUGE_PAGE + CHUNK)  # to a boundary, < CHUNK
    assert all(c.nbytes <= CHUNK for c in cut) and sum(c.nbytes for c in cut) == sum(r.nbytes for r in ranges)
    inner = [c.end for c in cut[:-1]] + [c.start for c in cut[1:]]  # every cut but the ranges' own ends
    assert all(at % HUGE_PAGE == 0 for at in inner if at not in (ranges[0].end, ranges[1].start))
    assert all(a.end == b.start for a, b in zip(cut[:-2], cut[1:-1], strict=True)) and cut[-1] == ranges[1]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_huge_pages_that_come_slowly_end_their_phase_after_the_first_chunk(monkeypatch) -> None:
    import bargein.loader.private_weights as private_weights

    monkeypatch.setattr(private_weights, "HUGE_PAGE_BUDGET_S", 10.0)
    clock = _Clock()
    phase = HugePagePhase(clock)
    assert phase.on
    clock.now += 0.016  # 8 MB in 16 ms: 0.5 GB/s, as this project's VMs give fresh huge pages
    phase.faulted_in(8 * 2**20)
    assert not phase.on
    clock.now += 0.0001  # and never again, however fast the next ones come
    phase.faulted_in(8 * 2**20)
    assert not phase.on


def test_huge_pages_that_come_fast_last_until_the_budget_is_spent(monkeypatch) -> None:
    import bargein.loader.private_weights as private_weights

    monkeypatch.setattr(private_weights, "HUGE_PAGE_BUDGET_S", 0.25)
    clock = _Clock()
    phase = HugePagePhase(clock)
    chunks_on = 0
    while phase.on:
        clock.now += 1 / 1024  # 8 MB in under a millisecond: 8.6 GB/s (steps the sums hold exactly)
        phase.faulted_in(8 * 2**20)
        chunks_on += 1
    assert chunks_on == 257  # the chunk that went past 0.25 s is the last


def test_a_move_the_system_refuses_leaves_the_rest_mapped_and_says_why(q4_k_m: Path, monkeypatch, caplog) -> None:
    import bargein.loader.private_weights as private_weights

    monkeypatch.setattr(private_weights, "CHUNK", 16 * 1024)
    reference, weights = _loaded(q4_k_m), _loaded(q4_k_m)

    def refused_on_the_third(moved: list[PageRange]) -> None:
        if len(moved) == 3:
            raise OSError(12, "mremap: Cannot allocate memory")

    calls = _record_moves(monkeypatch, refused_on_the_third)
    caplog.set_level(logging.INFO, logger="bargein.loader")
    made = _started(weights).wait(60)
    assert made is not None and made.error == "[Errno 12] mremap: Cannot allocate memory"
    assert len(calls) == 3 and made.bytes == calls[0].nbytes + calls[1].nbytes
    assert not _in_a_file(calls[1].start, calls[1].nbytes) and _in_a_file(calls[2].start, calls[2].nbytes)
    for name, w in weights.items():  # part private, part mapped: the same bytes everywhere
        if isinstance(w, QuantWeight):
            assert all(torch.equal(s.data, t.data) for s, t in zip(w.segments, reference[name].segments, strict=True))
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "stopped early, the rest read from the file's pages: [Errno 12]" in warning.getMessage()


def test_without_populate_advice_the_copy_faults_the_pages_in_itself(q4_k_m: Path, monkeypatch) -> None:
    """A kernel before Linux 5.14 refuses MADV_POPULATE_WRITE: the copy's writes fault the
    pages in, with the same bytes."""
    import bargein.loader.private_weights as private_weights

    refused = []
    real = private_weights.madvise

    def old_kernel(address: int, nbytes: int, advice: int) -> bool:
        if advice == private_weights.MADV_POPULATE_WRITE:
            refused.append(nbytes)
            return False
        return real(address, nbytes, advice)

    monkeypatch.setattr(private_weights, "madvise", old_kernel)
    reference, weights = _loaded(q4_k_m), _loaded(q4_k_m)
    made = _copied(weights)
    assert sum(refused) == made.bytes > 0
    assert not any(_in_a_file(p, n) for p, n in _segments(weights).items())
    for name, w in weights.items():
        if isinstance(w, QuantWeight):
            assert all(torch.equal(s.data, t.data) for s, t in zip(w.segments, reference[name].segments, strict=True))


def test_a_copy_whose_weights_are_dropped_stops_at_the_next_chunk(q4_k_m: Path, monkeypatch) -> None:
    """The thread holds the weights only while it moves a chunk: once the model lets them go
    (and with them the mapping it would move into), it stops."""
    import bargein.loader.private_weights as private_weights

    monkeypatch.setattr(private_weights, "CHUNK", 16 * 1024)
    weights = _loaded(q4_k_m)

    def drop_at_the_second(moved: list[PageRange]) -> None:
        if len(moved) == 2:
            weights.clear()  # the model's last references, gone while the second chunk moves

    moved = _record_moves(monkeypatch, drop_at_the_second)
    copy = _started(weights)
    made = copy.wait(60)
    assert made is not None and made.error == DROPPED and len(moved) == 2
    assert made.bytes == sum(r.nbytes for r in moved) < sum(c.nbytes for c in copy._chunks)
    assert wait_private_copies(0)


def test_a_copy_moves_chunks_only_while_the_model_is_quiet(q4_k_m: Path, monkeypatch) -> None:
    import bargein.loader.private_weights as private_weights

    monkeypatch.setattr(private_weights, "CHUNK", 64 * 1024)
    weights = _loaded(q4_k_m)
    moved = _record_moves(monkeypatch)
    quiet = threading.Event()
    copy = private_copy(weights)
    assert copy is not None
    copy.start(quiet=quiet.is_set)
    assert copy.wait(0.3) is None and moved == []  # a busy model: nothing moves
    quiet.set()
    made = copy.wait(60)
    assert made is not None and made.error is None and len(moved) == len(copy._chunks)
    assert not any(_in_a_file(p, n) for p, n in _segments(weights).items())


def test_a_copy_waiting_for_a_quiet_model_stops_once_the_weights_are_dropped(q4_k_m: Path) -> None:
    import gc

    weights = _loaded(q4_k_m)
    copy = private_copy(weights)
    assert copy is not None
    copy.start(quiet=lambda: False)  # a model that never pauses
    assert copy.wait(0.1) is None
    weights.clear()
    gc.collect()
    made = copy.wait(10)
    assert made is not None and made.error == DROPPED and made.bytes == 0


def _written_64k_at_a_time(path: Path) -> Path:
    """``path`` copied 64 KB at a time, as a copy or a download writes: its page cache on
    the small pages of those writes (one large write can give 2 MB ones)."""
    copy = path.with_name("copied." + path.name)
    with open(path, "rb") as src, open(copy, "wb") as dst:
        while piece := src.read(1 << 16):
            dst.write(piece)
    return copy


@pytest.fixture(scope="module")
def mid_q4_k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model of ~15 MB: whole 2 MB pages under its weights."""
    spec = TinySpec(hidden_size=1024, intermediate_size=2048, num_heads=8, num_kv_heads=4, num_layers=3,
                    tie_word_embeddings=False)
    return write_quant_gguf(tmp_path_factory.mktemp("auto") / "mid.Q4_K.gguf", spec, mix="Q4_K")[0]


def _same_weights(weights: dict[str, object], reference: dict[str, object]) -> bool:
    return all(torch.equal(s.data, t.data) for name, w in weights.items() if isinstance(w, QuantWeight)
               for s, t in zip(w.segments, reference[name].segments, strict=True))


@needs_kernels
def test_auto_reads_the_files_pages_again_onto_2mb_pages_where_the_kernel_gives_them(
        mid_q4_k: Path, tmp_path: Path, caplog) -> None:
    """A file just written (its page cache on small pages): the thread reads its pages again
    from the file; where the kernel gives 2 MB page-cache pages the weights stay views of the
    file, now on them, and nothing is copied; elsewhere the private copy follows. The same
    bytes at the same addresses either way."""
    from tests.model.test_huge_page_cache import gives_file_huge_pages

    huge = gives_file_huge_pages(tmp_path)
    path = _written_64k_at_a_time(mid_q4_k)
    reference, weights = _loaded(mid_q4_k), _loaded(path)
    segments = _segments(weights)
    caplog.set_level(logging.INFO, logger="bargein.loader")
    copy = private_copy(weights, file_pages_first=True)
    assert copy is not None
    made = copy.start().wait(60)
    assert made is not None and made.error is None, made
    assert _segments(weights) == segments and _same_weights(weights, reference)
    blocks = sum(segments.values())
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:")]
    assert made.refilled_bytes > 0.5 * blocks, made
    if huge:
        assert made.file_pages and made.bytes == 0 and made.file_huge_bytes > 0.5 * blocks, made
        assert all(_in_a_file(p, n) for p, n in segments.items())  # still the file's pages
        assert "read in place from the file's pages" in line and "read again from the file" in line, line
    else:
        assert not made.file_pages and made.bytes >= blocks, made
        assert "came back on 4 KB pages" in line, line


@needs_kernels
def test_auto_copies_where_the_pages_read_again_come_back_small(mid_q4_k: Path, monkeypatch, caplog) -> None:
    """Where smaps shows no 2 MB pages after the first chunks (an older kernel, another
    process holding the small pages), the weights are made private as with "private",
    including the chunks read again, and the log line says why."""
    import bargein.loader.private_weights as private_weights

    monkeypatch.setattr(private_weights, "PROBE_BYTES", HUGE_PAGE)
    monkeypatch.setattr(private_weights, "file_huge_bytes", lambda inodes: 0)
    reference, weights = _loaded(mid_q4_k), _loaded(mid_q4_k)
    caplog.set_level(logging.INFO, logger="bargein.loader")
    made = private_copy(weights, file_pages_first=True).start().wait(60)
    assert made is not None and made.error is None and not made.file_pages
    assert 0 < made.refilled_bytes <= private_weights.CHUNK  # the probe: one chunk, then the copy
    assert made.bytes >= sum(_segments(weights).values())
    assert not any(_in_a_file(p, n) for p, n in _segments(weights).items()) and _same_weights(weights, reference)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:")]
    assert "made private memory" in line and "came back on 4 KB pages" in line, line


def test_auto_leaves_pages_already_on_2mb_pages_as_they_are(mid_q4_k: Path, monkeypatch, caplog) -> None:
    """The file's pages on 2 MB pages already (a file read from disk): nothing is read again
    or copied, and the log line says where the weights are."""
    import bargein.loader.private_weights as private_weights

    monkeypatch.setattr(private_weights, "file_huge_bytes", lambda inodes: 1 << 40)

    def refused(*args: object) -> None:
        raise AssertionError("nothing to read again")

    monkeypatch.setattr(private_weights, "refill", refused)
    monkeypatch.setattr(private_weights, "move_private", refused)
    weights = _loaded(mid_q4_k)
    caplog.set_level(logging.INFO, logger="bargein.loader")
    made = private_copy(weights, file_pages_first=True).start().wait(60)
    assert made is not None and made.file_pages and made.error is None and made.bytes == made.refilled_bytes == 0
    assert all(_in_a_file(p, n) for p, n in _segments(weights).items())
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:")]
    assert line.startswith("weights: read in place from the file's pages") and "read again" not in line, line


def test_a_refill_the_system_refuses_leaves_the_rest_mapped_and_says_why(mid_q4_k: Path, monkeypatch,
                                                                        caplog) -> None:
    import bargein.loader.private_weights as private_weights

    calls = []

    def refuse_second(start: int, nbytes: int, fd: int, offset: int) -> None:
        calls.append(start)
        if len(calls) == 2:
            raise OSError(12, "mremap: Cannot allocate memory")

    monkeypatch.setattr(private_weights, "file_huge_bytes", lambda inodes: 0)
    monkeypatch.setattr(private_weights, "refill", refuse_second)
    weights = _loaded(mid_q4_k)
    caplog.set_level(logging.INFO, logger="bargein.loader")
    made = private_copy(weights, file_pages_first=True).start().wait(60)
    assert made is not None and made.file_pages and "Cannot allocate memory" in made.error and len(calls) == 2
    assert all(_in_a_file(p, n) for p, n in _segments(weights).items())
    (record,) = [r for r in caplog.records if r.getMessage().startswith("weights:")]
    assert record.levelno == logging.WARNING and "stopped early" in record.getMessage()


def test_auto_looks_at_the_files_pages_only_once_the_model_has_settled(mid_q4_k: Path, monkeypatch) -> None:
    """The file's pages are looked at (a walk of every mapping) and read again only once the
    model has been quiet for SETTLED_S: a short-lived process never starts reading the disk."""
    import bargein.loader.private_weights as private_weights

    looked = []
    monkeypatch.setattr(private_weights, "file_huge_bytes", lambda inodes: looked.append(1) or 1 << 40)
    settled = threading.Event()
    weights = _loaded(mid_q4_k)  # held: a copy whose weights are dropped stops
    running = private_copy(weights, file_pages_first=True).start(quiet=lambda: True, settled=settled.is_set)
    assert running.wait(0.2) is None and not looked  # waiting for the model to settle
    settled.set()
    made = running.wait(60)
    assert made is not None and made.file_pages and looked == [1]


def test_auto_reads_on_where_the_first_chunks_were_on_2mb_pages_before_their_refill(mid_q4_k: Path,
                                                                                  monkeypatch) -> None:
    """Chunks on 2 MB pages before their refill gain nothing: the probe asks whether the
    file's mappings have 2 MB pages at all, not whether the refilled chunks gained them."""
    import bargein.loader.private_weights as private_weights

    monkeypatch.setattr(private_weights, "ALREADY_HUGE", 2.0)  # never "already"
    monkeypatch.setattr(private_weights, "file_huge_bytes", lambda inodes: 4 * HUGE_PAGE)  # a constant: no gain
    weights = _loaded(mid_q4_k)
    made = private_copy(weights, file_pages_first=True).start().wait(60)
    assert made is not None and made.file_pages and made.error is None and made.bytes == 0, made
    assert made.refilled_bytes >= 6 * HUGE_PAGE and all(_in_a_file(p, n) for p, n in _segments(weights).items())


@pytest.mark.parametrize("model", ["mid_q4_k", "q4_k_m"])
def test_auto_keeps_a_tmpfs_files_pages_and_gathers_them_onto_2mb_pages(model: str, request, monkeypatch,
                                                                         caplog) -> None:
    """A model in /dev/shm: its pages are the file, memory already. Nothing is read again
    (the page cache cannot drop them) or copied (that would hold them twice), and the log
    line says why: as the memory plan counts it. Its small pages are gathered onto 2 MB
    pages in place, where the kernel does that (mid_q4_k; q4_k_m has no whole 2 MB page
    under its weights), and the line says how many."""
    from tests.model.test_huge_page_cache import gathers_tmpfs_pages, tmpfs_at_dev_shm

    if not tmpfs_at_dev_shm():
        pytest.skip("no tmpfs at /dev/shm here")
    made, line = _kept_on_tmpfs(request.getfixturevalue(model), Path("/dev/shm"), monkeypatch, caplog)
    if model == "q4_k_m":
        assert made.gathered_bytes == made.file_huge_bytes == 0 and made.gather_refused is None, made
        return
    refused = gathers_tmpfs_pages(Path("/dev/shm"))
    if refused:  # the pages serve as they are, and the line says why they stay small
        assert made.gathered_bytes == 0 and made.gather_refused, made
        assert f"the kernel did not gather the rest onto 2 MB pages ({made.gather_refused})" in line, line
        return
    assert made.gather_refused is None and made.gathered_bytes >= HUGE_PAGE, made
    assert made.file_huge_bytes >= made.gathered_bytes, made
    assert f"of them on 2 MB pages ({made.gathered_bytes / 2**20:,.0f} MiB gathered onto them in place" in line, line


def test_a_refused_gather_leaves_a_tmpfs_files_pages_serving_and_says_why(mid_q4_k: Path, monkeypatch,
                                                                            caplog) -> None:
    """A kernel that does not gather tmpfs pages (before Linux 6.1, shmem_enabled=deny): the
    first refusal ends the gather, the pages serve as they are, and the line names it at
    info level (nothing the user did wrong)."""
    import bargein.loader.private_weights as private_weights
    from tests.model.test_huge_page_cache import tmpfs_at_dev_shm

    if not tmpfs_at_dev_shm():
        pytest.skip("no tmpfs at /dev/shm here")
    asked = []

    def refuses(start: int, nbytes: int) -> None:
        asked.append(start)
        raise OSError(22, "madvise(MADV_COLLAPSE): Invalid argument")

    monkeypatch.setattr(private_weights, "collapse", refuses)
    made, line = _kept_on_tmpfs(mid_q4_k, Path("/dev/shm"), monkeypatch, caplog)
    assert len(asked) == 1 and made.gathered_bytes == 0 and made.error is None, made
    assert made.gather_refused == "[Errno 22] madvise(MADV_COLLAPSE): Invalid argument", made
    assert line.endswith("the kernel did not gather the rest onto 2 MB pages "
                         "([Errno 22] madvise(MADV_COLLAPSE): Invalid argument)"), line
    assert [r.levelname for r in caplog.records if r.getMessage().startswith("weights:")] == ["INFO"]


@pytest.fixture
def huge_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of its own, mounted with ``huge=always`` (which needs root, and a kernel with
    2 MB pages for tmpfs: skipped where either is missing), unmounted after the test."""
    mount = tmp_path / "huge-tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=always,size=64m", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        pytest.skip(f"no tmpfs with huge=always here: {done.stderr.strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)


@needs_kernels
def test_auto_keeps_a_huge_tmpfs_files_2mb_pages_and_counts_them(mid_q4_k: Path, huge_tmpfs: Path, monkeypatch,
                                                                  caplog) -> None:
    """A tmpfs mounted with huge=always holds the file on 2 MB pages: ``auto`` keeps them as
    they are, and the count of the weights on 2 MB pages is the mapping's whole pages of
    shared memory (smaps' ShmemPmdMapped), where a file on disk counts FilePmdMapped."""
    made, line = _kept_on_tmpfs(mid_q4_k, huge_tmpfs, monkeypatch, caplog)
    assert made.file_huge_bytes >= HUGE_PAGE and made.file_huge_bytes % HUGE_PAGE == 0, made
    assert f"{made.file_huge_bytes / 2**20:,.0f} MiB of them on 2 MB pages, shared" in line, line


def _kept_on_tmpfs(source: Path, directory: Path, monkeypatch, caplog) -> tuple[PrivateCopy, str]:
    """Loads a copy of ``source`` in ``directory`` (a tmpfs), runs ``auto``'s pass over it
    and checks that it kept the file's pages as they are; returns the pass and its log line."""
    import bargein.loader.private_weights as private_weights

    def refused(*args: object) -> None:
        raise AssertionError("a tmpfs file's pages are neither read again nor copied")

    monkeypatch.setattr(private_weights, "refill", refused)
    monkeypatch.setattr(private_weights, "move_private", refused)
    fd, name = tempfile.mkstemp(suffix=".gguf", dir=directory)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(source.read_bytes())
        reference, weights = _loaded(source), _loaded(Path(name))
        segments = _segments(weights)
        caplog.set_level(logging.INFO, logger="bargein.loader")
        made = private_copy(weights, file_pages_first=True).start().wait(60)
        assert made is not None and made.file_pages and made.error is None, made
        assert made.memory_file_system == "tmpfs" and made.bytes == made.refilled_bytes == 0, made
        assert _segments(weights) == segments and all(_in_a_file(p, n) for p, n in segments.items())
        assert _same_weights(weights, reference)
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:")]
        assert line.startswith("weights: read in place from the file's pages on tmpfs, which are memory already"), line
        return made, line
    finally:
        os.unlink(name)
