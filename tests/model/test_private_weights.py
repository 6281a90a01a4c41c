"""The load-time private copy of the weights (bargein.loader.private_weights): the same bits
on every kernel path as the mapped file's blocks, the same tokens with either
``weights_memory``, shared segments copied once, and the resident set holding the copy as
private pages, the file's pages dropped, peak about one copy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bargein.config import CacheConfig, EngineConfig
from bargein.engine.engine import Engine
from bargein.engine.sampling import SamplingParams
from bargein.kernels.native import load_native_kernels
from bargein.kernels.native_structs import describe_quant
from bargein.kernels.quant_weight import QuantWeight
from bargein.loader import load_config, load_weights, resolve_model_ref
from bargein.loader.gguf_file import open_gguf
from bargein.loader.private_weights import HUGE_PAGE, copy_to_private
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
    source = resolve_model_ref(path)
    return load_weights(source, load_config(source), progress=False, blocks=True)


def test_the_copy_is_private_aligned_once_per_segment_and_the_same_bytes(q4_k_m: Path) -> None:
    mapped, copied = _loaded(q4_k_m), _loaded(q4_k_m)
    made = copy_to_private(copied)
    f = open_gguf(q4_k_m).mapped()
    start, end = f.ctypes.data, f.ctypes.data + f.nbytes
    quants = {name: w for name, w in copied.items() if isinstance(w, QuantWeight)}
    segments = {s.data.data_ptr(): s.data.nbytes for w in quants.values() for s in w.segments}
    assert made.bytes == sum(segments.values())  # each stored tensor once
    assert made.bytes == sum(t.n_bytes for t in open_gguf(q4_k_m).tensors.values() if len(t.shape) == 2)
    lowest = min(segments)
    assert lowest % HUGE_PAGE == 0  # the arena starts on a 2 MB boundary
    assert all(p % 64 == 0 and not start <= p < end for p in segments)  # off the map, on cache lines
    assert max(p + n for p, n in segments.items()) - lowest < made.bytes + 64 * len(segments)  # one arena
    for name, w in quants.items():
        was = mapped[name]
        assert isinstance(was, QuantWeight) and len(w.segments) == len(was.segments)
        for s, t in zip(w.segments, was.segments, strict=True):
            assert s.qtype == t.qtype and torch.equal(s.data, t.data)
            assert (s.order is None) == (t.order is None) and (s.order is None or torch.equal(s.order, t.order))
    assert all(torch.equal(copied[n], mapped[n]) for n in copied if n not in quants)  # the rest untouched


@needs_kernels
def test_every_kernel_path_gives_the_same_bits_from_the_copy(q4_k_m: Path) -> None:
    mapped, copied = _loaded(q4_k_m), _loaded(q4_k_m)
    copy_to_private(copied)
    isas = [i for i in ("c", "avx2", "vnni", "neon", "dotprod") if KERNELS.q8_isa_available(i)]
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


@pytest.mark.parametrize("precision", ["fast", "exact"])
def test_both_settings_give_the_same_tokens(q4_k_m: Path, precision: str) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for where in ("private", "mapped"):
        config = EngineConfig(device="cpu", precision=precision, cache=CacheConfig(block_size=4, num_blocks=64),
                              cuda_graphs=False, weights_memory=where)
        (out,) = Engine.from_pretrained(str(q4_k_m), config, progress=False).generate([PROMPT], greedy)
        outs[where] = list(out.token_ids)
    assert outs["private"] == outs["mapped"]


def test_an_unknown_setting_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="weights_memory must be one of private, mapped"):
        EngineConfig(weights_memory="shared")


_RSS_SCRIPT = """
import json, logging, sys
from bargein import Engine, EngineConfig, CacheConfig, SamplingParams
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
loaded = resident_memory()
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
print(json.dumps({"loaded_anon": loaded.anon - before.anon, "file_rss": file_rss,
                  "peak": ran.peak - before.total, "log": [l for l in lines if "private memory" in l]}))
"""


@needs_kernels
def test_the_copy_is_private_memory_and_the_files_pages_are_dropped(tmp_path: Path) -> None:
    spec = TinySpec(hidden_size=1024, intermediate_size=2048, num_heads=8, num_kv_heads=4, num_layers=3,
                    tie_word_embeddings=False)
    path, _ = write_quant_gguf(tmp_path / "mid.Q4_K.gguf", spec, mix="Q4_K")
    size = path.stat().st_size
    blocks = sum(t.n_bytes for t in open_gguf(path).tensors.values() if len(t.shape) == 2)
    result = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(path)], capture_output=True, text=True,
                            timeout=300, check=True)
    m = json.loads(result.stdout.strip().splitlines()[-1])
    assert m["loaded_anon"] > 0.95 * blocks, m  # the copy is resident, as private pages
    assert m["file_rss"] < 0.02 * size, m  # decoding reads the copy: the file's pages were dropped
    assert m["peak"] < 1.3 * size + 100 * 2**20, m  # about one copy at a time, not two
    (line,) = m["log"]  # one line, stating the bytes
    assert f"{blocks / 2**20:,.0f} MiB of blocks copied into private memory" in line, line


def test_past_the_huge_page_budget_the_rest_is_copied_the_same(monkeypatch) -> None:
    import bargein.loader.private_weights as private_weights
    from bargein.kernels.ggml_types import GGMLQuantizationType

    monkeypatch.setattr(private_weights, "HUGE_PAGE_BUDGET_S", 0.0)  # 4 KB pages from the first chunk
    rows = 3 * HUGE_PAGE // 272 + 5  # rows of 256 Q8_0 values (272 bytes): over three huge pages
    blocks = torch.randint(0, 256, (rows * 272,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    weight = QuantWeight.of(GGMLQuantizationType.Q8_0, blocks, rows, 256)
    weights = {"w": weight, "also": weight, "norm": torch.ones(4)}
    made = copy_to_private(weights)
    assert made.bytes == blocks.numel() and weights["w"] is weights["also"]  # copied once, still shared
    (segment,) = weights["w"].segments
    assert segment.data.data_ptr() != blocks.data_ptr() and torch.equal(segment.data.reshape(-1), blocks)


def test_without_populate_advice_the_pages_are_touched_and_copied_the_same(monkeypatch) -> None:
    """A kernel before Linux 5.14 refuses MADV_POPULATE_WRITE: the arena is faulted in by a
    write to each page instead, on huge pages and on 4 KB pages alike, with the same bytes."""
    import bargein.loader.private_weights as private_weights
    from bargein.kernels.ggml_types import GGMLQuantizationType

    refused = []
    real = private_weights._madvise

    def old_kernel(address: int, nbytes: int, advice: int) -> bool:
        if advice == private_weights._MADV_POPULATE_WRITE:
            refused.append(nbytes)
            return False
        return real(address, nbytes, advice)

    monkeypatch.setattr(private_weights, "_madvise", old_kernel)
    rows = 5 * HUGE_PAGE // 272 + 3  # over five huge pages of Q8_0 rows
    blocks = torch.randint(0, 256, (rows * 272,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    weights = {"w": QuantWeight.of(GGMLQuantizationType.Q8_0, blocks, rows, 256)}
    monkeypatch.setattr(private_weights, "HUGE_PAGE_MIN_RATE", 0.0)  # however slow they come
    for budget in (0.0, 10.0):  # all on 4 KB pages, then all within the huge pages' budget
        monkeypatch.setattr(private_weights, "HUGE_PAGE_BUDGET_S", budget)
        refused.clear()
        made = copy_to_private(weights)
        assert sum(refused) >= blocks.numel() and made.bytes == blocks.numel()  # every byte faulted in the old way
        (segment,) = weights["w"].segments
        assert torch.equal(segment.data.reshape(-1), blocks)


class _TimedArena:
    """An arena for ``_fault_in_huge`` whose chunks take ``seconds_per_mb`` to fault in."""

    def __init__(self, nbytes: int, seconds_per_mb: float):
        self.nbytes, self.seconds_per_mb = nbytes, seconds_per_mb
        self.faulted: list[tuple[int, int]] = []
        self.small_from: list[int] = []

    def fault_in(self, start: int, end: int) -> None:
        import time

        time.sleep((end - start) / 2**20 * self.seconds_per_mb)
        self.faulted.append((start, end))

    def small_pages_from(self, at: int) -> int:
        self.small_from.append(at)
        return at


@pytest.mark.parametrize("threads", [1, 2])
def test_huge_pages_that_come_slowly_stop_at_the_first_chunks(monkeypatch, threads) -> None:
    """Huge pages faulted in at 2 MB per 4 ms (0.5 GB/s, as this project's VMs give fresh
    ones) end the huge-page phase once the first chunk is in, long before the budget; the
    4 KB pages start right after the chunks taken, and no chunk is taken twice or past them."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import bargein.loader.private_weights as private_weights

    monkeypatch.setattr(private_weights, "HUGE_PAGE_BUDGET_S", 10.0)
    arena = _TimedArena(64 * private_weights._CHUNK, seconds_per_mb=0.002)
    with ThreadPoolExecutor(threads) as pool:
        small_from = private_weights._fault_in_huge(arena, time.perf_counter(), pool, threads)
    assert arena.small_from == [small_from] and small_from <= threads * private_weights._CHUNK
    assert sorted(arena.faulted) == [(at, at + private_weights._CHUNK)
                                     for at in range(0, small_from, private_weights._CHUNK)]


def test_huge_pages_that_come_fast_fill_the_arena_within_the_budget(monkeypatch) -> None:
    import time
    from concurrent.futures import ThreadPoolExecutor

    import bargein.loader.private_weights as private_weights

    monkeypatch.setattr(private_weights, "HUGE_PAGE_BUDGET_S", 10.0)
    # 10 MB/s: the chunks come at once, and a worker descheduled for most of a second by a
    # busy machine must not look like a slow fault
    monkeypatch.setattr(private_weights, "HUGE_PAGE_MIN_RATE", 1e7)
    nbytes = 16 * private_weights._CHUNK + 4096  # a last chunk shorter than the others
    arena = _TimedArena(nbytes, seconds_per_mb=0.0)
    with ThreadPoolExecutor(2) as pool:
        assert private_weights._fault_in_huge(arena, time.perf_counter(), pool, 2) == nbytes
    assert arena.small_from == [] and sorted(arena.faulted)[-1] == (16 * private_weights._CHUNK, nbytes)
    assert sum(end - start for start, end in arena.faulted) == nbytes
