"""Memory: a GGUF's quantized blocks loaded as stored, no float32 copy of a block-held weight
in the default mode, the KV cache sized by tokens, and the loader's peak bounded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
import torch.nn.functional as F

from bargein.config import CacheConfig, EngineConfig
from bargein.engine.device import build_model
from bargein.engine.engine import Engine
from bargein.engine.sampling import SamplingParams
from bargein.kernels.block_quant import BlockWeight, recover_blocks
from bargein.kernels.native import load_native_kernels
from bargein.kernels.ops import KernelSet
from bargein.kernels.quant_weight import QuantWeight
from bargein.loader import load_config, load_tokenizer, load_weights, resolve_model_ref
from bargein.loader.gguf_file import open_gguf
from bargein.model.block_weights import TokenEmbedding, cat_rows
from bargein.model.linear import Linear
from tests.tiny_engine import TINY, ByteTokenizer
from tests.tiny_engine import tiny_weights as tiny_engine_weights
from tests.tiny_models import TinySpec, tiny_weights, write_gguf

NATIVE = load_native_kernels()
needs_native = pytest.mark.skipif(NATIVE is None, reason="no C compiler: the native kernels are not built")
SPEC = TinySpec()


def same_blocks(a: BlockWeight, b: BlockWeight) -> bool:
    return a.bits == b.bits and torch.equal(a.qs, b.qs) and torch.equal(a.scales, b.scales) and (
        (a.mins is None and b.mins is None) or torch.equal(a.mins, b.mins))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("mem")
    weights = tiny_weights(SPEC)
    return {t: write_gguf(folder / f"tiny.{t}.gguf", SPEC, weights, tensor_type=t) for t in ("Q4_1", "Q8_0", "Q4_0")}


def load(path: Path, **kwargs):
    source = resolve_model_ref(path)
    config = load_config(source)
    return config, load_weights(source, config, progress=False, **kwargs)


# -- blocks straight from the file --------------------------------------------------------------
@pytest.mark.parametrize("tensor_type", ["Q4_1", "Q8_0"])
def test_direct_blocks_equal_the_recovered_ones_on_written_files(files, tensor_type: str) -> None:
    _, dense = load(files[tensor_type])
    _, held = load(files[tensor_type], blocks=True)
    assert held.keys() == dense.keys()
    matrices = [name for name, w in dense.items() if w.dim() == 2]
    assert matrices and all(isinstance(held[name], QuantWeight) for name in matrices)
    for name in matrices:  # Q/K included: their rows are un-permuted by the row order
        assert torch.equal(held[name].dequantize(), dense[name]), name
    for name in dense.keys() - set(matrices):  # norms stay dense float32
        assert torch.equal(held[name], dense[name]), name


def test_other_block_types_are_quant_weights_too(files) -> None:
    _, dense = load(files["Q4_0"])
    _, held = load(files["Q4_0"], blocks=True)
    assert all(isinstance(held[n], QuantWeight) for n in dense if dense[n].dim() == 2)
    assert all(torch.equal(held[n].dequantize() if isinstance(held[n], QuantWeight) else held[n], dense[n])
               for n in dense)


def test_direct_blocks_equal_the_recovered_ones_on_the_bundled_model() -> None:
    f = open_gguf(resolve_model_ref(None).path)
    names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight",
             "blk.29.ffn_gate.weight", "blk.17.attn_output.weight"]
    for name in names:
        held, dense = f.blocks(name), f.tensor(name)
        assert held.bits == (8 if name == "token_embd.weight" else 4)
        assert torch.equal(held.dequantize(), dense), name
        assert same_blocks(held, recover_blocks(dense)), name


def test_lean_metadata_parser_agrees_with_gguf_reader() -> None:
    path = resolve_model_ref(None).path
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    header = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # the reader's own pseudo-fields
    assert ours.fields.keys() == theirs.fields.keys() - header
    for key, field in theirs.fields.items():
        if key in header:
            continue
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            assert ours.strings(key) == [bytes(field.parts[i]).decode("utf-8", errors="replace")
                                         for i in field.data]
        else:
            assert ours.get(key) == field.contents(), key
    assert ours.tensors.keys() == {t.name for t in theirs.tensors}
    for t in theirs.tensors:
        info = ours.tensors[t.name]
        assert (info.data_offset, info.n_bytes, info.tensor_type) == (t.data_offset, int(t.n_bytes), t.tensor_type)
        assert info.shape.tolist() == t.shape.tolist()


# -- the model holds the blocks only ----------------------------------------------------------
def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model holds: parameters, buffers, packed and block weights."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.data_ptr()] = t.numel() * t.element_size()
    for m in model.modules():
        if isinstance(getattr(m, "packed", None), torch.Tensor):  # oneDNN's: no storage pointer
            seen[id(m.packed)] = m.packed.numel() * m.packed.element_size()
        for t in vars(b).values() if (b := getattr(m, "blocks", None)) else ():
            if isinstance(t, torch.Tensor):
                seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


@needs_native
@pytest.mark.parametrize(("precision", "fp32_weights"), [("fast", None), ("fast", True), ("exact", None),
                                                         ("exact", False), ("exact", True)])
def test_no_mode_holds_a_float32_copy_of_a_files_blocks(files, precision: str, fp32_weights: bool | None) -> None:
    """Both precisions read the file's blocks (QuantWeights over the map); ``fp32_weights``
    no longer copies them."""
    config, weights = load(files["Q4_1"], blocks=True)
    stored = {n: w.nbytes if isinstance(w, QuantWeight) else w.numel() * 4 for n, w in weights.items()}
    model = build_model(config, weights, EngineConfig(device="cpu", precision=precision, fp32_weights=fp32_weights))
    assert not weights  # all taken by the model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * SPEC.num_layers + 1 and all(m.quant is not None for m in linears)
    assert not any(m.holds_dense or m.blocks is not None for m in linears)
    assert model.embed.weight is None and model.embed.quant is not None
    held = sum(m.quant.nbytes for m in linears) + model.embed.quant.nbytes * (not SPEC.tie_word_embeddings)
    held += sum(t.numel() * t.element_size() for t in model.parameters())  # the float32 norms
    assert held == sum(stored.values())  # the file's blocks (fused as segments) and the norms, nothing else


@needs_native
def test_blocks_only_model_answers_like_the_dense_one(files) -> None:
    """Greedy tokens of the block-held model (block matmul at every row count) equal the
    float32 model's over a prefill of more rows than the small-batch kernel takes."""
    outs = []
    for blocks, fp32 in ((True, False), (False, False)):
        config, weights = load(files["Q4_1"], blocks=blocks)
        engine_config = EngineConfig(device="cpu", cache=CacheConfig(block_size=4, num_blocks=64), fp32_weights=fp32)
        model = build_model(config, weights, engine_config, max_positions=config.max_position_embeddings)
        engine = Engine(model, load_tokenizer(resolve_model_ref(files["Q4_1"])), engine_config, model_name="tiny")
        (out,) = engine.generate([list(range(3, 43))], SamplingParams(max_tokens=12, temperature=0))
        outs.append(list(out.token_ids))
    assert outs[0] == outs[1]


@needs_native
@pytest.mark.parametrize("rows", [1, 12, 13, 40])
def test_linear_from_blocks_reads_them_for_any_row_count(rows: int) -> None:
    dense = load_weights_q41()
    blocks = recover_blocks(dense)
    layer = Linear.from_blocks(blocks, None, keep_fp32=False, kernels=KernelSet(NATIVE))
    assert not layer.holds_dense
    x = torch.randn(rows, dense.shape[1], generator=torch.Generator().manual_seed(rows))
    want = (x.double() @ dense.double().T).float()
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)  # float32 sums of 576


def load_weights_q41() -> torch.Tensor:
    return open_gguf(resolve_model_ref(None).path).tensor("blk.0.attn_q.weight")


def test_embedding_from_blocks_equals_the_dense_lookup() -> None:
    f = open_gguf(resolve_model_ref(None).path)
    held = f.blocks("token_embd.weight")
    ids = torch.tensor([0, 5, 49151, 5, 1234])
    want = F.embedding(ids, held.dequantize())
    assert torch.equal(TokenEmbedding(held)(ids), want)


def test_cat_rows_of_blocks_is_the_blocks_of_the_cat() -> None:
    g = torch.Generator().manual_seed(0)

    def blocks(n: int) -> BlockWeight:
        qs = torch.randint(0, 256, (n, 2, 16), generator=g, dtype=torch.uint8)
        return BlockWeight(4, qs, torch.rand(n, 2, generator=g), torch.randn(n, 2, generator=g))

    parts = [blocks(8), blocks(4), blocks(4)]
    fused = cat_rows(parts)
    assert isinstance(fused, BlockWeight) and fused.shape == (16, 64)
    assert torch.equal(fused.dequantize(), torch.cat([b.dequantize() for b in parts]))
    dense = torch.randn(4, 64, generator=g)
    mixed = cat_rows([parts[0], dense])  # blocks and a dense part: dense
    assert isinstance(mixed, torch.Tensor) and torch.equal(mixed[:8], parts[0].dequantize())
    assert torch.equal(mixed[8:], dense)


# -- the KV cache sized by tokens ---------------------------------------------------------------
def test_kv_tokens_round_up_to_whole_blocks() -> None:
    assert CacheConfig(kv_tokens=2048).counted_blocks == 128
    assert CacheConfig(kv_tokens=2049).counted_blocks == 129
    assert CacheConfig(kv_tokens=5, block_size=4).counted_blocks == 2
    assert CacheConfig(num_blocks=7).counted_blocks == 7
    assert CacheConfig().counted_blocks is None  # memory_bytes sizes it
    with pytest.raises(ValueError, match="not both"):
        CacheConfig(num_blocks=8, kv_tokens=64)
    with pytest.raises(ValueError, match="kv_tokens must be positive"):
        CacheConfig(kv_tokens=0)


def test_engine_pool_has_the_asked_tokens() -> None:
    config = EngineConfig(device="cpu", cache=CacheConfig(block_size=4, kv_tokens=50, memory_bytes=1 << 30))
    model = build_model(TINY, dict(tiny_engine_weights()), config, max_positions=TINY.max_position_embeddings)
    engine = Engine(model, ByteTokenizer(), config, model_name="tiny")
    assert engine.pool.num_blocks == 13  # ceil(50 / 4): the byte budget does not apply
    assert engine.runner.kv_caches[0][0].k.shape[0] == 14  # and the one scratch block
    assert engine.max_model_len == 52


def test_serve_refuses_both_kv_sizes() -> None:
    from tests.cli.test_server_cli import assert_one_line_error, serve

    assert_one_line_error(serve("--kv-memory", "1GiB", "--kv-tokens", "2048", "--port", "0"),
                          "--kv-memory and --kv-tokens")
    assert_one_line_error(serve("--kv-tokens", "0", "--port", "0"), "kv_tokens must be positive")


# -- loading without peaks ---------------------------------------------------------------------
_PEAK_SCRIPT = """
import json, resource, sys
import torch
from bargein.loader import load_config, load_weights, resolve_model_ref
source = resolve_model_ref(sys.argv[1]); config = load_config(source)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weights = load_weights(source, config, progress=False, blocks=True)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
held = sum(w.nbytes if hasattr(w, "segments") else w.numel() * w.element_size() for w in weights.values())
dense = sum(w.shape[0] * w.shape[1] * 4 if hasattr(w, "segments") else w.numel() * 4 for w in weights.values())
print(json.dumps({"grown": grown * 1024, "held": held, "dense": dense}))
"""


def test_loader_peak_is_the_blocks_not_float32(tmp_path: Path) -> None:
    """A model of ~20 MB in float32 loads with a peak near its ~5 MB of blocks (mapped: the
    pages are read only when a forward touches them)."""
    spec = TinySpec(num_layers=4, hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=4)
    path = write_gguf(tmp_path / "mid.Q4_1.gguf", spec, tiny_weights(spec), tensor_type="Q4_1")
    result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(path)], capture_output=True, text=True,
                            timeout=120, check=True)
    m = json.loads(result.stdout)
    assert m["dense"] > 3.5 * m["held"]
    # The blocks, plus one tensor in flight and allocator slack; the float32 model would not fit.
    assert m["grown"] < m["held"] + 4 * 2**20, m
    assert m["grown"] < m["dense"] / 2, m


def test_ggml_type_table_matches_the_gguf_package() -> None:
    from bargein.kernels.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType

    for qtype in GGMLQuantizationType:
        theirs = gguf.GGMLQuantizationType[qtype.name]
        assert theirs.value == qtype.value
        assert gguf.GGML_QUANT_SIZES[theirs] == GGML_QUANT_SIZES[qtype]


def test_large_zero_buffers_are_zero_and_resident_only_as_written() -> None:
    from bargein.model import zeroed

    def resident_mb() -> float:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20

    before = resident_mb()
    cache = zeroed.zeros((1024, 16, 16, 64), torch.float32, "cpu")  # 64 MiB
    assert cache.shape == (1024, 16, 16, 64) and cache.is_contiguous()
    assert resident_mb() - before < 16  # mapped, not yet resident
    assert not cache.any()  # reading maps the shared zero page: still zero, still not resident
    cache[:512] = 1.0
    assert resident_mb() - before > 28  # half written: half resident
    assert int(cache.sum()) == 512 * 16 * 16 * 64
    small = zeroed.zeros((4, 4), torch.float32, "cpu")
    assert not small.any()
